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

A save has two parts: ``stage`` (the step loop waits for it) and ``finish`` (the files written, the ranks'
agreement, the manifest and ``latest``). ``save`` runs both in turn. With ``checkpoint.background``,
``stage`` copies every state DeepSpeed hands its checkpoint engine to host memory instead of writing it,
and ``BackgroundSave`` runs ``finish`` in a thread while training goes on, its collectives on a gloo group of
their own. ``latest`` and COMPLETE are still written last, so a kill during a background save leaves the
previous checkpoint the newest complete one.

With ``checkpoint.mirror`` (an object-store URL), rank 0 then uploads the complete tag (in the same thread for
a background save) and only after that prunes ``checkpoint.dir``: the layout in the store, and why a tag there
is complete only with its COMPLETE, is ``convbert_ds.formats.checkpoint.store``.

On node-local disks (``checkpoint_disk``: each node its own ``checkpoint.dir``) no directory ever holds a whole
tag: each node's first rank uploads its node's part, and the tag is complete once rank 0 has uploaded COMPLETE
and ``latest`` to the mirror after every part was confirmed (``_commit_parts``). A node's failed upload is a
failed save like a full disk: every rank raises ``SaveFailed``, and the store's newest complete tag stays the
previous one.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from convbert_ds.disk_full import free_space, human_bytes
from convbert_ds.engine import deepspeed_seam
from convbert_ds.engine.checkpoint_disk import CheckpointDisk, one_disk
from convbert_ds.errors import first_line
from convbert_ds.formats.checkpoint import directory as tags
from convbert_ds.formats.checkpoint import run_state
from convbert_ds.formats.checkpoint import store as checkpoint_store
from convbert_ds.formats.checkpoint.rng import load_rng_file, rng_state, set_rng_state
from convbert_ds.formats.safe_pickle import check_directory, deepspeed_loads_weights_only
from convbert_ds.fsutil import write_text_atomically
from convbert_ds.log import get_logger

EXIT_NOT_SAVED = 4  # the run's last save failed: not 3 (EXIT_PREEMPTED), a requeue would hit the same disk
log = get_logger(__name__)


class _Writes:
    """One rank's writes during a save: the first error is kept and later writes are skipped.

    DeepSpeed's own writes (its checkpoint engine's ``save``/``makedirs``, the recovery scripts it copies)
    are routed through here while it saves (``deepspeed_seam.route_checkpoint_writes``): a write error raised
    out of ``save_checkpoint`` would skip the barriers that follow it there, and the other ranks would wait in
    them forever.
    """

    def __init__(self, engine, staged: list | None = None):
        self.error: BaseException | None = None
        self.engine_save = deepspeed_seam.checkpoint_engine_save(engine)  # what writes a staged state later
        self.staged = staged  # a list: DeepSpeed's states are copied into it, not written
        self._routed = deepspeed_seam.route_checkpoint_writes(engine, self.attempt,
                                                              save=None if staged is None else self._stage)

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

    def _stage(self, state_dict, path) -> None:
        self.staged.append((host_copy(state_dict), path))

    def __enter__(self):
        self._routed.__enter__()
        return self

    def __exit__(self, *exc):
        return self._routed.__exit__(*exc)


def host_copy(state, _storages: dict | None = None):
    """``state`` with every tensor copied to host memory and every container copied: what training changes in
    place next (weights, optimizer moments) is no longer what a background save writes. Tensors that share
    storage share the copy's, as ``torch.save`` keeps them: DeepSpeed's ZeRO optimizer hands every parameter
    group one ``step`` tensor, and a resume that loads two bit-equal ``step`` tensors instead of one
    diverges at its second step. Other values are kept as they are (numbers, strings, configs: nothing the
    step loop changes)."""
    storages = {} if _storages is None else _storages
    if isinstance(state, torch.Tensor):
        tensor = state.detach()
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in storages:
            storages[key] = storage.clone() if tensor.device.type == "cpu" else storage.cpu()
        copy = torch.empty(0, dtype=tensor.dtype)
        copy.set_(storages[key], tensor.storage_offset(), tensor.size(), tensor.stride())
        return copy
    if isinstance(state, OrderedDict):
        return OrderedDict((key, host_copy(value, storages)) for key, value in state.items())
    if isinstance(state, dict):
        return {key: host_copy(value, storages) for key, value in state.items()}
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):  # a namedtuple is kept as it is
        return type(state)(host_copy(value, storages) for value in state)
    return state


