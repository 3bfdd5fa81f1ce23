"""A command under a time limit that, when stopped, says where it was: ``run_group``, ``LimitedRun`` and
``where_it_stopped`` (the GPU acceptance runs every part through them; a lease is too short to rerun a part
just to find out where it hung or what it was still compiling); several such commands started at once,
each going on alone once ready while the others wait, paused: ``next_turn``."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Protocol, TypeVar
from pathlib import Path

T = TypeVar("T", bound="Turn")
STACK_DUMP_S = 20  # what a stopped command gets to print its Python stacks before it is killed
DRAIN_S = 10  # how long the output of a finished command is waited for, past its own exit
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl():
    """libc's prctl (Linux), looked up once here rather than in a forked child; None elsewhere."""
    if sys.platform != "linux":
        return None
    with contextlib.suppress(OSError, AttributeError):
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl.argtypes, prctl.restype = [ctypes.c_int, ctypes.c_ulong], ctypes.c_int
        return prctl
    return None


_PRCTL = _prctl()
# A stack's file names as a reader can place them on any machine: from the package (site-packages/...) or
# from this project's root, without the directories this machine happens to keep them in.
_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_MACHINE_PREFIX = re.compile(r'File "(?:[^"]*/site-packages/|' + re.escape(f"{_PROJECT_ROOT}/") + ")")


