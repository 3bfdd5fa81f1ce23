"""Start N ranks of a command on this machine with the variables torchrun hands its ranks, for the test runs
whose subject is not the launcher (``launch.NOT_THE_SUBJECT``):

    python tests/spawn_ranks.py N MASTER_PORT -- COMMAND ...

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (loopback) and MASTER_PORT, which is
what the trainer reads from any launcher (``convbert_ds/engine/distributed.py``), and inherits stdout and
stderr.

When COMMAND is this Python running a module (``-m convbert_ds.train``) or a script (``.py``), this process
imports what every rank imports first (torch, DeepSpeed, the trainer), then forks the ranks, each of which
runs COMMAND as ``python`` would from there. The imports are about 4.2 CPU-seconds a rank, and DeepSpeed's ZeRO
check imports its Muon optimizer, whose ``torch.compile`` decorators import inductor: 1.5 more. Made once and
forked, a 3-step tiny run on 2 ranks takes 7.5 CPU-seconds instead of 10.5 (2 CPU cores); the suite starts
about sixty such runs and is short of CPU, not of wall time. Nothing runs before the fork but imports, with
the run's own environment, and torch starts its thread pools at the first operation, so none is forked. Any
other COMMAND starts as a process of its own.

As torchrun does, it stops the other ranks when one fails (they would wait in a collective for it): SIGTERM,
then SIGKILL after a grace. It exits with the first failed rank's code (128 + N for a signal), else 0.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time

GRACE_S = 10.0  # for the other ranks to leave after SIGTERM (the trainer takes it for a preemption and may
# try to save: a save that waits on the failed rank is killed)
PRELOAD = ("torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer",
           "convbert_ds.engine.trainer")


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class ForkedRank:
    """A rank forked from this process, with the calls of ``subprocess.Popen`` that ``main`` makes."""

    def __init__(self, command: list[str], rank_env: dict):
        module = command[2] if command[1] == "-m" else None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid, self.returncode = os.fork(), None
        if self.pid:
            return
        # The rank: ``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` from here on, in this environment. An
        # exception or SystemExit ends it as it would end that process (traceback, exit code, atexit handlers).
        os.environ.clear()
        os.environ.update(rank_env)
        sys.argv = command[2 if module else 1:]
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(command[1]))  # as ``python SCRIPT`` sets it
            runpy.run_path(command[1], run_name="__main__")
        sys.exit(0)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _runs_python(command: list[str]) -> bool:
    """``python -m MODULE ...`` or ``python SCRIPT.py ...`` with this Python: what a rank can be forked for."""
    return (len(command) >= 2 and os.path.realpath(command[0]) == os.path.realpath(sys.executable)
            and (command[1] == "-m" and len(command) >= 3 or command[1].endswith(".py")))


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    ranks, port, command = int(argv[0]), argv[1], argv[3:]
    base = {**os.environ, "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port}
    envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(ranks)]
    if _runs_python(command):
        sys.path[0] = os.getcwd()  # as ``python -m`` sets it, not this file's folder
        for name in PRELOAD:
            __import__(name)
        running = [ForkedRank(command, rank_env) for rank_env in envs]
    else:
        running = [subprocess.Popen(command, env=rank_env) for rank_env in envs]
    failed = 0
    while running:
        for process in [p for p in running if p.poll() is not None]:
            running.remove(process)
            if process.returncode and not failed:
                failed = _exit_code(process.returncode)
                _stop(running)
        time.sleep(0.05)
    return failed


def _stop(processes: list) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