def _ranks_errors(error: BaseException | None, device, group=None) -> list[str]:
    """Every rank calls it, at the same point: ``[]`` when no rank failed, else each failed rank's error."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return []
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else first_line(error), group=group)
    return [f"rank {rank}: {text}" for rank, text in enumerate(errors) if text is not None]


def _free_space(directory: Path, last_complete: str | None) -> str:
    """What the user needs to fix a full disk: the space free now, and what a checkpoint takes."""
    said = free_space(directory)
    try:
        manifest = tags.read_manifest(directory / last_complete) if last_complete else None
    except (OSError, ValueError):
        manifest = None
    if manifest:
        said += f", a checkpoint takes {human_bytes(sum(f['size'] for f in manifest['files'].values()))}"
    return said


class SaveFailed(Exception):
    """A save failed on at least one rank (every rank raises it); its partial files are gone and ``latest``
    still names ``last_complete``. ``where``: ``checkpoint.dir``, or the mirror on node-local disks."""

    def __init__(self, where: Path | str, tag: str, errors: list[str], free: str, last_complete: str | None):
        self.where, self.tag, self.last_complete = where, tag, last_complete
        super().__init__(f"checkpoint {tag} not saved in {where}: {'; '.join(errors)}" + (f" ({free})" if free else ""))

    def retry_line(self, next_step: int) -> str:
        kept = f"latest still names {self.last_complete}" if self.last_complete else "no checkpoint is complete yet"
        return f"warning: {self}; {kept}; training goes on and saves again at step {next_step}"

    def final_line(self, step: int) -> str:
        first = tags.step_of(self.last_complete) + 1 if self.last_complete else 1
        where = (f"the last complete checkpoint is {self.where}/{self.last_complete}" if self.last_complete
                 else f"there is no complete checkpoint in {self.where}")
        return f"error: {self}; steps {first}-{step} are not saved; {where}"


@dataclass
class Staged:
    """A save once the step loop may go on: its files written (``staged`` empty) or copied to host memory."""

    directory: Path
    step: int
    trainer_state: str  # as written: serialised in the step loop (the data loader's state moves on)
    writes: _Writes
    rng: dict
    staged: list = field(default_factory=list)  # (state, path): what ``finish`` writes with DeepSpeed's engine

    @property
    def tag(self) -> str:
        return tags.tag_for(self.step)


def stage(engine, directory: Path, step: int, trainer_state: run_state.RunState, background: bool = False) -> Staged:
    """The part of a save the step loop waits for, on every rank: DeepSpeed's files written, or with
    ``background`` copied to host memory (the copy is all the step loop waits for)."""
    tag, staged = tags.tag_for(step), [] if background else None
    with _Writes(engine, staged) as writes:
        if dist.get_rank() == 0:  # re-saving a step (``latest`` moved back): no old COMPLETE over new files
            writes.attempt((directory / tag / tags.COMPLETE).unlink, missing_ok=True)
        engine.save_checkpoint(str(directory), tag=tag, save_latest=False)
    return Staged(directory, step, trainer_state.to_json(), writes, rng_state(), staged or [])


def finish(save: Staged, keep_last: int, device, group=None, mirror: str | None = None,
           disk: CheckpointDisk | None = None) -> str:
    """Write what ``save`` staged, then make the tag visible (COMPLETE, ``latest``) once all ranks are done.
    Returns the tag; raises ``SaveFailed`` on every rank when any rank's writes failed. ``group``: the ranks'
    collectives go there (a background save's own gloo group, with ``device`` the CPU). ``mirror``: a store
    URL rank 0 then uploads the tag to (``_commit_to_store``). ``disk``: where ``save.directory`` lives; on
    node-local disks the tag is complete only in the mirror, once every node's part is there (``_commit_parts``)."""
    directory, step, writes, rank = save.directory, save.step, save.writes, dist.get_rank()
    disk = disk or one_disk()
    tag, tag_dir = save.tag, save.directory / save.tag
    for state, path in save.staged:
        writes.attempt(writes.engine_save, state, path)
    writes.attempt(deepspeed_seam.injected_write_failure, step, tag_dir)
    writes.attempt(torch.save, save.rng, tag_dir / f"rng_rank{rank:05d}.pt")
    deepspeed_seam.injected_kill(step)
    errors = _ranks_errors(writes.error, device, group)  # also the barrier: every rank's files are written
    if not errors:
        if rank == 0:
            writes.attempt(write_text_atomically, tag_dir / tags.TRAINER_STATE, save.trainer_state)
            if disk.shared:  # on node-local disks no directory holds the whole tag: COMPLETE is the store's
                writes.attempt(tags.write_manifest, tag_dir, dist.get_world_size())
                writes.attempt(write_text_atomically, directory / tags.LATEST, tag + "\n")
        errors = _ranks_errors(writes.error, device, group)  # rank 0's writes: the others have none here
    if not errors and not disk.shared:
        errors = _commit_parts(save, keep_last, mirror, disk, group)
    if errors:
        last, free = None, ""
        if disk.keeper:
            shutil.rmtree(tag_dir, ignore_errors=True)
        if rank == 0:
            last = _last_complete(directory, mirror, disk)
            free = _free_space(directory, last) if disk.shared else ""
        dist.barrier(group=group)  # nobody goes on (or exits) before the partial files are gone
        raise SaveFailed(directory if disk.shared else mirror, tag, errors, free, last)
    dist.barrier(group=group)
    if rank == 0 and disk.shared:  # the other ranks go on: nothing they do next reads the store or the older tags
        _commit_to_store(directory, tag, keep_last, mirror)
    return tag


def _last_complete(directory: Path, mirror: str | None, disk: CheckpointDisk) -> str | None:
    if disk.shared:
        return tags.latest_complete(directory)
    try:
        return checkpoint_store.latest_complete(mirror)
    except OSError:
        return None


def _commit_parts(save: Staged, keep_last: int, mirror: str, disk: CheckpointDisk, group) -> list[str]:
    """Node-local disks: each node's keeper uploads its node's part of the tag, then rank 0, once every part is
    confirmed, uploads COMPLETE and ``latest`` (``store.commit_parts``) and prunes the store; each keeper then
    prunes its own disk. Returns the errors (the same list on every rank): a node's failed upload leaves the
    tag incomplete in the store and ``latest`` where it was."""
    host = socket.gethostname().split(".")[0]
    part = None  # (its manifest entries, what was sent, its error): from each keeper
    if disk.keeper:
        try:
            deepspeed_seam.injected_upload_failure(save.step, max(disk.group_ranks) == dist.get_world_size() - 1)
            files, sent, seconds = checkpoint_store.upload_part(save.directory, save.tag, mirror)
            part = (files, f"{host} {human_bytes(sent)} in {seconds:.1f} s", None)
        except OSError as error:  # a StoreError, or a local file that could not be read
            part = (None, None, f"{host}'s upload failed: {first_line(error)}")
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part, group=group)
    parts = [p for p in parts if p is not None]
    outcome: list = [[p[2] for p in parts if p[2]], []]  # [errors, the tags kept]: the same length on every rank
    if dist.get_rank() == 0 and not outcome[0]:
        try:
            checkpoint_store.commit_parts(mirror, save.tag, [p[0] for p in parts], dist.get_world_size())
        except OSError as error:
            outcome[0] = [f"{mirror}: {first_line(error)}"]
        else:
            log.info(f"uploaded checkpoint {save.tag} to {mirror} from {len(parts)} nodes ("
                     + "; ".join(p[1] for p in parts) + ")")
            outcome[1] = _prune_store(mirror, keep_last)
    dist.broadcast_object_list(outcome, src=0, group=group)
    errors, kept = outcome
    if not errors and kept and disk.keeper:
        for old in os.listdir(save.directory):
            if tags.is_tag(old) and tags.step_of(old) < tags.step_of(kept[0]):
                shutil.rmtree(save.directory / old, ignore_errors=True)
    return errors


