"""The dynamic convolution at the heart of ConvBERT's conv heads.

``dynamic_conv`` is the one function the model calls. It computes, for every
batch ``b``, position ``t`` and conv head ``h``::

    w[b, t, h, :] = softmax(kernel_logits[b, t, h, :])                  (over K, in fp32)
    out[b, t, h, :] = sum_k w[b, t, h, k] * values[b, t + k - (K-1)/2, h, :]

with ``values`` zero outside ``[0, T)`` ("same" padding). The kernel is shared
by the ``d`` channels of a head. With ``segments`` (``[B, T]`` integer ids: the
documents packed into one sample), a tap whose position lies in another segment
than ``t`` reads zero too: the convolution restarts at every document boundary,
as it does at the ends of the sequence (the softmax still spans all K taps). This is exactly what transformers' ConvBERT
computes with ``nn.functional.unfold`` + ``matmul``, but the reference below
never builds the K-times copy of ``values``: it adds K shifted views.

Implementations: ``"torch"`` (the reference here, any device) and ``"triton"``
(fused kernels in ``convbert_ds.kernels``); ``"auto"`` picks Triton on CUDA
and the reference elsewhere. On CUDA, ``"auto"`` first runs the kernels once on
a small input of each dtype it meets and checks them against the reference: a
GPU or Triton/driver combination they fail on (compile, launch or wrong numbers)
gets the reference, with a one-line warning naming the reason, instead of a
crashed run. ``"triton"`` asked for by name is never replaced.

Under ``torch.compile``: both paths trace without a graph break (the Triton
kernels are custom ops). The probe itself cannot be traced, so ``"auto"`` on
CUDA only stays in one graph for layouts already probed: run
``probe_sdconv(model, device, dtype)`` eagerly before compiling. A layout met
unprobed while compiling is probed behind a graph break (an error under
``fullgraph=True``).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F

from convbert_ds.config import SDCONV_IMPLS, ModelConfig

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _ReferenceDynamicConv(torch.autograd.Function):
    """Shift-and-add forward and an explicit backward.

    Letting autograd differentiate K slices of a padded tensor would allocate
    and zero-fill a full-size gradient buffer per tap; here one buffer is
    accumulated in place, and only the softmax weights and the padded values
    are kept for backward.
    """

    @staticmethod
    def forward(ctx, kernel_logits, values, value_mask, segments):
        kernel_size, seq_len = kernel_logits.shape[-1], values.shape[1]
        pad = (kernel_size - 1) // 2
        compute_dtype = torch.float32 if values.dtype in _LOW_PRECISION else values.dtype
        softmax_dtype = torch.float32 if kernel_logits.dtype in _LOW_PRECISION else kernel_logits.dtype
        probs = torch.softmax(kernel_logits.to(softmax_dtype), dim=-1).to(compute_dtype)
        # Taps into another segment read zero: the same as zeroing their weight after the softmax.
        weights = probs if segments is None else probs * same_segment_taps(segments, kernel_size)[:, :, None, :]
        values = values.to(compute_dtype)
        if value_mask is not None:
            values = values * value_mask[:, :, None, None].to(compute_dtype)
        padded = F.pad(values, (0, 0, 0, 0, pad, pad))
        out = weights[..., 0, None] * padded[:, :seq_len]
        for k in range(1, kernel_size):
            out.addcmul_(weights[..., k, None], padded[:, k:k + seq_len])
        ctx.save_for_backward(probs, weights, padded, value_mask)
        ctx.dtypes = (kernel_logits.dtype, ctx.needs_input_grad)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        probs, weights, padded, value_mask = ctx.saved_tensors
        logits_dtype, needs = ctx.dtypes
        kernel_size, seq_len = weights.shape[-1], grad_out.shape[1]
        pad = (kernel_size - 1) // 2
        grad_out = grad_out.to(padded.dtype)
        grad_logits = grad_values = None
        if needs[0]:
            grad_weights = torch.stack(
                [(grad_out * padded[:, k:k + seq_len]).sum(-1) for k in range(kernel_size)], dim=-1)
            if weights is not probs:  # through the segment mask m: d(p * m)/dp = m (where p is 0 it is moot)
                grad_weights = grad_weights * (weights != 0)
            # Softmax backward: p * (g - <g, p>).
            grad_logits = probs * (grad_weights - (grad_weights * probs).sum(-1, keepdim=True))
            grad_logits = grad_logits.to(logits_dtype)
        if needs[1]:
            grad_padded = torch.zeros_like(padded)
            for k in range(kernel_size):
                grad_padded[:, k:k + seq_len].addcmul_(weights[..., k, None], grad_out)
            grad_values = grad_padded[:, pad:pad + seq_len]
            if value_mask is not None:
                grad_values = grad_values * value_mask[:, :, None, None].to(grad_values.dtype)
        return grad_logits, grad_values, None, None


def same_segment_taps(segments: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """``[B, T, K]`` float mask: 1 where tap ``k`` of position ``t`` (position ``t + k - (K-1)/2``) lies inside
    the sequence and in the same segment as ``t``, else 0."""
    pad = (kernel_size - 1) // 2
    seq_len = segments.shape[1]
    outside = torch.iinfo(torch.int64).min  # no segment has this id
    padded = F.pad(segments.long(), (pad, pad), value=outside)
    taps = torch.stack([padded[:, k:k + seq_len] for k in range(kernel_size)], dim=-1)
    return (taps == segments.long()[:, :, None]).float()


def dynamic_conv_reference(kernel_logits: torch.Tensor, values: torch.Tensor,
                           value_mask: torch.Tensor | None = None,
                           segments: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch dynamic convolution; see the module docstring for the maths.

    Args:
        kernel_logits: ``[B, T, n, K]`` pre-softmax kernel logits, K odd.
        values: ``[B, T, n, d]``.
        value_mask: optional ``[B, T]``, nonzero where the position is a real
            token; padded positions then contribute nothing to their neighbours.
            transformers does not mask, so parity needs ``None``.
        segments: optional ``[B, T]`` integer ids (packed documents; padding its own id): taps that
            cross into another segment read zero.
    Returns:
        ``[B, T, n, d]`` in ``values.dtype``. Half-precision inputs are
        accumulated in fp32.
    """
    _check_shapes(kernel_logits, values, value_mask, segments)
    return _ReferenceDynamicConv.apply(kernel_logits, values, value_mask, segments).to(values.dtype)


