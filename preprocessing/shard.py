"""Tokenize a corpus into megatron-core shards: parallel, bounded in memory, resumable.

``python -m preprocessing.shard --input GLOB... --tokenizer DIR --out SHARD_DIR [--workers N]`` writes
SHARD_DIR/manifest.json and SHARD_DIR/{train,valid}/shard-NNNNN.{bin,idx} (see ``convbert_ds.formats``).

How it runs: the parent reads the inputs as chunks of whole documents
(``sources``), workers tokenize them (``encode``), and the parent appends the
results, in input order, to the open shard of each split (``indexed``). A
shard closes at the first document boundary past ``shard_tokens``. Documents go
to ``valid`` by a keyed hash of their text, so the split is deterministic.

Because chunking, tokenization and the split are all deterministic, the output
does not depend on the number of workers or on interruptions. A checkpoint
(``progress.json``) is written whenever a shard closes and every
``checkpoint_every`` x ``block_bytes`` of input: the finished shards with their hashes, the open
shards' file sizes, the counters, and the input position. A rerun after a crash
verifies the finished shards, truncates the open ones to the checkpoint and
goes on from that input position; the manifest comes out identical to an
uninterrupted run's. Files only get their final names once complete, and
``manifest.json`` is written last.

A full disk (``--out``'s, or the staging directory's for ``s3://``) ends the run
with one line naming the directory, the space free there and what is kept: the
finished shards and the last checkpoint. What the failed write left half-done
has a temporary name, so no reader takes it as a shard, and the same command run
again with room truncates or deletes it and resumes from that checkpoint.

``--slice i/N`` processes the i-th of N byte spans of the inputs (a document
belongs to the span its start falls in); ``python -m preprocessing.merge``
joins the slice directories into one.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from convbert_ds.cli import ArgumentParser, bounded
from convbert_ds.disk_full import full_disk_says
from convbert_ds.objstore import is_url
from convbert_ds.formats.shard_manifest import (
    MANIFEST, PROGRESS, SHARD_FILES, ShardManifestError, check_shard_file, read_manifest, shard_prefix, split_entry,
    write_manifest)
from convbert_ds.fsutil import FORCE_FLAG, write_json_atomically
from preprocessing.documents import MAX_LINE_CHARS
from preprocessing.encode import SPLITS, EncodeOptions, EncoderPool, chunk_bytes, work_units
from preprocessing import store
from preprocessing.errors import PreprocessingError, run_cli
from preprocessing.indexed import ShardWriter, commit_shard
from preprocessing.sources import Source, iter_chunks, parse_slice, plan_slice, range_bytes, resolve_inputs
from preprocessing.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VALID_FRACTION = 0.01
SKIPPED = ("empty_documents", "empty_sequences", "blank_files")
REPAIRED = ("invalid_utf8_bytes", "long_lines_split", "long_documents_split")
# Called with the count of input chunks done after every progress checkpoint; None in a normal run. The
# crash/resume test sets it (tests/preprocessing/shard_killed_at.py) to die at a chosen point instead of
# racing a poll loop.
after_checkpoint: Callable[[int], None] | None = None
_SHARD_FILE_NAME = re.compile(r"shard-\d+\.(bin|idx|lens|docs)(\.tmp)?$")
_JSON_TMP_NAME = re.compile(r"\.?(manifest|progress)\.json\.tmp(-\d+)?")  # fsutil's (and older) temp names


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------
# the output directory while it is written


class _SplitWriter:
    """One split's shards while writing: the finished ones' records and the open one."""

    def __init__(self, root: Path, name: str, dtype: str, shard_tokens: int, saved: dict | None):
        self.root, self.name, self.dtype, self.shard_tokens = root, name, dtype, shard_tokens
        (root / name).mkdir(parents=True, exist_ok=True)
        self.finished: list[dict] = saved["finished"] if saved else []
        self.next_index: int = saved["next_index"] if saved else 0
        self.writer: ShardWriter | None = None
        if saved and saved["open"]:
            self.writer = ShardWriter(self._path(self.next_index), dtype, resume=saved["open"])

    def _path(self, index: int) -> Path:
        return self.root / shard_prefix(self.name, index)

    def add(self, part, skip: int, done: dict, close_shard) -> None:
        """Append ``part``'s documents from ``skip`` on; ``close_shard(self)`` when a shard fills up.

        ``done[split]`` tracks how many of the part's documents are written, for checkpoints.
        """
        docs = part.document_sequences
        n = len(docs)
        seq_starts = np.concatenate(([0], np.cumsum(docs)))
        tok_starts = np.concatenate(([0], np.cumsum(part.document_tokens)))
        d = skip
        while d < n:
            if self.writer is None:
                self.writer = ShardWriter(self._path(self.next_index), self.dtype)
            room = self.shard_tokens - self.writer.tokens
            # Take documents until the shard reaches shard_tokens (the last one may overshoot).
            end = min(int(np.searchsorted(tok_starts[d + 1:], tok_starts[d] + room, side="left")) + d + 1, n)
            self.writer.add(part.tokens[tok_starts[d]:tok_starts[end]],
                            part.sequence_lengths[seq_starts[d]:seq_starts[end]], docs[d:end])
            done[self.name] = end
            d = end
            if self.writer.tokens >= self.shard_tokens:
                close_shard(self)

    def finish_open(self) -> dict | None:
        """Finish the open shard (write its index); it is committed after the next checkpoint."""
        if self.writer is None:
            return None
        writer, self.writer = self.writer, None
        if writer.documents == 0:
            writer.discard()
            return None
        record = {"prefix": shard_prefix(self.name, self.next_index), **writer.finish()}
        self.finished.append(record)
        self.next_index += 1
        return record

    def saved(self) -> dict:
        if self.writer is not None:
            self.writer.sync()
        return {"finished": self.finished, "next_index": self.next_index,
                "open": self.writer.state() if self.writer is not None else None}


def _restore_finished(root: Path, record: dict) -> None:
    """Check a shard the checkpoint lists as finished; finish renaming it if the crash came first."""
    for ext in SHARD_FILES:
        final = root / f"{record['prefix']}.{ext}"
        try:
            check_shard_file(final if final.exists() else Path(f"{final}.tmp"), record, ext, root / PROGRESS)
        except ShardManifestError as e:
            raise PreprocessingError(f"cannot resume: {e}; delete {root} (or pass {FORCE_FLAG}) to start over") \
                from None
    commit_shard(root / record["prefix"])


def _remove_stray_files(root: Path, keep: set[str]) -> None:
    """Delete shard files the checkpoint does not name, and temporary files of interrupted JSON writes."""
    for f in root.iterdir():
        if _JSON_TMP_NAME.fullmatch(f.name):
            f.unlink()
    for split in SPLITS:
        d = root / split
        if d.is_dir():
            for f in d.iterdir():
                if _SHARD_FILE_NAME.match(f.name) and f"{split}/{f.name}" not in keep:
                    f.unlink()


def clear_output(root: Path) -> None:
    for name in (MANIFEST, PROGRESS):
        (root / name).unlink(missing_ok=True)
    for split in SPLITS:
        shutil.rmtree(root / split, ignore_errors=True)


def _check_output_dir(root: Path) -> None:
    ours = {MANIFEST, PROGRESS, ".lock", *SPLITS}
    other = sorted(p.name for p in root.iterdir() if p.name not in ours and not _JSON_TMP_NAME.fullmatch(p.name))
    if other:
        raise PreprocessingError(f"{root} holds files that are not shards ({', '.join(other[:3])}); "
                                 "choose an empty or new directory")


# ---------------------------------------------------------------------------
# the run


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def shard_corpus(inputs: list[str], tokenizer: str, out: str | os.PathLike, workers: int | None = None,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, valid_fraction: float = DEFAULT_VALID_FRACTION,
                 slice: str | tuple[int, int] | None = None, strict: bool = False, text_field: str = "text",
                 split_seed: int = 0, block_bytes: int = 1 << 20, max_line_chars: int = MAX_LINE_CHARS,
                 max_document_bytes: int = 64 << 20, checkpoint_every: int = 64, overwrite: bool = False,
                 progress: bool = False, report=None) -> dict:
    """Tokenize ``inputs`` into megatron-core shards under ``out``; return the manifest.

    ``workers``: tokenizer processes (default: all cores; 0 = in this process).
    ``shard_tokens``: a shard closes at the first document end past this many tokens.
    ``valid_fraction``: share of documents (by hash of their text, keyed by
    ``split_seed``) that go to the validation split. ``slice``: "i/N" to process
    the i-th of N input slices (see ``preprocessing.merge``). ``strict``: invalid
    UTF-8 is an error instead of replaced. ``report``: a ``print``-like function
    for the summary table. Rerunning after an interruption resumes.
    """
    started = time.perf_counter()
    slice_index, slice_count = parse_slice(slice)
    if shard_tokens < 1 or not 0 <= valid_fraction <= 1:
        raise PreprocessingError("need shard_tokens >= 1 and 0 <= valid_fraction <= 1")
    tok = load_tokenizer(tokenizer)
    sources = resolve_inputs(inputs, text_field)
    ranges = plan_slice(sources, slice_index, slice_count)
    workers = default_workers() if workers is None else workers
    settings = {"shard_tokens": shard_tokens, "valid_fraction": valid_fraction, "split_seed": split_seed,
                "strict": strict, "text_field": text_field, "block_bytes": block_bytes,
                "max_line_chars": max_line_chars, "max_document_bytes": max_document_bytes,
                "slice": None if slice_count == 1 else {"index": slice_index, "count": slice_count}}
    fingerprint = {"tokenizer": tok.sha256,
                   "sources": [[s.path, s.format, s.compression, s.size, s.mtime_ns] for s in sources],
                   "settings": settings}

    store_url = str(out) if is_url(out) else None
    if store_url:  # staged here, uploaded when complete (preprocessing/store.py)
        store.check_target(store_url, _digest(fingerprint), overwrite)
        out = store.staging_dir(store_url)
    root = Path(out)
    if root.exists() and not root.is_dir():  # found by the CLI fuzz tests: mkdir's traceback otherwise
        raise PreprocessingError(f"--out {root} is a file; --out needs a directory (new, or a run to resume)")
    kept = "the finished shards and progress.json are kept there, and the rerun resumes from the last checkpoint"
    if store_url:
        kept += f" (this is the staging directory of {store_url}; XDG_CACHE_HOME moves it)"
    # A full disk ends the run at its last checkpoint, which is whole: shards get their names only once
    # finished and listed in progress.json, so what the failed write left half-done is truncated or deleted
    # when the same command runs again.
    with full_disk_says(root, kept):
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PreprocessingError(f"another process is writing to {root}") from None
            _check_output_dir(root)
            saved = None
            if overwrite:
                clear_output(root)
            elif (root / MANIFEST).is_file():
                manifest = read_manifest(root, verify=False)
                if manifest.get("fingerprint") != _digest(fingerprint):
                    raise PreprocessingError(f"{root} already holds shards made from other inputs, tokenizer or "
                                             f"settings; pass {FORCE_FLAG} to replace them")
                manifest = read_manifest(root)
                (root / PROGRESS).unlink(missing_ok=True)
                if report:
                    report(f"{root} is already complete")
                    report(summary_table(manifest))
                if store_url:
                    store.publish(root, store_url, report)
                return manifest
            elif (root / PROGRESS).is_file():
                saved = json.loads((root / PROGRESS).read_text())
                # Digests since many-small-file corpora (the sources list is long); whole values before.
                changed = [k for k in fingerprint
                           if saved["fingerprint"].get(k) not in (fingerprint[k], _digest(fingerprint[k]))]
                if changed:
                    raise PreprocessingError(
                        f"{root} holds an interrupted run with different {' and '.join(changed)}; rerun it with the "
                        f"same inputs and settings to resume, or pass {FORCE_FLAG} to start over")
            run = _Run(root, tok, sources, ranges, fingerprint, settings, tokenizer, saved, checkpoint_every)
            run.execute(workers, progress)
            manifest = run.write_manifest()
            if report:
                report(summary_table(manifest, time.perf_counter() - started, run.processed))
            if store_url:
                store.publish(root, store_url, report)
            return manifest


class _Run:
    def __init__(self, root: Path, tok: Tokenizer, sources: list[Source], ranges, fingerprint: dict,
                 settings: dict, tokenizer_arg: str, saved: dict | None, checkpoint_every: int):
        self.root, self.tok, self.sources, self.ranges = root, tok, sources, ranges
        self.checkpoint_every = max(checkpoint_every, 1)
        self.fingerprint, self.settings, self.tokenizer_arg = fingerprint, settings, tokenizer_arg
        self.options = EncodeOptions(tok.dtype, settings["valid_fraction"], settings["split_seed"],
                                     settings["strict"], settings["text_field"], settings["max_line_chars"],
                                     tuple(s.path for s in sources))
        keep = set()
        if saved:
            for split in SPLITS:
                for record in saved["splits"][split]["finished"]:
                    _restore_finished(root, record)
                    keep.update(f"{record['prefix']}.{ext}" for ext in ("bin", "idx"))
                if saved["splits"][split]["open"]:
                    prefix = shard_prefix(split, saved["splits"][split]["next_index"])
                    keep.update(f"{prefix}.{ext}.tmp" for ext in ("bin", "lens", "docs"))
        _remove_stray_files(root, keep)
        self.splits = {s: _SplitWriter(root, s, tok.dtype, settings["shard_tokens"],
                                       saved["splits"][s] if saved else None) for s in SPLITS}
        self.chunk = saved["chunk"] if saved else 0
        self.position = tuple(saved["position"]) if saved else (0, None)
        self.resume_skip = dict(saved["done_in_chunk"]) if saved else {s: 0 for s in SPLITS}
        self.stats = saved["stats"] if saved else {k: 0 for k in ("documents_read", *SKIPPED, *REPAIRED)}
        self.source_documents = saved["source_documents"] if saved else [0] * len(sources)
        self.done_in_chunk = {s: 0 for s in SPLITS}
        self.processed = {"documents": 0, "tokens": 0}
        self._uncommitted: list[str] = []

    def checkpoint(self) -> None:
        # The fingerprint as one digest per part: a corpus of many files has a long sources list, and
        # serialising it at every checkpoint cost more than tokenizing small files.
        state = {"fingerprint": {k: _digest(v) for k, v in self.fingerprint.items()}, "chunk": self.chunk,
                 "position": list(self.position),
                 "done_in_chunk": dict(self.done_in_chunk), "stats": self.stats,
                 "source_documents": self.source_documents,
                 "splits": {name: split.saved() for name, split in self.splits.items()}}
        write_json_atomically(self.root / PROGRESS, state)
        for prefix in self._uncommitted:
            commit_shard(self.root / prefix)
        self._uncommitted.clear()
        if after_checkpoint is not None:
            after_checkpoint(self.chunk)

    def _close_shard(self, split: _SplitWriter, checkpoint: bool = True) -> None:
        record = split.finish_open()
        if record:
            self._uncommitted.append(record["prefix"])
            if checkpoint:
                self.checkpoint()

    def execute(self, workers: int, progress: bool) -> None:
        from tqdm import tqdm

        total = sum(range_bytes(self.sources, r) for r in self.ranges)
        done = sum(range_bytes(self.sources, r) for r in self.ranges[:self.position[0]])
        chunks = iter_chunks(self.sources, self.ranges, self.settings["text_field"], self.settings["block_bytes"],
                             self.settings["max_document_bytes"], start=(self.chunk, self.position))
        since_checkpoint = 0
        # The pool first: the progress bar starts a thread, and threads rule out fork.
        with (EncoderPool(workers, self.tok.worker_spec(), self.options) as submit,
              tqdm(total=total, initial=done, unit="B", unit_scale=True, disable=not progress, desc="shard",
                   dynamic_ncols=True, file=sys.stderr) as bar):
            start = time.perf_counter()
            pending: collections.deque = collections.deque()
            window = 2 * max(workers, 1) + 2
            for batch in work_units(chunks, self.settings["block_bytes"]):
                pending.append((batch, submit(batch)))
                while len(pending) >= window:
                    since_checkpoint = self._apply_unit(*pending.popleft(), since_checkpoint, bar, start)
            while pending:
                since_checkpoint = self._apply_unit(*pending.popleft(), since_checkpoint, bar, start)

    def _apply_unit(self, batch, future, since_checkpoint: int, bar, start: float) -> int:
        try:
            result = future.result()
        except BrokenProcessPool:
            raise PreprocessingError("a worker process died (out of memory?); rerun the same command to resume") \
                from None
        first, last = batch[0], batch[-1]
        self.chunk, self.position = first.index, first.position
        # After a resume, the unit's documents up to the checkpoint are already written.
        skip, self.resume_skip = self.resume_skip, {s: 0 for s in SPLITS}
        self.done_in_chunk = dict(skip)
        for name in SPLITS:
            self.splits[name].add(result.parts[name], skip[name], self.done_in_chunk, self._close_shard)
        for key, value in result.stats.items():
            self.stats[key] += value
        for source, kept in result.documents_per_source.items():
            self.source_documents[source] += kept
            self.processed["documents"] += kept
        self.processed["tokens"] += sum(int(p.tokens.size) for p in result.parts.values())
        self.chunk, self.position = last.index + 1, last.next_position
        self.done_in_chunk = {s: 0 for s in SPLITS}
        # Counted in input bytes, not chunks or units: a checkpoint per few small files (fsyncs, the
        # progress file) would cost more than tokenizing them.
        since_checkpoint += sum(map(chunk_bytes, batch))
        if since_checkpoint >= self.checkpoint_every * self.settings["block_bytes"]:
            self.checkpoint()
            since_checkpoint = 0
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(f"{self.processed['documents'] / elapsed:,.0f} docs/s "
                            f"{self.processed['tokens'] / elapsed:,.0f} tok/s", refresh=False)
        bar.update(sum(chunk.progress_bytes for chunk in batch))
        return since_checkpoint

    def write_manifest(self) -> dict:
        for split in self.splits.values():
            self._close_shard(split, checkpoint=False)
        self.checkpoint()
        whole = {r.source for r in self.ranges if r.start == 0 and r.end is None}
        stats = {**self.stats, "blank_files": sum(1 for i in whole if self.source_documents[i] == 0)}
        manifest = {
            "tokenizer": {"dir": str(self.tokenizer_arg), **self.tok.describe()},
            "dtype": self.tok.dtype,
            "splits": {name: split_entry(split.finished) for name, split in self.splits.items()},
            "documents_read": stats["documents_read"],
            "skipped": {k: stats[k] for k in SKIPPED},
            "repaired": {k: stats[k] for k in REPAIRED},
            "sources": [{**s.describe(), "documents": n} for s, n in zip(self.sources, self.source_documents)],
            "settings": {k: v for k, v in self.settings.items() if k != "slice"},
            "slice": self.settings["slice"],
            "fingerprint": _digest(self.fingerprint),
        }
        manifest = write_manifest(self.root, manifest)
        (self.root / PROGRESS).unlink(missing_ok=True)
        return manifest


def summary_table(manifest: dict, seconds: float | None = None, processed: dict | None = None) -> str:
    rows = [("split", "shards", "documents", "sequences", "tokens")]
    for name, split in manifest["splits"].items():
        rows.append((name, str(len(split["shards"])), f"{split['documents']:,}", f"{split['sequences']:,}",
                     f"{split['tokens']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    skipped = ", ".join(f"{k} {v:,}" for k, v in {**manifest["skipped"], **manifest["repaired"]}.items() if v)
    lines.append(f"dtype {manifest['dtype']}, vocab {manifest['tokenizer']['vocab_size']:,}; "
                 f"skipped/repaired: {skipped or 'nothing'}")
    valid = manifest["splits"].get("valid")
    if valid is not None and valid["documents"] == 0 and manifest["settings"]["valid_fraction"] > 0:
        lines.append("note: the valid split is empty (too few documents for --valid-fraction)")
    if seconds is not None and processed is not None:
        s = max(seconds, 1e-9)
        lines.append(f"{seconds:,.1f} s: {processed['documents'] / s:,.0f} documents/s, "
                     f"{processed['tokens'] / s:,.0f} tokens/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m preprocessing.shard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", action="extend", required=True, metavar="GLOB",
                        help="text/JSONL/JSON/Parquet files, save_to_disk dirs, globs; .gz/.bz2/.xz/.zst ok")
    parser.add_argument("--tokenizer", required=True, help="tokenizer dir (preprocessing.tokenizer, or a HF one)")
    parser.add_argument("--out", required=True, help="shard directory to write (or resume), or s3://BUCKET/PREFIX "
                        "(staged in ~/.cache/convbert_ds/staging, then uploaded)")
    parser.add_argument("--workers", type=bounded(int, min=0), default=default_workers(),
                        help="tokenizer processes (0: tokenize in this process); the default is all cores")
    parser.add_argument("--shard-tokens", type=bounded(int, min=1), default=DEFAULT_SHARD_TOKENS,
                        help="a shard closes at the first document end past this many tokens")
    parser.add_argument("--valid-fraction", type=bounded(float, min=0, max=1), default=DEFAULT_VALID_FRACTION,
                        help="share of documents (by a hash of their text) in the valid split")
    parser.add_argument("--split-seed", type=bounded(int, min=0), default=0,
                        help="key of the train/valid document hash")
    parser.add_argument("--slice", default=None, metavar="i/N",
                        help="process the i-th (from 0) of N input slices; none: all of the input")
    parser.add_argument("--strict", action="store_true", help="invalid UTF-8 is an error instead of replaced")
    parser.add_argument("--text-field", default="text", help="field holding the text in JSON/Parquet/Arrow inputs")
    parser.add_argument("--block-bytes", type=bounded(int, min=1), default=1 << 20, help="input bytes per unit of work")
    parser.add_argument("--checkpoint-every", type=bounded(int, min=1), default=64,
                        help="checkpoint after this many --block-bytes of input (and whenever a shard closes)")
    parser.add_argument(FORCE_FLAG, "--overwrite", dest="overwrite", action="store_true",
                        help="replace shards made with other inputs/settings, or an interrupted run's")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    shard_corpus(args.input, args.tokenizer, args.out, args.workers, args.shard_tokens, args.valid_fraction,
                 args.slice, args.strict, args.text_field, args.split_seed, args.block_bytes,
                 checkpoint_every=args.checkpoint_every, overwrite=args.overwrite, progress=not args.no_progress,
                 report=print)


if __name__ == "__main__":
    sys.exit(run_cli(main))
