"""Join the shard directories of ``shard --slice i/N`` runs into one shard directory.

``python -m preprocessing.merge SLICE_DIR... --out SHARD_DIR [--copy]``

Each slice directory is verified against its manifest (sizes and sha256),
the slices must come from the same inputs, tokenizer and settings, and all N
must be present. Shards are hard-linked (copied across filesystems, or with
``--copy``) into ``SHARD_DIR/{train,valid}/shard-NNNNN`` in slice order, so the
merged splits hold the documents in the same order as a single run would.
Counts, skips and per-source document counts are summed; ``manifest.json`` is
written last. A non-empty ``SHARD_DIR`` is refused unless ``--force`` is given.

A merge that fails (a full disk: one line naming ``SHARD_DIR``, the space free
there and what is kept) deletes what it had placed in ``SHARD_DIR``, so the same
command runs again as it ran first; the slice directories are only read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from convbert_ds.cli import ArgumentParser
from convbert_ds.disk_full import full_disk_says
from convbert_ds.formats.shard_manifest import read_manifest, shard_prefix, split_entry, write_manifest
from convbert_ds.fsutil import FORCE_FLAG, refuse_non_empty
from preprocessing.encode import SPLITS
from preprocessing.errors import PreprocessingError, run_cli
from preprocessing.shard import REPAIRED, SKIPPED, clear_output, summary_table


def _same(manifests: list[tuple[Path, dict]], key, what: str) -> None:
    first_dir, first = manifests[0]
    for d, m in manifests[1:]:
        if key(m) != key(first):
            raise PreprocessingError(f"{d} and {first_dir} differ in {what}; they are not slices of one run")


def merge_slices(slice_dirs: list[str], out: str | os.PathLike, copy: bool = False,
                 overwrite: bool = False) -> dict:
    """Merge slice directories into ``out``; return the merged manifest. ``overwrite``: replace shards in ``out``."""
    root = Path(out)
    if any(Path(d).resolve() == root.resolve() for d in slice_dirs):
        raise PreprocessingError(f"--out {root} is one of the slice directories; choose a new directory")
    refuse_non_empty(root, overwrite, PreprocessingError)
    if not slice_dirs:
        raise PreprocessingError("no slice directories given")
    manifests = [(Path(d), read_manifest(d)) for d in slice_dirs]
    _same(manifests, lambda m: m["tokenizer"]["sha256"], "tokenizer")
    _same(manifests, lambda m: [(s["path"], s["bytes"]) for s in m["sources"]], "inputs")
    _same(manifests, lambda m: m["settings"], "settings")
    slices = [m["slice"] for _, m in manifests]
    if all(s is not None for s in slices):
        count = slices[0]["count"]
        indices = sorted(s["index"] for s in slices)
        if any(s["count"] != count for s in slices) or indices != list(range(count)):
            raise PreprocessingError(f"need each of the {count} slices exactly once, got slices "
                                     f"{', '.join(str(i) for i in indices)}")
        manifests.sort(key=lambda dm: dm[1]["slice"]["index"])
    elif any(s is not None for s in slices):
        raise PreprocessingError("mixing slice directories with whole-corpus shard directories")
    elif len(manifests) > 1:  # the same inputs, tokenizer and settings, each whole: every document twice
        raise PreprocessingError(f"{manifests[0][0]} and {manifests[1][0]} each hold the whole corpus (sharded "
                                 "without --slice), so merging them would repeat every document; merge joins the "
                                 "--slice i/N directories of one run (several corpora: list each in data.sets)")

    if root.is_dir():
        clear_output(root)  # only with overwrite: the manifest goes first, so a crash leaves no stale one
    with full_disk_says(root, "nothing of the merge is kept there (its partial output is deleted) and the slice "
                              "directories are untouched"):
        try:
            return _merge_into(root, manifests, copy)
        except BaseException:
            clear_output(root)  # a merge does not resume: its partial output would only make a rerun need --force
            raise


def _merge_into(root: Path, manifests: list[tuple[Path, dict]], copy: bool) -> dict:
    base = manifests[0][1]
    splits = {}
    for split in SPLITS:
        (root / split).mkdir(parents=True, exist_ok=True)
        shards = []
        for d, m in manifests:
            for shard in m["splits"][split]["shards"]:
                prefix = shard_prefix(split, len(shards))
                for ext in ("bin", "idx"):
                    _place(d / f"{shard['prefix']}.{ext}", root / f"{prefix}.{ext}", copy)
                shards.append({**shard, "prefix": prefix})
        splits[split] = split_entry(shards)

    sources = [{**s, "documents": sum(m["sources"][i]["documents"] for _, m in manifests)}
               for i, s in enumerate(base["sources"])]
    skipped = {k: sum(m["skipped"][k] for _, m in manifests) for k in SKIPPED}
    skipped["blank_files"] = sum(1 for s in sources if s["documents"] == 0)
    manifest = {
        "tokenizer": base["tokenizer"],
        "dtype": base["dtype"],
        "splits": splits,
        "documents_read": sum(m["documents_read"] for _, m in manifests),
        "skipped": skipped,
        "repaired": {k: sum(m["repaired"][k] for _, m in manifests) for k in REPAIRED},
        "sources": sources,
        "settings": base["settings"],
        "slice": None,
        "merged_from": [{"dir": str(d), "slice": m["slice"]} for d, m in manifests],
        "fingerprint": hashlib.sha256("".join(m["fingerprint"] for _, m in manifests).encode()).hexdigest(),
    }
    return write_manifest(root, manifest)


def _place(src: Path, dst: Path, copy: bool) -> None:
    """Hard-link (or copy) a shard file; no temporary name: until the manifest is written nothing counts."""
    if not copy:
        try:
            return os.link(src, dst)
        except OSError:
            pass
    shutil.copyfile(src, dst)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m preprocessing.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("slice_dirs", nargs="+", metavar="SLICE_DIR", help="the N shard --slice i/N directories")
    parser.add_argument("--out", required=True, help="shard directory to create")
    parser.add_argument("--copy", action="store_true", help="copy shards instead of hard-linking them")
    parser.add_argument(FORCE_FLAG, "--overwrite", dest="overwrite", action="store_true",
                        help="replace the shards of a non-empty --out")
    args = parser.parse_args(argv)
    manifest = merge_slices(args.slice_dirs, args.out, args.copy, args.overwrite)
    print(f"merged {len(args.slice_dirs)} slice directories into {args.out}")
    print(summary_table(manifest))


if __name__ == "__main__":
    sys.exit(run_cli(main))