def _check_shapes(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None,
                  segments: torch.Tensor | None = None) -> None:
    if kernel_logits.dim() != 4 or values.dim() != 4 or kernel_logits.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"dynamic_conv expects kernel_logits [B, T, n, K] and values [B, T, n, d] with the same B, T, n; "
            f"got {tuple(kernel_logits.shape)} and {tuple(values.shape)}")
    if kernel_logits.shape[-1] % 2 == 0:
        raise ValueError(f"dynamic_conv needs an odd kernel size, got K={kernel_logits.shape[-1]}")
    for name, mask in (("value_mask", value_mask), ("segments", segments)):
        if mask is not None and tuple(mask.shape) != tuple(values.shape[:2]):
            raise ValueError(f"{name} must be [B, T] = {tuple(values.shape[:2])}, got {tuple(mask.shape)}")


def resolve_impl(impl: str, device: torch.device) -> str:
    """Turn ``"auto"`` into the implementation it prefers on ``device`` (before any probing)."""
    if impl not in SDCONV_IMPLS:
        raise ValueError(f"sdconv_impl={impl!r} is not one of {SDCONV_IMPLS}")
    return ("triton" if device.type == "cuda" else "torch") if impl == "auto" else impl


# Why Triton kernels cannot be used, or None, per probed key: (device, logits dtype, values dtype, K, head size)
# for SDConv, (device, "document conv", K) for the depthwise conv over packed documents (model/depthwise.py).
_TRITON_PROBED: dict[tuple, str | None] = {}

# torch.compiler.disable, importing torch._dynamo at the first call instead of at this module's import: an eager
# run never needs dynamo, and importing it was about half of importing the trainer
# (benchmarks/RESULTS.md#row-import-time). The wrapper is torch's own, so a compiled graph breaks at it as at
# torch.compiler.disable (DeepSpeed's lazy_disable is the same function; tests/kernels/test_auto_fallback.py
# checks the break). It is private: a torch that renamed it would fail this import, in every test.
eager_only = torch._disable_dynamo


@eager_only  # runs kernels and prints: eager, once per key, never traced into a compiled graph
def probe_once(key: tuple, what: str, compare: Callable[[], float], tolerance: float) -> str | None:
    """Why Triton kernels cannot be used for ``key`` (its first item the device), or None when they can;
    cached per key. ``compare`` runs them and the torch path on a small input and returns the largest
    difference relative to each result's largest value. Any exception counts: a failed compile or launch
    surfaces as whatever Triton, the driver or ptxas raise, and the point of ``auto`` is that none of them
    ends a run that the torch path can carry."""
    if key in _TRITON_PROBED:
        return _TRITON_PROBED[key]
    try:
        with torch.enable_grad():  # the first call may come from an evaluation under no_grad
            worst = compare()
        reason = None if worst <= tolerance else f"its results differ from the torch path by {worst:.3g}"
    except Exception as error:  # noqa: BLE001 -- see the docstring: any failure means "use the reference"
        reason = ": ".join([type(error).__name__, *str(error).strip().splitlines()[:1]])
    if reason is not None:
        print(f"warning: sdconv_impl=auto: the Triton {what} cannot run on {key[0]}: {reason}; using the torch "
              "implementation", file=sys.stderr, flush=True)
    _TRITON_PROBED[key] = reason
    return reason


