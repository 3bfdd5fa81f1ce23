"""The shard directory: what ``preprocessing.shard``/``merge`` write and the data loader reads.

    SHARD_DIR/manifest.json                 written last: a directory without it is unfinished
    SHARD_DIR/SPLIT/shard-00000.{bin,idx}   megatron-core IndexedDataset files (SPLIT: train, valid, ...)
    SHARD_DIR/progress.json                 only while a run is unfinished: its resume checkpoint

``manifest.json``, ``format_version`` 1 (bump it with any change readers rely on)::

    {"format_version": 1, "dtype": "uint16" | "int32",
     "tokenizer": {"dir", "sha256", "vocab_size", "special_ids": {"pad", "cls", "sep", ...}, ...},
     "splits": {SPLIT: {"documents", "sequences", "tokens", "shards": [
         {"prefix": "SPLIT/shard-00000", "dtype", "documents", "sequences", "tokens",
          "bytes": {"bin", "idx"}, "sha256": {"bin", "idx"}}, ...]}},
     ...}   plus preprocessing's own records (sources, settings, skips, fingerprint), unread here

``read_manifest`` is the one reader and checker, ``write_manifest`` the one writer (it checks the same
fields); both raise ``ShardManifestError`` naming the file, the field and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from convbert_ds import objstore
from convbert_ds.errors import UserError
from convbert_ds.fsutil import file_sha256, read_json, write_json_atomically

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 1
SHARD_FILES = ("bin", "idx")
COUNTS = ("documents", "sequences", "tokens")
REQUIRED_SPECIAL_IDS = ("pad", "cls", "sep")
_RERUN = "re-run python -m preprocessing.shard"


class ShardManifestError(UserError, ValueError):
    """A shard directory that is missing, unfinished, damaged or of another format version."""


class MissingShardFileError(ShardManifestError, FileNotFoundError):
    """The manifest or a file it lists is not there (also a ``FileNotFoundError``)."""


def shard_prefix(split: str, index: int) -> str:
    """A shard's prefix relative to the shard directory, as the manifest lists it."""
    return f"{split}/shard-{index:05d}"


def split_entry(shards: list[dict]) -> dict:
    """A split's manifest entry: its shards and their summed counts."""
    return {**{key: sum(s[key] for s in shards) for key in COUNTS}, "shards": shards}


def _field(obj, name: str, where: str, path: Path | str):
    if not isinstance(obj, dict) or name not in obj:
        raise ShardManifestError(f"{path}: missing field {where}{name}; {_RERUN}")
    return obj[name]


def check_fields(manifest: dict, path: Path | str) -> None:
    """Check the fields readers rely on (not the files); ``path`` names the manifest in errors."""
    version = _field(manifest, "format_version", "", path)
    if version != FORMAT_VERSION:
        raise ShardManifestError(f"{path}: format_version {version!r} is not supported (expected "
                                 f"{FORMAT_VERSION}); re-shard with this version of preprocessing")
    tokenizer = _field(manifest, "tokenizer", "", path)
    _field(tokenizer, "vocab_size", "tokenizer.", path)
    for name in REQUIRED_SPECIAL_IDS:
        _field(_field(tokenizer, "special_ids", "tokenizer.", path), name, "tokenizer.special_ids.", path)
    for split, entry in _field(manifest, "splits", "", path).items():
        for i, shard in enumerate(_field(entry, "shards", f"splits.{split}.", path)):
            where = f"splits.{split}.shards[{i}]."
            for name in ("prefix", "dtype", *COUNTS):
                _field(shard, name, where, path)
            for name in ("bytes", "sha256"):
                for ext in SHARD_FILES:
                    _field(_field(shard, name, where, path), ext, f"{where}{name}.", path)


def read_manifest(shard_dir: str | os.PathLike, verify: bool = True) -> dict:
    """Load ``SHARD_DIR/manifest.json``, check its fields and that every listed file is whole.

    Sizes are always checked; ``verify`` also compares every file's sha256 (reads all the data).
    """
    root = Path(shard_dir)
    path = root / MANIFEST
    if not path.is_file():
        hint = " (an interrupted run is there: rerun it to resume)" if (root / PROGRESS).is_file() else ""
        raise MissingShardFileError(f"{path} not found{hint}: shard directories (e.g. data.sets paths) are "
                                    f"written by `python -m preprocessing.shard --out DIR`")
    manifest = read_json(path, ShardManifestError, _RERUN)
    check_fields(manifest, path)
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            for ext in SHARD_FILES:
                check_shard_file(root / f"{shard['prefix']}.{ext}", shard, ext, path, verify)
    return manifest


def read_store_manifest(url: str) -> tuple[bytes, dict]:
    """The manifest of a shard directory in an object store (``s3://BUCKET/PREFIX``): its bytes and its checked
    fields (the files are not looked at: a reader checks those it uses)."""
    name = str(objstore.Url.parse(url).join(MANIFEST))
    try:
        raw = objstore.read_bytes(name)
    except objstore.StoreNotFound:
        raise MissingShardFileError(f"{name} not found in the store at {objstore.endpoint()}: shard directories "
                                    f"are uploaded by `python -m preprocessing.shard --out s3://...`") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ShardManifestError(f"{name}: not JSON ({e}); {_RERUN}") from None
    check_fields(manifest, name)
    return raw, manifest


def check_shard_file(file: Path, shard: dict, ext: str, listed_in: Path, verify: bool = True) -> None:
    """Check one file of a shard entry: it exists with the listed size and, with ``verify``, sha256."""
    if not file.is_file():
        raise MissingShardFileError(f"{file} not found (listed in {listed_in}); copy the whole shard "
                                    f"directory or {_RERUN}")
    size, listed = file.stat().st_size, shard["bytes"][ext]
    by_tokens = shard["tokens"] * np.dtype(shard["dtype"]).itemsize if ext == "bin" else listed
    if size != listed or size != by_tokens:
        detail = f" ({shard['tokens']} {shard['dtype']} tokens: {by_tokens} bytes)" if ext == "bin" else ""
        raise ShardManifestError(f"{file}: {size} bytes but {listed_in} says {listed}{detail}; the shard "
                                 f"directory is incomplete or was changed, {_RERUN}")
    if verify and file_sha256(file) != shard["sha256"][ext]:
        raise ShardManifestError(f"{file}: sha256 differs from {listed_in} (corrupted or replaced); {_RERUN}")


def write_manifest(shard_dir: str | os.PathLike, manifest: dict) -> dict:
    """Write ``SHARD_DIR/manifest.json`` (atomically, after its shards); return the manifest."""
    path = Path(shard_dir) / MANIFEST
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    check_fields(manifest, path)
    write_json_atomically(path, manifest, indent=1)
    return manifest
