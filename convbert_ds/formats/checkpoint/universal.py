"""Universal checkpoints: a checkpoint's weights and Adam state, free of the layout that wrote it.

A DeepSpeed checkpoint is cut to its writer's layout: ZeRO-1/2 flatten every parameter group and give
each data-parallel rank one slice, ZeRO-3 slices every parameter, a pipeline stage keeps only its
layers under its own names, and without ZeRO the optimizer state is keyed by parameter position.
To resume on another layout (more or fewer ranks, another ZeRO stage, pipeline stages or not, fp32 or
bf16) the trainer converts the checkpoint once into the form below, beside it, and every rank of the
new layout takes its part from there (``convbert_ds.engine.universal.load_into``).

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

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from convbert_ds.config import ConfigError, ElectraConfig
from convbert_ds.formats.checkpoint.directory import UNIVERSAL
from convbert_ds.formats.checkpoint.names import canonical_names, meta_model, pipeline_to_plain
from convbert_ds.formats.checkpoint.run_state import RunState
from convbert_ds.formats.safe_pickle import safe_load
from convbert_ds.fsutil import write_dir_atomically, write_json_atomically
from convbert_ds.model.optim import param_groups

META = "universal.json"
QUANTITIES = ("fp32", "exp_avg", "exp_avg_sq")
FORMAT = 1
# Called with each quantity once its file is in the temporary directory: where a test's fault injection
# (tests/faulty_train.py) dies half-way through a conversion. None in every real run.
after_quantity_written: Callable[[str], None] | None = None


class ReshapeError(ConfigError):
    """A checkpoint that cannot be carried to another layout; the message says what to do instead."""


@dataclass(frozen=True)
class Layout:
    """How a run is laid out over its ranks: what decides the shape of its DeepSpeed files."""

    world_size: int
    zero_stage: int
    pipeline_stages: int
    precision: str  # what the weights are stored in: fp32 under torch autocast, whatever the compute runs in

    @classmethod
    def of_checkpoint(cls, state: RunState) -> Layout:
        """The layout a checkpoint's ``trainer_state.json`` records."""
        return cls(state.world_size, state.zero_stage, state.pipeline_stages, state.precision)

    def __str__(self) -> str:
        pipeline = f"{self.pipeline_stages} pipeline stages, " if self.pipeline_stages > 1 else ""
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return f"{ranks}, {pipeline}ZeRO-{self.zero_stage}, {self.precision}"


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
    model = meta_model(electra)
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
            if after_quantity_written is not None:
                after_quantity_written(quantity)
        write_json_atomically(tmp / META, meta)  # last: its presence marks a whole conversion

    return write_dir_atomically(target, fill)
