"""Universal checkpoints: a checkpoint's weights and Adam state, free of the layout that wrote it.

A DeepSpeed checkpoint is cut to its writer's layout: ZeRO-1/2 flatten every parameter group and give
each data-parallel rank one slice, ZeRO-3 slices every parameter, a pipeline stage keeps only its
layers under its own names, and without ZeRO the optimizer state is keyed by parameter position.
To resume on another layout (more or fewer ranks, another ZeRO stage, pipeline stages or not, fp32 or
bf16) the trainer converts the checkpoint once into the form below, beside it, and every rank of the
new layout takes its part from there (``load_into``).

On disk, ``stepNNNNNNNN/universal/`` (filled in a temporary directory and renamed into place, so a
crash leaves either nothing, and the next resume converts again, or the whole)::

    fp32.safetensors         fp32 master weights under ElectraForPretraining's names (a tensor shared
                             by several names is stored once, under its first name)
    exp_avg.safetensors      Adam's first moments, same names and shapes
    exp_avg_sq.safetensors   Adam's second moments
    universal.json           {"format": 1, "source": the layout that wrote the checkpoint,
                              "optimizer_step": Adam's step count, "lr_scheduler": DeepSpeed's
                              scheduler state, "global_steps", "global_samples", "skipped_steps"}

Safetensors hold no pickle: reading them executes nothing. DeepSpeed's own files are read through
``formats.safe_pickle`` (an allow-list of the globals they need).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from convbert_ds.config import ConfigError, ElectraConfig
from convbert_ds.engine.checkpoint import UNIVERSAL
from convbert_ds.formats.safe_pickle import safe_load
from convbert_ds.fsutil import write_dir_atomically, write_json_atomically
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.optim import param_groups
from convbert_ds.model.tied import tied_groups

META = "universal.json"
QUANTITIES = ("fp32", "exp_avg", "exp_avg_sq")
FORMAT = 1


class ReshapeError(ConfigError):
    """A checkpoint that cannot be carried to another layout; the message says what to do instead."""


@dataclass(frozen=True)
class Layout:
    """How a run is laid out over its ranks: what decides the shape of its DeepSpeed files."""

    world_size: int
    zero_stage: int
    pipeline_stages: int
    precision: str

    @classmethod
    def of_checkpoint(cls, state: dict) -> Layout:
        """The layout a checkpoint's ``trainer_state.json`` records."""
        return cls(int(state.get("world_size", 1)), int(state.get("zero_stage", 0)),
                   int(state.get("pipeline_stages", 1)), state.get("precision", "fp32"))

    def __str__(self) -> str:
        pipeline = f"{self.pipeline_stages} pipeline stages, " if self.pipeline_stages > 1 else ""
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return f"{ranks}, {pipeline}ZeRO-{self.zero_stage}, {self.precision}"


# Names ---------------------------------------------------------------------------------------------
def _meta_model(electra: ElectraConfig) -> ElectraForPretraining:
    with torch.device("meta"):  # names and shapes only, no memory
        return ElectraForPretraining(electra)


def canonical_names(electra: ElectraConfig) -> dict[str, str]:
    """Every parameter name of the plain model (tied twins included) -> the name its tensor is stored under."""
    return {alias: first for first, names in tied_groups(_meta_model(electra)).items() for alias in names}


def pipeline_to_plain(electra: ElectraConfig) -> callable:
    """Maps a ``PipelineModule`` parameter name ("8.attention.self.query.weight", "tied_modules.embeddings.
    LayerNorm.bias") to the plain model's name of the same tensor."""
    # Here: the pipeline package imports DeepSpeed (slow, and it prints); the converter reads plain layouts
    # without it.
    from convbert_ds.engine.pipeline import pipeline_layer_names

    layers = pipeline_layer_names(electra)
    shared = layers[1]  # layer 1 is the shared embeddings (see engine/pipeline/__init__.py)

    def plain(name: str) -> str:
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            return shared + rest.partition(".")[2]
        return layers[int(head)] + rest

    return plain


