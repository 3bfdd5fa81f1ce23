"""Universal copies and a live engine: every rank takes its part of one (``load_into``, the trainer's
reshaped resume) or the full state is gathered from all ranks (``gather_state``, the tests' oracle).

The copy's format, and reading it out of a checkpoint of any layout, is
``convbert_ds.formats.checkpoint.universal``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from convbert_ds.config import ElectraConfig
from convbert_ds.formats.checkpoint.names import canonical_names, pipeline_to_plain
from convbert_ds.formats.checkpoint.universal import META, QUANTITIES, ReshapeError


def _module_names(engine, electra: ElectraConfig, pipelined: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """(canonical plain name, parameter) for every trainable parameter this rank's module holds."""
    canonical = canonical_names(electra)
    rename = pipeline_to_plain(electra) if pipelined else (lambda name: name)
    return [(canonical[rename(name)], p) for name, p in engine.module.named_parameters() if p.requires_grad]


def _base_optimizer(engine):
    """The torch optimizer underneath DeepSpeed's wrappers (ZeRO, bf16), or the optimizer itself."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _fp32_copies(engine) -> dict | None:
    """bf16/fp16 without ZeRO (DeepSpeed's unfused optimizer): module parameter -> the fp32 copy Adam updates."""
    optimizer = engine.optimizer
    if not (hasattr(optimizer, "fp16_groups") and hasattr(optimizer, "fp32_groups")):
        return None
    return {lp: hp for lps, hps in zip(optimizer.fp16_groups, optimizer.fp32_groups) for lp, hp in zip(lps, hps)}


def _init_adam_state(engine, step: torch.Tensor) -> None:
    """Give every tensor the optimizer updates the state Adam creates at its first step (a fresh engine has
    none yet), and let DeepSpeed point its per-parameter views at it."""
    base = _base_optimizer(engine)
    # ZeRO-3 hands torch's Adam one sub-group at a time, so its groups do not list every tensor it updates.
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or \
        [flat for group in base.param_groups for flat in group["params"]]
    # Fused AdamW keeps its step count as float32 on the parameters' device (as torch's own loading does).
    fused = bool(base.defaults.get("fused"))
    for flat in flats:
        flat_step = step.to(flat.device, torch.float32) if fused else step.clone()
        if not base.state[flat]:
            base.state[flat] = {"step": flat_step, "exp_avg": torch.zeros_like(flat),
                                "exp_avg_sq": torch.zeros_like(flat)}
        else:
            base.state[flat]["step"] = flat_step
    _link_views(engine)


def _link_views(engine) -> None:
    """Point DeepSpeed's per-parameter views (ZeRO-1/2, bf16) at the optimizer state as it is now.

    DeepSpeed links them once, just before the first step, when torch's Adam has no state yet, and never
    again: without this its full-state API finds no moments, and values set through it would land nowhere.
    """
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()


def _set_zero3_piece(optimizer, param, value: torch.Tensor, key: str | None) -> None:
    """ZeRO-3's own ``set_full_hp_param`` reads past the end of a parameter whose size the ranks do not
    divide (the last piece is padded); this takes the piece from the value padded the same way."""
    piece, _ = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    start = piece.numel() * optimizer._get_param_partition_rank(param)
    flat = value.flatten()[start:start + piece.numel()]
    piece.zero_()
    piece[:flat.numel()].copy_(flat)


def load_into(engine, universal_dir: Path, electra: ElectraConfig, pipelined: bool, new_phase: bool = False,
              moments: bool = True) -> dict:
    """Set this rank's part of the weights, fp32 masters, Adam moments and step, the LR schedule and
    DeepSpeed's counters from ``universal_dir``; returns its metadata. Every rank calls it.

    ``new_phase``: the weights (and with ``moments`` Adam's state) only; the engine keeps its own fresh
    schedule and counters. ``moments=False``: Adam starts afresh (step 0, zero moments).
    """
    meta = json.loads((universal_dir / META).read_text())
    quantities = QUANTITIES if moments else QUANTITIES[:1]
    optimizer, base = engine.optimizer, _base_optimizer(engine)
    masters = _fp32_copies(engine)
    if base is not optimizer and masters is None and not hasattr(optimizer, "_lazy_init_hp_params_optimizer_state") \
            and not hasattr(optimizer, "fp32_partitioned_groups_flat"):
        raise ReshapeError(f"cannot load a universal checkpoint into {type(optimizer).__name__} (fp16 without "
                           "ZeRO); use a ZeRO-1 DeepSpeed config, or resume with the checkpoint's own layout")
    _init_adam_state(engine, torch.tensor(float(meta["optimizer_step"] if moments else 0)))
    files = {q: safe_open(str(universal_dir / f"{q}.safetensors"), framework="pt") for q in quantities}
    with torch.no_grad():
        for name, param in _module_names(engine, electra, pipelined):
            values = {q: files[q].get_tensor(name) for q in quantities}
            if hasattr(param, "ds_id"):  # ZeRO-3: this rank's piece of the fp32 copy and of each moment
                for quantity, value in values.items():
                    _set_zero3_piece(optimizer, param, value, None if quantity == "fp32" else quantity)
            elif hasattr(param, "_hp_mapping"):  # ZeRO-1/2, bf16: the fragment this rank's partition holds
                for quantity, value in values.items():
                    param.set_full_hp_param(value, None if quantity == "fp32" else quantity)
                param.data.copy_(values["fp32"].to(param.dtype))
            else:  # without ZeRO: Adam updates the module's parameters (fp32) or an fp32 copy of each (bf16)
                master = masters[param] if masters else param
                master.data.copy_(values["fp32"])
                param.data.copy_(values["fp32"].to(param.dtype))
                for quantity in quantities[1:]:
                    base.state[master][quantity].copy_(values[quantity])
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: the module's pieces from the fp32 copy
        for fp32, lp in zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat):
            lp.data.copy_(fp32.data)
    if new_phase:
        return meta
    if engine.lr_scheduler is not None and meta["lr_scheduler"]:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        # The schedule's position alone sets no rate: the optimizer's groups get it at the next step.
        for group, lr in zip(base.param_groups, engine.lr_scheduler.get_lr()):
            group["lr"] = lr
    engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
    engine.skipped_steps = meta["skipped_steps"]
    return meta


def gather_state(engine, electra: ElectraConfig, pipelined: bool) -> dict[str, dict[str, torch.Tensor]]:
    """The full fp32 weights and Adam moments of a live engine (a collective: every rank calls it), by
    canonical name: what a checkpoint of it holds, whatever the layout."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # with an engine only

    base, masters = _base_optimizer(engine), _fp32_copies(engine)
    _link_views(engine)
    out = {q: {} for q in QUANTITIES}
    for name, param in _module_names(engine, electra, pipelined):
        if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):
            out["fp32"][name] = safe_get_full_fp32_param(param).float().cpu().clone()
            for quantity in QUANTITIES[1:]:
                out[quantity][name] = safe_get_full_optimizer_state(param, quantity).float().cpu().clone()
        else:
            master = masters[param] if masters else param
            out["fp32"][name] = master.detach().float().cpu().clone()
            for quantity in QUANTITIES[1:]:
                out[quantity][name] = base.state[master][quantity].float().cpu().clone()
    if pipelined:  # each stage holds its own layers: put the stages together
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, out)
        out = {q: {name: t for part in parts for name, t in part[q].items()} for q in QUANTITIES}
    return out
