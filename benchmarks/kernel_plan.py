"""What the whole compiled ELECTRA step launches on a GPU, and the bytes its fused kernels move, planned on a
CPU: inductor's Triton kernels for the paper configs' step, counted but never run.

    python benchmarks/kernel_plan.py                          # base, seq 128, batches 8 and 16, figures at 256
    python benchmarks/kernel_plan.py --override residual_dtype=fp32      # a variant of the model, to A/B
    python benchmarks/kernel_plan.py --option combo_kernels=true         # an inductor option (train.compile_options)
    python benchmarks/kernel_plan.py --preset tiny --seq 32 --batches 2 4 --at 64
    python benchmarks/kernel_plan.py --instructions     # and the instructions each kernel issues on an H200

Why: on a GPU most of the step's time outside the matmuls is inductor's fused kernels (LayerNorms, GELUs,
dropouts' backwards, residual adds, the packed conv), and they are bound by the bytes they move. A CPU
compile builds C++ kernels, which inductor groups otherwise; here (``inductor_count.gpu_kernels_on_cpu``)
it builds the Triton kernels it would build for a GPU, and counts their bytes. So a change to the model
can be A/B'd in the bytes a GPU would move, on a machine without one.

The step is the trainer's compiled one (``compile_step``: masking, both bodies, sampling, losses, forward
and backward) under bf16 autocast, the residual stream in bf16 and each sample packed from three
documents, as the paper configs run it on a GPU. What runs as on a GPU, outside inductor's kernels:
- the SDConv as its Triton custom ops (``sdconv_impl: auto`` on CUDA), here returning zeros;
- attention as one opaque op forward and one backward (cuDNN's on a GPU, opaque to inductor too);
- dropout as aten's kernel (``train.compile_random: eager``; ``--random inductor``: inside inductor's).

With ``--instructions``, each fused kernel is also compiled for an H200 (``sm_90``) and the instructions its
warps issue counted from its machine code (``kernel_issue``): a kernel whose instructions take longer than
its bytes is bound by them, which no count of bytes shows (the exact GELU's erf).

Each batch of ``--batches`` is compiled in turn; with two, each kernel's bytes split into a part per sample
and a part per step whatever the batch (weights, their casts and gradients, the embeddings' gradients),
and the figures are given at ``--at``. ``--bandwidth``: the rate that turns bytes into milliseconds,
calibrated on an H200 (benchmarks/RESULTS.md: the bytes planned here at batch 256 against the device time
its profile gave inductor's kernels). What can differ from a GPU's plan: CPU autocast casts a few ops
(softmax, the losses) otherwise than CUDA's; torch's version (a lease's may be older); the reductions'
split, which follows the device's core count. Matmuls and the other ops inductor does not fuse are listed
apart: their time is not a matter of bytes.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import library as torch_ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/kernel_plan.py`

from benchmarks.document_conv import three_documents_per_sample  # noqa: E402
from benchmarks.inductor_count import attributes_set, gpu_kernels_on_cpu, inductor_metrics_counted  # noqa: E402
from benchmarks.kernel_issue import (  # noqa: E402
    H200_PEAK_TBPS, issue_ms, launches_recorded, refuse_interpreter, warp_instructions)
from benchmarks.train_step import electra_config_for  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES  # noqa: E402
from convbert_ds.engine.compile_options import inductor_options  # noqa: E402
from convbert_ds.engine.profiling import fused_part  # noqa: E402
from convbert_ds.formats.train_config import load_config, option_text  # noqa: E402

VOCAB, SPECIAL_IDS = 30522, {"pad": 0, "cls": 2, "sep": 3, "mask": 4}
H200_BANDWIDTH_TBPS = 2.80  # inductor's kernels on an H200, base at batch 256 (benchmarks/RESULTS.md)


@torch_ops.custom_op("convbert_ds::attention_stand_in", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              dropout_p: float) -> torch.Tensor:
    """Stands in for ``scaled_dot_product_attention``, zeros in the query's shape and layout: what cuDNN's and
    flash attention's kernels return where the values' head size is the queries' (ConvBERT's)."""
    return torch.zeros_like(query)


@attention.register_fake
def _(query, key, value, mask, dropout_p):
    return torch.empty_like(query)


@torch_ops.custom_op("convbert_ds::attention_stand_in_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    return [torch.zeros_like(t) for t in (query, key, value)]


@attention_backward.register_fake
def _(grad, query, key, value, out, mask):
    return [torch.empty_like(t) for t in (query, key, value)]


def _attention_setup(ctx, inputs, output):
    query, key, value, mask, _ = inputs
    ctx.save_for_backward(query, key, value, output, mask)


def _attention_grads(ctx, grad):
    return (*attention_backward(grad, *ctx.saved_tensors), None, None)


attention.register_autograd(_attention_grads, setup_context=_attention_setup)


def _stand_in_attention(query, key, value, attn_mask=None, dropout_p=0.0, **_):
    return attention(query, key, value, attn_mask, dropout_p)


def as_on_a_gpu():
    """What the model does on CUDA, on CPU tensors: ``sdconv_impl: auto`` picks the SDConv's Triton custom ops
    (``sdconv_as_on_cuda``), whose launches return zeros here, and attention is ``_stand_in_attention``."""
    from convbert_ds.kernels import sdconv_triton

    def sdconv_zeros(kernel_logits, values, value_mask, segments, store_lse):
        batch, seq_len, heads, _ = kernel_logits.shape
        return torch.zeros_like(values), values.new_zeros((batch, heads, seq_len) if store_lse else (0,),
                                                          dtype=torch.float32)

    def sdconv_grad_zeros(grad_out, kernel_logits, values, value_mask, segments, lse, need_grad_logits,
                          need_grad_values):
        return (torch.zeros_like(kernel_logits) if need_grad_logits else None,
                torch.zeros_like(values) if need_grad_values else None)

    return (*sdconv_as_on_cuda(),
            (sdconv_triton, "sdconv_forward", sdconv_zeros), (sdconv_triton, "sdconv_backward", sdconv_grad_zeros),
            (sdconv_triton, "INTERPRET", True),  # their input check's "CPU tensors need the interpreter"
            (F, "scaled_dot_product_attention", _stand_in_attention))


def sdconv_as_on_cuda() -> tuple:
    """Patches (for ``attributes_set``) under which ``sdconv_impl: auto`` on CPU tensors picks what it picks on
    CUDA (the dynamic conv's Triton custom ops, the packed conv through inductor when compiled), without
    probing the Triton kernels first."""
    from convbert_ds.model import depthwise, sdconv

    resolve = sdconv.resolve_impl

    def resolve_as_on_cuda(impl, device):
        return resolve(impl, torch.device("cuda"))

    return ((sdconv, "resolve_impl", resolve_as_on_cuda), (depthwise, "resolve_impl", resolve_as_on_cuda),
            (sdconv, "cached_reason", lambda key, probe: None), (depthwise, "cached_reason", lambda key, probe: None))


def reached_bytes(node) -> int:
    """What one of inductor's kernels reads and writes (``node``: its scheduler node), buffer by buffer: the
    elements its indexing reaches (``MemoryDep.numbytes_hint``: a slice of a wider buffer, a row broadcast
    over a tile), at most the buffer; the buffers a fused kernel keeps to itself are never stored, so they
    are not counted. Inductor's own count (``get_read_write_buffers_sizes``) takes each buffer of a fused
    kernel whole: a kernel that reads a 384-wide slice of the stacked input projections' 1,536-wide output
    counted all of it, and fusing fewer nodes made a step's count smaller (``max_fusion_size=1``: 0.61 of it,
    tiny). Ops inductor does not fuse keep inductor's count."""
    from torch._inductor.dependencies import WeakDep
    from torch._inductor.scheduler import ExternKernelSchedulerNode, FusedSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    if isinstance(node, NopKernelSchedulerNode):
        return 0
    if isinstance(node, ExternKernelSchedulerNode):
        return node.get_read_write_buffers_sizes()
    stored = {dep.name for dep in node.read_writes.writes}
    if isinstance(node, FusedSchedulerNode):
        parts = set(node.snodes)
        stored = {name for name in stored
                  if any(user.node not in parts for user in node.scheduler.name_to_buf[name].users)}
    total = 0
    for deps in (node.read_writes.reads, [dep for dep in node.read_writes.writes if dep.name in stored]):
        reached: dict[str, int] = defaultdict(int)
        for dep in deps:
            if not isinstance(dep, WeakDep):  # an order between kernels, not an access
                reached[dep.name] = max(reached[dep.name], dep.numbytes_hint())
        total += sum(min(nbytes, _buffer_bytes(V.graph, name, nbytes)) for name, nbytes in reached.items())
    return total


