"""The captured step (``train.cuda_graphs: capture``) under real DeepSpeed engines, as the trainer sets it up:
the DeepSpeed dict the trainer builds from each file, ``write_grads`` from ``plan.whole_fp32_grads``, the
trainer's optimizer step (``OptimizerStep``). One gloo rank, the ``tiny`` model, three steps.

Without a GPU the CUDA graphs are stood in for by ``RerunRecorder`` (``tests/rerun_recorder.py``): a replay
reruns the step into the same fixed memory. So what is checked is everything around the recording: at ZeRO-0
(fp32, and bf16 autocast) the backward writes ``.grad`` itself and DeepSpeed's optimizer steps on it; at
ZeRO-1 the gradients go through autograd, where DeepSpeed's hooks move them into its partitions; at ZeRO-0 a
step of several micro-batches adds them up in place. Either way the losses and the weights after three
steps are the eager engine's, bit for bit.
"""

import json

import pytest

from launch import TINY_CONFIG, run_as_one_rank

# (DeepSpeed file, micro-batches per optimizer step): several only where the captured backward adds them up
# itself (the plan refuses them at ZeRO-1/2).
RUNS = [("zero0_fp32", 1), ("zero0_autocast_bf16", 1), ("zero1_bf16", 1), ("zero0_fp32", 2)]


def _run(name: str, capture: bool, micro_batches: int) -> tuple[list[float], list, bool, int]:
    """Three steps of ``micro_batches`` micro-batches of 2 samples on a fresh engine; (losses, weights after,
    whether the plan's layout lets the graphs write ``.grad``, the replays run)."""
    import deepspeed
    import torch

    from convbert_ds.config import ElectraConfig
    from convbert_ds.engine.optimizer_step import OptimizerStep
    from convbert_ds.engine.plan import (build_ds_config, load_ds_config, precision_of, trainer_clip_norm,
                                         whole_fp32_grads)
    from convbert_ds.formats.train_config import load_config
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.optim import param_groups
    from convbert_ds.model.step_capture import capture_step
    from rerun_recorder import RerunRecorder

    cfg = load_config(TINY_CONFIG, [f"deepspeed.config=ds_configs/{name}.json", "train.precision=null",
                                    "train.micro_batch_size=2", f"train.global_batch_size={2 * micro_batches}"])
    base = load_ds_config(cfg)
    precision = precision_of(cfg, base)
    ds = build_ds_config(cfg, base, 2, micro_batches, precision)
    write_grads = whole_fp32_grads(ds, cfg.pipeline.stages, precision)
    torch.manual_seed(0)
    model = ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=512))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01), config=ds)
    recorder = RerunRecorder()
    if capture:  # as the trainer does: once the engine has put the parameters where they stay
        capture_step(engine.module, write_grads, accumulates=micro_batches > 1, recorder=recorder)
    optimizer_step = OptimizerStep(engine, trainer_clip_norm(cfg, ds), engine.zero_optimization_stage())
    batches = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3 * micro_batches):  # as the trainer's loop: engine.step() after every micro-batch
        ids = torch.randint(5, 1000, (2, 64), generator=batches)
        torch.manual_seed(10 + step)
        out = engine(ids, torch.ones_like(ids), torch.zeros_like(ids), check=False)
        engine.backward(out.loss)
        optimizer_step()
        losses.append(out.loss.item())
    return losses, [p.detach().float().clone() for p in engine.module.parameters()], write_grads, recorder.replays


def _compare() -> dict:
    import torch

    from convbert_ds.engine.distributed import init_process_group

    init_process_group("gloo")
    results = {}
    for name, micro_batches in RUNS:
        eager_losses, eager_weights, write_grads, _ = _run(name, False, micro_batches)
        losses, weights, _, replays = _run(name, True, micro_batches)
        differing = sum(not torch.equal(a, b) for a, b in zip(weights, eager_weights))
        results[f"{name}/{micro_batches}"] = {"write_grads": write_grads, "losses": losses,
                                              "eager_losses": eager_losses, "weights_differing": differing,
                                              "replays": replays}
    return results


@pytest.fixture(scope="module")
def compared():
    return run_as_one_rank(__file__)


@pytest.mark.parametrize("name,micro_batches", RUNS, ids=[f"{name}-{micro}" for name, micro in RUNS])
def test_the_captured_step_trains_as_the_eager_engine(compared, name, micro_batches):
    run = compared[f"{name}/{micro_batches}"]
    assert run["write_grads"] == name.startswith("zero0")  # ZeRO-1's hooks need autograd's AccumulateGrad
    assert run["replays"] == 2 * 3 * micro_batches, run  # a forward and a backward replay each: captured
    assert run["losses"] == run["eager_losses"], run
    assert run["weights_differing"] == 0, run


if __name__ == "__main__":  # the fixture's process
    from convbert_ds.engine.distributed import exit_process

    print(json.dumps(_compare()))
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then
