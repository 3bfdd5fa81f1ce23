"""Shard directories in an object store (``data.sets: [{path: s3://BUCKET/PREFIX}]``), read as local ones are.

The store holds the same files as a local shard directory (``convbert_ds.formats.shard_manifest``). A run
keeps, in the local cache (``data.cache_dir``, default ``~/.cache/convbert_ds``)::

    store/BUCKET/PREFIX/MANIFEST_SHA16/manifest.json      the manifest, as it is in the store
    store/BUCKET/PREFIX/MANIFEST_SHA16/SPLIT/*.idx        every index file, whole and checked against its sha256
    store/BUCKET/PREFIX/MANIFEST_SHA16/index_cache/       the sample indexes and the checksum stamp, as for local
    blocks/BIN_SHA256/00000042                            block 42 of a .bin (BLOCK_BYTES each, the last shorter)

Index files are small (about 12 bytes per sentence) and every rank needs all of them to pack, so they are
downloaded whole. A ``.bin`` is read by byte ranges, a block at a time, only the blocks that this rank's
samples touch: a block is fetched once per machine (ranks on one node and restarts share the files; each is
written under a temporary name and renamed) and the least recently used blocks are deleted whenever they
pass ``data.cache_limit_gb`` together. Every range request carries the ETag seen when the run opened the
shard (``If-Match``), so an object replaced mid-run ends the run with one line instead of mixing two
versions; blocks are named by the sha256 the manifest lists, so a new version never meets old blocks.

A full disk: the manifest and index files are needed on disk (readers map them), so the run stops with one
line naming their directory, the space free there and what is kept (each file already fetched, whole: every
write goes to a temporary name that is deleted when it fails; a rerun fetches the rest). A block is only a
cache: one that finds no room is served from memory (the few recent blocks a reader holds) and fetched again
when needed later, and the process says so once per cache directory, in one line.

Why not megatron-core's object-storage reader of the same format (``IndexedDataset(...,
object_storage_config=...)``): it downloads each index on global rank 0 only and expects the other ranks to
find it on a shared disk, which is what a cluster without one lacks; and it keeps one chunk in memory per
reader, with no disk cache to share between a node's ranks or across restarts, and no version check.
Its format reader still parses every index here. mosaicml-streaming has such a cache but reads its own
format, not megatron's ``.bin/.idx``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convbert_ds import objstore
from convbert_ds.disk_full import full_disk_says, is_disk_full, warn_once
from convbert_ds.formats.shard_manifest import MANIFEST, ShardManifestError, read_store_manifest
from convbert_ds.formats.train_config import DataSection
from convbert_ds.fsutil import write_bytes_atomically

BLOCK_BYTES = 4 << 20
DEFAULT_LIMIT_GB = DataSection.cache_limit_gb
_BLOCKS_IN_MEMORY = 4  # per shard and process: a sample's tokens and its neighbours'


@dataclass(frozen=True)
class StoreCache:
    """Where a machine keeps what it read from a store, and how many bytes of ``.bin`` blocks at most."""

    root: Path
    limit_bytes: int
    block_bytes: int = BLOCK_BYTES

    @classmethod
    def at(cls, cache_dir: str | os.PathLike | None, limit_gb: float = DEFAULT_LIMIT_GB) -> StoreCache:
        return cls(Path(cache_dir) if cache_dir else objstore.default_cache_dir(), int(limit_gb * 2**30))


@dataclass(frozen=True)
class RemoteBin:
    """A shard's ``.bin`` in the store, as this run first saw it."""

    url: str
    etag: str
    cache: StoreCache


def mirror(url: str, cache: StoreCache, splits: tuple[str, ...] | None = None) -> tuple[Path, dict]:
    """Fetch ``url``'s manifest and index files into the cache (those already there are kept); returns the
    local directory and the manifest. ``splits``: only their index files (default: all)."""
    raw, manifest = read_store_manifest(url)
    u = objstore.Url.parse(url)
    root = cache.root / "store" / u.bucket / u.key / hashlib.sha256(raw).hexdigest()[:16]
    with full_disk_says(root, f"the index files of {url} fetched so far are kept there, each whole, and the "
                              "rerun fetches the rest (data.cache_dir moves them)"):
        _mirror_into(root, u, raw, manifest, splits)
    return root, manifest


