"""The trainer's part of an optimizer step: after each micro-batch's backward, ``engine.step()``; at the
accumulation boundary, first the data-parallel gradient all-reduce and the clipping where DeepSpeed's
own would cost a launch per parameter tensor.

Where each parameter's ``.grad`` holds its whole fp32 gradient (ZeRO-0 with fp32 weights: fp32, or torch
autocast; no pipeline, no fp16 loss scale; ``plan.whole_fp32_grads``):

- **the all-reduce.** DeepSpeed's (``engine.allreduce_gradients``, inside ``backward``) flattens the
  gradients, all-reduces the flat tensor and copies it back one parameter tensor at a time: a copy kernel
  per tensor (568 for ConvBERT-base) every step. Here the same flatten and all-reduce (DeepSpeed's own,
  through ``deepspeed_seam.gradient_allreduce``, so its averaging and ``communication_data_type`` hold) and
  one multi-tensor copy back. The reduced values are the same.
- **the clipping**: one fused norm over all tensors (``plan.trainer_clip_norm``; DeepSpeed's is off).

On one data-parallel rank at ZeRO-0 there is nothing to reduce: DeepSpeed's all-reduce would copy every
gradient back onto itself, so it is off whatever the precision. (ZeRO-1/2 move the gradients into their
partitions in theirs: kept.)
"""

from __future__ import annotations

import torch

from convbert_ds.engine import deepspeed_seam


class OptimizerStep:
    def __init__(self, engine, max_norm: float, zero_stage: int, dp_size: int = 1, whole_fp32_grads: bool = False):
        """``max_norm``: ``plan.trainer_clip_norm`` (0: DeepSpeed clips, or nothing is clipped)."""
        self.engine, self.max_norm = engine, max_norm
        self.norm: torch.Tensor | None = None  # the last clipped norm (a device tensor, read on logging steps)
        trained = [p for p in engine.module.parameters() if p.requires_grad]
        # Listed once: walking the module tree for them at every step is host time per tensor (568 at base).
        self.clipped = trained if max_norm > 0 else []
        self.params: list[torch.nn.Parameter] = []  # whose gradients the trainer all-reduces; empty: none
        if zero_stage == 0 and (dp_size == 1 or whole_fp32_grads):
            deepspeed_seam.turn_off_backward_allreduce(engine)  # nothing to reduce, or the trainer reduces
            if dp_size > 1:
                self.params = trained
                self.reduce = deepspeed_seam.gradient_allreduce(engine)  # at set-up: a mismatch fails here

    def __call__(self) -> None:
        if self.engine.is_gradient_accumulation_boundary():
            if self.params:
                self._all_reduce()
            if self.max_norm > 0:
                self.norm = torch.nn.utils.clip_grad_norm_(self.clipped, self.max_norm)
        self.engine.step()

    def _all_reduce(self) -> None:
        # A Python pass over the parameters (DeepSpeed's own reduce makes one too), no device op per tensor:
        # a missing gradient is zero-filled, as DeepSpeed does, so every rank reduces the same tensors.
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        torch._foreach_copy_(grads, self.reduce(grads))
