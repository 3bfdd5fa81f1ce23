"""What the trainer's optimizer step asks of the device, counted: a real engine on one gloo rank, with the
DeepSpeed config the trainer builds (``build_ds_config``) from ``ds_configs/zero1_bf16.json``,
``zero0_fp32.json`` and ``zero0_autocast_bf16.json``, the ``tiny`` model, a [2, 64] batch, stepped as the
trainer steps it (``OptimizerStep``: its own fused clipping where DeepSpeed's is off, then
``engine.step()``). The counts are dispatched ops (about one kernel launch each) and host-device syncs
(``OpCounter``, which also counts DeepSpeed's accelerator ``synchronize()``), taken on the third step.

Measured (tiny preset: 110 parameter tensors in 2 groups; the counts grow with the tensors, not their size):

=========================================  =================  ===================================
the optimizer step, third step             ZeRO-1 bf16        ZeRO-0 fp32, ZeRO-0 autocast bf16
=========================================  =================  ===================================
lean: the files as they are, fused AdamW,  301 ops, 2 syncs   14 ops, 0 syncs
the trainer's clipping at ZeRO-0
DeepSpeed's clipping at ZeRO-0             (the same)         236 ops, 0 syncs
before: throughput timer on, bf16          1,773 ops, 7       1,270 ops, 111
overflow check on, torch AdamW unfused
=========================================  =================  ===================================

ConvBERT-small (575 tensors, about as many as base) for scale: ZeRO-1 bf16 1,221 ops / 2 syncs (was 8,673 / 7),
ZeRO-0 with DeepSpeed's clipping 1,156 / 0 (was 6,530 / 571). What ZeRO-1 keeps is DeepSpeed's per-tensor
gradient norm (about 2 ops a tensor, no sync; its partitioned gradients are not in ``.grad``, so the trainer
cannot take the norm itself) and one sync per parameter group where clipping tests the norm
(``is_invalid_grad_norm``). At ZeRO-0 the trainer clips with torch's foreach norm: one launch for all
tensors. The "before" syncs of unfused AdamW are its per-tensor ``step.item()`` (on a GPU
these read host tensors, but the per-tensor work stays). Budgets: the lean counts plus 25% for ops, and no
margin for syncs (each one more is another wait); the "before" run checks that they catch a regression.
The model's own forward and backward are budgeted in tests/model; around them only DeepSpeed's
``synchronize()`` calls are counted here, and there must be none (the "before" settings had 2 a step).
"""

import json

import pytest

from launch import TINY_CONFIG, run_as_one_rank

OP_MARGIN = 1.25
# file -> (step ops, step syncs) as measured (see the docstring)
MEASURED = {"zero1_bf16": (301, 2), "zero0_fp32": (14, 0), "zero0_autocast_bf16": (14, 0)}


def _ds_config(name: str, lean: bool) -> tuple[dict, float]:
    """The DeepSpeed dict the trainer builds from ``ds_configs/NAME.json``, and the norm the trainer clips to
    itself (0: DeepSpeed clips)."""
    from convbert_ds.engine.plan import build_ds_config, load_ds_config, precision_of, trainer_clip_norm
    from convbert_ds.formats.train_config import load_config

    cfg = load_config(TINY_CONFIG, [f"deepspeed.config=ds_configs/{name}.json", "train.precision=null",
                                    "train.micro_batch_size=2", "train.global_batch_size=2"])
    base = load_ds_config(cfg)
    ds = build_ds_config(cfg, base, 2, 1, precision_of(cfg, base))
    if not lean:  # the settings before: DeepSpeed's defaults for all three
        ds.pop("timers")
        ds["bf16"].pop("check_grad_overflow", None)
        ds["optimizer"]["params"].pop("fused")
    return ds, trainer_clip_norm(cfg, ds)


