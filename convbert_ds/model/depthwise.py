"""The depthwise convolution of ConvBERT's span-aware key over packed documents.

Each channel ``c`` of ``x`` ``[B, T, C]`` is convolved over time with its own K taps (``same`` padding)::

    out[b, t, c] = sum_k weight[c, k] * taps[b, t, k] * x[b, t + k - (K-1)/2, c]

``taps`` ``[B, T, K]`` is 1 where tap ``k`` of position ``t`` lies in ``t``'s own document and 0 where it
crosses a document boundary or the sequence's ends, so the convolution restarts at every boundary. Without
documents the model calls ``nn.Conv1d`` instead, which cannot mask per position.

Being in the same document is symmetric: tap ``k`` of ``t`` is on exactly when tap ``K-1-k`` of
``t + k - (K-1)/2`` is (``sdconv.same_segment_taps``, which makes every ``taps`` the model passes). So the
gradient of ``x`` is this same convolution of the output's gradient ``g``, each channel's weights reversed::

    dx[b, s, c] = sum_k weight[c, K-1-k] * taps[b, s, k] * g[b, s + k - (K-1)/2, c]

The torch path's backward computes it so: a gather like the forward, which inductor compiles to one pass
that writes ``x``'s dtype. Scattering each tap's share into a padded fp32 buffer (the form before) wrote that
buffer and read it back to cast it: with a bf16 ``x`` (the paper configs' residual stream), inductor counts
26.2 MB for that form's forward and backward against 18.1 now (CPU, batch 8 x 128 x 768,
``benchmarks/document_conv.py --compile --x-dtype bf16``).

Why a function of its own: the obvious form, an unfold of ``x`` contracted with the taps (``einsum``), builds
a K-times copy of ``x`` in forward and, in backward, a batched outer product ``[B*T, C, 1] x [B*T, 1, K]``
that cuBLAS runs at a small fraction of its speed. On an H100 that path took about a third of a compiled
ConvBERT-base step's device time (``benchmarks/RESULTS.md``, 2026-11-26). Here (``impl="torch"``, any
device) forward and backward are K shifted multiply-adds into one buffer each, without the K-times copy;
still a pass over ``x`` per tap (2.97 ms a layer eager on an H200, 2026-11-27), and 27 multiply-adds a layer
for inductor to trace and schedule (the small preset's whole step took 39% longer to compile on CPU than
with the einsum). ``impl="triton"`` runs Triton kernels instead
(``convbert_ds.kernels.document_conv_triton``): one pass over ``x`` forward, one over ``x`` and the gradient
backward, and inductor keeps them out of its graph as custom ops. ``"auto"`` picks them on CUDA once a probe
has checked them there against this path, as for SDConv (``model/sdconv.py``), except under ``torch.compile``,
where this path is faster (``benchmarks/document_conv.py --compile``); ``probe_document_conv`` runs that
probe eagerly, ahead of ``torch.compile`` or a CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from convbert_ds.config import ModelConfig
from convbert_ds.model.sdconv import (cached_reason, largest_difference, probe_once, resolve_impl, same_segment_taps,
                                      value_and_grads)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _padded(x: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """``x`` ``[B, T, C]`` with (K-1)/2 zero positions before and after."""
    return F.pad(x, (0, 0, kernel_size // 2, kernel_size // 2))


def _shifted_multiply_adds(padded: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``out[b, t, c] = sum_k weight[c, k] * taps[b, t, k] * padded[b, t + k, c]``, in ``padded``'s dtype."""
    kernel_size = weight.shape[1]
    seq_len = padded.shape[1] - (kernel_size - 1)
    out = torch.zeros_like(padded[:, :seq_len])
    for k in range(kernel_size):
        out.addcmul_(padded[:, k:k + seq_len] * taps[:, :, k, None], weight[:, k])
    return out


class _DocumentDepthwiseConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, taps):
        # Half-precision inputs accumulate in fp32 (as cuDNN's conv does); the output is x's dtype.
        compute_dtype = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
        padded = _padded(x.to(compute_dtype), weight.shape[1])
        weight_c, taps_c = weight.to(compute_dtype), taps.to(compute_dtype)
        ctx.save_for_backward(padded, weight_c, taps_c)
        ctx.dtypes = (x.dtype, weight.dtype)
        return _shifted_multiply_adds(padded, weight_c, taps_c).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        padded, weight, taps = ctx.saved_tensors
        x_dtype, weight_dtype = ctx.dtypes
        kernel_size, seq_len = weight.shape[1], grad_out.shape[1]
        grad_out = grad_out.to(padded.dtype)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:  # the same conv of the gradient, taps reversed (module docstring)
            grad_x = _shifted_multiply_adds(_padded(grad_out, kernel_size), weight.flip(1), taps).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.stack([(grad_out * taps[:, :, k, None] * padded[:, k:k + seq_len]).sum((0, 1))
                                       for k in range(kernel_size)], dim=1).to(weight_dtype)
        return grad_x, grad_weight, None


