"""Look inside token shards: counts, length histograms and a few decoded documents.

``python -m preprocessing.inspect SHARD_DIR`` (a directory with manifest.json, or ``s3://BUCKET/PREFIX``)
or ``python -m preprocessing.inspect SHARD_DIR/train/shard-00000`` (one shard,
by prefix or .bin/.idx path). Shards are opened with megatron-core's own
``IndexedDataset`` (in a store, with its object-storage reader); the tokenizer comes from the manifest
unless ``--tokenizer`` names one. ``--seq-len L [L ...]`` (default 128 512) prints, per split, how much of
the samples at each length would be real tokens rather than padding, with documents
packed into shared samples (``data.pack_documents: true``) and one per sample.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import numpy as np

from convbert_ds.cli import ArgumentParser, bounded
from convbert_ds.formats.sample_packing import MIN_SEQ_LEN, document_blocks, framed_lengths, pack_documents
from convbert_ds.formats.shard_manifest import MANIFEST, read_manifest, read_store_manifest
from convbert_ds.objstore import default_cache_dir, is_url
from preprocessing.errors import PreprocessingError, run_cli
from preprocessing.shard import summary_table
from preprocessing.tokenizer import load_tokenizer

STORE_CHUNK_BYTES = 4 << 20  # bytes per ranged read of a .bin in a store


def _indexed_dataset(prefix: str):
    with warnings.catch_warnings():
        # megatron-core warns at import about optional GPU libraries (Apex, TE); its import is slow (torch).
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset, ObjectStorageConfig

        if not is_url(prefix):
            return IndexedDataset(prefix)
        # One process reads a few documents: megatron's own reader of the format in a store fits (training
        # reads through convbert_ds/data/remote_shards.py, which says why it does not use it).
        return IndexedDataset(prefix, mmap=False, object_storage_config=ObjectStorageConfig(
            path_to_idx_cache=str(default_cache_dir() / "inspect"), bin_chunk_nbytes=STORE_CHUNK_BYTES))


def histogram(values: np.ndarray, width: int = 40) -> list[str]:
    """Power-of-two buckets of ``values`` as text bars."""
    if len(values) == 0:
        return ["  (empty)"]
    buckets = np.floor(np.log2(np.maximum(values, 1))).astype(int)
    counts = np.bincount(buckets)
    lines = []
    for b, count in enumerate(counts):
        if count:
            lo, hi = 2**b, 2 ** (b + 1) - 1
            label = f"{lo}" if lo == hi else f"{lo}-{hi}"
            bar = "#" * max(1, round(width * count / counts.max()))
            lines.append(f"  {label:>13}  {count:>10,}  {bar}")
    return lines


def real_token_lines(prefixes: list[str], seq_lens: list[int]) -> list[str]:
    """For each length: the fraction of sample positions holding real tokens, documents packed together
    and one piece of a document per sample (the rest is padding: compute spent on nothing)."""
    lines = []
    for seq_len in seq_lens:
        chunks = framed = 0
        for prefix in prefixes:
            ds = _indexed_dataset(prefix)
            docs, lengths = ds.document_indices, ds.sequence_lengths
            for d0, d1 in document_blocks(docs):
                lo, hi = int(docs[d0]), int(docs[d1])
                block = np.asarray(lengths[lo:hi], dtype=np.int64)
                # Token offsets and the A/B split do not change the counts: zeros and seed 0.
                records = pack_documents(block, np.zeros_like(block), np.asarray(docs[d0:d1 + 1]) - lo, seq_len,
                                         seed=0, shard=0)
                chunks, framed = chunks + len(records), framed + int(framed_lengths(records).sum())
        if not chunks:
            lines.append(f"  real tokens at {seq_len}: no samples")
            continue
        packed = -(-framed // seq_len)
        lines.append(f"  real tokens: {framed / (seq_len * packed):.1%} of {seq_len} x {packed:,} samples, documents "
                     f"packed together (data.pack_documents: true); {framed / (seq_len * chunks):.1%} of {seq_len} x "
                     f"{chunks:,} samples with one document each (false)")
    return lines


def _describe(prefixes: list[str], tokenizer, documents: int, seq_lens: list[int]) -> list[str]:
    seq_lengths, doc_tokens, shown = [], [], []
    for prefix in prefixes:
        ds = _indexed_dataset(prefix)
        lengths = ds.sequence_lengths.astype(np.int64)
        seq_lengths.append(lengths)
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        doc_tokens.append(np.diff(bounds[ds.document_indices]))
        for d in range(min(documents - len(shown), len(ds.document_indices) - 1)):
            seqs = range(ds.document_indices[d], ds.document_indices[d + 1])
            shown.append([tokenizer.decode(ds[i]) if tokenizer else " ".join(map(str, ds[i][:32])) for i in seqs])
    seq_lengths = np.concatenate(seq_lengths) if seq_lengths else np.zeros(0, np.int64)
    doc_tokens = np.concatenate(doc_tokens) if doc_tokens else np.zeros(0, np.int64)
    out = [f"  {len(prefixes)} shards, {len(doc_tokens):,} documents, {len(seq_lengths):,} sequences, "
           f"{int(seq_lengths.sum()):,} tokens"]
    if len(seq_lengths):
        out.append(f"  tokens per sequence: mean {seq_lengths.mean():.1f}, median {np.median(seq_lengths):.0f}, "
                   f"max {seq_lengths.max():,}; per document: mean {doc_tokens.mean():.1f}, "
                   f"max {doc_tokens.max():,}")
    out += real_token_lines(prefixes, seq_lens)
    out.append("  sequence length histogram (tokens):")
    out += histogram(seq_lengths)
    out.append("  document length histogram (tokens):")
    out += histogram(doc_tokens)
    for k, doc in enumerate(shown):
        out.append(f"  --- document {k} ({len(doc)} sequences) ---")
        out += [f"  | {line[:200]}" for line in doc]
    return out


def inspect_path(path: str, tokenizer_dir: str | None = None, documents: int = 3,
                 seq_lens: tuple[int, ...] = (128, 512)) -> str:
    if is_url(path):
        url = re.sub(r"(?<=[^/:])/+$", "", path)  # trailing slashes off, but not the scheme's ("s3://")
        manifest = read_store_manifest(url)[1]
        return _describe_directory(url, manifest, tokenizer_dir, documents, seq_lens)
    p = Path(path)
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
    if (p / MANIFEST).is_file():
        return _describe_directory(str(p), read_manifest(p, verify=False), tokenizer_dir, documents, seq_lens)
    if Path(f"{p}.idx").is_file() and Path(f"{p}.bin").is_file():
        if tokenizer_dir is None and (p.parent.parent / MANIFEST).is_file():
            tokenizer_dir = read_manifest(p.parent.parent, verify=False)["tokenizer"]["dir"]
        tokenizer = _tokenizer(tokenizer_dir) if tokenizer_dir else None
        return "\n".join([f"{p}:"] + _describe([str(p)], tokenizer, documents, list(seq_lens)))
    raise PreprocessingError(f"{path}: neither a shard directory (with manifest.json) nor a shard prefix "
                             "(with .bin and .idx)")


def _describe_directory(root: str, manifest: dict, tokenizer_dir: str | None, documents: int,
                        seq_lens: tuple[int, ...]) -> str:
    tokenizer = _tokenizer(tokenizer_dir or manifest["tokenizer"]["dir"])
    out = [f"{root}: tokenizer {manifest['tokenizer']['dir']} ({manifest['tokenizer']['kind']}, "
           f"vocab {manifest['tokenizer']['vocab_size']:,}, {manifest['dtype']})",
           summary_table(manifest)]
    for name, split in manifest["splits"].items():
        out.append(f"\n[{name}]")
        out += _describe([f"{root}/{s['prefix']}" for s in split["shards"]], tokenizer, documents, list(seq_lens))
    return "\n".join(out)


def _tokenizer(directory: str):
    try:
        return load_tokenizer(directory)
    except PreprocessingError as e:
        print(f"note: showing token ids, cannot load the tokenizer: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m preprocessing.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", metavar="PREFIX_OR_DIR", help="a shard directory (or s3://BUCKET/PREFIX), or one "
                        "shard's prefix/.bin/.idx")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir for decoding; none: the manifest's")
    parser.add_argument("--documents", type=bounded(int, min=0), default=3, help="decoded documents to show per split")
    parser.add_argument("--seq-len", type=bounded(int, min=MIN_SEQ_LEN), nargs="+", default=[128, 512], metavar="L",
                        help="sample lengths at which to report the real-token fraction (data.seq_len)")
    args = parser.parse_args(argv)
    print(inspect_path(args.path, args.tokenizer, args.documents, tuple(args.seq_len)))



if __name__ == "__main__":
    sys.exit(run_cli(main))
