"""Where the GPU acceptance (``benchmarks/gpu_acceptance.py``) writes: the device and versions it ran on, and
its section of ``benchmarks/RESULTS.md`` (or of the CPU smoke run's file).

The file's layout: one heading (``SECTION``) at the end, created by the first run; under it, each run's own
section (``### DATE: DEVICE``), appended, the newest last."""

from __future__ import annotations

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


def write_results(path: Path, section: str) -> None:
    """Append this run's section under the GPU acceptance heading (created at the end of the file once)."""
    text = path.read_text() if path.exists() else ""
    if SECTION not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + SECTION + "\n\nEach run appends its own section; " \
            "the newest is last.\n"
    path.write_text(text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n")
