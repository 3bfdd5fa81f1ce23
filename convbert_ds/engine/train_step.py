"""One optimizer step on a DeepSpeed engine, plain or pipelined: forward, backward, update, and the step's
metrics when asked for. Nothing here decides *when* anything runs; that is the loop's list in ``trainer.py``.

Metrics stay device tensors until the one read a logging step pays for (a read is a device sync, see
``engine/step_guard.py`` for why the loop avoids them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from convbert_ds.engine.pipeline import pipeline_batch, pipeline_metrics
from convbert_ds.model.convbert import check_inputs


class MetricSums:
    """Per-key sums of the model's metric tensors over micro-batches; ``mean()`` reads them once."""

    def __init__(self, batch_auc: bool = True):
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.batch_auc = batch_auc  # False: no per-batch rtd_auc (evaluation takes the set's, from counts)

    def add(self, out) -> None:
        for key, value in out.metric_tensors(batch_auc=self.batch_auc).items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.count += 1

    def mean(self) -> dict:
        if not self.sums:
            return {}
        values = (torch.stack(list(self.sums.values())) / self.count).tolist()  # the one read
        return dict(zip(self.sums, values))


class TrainStep:
    """``step(batches, want_metrics)``: one optimizer step from ``grad_accum`` micro-batches of ``batches``.

    ``guard`` (``StepGuard``) counts non-finite losses; ``optimizer_step`` is the plain engine's update
    (``OptimizerStep``; None for the pipeline engine, which steps inside ``train_batch``); ``graphs``
    (``StepGraphs``) marks where a CUDA-graph step begins."""

    def __init__(self, engine, model_config, guard, graphs, optimizer_step, grad_accum: int, pipelined: bool):
        self.engine, self.model_config, self.guard, self.graphs = engine, model_config, guard, graphs
        self.optimizer_step, self.grad_accum, self.pipelined = optimizer_step, grad_accum, pipelined

    def to_device(self, batch: dict) -> dict:
        """Checked here, on the host copy, where reading token ids costs no device sync (the model is then
        called with ``check=False``)."""
        check_inputs(self.model_config, batch["input_ids"], batch.get("attention_mask"),
                     batch.get("token_type_ids"), batch.get("document_ids"))
        return {k: v.to(self.engine.device, non_blocking=True) for k, v in batch.items()}

    def forward(self, batch: dict):
        batch = self.to_device(batch)
        self.graphs.begin_step()
        return self.engine(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], check=False,
                           document_ids=batch.get("document_ids"))

    def step(self, batches, want_metrics: bool) -> dict:
        """The step's metrics (mean over micro-batches) only when ``want_metrics``: only logging steps pay
        for the read."""
        if self.pipelined:
            loss = self.engine.train_batch(data_iter=(pipeline_batch(self.to_device(b)) for b in batches))
            self.guard.record(loss)
            return pipeline_metrics(self.engine) if want_metrics else {}
        sums = MetricSums()
        for _ in range(self.grad_accum):
            out = self.forward(next(batches))
            self.guard.record(out.loss)
            if self.guard.drops_nonfinite and not self._agreed_finite(out.loss):
                # Drop this micro-batch: a zero loss that touches every parameter keeps DeepSpeed's
                # gradient hooks in step, without back-propagating through non-finite activations.
                self.engine.backward(sum(p.sum() * 0.0 for p in self.engine.module.parameters()))
            else:
                self.engine.backward(out.loss)
                if want_metrics:
                    sums.add(out)
            self.optimizer_step()
        return sums.mean()

    @staticmethod
    def _agreed_finite(loss: torch.Tensor) -> bool:
        finite = torch.isfinite(loss.detach()).float()
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())
