"""Samples holding several documents (``data.pack_documents``): the stream cut into full samples, every token
once, the index built in blocks, loaders that resume exactly, and the real-token fraction reported."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from convbert_ds.data.cross_document import CrossDocumentDataset
from convbert_ds.data.loader import build_dataloader
from convbert_ds.data.packing import PackedDataset
from convbert_ds.formats.sample_packing import SAMPLE_DTYPE, sample_starts
from preprocessing import inspect


@pytest.mark.parametrize("seq_len", [64, 512])
def test_samples_are_the_stream_of_framed_documents_cut_every_seq_len(tiny_corpus, seq_len):
    chunks = PackedDataset(tiny_corpus["shards"], "train", seq_len, progress=False)
    packed = CrossDocumentDataset(tiny_corpus["shards"], "train", seq_len, progress=False)
    stream = np.concatenate([chunks.framed(i)[0] for i in range(len(chunks))])
    types = np.concatenate([chunks.framed(i)[1] for i in range(len(chunks))])
    assert len(packed) == -(-len(stream) // seq_len)
    samples = [packed[i] for i in range(len(packed))]
    real = [s["attention_mask"].bool() for s in samples]
    assert all(r.all() for r in real[:-1]), "every sample but the last is full"
    np.testing.assert_array_equal(torch.cat([s["input_ids"][r] for s, r in zip(samples, real)]).numpy(), stream)
    np.testing.assert_array_equal(torch.cat([s["token_type_ids"][r] for s, r in zip(samples, real)]).numpy(), types)
    for sample in samples:  # documents numbered 1, 2, ... in order, padding 0, each piece contiguous
        ids = sample["document_ids"]
        pieces = torch.unique_consecutive(ids[ids > 0])
        assert pieces.tolist() == list(range(1, len(pieces) + 1))
    assert packed.real_token_fraction() >= 0.95 > chunks.real_token_fraction()


def test_index_does_not_depend_on_the_build_blocks():
    gen = np.random.default_rng(0)
    chunks = np.zeros(1000, dtype=SAMPLE_DTYPE)
    chunks["len_a"], chunks["len_b"] = gen.integers(1, 60, 1000), gen.integers(0, 60, 1000)
    whole = np.concatenate(list(sample_starts(chunks, 128)))
    blocked = np.concatenate(list(sample_starts(chunks, 128, block=7)))
    np.testing.assert_array_equal(whole, blocked)
    framed = chunks["len_a"].astype(np.int64) + chunks["len_b"] + 3
    starts = np.concatenate([[0], np.cumsum(framed)[:-1]])[whole["chunk"]] + whole["skip"]
    np.testing.assert_array_equal(starts, np.arange(len(whole)) * 128)


def test_loader_batches_carry_documents_and_resume_exactly(tiny_corpus):
    def loader(consumed: int):
        return build_dataloader([{"path": tiny_corpus["shards"]}], "train", seq_len=64, micro_batch_size=4,
                                consumed_samples=consumed, progress=False, pack_documents=True)

    first = iter(loader(0))
    for _ in range(3):
        next(first)
    expected = next(first)
    resumed = next(iter(loader(12)))
    assert set(expected) == {"input_ids", "token_type_ids", "attention_mask", "document_ids"}
    for key in expected:
        assert torch.equal(expected[key], resumed[key]), key


def test_inspect_prints_the_real_token_fraction(tiny_corpus, capsys):
    inspect.main([str(tiny_corpus["shards"]), "--seq-len", "128", "512", "--documents", "0"])
    out = capsys.readouterr().out
    found = re.findall(r"real tokens: ([\d.]+)% of (\d+) x ([\d,]+) samples, documents packed together", out)
    assert [length for _, length, _ in found] == ["128", "512", "128", "512"]  # train, then valid
    train_128 = CrossDocumentDataset(tiny_corpus["shards"], "train", 128, progress=False)
    assert found[0][2].replace(",", "") == str(len(train_128))
    assert all(float(percent) >= 95 for percent, _, _ in found[:2])