# Reading DeepSpeed's files -------------------------------------------------------------------------
# One quantity at a time, each parameter copied straight from the ranks' memory-mapped slices into a
# tensor of its own: memory stays near one quantity (the fp32 model size), whatever the number of ranks.
def _zero_flats(optim: dict, zero_stage: int, quantity: str) -> list[torch.Tensor]:
    """One rank's flat partitions of ``quantity``: per parameter group (ZeRO-1/2) or sub-group (ZeRO-3)."""
    osd = optim["optimizer_state_dict"]
    if quantity == "fp32":
        return list(osd["single_partition_of_fp32_groups"] if zero_stage <= 2 else osd["fp32_flat_groups"])
    state = (osd["base_optimizer_state"] if zero_stage <= 2 else osd["optimizer_state_dict"])["state"]
    return [state[index][quantity] for index in sorted(state)]


def _copy_range(parts: list[torch.Tensor], start: int, out: torch.Tensor) -> None:
    """Fill ``out`` with elements ``start ...`` of the tensors in ``parts`` laid end to end (no copy of them)."""
    done = 0
    for part in parts:
        if done == out.numel():
            return
        if start >= part.numel():
            start -= part.numel()
            continue
        take = min(part.numel() - start, out.numel() - done)
        out[done:done + take].copy_(part[start:start + take])
        done, start = done + take, 0
    if done != out.numel():
        raise ReshapeError(f"the optimizer shards end {out.numel() - done} values early")


def _merge_zero12(per_rank: list[list[torch.Tensor]], shapes: list[dict], paddings) -> dict[str, torch.Tensor]:
    """ZeRO-1/2: a group's ranks' slices laid end to end are the group's flat buffer; parameters follow
    in ``param_shapes`` order, each followed by its alignment padding."""
    out = {}
    for group, group_shapes in enumerate(shapes):
        parts, offset = [ranks[group] for ranks in per_rank], 0
        for index, (name, shape) in enumerate(group_shapes.items()):
            out[name] = torch.empty(tuple(shape), dtype=torch.float32)
            _copy_range(parts, offset, out[name].view(-1))
            offset += out[name].numel() + (paddings[group][index] if paddings else 0)
    return out


def _merge_zero3(per_rank: list[list[torch.Tensor]], shapes: list[dict]) -> dict[str, torch.Tensor]:
    """ZeRO-3: every parameter is cut into ``ceil(numel / ranks)`` pieces, rank r holding piece r; a rank's
    pieces follow one another in ``param_shapes`` order across its sub-groups."""
    out, offset = {}, 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        numel = math.prod(shape)
        piece = math.ceil(numel / len(per_rank))
        flat = torch.empty(piece * len(per_rank), dtype=torch.float32)
        for rank, parts in enumerate(per_rank):
            _copy_range(parts, offset, flat[rank * piece:(rank + 1) * piece])
        out[name] = flat[:numel].view(tuple(shape)).clone() if numel < flat.numel() else flat.view(tuple(shape))
        offset += piece
    return out


def _step_of(optim_state: dict) -> int:
    return int(next(iter(optim_state["state"].values()))["step"])


def _base_state(optim: dict, zero_stage: int) -> dict:
    osd = optim["optimizer_state_dict"]
    return osd["base_optimizer_state"] if zero_stage <= 2 else osd["optimizer_state_dict"]


def _read_zero(layout: Layout, stage_files: list[tuple[Path, list[Path]]], rename, quantity: str) -> dict:
    """ZeRO-1/2/3 files: ``stage_files`` = per pipeline stage (one for a plain run), its model-states file and
    its data-parallel ranks' optimizer files. Returns name -> tensor."""
    out = {}
    for model_file, optim_files in stage_files:
        shapes = safe_load(model_file, mmap=True)["param_shapes"]
        optims = [safe_load(f, mmap=True) for f in optim_files]  # mapped: pages are read as they are copied
        per_rank = [_zero_flats(o, layout.zero_stage, quantity) for o in optims]
        merged = (_merge_zero12(per_rank, shapes, optims[0]["optimizer_state_dict"].get("param_alignment_paddings"))
                  if layout.zero_stage <= 2 else _merge_zero3(per_rank, shapes))
        for name, tensor in merged.items():  # a tied table held by two stages: the same values twice
            out.setdefault(rename(name), tensor)
    return out


