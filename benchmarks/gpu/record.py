"""What a GPU acceptance run (``benchmarks/gpu/acceptance.py``) writes, and where: its record, a file of its own
(the device and versions it ran on, the commit, its command, each part's figures), by default
``benchmarks/runs/DATE-DEVICE.md``; never an existing file (a second run the same day writes ``DATE-DEVICE-2.md``),
never ``benchmarks/RESULTS.md``, whose rows are picked from the records by hand.

A record stays short (about 150 lines at most for a lease's run): each command's output is cut to its first
lines (``trimmed``) and the profiles to their summary; the whole of each is in the logs (``--logs``)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "benchmarks" / "runs"
DEFAULT_BUDGET_S = 540
COMMAND_LINES = 14  # of one command's output in the record


def device_name(on_gpu: bool) -> str:
    import torch
    return torch.cuda.get_device_name() if on_gpu else f"CPU ({platform.processor() or platform.machine()})"


def device_slug(name: str) -> str:
    """The device in a record's file name: ``h100``, ``h200``, ``a100`` for those, else the name in lowercase
    words joined by ``-`` (without the vendor's)."""
    known = re.search(r"\b([AHB]\d{2,3})\b", name, re.IGNORECASE)
    if known:
        return known.group(1).lower()
    words = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return re.sub(r"^nvidia-", "", words) or "device"


def record_path(given: Path | None, on_gpu: bool, today: datetime.date | None = None) -> Path:
    """Where this run's record goes: ``given`` (a file; or a directory, one that exists or a name without a
    suffix, which gets the default name), else ``benchmarks/runs/``; the default name is ``DATE-DEVICE.md``
    (DEVICE: ``device_slug``, or ``cpu``). An existing file is never overwritten: ``NAME-2.md``, ``NAME-3.md``...
    instead."""
    slug = device_slug(device_name(on_gpu)) if on_gpu else "cpu"
    name = f"{(today or datetime.date.today()).isoformat()}-{slug}.md"
    if given is None:
        path = RUNS / name
    elif given.is_dir() or not given.suffix:
        path = given / name
    else:
        path = given
    stem, n = path.stem, 2
    while path.exists():
        path, n = path.with_name(f"{stem}-{n}{path.suffix}"), n + 1
    return path


def _commit() -> str:
    """The tree's commit (``+`` when it has changes), or "unknown" where there is no git (a copied tree)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def environment(on_gpu: bool) -> str:
    import torch
    import transformers
    versions = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda}", f"transformers {transformers.__version__}"]
    for module in ("triton", "deepspeed"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            versions.append(f"{module} not installed")
    if on_gpu:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        versions.append(f"driver {smi.stdout.strip() or 'unknown'}")
    return f"Device: {device_name(on_gpu)}, {os.cpu_count()} CPU cores; " + ", ".join(versions) + "."


def record_text(args: argparse.Namespace, all_parts: list[str], on_gpu: bool, seconds: float,
                failed: list[str], body: list[tuple[str, str]]) -> str:
    """One acceptance run's record: its device and versions, the commit, its command as typed (``args``: the
    parsed command line, ``all_parts``: the parts it runs by default) and the parts done so far (``body``:
    each one's title and text)."""
    command = " ".join(["python -m benchmarks.gpu.acceptance",
                        *([] if on_gpu else ["--cpu-smoke", args.cpu_smoke.name]),
                        *([] if args.parts == all_parts else ["--parts", ",".join(args.parts)]),
                        *([] if args.budget == DEFAULT_BUDGET_S else ["--budget", f"{args.budget:g}"]),
                        *([] if args.rows is None else ["--rows", f"'{args.rows.pattern}'"]),
                        *([] if args.together is None else ["--together", str(args.together)])])
    record = [f"# GPU acceptance: {datetime.date.today().isoformat()}, {device_name(on_gpu)}", "",
              environment(on_gpu), f"Commit {_commit()}. Command: `{command}` ({seconds:.0f} s in all).",
              f"Parts that failed: {', '.join(failed) or 'none'}."]
    if len(body) < len(args.parts):
        record[-1] += f" As of part {len(body)} of {len(args.parts)}: the parts after it had not run yet."
    for title, text in body:
        record += ["", f"## {title}", "", text]
    return "\n".join(record) + "\n"


def trimmed(text: str, log: str, limit: int = COMMAND_LINES, last: bool = False) -> str:
    """``text`` cut to its first ``limit`` lines (``last``: its last, for a command that failed), one of them
    saying how many more the log ``log`` holds."""
    lines = text.strip().splitlines()
    if len(lines) <= limit:
        return "\n".join(lines)
    more = f"[{len(lines) - limit + 1} more lines in {log}.log, with --logs]"
    return "\n".join([more, *lines[-(limit - 1):]] if last else [*lines[:limit - 1], more])


def write_record(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
