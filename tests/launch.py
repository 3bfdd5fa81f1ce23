"""Run the trainer as users do: the ``deepspeed`` launcher (or torchrun) with 2 CPU ranks."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from convbert_ds.engine.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny_cpu.yaml"


def env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m ARGS`` in the repository, output captured (the preprocessing command lines)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd or REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


FAULTY_TRAIN = Path(__file__).with_name("faulty_train.py")


def train_command(launcher: str, nproc: int = 2, faults: dict | None = None) -> list[str]:
    """The trainer under ``launcher``; with ``faults`` (``{"kill_during_save": 8}``: ``tests/faulty_train.py``'s
    options, ``True`` for a flag), ``faulty_train.py`` with them, which starts the same trainer."""
    bin_dir = Path(sys.executable).parent
    entry = ["-m", "convbert_ds.train"]  # python's arguments
    if faults:
        entry = [str(FAULTY_TRAIN)]
        for name, value in faults.items():
            entry += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    if launcher == "deepspeed":
        return [str(bin_dir / "deepspeed"), "--num_gpus", str(nproc), "--master_port", free_port(),
                *(entry if faults else ["--module", "convbert_ds.train"])]
    if launcher == "torchrun":
        return [str(bin_dir / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", free_port(), *entry]
    if launcher == "ranks":
        return spawn_ranks(nproc, [sys.executable, *entry])
    raise ValueError(launcher)


SPAWN_RANKS = Path(__file__).with_name("spawn_ranks.py")
_zygote: dict = {}  # this process's rank zygote, once started: its "socket" path and its "process"


def spawn_ranks(nproc: int, command: list[str]) -> list[str]:
    """``command`` on ``nproc`` ranks of this machine, started by ``tests/spawn_ranks.py``, forked from this
    process's zygote where it can be (its docstring says when)."""
    return [sys.executable, str(SPAWN_RANKS), str(nproc), free_port(), "--zygote", _zygote_socket(), "--", *command]


def _zygote_socket() -> str:
    """Start ``spawn_ranks.py --serve`` at the first run that needs it, in ``env()``; it lives as long as this
    process. Runs asked for before it has made its imports make their own (``spawn_ranks.py`` does not wait)."""
    if not _zygote:
        directory = tempfile.mkdtemp(prefix="rank_zygote_")
        log = open(os.path.join(directory, "log"), "w")
        zygote = subprocess.Popen([sys.executable, str(SPAWN_RANKS), "--serve", os.path.join(directory, "socket"),
                                   str(os.getpid())], cwd=REPO, env=env(), stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)

        def stop() -> None:
            zygote.kill()
            zygote.wait()
            shutil.rmtree(directory, ignore_errors=True)

        atexit.register(stop)
        _zygote.update(socket=os.path.join(directory, "socket"), process=zygote)
    return _zygote["socket"]


def run_group(command: list[str], timeout: float, on_line=None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with the whole process group killed on timeout; ``on_line(line)`` sees each line of
    stdout and of stderr as it comes (to act at a point of the run), one line at a time.

    A launcher's ranks are its grandchildren: killing only the launcher (what subprocess.run does) leaves
    ranks blocked in a collective, holding cores and memory, and every later test then runs slower.
    """
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, **kwargs)
    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def communicate() -> tuple[str, str]:
        if on_line is None:
            return process.communicate(timeout=timeout)
        lines, errors, one_at_a_time = [], [], threading.Lock()

        def watch(stream, kept: list[str]) -> None:
            for line in stream:
                kept.append(line)
                with one_at_a_time:
                    on_line(line)
        threads = [threading.Thread(target=watch, args=(process.stdout, lines)),
                   threading.Thread(target=watch, args=(process.stderr, errors))]
        for thread in threads:
            thread.start()
        try:
            process.wait(timeout=timeout)
        finally:
            if process.poll() is None:  # timed out: the outer handler says so
                kill_group()
            for thread in threads:
                thread.join()
        return "".join(lines), "".join(errors)

    try:
        stdout, stderr = communicate()
    except subprocess.TimeoutExpired:
        kill_group()
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=stdout[-6000:], stderr=stderr[-6000:]) from None
    finally:
        if process.poll() is None:  # an exception in the test itself (e.g. KeyboardInterrupt): leave nothing running
            kill_group()
            process.wait()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# The launcher of the runs whose subject is not the launcher (checkpoint layouts for the converter, compiled
# steps, metrics files): the same trainer, DeepSpeed engines and gloo ranks, started by ``spawn_ranks.py``
# with the variables torchrun would set. That was about 4.6 s sooner a run than ``deepspeed``, whose runner
# and node launcher each import DeepSpeed before a rank starts (13.3 s against 8.6 s for a 1-step tiny run
# on 2 CPU cores), and 1.8 s sooner than torchrun, which imports torch first (10.3 s against 12.1 s for 12
# steps). Forked from the zygote, the ranks skip their imports too: the elastic and checkpoint-integrity
# files took 194 s and 222 CPU-seconds instead of 274 s and 355 (2 CPU cores). A run under ``deepspeed`` costs
# about 15 CPU-seconds more than one forked from the zygote: moving the phase-2 runs, the damaged-checkpoint
# resumes and the elastic set-ups here took the phases, checkpoint-integrity and elastic files from 214
# CPU-seconds to 128. A test that compares two runs bit for bit starts both with the same launcher. What users
# see from ``deepspeed`` itself (start-up, one-line errors and exit codes, kill -9 and crashes mid-save,
# preemption) is tested under it, the default; torchrun has a test of its own.
NOT_THE_SUBJECT = "ranks"


def run_training(run_dir: Path, shards: Path | str, *overrides: str, launcher: str = "deepspeed", nproc: int = 2,
                 extra_env: dict | None = None, timeout: int = 420, on_line=None,
                 faults: dict | None = None) -> subprocess.CompletedProcess:
    """A training run in ``run_dir``; ``faults``: injected into its ranks (``train_command``)."""
    command = train_command(launcher, nproc, faults) + [
        "--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}', weight: 1.0}}]",
        f"checkpoint.dir={run_dir / 'checkpoints'}", f"log.dir={run_dir / 'logs'}", "log.interval=1", *overrides]
    return run_group(command, timeout, on_line, cwd=REPO, env={**env(), **(extra_env or {})})


def train_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["split"] == "train"]


def check(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def run_as_one_rank(script: str, timeout: float = 300):
    """Run ``script`` as a process of its own, rank 0 of a one-rank process group (an engine needs one, and
    other tests in the pytest process may hold one), with ``tests/`` importable; returns the JSON that its
    last line of output prints."""
    rank_env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": free_port(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")}
    result = subprocess.run([sys.executable, script], cwd=REPO, env=rank_env, capture_output=True, text=True,
                            timeout=timeout)
    check(result)
    return json.loads(result.stdout.splitlines()[-1])