def _read_zero0(directory: Path, layout: Layout, electra: ElectraConfig, quantity: str) -> dict:
    """No ZeRO: the module and a torch optimizer state keyed by parameter position (the trainer's groups);
    bf16/fp16 wrap it and keep fp32 copies group by group."""
    states = safe_load(directory / "mp_rank_00_model_states.pt", mmap=True)
    model = _meta_model(electra)
    position = {id(p): n for n, p in model.named_parameters()}
    names = [position[id(p)] for group in param_groups(model, 0.0) for p in group["params"]]
    optimizer = states["optimizer"]
    inner = optimizer.get("optimizer_state_dict", optimizer)
    if quantity != "fp32":
        return {name: inner["state"][index][quantity].float().clone() for index, name in enumerate(names)}
    if layout.precision == "fp32":
        return {name: states["module"][name].float().clone() for name in names}
    masters = [t for group in optimizer["fp32_groups"] for t in group]
    return {name: t.reshape(states["module"][name].shape).float().clone() for name, t in zip(names, masters)}


def _files(directory: Path, layout: Layout) -> list[tuple[Path, list[Path]]]:
    """ZeRO-1/2/3 layouts: per pipeline stage (one for a plain run), the model-states and optimizer files."""
    prefix = "bf16_" if layout.precision == "bf16" else ""
    if layout.pipeline_stages > 1:
        ranks = range(layout.world_size // layout.pipeline_stages)
        return [(directory / f"mp_rank_{s:02d}_model_states.pt",
                 [directory / f"{prefix}zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt" for r in ranks])
                for s in range(layout.pipeline_stages)]
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if layout.zero_stage == 3 else "mp_rank_00_model_states.pt"
    return [(directory / model_file,
             [directory / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(layout.world_size)])]


def read_quantity(directory: Path, layout: Layout, electra: ElectraConfig, quantity: str) -> dict[str, torch.Tensor]:
    """One of ``QUANTITIES`` of a checkpoint tag written in ``layout``: canonical name -> fp32 tensor."""
    if layout.pipeline_stages > 1 and layout.zero_stage == 0:
        raise ReshapeError(f"{directory}: a pipeline checkpoint without ZeRO ({layout}) keeps its optimizer "
                           "state by position within each stage and cannot be carried to another layout; "
                           "resume with the same layout (use ZeRO-1 with pipeline stages to stay elastic)")
    if layout.zero_stage == 0:
        tensors = _read_zero0(directory, layout, electra, quantity)
    else:
        rename = pipeline_to_plain(electra) if layout.pipeline_stages > 1 else (lambda name: name)
        tensors = _read_zero(layout, _files(directory, layout), rename, quantity)
    canonical = canonical_names(electra)
    tensors = {canonical[name]: tensor for name, tensor in tensors.items()}
    expected = set(canonical.values())
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ReshapeError(f"{directory}: the {quantity} state does not match the model (missing {missing[:3]}, "
                           f"unexpected {extra[:3]}); the checkpoint was written for another model config")
    return tensors


def read_meta(directory: Path, layout: Layout) -> dict:
    """Adam's step count, the LR schedule's state and DeepSpeed's counters (``universal.json``)."""
    if layout.zero_stage == 0:
        states = safe_load(directory / "mp_rank_00_model_states.pt", mmap=True)
        optimizer = states["optimizer"]
        step = _step_of(optimizer.get("optimizer_state_dict", optimizer))
    else:
        model_file, optim_files = _files(directory, layout)[0]
        states = safe_load(model_file, mmap=True)
        step = _step_of(_base_state(safe_load(optim_files[0], mmap=True), layout.zero_stage))
    return {"format": FORMAT, "source": str(layout), "optimizer_step": step,
            "lr_scheduler": states.get("lr_scheduler") or {},
            **{k: int(states.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}}


def convert(tag_dir: Path, layout: Layout, electra: ElectraConfig) -> Path:
    """Write ``tag_dir/universal`` (once: an existing complete one is reused) and return its path."""
    target = tag_dir / UNIVERSAL
    if (target / META).is_file():
        return target
    for leftover in tag_dir.glob(f".{UNIVERSAL}.*"):  # a conversion killed half-way: redo it
        shutil.rmtree(leftover, ignore_errors=True)
    meta = read_meta(tag_dir, layout)

    def fill(tmp: Path) -> None:
        for quantity in QUANTITIES:
            save_file(read_quantity(tag_dir, layout, electra, quantity), str(tmp / f"{quantity}.safetensors"))
            if os.environ.get("CONVBERT_DS_KILL_DURING_CONVERSION"):  # crash tests: die half-way
                os.kill(os.getpid(), signal.SIGKILL)
        write_json_atomically(tmp / META, meta)  # last: its presence marks a whole conversion

    return write_dir_atomically(target, fill)


# Loading into a live engine ------------------------------------------------------------------------
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