def _prune_store(mirror: str, keep_last: int) -> list[str]:
    """Apply ``keep_last`` to the store; the tags kept there (none when the store could not be listed)."""
    try:
        kept = checkpoint_store.complete_tags(mirror)[-keep_last:]
        checkpoint_store.prune(mirror, kept)
    except OSError as error:
        log.warning(f"warning: could not prune old checkpoints in {mirror} ({first_line(error)}); "
                    "they are deleted at a later save")
        return []
    return kept


def _commit_to_store(directory: Path, tag: str, keep_last: int, mirror: str | None) -> None:
    """Rank 0, once ``tag`` is complete: upload it to ``mirror``, then apply ``keep_last`` to the store and to
    ``directory``. A failed upload deletes nothing: the older tags on disk stay until a later upload completes."""
    if mirror:
        try:
            sent, seconds = checkpoint_store.upload_tag(directory, tag, mirror)
            checkpoint_store.prune(mirror, checkpoint_store.complete_tags(mirror)[-keep_last:])
        except OSError as error:  # a StoreError, or a local file that could not be read
            log.warning(f"warning: checkpoint {tag} is complete in {directory} but not in {mirror} "
                        f"({first_line(error)}); the checkpoints on this disk are kept until a later save's upload "
                        "completes")
            return
        log.info(f"uploaded checkpoint {tag} to {mirror} ({human_bytes(sent)} in {seconds:.1f} s)")
    for old in tags.complete_tags(directory)[:-keep_last]:
        shutil.rmtree(directory / old, ignore_errors=True)


