"""The rate each matmul of a captured ELECTRA step ran at on a GPU: the cuBLAS kernels in the trace that
``train.profile`` wrote of a run with ``train.cuda_graphs: capture``, paired in launch order with the matmuls
inductor's compiled step issues, recorded on a CPU (their shapes, hence their FLOPs).

    python benchmarks/matmul_rates.py TRACE.pt.trace.json.gz --preset base --batch 256 --vocab 30166 \\
        --option combo_kernels=true

Why: a profile names cuBLAS's kernels (``nvjet_sm90_tst_256x128_...``), not the matmuls they ran, and in a
CUDA graph's replay no host op is recorded beside them to give their shapes. So a profile says how long the
step's matmuls took, not which of them run far below the device's peak. Inductor issues the same matmuls
in the same order wherever it compiles the same step; here it compiles it on a CPU as it would for a GPU
(``kernel_plan.step_model_and_inputs``, ``inductor_count.gpu_kernels_on_cpu``) and records each matmul it
hands to its extern kernels.

Pass the model and inductor's options as the traced run had them (``--preset``, ``--vocab``, ``--override``,
``--option``): another step issues other matmuls, and the counts then disagree (an error). The FLOPs are
recorded at ``--record-batch`` and scaled to ``--batch``: every matmul of the step has one dimension that
counts tokens or masked positions, both proportional to the batch.

A graph's matmuls are listed shape by shape only where the pairing holds up: cuBLAS picks one kernel for
one shape and layout, so a shape whose calls ran as different kernels means that graph ran its matmuls in
another order than the CPU's (the backward's independent branches, the generator's and the
discriminator's, may interleave either way). Such a graph gets its total only, which any order gives.

Only cuBLAS's kernels are read as matmuls. Where inductor ran some as Triton templates (tuned matmuls,
``train.compile_autotune``), their kernels read as its fused ones, the counts differ, and the trace is refused.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/matmul_rates.py`

from benchmarks.inductor_count import attributes_set, gpu_kernels_on_cpu  # noqa: E402
from benchmarks.kernel_plan import VOCAB, as_on_a_gpu, step_forward, step_model_and_inputs  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES  # noqa: E402
from convbert_ds.engine.compile_options import inductor_options  # noqa: E402
from convbert_ds.engine.flops import PEAK_TFLOPS  # noqa: E402
from convbert_ds.engine.profiling import MATMULS, kernel_kind, trace_json_events  # noqa: E402
from convbert_ds.errors import UserError  # noqa: E402
from convbert_ds.formats.train_config import load_config, option_text  # noqa: E402

GRAPHS = ("forward", "backward")  # what the capture records for one micro-batch a step, in replay order
EXTERN_MATMULS = ("mm", "addmm", "bias_addmm", "bmm", "baddbmm")  # inductor's extern kernels that are matmuls
H200_PEAK_TFLOPS = PEAK_TFLOPS["H200"]  # the dense bf16 peak MFU is reckoned against


@dataclass(frozen=True)
class Matmul:
    op: str
    shape: tuple[int, int, int]  # M x K x N, as recorded
    flops: float  # 2 M K N (times the batch of matrices, for bmm)


def _matmul(op: str, tensors: list[torch.Tensor]) -> Matmul:
    left, right = tensors[-2:]  # addmm's and baddbmm's first tensor is what they add
    *batch, m, k = left.shape
    n = right.shape[-1]
    return Matmul(op, (m, k, n), 2.0 * m * k * n * (batch[0] if batch else 1))


def recorded_matmuls(preset: str, batch: int, seq: int, vocab: int, overrides: dict,
                     options: dict) -> dict[str, list[Matmul]]:
    """The matmuls of the compiled step's forward and of its backward, in the order inductor issues them."""
    from torch._inductor.select_algorithm import extern_kernels

    from convbert_ds.model.layers import compile_step

    model, inputs = step_model_and_inputs(preset, batch, seq, overrides, vocab)
    recorded: dict[str, list[Matmul]] = {graph: [] for graph in GRAPHS}
    into: list[list[Matmul]] = []  # where calls go: nowhere while the step compiles

    def recording(op: str, kernel):
        def call(*args, **kwargs):
            if into:
                into[0].append(_matmul(op, [a for a in args if isinstance(a, torch.Tensor)]))
            return kernel(*args, **kwargs)
        return call

    patches = tuple((extern_kernels, op, recording(op, getattr(extern_kernels, op))) for op in EXTERN_MATMULS)
    with attributes_set((*as_on_a_gpu(), *patches)), gpu_kernels_on_cpu():
        compile_step(model, cuda_graphs=False, eager_random=True, options=options)
        step_forward(model, inputs).backward()  # compiles
        model.zero_grad(set_to_none=True)
        into.append(recorded["forward"])
        loss = step_forward(model, inputs)
        into[0] = recorded["backward"]
        loss.backward()
    return recorded


