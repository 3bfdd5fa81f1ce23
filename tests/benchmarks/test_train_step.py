"""``benchmarks/train_step.py --counts-only`` end to end at the tiny preset: the three loops (ours plain, ours
through the DeepSpeed engine, transformers' ConvBERT) each run a real step and report their ops and syncs."""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest

from launch import REPO, env, run_group

ROWS = ("plain PyTorch", "DeepSpeed engine", "transformers ConvBERT")


@pytest.mark.slow
def test_counts_only_reports_the_three_loops(tiny_corpus):
    command = [sys.executable, str(REPO / "benchmarks" / "train_step.py"), "--counts-only", "--preset", "tiny",
               "--batch", "2", "--seq", "64", "--threads", "1", "--shards", str(tiny_corpus["shards"])]
    result = run_group(command, timeout=180, cwd=REPO, env=env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("loop") and "fwd+bwd ops" in line)
    table = {line[:23].strip(): line[23:].split() for line in lines[header + 1:header + 1 + len(ROWS)]}
    assert tuple(table) == ROWS, result.stdout
    for name, cells in table.items():
        forward_backward, _, optimizer, _, total, loss = cells
        assert int(forward_backward.replace(",", "")) > 100, (name, cells)  # a real model ran
        assert int(total.replace(",", "")) == int(forward_backward.replace(",", "")) + int(optimizer.replace(",", ""))
        assert math.isfinite(float(loss)) and float(loss) > 0, (name, cells)
    # Our model, checked on the host and called with check=False, never waits for the device in its step.
    assert table["plain PyTorch"][1] == "0" and table["DeepSpeed engine"][1] == "0", result.stdout
    assert "median step" not in result.stdout  # --counts-only: no timing table


@pytest.mark.slow
def test_a_subset_of_rows_timed_and_profiled(tiny_corpus, tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "train_step.py"), "--rows", "plain,engine", "--steps", "1",
               "--preset", "tiny", "--batch", "2", "--seq", "64", "--threads", "1",
               "--shards", str(tiny_corpus["shards"]), "--profile", str(tmp_path / "traces")]
    result = run_group(command, timeout=180, cwd=REPO, env=env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "transformers ConvBERT" not in result.stdout  # not asked for: neither timed nor counted
    assert "DeepSpeed engine / plain PyTorch:" in result.stdout
    for row in ("plain", "deepspeed"):  # each row's trace, and its device-vs-wall line
        assert (tmp_path / "traces" / f"{row}.pt.trace.json.gz").stat().st_size > 1000
    # On CPU the wall-time line says there is no device time to set against it.
    assert result.stdout.count("no CUDA kernels recorded (a CPU run: the host does it all)") == 2, result.stdout


def test_the_timed_steps_follow_the_ready_file_and_wait_for_the_go_file(tmp_path):
    """What the GPU acceptance relies on to time the transformers row alone: the ready file appears only after
    the warm-up steps, and no timed step begins before the caller's go file (``time_rows``)."""
    from benchmarks.train_step import Row, time_rows

    ready, go = tmp_path / "ready", tmp_path / "go"
    seen = []  # per step: (ready file there, go file there, when)
    row = Row("stand-in", lambda batch: seen.append((ready.exists(), go.exists(), time.monotonic())), lambda: None)
    written = []  # when the go file was written: the timer's own clock (its thread may start before ours reads)

    def write_go():
        written.append(time.monotonic())  # before the file, so no step that sees the file can precede it
        go.write_text("go\n")

    threading.Timer(0.5, write_go).start()
    times = time_rows([row], iter(range(10)), steps=3, cuda=False, warmup=2, ready_file=ready, go_file=go)
    assert [(r, g) for r, g, _ in seen] == [(False, False)] * 2 + [(True, True)] * 3, seen
    assert written[0] <= seen[2][2] and len(times["stand-in"]) == 3, (seen, written)
