"""What the layer benchmarks share (``input_projections.py``, ``residual_dtype.py``): one encoder layer in two
variants, forward + backward side by side on the same weights and inputs.

Inputs are samples packed from three documents each (the trainer's default input). Each variant prints:
- its median time over ``reps`` runs after warm-up (the variants take turns, ``benchmarks/timing.py``);
- the ATen ops one forward + backward dispatches (about one kernel each on a GPU; counted eager, compiled or
  not);
- with ``compile``, inductor's own count of its compiled forward and backward (``inductor_count.py``): the
  kernels they launch, the bytes all of them move (``MB moved``) and the bytes of the kernels it fuses
  itself (``MB fused``).

The outputs are checked against each other first.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the scripts run as `python benchmarks/X.py`

from benchmarks.document_conv import three_documents_per_sample  # noqa: E402
from benchmarks.inductor_count import compiled_counts  # noqa: E402
from benchmarks.timing import medians_ms  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded  # noqa: E402
from convbert_ds.config import PRESET_NAMES, ModelConfig  # noqa: E402
from convbert_ds.model.layers import padding_masks  # noqa: E402
from convbert_ds.model.op_count import OpCounter  # noqa: E402


@dataclass
class Variant:
    layer: nn.Module
    input_dtype: torch.dtype = torch.float32  # what the layer before it hands it (the residual stream's dtype)


def parse_arguments(doc: str, argv: list[str] | None):
    """The layer benchmarks' command line (``doc``: the script's docstring); sets ``--threads``."""
    parser = ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base", help="the discriminator's layer")
    parser.add_argument("--batch", type=bounded(int, min=1), default=None, help="default: 128 on CUDA, 8 on CPU")
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--reps", type=bounded(int, min=1), default=20)
    parser.add_argument("--compile", action="store_true", help="each layer through torch.compile (inductor)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def compare(args, config: ModelConfig, variants: dict[str, Variant], autocast: bool) -> dict[str, dict[str, float]]:
    """Print the comparison of ``variants`` of ``config``'s layer at ``args``' sizes (``parse_arguments``;
    the first variant is the one the others' outputs are checked against); return each one's figures
    (``ms``, ``ops``, and with ``--compile`` ``kernels``, ``mb`` and ``fused_mb``)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch, seq, reps, compile = args.batch or (128 if cuda else 8), args.seq, args.reps, args.compile
    x32 = torch.randn(batch, seq, config.hidden_size, device=device)
    inputs = {name: x32.to(v.input_dtype).requires_grad_() for name, v in variants.items()}
    grad_out = torch.randn_like(x32)
    masks = padding_masks(None, three_documents_per_sample(batch, seq, device), config.conv_kernel_size)
    precision = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)

    def fwd_bwd(name: str, module: nn.Module):
        def once():
            with precision:
                out = module(inputs[name], masks)
            torch.autograd.grad(out, [inputs[name], *module.parameters()], grad_out.to(out.dtype))
        return once

    outputs = []
    for name, variant in variants.items():
        torch.manual_seed(1)  # dropout: the same draws for every variant
        with precision:
            outputs.append(variant.layer(inputs[name], masks).float())
    difference = max((out - outputs[0]).abs().max() for out in outputs[1:]) / outputs[0].abs().max()
    figures: dict[str, dict[str, float]] = {}
    for name, variant in variants.items():
        with OpCounter() as counter:
            fwd_bwd(name, variant.layer)()
        figures[name] = {"ops": counter.total}
    runs = {}
    for name, variant in variants.items():
        runs[name] = fwd_bwd(name, torch.compile(variant.layer) if compile else variant.layer)
        if compile:
            figures[name].update(compiled_counts(name, runs[name]))  # compiles its forward and backward
    for name, ms in medians_ms(runs, reps, cuda).items():
        figures[name]["ms"] = ms
    print(f"device={torch.cuda.get_device_name() if cuda else 'cpu'} preset={args.preset} layer (hidden "
          f"{config.hidden_size}, heads {config.num_heads} x {config.head_dim}) batch={batch} seq={seq} "
          f"precision={'bf16 autocast' if autocast else 'fp32'} compile={'on' if compile else 'off'} "
          f"threads={torch.get_num_threads()} reps={reps}")
    print(f"largest difference of the outputs over the largest output: {difference:.1e}")
    print(f"{'layer':<48}{'fwd+bwd (ms)':>14}{'eager ops':>11}"
          + (f"{'kernels':>9}{'MB moved':>10}{'MB fused':>10}" if compile else ""))
    for name, f in figures.items():
        print(f"{name:<48}{f['ms']:>14.3f}{f['ops']:>11,}"
              + (f"{f['kernels']:>9,}{f['mb']:>10.1f}{f['fused_mb']:>10.1f}" if compile else ""))
    return figures


def ratio_line(label: str, top: dict[str, float], bottom: dict[str, float]) -> str:
    """``label: T (time), O (ops)[, K (compiled kernels), B (bytes), F (fused kernels' bytes)]``: one
    variant's figures over another's."""
    parts = [f"{top[key] / bottom[key]:.3f} ({what})" for key, what in
             (("ms", "time"), ("ops", "ops"), ("kernels", "compiled kernels"), ("mb", "bytes"),
              ("fused_mb", "fused kernels' bytes")) if key in top]
    return f"{label}: " + ", ".join(parts)
