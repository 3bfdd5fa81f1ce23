"""``compile_step(layers_once=True)`` (``train.compile_layers_once``): every encoder layer calls one compiled
region per width instead of being unrolled into the step's graph. It must compute what eager computes.

The case that matters is a region called more than once: in torch 2.13, inductor's buffer reuse let a
reused region's backward read memory that had since been overwritten, and the discriminator's last layer's
input projections got gradients about 100% off while the loss was right to 10 digits. So the model here has
three layers per body (two reuses each) and packed documents, and every parameter's gradient is compared,
not the loss alone. Dropout is on: the compiled step draws the same masks as eager (``fallback_random``).
On a GPU the same check runs on CUDA (``python -m benchmarks.gpu.acceptance`` runs that case).

Measured on CPU (fp32, one step): the largest difference of any gradient from eager is 2e-6; the test
allows a relative 1e-4 per tensor.
"""

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.layers import compile_step, compiled_graph_count, probe_triton_kernels

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _step(model, inputs, documents, seed: int):
    """Loss and every parameter's gradient of one training step, drawn from ``seed``."""
    torch.manual_seed(seed)
    out = model(*inputs, check=False, document_ids=documents)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_layers_compiled_once_give_the_eager_gradients(device):
    torch.manual_seed(0)
    config = ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=64, num_hidden_layers=3)
    model = ElectraForPretraining(config).to(device)
    if device == "cuda":  # as the trainer does: the Triton kernels are probed eagerly, before any tracing
        probe_triton_kernels(model, torch.device("cuda", torch.cuda.current_device()), torch.float32)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 1000, (2, 64), generator=gen).to(device)
    inputs = (input_ids, torch.ones_like(input_ids), torch.zeros_like(input_ids))
    positions = torch.arange(64, device=device)
    documents = (1 + (positions >= 21).long() + (positions >= 40).long()).expand(2, -1).contiguous()
    eager = _step(model, inputs, documents, seed=7)

    torch._dynamo.reset()
    graphs_before = compiled_graph_count()  # a count over the process: other tests in it compiled too
    compile_step(model, cuda_graphs=False, layers_once=True)
    compiled = _step(model, inputs, documents, seed=7)

    assert compiled_graph_count() - graphs_before == 1  # still one graph for the whole step, the regions inside
    assert torch.allclose(compiled[0], eager[0], rtol=1e-5), (compiled[0].item(), eager[0].item())
    assert compiled[1].keys() == eager[1].keys()
    # The keys' biases have a true gradient of zero (the softmax ignores a shift of every score of a query
    # alike): what they get is rounding, and a relative error of rounding means nothing.
    off = {name: _relative(compiled[1][name], grad) for name, grad in eager[1].items()
           if not name.endswith("self.key.bias") and _relative(compiled[1][name], grad) > 1e-4}
    assert not off, f"{len(off)} of {len(eager[1])} gradients differ from eager: {sorted(off.items())[:6]}"
    layers = [name for name in eager[1] if ".encoder.layer.2." in name]
    assert layers, "the last layer of each body (the discriminator's went wrong) is among those compared"
