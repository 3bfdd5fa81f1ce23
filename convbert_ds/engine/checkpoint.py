"""Checkpoints that are never lost, never half-read, and checked before they are trusted.

Layout of ``checkpoint.dir``::

    latest                      name of the newest *complete* tag (written last, atomically)
    step00001000/               DeepSpeed's files (model/optimizer states, ZeRO shards or
                                pipeline layer files) + ours:
        trainer_state.json      step, sampler state, config, data manifests' references
        rng_rank00000.pt ...    every rank's RNG states (CPU, CUDA, numpy, random): tensors and plain
                                python values only, so ``torch.load(weights_only=True)`` reads them
        COMPLETE                written by rank 0 after every rank finished saving (below)
    step00000800.damaged/       a tag that failed verification on resume, kept for inspection

``COMPLETE`` is JSON, the tag's manifest::

    {"format": 1, "world_size": 2,
     "files": {"mp_rank_00_model_states.pt": {"size": 123456, "sha256": "9f86d0..."}, ...}}

``files`` lists every file under the tag directory (relative paths, recursively), except COMPLETE itself
and anything under a directory named ``universal`` (a converted copy cached there later, not part of
the save). Rank 0 hashes the files after the barrier, when every rank's files are on the shared
filesystem. Checkpoints written before the manifest have ``COMPLETE`` = ``"N\\n"`` (the world size):
they still load, but nothing can be verified for them.

A tag without COMPLETE is a save that was interrupted: it is ignored, and removed at the next start.
``latest`` is only ever moved to a complete tag; a user may write an older tag into it to go back.

Resuming (``agreed_resume_tag``): rank 0 checks the tag about to be loaded against its manifest, the
size of every file always (a stat) and its sha256 with ``checkpoint.verify=checksum`` (the default: a
bit flip does not change a size). A tag that fails is renamed ``TAG.damaged`` (never deleted: the
user may want to inspect it; renamed so that it is never chosen again and a later save of that step
does not write into it), and the next older complete tag is checked. ``latest`` is left alone: it
moves when the next save completes.

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
import hashlib
import json
import os
import random
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from convbert_ds.engine.distributed import on_rank0
from convbert_ds.errors import UserError
from convbert_ds.formats.safe_pickle import check_directory, deepspeed_loads_weights_only, safe_load
from convbert_ds.fsutil import write_text_atomically

COMPLETE = "COMPLETE"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
UNIVERSAL = "universal"  # a converted copy cached inside a tag: not part of the save, not in its manifest
MANIFEST_FORMAT = 1
VERIFY_MODES = ("size", "checksum")
EXIT_NOT_SAVED = 4  # the run's last save failed: not 3 (EXIT_PREEMPTED), a requeue would hit the same disk
HASH_THREADS = 8  # hashlib releases the GIL: threads hash files side by side (and overlap network reads)
_TAG = re.compile(r"^step(\d{8,})$")


class CheckpointError(UserError):
    """A checkpoint cannot be resumed from; the message names the file and what to do."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int:
    return int(_TAG.match(tag).group(1))


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the JSON lines whose ``step`` is at most ``step``: a run resumed from that step logs the rest
    again, so its log ends up as an uninterrupted run's."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        path.write_text("".join(line + "\n" for line in kept))


