"""On a GPU: the compiled ELECTRA step (``train.compile_mode: step``) is captured as CUDA graphs.

``compile_step`` asks inductor for CUDA graphs (``reduce-overhead``), but inductor may run a compiled graph
kernel by kernel instead, and with graph partitioning (its default) without saying so. On the H200 the
compiled step showed no replay in a profile. These tests run the step as the trainer does (bf16 autocast,
fused AdamW, ``cudagraph_mark_step_begin`` per step) with partitioning on and off, and count the graphs
the CUDA-graph trees recorded: a failure names the setting and the skips inductor reported. A third
test captures the eager step by hand (``torch.cuda.make_graphed_callables``): the other route to one
launch per step. ``python -m benchmarks.gpu_acceptance`` runs them first. Skipped without CUDA.
"""

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.layers import compile_step, cuda_graphs_recorded, cudagraph_skips
from convbert_ds.model.sdconv import probe_sdconv

# Collected and skipped (not skipped at import): the acceptance's pytest then exits 0 on a CPU smoke run.
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

STEPS = 4  # warm-up call, recording call, then replays


def _tiny_step_parts():
    """A tiny ELECTRA model on the GPU (SDConv kernels probed, as the trainer does), its optimizer and a batch."""
    torch.manual_seed(0)
    config = ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=64)
    device = torch.device("cuda", torch.cuda.current_device())
    model = ElectraForPretraining(config).to(device)
    probe_sdconv(model, device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    input_ids = torch.randint(5, 1000, (4, 64), device=device)
    return model, optimizer, (input_ids, torch.ones_like(input_ids), torch.zeros_like(input_ids))


def _trains(losses: list[torch.Tensor]) -> bool:
    """Finite losses that change from step to step: the replays compute (new masks, new weights)."""
    return all(torch.isfinite(loss) for loss in losses) and len({loss.item() for loss in losses}) > 1


@pytest.mark.parametrize("partition", [True, False], ids=["graph-partition", "no-graph-partition"])
def test_compiled_step_is_captured_and_replayed(partition):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # also empties the CUDA-graph trees: the count below is this test's
    torch._logging.set_logs(cudagraphs=True)  # inductor's reasons for a skip, in the failure's captured log
    model, optimizer, (input_ids, mask, types) = _tiny_step_parts()
    losses = []
    with inductor_config.patch(graph_partition=partition):  # read when the graphs compile, at the first call
        compile_step(model, cuda=True)
        for _ in range(STEPS):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids, mask, types, check=False)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(out.loss.detach().clone())
    recorded = cuda_graphs_recorded()
    torch._logging.set_logs()
    assert recorded >= 2, (f"graph_partition={partition}: {recorded} CUDA graph(s) recorded after {STEPS} steps "
                           f"(forward and backward expected); inductor reported {cudagraph_skips()} skip(s)")
    assert _trains(losses), losses


class _StepLoss(torch.nn.Module):
    """The ELECTRA step's loss as the only output: ``make_graphed_callables`` takes tensors in and out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids, attention_mask, token_type_ids, check=False).loss


def test_eager_step_can_be_captured_by_hand():
    """Without inductor: ``torch.cuda.make_graphed_callables`` captures the eager forward and backward whole,
    which needs what the step was built for (no host read, static shapes, device-side randomness). If
    inductor's trees do not capture the compiled step, this says whether an explicit capture could."""
    model, optimizer, batch = _tiny_step_parts()
    losses = []
    # The autocast cache would hold casts made during capture: make_graphed_callables refuses it.
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(_StepLoss(model), batch, allow_unused_input=True)
        for _ in range(STEPS):
            loss = graphed(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
    assert _trains(losses), losses
