"""Fused Triton SDConv: ``triton_dynamic_conv`` is what ``dynamic_conv(impl="triton")`` calls.

Same contract as ``convbert_ds.model.sdconv.dynamic_conv_reference``; the kernels
live in ``sdconv_triton`` (their docstring has the maths, block layout and precision).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from convbert_ds.kernels import sdconv_triton
from convbert_ds.kernels.sdconv_triton import MAX_KERNEL_SIZE, SUPPORTED_DTYPES

__all__ = ["triton_dynamic_conv", "MAX_KERNEL_SIZE", "SUPPORTED_DTYPES"]


class _DynamicConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel_logits, values, value_mask, needs_grad):
        out, lse = sdconv_triton.sdconv_forward(kernel_logits, values, value_mask, store_lse=needs_grad)
        if needs_grad:
            ctx.save_for_backward(kernel_logits, values, value_mask, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        kernel_logits, values, value_mask, lse = ctx.saved_tensors
        grad_logits, grad_values = sdconv_triton.sdconv_backward(
            grad_out, kernel_logits, values, value_mask, lse,
            need_grad_logits=ctx.needs_input_grad[0], need_grad_values=ctx.needs_input_grad[1])
        return grad_logits, grad_values, None, None


def triton_dynamic_conv(kernel_logits: torch.Tensor, values: torch.Tensor,
                        value_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Fused softmax + dynamic convolution, differentiable in ``kernel_logits`` and ``values``.

    Args:
        kernel_logits: ``[B, T, n, K]`` pre-softmax logits, K odd and at most 31; fp32, fp16 or bf16.
        values: ``[B, T, n, d]``; fp32, fp16 or bf16 (may differ from the logits' dtype).
        value_mask: optional ``[B, T]`` (any dtype), multiplied into ``values``: nonzero = real token.
    Returns:
        ``[B, T, n, d]`` in ``values.dtype``; softmax and accumulation in fp32. Inputs may have any
        strides (no copies are made); gradients come back contiguous in the inputs' dtypes.
    """
    _check_inputs(kernel_logits, values, value_mask)
    if value_mask is not None:
        value_mask = value_mask.to(torch.float32)  # [B, T]: tiny, and keeps bool/int masks out of the kernels
    # Decided here: inside Function.forward grad mode is always off.
    needs_grad = torch.is_grad_enabled() and (kernel_logits.requires_grad or values.requires_grad)
    return _DynamicConv.apply(kernel_logits, values, value_mask, needs_grad)


def _check_inputs(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None) -> None:
    if kernel_logits.dim() != 4 or values.dim() != 4 or kernel_logits.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"triton_dynamic_conv expects kernel_logits [B, T, n, K] and values [B, T, n, d] with the same "
            f"B, T, n; got {tuple(kernel_logits.shape)} and {tuple(values.shape)}")
    kernel_size = kernel_logits.shape[-1]
    if kernel_size % 2 == 0:
        raise ValueError(f"triton_dynamic_conv needs an odd kernel size, got K={kernel_size}")
    if kernel_size > MAX_KERNEL_SIZE:
        raise ValueError(f"triton_dynamic_conv supports K <= {MAX_KERNEL_SIZE}, got K={kernel_size}; "
                         f"use impl='torch' for wider kernels")
    if value_mask is not None and tuple(value_mask.shape) != tuple(values.shape[:2]):
        raise ValueError(f"value_mask must be [B, T] = {tuple(values.shape[:2])}, got {tuple(value_mask.shape)}")
    for name, tensor in (("kernel_logits", kernel_logits), ("values", values)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton_dynamic_conv supports {SUPPORTED_DTYPES} for {name}, got {tensor.dtype}")
    tensors = [kernel_logits, values] + ([] if value_mask is None else [value_mask])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"triton_dynamic_conv needs all inputs on one device, got {sorted(map(str, devices))}")
    if values.device.type == "cpu" and not sdconv_triton.INTERPRET:
        raise RuntimeError("triton_dynamic_conv got CPU tensors: the Triton kernels need a GPU, or TRITON_INTERPRET=1 "
                           "set before triton is imported; on CPU use dynamic_conv(..., impl='torch')")
