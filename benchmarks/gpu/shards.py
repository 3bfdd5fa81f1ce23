"""The GPU acceptance's training data: the built-in corpus (the standard library's docstrings), tokenized and
sharded once per run directory, at the vocabulary the rows are sized for."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def built_in_shards(work: Path, vocab_size: int) -> Path:
    """``work/shards`` (built on the first call): the corpus under a BPE tokenizer of ``vocab_size`` pieces.

    BPE, because a unigram model stops at the 9,310 pieces this corpus supports, and ConvBERT-base's FLOPs and
    time depend on its vocabulary (the generator's head, the embeddings): the rows run the paper's 30,522.
    """
    shards = work / "shards"
    if (shards / "manifest.json").is_file():
        return shards
    from convbert_ds.builtin.stdlib_docstrings import write_corpus
    from preprocessing.shard import shard_corpus
    from preprocessing.tokenizer import train_tokenizer

    corpus = write_corpus(work / "corpus.txt")
    tokenizer = train_tokenizer([str(corpus)], str(work / "tokenizer"), vocab_size=vocab_size, model_type="bpe")
    shard_corpus([str(corpus)], str(tokenizer), str(shards), workers=1)
    got = shards_vocab_size(shards)
    if got != vocab_size:  # the rows still run (a lease is too scarce to stop); the acceptance's header says so
        print(f"warning: the tokenizer of the built-in corpus has {got:,} pieces, not the {vocab_size:,} asked "
              f"for: the rows' model has {got:,}", file=sys.stderr)
    return shards


def shards_vocab_size(shards: Path) -> int:
    """The vocabulary the shards' tokenizer has (the size their model is built with), from their manifest."""
    return json.loads((shards / "manifest.json").read_text())["tokenizer"]["vocab_size"]
