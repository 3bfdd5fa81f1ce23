"""The depthwise convolution of ConvBERT's span-aware key over packed documents.

Each channel ``c`` of ``x`` ``[B, T, C]`` is convolved over time with its own K taps (``same`` padding)::

    out[b, t, c] = sum_k weight[c, k] * taps[b, t, k] * x[b, t + k - (K-1)/2, c]

``taps`` ``[B, T, K]`` is 1 where tap ``k`` of position ``t`` lies in ``t``'s own document and 0 where it
crosses a document boundary or the sequence's ends, so the convolution restarts at every boundary. Without
documents the model calls ``nn.Conv1d`` instead, which cannot mask per position.

Why a function of its own: the obvious form, an unfold of ``x`` contracted with the taps (``einsum``), builds
a K-times copy of ``x`` in forward and, in backward, a batched outer product ``[B*T, C, 1] x [B*T, 1, K]``
that cuBLAS runs at a small fraction of its speed. On an H100 that path took about a third of a compiled
ConvBERT-base step's device time (``benchmarks/RESULTS.md``, 2026-11-26). Here forward and backward are K
shifted multiply-adds into one buffer each, which inductor fuses into a few elementwise kernels and which
eager runs without the K-times copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _DocumentDepthwiseConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, taps):
        kernel_size, seq_len = weight.shape[1], x.shape[1]
        # Half-precision inputs accumulate in fp32 (as cuDNN's conv does); the output is x's dtype.
        compute_dtype = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
        padded = F.pad(x.to(compute_dtype), (0, 0, kernel_size // 2, kernel_size // 2))
        weight_c, taps_c = weight.to(compute_dtype), taps.to(compute_dtype)
        out = torch.zeros_like(padded[:, :seq_len])
        for k in range(kernel_size):
            out.addcmul_(padded[:, k:k + seq_len] * taps_c[:, :, k, None], weight_c[:, k])
        ctx.save_for_backward(padded, weight_c, taps_c)
        ctx.dtypes = (x.dtype, weight.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        padded, weight, taps = ctx.saved_tensors
        x_dtype, weight_dtype = ctx.dtypes
        kernel_size, seq_len = weight.shape[1], grad_out.shape[1]
        grad_out = grad_out.to(padded.dtype)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # Each tap sent weight[c, k] * x[t + k - p] to position t: send the gradient back the same way.
            grad_padded = torch.zeros_like(padded)
            for k in range(kernel_size):
                grad_padded[:, k:k + seq_len].addcmul_(grad_out * taps[:, :, k, None], weight[:, k])
            grad_x = grad_padded[:, kernel_size // 2:kernel_size // 2 + seq_len].to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.stack([(grad_out * taps[:, :, k, None] * padded[:, k:k + seq_len]).sum((0, 1))
                                       for k in range(kernel_size)], dim=1).to(weight_dtype)
        return grad_x, grad_weight, None


def document_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T, C]``, ``weight`` ``[C, K]`` (K odd), ``taps`` ``[B, T, K]`` (0 or 1) -> ``[B, T, C]`` in
    ``x``'s dtype; see the module docstring. The taps get no gradient."""
    if x.dim() != 3 or weight.shape != (x.shape[2], weight.shape[1]) or taps.shape != (*x.shape[:2], weight.shape[1]):
        raise ValueError(f"document_depthwise_conv expects x [B, T, C], weight [C, K] and taps [B, T, K]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)} and {tuple(taps.shape)}")
    return _DocumentDepthwiseConv.apply(x, weight, taps)
