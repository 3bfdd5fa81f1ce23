"""Fused Triton SDConv against the PyTorch reference; on CPU the kernels run in Triton's interpreter."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of convbert_ds.kernels: @triton.jit picks the interpreter at decoration
    # time. tests/conftest.py does the same; this keeps the module right when run on its own.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

from convbert_ds.kernels import sdconv_triton, triton_dynamic_conv  # noqa: E402
from convbert_ds.model.sdconv import dynamic_conv, dynamic_conv_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch, seq_len, heads, head_dim, kernel_size, dtype=torch.float32, masked=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(batch, seq_len, heads, kernel_size, generator=gen)).to(DEVICE, dtype)
    values = torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(DEVICE, dtype)
    grad_out = torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(DEVICE, dtype)
    mask = (torch.rand(batch, seq_len, generator=gen) > 0.3).to(DEVICE) if masked else None
    return logits, values, mask, grad_out


def _run(fn, logits, values, mask, grad_out):
    logits = logits.detach().requires_grad_()
    values = values.detach().requires_grad_()
    out = fn(logits, values, mask)
    grad_logits, grad_values = torch.autograd.grad(out, (logits, values), grad_out)
    return out, grad_logits, grad_values


def _noncontiguous(logits, values, mask, grad_out):
    """Same numbers through strided views: transposed logits, every other channel, strided mask, stride-0 grad."""
    logits = logits.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.zeros(*values.shape[:-1], 2 * values.shape[-1], dtype=values.dtype, device=values.device)
    wide[..., ::2] = values
    values = wide[..., ::2]
    if mask is not None:
        mask = torch.stack([mask.float(), (~mask).float()], dim=-1).flatten(1)[:, ::2]
    grad_out = grad_out[:, :1, :1].expand_as(grad_out)
    assert not (logits.is_contiguous() or values.is_contiguous() or grad_out.is_contiguous())
    return logits, values, mask, grad_out


# (batch, seq_len, heads, head_dim, kernel_size, masked); the interpreter runs BLOCK_T = 16.
FP32_CASES = {
    "T=1": (2, 1, 2, 8, 9, False),
    "T<K, masked": (2, 5, 2, 8, 9, True),
    "K=1": (1, 19, 2, 8, 1, False),
    "K=31, odd T, masked": (1, 37, 1, 8, 31, True),
    "head_dim over two chunks": (1, 17, 1, 80, 5, False),
}


@pytest.mark.parametrize("shape", FP32_CASES.values(), ids=FP32_CASES.keys())
def test_fp32_matches_reference(shape):
    *dims, masked = shape
    args = _inputs(*dims, masked=masked)
    for got, want in zip(_run(triton_dynamic_conv, *args), _run(dynamic_conv_reference, *args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_noncontiguous_inputs_and_stride0_grad():
    args = _noncontiguous(*_inputs(2, 33, 3, 12, 9, masked=True))
    for got, want in zip(_run(triton_dynamic_conv, *args), _run(dynamic_conv_reference, *args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# bf16 results carry one rounding to 8 mantissa bits (the interpreter truncates instead of rounding
# to nearest, so up to one ulp = 2^-7 relative); fp16 one rounding to 11 bits.
LOW_PRECISION = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("logits_dtype,values_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
def test_low_precision_matches_fp64_reference(logits_dtype, values_dtype):
    logits, values, mask, grad_out = _inputs(2, 37, 2, 16, 9, masked=True)
    logits, values, grad_out = logits.to(logits_dtype), values.to(values_dtype), grad_out.to(values_dtype)
    got = _run(triton_dynamic_conv, logits, values, mask, grad_out)
    want = _run(dynamic_conv_reference, logits.double(), values.double(), mask, grad_out.double())
    for name, g, w, dtype in zip(("out", "grad_logits", "grad_values"), got, want,
                                 (values_dtype, logits_dtype, values_dtype)):
        assert g.dtype == dtype, name
        tol = LOW_PRECISION.get(dtype, 1e-5)
        # Absolute slack for near-zero entries: fp32 accumulation error relative to the tensor's scale.
        atol = max(1e-5, tol * 1e-2 * w.abs().max().item())
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("needs", ["logits", "values"])
def test_partial_gradients_and_no_grad(needs):
    logits, values, mask, grad_out = _inputs(1, 20, 2, 8, 3, masked=True)
    with torch.no_grad():
        torch.testing.assert_close(triton_dynamic_conv(logits, values, mask),
                                   dynamic_conv_reference(logits, values, mask), rtol=1e-5, atol=1e-5)
    inputs = {"logits": logits.clone(), "values": values.clone()}
    inputs[needs].requires_grad_()
    out = triton_dynamic_conv(inputs["logits"], inputs["values"], mask)
    (got,) = torch.autograd.grad(out, inputs[needs], grad_out)
    _, want_logits, want_values = _run(dynamic_conv_reference, logits, values, mask, grad_out)
    torch.testing.assert_close(got, want_logits if needs == "logits" else want_values, rtol=1e-5, atol=1e-5)


def test_model_entry_point_and_empty_batch():
    args = _inputs(2, 9, 2, 8, 3, masked=True)
    ours = _run(lambda l, v, m: dynamic_conv(l, v, m, impl="triton"), *args)
    for got, want in zip(ours, _run(dynamic_conv_reference, *args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out, grad_logits, grad_values = _run(triton_dynamic_conv, *_inputs(0, 9, 2, 8, 3))
    assert out.shape == (0, 9, 2, 8) and grad_logits.shape == (0, 9, 2, 3) and grad_values.shape == out.shape


@pytest.mark.parametrize("logits_shape,values_shape,mask_shape,dtype,match", [
    ((1, 4, 2, 4), (1, 4, 2, 8), None, torch.float32, "odd kernel size"),
    ((1, 4, 2, 33), (1, 4, 2, 8), None, torch.float32, "K <= 31"),
    ((1, 4, 2, 3), (1, 5, 2, 8), None, torch.float32, "same B, T, n"),
    ((1, 4, 2, 3), (1, 4, 8), None, torch.float32, "same B, T, n"),
    ((1, 4, 2, 3), (1, 4, 2, 8), (1, 5), torch.float32, "value_mask must be"),
    ((1, 4, 2, 3), (1, 4, 2, 8), None, torch.float64, "supports"),
])
def test_clear_errors(logits_shape, values_shape, mask_shape, dtype, match):
    logits = torch.zeros(logits_shape, dtype=dtype, device=DEVICE)
    values = torch.zeros(values_shape, dtype=dtype, device=DEVICE)
    mask = None if mask_shape is None else torch.ones(mask_shape, device=DEVICE)
    with pytest.raises((ValueError, TypeError), match=match):
        triton_dynamic_conv(logits, values, mask)


def test_cpu_tensors_rejected_outside_interpreter(monkeypatch):
    monkeypatch.setattr(sdconv_triton, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="need a GPU"):
        triton_dynamic_conv(torch.zeros(1, 4, 2, 3), torch.zeros(1, 4, 2, 8))


@pytest.mark.parametrize("masked", [False, True])
def test_segments_match_reference(masked):
    """Packed documents: taps across a segment boundary read zero, in the kernels as in the reference
    (boundaries inside and at the edges of the interpreter's 16-position blocks; padding its own segment)."""
    logits, values, mask, grad_out = _inputs(2, 37, 2, 8, 9, masked=masked, seed=3)
    lengths = ([5, 11, 1, 16, 4], [16, 16, 5])  # segment lengths per row; the last segment of row 0 is padding
    segments = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    segments = segments.to(DEVICE)
    fused = _run(lambda l, v, m: triton_dynamic_conv(l, v, m, segments), logits, values, mask, grad_out)
    reference = _run(lambda l, v, m: dynamic_conv_reference(l, v, m, segments), logits, values, mask, grad_out)
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _configs_to_check(kernel) -> list:
    """What the tuner may keep: on a GPU every configuration; in the interpreter, which has one, its block
    shape with the taps unrolled and looped (``UNROLL_TAPS``: the same Python there, as unrolling is the
    compiler's; ``test_kernels_compile.py`` compiles both for sm_90)."""
    if not sdconv_triton.INTERPRET:
        return kernel.configs
    (config,) = kernel.configs
    return [triton.Config({**config.kwargs, "UNROLL_TAPS": unrolled}, num_warps=config.num_warps)
            for unrolled in (True, False)]


def test_every_configuration_the_tuner_may_keep_computes_the_reference(monkeypatch):
    """The tuner keeps the fastest configuration of each kernel, whose values nothing else checks: each one,
    alone (a tuner of one configuration runs it without timing), gives the reference's output and gradients,
    with a value mask and packed documents (every branch of both kernels)."""
    logits, values, mask, grad_out = _inputs(2, 37, 2, 8, 9, masked=True, seed=5)
    segments = (torch.arange(37, device=DEVICE) // 12).expand(2, -1)
    want = _run(lambda l, v, m: dynamic_conv_reference(l, v, m, segments), logits, values, mask, grad_out)
    kernels = sdconv_triton._sdconv_fwd_kernel, sdconv_triton._sdconv_bwd_kernel
    pairs = list(zip(*(_configs_to_check(kernel) for kernel in kernels)))
    assert {forward.kwargs["UNROLL_TAPS"] for forward, _ in pairs} == {True, False}
    for configs in pairs:
        for kernel, config in zip(kernels, configs):
            monkeypatch.setattr(kernel, "configs", [config])
            monkeypatch.setattr(kernel, "cache", {})
        got = _run(lambda l, v, m: triton_dynamic_conv(l, v, m, segments), logits, values, mask, grad_out)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda text: f"{configs[0]}: {text}")