def _buffer_bytes(graph, name: str, otherwise: int) -> int:
    """The bytes of buffer ``name`` of ``graph``; ``otherwise`` where it has none of its own (a mutation's)."""
    buffer = graph.try_get_buffer(name)
    try:
        return graph.sizevars.optimization_hint(buffer.get_numel(), fallback=0) * buffer.get_dtype().itemsize
    except (AttributeError, NotImplementedError):  # no such buffer, or a layout without a size (NoneLayout)
        return otherwise


def _count_reached_bytes(count_bytes):
    """``GraphLowering.count_bytes`` (what fills ``torch._inductor.metrics``) with each kernel's bytes as
    ``reached_bytes`` counts them."""
    def counted(graph):
        _, nodes, runtimes = count_bytes(graph)
        per_node = [(node, reached_bytes(node) // 4) for node, _ in nodes]  # metrics keep bytes // 4
        return sum(4 * quarter for _, quarter in per_node), per_node, runtimes
    return counted


def step_model_and_inputs(preset: str, batch: int, seq: int, overrides: dict, vocab: int = VOCAB) -> tuple:
    """The ELECTRA model the plan compiles (``overrides``: of its config; the SDConv as on a GPU, the residual
    stream in bf16, as the paper configs run it) and a batch of random tokens, each sample packed from three
    documents: ``(model, inputs)``."""
    from convbert_ds.model import ElectraForPretraining

    config = electra_config_for(preset, vocab, SPECIAL_IDS, max_position_embeddings=max(512, seq),
                                **{"sdconv_impl": "auto", "residual_dtype": "autocast", **overrides})
    torch.manual_seed(0)
    model = ElectraForPretraining(config)
    ids = torch.randint(5, vocab, (batch, seq))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                  document_ids=three_documents_per_sample(batch, seq, ids.device))
    return model, inputs


def step_forward(model, inputs: dict) -> torch.Tensor:
    """The step's loss, under bf16 autocast (CPU's: the GPU's casts but for a few ops, see the module's doc)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**inputs, check=False).loss


def plan_step(preset: str, batch: int, seq: int, overrides: dict, options: dict, instructions: bool = False,
              eager_random: bool = True) -> list[tuple[str, str, float, float]]:
    """``(kind, name, MB, warp instructions)`` of every kernel and extern op of one compiled step's forward
    and backward at ``batch`` x ``seq`` (``overrides``: of the model's config; ``options``: inductor's,
    checked): kind is inductor's part of the layer (``profiling.fused_part``) for its fused kernels,
    ``extern`` for the rest (name: the op). Warp instructions (``kernel_issue``): with ``instructions``, for
    inductor's kernels, those of a name shared evenly among them; 0 otherwise. ``eager_random``: as
    ``train.compile_random: eager`` (False: ``inductor``, the draws inside inductor's kernels)."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.utils import get_fused_kernel_name

    from convbert_ds.model.layers import compile_step

    model, inputs = step_model_and_inputs(preset, batch, seq, overrides)
    patches = (*as_on_a_gpu(), (GraphLowering, "count_bytes", _count_reached_bytes(GraphLowering.count_bytes)))
    with attributes_set(patches), gpu_kernels_on_cpu(), inductor_metrics_counted() as metrics, \
            launches_recorded() as launches:
        compile_step(model, cuda_graphs=False, eager_random=eager_random, options=options)
        step_forward(model, inputs).backward()
    issued: dict[str, float] = defaultdict(float)
    for launch in launches if instructions else ():
        issued[launch.fused_name] += warp_instructions(launch)
    kernels = []
    for node, quarter_bytes in metrics.nodes_num_elem:  # inductor keeps each kernel's bytes // 4
        if isinstance(node, NopKernelSchedulerNode):
            continue
        if isinstance(node, ExternKernelSchedulerNode):
            ir = node.node
            name = str(getattr(ir, "op_overload", None) or getattr(ir, "python_kernel_name", None) or type(ir).__name__)
            kind = "extern"
        else:
            name = get_fused_kernel_name(node.get_nodes(), "original_aten")
            kind = fused_part(name)
        kernels.append((kind, name, 4 * quarter_bytes / 1e6))
    per_name = Counter(name for _, name, _ in kernels)
    unmatched = sorted(set(issued) - set(per_name))
    if unmatched:  # the kernels' names and the scheduler's would then no longer agree: a count would be lost
        raise RuntimeError(f"launched kernels that no fused node of the plan names: {unmatched[:5]}")
    return [(kind, name, mb, issued.get(name, 0.0) / per_name[name]) for kind, name, mb in kernels]


def split_per_sample(plans: dict[int, list]) -> dict[tuple[str, str], tuple[int, float, float, float, float]]:
    """``(kind, name) -> (count, MB per sample, MB per step, warp instructions per sample, per step)`` of every
    kernel, from its figures at one or two batch sizes (one: all per sample); both are linear in the batch."""
    totals: dict[int, dict] = {}
    for batch, kernels in plans.items():
        by_name = totals[batch] = defaultdict(lambda: [0, 0.0, 0.0])
        for kind, name, mb, instructions in kernels:
            figures = by_name[(kind, name)]
            figures[0] += 1
            figures[1] += mb
            figures[2] += instructions
    (small, first), *rest = sorted(totals.items())
    large, second = rest[0] if rest else (small, first)
    split = {}
    for key in first.keys() | second.keys():
        (count, *at_small), (_, *at_large) = first.get(key, (0, 0.0, 0.0)), second.get(key, (0, 0.0, 0.0))
        split[key] = (count,)
        for low, high in zip(at_small, at_large):
            per_sample = (high - low) / (large - small) if large != small else low / small
            split[key] += (per_sample, max(0.0, low - small * per_sample))
    return split


def print_plan(split: dict, at: int, bandwidth: float, top: int) -> None:
    """The plan's tables at batch ``at``; with instructions counted, each row's issue time on an H200 too.
    A row's figures are ``split_per_sample``'s (count, MB per sample, per step, warp instructions per sample,
    per step), summed, then its floor in ms."""
    def at_batch(per_sample: float, per_step: float) -> float:
        return per_sample * at + per_step

    parts: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])
    externs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for (kind, name), figures in split.items():
        group = externs[name] if kind == "extern" else parts[kind]
        # A kernel's floor: the longer of its bytes at the HBM's peak and its instructions at the full clock.
        floor = max(at_batch(*figures[1:3]) / 1e3 / H200_PEAK_TBPS, issue_ms(at_batch(*figures[3:5])))
        for i, value in enumerate((*figures, floor)):
            group[i] += value
    issued = any(figures[3] or figures[4] for figures in split.values())

    def row(label: str, count: float, per_sample: float, per_step: float, issue_sample: float = 0.0,
            issue_step: float = 0.0, floor: float = 0.0, timed: bool = True) -> str:
        gb = at_batch(per_sample, per_step) / 1e3
        ms = f"{gb / bandwidth:9.2f}" if timed else f"{'':9}"
        issue = f"{issue_ms(at_batch(issue_sample, issue_step)):9.2f}{floor:9.2f}" if issued and timed else ""
        return f"  {label:<44}{count:>7,.0f}{per_sample:>12.2f}{per_step:>10.1f}{gb:>10.2f}{ms}{issue}"

    header = (f"  {'':<44}{'kernels':>7}{'MB/sample':>12}{'MB/step':>10}{f'GB@{at}':>10}{'ms':>9}"
              + (f"{'issue ms':>9}{'floor ms':>9}" if issued else ""))
    print(f"\ninductor's fused kernels by part of the layer (ms: at {bandwidth:g} TB/s; MB/step: whatever the batch"
          + (f"; issue ms: their instructions at one a clock per scheduler of an H200; floor ms: per kernel, the "
             f"longer of that and its bytes at the HBM's {H200_PEAK_TBPS:g} TB/s" if issued else "") + "):")
    print(header)
    for part, figures in sorted(parts.items(), key=lambda item: -at_batch(*item[1][1:3])):
        print(row(part, *figures))
    print(row("all of inductor's fused kernels", *(sum(f[i] for f in parts.values()) for i in range(6))))
    print("\nops inductor does not fuse (matmuls, attention, SDConv, dropout; their time is not their bytes'):")
    print(header)
    for name, figures in sorted(externs.items(), key=lambda item: -at_batch(*item[1][1:3])):
        if at_batch(*figures[1:3]) >= 1.0:
            print(row(name[:44], *figures[:3], timed=False))
    print(f"\nthe {top} fused kernels that move the most at batch {at} (kernels of one name summed"
          f"{'; ms at the bandwidth, then issue ms' if issued else ''}):")
    largest = sorted(((at_batch(*f[1:3]), at_batch(*f[3:5]), f[0], name) for (kind, name), f in split.items()
                      if kind != "extern"), reverse=True)[:top]
    for mb, instructions, count, name in largest:
        times = f"{mb / 1e3 / bandwidth:6.2f} {issue_ms(instructions):6.2f}  " if issued else ""
        print(f"  {mb / 1e3:8.2f} GB {times}x{count:<4} {name[:110]}")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base")
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--batches", type=bounded(int, min=1), nargs="+", default=[8, 16],
                        help="one or two batch sizes to compile (two split the bytes per sample from those per step)")
    parser.add_argument("--at", type=bounded(int, min=1), default=256, help="the batch the figures are given at")
    parser.add_argument("--bandwidth", type=bounded(float, min=0.01), default=H200_BANDWIDTH_TBPS,
                        help="TB/s that turn the fused kernels' bytes into ms "
                             f"(default: {H200_BANDWIDTH_TBPS}, an H200's)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a field of the model's config, as model.overrides takes it (e.g. residual_dtype=fp32); "
                             "repeatable")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="one of inductor's options, as train.compile_options takes it (e.g. combo_kernels=true): "
                             "what a GPU row could A/B without a change of code; repeatable")
    parser.add_argument("--top", type=bounded(int, min=1), default=15, help="fused kernels listed")
    parser.add_argument("--random", choices=("eager", "inductor"), default="eager",
                        help="who draws dropout and sampling in the compiled step, as train.compile_random")
    parser.add_argument("--instructions", action="store_true",
                        help="also count the instructions each fused kernel issues, compiled for an H200 "
                             "(benchmarks/kernel_issue.py; minutes more)")
    args = parser.parse_args(argv)
    if len(set(args.batches)) != len(args.batches) or len(args.batches) > 2:
        parser.error(f"--batches takes one or two different sizes, got {args.batches}")
    if args.instructions:  # it compiles each kernel for a GPU
        refuse_interpreter("benchmarks/kernel_plan.py --instructions")
    # Read as a run's overrides are, and the options checked as the trainer checks train.compile_options; a
    # model field that does not exist is a ConfigError when the model is built (config.preset).
    cfg = load_config(None, ["train.compile_mode=step", f"train.compile_random={args.random}",
                             *(f"model.overrides.{text}" for text in args.override),
                             *(f"train.compile_options.{text}" for text in args.option)])
    overrides, options = dict(cfg.model.overrides), inductor_options(cfg)
    eager_random = cfg.train.compile_random == "eager"
    plans = {batch: plan_step(args.preset, batch, args.seq, overrides, options, args.instructions, eager_random)
             for batch in args.batches}
    print(f"planned on CPU for a GPU (inductor's Triton kernels, not run): preset={args.preset} seq={args.seq} "
          f"batches={','.join(map(str, args.batches))} bf16 autocast, packed documents, {args.random} random"
          f"{''.join(f', {k}={v}' for k, v in overrides.items())}"
          f"{''.join(f', inductor {option_text(k, v)}' for k, v in options.items())} | torch {torch.__version__}")
    for batch, kernels in plans.items():
        fused = [mb for kind, _, mb, _ in kernels if kind != "extern"]
        print(f"batch {batch}: {len(fused):,} fused kernels ({sum(fused):,.1f} MB), "
              f"{len(kernels) - len(fused):,} other ops, forward and backward")
    print_plan(split_per_sample(plans), args.at, args.bandwidth, args.top)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
