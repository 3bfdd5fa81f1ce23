"""Packing real text into [CLS] A [SEP] B [SEP] samples: layout, no token lost, no document crossed."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from shard_factory import SPECIAL_IDS, corpus, write_shard_dir

from convbert_ds.data.packing import PackedDataset, pack_documents

CLS, SEP, PAD = SPECIAL_IDS["cls"], SPECIAL_IDS["sep"], SPECIAL_IDS["pad"]


def _edge_case_documents():
    """Documents the standard library does not supply: empty ones, empty and one-token sentences."""
    return [(), ((7,),), ((), (8, 9, 10), ()), ((11,) * 50, (12,), (13,) * 3)]


@pytest.fixture(scope="module")
def documents():
    docs = list(corpus()[:250])
    return docs[:100] + _edge_case_documents() + docs[100:]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, documents):
    return write_shard_dir(tmp_path_factory.mktemp("packing") / "set", {"train": documents}, num_shards=3)


def check_samples(samples, sentence_lengths, doc_bounds, seq_len):
    """Check packed samples against the corpus layout; ``samples`` yields (len_a, len_b) in order.

    Returns the token offsets where each sample starts in the corpus stream.
    """
    budget = seq_len - 3
    sentence_ends = np.cumsum(sentence_lengths)
    sentence_starts = sentence_ends - sentence_lengths
    boundaries = np.unique(np.concatenate([[0], sentence_ends]))
    doc_token_bounds = np.concatenate([[0], sentence_ends])[doc_bounds]
    total = int(sentence_ends[-1])
    starts, pos = [], 0
    for len_a, len_b in samples:
        n = len_a + len_b
        assert 1 <= n <= budget and len_a >= 1
        assert len_b >= 1 or n == 1
        end = pos + n
        doc = np.searchsorted(doc_token_bounds, pos, side="right") - 1
        assert end <= doc_token_bounds[doc + 1], "sample crosses a document boundary"
        inner = boundaries[(boundaries > pos) & (boundaries < end)]
        if len(inner):
            assert pos + len_a in inner, "A/B split is not at a sentence boundary"
        else:  # a sentence or a piece of one: cut pieces sit at multiples of budget from its start
            s = np.searchsorted(sentence_starts, pos, side="right") - 1
            while sentence_lengths[s] == 0:
                s -= 1
            assert (pos - sentence_starts[s]) % budget == 0
        if end < doc_token_bounds[doc + 1]:  # greedy: the next sentence or piece did not fit
            next_unit = min(budget, boundaries[boundaries > end][0] - end)
            assert n + next_unit > budget, "chunk closed before the budget was used"
        starts.append(pos)
        pos = end
    assert pos == total, "tokens were lost or duplicated"
    return starts


def _layout(documents):
    sentence_lengths = np.array([len(s) for d in documents for s in d], dtype=np.int64)
    doc_bounds = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
    return sentence_lengths, doc_bounds


@pytest.mark.parametrize("seq_len", [8, 16, 64, 512])
def test_samples_rebuild_the_corpus_in_order(shard_dir, documents, seq_len):
    ds = PackedDataset(shard_dir, "train", seq_len=seq_len, seed=3, progress=False)
    stream = np.array([t for d in documents for s in d for t in s])
    pieces = []
    for i in range(len(ds)):
        item = ds[i]
        ids, types, mask = (item[k].numpy() for k in ("input_ids", "token_type_ids", "attention_mask"))
        assert all(x.dtype == np.int64 and x.shape == (seq_len,) for x in (ids, types, mask))
        n = int(mask.sum())
        assert mask[:n].all() and (ids[n:] == PAD).all() and (types[n:] == 0).all()
        seps = np.flatnonzero(ids[:n] == SEP)
        assert ids[0] == CLS and len(seps) == 2 and seps[1] == n - 1
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:n] == 1).all()
        a, b = ids[1:seps[0]], ids[seps[0] + 1:n - 1]
        pieces.append((a, b))
    starts = check_samples([(len(a), len(b)) for a, b in pieces], *_layout(documents), seq_len)
    for start, (a, b) in zip(starts, pieces):
        np.testing.assert_array_equal(np.concatenate([a, b]), stream[start:start + len(a) + len(b)])


def test_split_is_seeded_and_deterministic(shard_dir, tmp_path):
    base = PackedDataset(shard_dir, "train", seq_len=64, seed=3, progress=False)
    again = PackedDataset(shard_dir, "train", seq_len=64, seed=3, cache_dir=tmp_path / "a", progress=False)
    other = PackedDataset(shard_dir, "train", seq_len=64, seed=4, cache_dir=tmp_path / "b", progress=False)
    assert again.index_built and other.index_built
    np.testing.assert_array_equal(base.samples, again.samples)
    # The chunks depend only on the corpus; where A ends depends on the seed.
    for field in ("shard", "start"):
        np.testing.assert_array_equal(base.samples[field], other.samples[field])
    total = base.samples["len_a"] + base.samples["len_b"]
    np.testing.assert_array_equal(total, other.samples["len_a"] + other.samples["len_b"])
    assert (base.samples["len_a"] != other.samples["len_a"]).mean() > 0.2


def test_int32_shards_and_pickling(tmp_path, documents):
    shard_dir = write_shard_dir(tmp_path / "set", {"train": documents[:60]}, num_shards=1, dtype=np.int32)
    ds = PackedDataset(shard_dir, "train", seq_len=32, seed=0, progress=False)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 10_000  # memory maps are reopened, not copied
    for i in (0, len(ds) // 2, len(ds) - 1):
        for key, value in ds[i].items():
            assert (clone[i][key] == value).all()
    check_samples(ds.samples[["len_a", "len_b"]].tolist(), *_layout(documents[:60]), 32)


def test_pack_documents_on_random_layouts():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n_docs = int(rng.integers(1, 40))
        per_doc = rng.integers(0, 30, size=n_docs)
        lengths = rng.integers(0, 90, size=int(per_doc.sum())) * (rng.random(int(per_doc.sum())) > 0.05)
        if lengths.sum() == 0:
            continue
        doc_bounds = np.concatenate([[0], np.cumsum(per_doc)])
        seq_len = int(rng.choice([8, 11, 32, 128]))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 1000
        records = pack_documents(lengths, starts, doc_bounds, seq_len, seed=trial, shard=5)
        assert (records["shard"] == 5).all()
        token_starts = check_samples(records[["len_a", "len_b"]].tolist(), lengths, doc_bounds, seq_len)
        np.testing.assert_array_equal(records["start"], np.array(token_starts) + 1000)


def test_split_with_an_empty_shard(tmp_path, documents):
    docs = [d for d in documents[:5] if d][:2]
    shard_dir = write_shard_dir(tmp_path / "set", {"train": docs}, num_shards=3)  # shard 0 gets no document
    ds = PackedDataset(shard_dir, "train", seq_len=16, seed=0, progress=False)
    assert set(ds.samples["shard"].tolist()) == {1, 2}
    check_samples(ds.samples[["len_a", "len_b"]].tolist(), *_layout(docs), 16)
