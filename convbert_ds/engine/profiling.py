"""Profile a window of training steps (``train.profile``): steps ``start_step`` to ``start_step + steps - 1``.

What each kind writes, per rank, under ``log.dir/profile/``:

- ``trace``: the torch profiler's trace of the window (CPU ops, and CUDA kernels on a GPU), as
  ``rank{R}.{time}.pt.trace.json``: TensorBoard's profiler plugin reads the folder
  (``tensorboard --logdir log.dir/profile``), and Chrome's ``chrome://tracing`` or Perfetto open the file.
  Each step is a ``train step N`` range in it. Beside it, ``summary_rank{R}.txt``: the window's wall time
  per step against the device's busy time, the kernels and host ops that took the most, and the
  device's time by kind of kernel (matmuls, inductor's fused kernels, SDConv, attention, torch's dropout
  kernels, copies and casts, the optimizer...; inductor's split further by the part of the layer each
  fuses: the packed conv, GELU, LayerNorm and dropout; ``device_time_summary``); rank 0 also prints it,
  so a run says whether it is bound by the host or the device without opening a trace.
  ``python benchmarks/analysis/trace_summary.py TRACE --top N`` prints the same summary from a trace file later,
  on any machine, as long as you like (``trace_file_events``).
- ``memory``: a CUDA memory snapshot (every allocation of the window with its stack),
  ``memory_rank{R}.pickle``, for https://pytorch.org/memory_viz.
- ``nvtx``: NVTX ranges for Nsight Systems, one per step (``train step N``) and one per op inside it;
  run the job under ``nsys profile --capture-range=nvtx --nvtx-capture='train step N'`` or whole.

The window costs nothing outside itself: no profiler object exists before ``start_step``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import time
from pathlib import Path

import torch

from convbert_ds.errors import UserError
from convbert_ds.formats.train_config import ProfileSection
from convbert_ds.log import get_logger

log = get_logger(__name__)


STEP_RANGE = "train step "  # each profiled step's range: "train step N"


class StepProfiler:
    def __init__(self, section: ProfileSection, log_dir: Path, rank: int):
        self.section, self.rank = section, rank
        self.first = section.start_step
        self.last = section.start_step + section.steps - 1 if section.start_step else 0
        self.out = log_dir / "profile"
        self.trace, self.memory = None, False
        self.step_context: contextlib.ExitStack | None = None
        self.traced_steps, self.trace_started = 0, 0.0  # for the summary's time per step

    def active(self, step: int) -> bool:
        return self.first <= step <= self.last and self.first > 0

    def begin_step(self, step: int) -> None:
        """Before step ``step`` runs (steps count from 1)."""
        if not self.active(step):
            return
        what = self.section.what
        if step == self.first:
            self.out.mkdir(parents=True, exist_ok=True)
            if "trace" in what:
                cuda = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
                self.trace = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, *cuda], profile_memory=True,
                    on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.out), f"rank{self.rank}"))
                self.trace.start()
                self.trace_started = _synchronized_clock()
            if "memory" in what:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
                self.memory = True
        self.step_context = contextlib.ExitStack()
        name = f"{STEP_RANGE}{step}"
        if self.trace is not None:
            self.step_context.enter_context(torch.profiler.record_function(name))
        if "nvtx" in what:
            self.step_context.enter_context(torch.cuda.nvtx.range(name))
            self.step_context.enter_context(torch.autograd.profiler.emit_nvtx())

    def end_step(self, step: int) -> None:
        """After step ``step`` ran; the last step of the window writes the files."""
        if not self.active(step):
            return
        self.step_context.close()
        if self.trace is not None:
            self.traced_steps += 1
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Write what the window recorded (also for a run that stops inside the window)."""
        if self.step_context is not None:
            self.step_context.close()
            self.step_context = None
        wrote, summary = False, []
        if self.trace is not None:
            wall_s = _synchronized_clock() - self.trace_started
            self.trace.stop()  # writes the trace through on_trace_ready
            if self.traced_steps:
                summary = device_time_summary(self.trace, self.traced_steps, wall_s)
                (self.out / f"summary_rank{self.rank}.txt").write_text("\n".join(summary) + "\n")
            self.trace, wrote = None, True
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.out / f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory, wrote = False, True
        self.first = self.last = 0  # once
        if wrote:
            log.info(f"profile: steps {self.section.start_step}-{self.section.start_step + self.section.steps - 1} "
                  f"({', '.join(self.section.what)}) written to {self.out} (tensorboard --logdir {self.out}, "
                  "or open a .pt.trace.json in Perfetto)")
            if summary:
                log.info("\n  ".join([f"profile summary (rank {self.rank}, {self.traced_steps} steps):", *summary]))


