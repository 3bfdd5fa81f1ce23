"""The profile summary of a trace that ``train.profile`` wrote, read back from its file on any machine: wall
time per step against the device's busy time, the kernels and host ops that took the most (as many as
``--top`` asks), and the device's time by kind of kernel; the same lines the trainer prints at the end of
its window (``convbert_ds/engine/profiling.py``), for a trace brought back from a GPU machine.

    python benchmarks/analysis/trace_summary.py log.dir/profile/rank0.HOST_PID.TIME.pt.trace.json --top 40
    python benchmarks/analysis/trace_summary.py TRACE.pt.trace.json.gz     # gzip-compressed traces too
"""

from __future__ import annotations

import sys
from pathlib import Path

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.engine.profiling import device_time_summary, trace_file_events


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a .pt.trace.json (or .pt.trace.json.gz) from train.profile")
    parser.add_argument("--top", type=bounded(int, min=1), default=12,
                        help="kernels listed (and half as many host ops; default 12, as the trainer prints)")
    args = parser.parse_args(argv)
    events, steps, wall_s = trace_file_events(args.trace)
    print(f"profile summary ({args.trace.name}, {steps} steps):")
    print("\n".join(f"  {line}" for line in device_time_summary(events, steps, wall_s, top=args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