def save(engine, directory: Path, step: int, trainer_state: run_state.RunState, keep_last: int) -> str:
    """Save on every rank and wait for it; the tag becomes visible (COMPLETE, ``latest``) only once all ranks
    are done. Returns the tag; raises ``SaveFailed`` on every rank when any rank's writes failed."""
    return finish(stage(engine, directory, step, trainer_state), keep_last, engine.device)


@dataclass
class Finished:
    """How a background save ended: ``error`` None when its tag is complete."""

    step: int
    seconds: float  # from its start in the step loop to its end in the background
    error: BaseException | None


class BackgroundSave:
    """At most one save in flight, its ``finish`` in a thread of this rank; every rank has one.

    Made on every rank at the same point (its gloo group is made collectively). The thread is a daemon: a
    process that ends or is killed mid-save leaves the previous checkpoint the newest complete one.
    """

    def __init__(self, keep_last: int, mirror: str | None = None, disk: CheckpointDisk | None = None):
        self.keep_last, self.mirror, self.disk = keep_last, mirror, disk
        self.group = dist.new_group(backend="gloo")
        self._thread: threading.Thread | None = None
        self._finished: Finished | None = None

    def start(self, save: Staged, started: float) -> None:
        assert self._thread is None, "wait() for the save in flight first"

        def run():
            error = None
            try:
                finish(save, self.keep_last, torch.device("cpu"), self.group, self.mirror, self.disk)
            except Exception as failed:  # noqa: BLE001 -- said by the step loop, at its next wait
                error = failed
            self._finished = Finished(save.step, time.perf_counter() - started, error)

        self._thread = threading.Thread(target=run, name=f"checkpoint-{save.tag}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """True when a save has ended and ``wait`` returns at once; never waits."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> Finished | None:
        """The save in flight, once it has ended; None when there is none."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, finished, self._finished = None, self._finished, None
        return finished


class RunSaves:
    """A run's saves (``checkpoint.*``) and when they are due: waited for, or in the background; said on rank
    0 (the log's rank), with how long the step loop waited. Made on every rank at the same point.
    ``saved_at``: the step of the last save that is complete or, in the background, still in flight; a
    failed one leaves it behind, for the next interval or the run's last save to make up for."""

    def __init__(self, engine, cfg, train_steps: int, after_save, disk: CheckpointDisk | None = None):
        deepspeed_seam.check_checkpoint_writes(engine)  # a DeepSpeed that moved them fails here, not at a save
        self.engine, self.directory, self.cfg, self.train_steps = engine, Path(cfg.dir), cfg, train_steps
        self.disk = disk or one_disk()
        self.after_save = after_save  # after_save(step, the tag's directory or URL), on rank 0: the probes
        self.background = (BackgroundSave(cfg.keep_last, cfg.mirror, self.disk) if cfg.background  # every rank
                           else None)
        self.saved_at = -1

    def start(self, step: int) -> None:
        """The step loop starts at ``step``: 0, or the step it resumed from (that checkpoint exists)."""
        self.saved_at = step

    def due(self, step: int) -> bool:
        """An interval save at ``step`` (the run's last step is ``save_last``'s)."""
        return step % self.cfg.interval == 0 and step < self.train_steps

    def save_last(self, step: int, make_state: Callable[[], run_state.RunState]) -> bool:
        """The run's last save (its end, a preemption) unless ``step`` is saved already; False when it failed.
        A background save still in flight ends first: if it failed, ``step`` is saved again. ``make_state()``:
        the trainer state to save, asked for only when a save happens."""
        self.finish_background()
        return self.saved_at == step or self.save(step, make_state(), final=True)

    def save(self, step: int, trainer_state: run_state.RunState, final: bool) -> bool:
        """Save at ``step``; False (on every rank) when it failed. A failed save is a warning and the next
        interval retries; a failed ``final`` one (the run's last, always waited for) is an error the caller
        exits on."""
        started = time.perf_counter()  # what the step loop waits for includes a save still in flight
        self.finish_background()  # at most one save in flight
        in_background = self.background is not None and not final
        try:
            staged = stage(self.engine, self.directory, step, trainer_state, in_background)
            if in_background:
                self.background.start(staged, started)
                log.info(f"saving checkpoint {self._where(staged.tag)} in the background (the step loop "
                         f"waited {time.perf_counter() - started:.2f} s)")
            else:
                finish(staged, self.cfg.keep_last, self.engine.device, mirror=self.cfg.mirror, disk=self.disk)
                self._saved(step, f"the step loop waited {time.perf_counter() - started:.2f} s")
        except SaveFailed as error:
            self._say_failed(error, step, final)
            return False
        self.saved_at = step
        return True

    def poll(self) -> None:
        """Say a background save that has ended; never waits."""
        if self.background is not None and self.background.done():
            self.finish_background()

    def finish_background(self) -> None:
        """Wait for the save in flight, if any, and say how it ended (the ranks agreed on it)."""
        finished = self.background.wait() if self.background is not None else None
        if finished is None:
            return
        if finished.error is None:
            self._saved(finished.step, f"in the background: {finished.seconds:.2f} s from its start")
            return
        if not isinstance(finished.error, SaveFailed):
            raise finished.error
        self._say_failed(finished.error, finished.step, final=False)
        if self.saved_at == finished.step:
            self.saved_at = -1

    def _where(self, tag: str) -> Path | str:
        """The tag's directory, or on node-local disks its URL: the one place it is whole."""
        return self.directory / tag if self.disk.shared else f"{self.cfg.mirror.rstrip('/')}/{tag}"

    def _saved(self, step: int, how: str) -> None:
        where = self._where(tags.tag_for(step))
        log.info(f"saved checkpoint {where} ({how})")
        if dist.get_rank() == 0:
            self.after_save(step, where)

    def _say_failed(self, error: SaveFailed, step: int, final: bool) -> None:
        if final:
            log.error(error.final_line(step))
            return
        interval = self.cfg.interval
        log.warning(error.retry_line(min(step - step % interval + interval, self.train_steps)))


def load(engine, directory: Path, tag: str) -> run_state.RunState:
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
    return run_state.read(path)