def _synchronized_clock() -> float:
    """Seconds, once the device has finished what it was given: a window's wall time includes its kernels."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


# What a kernel is, from its name (lower-cased substrings; the first kind that matches), for the summary's
# breakdown of the device's time: which kind of work a cut must come from.
FUSED = "inductor's fused kernels"
MATMULS = "matmuls (cuBLAS)"
KERNEL_KINDS = (
    (FUSED, ("triton_",)),  # inductor names its kernels triton_{poi,red,per}_...
    ("our Triton kernels (SDConv, packed conv)", ("_sdconv_", "_document_conv_")),
    (MATMULS, ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")),
    # cuDNN's attention runs helper kernels of its own beside its flash kernels: the backward's dot(dO, O), its
    # dQ's cast, the unpacking of its dropout seed.
    ("attention", ("flash", "fmha", "attention", "cudnn::fusion", "unpack_cudnn")),
    ("dropout (torch's kernels)", ("dropout",)),  # inductor's draws are in its own kinds (train.compile_random)
    ("optimizer and clipping (multi-tensor)", ("multi_tensor", "adam")),
    ("copies, casts and fills", ("memcpy", "memset", "copy", "fill")),
    ("eager elementwise, norms, reductions", ("elementwise", "reduce_kernel", "norm", "gammabeta", "softmax")),
    ("collectives", ("nccl",)),
)
SHORT_KERNEL_US = 10.0  # kernels this short on average are bound by their launch and tail, not their work
# Inductor names each fused kernel for the ops inside it, so its kernels split further by the layer's part
# they come from. The first part that matches: a kernel fusing the conv's backward with a LayerNorm's counts
# as the conv's. The packed conv's shifted multiply-adds (model/depthwise.py) trace to tap slices and
# addcmul, and its backward pads the gradient; in the H200 profiles of the base step nothing else did.
FUSED_PARTS = (
    ("the packed conv", ("addcmul", "constant_pad_nd", "select_slice")),
    ("GELU and its backward", ("gelu",)),
    ("LayerNorm, dropout, residual adds", ("layer_norm", "dropout")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def fused_part(name: str) -> str:
    """Which part of the layer one of inductor's fused kernels comes from, by its name."""
    lowered = name.lower()
    return next((part for part, marks in FUSED_PARTS if any(m in lowered for m in marks)), "the rest")


def _by_kind(on_device: list, steps: int, busy_us: float) -> list[str]:
    """The device's time per step by kind of kernel, and how much of it went to short kernels."""
    kinds: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}  # inductor's fused kernels by the layer's part
    short = [0.0, 0]
    for e in on_device:
        kind = kernel_kind(e.key)
        _add(kinds.setdefault(kind, [0.0, 0]), e)
        if kind == FUSED:
            _add(parts.setdefault(fused_part(e.key), [0.0, 0]), e)
        if e.self_device_time_total < SHORT_KERNEL_US * e.count:
            _add(short, e)

    def row(totals: list[float], label: str, width: int = 6) -> str:
        us, count = totals
        return f"  {us / max(busy_us, 1):{width}.1%} {us / 1e3 / steps:8.2f} ms/step x{count // steps:<5} {label}"

    def largest_first(totals: dict[str, list[float]]) -> list[tuple[str, list[float]]]:
        return sorted(totals.items(), key=lambda item: item[1][0], reverse=True)

    lines = ["  by kind of kernel:"]
    for kind, totals in largest_first(kinds):
        lines.append(row(totals, kind))
        if kind == FUSED:
            lines += [row(part_totals, f"  of which {part}", width=8) for part, part_totals in largest_first(parts)]
    lines.append(row(short, f"of those in kernels under {SHORT_KERNEL_US:.0f} us on average"))
    return lines


def _add(totals: list[float], event) -> None:
    """Add one profiler row's device time and launch count to ``totals`` (``[us, count]``)."""
    totals[0] += event.self_device_time_total
    totals[1] += event.count


