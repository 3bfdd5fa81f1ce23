"""A split of a shard directory (format: ``convbert_ds.formats.shard_manifest``) as the data loader sees it.

Everything is checked before any index is built, so a bad directory fails at start-up with one line naming
the path and the fix (megatron's own dataset builder hangs on an empty split; this never gets that far).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convbert_ds import objstore
from convbert_ds.config import ConfigError
from convbert_ds.data.remote_shards import DEFAULT_LIMIT_GB, RemoteBin, StoreCache, mirror, open_bin
from convbert_ds.formats.shard_manifest import (MANIFEST, SHARD_FILES, ShardManifestError, check_shard_file,
                                                read_manifest)
from convbert_ds.fsutil import write_json_atomically


@dataclass(frozen=True)
class Shard:
    prefix: Path  # absolute; ``prefix.bin`` / ``prefix.idx``
    name: str  # prefix relative to the shard directory, as in the manifest
    dtype: np.dtype
    documents: int
    sequences: int
    tokens: int
    sha256: dict
    remote: RemoteBin | None = None  # a .bin in an object store (its .idx is in the local mirror)

    @property
    def bin_path(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".bin")

    @property
    def idx_path(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".idx")

    def identity(self) -> list:
        """What names this shard's content in cache keys: its hashes (the manifest always lists them)."""
        return [self.name, self.sha256["bin"], self.sha256["idx"]]


@dataclass(frozen=True)
class ShardSplit:
    """One split ("train", "valid", ...) of one shard directory."""

    shard_dir: Path  # for a store URL, the local mirror of its manifest and index files (remote_shards.py)
    split: str
    shards: tuple[Shard, ...]
    tokenizer: dict
    special_ids: dict
    vocab_size: int
    origin: str = ""  # as data.sets names it: the directory or the store URL


def open_manifest(shard_dir: str | os.PathLike, cache: StoreCache, splits: tuple[str, ...] | None = None
                  ) -> tuple[Path, dict, str]:
    """A shard directory's local root (for a store URL: the mirror), its checked manifest, and the manifest's
    name for messages; local files of every split are checked by size, a store's index files of ``splits``."""
    if objstore.is_url(shard_dir):
        root, manifest = mirror(str(shard_dir), cache, splits)
        return root, manifest, str(objstore.Url.parse(str(shard_dir)).join(MANIFEST))
    root = Path(shard_dir).resolve()
    return root, read_manifest(root, verify=False), str(root / MANIFEST)


def open_split(shard_dir: str | os.PathLike, split: str, cache_dir: str | os.PathLike | None = None,
               cache_limit_gb: float = DEFAULT_LIMIT_GB) -> ShardSplit:
    """Read and check ``shard_dir/manifest.json`` for ``split``; every shard file must exist, whole.
    ``shard_dir`` may be a store URL (``s3://BUCKET/PREFIX``): its files are cached under ``cache_dir``."""
    cache = StoreCache.at(cache_dir, cache_limit_gb)
    url = str(shard_dir) if objstore.is_url(shard_dir) else None
    root, manifest, manifest_path = open_manifest(shard_dir, cache, (split,))
    origin = url or str(root)
    if split not in manifest["splits"]:
        raise ShardManifestError(f"{manifest_path}: no split {split!r} (has {sorted(manifest['splits'])}); "
                                 f"shard the corpus with a {split!r} split")
    shards = tuple(Shard(prefix=root / e["prefix"], name=e["prefix"], dtype=np.dtype(e["dtype"]),
                         documents=int(e["documents"]), sequences=int(e["sequences"]), tokens=int(e["tokens"]),
                         sha256=dict(e["sha256"]), remote=open_bin(url, e, cache) if url else None)
                   for e in manifest["splits"][split]["shards"])
    if sum(s.documents for s in shards) == 0 or sum(s.tokens for s in shards) == 0:
        raise ShardManifestError(f"{manifest_path}: split {split!r} has no documents; shard a corpus that "
                                 f"gives it some, or drop {origin} from data.sets")
    tokenizer = manifest["tokenizer"]
    return ShardSplit(root, split, shards, tokenizer, dict(tokenizer["special_ids"]), int(tokenizer["vocab_size"]),
                      origin=origin)


