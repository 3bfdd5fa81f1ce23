"""Where a run starts: the newest complete checkpoint of ``checkpoint.dir`` (in the layout it was saved in,
bit for bit, or in another one through its universal copy), the previous phase's checkpoint
(``phase.continue_from``), or nothing (step 0).

``resume`` loads the weights, optimizer and sampler state into a running engine and data loader and returns
the run's position; everything the step loop builds after it (logs, progress, saves) starts from there."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from convbert_ds.engine import checkpoint, distributed
from convbert_ds.engine.checkpoint_disk import CheckpointDisk, one_disk
from convbert_ds.engine.plan import RunPlan
from convbert_ds.engine.universal import load_into
from convbert_ds.formats.checkpoint import directory as tags, run_state, store as checkpoint_store, universal
from convbert_ds.formats.checkpoint.run_state import FIRST_PHASE, Phase
from convbert_ds.log import EVERY_RANK, get_logger

log = get_logger(__name__)

@dataclass
class Position:
    """The run's step, its count of micro-batches with a non-finite loss, and its phase (which phase this
    run is, and what the earlier ones saw)."""

    step: int = 0
    nonfinite_total: int = 0
    phase: Phase = FIRST_PHASE  # a run without phase.continue_from is phase 1 with nothing before it


def resume(plan: RunPlan, engine, train_loader, disk: CheckpointDisk | None = None) -> Position:
    """Load the checkpoint this run starts from into ``engine`` and ``train_loader`` (every rank). ``disk``:
    where ``checkpoint.dir`` lives; each disk's keeper (rank 0 on a shared one, each node's first rank on
    node-local ones) tidies and checks its own copy."""
    ckpt_dir = Path(plan.cfg.checkpoint.dir)
    disk = disk or one_disk()
    if disk.keeper:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        removed = tags.remove_incomplete(ckpt_dir)
        if removed:
            log.info(f"removed incomplete checkpoint(s) {removed} from {ckpt_dir} (an interrupted save, or on "
                     "node-local disks this node's part of a save)", extra=EVERY_RANK)
    dist.barrier()
    tag = distributed.on_rank0(lambda: tags.choose_resume_tag(ckpt_dir, plan.cfg.checkpoint.verify))
    if tag is not None and not disk.shared:
        _on_every_disk(plan, disk, tag)
    if tag is None:
        if plan.continue_from is not None:
            return Position(phase=_start_phase(plan, engine, plan.continue_from))
        return Position()
    state = run_state.read(ckpt_dir / tag)
    saved = universal.Layout.of_checkpoint(state)
    if saved == plan.layout:  # the bit-exact path: every rank reads its own files
        checkpoint.load(engine, ckpt_dir, tag)
        changed = ""
    else:
        changed = _load_other_layout(plan, engine, ckpt_dir / tag, saved, disk)
    train_loader.load_state_dict(state.data)
    position = Position(state.step, state.nonfinite_total, state.phase)
    log.info(f"resumed from {ckpt_dir / tag} at step {position.step} "
             f"({train_loader.consumed_samples} samples consumed){changed}")
    before, now = state.global_batch_size, plan.cfg.train.global_batch_size
    if before not in (None, now):
        log.info(f"train.global_batch_size changed from {before} to {now}: the sample stream goes on where it "
                 "stopped, each step now takes the new batch, and the learning-rate schedule still counts steps")
    return position


def _start_phase(plan: RunPlan, engine, tag_dir: Path) -> Phase:
    """Begin a new phase from the previous one's checkpoint (``phase.continue_from``): its weights and
    (``phase.optimizer_state``) Adam's moments, in any layout; this run's step, schedule and data start at 0.
    Returns the new phase's record."""
    cfg = plan.cfg
    state = run_state.read(tag_dir)

    def check() -> None:
        problem = tags.verify(tag_dir, cfg.checkpoint.verify)
        if problem is not None:
            raise tags.CheckpointError(f"phase.continue_from: {tag_dir} is damaged ({problem}); point "
                                       "phase.continue_from at an older checkpoint of that run")

    distributed.on_rank0(check)
    _convert_to_universal(plan, tag_dir, universal.Layout.of_checkpoint(state))
    load_into(engine, tag_dir / tags.UNIVERSAL, plan.electra, plan.pipelined, new_phase=True,
              moments=cfg.phase.optimizer_state)
    phase = state.next_phase(tag_dir)
    log.info(f"phase {phase.index}: continuing from {tag_dir} (its step {state.step}, seq_len "
             f"{state.seq_len} -> {cfg.data.seq_len}, {state.tokens_seen:,} tokens seen before); "
             f"{'weights and Adam moments' if cfg.phase.optimizer_state else 'weights only'}, then "
             f"{cfg.train.steps} steps of its own: new learning-rate schedule, new data order")
    return phase


def _on_every_disk(plan: RunPlan, disk: CheckpointDisk, tag: str) -> None:
    """Node-local disks: the tag rank 0 chose is on every node's disk too, verified there; a node that lacks
    it (or holds a damaged copy) downloads it from the mirror first."""
    ckpt_dir, mirror, mode = Path(plan.cfg.checkpoint.dir), plan.cfg.checkpoint.mirror, plan.cfg.checkpoint.verify

    def fetch() -> None:
        if tags.verify(ckpt_dir / tag, mode) is None:
            return
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        size, seconds = checkpoint_store.download_tag(mirror, tag, ckpt_dir)
        log.info(f"downloaded checkpoint {tag} from {mirror} into {ckpt_dir} ({size / 2**20:,.1f} MiB in "
                 f"{seconds:.1f} s)", extra=EVERY_RANK)
        problem = tags.verify(ckpt_dir / tag, mode)
        if problem is not None:
            raise tags.CheckpointError(f"{mirror}/{tag}: downloaded, but {problem}; {tags.DAMAGED_TAG}")

    distributed.on_ranks(fetch, disk.keeper and dist.get_rank() != 0)


def _convert_to_universal(plan: RunPlan, tag_dir: Path, saved: universal.Layout,
                          disk: CheckpointDisk | None = None) -> None:
    """Each disk's keeper (rank 0 when there is one disk) writes ``tag_dir/universal`` once (kept there for the
    next reader); every rank waits."""
    def convert() -> None:
        if not (tag_dir / tags.UNIVERSAL / universal.META).is_file():
            log.info(f"converting {tag_dir} ({saved}) to a universal checkpoint for {plan.layout}")
        try:
            universal.convert(tag_dir, saved, plan.electra)
        except OSError as error:  # e.g. no space for the copy: one line, not a traceback per rank
            raise universal.ReshapeError(f"cannot read {tag_dir} in another layout: {error}") from None

    distributed.on_ranks(convert, disk.keeper if disk is not None else dist.get_rank() == 0)


def _load_other_layout(plan: RunPlan, engine, tag_dir: Path, saved: universal.Layout, disk: CheckpointDisk) -> str:
    """Resume a checkpoint written in another layout through its universal copy (converted once by rank 0,
    kept beside the checkpoint for the next resume); returns the log line's addition."""
    _convert_to_universal(plan, tag_dir, saved, disk)
    load_into(engine, tag_dir / tags.UNIVERSAL, plan.electra, plan.pipelined)
    # The saved random streams belong to the old ranks; new ones, the same on every rerun.
    seed = np.random.SeedSequence([plan.cfg.train.seed, tags.step_of(tag_dir.name), dist.get_rank()])
    torch.manual_seed(int(seed.generate_state(1)[0]))
    return (f"; layout changed: {saved} -> {plan.layout} (through {tag_dir / tags.UNIVERSAL}, kept "
            "for the next resume; random streams reseeded)")
