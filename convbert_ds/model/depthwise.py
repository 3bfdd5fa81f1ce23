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

The same symmetry moves the shift in the weights' gradient from ``x`` to ``g``::

    dw[c, K-1-k] = sum_{b, s} x[b, s, c] * taps[b, s, k] * g[b, s + k - (K-1)/2, c]

So the torch path's backward reads ``x`` as it is and pads only ``g``; both gradients are gathers like the
forward. Inductor then compiles the forward to one pass that reads ``x`` and writes ``out``, and keeps ``x``
itself for the backward (see ``_DocumentDepthwiseConv``). Each tap's weights are read side by side across
channels (``tap_major_weight``). Each of these cut the bytes inductor's kernels move, against a backward
that kept a padded fp32 copy of ``x`` and read the weights with a stride of K, and before that scattered
``dx`` into a padded fp32 buffer (benchmarks/RESULTS.md#row-document-conv-compiled).

Why a function of its own: the obvious form, an unfold of ``x`` contracted with the taps (``einsum``), builds
a K-times copy of ``x`` in forward and, in backward, a batched outer product ``[B*T, C, 1] x [B*T, 1, K]``
that cuBLAS runs at a small fraction of its speed: that path was a large share of a compiled ConvBERT-base
step's device time (benchmarks/RESULTS.md#row-document-conv-shifted). Here (``impl="torch"``, any device)
forward and backward are K shifted multiply-adds into one buffer each, without the K-times copy; still a
pass over ``x`` per tap (benchmarks/RESULTS.md#row-document-conv-eager), and 27 multiply-adds a layer for
inductor to trace and schedule, a longer whole-step compile than the einsum's
(benchmarks/RESULTS.md#row-document-conv-compile-time). ``impl="triton"`` runs Triton kernels instead
(``convbert_ds.kernels.document_conv_triton``): one pass over ``x`` forward, one over ``x`` and the gradient
backward, and inductor keeps them out of its graph as custom ops. ``"auto"`` picks them on CUDA once a probe
has checked them there against this path, as for SDConv (``model/sdconv.py``), except under ``torch.compile``,
where this path is faster (benchmarks/RESULTS.md#row-document-conv-triton); ``probe_document_conv`` runs that
probe eagerly, ahead of ``torch.compile`` or a CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import library as torch_ops
from torch import nn

from convbert_ds.config import ModelConfig
from convbert_ds.model.sdconv import (cached_reason, eager_only, largest_difference, probe_once, resolve_impl,
                                      same_segment_taps, value_and_grads)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _padded(x: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """``x`` ``[B, T, C]`` with (K-1)/2 zero positions before and after."""
    return F.pad(x, (0, 0, kernel_size // 2, kernel_size // 2))


@torch_ops.custom_op("convbert_ds::tap_major_weight", mutates_args=())
def tap_major_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[C, K]`` as a new contiguous ``[K, C]``: each tap's weights side by side across channels.

    An op of its own so that inductor writes the copy: a plain ``weight.t().contiguous()`` it inlines into its
    consumers, whose loads then still stride over K floats from one channel to the next. Their threads (and
    the C++ kernels' vector lanes) run along channels, so a strided load is one memory transaction per
    channel where a contiguous one serves 32 of them."""
    return weight.t().clone(memory_format=torch.contiguous_format)  # a copy even where .t() is contiguous


@tap_major_weight.register_fake
def _(weight):
    return weight.new_empty((weight.shape[1], weight.shape[0]))


def _to_compute_dtype(padded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eager, ``padded`` cast once, whole. Traced, as it is: ``_shifted_multiply_adds`` casts each tap's
    slice where it reads it, so that inductor reads the tensor in its own dtype instead of writing an fp32
    copy for its K readers."""
    return padded if torch.compiler.is_compiling() else padded.to(dtype)


def _shifted_multiply_adds(padded: torch.Tensor, weight_kc: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``out[b, t, c] = sum_k weight_kc[k, c] * taps[b, t, k] * padded[b, t + k, c]``, in ``weight_kc``'s
    dtype (``padded`` is cast as it is read)."""
    kernel_size, seq_len = weight_kc.shape[0], taps.shape[1]
    out = torch.zeros((*taps.shape[:2], weight_kc.shape[1]), dtype=weight_kc.dtype, device=weight_kc.device)
    for k in range(kernel_size):
        out.addcmul_(padded[:, k:k + seq_len].to(weight_kc.dtype) * taps[:, :, k, None], weight_kc[k])
    return out


class _DocumentDepthwiseConv(torch.autograd.Function):
    """What is kept and padded, and why (the maths is in the module docstring). The backward keeps ``x``
    itself (with a bf16 residual stream, the tensor the layer's projections keep too) and pads only the
    output's gradient. Were it to pad ``x``, the padded copy would be kept: inductor's partitioner never
    recomputes a pad (``constant_pad_nd`` is not among the ops it may), so the forward wrote that copy, in
    fp32, and the backward read it back, twice a bf16 ``x``'s bytes each way. Traced, the gradient is padded
    in its own dtype and each tap's slice cast as it is read (``_to_compute_dtype``), so a pad that inductor
    does write moves half the bytes of an fp32 one."""

    @staticmethod
    def forward(ctx, x, weight, taps):
        # Half-precision inputs accumulate in fp32 (as cuDNN's conv does); the output is x's dtype.
        compute_dtype = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
        weight_kc, taps_c = tap_major_weight(weight.to(compute_dtype)), taps.to(compute_dtype)
        ctx.save_for_backward(x, weight_kc, taps_c)
        ctx.weight_dtype = weight.dtype
        padded = _to_compute_dtype(_padded(x, weight.shape[1]), compute_dtype)
        return _shifted_multiply_adds(padded, weight_kc, taps_c).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight_kc, taps = ctx.saved_tensors
        kernel_size, seq_len = weight_kc.shape[0], grad_out.shape[1]
        padded_grad = _to_compute_dtype(_padded(grad_out, kernel_size), weight_kc.dtype)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:  # the same conv of the gradient, weights reversed (module docstring)
            grad_x = _shifted_multiply_adds(padded_grad, weight_kc.flip(0), taps).to(x.dtype)
        if ctx.needs_input_grad[1]:  # tap K-1-k's weights: the gradient shifted by k (module docstring)
            x_c = x.to(weight_kc.dtype)
            grad_weight = torch.stack(
                [(x_c * taps[:, :, k, None] * padded_grad[:, k:k + seq_len].to(x_c.dtype)).sum((0, 1))
                 for k in reversed(range(kernel_size))], dim=1).to(ctx.weight_dtype)
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
        # neighbours, while the Triton op is a fusion barrier; eager, the Triton kernels win
        # (benchmarks/RESULTS.md#row-document-conv-triton).
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


@eager_only  # the probe builds inputs and runs kernels: a graph break under torch.compile
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