def _mirror_into(root: Path, u: objstore.Url, raw: bytes, manifest: dict, splits: tuple[str, ...] | None) -> None:
    if not (root / MANIFEST).is_file():
        root.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(root / MANIFEST, raw)
    for name, split in manifest["splits"].items():
        if splits is not None and name not in splits:
            continue
        for shard in split["shards"]:
            local = root / f"{shard['prefix']}.idx"
            if local.is_file() and local.stat().st_size == shard["bytes"]["idx"]:
                continue
            remote = str(u.join(f"{shard['prefix']}.idx"))
            data = objstore.read_bytes(remote)
            if hashlib.sha256(data).hexdigest() != shard["sha256"]["idx"]:
                raise ShardManifestError(f"{remote}: sha256 differs from {u.join(MANIFEST)} (corrupted or "
                                         f"replaced); re-run python -m preprocessing.shard")
            local.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomically(local, data)


def open_bin(url: str, shard: dict, cache: StoreCache) -> RemoteBin:
    """Check a ``.bin`` in the store against its manifest entry (by size) and note its version."""
    bin_url = str(objstore.Url.parse(url).join(f"{shard['prefix']}.bin"))
    size, etag = objstore.head(bin_url)
    listed = shard["bytes"]["bin"]
    if size != listed:
        raise ShardManifestError(f"{bin_url}: {size} bytes but {objstore.Url.parse(url).join(MANIFEST)} says "
                                 f"{listed}; the upload is incomplete or was changed, upload the shard directory again")
    return RemoteBin(bin_url, etag, cache)


class RemoteTokens:
    """A ``.bin`` in the store, sliced as the memory map of a local one is: ``tokens[a:b]`` is an array."""

    def __init__(self, remote: RemoteBin, dtype: np.dtype, nbytes: int, sha256: str):
        self.remote, self.dtype, self.nbytes = remote, np.dtype(dtype), nbytes
        self.dir = remote.cache.root / "blocks" / sha256
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        self.fetched_bytes = 0  # from the store by this object (not from the disk cache)

    def __len__(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __getitem__(self, items: slice) -> np.ndarray:
        start, stop, _ = items.indices(len(self))
        lo, hi = start * self.dtype.itemsize, max(stop, start) * self.dtype.itemsize
        size = self.remote.cache.block_bytes
        parts = []
        for block in range(lo // size, (hi - 1) // size + 1 if hi > lo else lo // size):
            data = self._block(block)
            parts.append(data[max(lo - block * size, 0):hi - block * size])
        return np.frombuffer(b"".join(parts), dtype=self.dtype)

    def _block(self, block: int) -> bytes:
        if block in self._recent:
            self._recent.move_to_end(block)
            return self._recent[block]
        path = self.dir / f"{block:08d}"
        size = self.remote.cache.block_bytes
        expected = min(size, self.nbytes - block * size)
        try:
            data = path.read_bytes()
            os.utime(path)  # recently used: eviction goes by modification time
        except FileNotFoundError:
            data = b""
        if len(data) != expected:  # absent, evicted meanwhile by another rank, or damaged
            data = objstore.read_range(self.remote.url, block * size, block * size + expected, self.remote.etag)
            self.fetched_bytes += len(data)
            self._keep_on_disk(path, data)
        self._recent[block] = data
        if len(self._recent) > _BLOCKS_IN_MEMORY:
            self._recent.popitem(last=False)
        return data

    def _keep_on_disk(self, path: Path, data: bytes) -> None:
        """Cache a fetched block for the other ranks and later starts; a full disk only costs a warning."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_bytes_atomically(path, data)
        except OSError as error:
            if not is_disk_full(error):
                raise
            warn_once(self.remote.cache.root / "blocks", "blocks of shards that find no room there are kept in "
                                                         "memory only and fetched again when needed")
            return
        evict(self.remote.cache, keep=path)


def evict(cache: StoreCache, keep: Path | None = None) -> int:
    """Delete the least recently used blocks until they fit ``cache.limit_bytes``; returns the bytes kept."""
    files = []
    for path in (cache.root / "blocks").glob("*/*"):
        with contextlib.suppress(FileNotFoundError):  # another rank may delete it meanwhile
            stat = path.stat()
            if ".tmp-" not in path.name:
                files.append((stat.st_mtime_ns, stat.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= cache.limit_bytes:
            break
        if path != keep:
            path.unlink(missing_ok=True)
            total -= size
    return total
