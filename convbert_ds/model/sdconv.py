"""The dynamic convolution at the heart of ConvBERT's conv heads.

``dynamic_conv`` is the one function the model calls. It computes, for every
batch ``b``, position ``t`` and conv head ``h``::

    w[b, t, h, :] = softmax(kernel_logits[b, t, h, :])                  (over K, in fp32)
    out[b, t, h, :] = sum_k w[b, t, h, k] * values[b, t + k - (K-1)/2, h, :]

with ``values`` zero outside ``[0, T)`` ("same" padding). The kernel is shared
by the ``d`` channels of a head. This is exactly what transformers' ConvBERT
computes with ``nn.functional.unfold`` + ``matmul``, but the reference below
never builds the K-times copy of ``values``: it adds K shifted views.

Implementations: ``"torch"`` (the reference here, any device) and ``"triton"``
(fused kernels in ``convbert_ds.kernels``); ``"auto"`` picks Triton on CUDA
and the reference elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from convbert_ds.config import SDCONV_IMPLS

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _ReferenceDynamicConv(torch.autograd.Function):
    """Shift-and-add forward and an explicit backward.

    Letting autograd differentiate K slices of a padded tensor would allocate
    and zero-fill a full-size gradient buffer per tap; here one buffer is
    accumulated in place, and only the softmax weights and the padded values
    are kept for backward.
    """

    @staticmethod
    def forward(ctx, kernel_logits, values, value_mask):
        kernel_size, seq_len = kernel_logits.shape[-1], values.shape[1]
        pad = (kernel_size - 1) // 2
        compute_dtype = torch.float32 if values.dtype in _LOW_PRECISION else values.dtype
        softmax_dtype = torch.float32 if kernel_logits.dtype in _LOW_PRECISION else kernel_logits.dtype
        weights = torch.softmax(kernel_logits.to(softmax_dtype), dim=-1).to(compute_dtype)
        values = values.to(compute_dtype)
        if value_mask is not None:
            values = values * value_mask[:, :, None, None].to(compute_dtype)
        padded = F.pad(values, (0, 0, 0, 0, pad, pad))
        out = weights[..., 0, None] * padded[:, :seq_len]
        for k in range(1, kernel_size):
            out.addcmul_(weights[..., k, None], padded[:, k:k + seq_len])
        ctx.save_for_backward(weights, padded, value_mask)
        ctx.dtypes = (kernel_logits.dtype, ctx.needs_input_grad)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weights, padded, value_mask = ctx.saved_tensors
        logits_dtype, needs = ctx.dtypes
        kernel_size, seq_len = weights.shape[-1], grad_out.shape[1]
        pad = (kernel_size - 1) // 2
        grad_out = grad_out.to(padded.dtype)
        grad_logits = grad_values = None
        if needs[0]:
            grad_weights = torch.stack(
                [(grad_out * padded[:, k:k + seq_len]).sum(-1) for k in range(kernel_size)], dim=-1)
            # Softmax backward: w * (g - <g, w>).
            grad_logits = weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True))
            grad_logits = grad_logits.to(logits_dtype)
        if needs[1]:
            grad_padded = torch.zeros_like(padded)
            for k in range(kernel_size):
                grad_padded[:, k:k + seq_len].addcmul_(weights[..., k, None], grad_out)
            grad_values = grad_padded[:, pad:pad + seq_len]
            if value_mask is not None:
                grad_values = grad_values * value_mask[:, :, None, None].to(grad_values.dtype)
        return grad_logits, grad_values, None


def dynamic_conv_reference(kernel_logits: torch.Tensor, values: torch.Tensor,
                           value_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch dynamic convolution; see the module docstring for the maths.

    Args:
        kernel_logits: ``[B, T, n, K]`` pre-softmax kernel logits, K odd.
        values: ``[B, T, n, d]``.
        value_mask: optional ``[B, T]``, nonzero where the position is a real
            token; padded positions then contribute nothing to their neighbours.
            transformers does not mask, so parity needs ``None``.
    Returns:
        ``[B, T, n, d]`` in ``values.dtype``. Half-precision inputs are
        accumulated in fp32.
    """
    _check_shapes(kernel_logits, values, value_mask)
    return _ReferenceDynamicConv.apply(kernel_logits, values, value_mask).to(values.dtype)


def _check_shapes(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None) -> None:
    if kernel_logits.dim() != 4 or values.dim() != 4 or kernel_logits.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"dynamic_conv expects kernel_logits [B, T, n, K] and values [B, T, n, d] with the same B, T, n; "
            f"got {tuple(kernel_logits.shape)} and {tuple(values.shape)}")
    if kernel_logits.shape[-1] % 2 == 0:
        raise ValueError(f"dynamic_conv needs an odd kernel size, got K={kernel_logits.shape[-1]}")
    if value_mask is not None and tuple(value_mask.shape) != tuple(values.shape[:2]):
        raise ValueError(f"value_mask must be [B, T] = {tuple(values.shape[:2])}, got {tuple(value_mask.shape)}")


def resolve_impl(impl: str, device: torch.device) -> str:
    """Turn ``"auto"`` into a concrete implementation for ``device``."""
    if impl not in SDCONV_IMPLS:
        raise ValueError(f"sdconv_impl={impl!r} is not one of {SDCONV_IMPLS}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return impl


def dynamic_conv(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None = None,
                 impl: str = "auto") -> torch.Tensor:
    """Dynamic convolution through the chosen implementation (see module docstring)."""
    if resolve_impl(impl, values.device) == "triton":
        # Here, not at the top: triton is an optional, slow-to-import dependency that CPU runs never need.
        from convbert_ds.kernels import triton_dynamic_conv
        return triton_dynamic_conv(kernel_logits, values, value_mask)
    return dynamic_conv_reference(kernel_logits, values, value_mask)