def traced_matmul_kernels(path: Path) -> dict[str, list[tuple[str, float]]]:
    """The cuBLAS kernels of each graph of the captured step in ``path`` (``(name, us)``, in launch order), the
    time of a split-K GEMM's reduction kernel added to its GEMM's, each averaged over the traced steps."""
    events = trace_json_events(path)
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"}
    per_launch: dict[int, list[dict]] = defaultdict(list)
    for e in sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        if e["args"].get("correlation") in launches:
            per_launch[e["args"]["correlation"]].append(e)
    replays = [per_launch[c] for c in sorted(per_launch, key=lambda c: per_launch[c][0]["ts"])]
    if not replays or len(replays) % len(GRAPHS):
        raise UserError(f"{path}: {len(replays)} CUDA-graph replays, not a whole number of steps of "
                        f"{len(GRAPHS)} ({', '.join(GRAPHS)}); pass a trace of a run with train.cuda_graphs=capture "
                        "and one micro-batch a step")
    steps = len(replays) // len(GRAPHS)
    kernels = {}
    for i, graph in enumerate(GRAPHS):
        per_step = [_matmul_kernels(replays[s * len(GRAPHS) + i]) for s in range(steps)]
        if any([n for n, _ in ks] != [n for n, _ in per_step[0]] for ks in per_step):
            raise UserError(f"{path}: the {graph} graph's matmul kernels differ between traced steps; a replay "
                            "runs the same kernels each time, so this is not one captured step's trace")
        kernels[graph] = [(name, sum(ks[j][1] for ks in per_step) / steps) for j, (name, _) in enumerate(per_step[0])]
    return kernels


def _matmul_kernels(replay: list[dict]) -> list[tuple[str, float]]:
    found: list[list] = []
    for e in replay:
        name = e["name"]
        if kernel_kind(name) != MATMULS:
            continue
        if "splitkreduce" in name.lower() and found:
            found[-1][1] += e["dur"]  # the reduction that ends a split-K GEMM
        else:
            found.append([name, float(e["dur"])])
    return [(name, us) for name, us in found]


