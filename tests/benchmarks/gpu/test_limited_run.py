"""Commands paused and resumed under a time limit, several started together, each going on alone once ready
(``benchmarks/gpu/limited_run.py``): how the GPU acceptance overlaps its rows' compiles without overlapping their
timed steps. Real processes and signals, small Python scripts standing in for the trainer."""

import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from benchmarks.gpu.limited_run import LimitedRun, next_turn
from benchmarks.gpu.pretrain_rows import PretrainRun, StartedRow

# Writes a time stamp a line every 0.1 s, 30 lines: 3 s of running.
TICKER = ("import sys, time\n"
          "for _ in range(30):\n"
          "    with open(sys.argv[1], 'a') as f:\n"
          "        f.write(f'{time.monotonic()}\\n')\n"
          "    time.sleep(0.1)\n")


def _stamps(path) -> list[float]:
    return [float(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
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
    assert code == 124 and run.stopped_by == "its deadline (the end of its budget)"


class _Job:
    """A stand-in for a training run: "compiles" for ``warm_s``, writes when it is ready (as the trainer logs
    its first step), then "times" 10 steps 0.15 s apart, each a time stamp."""

    def __init__(self, tmp_path, i: int, warm_s: float):
        self.marker, self.steps = tmp_path / f"ready{i}", tmp_path / f"steps{i}"
        script = ("import pathlib, sys, time\n"
                  "time.sleep(float(sys.argv[1]))\n"
                  "pathlib.Path(sys.argv[2]).write_text('ready')\n"
                  "for _ in range(10):\n"
                  "    with open(sys.argv[3], 'a') as f:\n"
                  "        f.write(f'{time.monotonic()}\\n')\n"
                  "    time.sleep(0.15)\n")
        self.run = LimitedRun([sys.executable, "-c", script, str(warm_s), str(self.marker), str(self.steps)],
                              dict(os.environ), limit_s=60)

    def ready(self) -> bool:
        return self.marker.exists()


@pytest.mark.slow
def test_runs_start_together_and_each_goes_on_alone_once_ready(tmp_path):
    # Had the others not been paused, the first one ready (at 2 s) would still be stepping when the next
    # one gets ready (at 3 s) and starts stepping too.
    warm_s = [3.0, 2.0, 4.0]  # the first in order is not the first ready
    started = time.monotonic()
    running = [_Job(tmp_path, i, seconds) for i, seconds in enumerate(warm_s)]
    jobs, turns = list(running), []
    while running:  # as the acceptance takes its rows' turns
        job = next_turn(running)
        running.remove(job)
        assert all(other.run.paused_since is not None for other in running)
        turn_began = time.monotonic()
        code, _, stderr = job.run.finish()
        assert code == 0, stderr
        turns.append((jobs.index(job), turn_began, time.monotonic()))
        for other in running:
            other.run.resume()
    assert [i for i, _, _ in turns] == [1, 0, 2]  # in the order they got ready
    for i, began, ended in turns:  # during its turn, no other job took a step
        assert not [stamp for j, job in enumerate(jobs) if j != i for stamp in _stamps(job.steps)
                    if began < stamp < ended], turns
    # Their warm-ups overlapped: about 8.5 s in all, against 13.5 s one after another.
    assert time.monotonic() - started < sum(warm_s) + 10 * 0.15 * 3 - 2


def test_a_run_past_its_limit_gets_its_turn_and_is_stopped_then(tmp_path):
    late = LimitedRun([sys.executable, "-c", TICKER, str(tmp_path / "ticks")], dict(os.environ), limit_s=1)
    slow = _Job(tmp_path, 0, 30)
    chosen = next_turn([slow, SimpleNamespace(run=late, ready=lambda: False)])
    assert chosen.run is late and slow.run.paused_since is not None  # the other paused while it stops
    assert late.finish()[0] == 124 and late.stopped_by == "its limit of 1 s"
    slow.run.kill()


def test_a_run_that_has_exited_gets_its_turn_at_once(tmp_path):
    quick = LimitedRun([sys.executable, "-c", "pass"], dict(os.environ), limit_s=60)
    quick.process.wait()
    slow = _Job(tmp_path, 0, 30)
    chosen = next_turn([slow, SimpleNamespace(run=quick, ready=lambda: False)])
    assert chosen.run is quick and slow.run.paused_since is not None
    slow.run.kill()
    assert quick.finish()[0] == 0 and slow.run.poll() == -signal.SIGKILL


def test_a_row_counts_its_first_step_and_the_logged_rows_it_ran_alone(tmp_path):
    run = LimitedRun([sys.executable, "-c", "pass"], dict(os.environ), limit_s=60)
    row = StartedRow(PretrainRun("tiny", "fp32", "torch", False), "run", tmp_path, run)
    assert not row.ready() and row.first_step_s is None
    row.metrics.parent.mkdir(parents=True)
    row.metrics.write_text('{"step": 1}\n{"step": 5')  # the second line part-written when it went on alone
    assert row.ready() and 0 < row.first_step_s < 60
    row.runs_alone()
    assert row.alone_from == 3  # not the rows at step 5 (being written) and 10 (begun before): from 15 on
    assert run.finish()[0] == 0
