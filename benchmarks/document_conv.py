"""The span-aware key's depthwise conv over packed documents: the Triton kernels the model uses on a GPU
(``impl="triton"``, CUDA only) and its K shifted multiply-adds (``impl="torch"``,
``convbert_ds/model/depthwise.py``) against the unfold + einsum they replaced, with torch's depthwise
``conv1d`` (one document per row: it cannot mask per position) and the torch path's form before it kept
``x`` itself (a padded fp32 copy kept, the weights read with a stride of K; the last line is the A/B)
beside them.

    python benchmarks/document_conv.py                  # CUDA: ConvBERT-base's shape under bf16 autocast; CPU: fp32
    python benchmarks/document_conv.py --compile        # each variant through torch.compile (the paper configs' path)
    python benchmarks/document_conv.py --batch 8 --threads 2 --compile --x-dtype bf16

Forward + backward of the conv alone, as the model calls it: ``x`` ``[B, T, C]`` a LayerNorm's output (in
bf16 on CUDA, where the paper configs keep the residual stream in bf16, ``residual_dtype: autocast``; in
fp32 on CPU; ``--x-dtype``), the weight ``[C, K]`` in fp32, under bf16 autocast on CUDA or with a bf16
``x``. Documents of about a third of the sequence each. Median of ``--reps`` runs after warm-up, all
variants on the same inputs in one process; the ratio is each variant's time over the einsum's. The packed
variants are checked against the einsum first. With ``--compile`` each variant also reports inductor's
count of the kernels its forward and backward launch and the bytes they move
(``compiled_counts`` in ``benchmarks/common.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/document_conv.py` finds common

from benchmarks.common import compiled_counts, medians_ms, three_documents_per_sample  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.model.depthwise import _padded, _shifted_multiply_adds, document_depthwise_conv  # noqa: E402
from convbert_ds.model.sdconv import same_segment_taps  # noqa: E402

BASELINE = "unfold + einsum (before)"


def unfold_einsum(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The packed path the model had before: each position's K-tap window (a view), weighted per channel,
    contracted with its taps."""
    kernel_size = weight.shape[1]
    windows = F.pad(x, (0, 0, kernel_size // 2, kernel_size // 2)).unfold(1, kernel_size, 1)  # [B, T, C, K]
    return torch.einsum("btck,btk->btc", windows * weight, taps.to(x.dtype))


def conv1d_one_document(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    kernel_size = weight.shape[1]
    return F.conv1d(x.transpose(1, 2), weight[:, None, :], padding=kernel_size // 2,
                    groups=x.shape[2]).transpose(1, 2)


def triton_kernels(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    return document_depthwise_conv(x, weight, taps, impl="triton")


class _KeepsPaddedX(torch.autograd.Function):
    """The torch path as it was before it kept ``x`` itself (2026-11-27): the forward keeps a padded fp32
    copy of ``x`` for the weights' gradient (inductor's partitioner never recomputes a pad, so it writes that
    copy), and every kernel reads the weights ``[C, K]`` with a stride of K across channels."""

    @staticmethod
    def forward(ctx, x, weight, taps):
        padded, weight32, taps32 = _padded(x.float(), weight.shape[1]), weight.float(), taps.float()
        ctx.save_for_backward(padded, weight32, taps32)
        ctx.dtypes = x.dtype, weight.dtype
        return _shifted_multiply_adds(padded, weight32.t(), taps32).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        padded, weight, taps = ctx.saved_tensors
        kernel_size, seq_len, grad_out = weight.shape[1], grad_out.shape[1], grad_out.float()
        grad_x = _shifted_multiply_adds(_padded(grad_out, kernel_size), weight.t().flip(0), taps)
        grad_weight = torch.stack([(grad_out * taps[:, :, k, None] * padded[:, k:k + seq_len]).sum((0, 1))
                                   for k in range(kernel_size)], dim=1)
        return grad_x.to(ctx.dtypes[0]), grad_weight.to(ctx.dtypes[1]), None


TORCH_PATH = "shifted multiply-adds (torch)"
KEPT_PADDED = "torch, fp32 pad kept (before)"
VARIANTS = {"conv1d, one document (no mask)": conv1d_one_document, BASELINE: unfold_einsum,
            KEPT_PADDED: _KeepsPaddedX.apply,
            TORCH_PATH: document_depthwise_conv, "Triton kernels (impl=triton)": triton_kernels}


def fwd_bwd(fn, x, weight, taps, grad_out):
    def once():
        out = fn(x, weight, taps)
        torch.autograd.grad(out, (x, weight), grad_out.to(out.dtype))
    return once


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=bounded(int, min=1), default=None, help="default: 128 on CUDA, 8 on CPU")
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--channels", type=bounded(int, min=1), default=768, help="hidden size (base: 768)")
    parser.add_argument("--kernel", type=bounded(int, min=1), default=9, help="conv kernel size K (odd)")
    parser.add_argument("--reps", type=bounded(int, min=1), default=20)
    parser.add_argument("--compile", action="store_true", help="each variant through torch.compile (inductor)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None)
    parser.add_argument("--x-dtype", choices=("fp32", "bf16"), default=None,
                        help="the conv's input (default: bf16 on CUDA, the paper configs' residual stream; fp32 on CPU)")
    args = parser.parse_args(argv)
    if args.kernel % 2 == 0:
        parser.error(f"--kernel {args.kernel}: the conv needs an odd kernel size (ConvBERT's is 9)")
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch = args.batch or (128 if cuda else 8)
    gen = torch.Generator(device=device).manual_seed(0)
    x_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.x_dtype or ("bf16" if cuda else "fp32")]
    x = torch.randn(batch, args.seq, args.channels, device=device, generator=gen).to(x_dtype).requires_grad_()
    weight = torch.randn(args.channels, args.kernel, device=device, generator=gen, requires_grad=True)
    grad_out = torch.randn(batch, args.seq, args.channels, device=device, generator=gen)
    taps = same_segment_taps(three_documents_per_sample(batch, args.seq, device), args.kernel)
    mixed = cuda or x_dtype == torch.bfloat16  # bf16 x: the weight meets it under autocast, as in the model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed)
    # Inductor's C++ code for the einsum's backward with a bf16 x writes past its buffer (torch 2.13 on CPU:
    # the process dies in malloc some calls later), so there the baseline runs eagerly, and says so.
    eager = {BASELINE} if args.compile and not cuda and x_dtype == torch.bfloat16 else set()
    # The Triton kernels on a GPU only (on CPU they would run in Triton's interpreter, which times nothing real).
    variants = {name: torch.compile(fn) if args.compile and name not in eager else fn
                for name, fn in VARIANTS.items() if cuda or fn is not triton_kernels}
    with autocast:
        counts = {name: compiled_counts(name, fwd_bwd(fn, x, weight, taps, grad_out))  # their first call compiles
                  for name, fn in variants.items() if name not in eager} if args.compile else {}
        before = variants[BASELINE](x, weight, taps).float()
        worst = {name: ((variants[name](x, weight, taps).float() - before).abs().max() / before.abs().max()).item()
                 for name in variants if name not in (BASELINE, list(VARIANTS)[0])}
        times = medians_ms({name: fwd_bwd(fn, x, weight, taps, grad_out) for name, fn in variants.items()},
                           args.reps, cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device={name} batch={batch} seq={args.seq} channels={args.channels} K={args.kernel} x={x.dtype} "
          f"precision={'bf16 autocast' if mixed else 'fp32'} compile={'on' if args.compile else 'off'} "
          f"threads={torch.get_num_threads()} reps={args.reps}")
    print("the packed variants against the einsum (largest difference over the largest output): "
          + ", ".join(f"{name} {diff:.1e}" for name, diff in worst.items()))
    # The fewest bytes forward and backward can move: read x, write out; read the gradient and x, write dx.
    least_bytes = 5 * x.numel() * x.element_size()
    print(f"{'variant':<34}{'fwd+bwd (ms)':>14}{'/ einsum':>10}{'GB/s at the fewest bytes':>26}"
          + (f"{'kernels':>9}{'MB moved':>10}" if counts else ""))
    for variant, ms in times.items():
        counted = f"{counts[variant]['kernels']:>9,}{counts[variant]['mb']:>10.1f}" if variant in counts else \
            f"{'eager':>9}" if counts else ""
        print(f"{variant:<34}{ms:>14.3f}{ms / times[BASELINE]:>10.2f}{least_bytes / ms / 1e6:>26,.2f}{counted}")
    print(f"torch path / its form before: {times[TORCH_PATH] / times[KEPT_PADDED]:.3f} (time)"
          + (f", {counts[TORCH_PATH]['mb'] / counts[KEPT_PADDED]['mb']:.3f} (bytes)" if counts else ""))


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
