"""The depthwise convolution over packed documents (``convbert_ds/model/depthwise.py``) against its
definition and against torch's own depthwise ``conv1d``."""

import pytest
import torch
import torch.nn.functional as F

from convbert_ds.model.depthwise import document_depthwise_conv
from convbert_ds.model.sdconv import same_segment_taps

KERNEL = 9


def packed_documents(batch: int = 3, seq: int = 29) -> torch.Tensor:
    """Document ids with boundaries closer together than the kernel, a one-token document and padding."""
    starts = torch.tensor([0, 3, 4, 12, 20])
    ids = (torch.arange(seq)[:, None] >= starts).sum(-1)
    ids[25:] = 0  # padding: its own segment
    return torch.stack([ids.roll(shift, 0) if shift else ids for shift in range(batch)])


def by_definition(x, weight, taps):
    """The formula itself: each position's K-tap window (an unfold), weighted per channel and per tap."""
    windows = F.pad(x, (0, 0, KERNEL // 2, KERNEL // 2)).unfold(1, KERNEL, 1)  # [B, T, C, K]
    return (windows * weight * taps[:, :, None, :]).sum(-1)


def inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    documents = packed_documents()
    x = torch.randn(*documents.shape, 6, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(6, KERNEL, generator=gen, dtype=dtype, requires_grad=True)
    return x, weight, same_segment_taps(documents, KERNEL).to(dtype)


def test_values_and_gradients_follow_the_definition():
    x, weight, taps = inputs()
    grad_out = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (document_depthwise_conv, by_definition):
        out = fn(x, weight, taps)
        results.append((out, *torch.autograd.grad(out, (x, weight), grad_out)))
    for ours, expected, name in zip(*results, ("output", "grad x", "grad weight")):
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12, msg=name)
    assert torch.autograd.gradcheck(lambda a, w: document_depthwise_conv(a, w, taps), (x, weight))


def test_same_document_taps_are_symmetric():
    """What the torch path's backward relies on: tap k of t is on exactly when tap K-1-k of t + k - P is."""
    taps = same_segment_taps(packed_documents(), KERNEL)
    pad, seq = KERNEL // 2, taps.shape[1]
    for k in range(KERNEL):
        t = torch.arange(max(0, pad - k), min(seq, seq + pad - k))  # both ends inside the sequence
        assert torch.equal(taps[:, t, k], taps[:, t + k - pad, KERNEL - 1 - k]), k
    assert taps.sum() < taps.numel() * 0.9  # the boundaries cut taps: the check above saw zeros too


def test_one_document_is_torchs_depthwise_conv1d():
    """With one document per row the taps only cut at the ends: torch's ``same``-padded conv1d exactly."""
    x, weight, _ = inputs()
    taps = same_segment_taps(torch.ones(x.shape[:2], dtype=torch.long), KERNEL).to(x.dtype)
    ours = document_depthwise_conv(x, weight, taps)
    conv = F.conv1d(x.transpose(1, 2), weight[:, None, :], padding=KERNEL // 2, groups=x.shape[2]).transpose(1, 2)
    torch.testing.assert_close(ours, conv, rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad(out.square().sum(), (x, weight)) for out in (ours, conv)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_half_precision_accumulates_in_fp32_and_keeps_its_dtypes():
    x64, weight64, taps = inputs()
    x, weight = x64.detach().bfloat16().requires_grad_(), weight64.detach().float().requires_grad_()
    out = document_depthwise_conv(x, weight, taps.bfloat16())
    out.float().sum().backward()
    assert (out.dtype, x.grad.dtype, weight.grad.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    expected = by_definition(x.detach().double(), weight.detach().double(), taps)
    # One rounding of the bf16 output (8 bits of mantissa), not nine additions' worth.
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-6)


def test_mismatched_shapes_are_named():
    x, weight, taps = inputs()
    with pytest.raises(ValueError, match=r"taps \[B, T, K\]; got \(3, 29, 6\), \(6, 9\) and \(3, 28, 9\)"):
        document_depthwise_conv(x, weight, taps[:, :28])