def _measure(runs: list[tuple[str, bool]]) -> dict:
    """One rank, one process group; each (file, lean) gets its engine and three steps."""
    import deepspeed
    import torch

    from convbert_ds.config import ElectraConfig
    from convbert_ds.engine.distributed import init_process_group
    from convbert_ds.engine.optimizer_step import OptimizerStep
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.op_count import OpCounter
    from convbert_ds.model.optim import param_groups

    init_process_group("gloo")
    results = {}
    for name, lean in runs:
        torch.manual_seed(0)
        model = ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=1000,
                                                                max_position_embeddings=512))
        ds, clip = _ds_config(name, lean)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01), config=ds)
        optimizer_step = OptimizerStep(engine, clip, engine.zero_optimization_stage())  # one rank, as the trainer
        ids = torch.randint(5, 1000, (2, 64))
        mask, types = torch.ones_like(ids), torch.zeros_like(ids)
        for _ in range(3):
            around, step = OpCounter(), OpCounter()
            with around:
                out = engine(ids, mask, types, check=False)
                engine.backward(out.loss)
            with step:  # the trainer's step: its own clipping, where it clips, then DeepSpeed's
                optimizer_step()
        results[f"{name}/{'lean' if lean else 'before'}"] = {
            "step": [step.total, step.syncs], "optimizer": type(engine.optimizer).__name__,
            "fused": engine.basic_optimizer.defaults.get("fused"), "tensors": sum(1 for _ in model.parameters()),
            "trainer_clips": clip > 0, "forward_casts": around.ops["aten._to_copy"],
            "backward_copies": around.ops["aten.copy_"],
            "synchronize": around.sync_ops["accelerator.synchronize"] + step.sync_ops["accelerator.synchronize"]}
    return results


@pytest.fixture(scope="module")
def counts():
    return run_as_one_rank(__file__)


@pytest.mark.parametrize("name", list(MEASURED))
def test_the_engine_step_stays_within_its_budget(counts, name):
    ops, syncs = MEASURED[name]
    lean = counts[f"{name}/lean"]
    assert lean["fused"] is True
    assert lean["synchronize"] == 0, "a DeepSpeed timer synchronizes the device (timers, wall_clock_breakdown)"
    assert lean["step"][1] <= syncs, f"engine.step() syncs: {lean}"
    assert lean["step"][0] <= ops * OP_MARGIN, f"engine.step() ops: {lean}"
    # ZeRO-1 bf16 runs DeepSpeed's flat-buffer ZeRO optimizer, not the per-tensor one of ZeRO-0 bf16; at
    # ZeRO-0 (fp32 weights, autocast or not) the optimizer is torch's fused AdamW and the trainer clips.
    assert lean["optimizer"] == ("DeepSpeedZeroOptimizer" if name.startswith("zero1") else "AdamW")
    assert lean["trainer_clips"] == name.startswith("zero0")
    # One rank at ZeRO-0: no all-reduce copying every gradient back onto itself (the model's own forward and
    # backward have a few copies of their own, not one per tensor).
    if name.startswith("zero0"):
        assert lean["backward_copies"] < lean["tensors"] // 4, lean


def test_autocast_runs_the_forward_in_bf16_over_fp32_weights(counts):
    """``zero0_autocast_bf16``: DeepSpeed's ``torch_autocast`` casts each weight use to bf16 in the forward
    (a cast per use, which a compiled step fuses); the fp32 file runs no such casts."""
    autocast, fp32 = counts["zero0_autocast_bf16/lean"], counts["zero0_fp32/lean"]
    assert autocast["forward_casts"] > fp32["forward_casts"] + autocast["tensors"], (autocast, fp32)


def test_the_budget_catches_the_settings_before(counts):
    ops, syncs = MEASURED["zero1_bf16"]
    before = counts["zero1_bf16/before"]
    assert before["synchronize"] == 2  # the throughput timer's, in forward and in step
    assert before["step"][1] > syncs and before["step"][0] > 3 * ops * OP_MARGIN


if __name__ == "__main__":  # the fixture's process
    from convbert_ds.engine.distributed import exit_process

    print(json.dumps(_measure([(name, True) for name in MEASURED] + [("zero1_bf16", False)])))
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then
