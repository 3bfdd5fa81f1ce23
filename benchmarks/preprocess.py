"""Preprocessing throughput and memory, against the tokenizer's own ceiling and a naive baseline.

    python benchmarks/preprocess.py [--mb 60] [--repeats 3] [--workdir DIR]

Builds a real-text corpus (Python stdlib docstrings repeated to ``--mb`` MB)
and a sentencepiece tokenizer on it, then measures, each in a fresh process and
interleaved over ``--repeats`` rounds (medians reported; the machine is shared):

- ``bare encode``: ``SentencePieceProcessor.encode`` over the same lines in one
  process, one thread, nothing else — the tokenizer's ceiling;
- ``datasets.map + builder``: ``load_dataset("text")`` → ``Dataset.map`` with the
  same tokenizer → megatron-core ``IndexedDatasetBuilder.add_item`` per line;
- ``preprocessing.shard`` with 1 and 2 workers, end to end (process start-up,
  manifest and hashes included);
- ``preprocessing.shard`` with 2 workers on the same text as a directory of many
  small files (about 18 KB each, cut at document boundaries: a corpus of articles,
  docs or code files), whose per-file costs a single file never shows.

Peak memory is the largest sum of RSS over the measured process and all its
children, sampled every 20 ms (shared library pages count once per process, so
this overstates). The 1-worker run is repeated on a quarter of the corpus to
show that memory does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error

BLOCK = 1 << 20
BARE, BASELINE = "bare sp.encode (ceiling)", "datasets.map + IndexedDatasetBuilder"
ONE, TWO, QUARTER = "preprocessing.shard, 1 worker", "preprocessing.shard, 2 workers", "preprocessing.shard, 1 worker, 1/4"
MANY = "preprocessing.shard, 2 workers, small files"
SMALL_FILE_BYTES = 18_000


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (worker processes)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _lines_in_blocks(path: str):
    """The corpus's non-blank lines, in batches of about a megabyte, cut at line ends."""
    with open(path, encoding="utf-8") as f:
        while batch := f.readlines(BLOCK):
            yield [s for s in (line.strip() for line in batch) if s]


def measure_bare(corpus: str, tokenizer: str) -> dict:
    import sentencepiece as spm

    start, cpu = time.perf_counter(), _cpu_seconds()
    sp = spm.SentencePieceProcessor(model_file=str(Path(tokenizer) / "tokenizer.model"))
    tokens = 0
    for lines in _lines_in_blocks(corpus):
        tokens += sum(map(len, sp.encode(lines, num_threads=1)))
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu}


def measure_baseline(corpus: str, tokenizer: str, out: str) -> dict:
    """What one writes first: datasets.map to tokenize, then IndexedDatasetBuilder per line."""
    import warnings

    import datasets
    import numpy as np
    import sentencepiece as spm
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    datasets.disable_progress_bars()
    start, cpu = time.perf_counter(), _cpu_seconds()
    sp = spm.SentencePieceProcessor(model_file=str(Path(tokenizer) / "tokenizer.model"))
    ds = datasets.load_dataset("text", data_files=corpus, split="train", cache_dir=str(Path(out) / "cache"))
    ds = ds.map(lambda batch: {"ids": sp.encode([t.strip() for t in batch["text"]])}, batched=True,
                remove_columns=["text"])
    builder = IndexedDatasetBuilder(str(Path(out) / "data.bin"), dtype=np.uint16)
    tokens, open_document = 0, False
    for batch in ds.iter(batch_size=1000):
        for ids in batch["ids"]:
            if ids:
                builder.add_item(torch.tensor(ids, dtype=torch.int64))
                tokens += len(ids)
                open_document = True
            elif open_document:
                builder.end_document()
                open_document = False
    if open_document:
        builder.end_document()
    builder.finalize(str(Path(out) / "data.idx"))
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu}


def measure_shard(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    from preprocessing.shard import shard_corpus

    start, cpu = time.perf_counter(), _cpu_seconds()
    manifest = shard_corpus([corpus], tokenizer, out, workers=workers, overwrite=True)
    seconds = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    return {"tokens": tokens, "seconds": seconds, "cpu": _cpu_seconds() - cpu}


def run_measured(args: list[str]) -> dict:
    """Run ``--measure ...`` in a fresh process; add the peak RSS summed over its process tree."""
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"measurement {args} failed with exit code {proc.returncode}")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss": peak}


