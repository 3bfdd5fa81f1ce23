"""Triton kernels of the model, each registered as custom ops (fake implementations and an autograd formula),
so that ``torch.compile(fullgraph=True)`` keeps them in its graph as opaque calls:

- ``triton_dynamic_conv``, what ``dynamic_conv(impl="triton")`` calls: fused SDConv, the same contract as
  ``convbert_ds.model.sdconv.dynamic_conv_reference``; kernels in ``sdconv_triton`` (their docstring has
  the maths, block layout and precision); ops ``convbert_ds::sdconv_forward`` and ``sdconv_backward``.
- ``triton_document_conv``, what ``document_depthwise_conv(impl="triton")`` calls: the span-aware key's
  depthwise conv over packed documents; kernels in ``document_conv_triton``; ops
  ``convbert_ds::document_conv_forward`` and ``document_conv_backward``.
"""

from __future__ import annotations

import torch
from torch import library as torch_ops

from convbert_ds.kernels import document_conv_triton, sdconv_triton
from convbert_ds.kernels.sdconv_triton import MAX_KERNEL_SIZE, SUPPORTED_DTYPES

__all__ = ["triton_dynamic_conv", "triton_document_conv", "MAX_KERNEL_SIZE", "SUPPORTED_DTYPES"]


@torch_ops.custom_op("convbert_ds::sdconv_forward", mutates_args=())
def sdconv_forward(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None,
                   segments: torch.Tensor | None, store_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [B, T, n, d]`` in ``values.dtype`` and the fp32 ``lse [B, n, T]`` that backward needs (``[0]``
    unless ``store_lse``); ``value_mask`` None or fp32 ``[B, T]``; ``segments`` None or int32 ``[B, T]``."""
    return sdconv_triton.sdconv_forward(kernel_logits, values, value_mask, segments, store_lse)


@sdconv_forward.register_fake
def _(kernel_logits, values, value_mask, segments, store_lse):
    batch, seq_len, heads, _ = kernel_logits.shape
    lse_shape = (batch, heads, seq_len) if store_lse else (0,)
    return values.new_empty(values.shape), values.new_empty(lse_shape, dtype=torch.float32)


@torch_ops.custom_op("convbert_ds::sdconv_backward", mutates_args=())
def sdconv_backward(grad_out: torch.Tensor, kernel_logits: torch.Tensor, values: torch.Tensor,
                    value_mask: torch.Tensor | None, segments: torch.Tensor | None, lse: torch.Tensor,
                    need_grad_logits: bool, need_grad_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_logits, grad_values)``, contiguous in the dtypes of ``kernel_logits`` and ``values``; one not
    asked for comes back empty (``[0]``), as a custom op cannot return None."""
    grads = sdconv_triton.sdconv_backward(grad_out, kernel_logits, values, value_mask, segments, lse,
                                          need_grad_logits=need_grad_logits, need_grad_values=need_grad_values)
    return tuple(_skipped_grad(like) if grad is None else grad for grad, like in zip(grads, (kernel_logits, values)))


@sdconv_backward.register_fake
def _(grad_out, kernel_logits, values, value_mask, segments, lse, need_grad_logits, need_grad_values):
    return tuple(like.new_empty(like.shape) if needed else _skipped_grad(like)
                 for needed, like in ((need_grad_logits, kernel_logits), (need_grad_values, values)))


def _skipped_grad(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def _setup_context(ctx, inputs, output):
    kernel_logits, values, value_mask, segments, _ = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(kernel_logits, values, value_mask, segments, lse)


def _backward(ctx, grad_out, _grad_lse):
    kernel_logits, values, value_mask, segments, lse = ctx.saved_tensors
    need_logits, need_values = ctx.needs_input_grad[:2]
    grad_logits, grad_values = sdconv_backward(grad_out, kernel_logits, values, value_mask, segments, lse,
                                               need_logits, need_values)
    return (grad_logits if need_logits else None), (grad_values if need_values else None), None, None, None


sdconv_forward.register_autograd(_backward, setup_context=_setup_context)


def triton_dynamic_conv(kernel_logits: torch.Tensor, values: torch.Tensor,
                        value_mask: torch.Tensor | None = None, segments: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Fused softmax + dynamic convolution, differentiable in ``kernel_logits`` and ``values``.

    Args:
        kernel_logits: ``[B, T, n, K]`` pre-softmax logits, K odd and at most 31; fp32, fp16 or bf16.
        values: ``[B, T, n, d]``; fp32, fp16 or bf16 (may differ from the logits' dtype).
        value_mask: optional ``[B, T]`` (any dtype), multiplied into ``values``: nonzero = real token.
        segments: optional ``[B, T]`` integer ids (packed documents): taps into another segment read zero.
    Returns:
        ``[B, T, n, d]`` in ``values.dtype``; softmax and accumulation in fp32. Inputs may have any
        strides (no copies are made); gradients come back contiguous in the inputs' dtypes.
    """
    _check_inputs(kernel_logits, values, value_mask, segments)
    if value_mask is not None:
        value_mask = value_mask.to(torch.float32)  # [B, T]: tiny, and keeps bool/int masks out of the kernels
    if segments is not None:
        segments = segments.to(torch.int32)
    # The log-sum-exp is only stored for a backward (the op's autograd formula runs under the same test).
    store_lse = torch.is_grad_enabled() and (kernel_logits.requires_grad or values.requires_grad)
    out, _ = sdconv_forward(kernel_logits, values, value_mask, segments, store_lse)
    return out


def _check_inputs(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None,
                  segments: torch.Tensor | None) -> None:
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
    for name, mask in (("value_mask", value_mask), ("segments", segments)):
        if mask is not None and tuple(mask.shape) != tuple(values.shape[:2]):
            raise ValueError(f"{name} must be [B, T] = {tuple(values.shape[:2])}, got {tuple(mask.shape)}")
    for name, tensor in (("kernel_logits", kernel_logits), ("values", values)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton_dynamic_conv supports {SUPPORTED_DTYPES} for {name}, got {tensor.dtype}")
    tensors = [kernel_logits, values] + [mask for mask in (value_mask, segments) if mask is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"triton_dynamic_conv needs all inputs on one device, got {sorted(map(str, devices))}")
    if values.device.type == "cpu" and not sdconv_triton.INTERPRET:
        raise RuntimeError("triton_dynamic_conv got CPU tensors: the Triton kernels need a GPU, or TRITON_INTERPRET=1 "
                           "set before triton is imported; on CPU use dynamic_conv(..., impl='torch')")


@torch_ops.custom_op("convbert_ds::document_conv_forward", mutates_args=())
def document_conv_forward(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``out [B, T, C]`` in ``x.dtype``."""
    return document_conv_triton.document_conv_forward(x, weight, taps)


@document_conv_forward.register_fake
def _(x, weight, taps):
    return x.new_empty(x.shape)


@torch_ops.custom_op("convbert_ds::document_conv_backward", mutates_args=())
def document_conv_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor,
                           need_grad_x: bool, need_grad_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_w)`` in the dtypes of ``x`` and ``weight``; one not asked for comes back empty."""
    grads = document_conv_triton.document_conv_backward(grad_out, x, weight, taps, need_grad_x, need_grad_w)
    return tuple(_skipped_grad(like) if grad is None else grad for grad, like in zip(grads, (x, weight)))


@document_conv_backward.register_fake
def _(grad_out, x, weight, taps, need_grad_x, need_grad_w):
    return tuple(like.new_empty(like.shape) if needed else _skipped_grad(like)
                 for needed, like in ((need_grad_x, x), (need_grad_w, weight)))


def _document_conv_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _document_conv_backward(ctx, grad_out):
    x, weight, taps = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    grad_x, grad_w = document_conv_backward(grad_out, x, weight, taps, need_x, need_w)
    return (grad_x if need_x else None), (grad_w if need_w else None), None


document_conv_forward.register_autograd(_document_conv_backward, setup_context=_document_conv_setup_context)


def triton_document_conv(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The depthwise conv over packed documents (``convbert_ds.model.depthwise``), differentiable in ``x`` and
    ``weight``: ``x`` ``[B, T, C]``, ``weight`` ``[C, K]``, ``taps`` ``[B, T, K]`` (0 or 1; no gradient), any
    strides, fp32, fp16 or bf16 each -> ``[B, T, C]`` in ``x``'s dtype, fp32 inside."""
    for name, tensor in (("x", x), ("weight", weight), ("taps", taps)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton_document_conv supports {SUPPORTED_DTYPES} for {name}, got {tensor.dtype}")
    if x.device.type == "cpu" and not document_conv_triton.INTERPRET:
        raise RuntimeError("triton_document_conv got CPU tensors: the Triton kernels need a GPU, or "
                           "TRITON_INTERPRET=1 set before triton is imported; on CPU use impl='torch'")
    return document_conv_forward(x, weight, taps)
