"""Checkpoints that are never lost and never half-read.

Layout of ``checkpoint.dir``::

    latest                      name of the newest *complete* tag (written last, atomically)
    step00001000/               DeepSpeed's files (model/optimizer states, ZeRO shards or
                                pipeline layer files) + ours:
        trainer_state.json      step, sampler state, config, data manifests' references
        rng_rank00000.pt ...    every rank's RNG states (CPU, CUDA, numpy, random)
        COMPLETE                written by rank 0 after every rank finished saving

A tag without COMPLETE is a save that was interrupted: it is ignored, and
removed at the next start. ``latest`` is only ever moved to a complete tag.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from convbert_ds.fsutil import write_text_atomically

COMPLETE = "COMPLETE"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
_TAG = re.compile(r"^step(\d{8,})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


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
    return sorted(tags, key=lambda t: int(_TAG.match(t).group(1)))


def latest_complete(directory: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete tag."""
    pointer = directory / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if (directory / tag / COMPLETE).is_file():
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


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fault_injection_point(step: int) -> None:
    """Crash tests: ``CONVBERT_DS_KILL_DURING_SAVE_AT=STEP`` SIGKILLs rank 0 mid-save at that step."""
    at = os.environ.get("CONVBERT_DS_KILL_DURING_SAVE_AT")
    if at is not None and int(at) == step and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def save(engine, directory: Path, step: int, trainer_state: dict, keep_last: int) -> str:
    """Save on every rank; the tag becomes visible (COMPLETE, ``latest``) only once all ranks are done."""
    tag = tag_for(step)
    rank = dist.get_rank()
    engine.save_checkpoint(str(directory), tag=tag, save_latest=False)
    torch.save(rng_state(), directory / tag / f"rng_rank{rank:05d}.pt")
    _fault_injection_point(step)
    dist.barrier()
    if rank == 0:
        write_text_atomically(directory / tag / TRAINER_STATE, json.dumps(trainer_state, indent=2, default=str))
        write_text_atomically(directory / tag / COMPLETE, f"{dist.get_world_size()}\n")
        write_text_atomically(directory / LATEST, tag + "\n")
        for old in complete_tags(directory)[:-keep_last]:
            shutil.rmtree(directory / old, ignore_errors=True)
    dist.barrier()
    return tag


def load(engine, directory: Path, tag: str) -> dict:
    """Restore DeepSpeed states, this rank's RNG states, and return the trainer state."""
    path = directory / tag
    load_path, _ = engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {path}")
    rng_file = path / f"rng_rank{dist.get_rank():05d}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"{rng_file} not found: the checkpoint was written by fewer ranks; "
                                "resume with the same number of processes for an exact resume")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / TRAINER_STATE).read_text())