def run_group(command: list[str], env: dict, limit_s: float, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run ``command``: exit code (124 when stopped at ``limit_s``), stdout, stderr (``LimitedRun``)."""
    return LimitedRun(command, env, limit_s, cwd).finish()


class LimitedRun:
    """A command started at once under a time limit, that can be paused and resumed.

    A command that outlives its limit gets SIGABRT first, then every process under it: with
    ``PYTHONFAULTHANDLER`` set, each Python process prints its threads' stacks to stderr, so the log says
    where it was (a compile, a capture, a collective) rather than only that it took too long. Then all of
    them are killed: the command's process group, and the processes under it that started sessions of their
    own (torchrun's ranks do), which would otherwise keep the GPU and the output pipes. The output is read
    as it comes, so a full pipe never blocks a stack dump, and a process left holding the pipes after the
    command exits delays the answer by ``DRAIN_S`` at most.

    ``pause`` stops every process under the command (SIGSTOP) and ``resume`` lets them go on (SIGCONT)
    (``next_turn``). The limit counts only the time the command ran, not the time it was paused;
    ``deadline`` (``time.monotonic()``), when given, stops it whatever it has used. The command is killed
    if the thread that started it ends first (start it from the main thread), so that none is left paused,
    holding a GPU."""

    def __init__(self, command: list[str], env: dict, limit_s: float, cwd: Path | None = None,
                 deadline: float | None = None):
        self.limit_s, self.deadline = limit_s, deadline
        self.process = subprocess.Popen(command, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"},
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True, preexec_fn=partial(_in_the_child, os.getpid()))
        self.readers = [_Reader(self.process.stdout), _Reader(self.process.stderr)]
        self.started = time.monotonic()
        self.paused_s = 0.0  # paused before, in all
        self.paused_since: float | None = None  # set while paused
        self.code: int | None = None
        self.stopped_by = ""  # once stopped (code 124): its limit, or the deadline

    def ran_s(self) -> float:
        """Seconds it has run, not counting the time it was paused."""
        now = time.monotonic()
        return now - self.started - self.paused_s - (now - self.paused_since if self.paused_since is not None else 0.0)

    def left_s(self) -> float:
        """Seconds it may still run: what its limit leaves, or the deadline if that comes first."""
        left = self.limit_s - self.ran_s()
        return left if self.deadline is None else min(left, self.deadline - time.monotonic())

    def poll(self) -> int | None:
        """Its exit code once it has exited, else None (a run past its time goes on until ``finish``)."""
        if self.code is None and self.process.poll() is not None:
            self.code = self.process.returncode
        return self.code

    def expired(self) -> bool:
        """Whether it is running past its limit or the deadline (``finish`` stops it at once)."""
        return self.code is None and self.paused_since is None and self.left_s() <= 0

    def pause(self) -> None:
        """Stop every process under the command; returns once the command's own process has stopped, so
        that what it wrote by then is all it writes before ``resume``."""
        if self.paused_since is not None or self.process.poll() is not None:
            return
        self._signal(signal.SIGSTOP)
        self.paused_since = time.monotonic()
        waited = time.monotonic() + 5
        while _state(self.process.pid) not in ("T", "Z", "") and time.monotonic() < waited:
            time.sleep(0.005)

    def resume(self) -> None:
        if self.paused_since is None:
            return
        self._signal(signal.SIGCONT)
        self.paused_s += time.monotonic() - self.paused_since
        self.paused_since = None

    def finish(self) -> tuple[int, str, str]:
        """Resume it if paused, wait until it exits or its time is up: exit code (124 when stopped), stdout,
        stderr."""
        self.resume()
        if self.code is None:
            try:
                self.code = self.process.wait(timeout=max(0.0, self.left_s()))
            except subprocess.TimeoutExpired:
                self._stop()
        with contextlib.suppress(ProcessLookupError):  # whatever the command left in its group
            os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + DRAIN_S
        stdout, stderr = (reader.text(max(0.0, deadline - time.monotonic())) for reader in self.readers)
        return self.code, stdout, stderr

    def kill(self) -> None:
        """Kill every process under the command at once, paused or not (no stacks: for a caller that has to
        stop early itself)."""
        if self.code is None:
            self._signal(signal.SIGKILL)
            self.process.wait()
            self.code = -signal.SIGKILL

    def _signal(self, sig: signal.Signals) -> None:
        """``sig`` to the command's process group and to every process under it in a session of its own."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)
        _signal_all(_descendants(self.process.pid), sig)

    def _stop(self) -> None:
        """Its stacks, then every process under it killed (see the class's doc); its code becomes 124, and
        ``stopped_by`` says what stopped it."""
        by_deadline = self.deadline is not None and self.deadline - time.monotonic() < self.limit_s - self.ran_s()
        self.stopped_by = ("its deadline (the end of its budget)" if by_deadline
                           else f"its limit of {self.limit_s:.0f} s")
        self.resume()  # a paused process would print its stacks only once let go on
        process = self.process
        under = _descendants(process.pid)  # now: once the command is gone, they are no longer under it
        process.send_signal(signal.SIGABRT)  # its stack comes first in the output (where_it_stopped reads it)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STACK_DUMP_S)
        _signal_all(under, signal.SIGABRT)  # then theirs: torchrun's ranks, each where it was
        time.sleep(2)
        _signal_all(under + _descendants(process.pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self.code = 124


class Turn(Protocol):
    """What ``next_turn`` chooses among: a run, and whether the part of it that must run alone has begun."""
    run: LimitedRun

    def ready(self) -> bool: ...


def next_turn(turns: Sequence[T], poll_s: float = 0.05) -> T:
    """Wait until one of ``turns`` is ready, has exited or is past its time (the first in order when
    several are), pause every other one, and return it: it goes on alone. The caller finishes the chosen
    run (``LimitedRun.finish``: one past its time is stopped there, the others paused while it prints its
    stacks), then resumes the others (``LimitedRun.resume``).

    The GPU acceptance starts several training runs at once: their compiles (minutes each, on the host)
    overlap, and each runs its timed steps (after its first) with every other run paused."""
    while True:
        ready = [turn for turn in turns  # each one asked: ready() notes the time of its first step
                 if turn.ready() or turn.run.poll() is not None or turn.run.expired()]
        if ready:
            for other in turns:
                if other is not ready[0]:
                    other.run.pause()
            return ready[0]
        time.sleep(poll_s)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); [] when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:  # "pid (comm) state ppid ...": comm may hold spaces
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _state(pid: int) -> str:
    """The process's state letter (T: stopped, Z: exited, not yet reaped); "" when it is gone."""
    return (_stat(pid) or [""])[0]


class _Reader:
    """A pipe read to its end on a thread of its own."""

    def __init__(self, pipe):
        self.chunks: list[str] = []
        self.thread = threading.Thread(target=lambda: self.chunks.extend(iter(pipe.readline, "")), daemon=True)
        self.thread.start()

    def text(self, wait_s: float) -> str:
        self.thread.join(wait_s)
        return "".join(list(self.chunks))


def _in_the_child(starter: int) -> None:
    # SIGABRT's default action also writes a core file: gigabytes for a process holding a GPU context.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # A paused command whose starter died would stay stopped, its GPU memory held (its session is its own:
    # no SIGHUP comes). Linux: SIGKILL when the starting thread ends (its own children, if paused too, stay
    # so); a starter gone before this line never sends it, so then the command does not start at all.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != starter:
            os._exit(1)


def _descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, theirs, ...), from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else []
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def where_it_stopped(output: str, frames: int = 8) -> list[str]:
    """The innermost ``frames`` of the command's main thread's stack in its output once stopped by
    ``run_group`` (faulthandler's first "Current thread": the command dumps before the processes under it),
    or []; file names from the package or the project root on (results are read on other machines)."""
    start = output.find("Current thread ")
    if start < 0:
        return []
    lines = output[start:].splitlines()
    stack = []
    for line in lines[1:]:
        if not line.startswith("  File "):  # the end of this thread's stack
            break
        stack.append(_MACHINE_PREFIX.sub('File "', line.strip()))
    return lines[:1] + stack[:frames]
