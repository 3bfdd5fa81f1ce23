"""A command under a time limit that, when stopped, says where it was: ``run_group`` and ``where_it_stopped``
(the GPU acceptance runs every part through them; a lease is too short to rerun a part just to find out
where it hung or what it was still compiling)."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
from pathlib import Path

STACK_DUMP_S = 20  # what a stopped command gets to print its Python stacks before its process group is killed


def run_group(command: list[str], env: dict, limit_s: float, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run ``command`` in a process group of its own: exit code (124 when stopped at ``limit_s``), stdout,
    stderr. A command that outlives its limit is sent SIGABRT first: with ``PYTHONFAULTHANDLER`` set, Python
    prints every thread's stack to stderr, so the log says where it was (a compile, a capture, a collective)
    rather than only that it took too long. Then the whole group goes: data loader and compile workers too."""
    process = subprocess.Popen(command, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_no_core_file)
    try:
        stdout, stderr = process.communicate(timeout=limit_s)
        code = process.returncode
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the command itself, not its children's pipes
            process.wait(timeout=STACK_DUMP_S)
        _kill_group(process.pid)
        stdout, stderr = process.communicate()
        return 124, stdout, stderr
    _kill_group(process.pid)  # whatever the command left running
    return code, stdout, stderr


def _no_core_file() -> None:
    # SIGABRT's default action also writes a core file: gigabytes for a process holding a GPU context.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def where_it_stopped(output: str, frames: int = 8) -> list[str]:
    """The innermost ``frames`` of the main thread's stack in a stopped command's output (faulthandler's
    "Current thread" after SIGABRT; for a command that spawned Python processes, the last such dump), or []."""
    start = output.rfind("Current thread ")
    if start < 0:
        return []
    lines = output[start:].splitlines()
    stack = []
    for line in lines[1:]:
        if not line.startswith("  File "):  # the end of this thread's stack
            break
        stack.append(line.strip())
    return lines[:1] + stack[:frames]
