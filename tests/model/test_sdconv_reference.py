"""The pure-PyTorch dynamic convolution: exact maths, exact gradients, masking, precision."""

import pytest
import torch

from convbert_ds.model.sdconv import dynamic_conv, dynamic_conv_reference


def unfold_dynamic_conv(kernel_logits, values):
    """The textbook definition, written with an explicit K-times window copy."""
    batch, seq_len, heads, kernel_size = kernel_logits.shape
    pad = (kernel_size - 1) // 2
    padded = torch.nn.functional.pad(values, (0, 0, 0, 0, pad, pad))
    windows = torch.stack([padded[:, k:k + seq_len] for k in range(kernel_size)], dim=-1)  # [B,T,n,d,K]
    return (windows * torch.softmax(kernel_logits, -1)[:, :, :, None, :]).sum(-1)


@pytest.mark.parametrize("kernel_size, seq_len", [(9, 13), (1, 5), (5, 3), (15, 20), (31, 7), (3, 1)])
def test_matches_definition_and_gradcheck(kernel_size, seq_len):
    gen = torch.Generator().manual_seed(kernel_size * 100 + seq_len)
    logits = torch.randn(2, seq_len, 3, kernel_size, dtype=torch.double, generator=gen, requires_grad=True)
    values = torch.randn(2, seq_len, 3, 4, dtype=torch.double, generator=gen, requires_grad=True)
    assert torch.allclose(dynamic_conv_reference(logits, values), unfold_dynamic_conv(logits, values))
    assert torch.autograd.gradcheck(dynamic_conv_reference, (logits, values))


def test_value_mask_zeroes_padded_neighbours():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, 1, 3, dtype=torch.double, generator=gen, requires_grad=True)
    values = torch.randn(1, 6, 1, 2, dtype=torch.double, generator=gen, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]], dtype=torch.double)
    masked = dynamic_conv_reference(logits, values, mask)
    assert torch.allclose(masked, unfold_dynamic_conv(logits, values * mask[:, :, None, None]))
    assert torch.autograd.gradcheck(lambda a, b: dynamic_conv_reference(a, b, mask), (logits, values))


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_accumulates_in_fp32(dtype, tolerance):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 40, 2, 9, generator=gen)
    values = torch.randn(2, 40, 2, 16, generator=gen)
    out = dynamic_conv_reference(logits.to(dtype), values.to(dtype))
    assert out.dtype == dtype
    exact = unfold_dynamic_conv(logits.to(dtype).double(), values.to(dtype).double())
    assert (out.double() - exact).abs().max() < tolerance


def test_bad_shapes_and_impls_are_rejected():
    with pytest.raises(ValueError, match="odd kernel size"):
        dynamic_conv_reference(torch.zeros(1, 4, 2, 4), torch.zeros(1, 4, 2, 8))
    with pytest.raises(ValueError, match="same B, T, n"):
        dynamic_conv_reference(torch.zeros(1, 4, 2, 3), torch.zeros(1, 5, 2, 8))
    with pytest.raises(ValueError, match="sdconv_impl"):
        dynamic_conv(torch.zeros(1, 4, 2, 3), torch.zeros(1, 4, 2, 8), impl="cuda")


def test_segments_restart_the_convolution_at_document_boundaries():
    """Two documents packed into one row give, for each, what the document gives alone (output and both
    gradients), and the result passes gradcheck."""
    gen = torch.Generator().manual_seed(2)
    lengths = (4, 7)
    logits = torch.randn(1, sum(lengths), 2, 5, dtype=torch.double, generator=gen, requires_grad=True)
    values = torch.randn(1, sum(lengths), 2, 3, dtype=torch.double, generator=gen, requires_grad=True)
    segments = torch.tensor([[1] * lengths[0] + [2] * lengths[1]])
    packed = dynamic_conv_reference(logits, values, segments=segments)
    alone = torch.cat([dynamic_conv_reference(logits[:, a:b], values[:, a:b]) for a, b in ((0, 4), (4, 11))], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
    weights = torch.randn_like(packed)
    grads = torch.autograd.grad((packed * weights).sum(), (logits, values))
    grads_alone = torch.autograd.grad((alone * weights).sum(), (logits, values))
    for got, want in zip(grads, grads_alone):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: dynamic_conv_reference(a, b, segments=segments), (logits, values))
