"""Optimiser parameter groups shared by pretraining and fine-tuning (ELECTRA's rules)."""

from __future__ import annotations

from collections.abc import Callable

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
