"""The checkpoint directory: tags, the COMPLETE manifest, choosing the tag to resume from.

Layout of ``checkpoint.dir``::

    latest                      name of the newest *complete* tag (written last, atomically)
    step00001000/               DeepSpeed's files (model/optimizer states, ZeRO shards or
                                pipeline layer files) + ours:
        trainer_state.json      step, sampler state, config, data manifests' references: the
                                format and its only reader are ``run_state``
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

Resuming (``choose_resume_tag``, on rank 0) checks the tag about to be loaded against its manifest: the
size of every file always (a stat) and its sha256 with ``checkpoint.verify=checksum`` (the default: a
bit flip does not change a size). A tag that fails is renamed ``TAG.damaged`` (never deleted: the
user may want to inspect it; renamed so that it is never chosen again and a later save of that step
does not write into it), and the next older complete tag is checked. ``latest`` is left alone: it
moves when the next save completes.

Saving into it during training (every rank's writes, failed saves) is ``convbert_ds.engine.checkpoint``;
everything here reads and checks files only, without DeepSpeed, so the converter and fine-tuning use it
as they find it on disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from convbert_ds.errors import UserError
from convbert_ds.fsutil import file_sha256, write_text_atomically

COMPLETE = "COMPLETE"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
UNIVERSAL = "universal"  # a converted copy cached inside a tag: not part of the save, not in its manifest
MANIFEST_FORMAT = 1
VERIFY_MODES = ("size", "checksum")
HASH_THREADS = 8  # hashlib releases the GIL: threads hash files side by side (and overlap network reads)
_TAG = re.compile(r"^step(\d{8,})$")
DAMAGED_TAG = "the tag is damaged: use an older one (the converter's --tag, or its name in checkpoint.dir/latest)"


class CheckpointError(UserError):
    """A checkpoint cannot be resumed from; the message names the file and what to do."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int:
    return int(_TAG.match(tag).group(1))


def is_tag(name: str) -> bool:
    """Whether ``name`` is a save's tag (``stepNNNNNNNN``), complete or not."""
    return bool(_TAG.match(name))


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
        tag = pointer.read_bytes().decode("utf-8", errors="replace").strip()  # damaged: the newest tag, below
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


def _hash_all(root: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(root / name), names)))


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
    return parse_manifest((tag_dir / COMPLETE).read_bytes())


def is_file_in_tag(name: str) -> bool:
    """A name a tag's file may have: relative, no ``..`` (a download would write it outside the tag)."""
    path = PurePosixPath(name)
    return bool(path.parts) and not path.is_absolute() and ".." not in path.parts and name != COMPLETE


def parse_manifest(raw: bytes) -> dict | None:
    """COMPLETE's bytes (on a disk or in a store) as ``read_manifest`` returns them; a ``ValueError`` saying what
    is wrong. Every entry is checked here, so its readers may index it: a name ``is_file_in_tag``, a size an
    int, a sha256 a string."""
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{COMPLETE}: not valid JSON") from None
    if type(manifest) is int:
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ValueError(f"{COMPLETE}: not a checkpoint manifest")
    for name, entry in files.items():
        if not is_file_in_tag(name):
            raise ValueError(f"{COMPLETE}: {name!r} is not a file name inside the tag")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str)):
            raise ValueError(f"{COMPLETE}: the entry of {name} is not {{\"size\": BYTES, \"sha256\": HEX}}")
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
