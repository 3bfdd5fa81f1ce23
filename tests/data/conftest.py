"""Data tests: packing, sampling, blending and index caches, on shard dirs written by
``shard_factory.write_shard_dir`` (the one factory; real preprocessing output is ``tiny_corpus``)."""
