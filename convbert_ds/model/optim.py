"""Optimiser parameter groups shared by pretraining and fine-tuning (ELECTRA's rules)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def applies_weight_decay(name: str, param: torch.Tensor) -> bool:
    """ELECTRA's rule: no weight decay on biases (the conv branch's [A, 1] bias too) and LayerNorm weights."""
    return param.dim() > 1 and not name.endswith("bias") and "LayerNorm" not in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups, with and without weight decay; a parameter shared under two names appears once."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # lists a shared tensor once, under its first name
        if param.requires_grad:
            (decay if applies_weight_decay(name, param) else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def layerwise_param_groups(model: torch.nn.Module, lr: float, weight_decay: float, decay_rate: float,
                           depth_of: Callable[[str], int], max_depth: int) -> list[dict]:
    """ELECTRA's layer-wise learning-rate decay: a parameter at ``depth`` gets
    ``lr * decay_rate ** (max_depth - depth)``, so the layers nearest the input move least.

    Each group records its ``depth`` and its ``base_lr`` (the schedule scales that).
    """
    groups: dict[tuple[int, bool], dict] = {}
    for name, param in model.named_parameters():  # lists a shared tensor once, under its first name
        if not param.requires_grad:
            continue
        depth, decays = depth_of(name), applies_weight_decay(name, param)
        if not 0 <= depth <= max_depth:
            raise ValueError(f"parameter {name}: depth {depth} outside [0, {max_depth}]")
        group = groups.setdefault((depth, decays), {
            "params": [], "names": [], "depth": depth, "weight_decay": weight_decay if decays else 0.0,
            "base_lr": lr * decay_rate ** (max_depth - depth)})
        group["params"].append(param)
        group["names"].append(name)
    for group in groups.values():
        group["lr"] = group["base_lr"]
    return [groups[key] for key in sorted(groups)]


def linear_warmup_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate: linear warm-up from 0, then linear decay to 0 at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def pretraining_warmup_steps(warmup_steps: int, steps: int) -> int:
    """The warm-up pretraining runs: ``train.warmup_steps``, but at most ``steps - 1``, so that the peak
    learning rate is reached, at the last step at the latest."""
    return max(0, min(warmup_steps, steps - 1))


@dataclass(frozen=True)
class WarmupDecay:
    """Pretraining's learning-rate schedule as the run plan holds it; called with an optimizer (DeepSpeed calls
    ``deepspeed.initialize(lr_scheduler=...)`` so), it returns the ``LinearWarmupDecayLR`` that runs it.
    ``warmup_steps`` is the one that runs (``pretraining_warmup_steps``)."""

    lr: float
    warmup_steps: int
    total_steps: int

    @classmethod
    def of(cls, train) -> WarmupDecay:
        """The schedule of a training config's ``train`` section: ``train.lr`` peak, linear warm-up over
        ``train.warmup_steps`` (at most ``train.steps - 1``), linear decay to 0 over ``train.steps``."""
        return cls(train.lr, pretraining_warmup_steps(train.warmup_steps, train.steps), train.steps)

    def note(self, asked_warmup_steps: int) -> str | None:
        """The line a run starts with when its warm-up is not ``train.warmup_steps`` (None when it is)."""
        if asked_warmup_steps == self.warmup_steps:
            return None
        return (f"note: train.warmup_steps={asked_warmup_steps} with train.steps={self.total_steps}: the warm-up "
                f"runs {self.warmup_steps} steps, so that the peak learning rate is reached by the last step; set "
                f"train.warmup_steps <= {self.warmup_steps}")

    def __call__(self, optimizer) -> LinearWarmupDecayLR:
        return LinearWarmupDecayLR(optimizer, self.lr, self.warmup_steps, self.total_steps)


class LinearWarmupDecayLR:
    """Step k (from 1) runs at ``lr x linear_warmup_decay(k - 1, warmup_steps, total_steps)``: with warm-up 0,
    step 1 runs at the peak; with W, steps 1..W climb from 0 and step W + 1 is the peak; then linear decay.

    Instead of DeepSpeed's WarmupDecayLR, which raises its warm-up to at least 2 steps and runs
    two steps at its minimum (its first ``step()`` comes after step 1 and computes 0 again): asked for no
    warm-up, it ran 0, 0, lr/2, then lr. The interface is DeepSpeed's (``step``, ``get_lr``, ``get_last_lr``,
    ``state_dict``, ``load_state_dict``) and so is the state, ``{"last_batch_iteration": completed steps - 1}``,
    so a checkpoint written with DeepSpeed's scheduler resumes at the same step with this one.
    """

    def __init__(self, optimizer, lr: float, warmup_steps: int, total_steps: int, last_batch_iteration: int = -1):
        self.optimizer, self.peak = optimizer, lr
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()  # the first step's rate, before any step() (DeepSpeed's does the same)

    def get_lr(self) -> list[float]:
        """The rate of the next step, per parameter group."""
        return self._rates(self.last_batch_iteration + 1)

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def ran_lr(self) -> list[float]:
        """The rate the last optimizer step ran at, per parameter group (the one a step's log line reports:
        ``get_lr`` is already the next step's); before any step, the first step's. From the position alone, so
        it holds after a resume too."""
        return self._rates(max(self.last_batch_iteration, 0))

    def _rates(self, iteration: int) -> list[float]:
        factor = linear_warmup_decay(iteration, self.warmup_steps, self.total_steps)
        return [self.peak * factor for _ in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """After an optimizer step (DeepSpeed's engine calls it); sets the next step's rate."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._last_lr = self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        # Only the position, as DeepSpeed's: the optimizer's state, loaded beside it, holds the groups' rates.
        self.last_batch_iteration = state["last_batch_iteration"]

    def _apply(self) -> list[float]:
        rates = self.get_lr()
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        return rates
