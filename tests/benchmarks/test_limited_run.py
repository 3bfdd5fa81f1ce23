"""Commands paused and resumed under a time limit, and several warmed up together then run one at a time
(``benchmarks/limited_run.py``): how the GPU acceptance overlaps its rows' compiles without overlapping their
timed steps. Real processes and signals, small Python scripts standing in for the trainer."""

import os
import sys
import time

from benchmarks.limited_run import LimitedRun, Warming, warm_up_together
from benchmarks.pretrain_rows import GPU_RUNS, PretrainRun, StartedRow, in_groups

# Writes a time stamp a line every 0.1 s, 30 lines: 3 s of running.
TICKER = ("import sys, time\n"
          "for _ in range(30):\n"
          "    with open(sys.argv[1], 'a') as f:\n"
          "        f.write(f'{time.monotonic()}\\n')\n"
          "    time.sleep(0.1)\n")


def _stamps(path) -> list[float]:
    return [float(line) for line in path.read_text().splitlines()]


def test_a_paused_command_does_nothing_and_its_limit_counts_only_its_running_time(tmp_path):
    out = tmp_path / "ticks"
    run = LimitedRun([sys.executable, "-c", TICKER, str(out)], dict(os.environ), limit_s=6)
    time.sleep(1.5)
    run.pause()
    written = len(_stamps(out))
    time.sleep(5)  # past its limit in wall time, had the pause counted
    assert len(_stamps(out)) == written and run.poll() is None  # not a line while paused, not stopped
    run.resume()
    code, _, stderr = run.finish()
    assert code == 0, stderr
    stamps = _stamps(out)
    assert len(stamps) == 30 and 0 < written < 30
    gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    assert max(gaps) >= 5 and sorted(gaps)[-2] < 1  # one gap: the pause
    assert run.ran_s() < 6 < time.monotonic() - run.started


def test_a_run_paused_past_its_deadline_is_stopped_when_its_turn_comes(tmp_path):
    run = LimitedRun([sys.executable, "-c", TICKER, str(tmp_path / "ticks")], dict(os.environ), limit_s=60,
                     deadline=time.monotonic() + 2)
    run.pause()
    time.sleep(2.5)
    code, _, _ = run.finish()
    assert code == 124 and run.stopped_by == "its deadline"


def test_runs_warm_up_together_then_each_runs_on_alone_in_order(tmp_path):
    # Each "compiles" for a while, says it is ready (a file, as the trainer's first logged step), waits a
    # little, then "times" its steps: 10 stamps 0.05 s apart.
    script = ("import pathlib, sys, time\n"
              "time.sleep(float(sys.argv[1]))\n"
              "pathlib.Path(sys.argv[2]).write_text('ready')\n"
              "time.sleep(0.5)\n"
              "for _ in range(10):\n"
              "    with open(sys.argv[3], 'a') as f:\n"
              "        f.write(f'{time.monotonic()}\\n')\n"
              "    time.sleep(0.05)\n")
    warm_s = [2.0, 1.0, 3.0]  # the first in order is not the first ready
    runs, paused = [], []
    started = time.monotonic()
    for i, seconds in enumerate(warm_s):
        run = LimitedRun([sys.executable, "-c", script, str(seconds), str(tmp_path / f"ready{i}"),
                          str(tmp_path / f"steps{i}")], dict(os.environ), limit_s=60)
        runs.append(Warming(run, (tmp_path / f"ready{i}").exists, lambda i=i: paused.append(i)))
    warm_up_together(runs)
    warmed = time.monotonic() - started
    assert warmed < sum(warm_s) - 1, warmed  # their warm-ups overlapped
    assert sorted(paused) == [0, 1, 2]  # each got ready while another was still warming up or waiting
    assert all(not (tmp_path / f"steps{i}").exists() for i in range(3))  # none has timed a step yet
    for each in runs:
        code, _, stderr = each.run.finish()
        assert code == 0, stderr
    spans = [(min(stamps), max(stamps)) for stamps in (_stamps(tmp_path / f"steps{i}") for i in range(3))]
    assert spans[0][1] < spans[1][0] and spans[1][1] < spans[2][0], spans  # one at a time, in order


def test_the_last_run_left_is_not_paused(tmp_path):
    # The other run exits at once, so the one that gets ready has nothing to wait for.
    quick = LimitedRun([sys.executable, "-c", "pass"], dict(os.environ), limit_s=60)
    ticker = LimitedRun([sys.executable, "-c", TICKER, str(tmp_path / "ticks")], dict(os.environ), limit_s=60)
    paused = []
    time.sleep(1)
    warm_up_together([Warming(quick, lambda: False), Warming(ticker, lambda: True, lambda: paused.append(1))])
    assert paused == [] and ticker.paused_since is None
    assert ticker.finish()[0] == 0 and quick.finish()[0] == 0


def test_rows_start_in_groups_and_a_row_without_graph_partitioning_starts_its_own():
    rows = [spec for spec in GPU_RUNS if spec.graph_partition][:5]
    assert in_groups(rows, 2) == [rows[:2], rows[2:4], rows[4:]]
    assert in_groups(rows, 1) == [[spec] for spec in rows]
    unpartitioned = next(spec for spec in GPU_RUNS if not spec.graph_partition)
    assert in_groups([rows[0], unpartitioned, rows[1]], 4) == [[rows[0]], [unpartitioned, rows[1]]]


def test_a_pause_leaves_out_the_logged_row_it_fell_in_and_the_next(tmp_path):
    run = LimitedRun([sys.executable, "-c", "pass"], dict(os.environ), limit_s=60)
    row = StartedRow(PretrainRun("tiny", "fp32", "torch", False), "run", tmp_path, run)
    assert not row.ready()
    row.metrics.parent.mkdir(parents=True)
    row.metrics.write_text('{"step": 1}\n{"step": 5')  # the second line part-written when it stopped
    assert row.ready()
    row.paused()
    assert row.paused_lines == {2, 3}
    assert run.finish()[0] == 0