def check_same_tokenizer(splits: list[ShardSplit]) -> None:
    """All sets of a blend must have been tokenized alike; else name the first pair that differ."""
    first = splits[0]
    for other in splits[1:]:
        a = (first.tokenizer.get("sha256"), first.vocab_size, first.special_ids)
        b = (other.tokenizer.get("sha256"), other.vocab_size, other.special_ids)
        if a != b:
            raise ConfigError(
                f"data.sets {first.origin} and {other.origin} use different tokenizers "
                f"(sha256 {a[0]} vs {b[0]}, vocab_size {a[1]} vs {b[1]}); shard every set with "
                f"the same tokenizer dir")


CACHE_SUBDIR = "index_cache"  # sample indexes (packing) and the checksum stamp, unless data.cache_dir is set
VERIFIED_STAMP = "verified.json"


def verify_checksums(shard_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                     trust_stamp: bool = True, cache_limit_gb: float = DEFAULT_LIMIT_GB, record: bool = True) -> int:
    """Compare every shard file of ``shard_dir`` with the sha256 its manifest lists; returns the bytes hashed.

    A bit flip keeps a file's size, and a flipped token id or index entry would surface hours later as a
    crash or, worse, as silently different data. Hashing reads every byte, so a file is hashed once: its
    size, mtime and expected sha256 go to a stamp beside the sample indexes (``SHARD_DIR/index_cache/``
    ``VERIFIED_STAMP``, or one per shard dir in ``cache_dir``), and a later start hashes only files changed
    since. A stamp that cannot be written (a read-only directory) costs a re-hash next time, nothing else.
    The stamp trusts a file whose size and mtime are unchanged; ``trust_stamp=False`` (``data.verify:
    always``) hashes every file anyway, for storage that may rot bits in place. In a store (a URL), a
    ``.bin`` is streamed through the hash and its stamp holds the object's ETag in place of the mtime.
    ``record=False`` reads the stamp but writes none (``--check-config``, which changes nothing).
    """
    url = str(shard_dir) if objstore.is_url(shard_dir) else None
    cache = StoreCache.at(cache_dir, cache_limit_gb)
    root, manifest, manifest_path = open_manifest(shard_dir, cache)
    # Several sets may share data.cache_dir, and their shard files have the same relative names.
    stamp_path = root / CACHE_SUBDIR / VERIFIED_STAMP if cache_dir is None else \
        Path(cache_dir) / f"verified-{hashlib.sha256((url or str(root)).encode()).hexdigest()[:16]}.json"
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamp = {}
    hashed, changed = 0, False
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            for ext in SHARD_FILES:
                key, expected = f"{shard['prefix']}.{ext}", shard["sha256"][ext]
                if url and ext == "bin":
                    remote = open_bin(url, shard, cache)
                    size, seen = shard["bytes"][ext], [shard["bytes"][ext], remote.etag, expected]
                else:
                    file = root / key
                    stat = file.stat()
                    size, seen = stat.st_size, [stat.st_size, stat.st_mtime_ns, expected]
                if trust_stamp and stamp.get(key) == seen:
                    continue
                if url and ext == "bin":
                    if objstore.sha256(remote.url, remote.etag) != expected:
                        raise ShardManifestError(f"{remote.url}: sha256 differs from {manifest_path} (corrupted or "
                                                 f"replaced); upload the shard directory again")
                else:
                    check_shard_file(file, shard, ext, manifest_path, verify=True)
                hashed += size
                stamp[key], changed = seen, True
    if changed and record:
        with contextlib.suppress(OSError):
            stamp_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(stamp_path, stamp, indent=1)
    return hashed
