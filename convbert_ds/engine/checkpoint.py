"""Saving checkpoints during training: every rank writes, the tag counts only once all ranks are done.

The directory format (tags, COMPLETE, ``latest``, choosing the tag to resume from) is
``convbert_ds.formats.checkpoint.directory``; this module writes it from a running DeepSpeed engine and
loads it back into one.

A save that fails (a full disk, a permission, a quota: any write error on any rank) does not stop
training. Every rank records its first write error and goes on through DeepSpeed's collectives
(writes are skipped, not raised out of them, or the other ranks would wait in its barriers forever);
the ranks then agree on the outcome (an all-reduce), rank 0 removes the partial tag and ``latest``
keeps naming the last complete checkpoint. Training goes on and saves again at the next interval: a
full disk is often fixed by the user deleting files while the run goes on, and stopping would throw
away every step since the last good checkpoint. The run's last save (end of training, or preemption)
has no next interval: when it fails the run exits with ``EXIT_NOT_SAVED`` and one line saying which
steps are not saved and where the last complete checkpoint is.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from convbert_ds.errors import first_line
from convbert_ds.formats.checkpoint import directory as tags
from convbert_ds.formats.checkpoint.rng import load_rng_file, rng_state, set_rng_state
from convbert_ds.formats.safe_pickle import check_directory, deepspeed_loads_weights_only
from convbert_ds.fsutil import write_text_atomically

EXIT_NOT_SAVED = 4  # the run's last save failed: not 3 (EXIT_PREEMPTED), a requeue would hit the same disk


def _fault_injection_point(step: int) -> None:
    """Crash tests: ``CONVBERT_DS_KILL_DURING_SAVE_AT=STEP`` SIGKILLs rank 0 mid-save at that step."""
    at = os.environ.get("CONVBERT_DS_KILL_DURING_SAVE_AT")
    if at is not None and int(at) == step and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def _failure_injection_point(step: int, tag_dir: Path) -> None:
    """Failed-save tests: ``CONVBERT_DS_FAIL_SAVE_AT=STEP`` makes one rank's save fail with ENOSPC after
    DeepSpeed wrote its files (so partial files exist); rank 1 when there is one, to prove the ranks agree."""
    at = os.environ.get("CONVBERT_DS_FAIL_SAVE_AT")
    if at is not None and int(at) == step and dist.get_rank() == min(1, dist.get_world_size() - 1):
        raise OSError(errno.ENOSPC, "No space left on device (CONVBERT_DS_FAIL_SAVE_AT)", str(tag_dir))


class _Writes:
    """One rank's writes during a save: the first error is kept and later writes are skipped.

    DeepSpeed's own writes (its checkpoint engine's ``save``/``makedirs``, the recovery scripts it copies)
    are routed through here while it saves: a write error raised out of ``save_checkpoint`` would skip the
    barriers that follow it there, and the other ranks would wait in them forever.
    """

    def __init__(self, engine):
        self.error: BaseException | None = None
        self.patched = [(engine.checkpoint_engine, "save"), (engine.checkpoint_engine, "makedirs"),
                        (engine, "_copy_recovery_script")]

    def attempt(self, write, *args, **kwargs):
        if self.error is None:
            try:
                return write(*args, **kwargs)
            except OSError as error:
                self.error = error
            except RuntimeError as error:  # torch.save's zip writer says a full disk as "unexpected pos N vs M"
                target = kwargs.get("path", args[1] if len(args) > 1 else "a checkpoint file")
                self.error = OSError(f"writing {target} failed: {first_line(error)}")
        return None

    def __enter__(self):
        for owner, name in self.patched:
            if hasattr(owner, name):
                original = getattr(owner, name)
                setattr(owner, name, lambda *a, _w=original, **k: self.attempt(_w, *a, **k))
        return self

    def __exit__(self, *exc):
        for owner, name in self.patched:
            if name in vars(owner):
                delattr(owner, name)  # the instance attribute set above: the class's method shows again


def _ranks_errors(error: BaseException | None, device) -> list[str]:
    """Every rank calls it, at the same point: ``[]`` when no rank failed, else each failed rank's error."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return []
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else first_line(error))
    return [f"rank {rank}: {text}" for rank, text in enumerate(errors) if text is not None]


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _free_space(directory: Path, last_complete: str | None) -> str:
    """What the user needs to fix a full disk: the space free now, and what a checkpoint takes."""
    try:
        said = f"{_bytes(shutil.disk_usage(directory).free)} free there"
    except OSError:
        said = "free space unknown"
    try:
        manifest = tags.read_manifest(directory / last_complete) if last_complete else None
    except (OSError, ValueError):
        manifest = None
    if manifest:
        said += f", a checkpoint takes {_bytes(sum(f['size'] for f in manifest['files'].values()))}"
    return said


