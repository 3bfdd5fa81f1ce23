"""A rank of tests/engine/test_evaluation.py: the trainer's ``Evaluation`` on the validation batches
``validation_batches()`` deals it (batch i to rank i mod world), as ``spawn_ranks`` starts it on gloo ranks.

    python tests/spawn_ranks.py 2 PORT -- python tests/engine/evaluation_worker.py OUT_DIR

The model is replaced by its outputs: each batch carries the discriminator's logits and which tokens were
replaced, and ``forward`` hands them to ``electra_output``, the real metrics code, so the subject is how the
pass combines batches and ranks. Rank 0 writes ``OUT_DIR/metrics.json``: the metrics and the syncs counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BATCHES, ROWS, SEQ, PADDED = 6, 4, 48, 8


def validation_batches() -> list[dict]:
    """Batches whose logits sit at different offsets (a batch of hard tokens, one of easy ones): each batch
    ranks its replaced tokens well, the set as a whole less so. The last ``PADDED`` positions of every row
    are padding with the highest logits: counted, they would move the AUC."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for i in range(BATCHES):
        replaced = torch.rand(ROWS, SEQ, generator=gen) < 0.2
        logits = torch.randn(ROWS, SEQ, generator=gen) + 2.0 * replaced + 1.5 * (i - BATCHES / 2)
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        mask[:, -PADDED:] = 0
        logits[:, -PADDED:] = 30.0
        replaced[:, -PADDED:] = False
        batches.append({"logits": logits, "replaced": replaced, "mask": mask})
    return batches


class _Engine:
    device = torch.device("cpu")

    def eval(self):
        pass

    def train(self):
        pass


class _Step:
    """What ``Evaluation`` uses of ``TrainStep``: the engine, whether it is pipelined, ``forward``."""

    engine, pipelined = _Engine(), False

    def forward(self, batch):
        from convbert_ds.model.electra import electra_output

        zero = torch.zeros(())
        return electra_output(zero, zero, batch["logits"], batch["replaced"], batch["mask"], rtd_weight=1.0)


def main(out: Path) -> None:
    import torch.distributed as dist

    from convbert_ds.engine import distributed
    from convbert_ds.engine.evaluation import Evaluation
    from convbert_ds.model.op_count import OpCounter

    distributed.discover()
    distributed.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = validation_batches()[rank::world]
    evaluation = Evaluation(_Step(), mine, interval=1, seed=0, dp_rank=rank, progress=None, metrics_log=None)
    with OpCounter() as ops:
        metrics = evaluation.evaluate()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps({"metrics": metrics, "syncs": ops.syncs,
                                                      "batches_per_rank": len(mine)}))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