def document_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor,
                            impl: str = "torch") -> torch.Tensor:
    """``x`` ``[B, T, C]``, ``weight`` ``[C, K]`` (K odd), ``taps`` ``[B, T, K]`` -> ``[B, T, C]`` in ``x``'s
    dtype; see the module docstring (``impl``: ``torch``, ``triton`` or ``auto``). ``taps`` is a same-document
    mask as ``sdconv.same_segment_taps`` makes it (the torch path's gradient relies on its symmetry); it gets
    no gradient."""
    if x.dim() != 3 or weight.shape != (x.shape[2], weight.shape[1]) or taps.shape != (*x.shape[:2], weight.shape[1]):
        raise ValueError(f"document_depthwise_conv expects x [B, T, C], weight [C, K] and taps [B, T, K]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)} and {tuple(taps.shape)}")
    chosen = resolve_impl(impl, x.device)
    if impl == "auto" and torch.compiler.is_compiling():
        # Traced, the torch path is the faster one: inductor fuses its shifted multiply-adds with their
        # neighbours, while the Triton op is a fusion barrier (forward + backward at ConvBERT-base's shape on an
        # H200 under torch.compile: 0.79 ms against 1.12 ms; eager the Triton kernels win, 0.75 against 2.97).
        chosen = "torch"
    if chosen == "triton" and impl == "auto":
        device, kernel_size = x.device, weight.shape[1]
        if cached_reason(_probe_key(device, kernel_size),
                         lambda: document_conv_unusable_reason(device, kernel_size)) is not None:
            chosen = "torch"
    if chosen == "triton":
        from convbert_ds.kernels import triton_document_conv  # here: CPU runs never import Triton
        return triton_document_conv(x, weight, taps)
    return _DocumentDepthwiseConv.apply(x, weight, taps)


def _probe_key(device: torch.device, kernel_size: int) -> tuple:
    return device, "document conv", kernel_size


@torch.compiler.disable  # the probe builds inputs and runs kernels: a graph break under torch.compile
def document_conv_unusable_reason(device: torch.device, kernel_size: int) -> str | None:
    """Why the Triton kernels of this conv cannot run on ``device`` for kernel size ``kernel_size``, or None
    when they can (cached; see ``sdconv.probe_once``). Forward and backward on a small packed input, in fp32
    (``x`` is a LayerNorm's output under autocast) and in bf16 (DeepSpeed's bf16 weights), against this
    module's torch path; the bf16 difference counts against a tolerance 200 times wider."""
    def compare() -> float:
        from convbert_ds.kernels import triton_document_conv  # inside the probe: importing Triton can fail too
        gen = torch.Generator().manual_seed(0)
        documents = (torch.arange(40) >= 17).long().expand(2, -1)  # a boundary; T spans several position blocks
        taps = same_segment_taps(documents, kernel_size).to(device)
        x32 = torch.randn(2, 40, 24, generator=gen).to(device)
        weight32 = torch.randn(24, kernel_size, generator=gen).to(device)
        grad_out32 = torch.randn(2, 40, 24, generator=gen).to(device)
        worst = 0.0
        for dtype, scale in ((torch.float32, 1.0), (torch.bfloat16, 1 / 200)):
            x, weight, grad_out = (t.to(dtype) for t in (x32, weight32, grad_out32))
            results = [value_and_grads(fn, (x, weight), (taps,), grad_out)
                       for fn in (triton_document_conv, _DocumentDepthwiseConv.apply)]
            worst = max(worst, scale * largest_difference(*results))
        return worst

    return probe_once(_probe_key(device, kernel_size), f"depthwise conv kernels (K={kernel_size})", compare, 1e-4)



def probe_document_conv(model: nn.Module | ModelConfig, device: torch.device | str) -> dict[tuple, str | None]:
    """Probe the Triton kernels of this conv, eagerly, for every kernel size of ``model`` that ``"auto"`` sends
    to them on ``device`` (before ``torch.compile``, as ``sdconv.probe_sdconv``). Returns ``key -> reason``
    (None: the kernels are used); empty where ``"auto"`` does not pick Triton."""
    device = torch.empty(0, device=device).device  # the index CUDA tensors carry, so the keys match theirs
    configs = [model] if isinstance(model, ModelConfig) else [getattr(m, "config", None) for m in model.modules()]
    sizes = {config.conv_kernel_size for config in configs
             if isinstance(config, ModelConfig) and config.conv_type in ("sdconv", "conventional")
             and config.sdconv_impl == "auto" and resolve_impl("auto", device) == "triton"}
    return {_probe_key(device, size): document_conv_unusable_reason(device, size) for size in sorted(sizes)}
