"""Corpus preprocessing: text → sentencepiece tokenizer → megatron-core token shards.

Command line (each a thin wrapper over the Python function named beside it)::

    python -m preprocessing.tokenizer --input GLOB... --out TOKENIZER_DIR   # tokenizer.train_tokenizer
    python -m preprocessing.shard --input GLOB... --tokenizer DIR --out DIR  # shard.shard_corpus
    python -m preprocessing.merge SLICE_DIR... --out DIR                     # merge.merge_slices
    python -m preprocessing.inspect SHARD_DIR_OR_PREFIX                      # inspect.main

Modules are imported lazily on purpose: worker processes import only
``sources``/``documents``/``encode`` (numpy + the tokenizer library), never torch.
"""