def prepare(workdir: Path, mb: int) -> tuple[str, str, str]:
    from convbert_ds.builtin.stdlib_docstrings import write_corpus
    from preprocessing.tokenizer import train_tokenizer

    base = write_corpus(workdir / "base.txt")
    tokenizer = workdir / "tokenizer"
    if not (tokenizer / "tokenizer.model").exists():
        train_tokenizer([str(base)], tokenizer, overwrite=True)
    corpus = workdir / f"corpus_{mb}mb.txt"
    if not corpus.exists():
        write_corpus(corpus, repeat_to_bytes=mb * 1_000_000)
    files = workdir / f"corpus_{mb}mb_files"
    if not files.exists():
        _split_into_files(corpus, files)
    quarter = workdir / f"corpus_{mb}mb_quarter.txt"
    if not quarter.exists():
        data = corpus.read_bytes()
        cut = data.index(b"\n\n", len(data) // 4) + 2
        quarter.write_bytes(data[:cut])
    return str(corpus), str(quarter), str(tokenizer), str(files)


def _split_into_files(corpus: Path, out: Path) -> None:
    """The corpus as files of about ``SMALL_FILE_BYTES``, cut at document boundaries, in name order."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    data, start, n = corpus.read_bytes(), 0, 0
    while start < len(data):
        cut = data.find(b"\n\n", start + SMALL_FILE_BYTES)
        end = len(data) if cut < 0 else cut + 2
        (partial / f"doc-{n:06d}.txt").write_bytes(data[start:end])
        start, n = end, n + 1
    partial.rename(out)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=bounded(int, min=1), default=60, help="corpus size in MB (at least 50 for the record)")
    parser.add_argument("--repeats", type=bounded(int, min=1), default=3)
    parser.add_argument("--workdir", default=None, help="where corpora and outputs go (default: a temp dir)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the datasets.map baseline (the slowest)")
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        kind, corpus, tokenizer, *rest = args.measure
        if kind == "bare":
            result = measure_bare(corpus, tokenizer)
        elif kind == "baseline":
            shutil.rmtree(rest[0], ignore_errors=True)
            result = measure_baseline(corpus, tokenizer, rest[0])
        else:
            result = measure_shard(corpus, tokenizer, rest[0], int(rest[1]))
        print(json.dumps(result))
        return

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="convbert_ds_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    corpus, quarter, tokenizer, files = prepare(workdir, args.mb)
    from preprocessing.tokenizer import load_tokenizer

    vocab = load_tokenizer(tokenizer).vocab_size
    runs = {
        BARE: ["bare", corpus, tokenizer],
        BASELINE: ["baseline", corpus, tokenizer, str(workdir / "baseline")],
        ONE: ["shard", corpus, tokenizer, str(workdir / "shards1"), "1"],
        TWO: ["shard", corpus, tokenizer, str(workdir / "shards2"), "2"],
        QUARTER: ["shard", quarter, tokenizer, str(workdir / "shards_q"), "1"],
        MANY: ["shard", files, tokenizer, str(workdir / "shards_many"), "2"],
    }
    if args.no_baseline:
        del runs[BASELINE]
    print(f"corpus {Path(corpus).stat().st_size / 1e6:.1f} MB of stdlib docstrings (also as "
          f"{len(os.listdir(files)):,} files of about {SMALL_FILE_BYTES / 1e3:.0f} KB), sentencepiece unigram "
          f"vocab {vocab}; {psutil.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for r in range(args.repeats):
        for name, measure_args in runs.items():
            result = run_measured(["--measure", *measure_args])
            results[name].append(result)
            print(f"  round {r + 1}: {name:<44} {result['tokens'] / result['seconds'] / 1e6:6.2f} M tokens/s "
                  f"{result['seconds']:7.2f} s  cpu {result['cpu']:6.2f} s  peak RSS {result['peak_rss'] / 2**20:5.0f} MB"
                  f"  (load {os.getloadavg()[0]:.1f})", flush=True)

    def rate(name: str, i: int) -> float:
        return results[name][i]["tokens"] / results[name][i]["seconds"]

    def cpu_rate(name: str, i: int) -> float:
        return results[name][i]["tokens"] / results[name][i]["cpu"]

    def median(name: str, f) -> float:
        return statistics.median(f(name, i) for i in range(args.repeats))

    bare = median(BARE, rate)
    print(f"\nmedians of {args.repeats} rounds (wall clock; cpu = user+sys of all processes of the run):")
    print(f"{'method':<46}{'tokens':>12}{'seconds':>9}{'M tok/s':>9}{'vs bare':>9}{'cpu s':>8}"
          f"{'M tok/cpu-s':>13}{'peak RSS MB':>13}")
    for name in runs:
        print(f"{name:<46}{results[name][0]['tokens']:>12,}"
              f"{median(name, lambda n, i: results[n][i]['seconds']):>9.2f}{median(name, rate) / 1e6:>9.2f}"
              f"{median(name, rate) / bare:>9.2f}{median(name, lambda n, i: results[n][i]['cpu']):>8.2f}"
              f"{median(name, cpu_rate) / 1e6:>13.2f}{median(name, lambda n, i: results[n][i]['peak_rss']) / 2**20:>13.0f}")

    def ratios(a: str, b: str, f) -> str:
        values = [f(a, i) / f(b, i) for i in range(args.repeats)]
        return f"{statistics.median(values):.2f}  (per round {', '.join(f'{v:.2f}' for v in values)})"

    print(f"\n1 worker / bare encode, wall:      {ratios(ONE, BARE, rate)}   goal >= 0.85")
    print(f"1 worker / bare encode, cpu/token: {ratios(ONE, BARE, cpu_rate)}")
    print(f"2 workers / 1 worker, wall:        {ratios(TWO, ONE, rate)}   goal >= 1.7")
    print(f"2 workers / bare encode, one file: {ratios(TWO, BARE, rate)}   goal >= 1.7")
    print(f"2 workers / bare encode, {len(os.listdir(files)):,} files: {ratios(MANY, BARE, rate)}   goal >= 1.7")
    if BASELINE in runs:
        print(f"1 worker / datasets.map baseline:  {ratios(ONE, BASELINE, rate)}")
    best = {name: min(x["seconds"] for x in results[name]) for name in runs}
    print(f"least disturbed (fastest of {args.repeats} rounds each): 1 worker / bare "
          f"{best[BARE] / best[ONE]:.2f}, 2 workers / 1 worker {best[ONE] / best[TWO]:.2f}")
    rss = {name: median(name, lambda n, i: results[n][i]['peak_rss']) / 2**20 for name in (QUARTER, ONE, TWO)}
    print(f"peak RSS: 1 worker {rss[QUARTER]:.0f} MB on 1/4 of the corpus, {rss[ONE]:.0f} MB on all of it; "
          f"2 workers {rss[TWO]:.0f} MB   goal < 1024 MB and flat")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
