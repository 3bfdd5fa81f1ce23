"""The trainer as ``python -m convbert_ds.train`` runs it, then the full state of its engine written out, for
tests/engine/test_elastic.py to compare across layouts.

    torchrun --nproc_per_node N tests/engine/reshape_worker.py OUT_DIR --config CONFIG key=value ...

Sets the engine up (which resumes from ``checkpoint.dir`` if it holds a checkpoint, converting it when
the layout differs), trains to ``train.steps`` (nothing to do if the checkpoint is already there), then
gathers the fp32 weights and Adam moments through DeepSpeed's own full-state API on every rank; rank 0
writes ``OUT_DIR/{fp32,exp_avg,exp_avg_sq}.safetensors`` and ``OUT_DIR/info.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

from convbert_ds.engine import distributed
from convbert_ds.engine.plan import resolve
from convbert_ds.engine.prepare import prepare
from convbert_ds.formats.train_config import load_config
from convbert_ds.engine.trainer import Preemption, Trainer
from convbert_ds.engine.universal import gather_state


def main(out: Path, config: str, overrides: list[str]) -> None:
    distributed.discover()
    plan = prepare(resolve(load_config(config, overrides), distributed.world_size()))
    distributed.init_process_group()
    trainer = Trainer(plan)
    trainer.setup()
    resumed_at = trainer.step
    trainer.train(Preemption())
    state = gather_state(trainer.engine, plan.electra, plan.pipelined)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for quantity, tensors in state.items():
            save_file(tensors, str(out / f"{quantity}.safetensors"))
        info = {"resumed_at": resumed_at, "step": trainer.step, "layout": str(plan.layout),
                "consumed_samples": trainer.train_loader.consumed_samples, "lr": trainer.engine.get_lr()[0],
                "global_steps": trainer.engine.global_steps, "global_samples": trainer.engine.global_samples}
        (out / "info.json").write_text(json.dumps(info))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[3], sys.argv[4:])
    distributed.exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then
