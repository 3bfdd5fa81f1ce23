"""The Triton kernels of the depthwise conv over packed documents against its torch path, as custom ops under
``torch.compile(fullgraph=True)``, and ``sdconv_impl: auto``'s probe of them. On CPU the kernels run in
Triton's interpreter (16 x 16 blocks, so the inputs below span several of them)."""

import os

import torch
from torch import library as torch_ops

if not torch.cuda.is_available():
    # Must precede the first import of convbert_ds.kernels (see test_kernels.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import convbert_ds.kernels  # noqa: E402,F401 -- registers the convbert_ds:: ops
from convbert_ds.config import ModelConfig  # noqa: E402
from convbert_ds.model import depthwise, sdconv  # noqa: E402
from convbert_ds.model.layers import ConvBertSelfAttention, padding_masks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = torch.ops.convbert_ds


def _inputs(batch=3, seq_len=37, channels=40, kernel_size=9, dtype=torch.float32, weight_dtype=None):
    """Documents of 11, 15 and 11 positions in each sample (boundaries inside and at the edges of blocks),
    the weight as the model passes it (a strided view of the conv's ``[C, 1, K]``), an incoming gradient."""
    gen = torch.Generator().manual_seed(0)
    documents = torch.tensor([1] * 11 + [2] * 15 + [3] * (seq_len - 26)).expand(batch, -1)
    taps = sdconv.same_segment_taps(documents, kernel_size).to(DEVICE)
    x = torch.randn(batch, seq_len, channels, generator=gen).to(DEVICE, dtype)
    conv_weight = torch.randn(channels, 1, kernel_size, generator=gen).to(DEVICE, weight_dtype or dtype)
    grad_out = torch.randn(batch, seq_len, channels, generator=gen).to(DEVICE, dtype)
    return x, conv_weight[:, 0, :], taps, grad_out


def _value_and_grads(impl, x, weight, taps, grad_out):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = depthwise.document_depthwise_conv(x, weight, taps, impl=impl)
    return (out, *torch.autograd.grad(out, (x, weight), grad_out))


