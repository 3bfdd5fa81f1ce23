"""What the GPU acceptance (``benchmarks/gpu_acceptance.py``) writes, and where: its section (the device and
versions it ran on, its command, each part's figures) in ``benchmarks/RESULTS.md`` (or in the CPU smoke run's
file).

The file's layout: one heading (``SECTION``) at the end, created by the first run; under it, each run's own
section (``### DATE: DEVICE``), appended, the newest last."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
from pathlib import Path

SECTION = "## GPU acceptance (`python -m benchmarks.gpu_acceptance`)"


def device_name(on_gpu: bool) -> str:
    import torch
    return torch.cuda.get_device_name() if on_gpu else f"CPU ({platform.processor() or platform.machine()})"


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


def acceptance_section(args: argparse.Namespace, all_parts: list[str], on_gpu: bool, seconds: float,
                       failed: list[str], body: list[tuple[str, str]]) -> str:
    """One acceptance run's section: its device and versions, its command as typed (``args``: the parsed
    command line, ``all_parts``: the parts it runs by default) and the parts done so far (``body``: each one's
    title and text)."""
    command = " ".join(["python -m benchmarks.gpu_acceptance",
                        *([] if on_gpu else ["--cpu-smoke", args.cpu_smoke.name]),
                        *([] if args.parts == all_parts else ["--parts", ",".join(args.parts)]),
                        *([] if args.budget == 540 else ["--budget", f"{args.budget:g}"]),
                        *([] if args.rows is None else ["--rows", f"'{args.rows.pattern}'"]),
                        *([] if args.together is None else ["--together", str(args.together)])])
    section = [f"### {datetime.date.today().isoformat()}: {device_name(on_gpu)}", "",
               environment(on_gpu), f"Command: `{command}` ({seconds:.0f} s in all).",
               f"Parts that failed: {', '.join(failed) or 'none'}."]
    if len(body) < len(args.parts):
        section[-1] += f" As of part {len(body)} of {len(args.parts)}: the parts after it had not run yet."
    for title, text in body:
        section += ["", f"#### {title}", "", text]
    return "\n".join(section)


def write_results(path: Path, section: str) -> None:
    """Append this run's section under the GPU acceptance heading (created at the end of the file once)."""
    text = path.read_text() if path.exists() else ""
    if SECTION not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + SECTION + "\n\nEach run appends its own section; " \
            "the newest is last.\n"
    path.write_text(text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n")
