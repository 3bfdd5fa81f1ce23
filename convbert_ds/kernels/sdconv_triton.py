"""Fused Triton kernels for ConvBERT's span-based dynamic convolution (SDConv).

Maths (see ``convbert_ds.model.sdconv``), with ``P = (K - 1) / 2``::

    w[t, k]   = softmax_k(logits[t, :])                       (fp32)
    out[t, :] = sum_k w[t, k] * v[t + k - P, :]                v = values * mask, zero outside [0, T)
                                                               and, with segments, outside t's segment

Backward, with ``g = dL/dout``::

    dw[t, k]      = <g[t, :], v[t + k - P, :]>
    dlogits[t, k] = w[t, k] * (dw[t, k] - sum_j w[t, j] dw[t, j])
    dv[s, :]      = mask[s] * sum_k w[s - k + P, k] * g[s - k + P, :]   (taps within one segment)

Block layout: one program owns ``BLOCK_T`` consecutive positions of one
(batch, head) pair and the whole head dimension (looped in ``BLOCK_D`` chunks).
The K shifted windows of ``v`` (forward, and ``dw``) and of ``g`` (``dv``) are
re-read from L1/L2 per tap instead of being copied K times into an unfold
tensor: HBM sees each element about ``(BLOCK_T + K - 1) / BLOCK_T`` times.

The backward is one kernel with no atomics: every program writes ``dlogits``
and ``dv`` only for its own rows. ``dv`` needs the softmax weights of the
neighbouring rows ``s - k + P``; instead of recomputing their softmax (K
loads of a whole row per tap) the forward stores the fp32 log-sum-exp per
(batch, head, position), 4 bytes per row, and the backward gets any weight as
``exp(logits[t, k] - lse[t])``. No ``[B, T, n, K]`` weight tensor is stored.

Precision: every load is cast to fp32 right away (needed for bf16 under
``TRITON_INTERPRET=1``, and what mixed precision means anyway); softmax and
accumulation are fp32; results are rounded once, to the input's dtype, on store
(GPUs round to nearest; the interpreter truncates fp32 -> bf16, up to one bf16 ulp).

The ``conv_kernel_layer`` projection that produces the logits is not fused in: it is a GEMM that
cuBLAS runs well, its output is 54 values per row against the 384 of ``values``, and fusing it would
move its weight gradient (a reduction over all B*T rows) into these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from convbert_ds.kernels.device import on_device_of

# The @triton.jit decorator picks the interpreter at import time; remember that choice.
INTERPRET = bool(knobs.runtime.interpret)

MAX_KERNEL_SIZE = 31
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK_D = 64


def _configs() -> list[triton.Config]:
    if INTERPRET:
        # One config: no benchmarking, and small blocks so short test sequences span several programs.
        return [triton.Config({"BLOCK_T": 16, "UNROLL_TAPS": True}, num_warps=4)]
    # Each block shape with the K taps unrolled, their loads issued together (8 or 16 tile elements per thread
    # at BLOCK_D = 64: larger tiles spill registers on sm_90), and in a loop. For sm_90 (K = 9, the backward at
    # BLOCK_T 16 x 4 warps) the unrolled kernel takes 161 registers, 3 programs an SM, the loop 64 and 8 (read
    # from the cubins Triton's compiler builds, as tests/kernels/test_kernels_compile.py builds them). Unrolled,
    # the backward moved its bytes far below the GPU's memory bandwidth in the base step; which one is faster
    # is the tuner's to time.
    return [triton.Config({"BLOCK_T": block_t, "UNROLL_TAPS": unrolled}, num_warps=warps)
            for block_t, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 8), (64, 16)) for unrolled in (True, False)]


# T_TUNE is T rounded up to a power of two: tuning keyed on T itself re-benchmarks every config at each new
# sequence length, and fine-tuning with per-batch padding meets dozens of lengths (seconds of tuning for each
# new length). The kernels never read T_TUNE.
_TUNE_KEY = ["T_TUNE", "HEAD_DIM", "KERNEL_SIZE"]


def _tune_length(seq_len: int) -> int:
    return max(16, triton.next_power_of_2(seq_len))


@triton.autotune(configs=_configs(), key=_TUNE_KEY, cache_results=True)
@triton.jit
def _sdconv_fwd_kernel(
    logits_ptr, values_ptr, mask_ptr, seg_ptr, out_ptr, lse_ptr,
    T, T_TUNE, N_HEADS, HEAD_DIM,
    sl_b, sl_t, sl_h, sl_k,
    sv_b, sv_t, sv_h, sv_d,
    sm_b, sm_t, ss_b, ss_t,
    KERNEL_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr, STORE_LSE: tl.constexpr, BLOCK_T: tl.constexpr,
    UNROLL_TAPS: tl.constexpr,
):
    PAD: tl.constexpr = (KERNEL_SIZE - 1) // 2
    pid = tl.program_id(0)
    n_t_blocks = tl.cdiv(T, BLOCK_T)
    bh = (pid // n_t_blocks).to(tl.int64)
    b = bh // N_HEADS
    h = bh % N_HEADS
    offs_t = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_t < T

    l_rows = logits_ptr + b * sl_b + h * sl_h + offs_t * sl_t
    logits = tl.load(l_rows[:, None] + offs_k[None, :] * sl_k,
                     mask=row_ok[:, None] & (offs_k[None, :] < KERNEL_SIZE), other=-float("inf")).to(tl.float32)
    row_max = tl.where(row_ok, tl.max(logits, axis=1), 0.0)
    denom = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)
    lse = row_max + tl.log(tl.where(row_ok, denom, 1.0))  # padding rows: lse = 0, never log(0)
    if STORE_LSE:
        tl.store(lse_ptr + bh * T + offs_t, lse, mask=row_ok)

    v_base = values_ptr + b * sv_b + h * sv_h
    if HAS_SEGMENTS:
        own_seg = tl.load(seg_ptr + b * ss_b + offs_t * ss_t, mask=row_ok, other=-1)
    out_rows = out_ptr + (b * T * N_HEADS + h) * HEAD_DIM + offs_t * (N_HEADS * HEAD_DIM)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for k in tl.range(0, KERNEL_SIZE, loop_unroll_factor=KERNEL_SIZE if UNROLL_TAPS else 1):
            w_k = tl.exp(tl.load(l_rows + k * sl_k, mask=row_ok, other=-float("inf")).to(tl.float32) - lse)
            src = offs_t + (k - PAD)
            src_ok = (src >= 0) & (src < T)
            if HAS_SEGMENTS:  # a tap in another document reads zero
                src_ok = src_ok & (tl.load(seg_ptr + b * ss_b + src * ss_t, mask=src_ok, other=-2) == own_seg)
            v = tl.load(v_base + src[:, None] * sv_t + offs_d[None, :] * sv_d,
                        mask=src_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            if HAS_MASK:
                v = v * tl.load(mask_ptr + b * sm_b + src * sm_t, mask=src_ok, other=0.0).to(tl.float32)[:, None]
            acc += w_k[:, None] * v
        tl.store(out_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.autotune(configs=_configs(), key=_TUNE_KEY, cache_results=True)
@triton.jit
def _sdconv_bwd_kernel(
    logits_ptr, values_ptr, mask_ptr, seg_ptr, lse_ptr, grad_out_ptr, grad_logits_ptr, grad_values_ptr,
    T, T_TUNE, N_HEADS, HEAD_DIM,
    sl_b, sl_t, sl_h, sl_k,
    sv_b, sv_t, sv_h, sv_d,
    sm_b, sm_t, ss_b, ss_t,
    sg_b, sg_t, sg_h, sg_d,
    KERNEL_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr, NEED_GRAD_LOGITS: tl.constexpr, NEED_GRAD_VALUES: tl.constexpr,
    BLOCK_T: tl.constexpr, UNROLL_TAPS: tl.constexpr,
):
    PAD: tl.constexpr = (KERNEL_SIZE - 1) // 2
    pid = tl.program_id(0)
    n_t_blocks = tl.cdiv(T, BLOCK_T)
    bh = (pid // n_t_blocks).to(tl.int64)
    b = bh // N_HEADS
    h = bh % N_HEADS
    offs_t = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_t < T

    l_base = logits_ptr + b * sl_b + h * sl_h
    v_base = values_ptr + b * sv_b + h * sv_h
    g_base = grad_out_ptr + b * sg_b + h * sg_h
    lse_base = lse_ptr + bh * T
    row_off = (b * T * N_HEADS + h) * HEAD_DIM + offs_t * (N_HEADS * HEAD_DIM)
    if HAS_MASK:
        own_mask = tl.load(mask_ptr + b * sm_b + offs_t * sm_t, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_SEGMENTS:
        own_seg = tl.load(seg_ptr + b * ss_b + offs_t * ss_t, mask=row_ok, other=-1)

    grad_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        if NEED_GRAD_LOGITS:
            g_own = tl.load(g_base + offs_t[:, None] * sg_t + offs_d[None, :] * sg_d,
                            mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        grad_v = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for k in tl.range(0, KERNEL_SIZE, loop_unroll_factor=KERNEL_SIZE if UNROLL_TAPS else 1):
            if NEED_GRAD_LOGITS:
                # dw[t, k] = <g[t], v[t + k - P]>
                src = offs_t + (k - PAD)
                src_ok = (src >= 0) & (src < T)
                if HAS_SEGMENTS:
                    src_ok = src_ok & (tl.load(seg_ptr + b * ss_b + src * ss_t, mask=src_ok, other=-2) == own_seg)
                v = tl.load(v_base + src[:, None] * sv_t + offs_d[None, :] * sv_d,
                            mask=src_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                if HAS_MASK:
                    v = v * tl.load(mask_ptr + b * sm_b + src * sm_t, mask=src_ok, other=0.0).to(tl.float32)[:, None]
                grad_w += tl.where(offs_k[None, :] == k, tl.sum(g_own * v, axis=1)[:, None], 0.0)
            if NEED_GRAD_VALUES:
                # dv[s] += w[s - k + P, k] * g[s - k + P]: row s was tap k of output row s - k + P.
                dst = offs_t - (k - PAD)
                dst_ok = (dst >= 0) & (dst < T)
                if HAS_SEGMENTS:  # row s fed output row dst only within one document
                    dst_ok = dst_ok & (tl.load(seg_ptr + b * ss_b + dst * ss_t, mask=dst_ok, other=-2) == own_seg)
                w_k = tl.exp(tl.load(l_base + dst * sl_t + k * sl_k, mask=dst_ok, other=-float("inf")).to(tl.float32)
                             - tl.load(lse_base + dst, mask=dst_ok, other=0.0))
                g = tl.load(g_base + dst[:, None] * sg_t + offs_d[None, :] * sg_d,
                            mask=dst_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                grad_v += w_k[:, None] * g
        if NEED_GRAD_VALUES:
            if HAS_MASK:
                grad_v = grad_v * own_mask[:, None]
            tl.store(grad_values_ptr + row_off[:, None] + offs_d[None, :], grad_v.to(grad_values_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])

    if NEED_GRAD_LOGITS:
        k_ok = offs_k < KERNEL_SIZE
        logits = tl.load(l_base + offs_t[:, None] * sl_t + offs_k[None, :] * sl_k,
                         mask=row_ok[:, None] & k_ok[None, :], other=-float("inf")).to(tl.float32)
        lse = tl.load(lse_base + offs_t, mask=row_ok, other=0.0)
        w = tl.exp(logits - lse[:, None])
        grad_logits = w * (grad_w - tl.sum(w * grad_w, axis=1)[:, None])
        gl_rows = grad_logits_ptr + (b * T * N_HEADS + h) * KERNEL_SIZE + offs_t * (N_HEADS * KERNEL_SIZE)
        tl.store(gl_rows[:, None] + offs_k[None, :],
                 grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=row_ok[:, None] & k_ok[None, :])


def _block_sizes(kernel_size: int, head_dim: int) -> dict:
    return {"BLOCK_K": max(2, triton.next_power_of_2(kernel_size)),
            "BLOCK_D": max(2, min(_MAX_BLOCK_D, triton.next_power_of_2(head_dim)))}


def _grid(batch: int, heads: int, seq_len: int):
    return lambda meta: (batch * heads * triton.cdiv(seq_len, meta["BLOCK_T"]),)


def _shared_args(kernel_logits, values, value_mask, segments) -> tuple:
    """The mask and segment pointers, sizes and strides, and constants that both kernels take."""
    _, seq_len, heads, kernel_size = kernel_logits.shape
    head_dim = values.shape[-1]
    mask, sm_b, sm_t = (values, 0, 0) if value_mask is None else (value_mask, *value_mask.stride())
    seg, ss_b, ss_t = (values, 0, 0) if segments is None else (segments, *segments.stride())
    sizes_and_strides = (seq_len, _tune_length(seq_len), heads, head_dim, *kernel_logits.stride(), *values.stride(),
                         sm_b, sm_t, ss_b, ss_t)
    meta = dict(KERNEL_SIZE=kernel_size, HAS_MASK=value_mask is not None, HAS_SEGMENTS=segments is not None,
                **_block_sizes(kernel_size, head_dim))
    return (mask, seg), sizes_and_strides, meta


def forward_args(kernel_logits, values, value_mask, segments, out, lse, store_lse: bool) -> tuple[tuple, dict]:
    """Positional arguments and compile-time constants of ``_sdconv_fwd_kernel``."""
    masks, sizes_and_strides, meta = _shared_args(kernel_logits, values, value_mask, segments)
    return (kernel_logits, values, *masks, out, lse, *sizes_and_strides), dict(meta, STORE_LSE=store_lse)


def backward_args(grad_out, kernel_logits, values, value_mask, segments, lse, grad_logits, grad_values
                  ) -> tuple[tuple, dict]:
    """Positional arguments and compile-time constants of ``_sdconv_bwd_kernel``; a ``None`` gradient is skipped."""
    masks, sizes_and_strides, meta = _shared_args(kernel_logits, values, value_mask, segments)
    args = (kernel_logits, values, *masks, lse, grad_out,
            values if grad_logits is None else grad_logits, values if grad_values is None else grad_values,
            *sizes_and_strides, *grad_out.stride())
    return args, dict(meta, NEED_GRAD_LOGITS=grad_logits is not None, NEED_GRAD_VALUES=grad_values is not None)


def sdconv_forward(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None,
                   segments: torch.Tensor | None, store_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns ``out [B, T, n, d]`` and ``lse [B, n, T]`` (fp32, empty if not stored)."""
    batch, seq_len, heads, _ = kernel_logits.shape
    out = torch.empty(values.shape, dtype=values.dtype, device=values.device)
    lse = torch.empty((batch, heads, seq_len) if store_lse else (0,), dtype=torch.float32, device=values.device)
    if out.numel() > 0:
        args, meta = forward_args(kernel_logits, values, value_mask, segments, out, lse, store_lse)
        with on_device_of(values):
            _sdconv_fwd_kernel[_grid(batch, heads, seq_len)](*args, **meta)
    return out, lse


def sdconv_backward(grad_out: torch.Tensor, kernel_logits: torch.Tensor, values: torch.Tensor,
                    value_mask: torch.Tensor | None, segments: torch.Tensor | None, lse: torch.Tensor,
                    need_grad_logits: bool,
                    need_grad_values: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel; returns ``(grad_logits, grad_values)``, ``None`` where not needed."""
    batch, seq_len, heads, _ = kernel_logits.shape
    grad_logits = (torch.empty(kernel_logits.shape, dtype=kernel_logits.dtype, device=kernel_logits.device)
                   if need_grad_logits else None)
    grad_values = torch.empty(values.shape, dtype=values.dtype, device=values.device) if need_grad_values else None
    if values.numel() == 0:  # head_dim 0 leaves dw = 0, so dlogits = 0
        return (None if grad_logits is None else grad_logits.zero_()), grad_values
    args, meta = backward_args(grad_out, kernel_logits, values, value_mask, segments, lse, grad_logits, grad_values)
    with on_device_of(values):
        _sdconv_bwd_kernel[_grid(batch, heads, seq_len)](*args, **meta)
    return grad_logits, grad_values