@pytest.mark.parametrize("kernel_size", [9, 3, 1])
def test_kernels_match_the_torch_path_fp32(kernel_size):
    inputs = _inputs(kernel_size=kernel_size)
    got, want = (_value_and_grads(impl, *inputs) for impl in ("triton", "torch"))
    for name, g, w in zip(("out", "grad_x", "grad_weight"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_kernels_match_the_torch_path_bf16_and_mixed():
    # bf16 throughout (DeepSpeed's bf16 weights), and fp32 x with a bf16 weight: results in each input's dtype,
    # the sums in fp32 in both paths, so they differ by the final rounding only.
    for dtype, weight_dtype in ((torch.bfloat16, None), (torch.float32, torch.bfloat16)):
        inputs = _inputs(dtype=dtype, weight_dtype=weight_dtype)
        got, want = (_value_and_grads(impl, *inputs) for impl in ("triton", "torch"))
        for name, g, w in zip(("out", "grad_x", "grad_weight"), got, want):
            assert g.dtype == w.dtype, name
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_non_contiguous_gradient_and_one_gradient_only():
    x, weight, taps, grad_out = _inputs()
    strided = grad_out.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    want = _value_and_grads("torch", x, weight, taps, grad_out)
    assert torch.equal(_value_and_grads("triton", x, weight, taps, strided)[1],
                       _value_and_grads("triton", x, weight, taps, grad_out)[1])
    x_only = x.detach().requires_grad_()
    out = depthwise.document_depthwise_conv(x_only, weight, taps, impl="triton")
    (grad_x,) = torch.autograd.grad(out, x_only, grad_out)
    torch.testing.assert_close(grad_x, want[1], rtol=1e-5, atol=1e-5)
    assert OPS.document_conv_backward(grad_out, x, weight, taps, True, False)[1].numel() == 0


def test_opcheck():
    x, weight, taps, grad_out = _inputs(batch=2, seq_len=20, channels=8, kernel_size=5)
    torch_ops.opcheck(OPS.document_conv_forward, (x, weight, taps))
    torch_ops.opcheck(OPS.document_conv_backward, (grad_out, x, weight, taps, True, True))


@pytest.mark.slow
def test_compiled_whole_with_the_kernels_inside():
    inputs = _inputs()
    eager = _value_and_grads("torch", *inputs)
    compiled = torch.compile(lambda x, w, t: depthwise.document_depthwise_conv(x, w, t, impl="triton"),
                             backend="aot_eager", fullgraph=True)
    x, weight = (t.detach().requires_grad_() for t in inputs[:2])
    out = compiled(x, weight, inputs[2])
    for got, want in zip((out, *torch.autograd.grad(out, (x, weight), inputs[3])), eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _auto_picks_triton(impl, device):
    return "triton" if impl == "auto" else impl


def test_auto_probes_once_and_then_uses_the_kernels(monkeypatch):
    # "auto" picks Triton only on CUDA; made to on any device here (and "torch" stays torch).
    monkeypatch.setattr(depthwise, "resolve_impl", _auto_picks_triton)
    monkeypatch.setattr(sdconv, "_TRITON_PROBED", {})
    device = torch.empty(0, device=DEVICE).device
    config = ModelConfig(hidden_size=32, num_attention_heads=4, conv_kernel_size=5)
    assert depthwise.probe_document_conv(config, DEVICE) == {(device, "document conv", 5): None}
    calls = []
    real = convbert_ds.kernels.triton_document_conv
    monkeypatch.setattr(convbert_ds.kernels, "triton_document_conv", lambda *a: calls.append(1) or real(*a))
    inputs = _inputs(kernel_size=5)
    got, want = _value_and_grads("auto", *inputs), _value_and_grads("torch", *inputs)
    assert calls and len(sdconv._TRITON_PROBED) == 1  # the probe's answer was read, not probed again
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _compiled_ops(impl, inputs):
    """The op names in the graph that ``torch.compile(fullgraph=True)`` traces of the conv with ``impl``."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: depthwise.document_depthwise_conv(x, w, t, impl=impl),
                             backend=recording_backend, fullgraph=True)
    torch.testing.assert_close(compiled(*inputs[:3]), _value_and_grads("torch", *inputs)[0], rtol=1e-5, atol=1e-5)
    return {str(node.target) for graph in graphs for node in graph.graph.nodes}


def test_auto_takes_the_torch_path_when_compiled(monkeypatch):
    # Traced, inductor fuses the torch path's multiply-adds with their neighbours and the Triton op would be a
    # fusion barrier (benchmarks/document_conv.py --compile); fullgraph: no probe breaks the graph either.
    monkeypatch.setattr(depthwise, "resolve_impl", _auto_picks_triton)
    monkeypatch.setattr(sdconv, "_TRITON_PROBED", {})
    inputs = _inputs(kernel_size=5)
    assert any("document_conv_forward" in op for op in _compiled_ops("triton", inputs))  # what the check sees
    assert not any("document_conv" in op for op in _compiled_ops("auto", inputs))
    assert sdconv._TRITON_PROBED == {}  # nor was the probe run for it


def test_a_failing_kernel_sends_auto_to_the_torch_path(monkeypatch, capsys):
    monkeypatch.setattr(depthwise, "resolve_impl", _auto_picks_triton)
    monkeypatch.setattr(sdconv, "_TRITON_PROBED", {})

    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(convbert_ds.kernels, "triton_document_conv", broken)
    inputs = _inputs(kernel_size=5)
    got, want = _value_and_grads("auto", *inputs), _value_and_grads("torch", *inputs)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert "depthwise conv kernels (K=5)" in capsys.readouterr().err
    assert list(sdconv._TRITON_PROBED.values()) == ["RuntimeError: no kernel image is available for execution on "
                                                    "the device"]


def test_mixed_attention_over_packed_documents_same_with_either_impl():
    """The layer the kernels serve, over packed documents with padding: its output and every parameter's
    gradient are the torch path's (``triton`` also sends its SDConv to Triton's kernels)."""
    torch.manual_seed(0)
    config = ModelConfig(hidden_size=32, num_attention_heads=4, conv_kernel_size=9, sdconv_impl="torch")
    layer = ConvBertSelfAttention(config).to(DEVICE).eval()  # no attention dropout: both runs see the same
    hidden = torch.randn(2, 37, 32, device=DEVICE)
    attention = torch.ones(2, 37, device=DEVICE)
    attention[1, 30:] = 0
    documents = torch.tensor([1] * 11 + [2] * 15 + [3] * 11, device=DEVICE).repeat(2, 1)
    documents[1, 30:] = 0  # padding
    masks = padding_masks(attention, documents, config.conv_kernel_size)
    results = []
    for impl in ("torch", "triton"):
        config.sdconv_impl = impl
        layer.zero_grad(set_to_none=True)
        out = layer(hidden, masks)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), [p.grad for p in layer.parameters()]))
    (out_torch, grads_torch), (out_triton, grads_triton) = results
    torch.testing.assert_close(out_triton, out_torch, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads_triton, grads_torch):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_every_tuned_block_shape_computes_the_same_forward():
    """The tuner times the forward's block shapes and keeps the fastest, whose values nothing else checks at
    the shapes it is picked for: each shape, launched alone, gives the torch path's output (on CPU the
    interpreter has its one shape; on a GPU, every shape compiled for it)."""
    from convbert_ds.kernels import document_conv_triton as dc

    x, weight, taps, _ = _inputs()
    want = depthwise.document_depthwise_conv(x, weight, taps, impl="torch")
    kernel = dc._document_conv_fwd_kernel
    for config in kernel.configs:
        out = torch.full_like(x, float("nan"))  # every element must be written
        args, meta = dc.forward_args(x, weight, taps, out)
        grid = (x.shape[0] * -(-x.shape[1] // config.kwargs["BLOCK_T"]), -(-x.shape[2] // config.kwargs["BLOCK_C"]))
        kernel.fn[grid](*args, **meta, **config.kwargs, num_warps=config.num_warps)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=str(config))


def test_no_positions_give_a_zero_weight_gradient():
    x, weight, taps, grad_out = _inputs(seq_len=37)
    empty = [t[:, :0] for t in (x, taps, grad_out)]
    grad_x, grad_w = OPS.document_conv_backward(empty[2], empty[0], weight, empty[1], True, True)
    assert grad_x.shape == (3, 0, 40) and torch.equal(grad_w, torch.zeros_like(weight))