def complete_tags(directory: Path) -> list[str]:
    """Complete tags, oldest first."""
    if not directory.is_dir():
        return []
    tags = [p.name for p in directory.iterdir() if _TAG.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(tags, key=step_of)


def latest_complete(directory: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete tag."""
    pointer = directory / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if _TAG.match(tag) and (directory / tag / COMPLETE).is_file():
            return tag
    tags = complete_tags(directory)
    return tags[-1] if tags else None


def remove_incomplete(directory: Path) -> list[str]:
    """Delete tags an interrupted save left behind (rank 0, before anyone loads)."""
    removed = []
    if directory.is_dir():
        for path in directory.iterdir():
            if path.is_dir() and _TAG.match(path.name) and not (path / COMPLETE).is_file():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    return removed


# The manifest (COMPLETE) -------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _hash_all(root: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(root / name), names)))


def build_manifest(tag_dir: Path, world_size: int) -> dict:
    """The manifest of every file now in ``tag_dir`` (see the module docstring)."""
    names = sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                   if p.is_file() and p.name != COMPLETE and UNIVERSAL not in p.relative_to(tag_dir).parts[:-1])
    digests = _hash_all(tag_dir, names)
    files = {name: {"size": (tag_dir / name).stat().st_size, "sha256": digests[name]} for name in names}
    return {"format": MANIFEST_FORMAT, "world_size": world_size, "files": files}


def write_manifest(tag_dir: Path, world_size: int) -> None:
    """Write COMPLETE: from here on the tag counts as a checkpoint."""
    write_text_atomically(tag_dir / COMPLETE, json.dumps(build_manifest(tag_dir, world_size), indent=1) + "\n")


def read_manifest(tag_dir: Path) -> dict | None:
    """The manifest, or None for a checkpoint from before manifests ("N\\n": nothing to verify against)."""
    text = (tag_dir / COMPLETE).read_text()
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{COMPLETE}: not valid JSON") from None
    if isinstance(manifest, int):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{COMPLETE}: not a checkpoint manifest")
    return manifest


def verify(tag_dir: Path, mode: str) -> str | None:
    """What is wrong with the tag's files (the first file, in path order), or None when they match."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"checkpoint.verify={mode!r}: use one of {list(VERIFY_MODES)}")
    try:
        manifest = read_manifest(tag_dir)
    except (OSError, ValueError) as error:
        return str(error)
    if manifest is None:  # an old "N\n" marker: no sizes or checksums to check against, trusted as it is
        return None
    files = manifest["files"]
    for name in sorted(files):
        try:
            size = (tag_dir / name).stat().st_size
        except FileNotFoundError:
            return f"{name}: missing"
        except OSError as error:
            return f"{name}: unreadable ({error.strerror})"
        if size != files[name]["size"]:
            return f"{name}: size {size}, expected {files[name]['size']}"
    if mode == "checksum":
        try:
            digests = _hash_all(tag_dir, sorted(files))
        except OSError as error:
            return f"{Path(error.filename or '?').name}: unreadable ({error.strerror})"
        for name in sorted(files):
            if digests[name] != files[name]["sha256"]:
                return f"{name}: checksum mismatch"
    return None


# Choosing the tag to resume from -----------------------------------------------------------------


def _set_aside(directory: Path, tag: str) -> str:
    """Rename a damaged tag out of the ``stepN`` namespace; its new name (or the old one if that failed)."""
    for n in range(100):
        name = f"{tag}.damaged" + (f"-{n}" if n else "")
        if not (directory / name).exists():
            try:
                os.replace(directory / tag, directory / name)
                return name
            except OSError:
                return tag
    return tag


def choose_resume_tag(directory: Path, verify_mode: str) -> str | None:
    """Rank 0: the tag to resume from. Candidates: the one ``latest`` names (or the newest complete),
    then older complete tags, newest first; only a candidate is verified, and an older one only when
    the newer failed. Each tag that fails is set aside with one warning line; none left is an error."""
    tags = complete_tags(directory)[::-1]
    first = latest_complete(directory)
    damaged: list[tuple[str, str]] = []
    for tag in tags[tags.index(first):] if first else []:
        problem = verify(directory / tag, verify_mode)
        if problem is None:
            for bad, why in damaged:
                kept = _set_aside(directory, bad)
                print(f"warning: checkpoint {directory / bad} is damaged ({why}); kept as {kept} for inspection, "
                      f"resuming from {tag}", flush=True)
            return tag
        damaged.append((tag, problem))
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {directory}: " + "; ".join(f"{t}: {w}" for t, w in damaged)
                              + "; move the damaged tags out of the directory to start from step 0")
    return None


def agreed_resume_tag(directory: Path, verify_mode: str) -> str | None:
    """Every rank: rank 0's ``choose_resume_tag`` (or its error)."""
    return on_rank0(lambda: choose_resume_tag(directory, verify_mode))


def read_trainer_state(tag_dir: Path) -> dict:
    """A tag's ``trainer_state.json``: step, sampler state, config, layout, tokenizer."""
    return json.loads((tag_dir / TRAINER_STATE).read_text())


# RNG states ---------------------------------------------------------------------------------------


def rng_state() -> dict:
    """Tensors and plain values only (numpy's MT19937 keys as a tensor, ``random``'s state as a list)."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": {"version": version, "state": list(internal), "gauss": gauss}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``; the older layout (numpy/random tuples, pickled) is still accepted here
    for callers that load it with full pickle (fine-tuning's own state files)."""
    numpy_state, python_state = state["numpy"], state["python"]
    if isinstance(numpy_state, dict):
        numpy_state = ("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    if isinstance(python_state, dict):
        python_state = (python_state["version"], tuple(python_state["state"]), python_state["gauss"])
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_file(path: Path) -> dict:
    """This rank's RNG states, read weights-only (older files pickle numpy arrays: on the allow-list)."""
    return safe_load(path)


# Saving -------------------------------------------------------------------------------------------


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


def _describe(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


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
                self.error = OSError(f"writing {target} failed: {_describe(error)}")
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
    dist.all_gather_object(errors, None if error is None else _describe(error))
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
        manifest = read_manifest(directory / last_complete) if last_complete else None
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
        first = step_of(self.last_complete) + 1 if self.last_complete else 1
        where = (f"the last complete checkpoint is {self.directory / self.last_complete}" if self.last_complete
                 else f"there is no complete checkpoint in {self.directory}")
        return f"error: {self}; steps {first}-{step} are not saved; {where}"


def save(engine, directory: Path, step: int, trainer_state: dict, keep_last: int) -> str:
    """Save on every rank; the tag becomes visible (COMPLETE, ``latest``) only once all ranks are done.
    Returns the tag; raises ``SaveFailed`` on every rank when any rank's writes failed."""
    tag = tag_for(step)
    tag_dir, rank, device = directory / tag, dist.get_rank(), engine.device
    with _Writes(engine) as writes:
        if rank == 0:  # re-saving a step (``latest`` moved back): never leave an old COMPLETE over new files
            writes.attempt((tag_dir / COMPLETE).unlink, missing_ok=True)
        engine.save_checkpoint(str(directory), tag=tag, save_latest=False)
    writes.attempt(_failure_injection_point, step, tag_dir)
    writes.attempt(torch.save, rng_state(), tag_dir / f"rng_rank{rank:05d}.pt")
    _fault_injection_point(step)
    errors = _ranks_errors(writes.error, device)  # also the barrier: every rank's files are written
    if not errors:
        if rank == 0:
            writes.attempt(write_text_atomically, tag_dir / TRAINER_STATE,
                           json.dumps(trainer_state, indent=2, default=str))
            writes.attempt(write_manifest, tag_dir, dist.get_world_size())
            writes.attempt(write_text_atomically, directory / LATEST, tag + "\n")
        errors = _ranks_errors(writes.error, device)  # rank 0's writes: the others have none here
    if errors:
        last, free = None, ""
        if rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
            last = latest_complete(directory)
            free = _free_space(directory, last)
        dist.barrier()  # nobody goes on (or exits) before the partial files are gone
        raise SaveFailed(directory, tag, errors, free, last)
    if rank == 0:
        for old in complete_tags(directory)[:-keep_last]:
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
    return read_trainer_state(path)
