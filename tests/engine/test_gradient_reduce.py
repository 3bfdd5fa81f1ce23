"""The trainer's own gradient all-reduce at ZeRO-0 with fp32 gradients (``engine/optimizer_step.py``) against
DeepSpeed's, on 2 real gloo ranks: each rank a different batch, two real engines from the same weights
(the lean autocast file, as the trainer builds it), one reduced by DeepSpeed inside ``backward``, the other by
the trainer at the accumulation boundary. Both then clip with the trainer's fused norm and step.

What must hold: the same weights after every step, bit for bit (the same flatten and all-reduce, only the
copy back differs), and the copy back as one multi-tensor op where DeepSpeed's is one ``copy_`` per
parameter tensor (110 for the tiny model; 568 for ConvBERT-base).
"""

import json
import os
import subprocess
import sys

import pytest

from launch import REPO, TINY_CONFIG, free_port

STEPS = 3


def _engine(name: str, whole_fp32_grads: bool):
    import deepspeed
    import torch

    from convbert_ds.config import ElectraConfig
    from convbert_ds.engine.optimizer_step import OptimizerStep
    from convbert_ds.engine.plan import build_ds_config, load_ds_config, precision_of, trainer_clip_norm
    from convbert_ds.formats.train_config import load_config
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.optim import param_groups

    cfg = load_config(TINY_CONFIG, [f"deepspeed.config=ds_configs/{name}.json", "train.precision=null",
                                    "train.micro_batch_size=2", "train.global_batch_size=4"])
    base = load_ds_config(cfg)
    ds = build_ds_config(cfg, base, 2, 1, precision_of(cfg, base))
    torch.manual_seed(0)
    model = ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=512))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01), config=ds)
    step = OptimizerStep(engine, trainer_clip_norm(cfg, ds), engine.zero_optimization_stage(), 2, whole_fp32_grads)
    return engine, step


def _measure() -> dict:
    import torch
    import torch.distributed as dist

    from convbert_ds.engine.distributed import init_process_group
    from convbert_ds.model.op_count import OpCounter

    init_process_group("gloo")
    rank = dist.get_rank()
    engines = {"deepspeed": _engine("zero0_autocast_bf16", False), "trainer": _engine("zero0_autocast_bf16", True)}
    initial = [p.detach().clone() for p in engines["deepspeed"][0].module.parameters()]
    counts, weights = {}, {}
    for who, (engine, optimizer_step) in engines.items():
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        for _ in range(STEPS):
            ids = torch.randint(5, 1000, (2, 64), generator=generator)
            torch.manual_seed(7 + rank)  # the same masks and samples for both engines
            counter = OpCounter()
            with counter:
                out = engine(ids, torch.ones_like(ids), torch.zeros_like(ids), check=False)
                engine.backward(out.loss)
                optimizer_step()
        counts[who] = {"total": counter.total, "copies": counter.ops["aten.copy_"],
                       "foreach_copies": counter.ops["aten._foreach_copy_"],
                       "tensors": sum(1 for _ in engine.module.parameters()),
                       "allreduce_in_backward": engine.enable_backward_allreduce}
        weights[who] = [p.detach().clone() for p in engine.module.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(weights["deepspeed"], weights["trainer"]))
    trained = not all(torch.equal(a, b) for a, b in zip(weights["trainer"], initial))
    return {"rank": rank, "counts": counts, "same_weights": same, "trained": trained}


@pytest.fixture(scope="module")
def measured():
    # Two processes of their own, one rank each: the engines need a 2-rank process group.
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                              "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")})
             for rank in range(2)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-6000:]
    return [json.loads(output.splitlines()[-1]) for output in outputs]


def test_the_trainers_all_reduce_gives_deepspeeds_weights_bit_for_bit(measured):
    for rank in measured:
        assert rank["trained"], "the steps changed no weight: nothing was compared"
        assert rank["same_weights"], f"rank {rank['rank']}: the weights differ from DeepSpeed's all-reduce"


def test_the_gradients_come_back_in_one_multi_tensor_copy(measured):
    for rank in measured:
        ours, theirs = rank["counts"]["trainer"], rank["counts"]["deepspeed"]
        assert not ours["allreduce_in_backward"] and theirs["allreduce_in_backward"]
        tensors = theirs["tensors"]
        assert theirs["copies"] >= tensors, theirs  # DeepSpeed: one copy_ per parameter tensor
        assert ours["copies"] < tensors // 4 and ours["foreach_copies"] == 1, ours
        assert ours["total"] < theirs["total"] - tensors // 2, (ours, theirs)


if __name__ == "__main__":  # the fixture's processes
    from convbert_ds.engine.distributed import exit_process

    print(json.dumps(_measure()))
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then
