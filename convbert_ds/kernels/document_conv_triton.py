"""Triton kernels for the span-aware key's depthwise convolution over packed documents.

Maths (``convbert_ds.model.depthwise``), with ``P = (K - 1) / 2`` and ``taps`` 0 or 1::

    out[b, t, c]  = sum_k w[c, k] * taps[b, t, k] * x[b, t + k - P, c]

Backward, with ``g = dL/dout``::

    dx[b, s, c]   = sum_k w[c, k] * taps[b, s - k + P, k] * g[b, s - k + P, c]
    dw[c, k]      = sum_{b, t} g[b, t, c] * taps[b, t, k] * x[b, t + k - P, c]

Why kernels of their own: in PyTorch the same sums are K shifted multiply-adds, each a full pass over
``[B, T, C]`` in forward and two in backward (one for ``dx``, one reduction per tap for ``dw``): many times
the time the bytes that must move (``x`` and ``out``, then ``g``, ``x`` and ``dx``, in fp32) need
(benchmarks/RESULTS.md#row-document-conv-eager). Here each element of ``x`` and ``g`` is read from device memory about
once; the K shifted windows are re-read from L1/L2.

Block layout: a forward program owns ``BLOCK_T`` positions x ``BLOCK_C`` channels of one sample. A backward
program owns ``BLOCK_C`` channels of one whole sample: it walks the sample's positions in ``BLOCK_T`` steps,
writing ``dx`` for each and summing ``dw`` over them, and stores that sample's ``dw`` ``[C, K]`` (fp32). The
per-sample sums are added by one ``sum`` over the batch afterwards: no atomics, and the backward's block
shape is fixed (not tuned), so a run is bit-for-bit repeatable (exact resume relies on it).

Precision: loads are cast to fp32 right away; products and sums are fp32; ``out`` and ``dx`` are rounded once
to ``x``'s dtype, ``dw`` to the weight's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from convbert_ds.kernels.device import on_device_of

INTERPRET = bool(knobs.runtime.interpret)  # @triton.jit picks the interpreter at import time


def _forward_configs() -> list[triton.Config]:
    if INTERPRET:  # one config, no benchmarking; small blocks so short test inputs span several programs
        return [triton.Config({"BLOCK_T": 16, "BLOCK_C": 16}, num_warps=4)]
    return [triton.Config({"BLOCK_T": block_t, "BLOCK_C": block_c}, num_warps=warps)
            for block_t, block_c, warps in ((32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (16, 128, 4))]


def _backward_configs() -> list[triton.Config]:
    # One config, not tuned: dw sums over positions in BLOCK_T tiles, in an order the block shape and warp
    # count decide, so a tuner free to pick another config after a restart (timing noise) would change dw's
    # last bits, and exact resume with it. The forward and dx sum over the K taps in each thread, in any
    # config, so the forward is tuned.
    return [triton.Config({"BLOCK_T": 16, "BLOCK_C": 16} if INTERPRET else {"BLOCK_T": 32, "BLOCK_C": 64},
                          num_warps=4)]


# T_TUNE: T rounded up to a power of two, as for the SDConv kernels (tuning on T itself re-benchmarks at
# every new sequence length). The kernels never read it.
_TUNE_KEY = ["T_TUNE", "C", "KERNEL_SIZE"]


@triton.autotune(configs=_forward_configs(), key=_TUNE_KEY, cache_results=True)
@triton.jit
def _document_conv_fwd_kernel(
    x_ptr, w_ptr, taps_ptr, out_ptr, T, T_TUNE, C,
    sx_b, sx_t, sx_c, sw_c, sw_k, st_b, st_t, st_k,
    KERNEL_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    PAD: tl.constexpr = (KERNEL_SIZE - 1) // 2
    n_t_blocks = tl.cdiv(T, BLOCK_T)
    b = (tl.program_id(0) // n_t_blocks).to(tl.int64)
    offs_t = (tl.program_id(0) % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, c_ok = offs_t < T, offs_c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(KERNEL_SIZE):
        src = offs_t + (k - PAD)
        src_ok = row_ok & (src >= 0) & (src < T)
        tap = tl.load(taps_ptr + b * st_b + offs_t * st_t + k * st_k, mask=row_ok, other=0.0).to(tl.float32)
        w_k = tl.load(w_ptr + offs_c * sw_c + k * sw_k, mask=c_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + b * sx_b + src[:, None] * sx_t + offs_c[None, :] * sx_c,
                    mask=src_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        acc += (x * tap[:, None]) * w_k[None, :]
    out_rows = out_ptr + (b * T + offs_t) * C
    tl.store(out_rows[:, None] + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & c_ok[None, :])


@triton.autotune(configs=_backward_configs(), key=_TUNE_KEY, cache_results=True)
@triton.jit
def _document_conv_bwd_kernel(
    x_ptr, w_ptr, taps_ptr, grad_out_ptr, grad_x_ptr, grad_w_ptr, T, T_TUNE, C,
    sx_b, sx_t, sx_c, sw_c, sw_k, st_b, st_t, st_k, sg_b, sg_t, sg_c,
    KERNEL_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, NEED_GRAD_X: tl.constexpr, NEED_GRAD_W: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    PAD: tl.constexpr = (KERNEL_SIZE - 1) // 2
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    c_ok = offs_c < C
    x_base, g_base, taps_base = x_ptr + b * sx_b, grad_out_ptr + b * sg_b, taps_ptr + b * st_b
    grad_w = tl.zeros((BLOCK_C, BLOCK_K), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        row_ok = offs_t < T
        if NEED_GRAD_W:
            g_own = tl.load(g_base + offs_t[:, None] * sg_t + offs_c[None, :] * sg_c,
                            mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        grad_x = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for k in tl.static_range(KERNEL_SIZE):
            if NEED_GRAD_W:  # dw[c, k] += sum_t g[t, c] * taps[t, k] * x[t + k - P, c]
                src = offs_t + (k - PAD)
                src_ok = row_ok & (src >= 0) & (src < T)
                tap = tl.load(taps_base + offs_t * st_t + k * st_k, mask=row_ok, other=0.0).to(tl.float32)
                x = tl.load(x_base + src[:, None] * sx_t + offs_c[None, :] * sx_c,
                            mask=src_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                grad_w += tl.where(offs_k[None, :] == k, tl.sum(g_own * x * tap[:, None], axis=0)[:, None], 0.0)
            if NEED_GRAD_X:  # position s was tap k of output position s - k + P
                dst = offs_t - (k - PAD)
                dst_ok = row_ok & (dst >= 0) & (dst < T)
                tap = tl.load(taps_base + dst * st_t + k * st_k, mask=dst_ok, other=0.0).to(tl.float32)
                w_k = tl.load(w_ptr + offs_c * sw_c + k * sw_k, mask=c_ok, other=0.0).to(tl.float32)
                g = tl.load(g_base + dst[:, None] * sg_t + offs_c[None, :] * sg_c,
                            mask=dst_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                grad_x += (g * tap[:, None]) * w_k[None, :]
        if NEED_GRAD_X:
            rows = grad_x_ptr + (b * T + offs_t) * C
            tl.store(rows[:, None] + offs_c[None, :], grad_x.to(grad_x_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & c_ok[None, :])
    if NEED_GRAD_W:  # this sample's share, [C, K] fp32 at grad_w_ptr[b]
        rows = grad_w_ptr + (b * C + offs_c) * KERNEL_SIZE
        tl.store(rows[:, None] + offs_k[None, :], grad_w, mask=c_ok[:, None] & (offs_k[None, :] < KERNEL_SIZE))


def _sizes_and_strides(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> tuple:
    seq_len, channels = x.shape[1], x.shape[2]
    return (seq_len, max(16, triton.next_power_of_2(seq_len)), channels, *x.stride(), *weight.stride(),
            *taps.stride())


def forward_args(x, weight, taps, out) -> tuple[tuple, dict]:
    """Positional arguments and compile-time constants of ``_document_conv_fwd_kernel``."""
    return (x, weight, taps, out, *_sizes_and_strides(x, weight, taps)), dict(KERNEL_SIZE=weight.shape[1])


def backward_args(grad_out, x, weight, taps, grad_x, grad_w_per_sample) -> tuple[tuple, dict]:
    """Positional arguments and compile-time constants of ``_document_conv_bwd_kernel``; a ``None`` output
    is not computed."""
    args = (x, weight, taps, grad_out, x if grad_x is None else grad_x,
            x if grad_w_per_sample is None else grad_w_per_sample, *_sizes_and_strides(x, weight, taps),
            *grad_out.stride())
    kernel_size = weight.shape[1]
    return args, dict(KERNEL_SIZE=kernel_size, BLOCK_K=max(2, triton.next_power_of_2(kernel_size)),
                      NEED_GRAD_X=grad_x is not None, NEED_GRAD_W=grad_w_per_sample is not None)


def document_conv_forward(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel: ``out`` ``[B, T, C]``, contiguous, in ``x``'s dtype."""
    batch, seq_len, channels = x.shape
    out = torch.empty((batch, seq_len, channels), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        args, meta = forward_args(x, weight, taps, out)
        grid = lambda m: (batch * triton.cdiv(seq_len, m["BLOCK_T"]), triton.cdiv(channels, m["BLOCK_C"]))  # noqa: E731
        with on_device_of(x):
            _document_conv_fwd_kernel[grid](*args, **meta)
    return out


def document_conv_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor,
                           need_grad_x: bool, need_grad_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel: ``(dx, dw)``, contiguous, in the dtypes of ``x`` and ``weight``; ``None``
    where not asked for."""
    batch, seq_len, channels = x.shape
    kernel_size = weight.shape[1]
    grad_x = torch.empty((batch, seq_len, channels), dtype=x.dtype, device=x.device) if need_grad_x else None
    per_sample = None
    if need_grad_w:
        allocate = torch.empty if x.numel() > 0 else torch.zeros  # no positions, no launch: an empty sum
        per_sample = allocate((batch, channels, kernel_size), dtype=torch.float32, device=x.device)
    if x.numel() > 0 and (need_grad_x or need_grad_w):
        args, meta = backward_args(grad_out, x, weight, taps, grad_x, per_sample)
        grid = lambda m: (batch, triton.cdiv(channels, m["BLOCK_C"]))  # noqa: E731
        with on_device_of(x):
            _document_conv_bwd_kernel[grid](*args, **meta)
    if per_sample is None:
        return grad_x, None
    return grad_x, per_sample.sum(0).to(weight.dtype)