class SaveFailed(Exception):
    """A save failed on at least one rank (every rank raises it); its partial files are gone and ``latest``
    still names ``last_complete``."""

    def __init__(self, directory: Path, tag: str, errors: list[str], free: str, last_complete: str | None):
        self.directory, self.tag, self.last_complete = directory, tag, last_complete
        super().__init__(f"checkpoint {tag} not saved in {directory}: {'; '.join(errors)} ({free})")

    def retry_line(self, next_step: int) -> str:
        kept = f"latest still names {self.last_complete}" if self.last_complete else "no checkpoint is complete yet"
        return f"warning: {self}; {kept}; training goes on and saves again at step {next_step}"

    def final_line(self, step: int) -> str:
        first = tags.step_of(self.last_complete) + 1 if self.last_complete else 1
        where = (f"the last complete checkpoint is {self.directory / self.last_complete}" if self.last_complete
                 else f"there is no complete checkpoint in {self.directory}")
        return f"error: {self}; steps {first}-{step} are not saved; {where}"


def save(engine, directory: Path, step: int, trainer_state: dict, keep_last: int) -> str:
    """Save on every rank; the tag becomes visible (COMPLETE, ``latest``) only once all ranks are done.
    Returns the tag; raises ``SaveFailed`` on every rank when any rank's writes failed."""
    tag = tags.tag_for(step)
    tag_dir, rank, device = directory / tag, dist.get_rank(), engine.device
    with _Writes(engine) as writes:
        if rank == 0:  # re-saving a step (``latest`` moved back): never leave an old COMPLETE over new files
            writes.attempt((tag_dir / tags.COMPLETE).unlink, missing_ok=True)
        engine.save_checkpoint(str(directory), tag=tag, save_latest=False)
    writes.attempt(_failure_injection_point, step, tag_dir)
    writes.attempt(torch.save, rng_state(), tag_dir / f"rng_rank{rank:05d}.pt")
    _fault_injection_point(step)
    errors = _ranks_errors(writes.error, device)  # also the barrier: every rank's files are written
    if not errors:
        if rank == 0:
            writes.attempt(write_text_atomically, tag_dir / tags.TRAINER_STATE,
                           json.dumps(trainer_state, indent=2, default=str))
            writes.attempt(tags.write_manifest, tag_dir, dist.get_world_size())
            writes.attempt(write_text_atomically, directory / tags.LATEST, tag + "\n")
        errors = _ranks_errors(writes.error, device)  # rank 0's writes: the others have none here
    if errors:
        last, free = None, ""
        if rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
            last = tags.latest_complete(directory)
            free = _free_space(directory, last)
        dist.barrier()  # nobody goes on (or exits) before the partial files are gone
        raise SaveFailed(directory, tag, errors, free, last)
    if rank == 0:
        for old in tags.complete_tags(directory)[:-keep_last]:
            shutil.rmtree(directory / old, ignore_errors=True)
    dist.barrier()
    return tag


def load(engine, directory: Path, tag: str) -> dict:
    """Restore DeepSpeed states, this rank's RNG states, and return the trainer state."""
    path = directory / tag
    check_directory(path)  # no pickled global outside the allow-list, before DeepSpeed reads a byte
    with deepspeed_loads_weights_only(engine):
        load_path, _ = engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {path}")
    rng_file = path / f"rng_rank{dist.get_rank():05d}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"{rng_file} not found: the checkpoint was written by fewer ranks; "
                                "resume with the same number of processes for an exact resume")
    set_rng_state(load_rng_file(rng_file))
    return tags.read_trainer_state(path)