def paired_lines(recorded: dict[str, list[Matmul]], traced: dict[str, list[tuple[str, float]]], scale: float,
                 record_batch: int) -> list[str]:
    """The report: each graph's total, and its matmuls shape by shape where the pairing holds up."""
    for graph in GRAPHS:
        if len(recorded[graph]) != len(traced[graph]):
            raise UserError(f"the trace's {graph} graph ran {len(traced[graph])} matmul kernels where the step "
                            f"compiled here issues {len(recorded[graph])}: the trace is of another model or "
                            "inductor options; pass --preset, --vocab, --override and --option as the traced run "
                            "had them")
    lines = [f"  {'graph':<10}{'matmuls':>8}{'TFLOP':>9}{'ms':>9}{'TFLOP/s':>9}"]
    totals = [0.0, 0.0]
    for graph in GRAPHS:
        flops = scale * sum(m.flops for m in recorded[graph])
        us = sum(us for _, us in traced[graph])
        totals[0] += flops
        totals[1] += us
        lines.append(f"  {graph:<10}{len(recorded[graph]):>8}{flops / 1e12:>9.2f}{us / 1e3:>9.2f}"
                     f"{flops / us / 1e6:>9.0f}")
    lines.append(f"  {'both':<10}{sum(map(len, recorded.values())):>8}{totals[0] / 1e12:>9.2f}{totals[1] / 1e3:>9.2f}"
                 f"{totals[0] / totals[1] / 1e6:>9.0f}   ({totals[1] / 1e3:.2f} ms a step; at "
                 f"{H200_PEAK_TFLOPS:g} TFLOP/s, the peak: {totals[0] / H200_PEAK_TFLOPS / 1e9:.2f} ms)")
    for graph in GRAPHS:
        by_shape: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0.0, set()])
        for matmul, (kernel, us) in zip(recorded[graph], traced[graph]):
            row = by_shape[matmul.op, matmul.shape]
            row[0] += 1
            row[1] += scale * matmul.flops
            row[2] += us
            row[3].add(kernel)
        mixed = [f"{op} {' x '.join(map(str, shape))} as {len(row[3])}" for (op, shape), row in by_shape.items()
                 if len(row[3]) > 1]
        if mixed:
            lines.append(f"{graph}: {len(mixed)} of its {len(by_shape)} shapes ran as more than one kernel "
                         f"({', '.join(mixed[:3])}{', ...' if len(mixed) > 3 else ''}), so its matmuls ran in "
                         "another order than the CPU's: its total only (above)")
            continue
        lines.append(f"{graph}, shape by shape (M x K x N as recorded at batch {record_batch}; TFLOP and ms summed "
                     "over the calls):")
        lines.append(f"  {'ms':>6} {'calls':>5} {'TFLOP':>7} {'TFLOP/s':>7}  {'op':<7}{'M x K x N':<20}kernel")
        for (op, shape), (calls, flops, us, kernels) in sorted(by_shape.items(), key=lambda item: -item[1][2]):
            lines.append(f"  {us / 1e3:6.2f} {calls:5d} {flops / 1e12:7.3f} {flops / us / 1e6:7.0f}  {op:<7}"
                         f"{' x '.join(map(str, shape)):<20}{next(iter(kernels))[:70]}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a .pt.trace.json (or .gz) of a captured step (train.profile)")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base")
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--batch", type=bounded(int, min=1), default=256, help="the traced run's batch")
    parser.add_argument("--vocab", type=bounded(int, min=16), default=VOCAB,
                        help=f"the traced run's vocabulary (its shards' manifest; default {VOCAB})")
    parser.add_argument("--record-batch", type=bounded(int, min=1), default=8,
                        help="the batch the step is compiled at here (its FLOPs scaled to --batch)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a field of the model's config, as model.overrides takes it; repeatable")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="one of inductor's options, as train.compile_options takes it; repeatable")
    args = parser.parse_args(argv)
    traced = traced_matmul_kernels(args.trace)  # first: a bad trace is an error before minutes of compiling
    cfg = load_config(None, ["train.compile_mode=step", *(f"model.overrides.{text}" for text in args.override),
                             *(f"train.compile_options.{text}" for text in args.option)])
    overrides, options = dict(cfg.model.overrides), inductor_options(cfg)
    recorded = recorded_matmuls(args.preset, args.record_batch, args.seq, args.vocab, overrides, options)
    print(f"matmuls of {args.trace.name}, paired with the step compiled here: preset={args.preset} seq={args.seq} "
          f"batch={args.batch} vocab={args.vocab}{''.join(f', {k}={v}' for k, v in overrides.items())}"
          f"{''.join(f', inductor {option_text(k, v)}' for k, v in options.items())} (recorded at batch "
          f"{args.record_batch}) | torch {torch.__version__}")
    print("\n".join(paired_lines(recorded, traced, args.batch / args.record_batch, args.record_batch)))


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