def largest_difference(results, references) -> float:
    """The largest difference between paired tensors, relative to each reference's largest value (at least 1)."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1)).item()
               for a, b in zip(results, references))


@eager_only  # the probe builds inputs and runs kernels: a graph break under torch.compile
def triton_unusable_reason(device: torch.device, logits_dtype: torch.dtype, values_dtype: torch.dtype,
                           kernel_size: int, head_dim: int) -> str | None:
    """Why the Triton SDConv kernels cannot run on ``device`` for this layout, or None when they can (cached).

    Runs forward and backward once on a small masked input of these dtypes, kernel size and head size, and
    compares with the reference (a kernel size the kernels do not take is a reason too); see ``probe_once``.
    """
    def compare() -> float:
        gen = torch.Generator().manual_seed(0)
        shape = (2, 40, 2)  # B, T, n: T spans several position blocks of every tuned config
        logits = (2 * torch.randn(*shape, kernel_size, generator=gen)).to(device, logits_dtype)
        values = torch.randn(*shape, head_dim, generator=gen).to(device, values_dtype)
        mask = (torch.arange(shape[1]) < 33).expand(shape[0], -1).to(device)
        segments = (torch.arange(shape[1]) >= 17).long().expand(shape[0], -1).to(device)  # a document boundary
        grad_out = torch.randn(*shape, head_dim, generator=gen).to(device, values_dtype)
        from convbert_ds.kernels import triton_dynamic_conv  # inside the probe: importing Triton can fail too
        return largest_difference(*[value_and_grads(fn, (logits, values), (mask, segments), grad_out)
                                    for fn in (triton_dynamic_conv, dynamic_conv_reference)])

    # Relative to each tensor's largest value: accumulation order, and one rounding in half precision.
    tolerance = 1e-4 if values_dtype == torch.float32 else 2e-2
    return probe_once((device, logits_dtype, values_dtype, kernel_size, head_dim),
                      f"SDConv kernels ({logits_dtype}, {values_dtype}, K={kernel_size}, head size {head_dim})",
                      compare, tolerance)


def cached_reason(key: tuple, probe: Callable[[], str | None]) -> str | None:
    """The probe's cached answer for ``key``, else ``probe()``. Read here, not in the probe: torch.compile
    traces a dict lookup, while the probe is a graph break (``probe_sdconv`` fills the cache beforehand)."""
    return _TRITON_PROBED[key] if key in _TRITON_PROBED else probe()


def value_and_grads(fn, differentiable: tuple, others: tuple, grad_out) -> tuple[torch.Tensor, ...]:
    """``fn(*differentiable, *others)`` and its gradients with respect to ``differentiable`` (what a probe
    compares between the kernels and the torch path)."""
    inputs = tuple(t.detach().requires_grad_() for t in differentiable)
    out = fn(*inputs, *others)
    return (out, *torch.autograd.grad(out, inputs, grad_out))


def dynamic_conv(kernel_logits: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor | None = None,
                 impl: str = "auto", segments: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic convolution through the chosen implementation (see module docstring)."""
    chosen = resolve_impl(impl, values.device)
    if chosen == "triton" and impl == "auto":
        key = (values.device, kernel_logits.dtype, values.dtype, kernel_logits.shape[-1], values.shape[-1])
        if cached_reason(key, lambda: triton_unusable_reason(*key)) is not None:
            chosen = "torch"
    if chosen == "triton":
        # Here, not at the top: triton is slow to import, and CPU runs never need it.
        from convbert_ds.kernels import triton_dynamic_conv
        return triton_dynamic_conv(kernel_logits, values, value_mask, segments)
    return dynamic_conv_reference(kernel_logits, values, value_mask, segments)


def probe_sdconv(model: torch.nn.Module | ModelConfig, device: torch.device | str,
                 dtype: torch.dtype) -> dict[tuple, str | None]:
    """Probe the Triton kernels, eagerly, for every conv layout of ``model`` that ``"auto"`` sends to them.

    Call it before ``torch.compile`` so that ``dynamic_conv`` reads the results from the cache instead of
    probing (a graph break) inside the compiled graph. Calling it again is cheap: results are cached.

    Args:
        model: a module (every ``ModelConfig`` found on its submodules counts: generator and
            discriminator may differ in kernel or head size) or one ``ModelConfig``.
        device: where the model runs; a CUDA device without an index means the current one.
        dtype: the dtype the conv heads compute in: the autocast dtype under autocast, else the
            parameters' dtype. Call once per dtype when several are used (e.g. training and evaluation).
    Returns:
        ``(device, logits dtype, values dtype, K, head size) -> reason`` for each layout probed (None: the
        kernels are used); empty where ``"auto"`` does not pick Triton (CPU, or another ``sdconv_impl``).
    """
    device = torch.empty(0, device=device).device  # the index CUDA tensors carry, so the keys match theirs
    if isinstance(model, ModelConfig):
        configs = [model]
    else:
        configs = [getattr(module, "config", None) for module in model.modules()]
    layouts = {(config.conv_kernel_size, config.head_dim) for config in configs
               if isinstance(config, ModelConfig) and config.conv_type in ("sdconv", "dynamic")
               and config.sdconv_impl == "auto" and resolve_impl("auto", device) == "triton"}
    keys = [(device, dtype, dtype, kernel_size, head_dim) for kernel_size, head_dim in sorted(layouts)]
    return {key: triton_unusable_reason(*key) for key in keys}
