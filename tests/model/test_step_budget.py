"""The ELECTRA step's budget of device work, counted on the CPU (``convbert_ds.model.op_count``).

On a GPU the step is bound by the host: every dispatched op is about one kernel launch, and every sync
(``.item()``, a boolean index, ``nonzero``, ``unique``) stops the host from queueing ahead. Both are
counted here, without a GPU, so a change that brings them back fails in CI rather than on the next
cluster run. ``python benchmarks/train_step.py`` prints the same counts for the plain loop and the engine.

Measured (ConvBERT-base, batch 2 x 128, forward + backward, fp32): 5,000 ops (bf16 autocast) and 17 syncs
before the static step; 3,557 ops and 0 syncs after it; 3,215 since each layer's input projections (query,
key, value, the conv heads' values) are one matmul. Samples packed from three documents (the trainer's
default input: block masks, the conv's per-position taps, which ``nn.Conv1d`` cannot take): 5,059 ops, and
5,107 since the packed conv's input gradient is the conv of the gradient with reversed weights (a pad and a
flip more per layer), 5,131 since it copies its weights tap-major (one op more per layer). The budgets leave
~5% for harmless change.
"""

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.op_count import OpCounter

BASE_FWD_BWD_OPS = 3380
BASE_PACKED_FWD_BWD_OPS = 5360


def _batch(config: ElectraConfig, batch: int, seq_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.discriminator.vocab_size, (batch, seq_len), generator=gen)
    input_ids[:, 0], input_ids[:, -1] = 2, 3
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, seq_len * 3 // 4:] = 0  # one padded row: masks and counts must not depend on the data
    input_ids[-1, seq_len * 3 // 4:] = 0
    return input_ids, attention_mask, torch.zeros_like(input_ids)


def _three_documents(attention_mask: torch.Tensor) -> torch.Tensor:
    """``document_ids`` of samples packed from three documents of about a third each (0 on padding)."""
    positions = torch.arange(attention_mask.shape[1])
    third = attention_mask.shape[1] // 3
    return (1 + (positions >= third).long() + (positions >= 2 * third).long()) * attention_mask


def _count_step(preset: str, seq_len: int, autocast: bool, packed: bool = False) -> tuple[OpCounter, dict]:
    torch.manual_seed(0)
    config = ElectraConfig.from_preset(preset, vocab_size=30522, max_position_embeddings=512)
    model = ElectraForPretraining(config)
    inputs = _batch(config, 2, seq_len)
    documents = _three_documents(inputs[1]) if packed else None
    with OpCounter(where=True) as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(*inputs, check=False, document_ids=documents)
        out.loss.backward()
    with OpCounter() as metric_ops:
        metrics = out.metric_tensors()
    assert metric_ops.syncs == 0 and set(metrics) >= {"rtd_auc", "replaced_fraction"}, "metrics stay on the device"
    return ops, metrics


def test_base_step_has_no_sync_and_stays_under_its_op_budget():
    ops, _ = _count_step("base", 128, autocast=False)
    assert ops.syncs == 0, ops.sync_sites()
    assert ops.total <= BASE_FWD_BWD_OPS, ops.ops.most_common(15)


def test_packed_base_step_has_no_sync_and_stays_under_its_op_budget():
    ops, _ = _count_step("base", 128, autocast=False, packed=True)
    assert ops.syncs == 0, ops.sync_sites()
    assert ops.total <= BASE_PACKED_FWD_BWD_OPS, ops.ops.most_common(15)


def test_autocast_step_has_no_sync():
    """bf16 autocast adds a cast per weight use (~1,500 at base; bf16 weights, as DeepSpeed's bf16 keeps them,
    have none) but no sync. The tiny preset: CPU bf16 matmuls are slow."""
    ops, _ = _count_step("tiny", 64, autocast=True)
    assert ops.syncs == 0, ops.sync_sites()


def test_input_check_is_the_only_read_and_is_skippable():
    """``check=True`` (the default for users) reads the ids' range; the trainer checks on the host instead."""
    torch.manual_seed(0)
    config = ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=64)
    model = ElectraForPretraining(config)
    inputs = _batch(config, 2, 32)
    with OpCounter() as ops:
        model(*inputs)
    assert 0 < ops.syncs <= 3 and set(ops.sync_ops) == {"aten._local_scalar_dense"}, ops.sync_ops


@pytest.mark.parametrize("masking,packed", [("fixed", False), ("fixed", True), ("bernoulli", False)],
                         ids=["one-document", "packed-documents", "bernoulli-masking"])
def test_step_traces_as_one_graph(masking, packed):
    """``torch._dynamo.explain``: the whole forward (masking, both bodies, sampling, losses) in one graph, also
    with several documents per sample (``document_ids``: block masks, conv taps, restarted positions) and
    with per-token (``bernoulli``) masking. The compiled step against eager (losses, gradient norms, no
    recompiles) is tests/engine/test_compile.py's, inside the DeepSpeed engine."""
    torch.manual_seed(0)
    config = ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=64)
    config.masking = masking
    model = ElectraForPretraining(config)
    inputs = _batch(config, 2, 32)
    documents = (1 + (torch.arange(32) >= 11).long() + (torch.arange(32) >= 20).long()) * inputs[1]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda *inputs: model(*inputs, check=False,
                                                            document_ids=documents if packed else None))(*inputs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1
