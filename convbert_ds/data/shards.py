"""Reading a shard directory's manifest: which shard files make up a split, and their tokenizer.

``preprocessing.shard`` writes::

    SHARD_DIR/manifest.json
    SHARD_DIR/<split>/shard-00000.{bin,idx}   megatron-core IndexedDataset files

Everything here is checked before any index is built, so a bad directory fails
at start-up with one line naming the path and the fix (megatron's own dataset
builder hangs on an empty split; this never gets that far).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
MANIFEST_FORMAT_VERSION = 1
_REQUIRED_SPECIAL_IDS = ("pad", "cls", "sep")


@dataclass(frozen=True)
class Shard:
    prefix: Path  # absolute; ``prefix.bin`` / ``prefix.idx``
    name: str  # prefix relative to the shard directory, as in the manifest
    dtype: np.dtype
    documents: int
    sequences: int
    tokens: int
    sha256: dict

    @property
    def bin_path(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".bin")

    @property
    def idx_path(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".idx")

    def identity(self) -> list:
        """What names this shard's content in cache keys: its hashes, else size and mtime."""
        if self.sha256.get("bin") and self.sha256.get("idx"):
            return [self.name, self.sha256["bin"], self.sha256["idx"]]
        return [self.name] + [[p.stat().st_size, p.stat().st_mtime_ns] for p in (self.bin_path, self.idx_path)]


@dataclass(frozen=True)
class ShardSplit:
    """One split ("train", "valid", ...) of one shard directory."""

    shard_dir: Path
    split: str
    shards: tuple[Shard, ...]
    tokenizer: dict
    special_ids: dict
    vocab_size: int

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


def _field(obj: dict, name: str, where: str, manifest: Path):
    if not isinstance(obj, dict) or name not in obj:
        raise ValueError(f"{manifest}: missing field {where}{name}; re-run python -m preprocessing.shard")
    return obj[name]


def open_split(shard_dir: str | os.PathLike, split: str) -> ShardSplit:
    """Read and check ``shard_dir/manifest.json`` for ``split``; every shard file must exist."""
    shard_dir = Path(shard_dir).resolve()
    manifest_path = shard_dir / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} not found: data.sets paths must be directories written by "
                                f"`python -m preprocessing.shard --out DIR`")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{manifest_path}: not valid JSON ({e}); re-run python -m preprocessing.shard") from None
    version = _field(manifest, "format_version", "", manifest_path)
    if version != MANIFEST_FORMAT_VERSION:
        raise ValueError(f"{manifest_path}: format_version {version} is not supported (expected "
                         f"{MANIFEST_FORMAT_VERSION}); re-shard with this version of preprocessing")
    tokenizer = _field(manifest, "tokenizer", "", manifest_path)
    special_ids = _field(tokenizer, "special_ids", "tokenizer.", manifest_path)
    for name in _REQUIRED_SPECIAL_IDS:
        _field(special_ids, name, "tokenizer.special_ids.", manifest_path)
    vocab_size = int(_field(tokenizer, "vocab_size", "tokenizer.", manifest_path))
    splits = _field(manifest, "splits", "", manifest_path)
    if split not in splits:
        raise ValueError(f"{manifest_path}: no split {split!r} (has {sorted(splits)}); "
                         f"shard the corpus with a {split!r} split")
    entries = _field(splits[split], "shards", f"splits.{split}.", manifest_path)

    shards = []
    for i, entry in enumerate(entries):
        where = f"splits.{split}.shards[{i}]."
        name = _field(entry, "prefix", where, manifest_path)
        shard = Shard(prefix=shard_dir / name, name=name,
                      dtype=np.dtype(_field(entry, "dtype", where, manifest_path)),
                      documents=int(_field(entry, "documents", where, manifest_path)),
                      sequences=int(_field(entry, "sequences", where, manifest_path)),
                      tokens=int(_field(entry, "tokens", where, manifest_path)),
                      sha256=dict(entry.get("sha256") or {}))
        for path in (shard.bin_path, shard.idx_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found (listed in {manifest_path}); "
                                        f"copy the whole shard directory or re-run python -m preprocessing.shard")
        expected = shard.tokens * shard.dtype.itemsize
        if shard.bin_path.stat().st_size != expected:
            raise ValueError(f"{shard.bin_path}: {shard.bin_path.stat().st_size} bytes but {manifest_path} says "
                             f"{shard.tokens} {shard.dtype} tokens ({expected} bytes); the shard directory "
                             f"is incomplete or was changed, re-run python -m preprocessing.shard")
        shards.append(shard)

    result = ShardSplit(shard_dir, split, tuple(shards), tokenizer, dict(special_ids), vocab_size)
    if result.documents == 0 or result.tokens == 0:
        raise ValueError(f"{manifest_path}: split {split!r} has no documents; shard a corpus that "
                         f"gives it some, or drop {shard_dir} from data.sets")
    return result


def check_same_tokenizer(splits: list[ShardSplit]) -> None:
    """All sets of a blend must have been tokenized alike; else name the first pair that differ."""
    first = splits[0]
    for other in splits[1:]:
        a = (first.tokenizer.get("sha256"), first.vocab_size, first.special_ids)
        b = (other.tokenizer.get("sha256"), other.vocab_size, other.special_ids)
        if a != b:
            raise ValueError(
                f"data.sets {first.shard_dir} and {other.shard_dir} use different tokenizers "
                f"(sha256 {a[0]} vs {b[0]}, vocab_size {a[1]} vs {b[1]}); shard every set with "
                f"the same tokenizer dir")
