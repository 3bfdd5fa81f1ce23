"""SDConv under ``torch.compile(fullgraph=True)``: the Triton kernels as custom ops, and both paths traced whole.

On CPU the kernels run in Triton's interpreter; graphs are compiled with the ``aot_eager`` backend, which
traces forward and backward through the ops' fake implementations and autograd formula (what Inductor
sees) without spending a C++ build on each test.
"""

import os

import torch
from torch import library as torch_ops

opcheck = torch_ops.opcheck

if not torch.cuda.is_available():
    # Must precede the first import of convbert_ds.kernels (see test_kernels.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

import convbert_ds.kernels  # noqa: E402,F401 -- registers the convbert_ds:: ops
from convbert_ds.config import ElectraConfig, ModelConfig, generator_config  # noqa: E402
from convbert_ds.model import ElectraForPretraining, sdconv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = torch.ops.convbert_ds


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # The tests compile the same lambdas with other closures: start each from no cached graphs and no
    # recompilations counted against dynamo's limit.
    torch._dynamo.reset()


def _inputs(masked=True, batch=2, seq_len=16, heads=2, kernel_size=5, head_dim=8):
    gen = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(batch, seq_len, heads, kernel_size, generator=gen)).to(DEVICE)
    values = torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(DEVICE)
    mask = (torch.rand(batch, seq_len, generator=gen) > 0.3).float().to(DEVICE) if masked else None
    grad_out = torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(DEVICE)
    return logits, values, mask, grad_out


@pytest.mark.parametrize("masked", [True, False])
def test_opcheck_forward(masked):
    logits, values, mask, _ = _inputs(masked)
    segments = None if mask is None else (mask.cumsum(1) // 7).int()  # packed documents, with the mask
    opcheck(OPS.sdconv_forward, (logits, values, mask, segments, False))
    # Inputs that require grad take the autograd checks through the formula (and the backward op).
    opcheck(OPS.sdconv_forward, (logits.requires_grad_(), values.requires_grad_(), mask, segments, True))


@pytest.mark.parametrize("need_logits,need_values", [(True, True), (True, False), (False, True)])
def test_opcheck_backward(need_logits, need_values):
    logits, values, mask, grad_out = _inputs()
    _, lse = OPS.sdconv_forward(logits, values, mask, None, True)
    opcheck(OPS.sdconv_backward, (grad_out, logits, values, mask, None, lse, need_logits, need_values))


def _eager_and_compiled(impl, masked=True):
    """Output and both gradients, eager then compiled as one graph; and whether that graph calls the Triton op."""
    logits, values, mask, grad_out = _inputs(masked)
    fn = lambda l, v, m: sdconv.dynamic_conv(l, v, m, impl=impl)  # noqa: E731
    counter = CompileCounterWithBackend("aot_eager")
    results = []
    for run in (fn, torch.compile(fn, backend=counter, fullgraph=True)):  # fullgraph: a graph break raises
        leaves = logits.detach().requires_grad_(), values.detach().requires_grad_()
        out = run(*leaves, mask)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    assert counter.frame_count == 1
    return results, "convbert_ds.sdconv_forward" in counter.graphs[0].code


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("masked", [True, False])
def test_compiles_without_graph_break_and_matches_eager(impl, masked):
    (eager, compiled), calls_triton = _eager_and_compiled(impl, masked)
    assert calls_triton == (impl == "triton")
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_triton_under_no_grad():
    logits, values, mask, _ = _inputs()
    compiled = torch.compile(lambda l, v, m: sdconv.dynamic_conv(l, v, m, impl="triton"),
                             backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(logits, values, mask), sdconv.dynamic_conv_reference(logits, values, mask),
                                   rtol=1e-5, atol=1e-5)


def test_auto_reads_the_probe_cache_while_compiling(monkeypatch):
    # "auto" only picks Triton on CUDA; here it is made to on any device, as in test_auto_fallback.
    monkeypatch.setattr(sdconv, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(sdconv, "_TRITON_PROBED", {})
    config = ModelConfig(hidden_size=32, num_attention_heads=4, conv_kernel_size=5)  # 2 conv heads of 8
    device = torch.empty(0, device=DEVICE).device
    assert sdconv.probe_sdconv(config, DEVICE, torch.float32) == {(device, torch.float32, torch.float32, 5, 8): None}
    (eager, compiled), calls_triton = _eager_and_compiled("auto")
    assert calls_triton
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_unprobed_layout_is_probed_behind_a_graph_break(monkeypatch):
    monkeypatch.setattr(sdconv, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(sdconv, "_TRITON_PROBED", {})
    logits, values, mask, _ = _inputs()
    fn = lambda l, v, m: sdconv.dynamic_conv(l, v, m, impl="auto")  # noqa: E731
    with pytest.raises(torch._dynamo.exc.Unsupported, match="triton_unusable_reason"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(logits, values, mask)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="aot_eager")(logits, values, mask)
    assert len(sdconv._TRITON_PROBED) == 1
    torch.testing.assert_close(out, sdconv.dynamic_conv_reference(logits, values, mask), rtol=1e-5, atol=1e-5)


def test_probe_covers_every_conv_layout_of_a_model_and_skips_cpu(monkeypatch):
    disc = ModelConfig(vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                       intermediate_size=64, embedding_size=16, max_position_embeddings=16)
    model = ElectraForPretraining(ElectraConfig(discriminator=disc, generator=generator_config(disc, 0.25)))
    assert sdconv.probe_sdconv(model, "cpu", torch.bfloat16) == {}  # "auto" is the torch path on CPU
    monkeypatch.setattr(sdconv, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(sdconv, "triton_unusable_reason", lambda *key: f"stub {key[3:]}")
    # Discriminator: 2 conv heads of 16; generator (hidden 16, head_ratio heads kept): 1 conv head of 8.
    cpu = torch.device("cpu")
    assert sdconv.probe_sdconv(model, "cpu", torch.bfloat16) == {
        (cpu, torch.bfloat16, torch.bfloat16, 9, size): f"stub {(9, size)}" for size in (8, 16)}
