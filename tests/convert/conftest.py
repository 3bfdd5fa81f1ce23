"""Converter tests: checkpoints of real 2-rank runs -> transformers directories, checked by
transformers itself, and ``--from-hf`` back. Marked ``slow``."""
