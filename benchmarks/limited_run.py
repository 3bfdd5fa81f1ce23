"""A command under a time limit that, when stopped, says where it was: ``run_group`` and ``where_it_stopped``
(the GPU acceptance runs every part through them; a lease is too short to rerun a part just to find out
where it hung or what it was still compiling)."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path

STACK_DUMP_S = 20  # what a stopped command gets to print its Python stacks before it is killed
DRAIN_S = 10  # how long the output of a finished command is waited for, past its own exit
# A stack's file names as a reader can place them on any machine: from the package (site-packages/...) or
# from this project's root, without the directories this machine happens to keep them in.
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
_MACHINE_PREFIX = re.compile(r'File "(?:[^"]*/site-packages/|' + re.escape(f"{_PROJECT_ROOT}/") + ")")


def run_group(command: list[str], env: dict, limit_s: float, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run ``command``: exit code (124 when stopped at ``limit_s``), stdout, stderr.

    A command that outlives its limit gets SIGABRT first, then every process under it: with
    ``PYTHONFAULTHANDLER`` set, each Python process prints its threads' stacks to stderr, so the log says
    where it was (a compile, a capture, a collective) rather than only that it took too long. Then all of
    them are killed: the command's process group, and the processes under it that started sessions of their
    own (torchrun's ranks do), which would otherwise keep the GPU and the output pipes. The output is read
    as it comes, so a full pipe never blocks a stack dump, and a process left holding the pipes after the
    command exits delays the answer by ``DRAIN_S`` at most."""
    process = subprocess.Popen(command, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_no_core_file)
    readers = [_Reader(process.stdout), _Reader(process.stderr)]
    try:
        code = process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
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
        code = 124
    with contextlib.suppress(ProcessLookupError):  # whatever the command left in its group
        os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + DRAIN_S
    stdout, stderr = (reader.text(max(0.0, deadline - time.monotonic())) for reader in readers)
    return code, stdout, stderr


class _Reader:
    """A pipe read to its end on a thread of its own."""

    def __init__(self, pipe):
        self.chunks: list[str] = []
        self.thread = threading.Thread(target=lambda: self.chunks.extend(iter(pipe.readline, "")), daemon=True)
        self.thread.start()

    def text(self, wait_s: float) -> str:
        self.thread.join(wait_s)
        return "".join(list(self.chunks))


def _no_core_file() -> None:
    # SIGABRT's default action also writes a core file: gigabytes for a process holding a GPU context.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, theirs, ...), from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as stat:  # "pid (comm) state ppid ...": comm may hold spaces
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
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