def device_time_summary(profile, steps: int, wall_s: float, top: int = 12) -> list[str]:
    """Lines that say whether a profiled window was bound by the device or by the host: the device's busy
    time per step (kernels and copies, summed; one stream) against the wall time per step, the kernels
    launched per step, the ops that kept the device busiest, and the busy time by kind of kernel.
    ``profile``: a ``torch.profiler.profile``, or ``trace_file_events``' events (anything with
    ``key_averages()``)."""
    averages = profile.key_averages()
    # Only the device's own rows (kernels, copies): an op's row repeats the time of the kernels it launched,
    # and a ``record_function`` range (``train step N``, the optimizer's step) is mirrored on the device's
    # timeline as a user annotation spanning the kernels inside it, so counting it counts them twice.
    on_device = [e for e in averages if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                 and not getattr(e, "is_user_annotation", False)]
    busy_us = sum(e.self_device_time_total for e in on_device)
    launches = sum(e.count for e in on_device)
    wall_ms, busy_ms = 1e3 * wall_s / steps, busy_us / 1e3 / steps
    if not on_device:  # a CPU run: no device to be bound by
        lines = [f"wall {wall_ms:.1f} ms/step; no CUDA kernels recorded (a CPU run: the host does it all)"]
    else:
        lines = [f"wall {wall_ms:.1f} ms/step, device busy {busy_ms:.1f} ms/step ({busy_ms / wall_ms:.0%}), "
                 f"{launches / steps:,.0f} kernels and copies/step"]
    for e in sorted(on_device, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        lines.append(f"  {e.self_device_time_total / max(busy_us, 1):6.1%} "
                     f"{e.self_device_time_total / 1e3 / steps:8.2f} ms/step x{e.count // steps:<5} {e.key[:90]}")
    if on_device:
        lines += _by_kind(on_device, steps, busy_us)
    lines.append("  host: the ops with the most CPU time of their own")
    # The trainer's ``train step N`` ranges hold, as their own time, the Python between the ops: one row.
    ranges = [e for e in averages if e.key.startswith(STEP_RANGE)]
    host = [(e.self_cpu_time_total, e.count, e.key) for e in averages if not e.key.startswith(STEP_RANGE)]
    if ranges:
        host.append((sum(e.self_cpu_time_total for e in ranges), steps, "(Python between the ops, in the step)"))
    for self_us, count, key in sorted(host, reverse=True)[:top // 2]:
        lines.append(f"  {self_us / 1e3 / steps:8.2f} ms/step x{count // steps:<5} {key[:90]}")
    return lines


# The trace file's event categories (the Chrome trace format torch's profiler writes) that the summary reads:
# the device's own work, and the host's ops, ranges and CUDA runtime calls.
_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}
_READ_CATEGORIES = _DEVICE_CATEGORIES | _HOST_CATEGORIES | {"gpu_user_annotation"}  # the last: ranges mirrored


def trace_json_events(path: Path) -> list[dict]:
    """The raw events of a ``.pt.trace.json`` (or ``.json.gz``) as torch's profiler writes them (the Chrome
    trace format's ``traceEvents``; none where the file has none)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as file:
            trace = json.load(file)
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: not a readable profiler trace ({error}); pass the .pt.trace.json (or .gz) "
                        "that train.profile wrote under log.dir/profile/") from None
    return trace.get("traceEvents", []) if isinstance(trace, dict) else []


def trace_file_events(path: Path) -> tuple[torch.autograd.profiler_util.EventList, int, float]:
    """A ``.pt.trace.json`` (or ``.json.gz``) that ``train.profile`` wrote, read back as the profiler's own
    events, for ``device_time_summary``: ``(events, steps, wall_s)``. Steps are its ``train step N`` ranges;
    the wall time runs from the first one's start to the last event's end (the device's tail included)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    events, step_starts, last_end = [], [], 0.0
    for raw in trace_json_events(path):
        category = raw.get("cat")
        if raw.get("ph") != "X" or category not in _READ_CATEGORIES:
            continue
        start, end, name = float(raw["ts"]), float(raw["ts"]) + float(raw.get("dur", 0)), str(raw["name"])
        on_device = category in _DEVICE_CATEGORIES or category == "gpu_user_annotation"
        if category == "user_annotation" and name.startswith(STEP_RANGE):
            step_starts.append(start)
        last_end = max(last_end, end)
        thread = raw.get("tid", 0)
        events.append(FunctionEvent(id=len(events), name=name, thread=thread if isinstance(thread, int) else 0,
                                    start_us=start, end_us=end, use_device="cuda",
                                    device_type=DeviceType.CUDA if on_device else DeviceType.CPU,
                                    is_user_annotation=category in ("user_annotation", "gpu_user_annotation"),
                                    stack=[]))
    if not step_starts:
        raise UserError(f"{path}: no '{STEP_RANGE}N' range in it; pass a trace that train.profile wrote")
    timeline = EventList(sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)), use_device="cuda")
    timeline._build_tree()  # each host op's own time: its span less its children's
    return timeline, len(step_starts), (last_end - min(step_starts)) / 1e6
