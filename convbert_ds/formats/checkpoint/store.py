"""A run's checkpoints mirrored in an object store (``checkpoint.mirror: s3://BUCKET/PREFIX``).

Layout, the same as ``checkpoint.dir``'s (``directory.py``)::

    PREFIX/latest                   the newest tag whose upload is complete (written after its COMPLETE)
    PREFIX/step00001000/...         the tag's files, under the same relative names
    PREFIX/step00001000/COMPLETE    uploaded last, once every file it lists is in the store with its size

So a tag in the store is complete exactly when its ``COMPLETE`` is there, as on disk, and a process killed
mid-upload leaves the previous complete tag the newest. S3's writes are atomic per object and the client
checks each body's checksum in flight; what is uploaded is checked again by size here and by sha256 when a
run resumes from a downloaded copy (``checkpoint.verify``). The local copy is kept until its upload is
complete: the trainer prunes ``checkpoint.dir`` only after (``convbert_ds.engine.checkpoint``).

On node-local disks (``engine.checkpoint_disk``) no disk holds a whole tag: each node uploads its own part
(``upload_part``: every file its ranks wrote, each checked by size once sent), and rank 0 uploads ``COMPLETE``,
the manifest of every node's files, and ``latest`` only after every node's part is confirmed
(``commit_parts``): a node whose upload fails leaves the tag incomplete in the store, and the previous one the
newest complete.

Downloading (a run that starts on an empty disk, the converter's and fine-tuning's ``s3://`` paths) fills a
temporary directory beside the target and renames it into place: a tag on disk is whole or absent. A full
disk deletes the temporary directory and ends in one line naming the target, the space free there and what is
kept (the tags already on that disk, and the store's copy).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

from convbert_ds import objstore
from convbert_ds.disk_full import full_disk_says
from convbert_ds.formats.checkpoint import directory as local
from convbert_ds.formats.checkpoint.directory import (COMPLETE, DAMAGED_TAG, LATEST, UNIVERSAL, CheckpointError,
                                                      is_file_in_tag, is_tag, parse_manifest, read_manifest, step_of)
from convbert_ds.fsutil import exclusive_lock, write_text_atomically
from convbert_ds.log import EVERY_RANK, get_logger

log = get_logger(__name__)


def _files(tag_dir: Path) -> list[str]:
    """What a tag's upload sends before COMPLETE: its manifest's files (every file, for a pre-manifest tag)."""
    manifest = read_manifest(tag_dir)
    if manifest is not None:
        return sorted(manifest["files"])
    return sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                  if p.is_file() and p.name != COMPLETE and UNIVERSAL not in p.relative_to(tag_dir).parts[:-1])


def _upload_files(tag_dir: Path, names: list[str], url: str, tag: str) -> int:
    """Send ``names`` under ``tag_dir`` to ``url/tag/``, then check each one's size in the store; the bytes sent."""
    root, sent = objstore.Url.parse(url), 0
    for name in names:
        objstore.upload(tag_dir / name, str(root.join(tag, name)))
        sent += (tag_dir / name).stat().st_size
    for name in names:
        stored, size = objstore.head(str(root.join(tag, name)))[0], (tag_dir / name).stat().st_size
        if stored != size:
            raise objstore.StoreError(f"{root.join(tag, name)}: {stored} bytes in the store, {size} on disk after "
                                      f"the upload; the store lost a write")
    return sent


def upload_tag(directory: Path, tag: str, url: str) -> tuple[int, float]:
    """Upload the complete tag ``directory/tag`` to ``url/tag`` and move ``url/latest`` to it; returns the bytes
    sent and the seconds taken. Raises ``StoreError`` (the store's copy then stays incomplete)."""
    started, tag_dir, root = time.perf_counter(), directory / tag, objstore.Url.parse(url)
    sent = _upload_files(tag_dir, _files(tag_dir), url, tag)
    objstore.upload(tag_dir / COMPLETE, str(root.join(tag, COMPLETE)))
    objstore.put_bytes(str(root.join(LATEST)), f"{tag}\n".encode())
    return sent, time.perf_counter() - started


def upload_part(directory: Path, tag: str, url: str) -> tuple[dict, int, float]:
    """One node's part of a tag on node-local disks: every file now under ``directory/tag`` sent to ``url/tag``
    and checked there by size. Returns the part's manifest entries (``{name: {"size", "sha256"}}``, as in
    COMPLETE), the bytes sent and the seconds taken. Raises ``StoreError``."""
    started, tag_dir = time.perf_counter(), directory / tag
    files = local.build_manifest(tag_dir, 0)["files"]
    sent = _upload_files(tag_dir, sorted(files), url, tag)
    return files, sent, time.perf_counter() - started


def commit_parts(url: str, tag: str, parts: list[dict], world_size: int) -> None:
    """Make ``url/tag`` complete from the parts every node uploaded (``upload_part``'s entries, one dict per
    node): each listed file checked in the store by size, then COMPLETE (their union) and ``latest``. A file
    two nodes both wrote must agree. Raises ``StoreError``, leaving the tag incomplete."""
    root, files = objstore.Url.parse(url), {}
    for part in parts:
        for name, entry in part.items():
            if files.setdefault(name, entry) != entry:
                raise objstore.StoreError(f"{root.join(tag, name)}: two nodes wrote different files under this "
                                          "name; the checkpoint is not complete")
    for name in sorted(files):
        try:
            stored = objstore.head(str(root.join(tag, name)))[0]
        except objstore.StoreNotFound:
            raise objstore.StoreError(f"{root.join(tag, name)}: not in the store, though its node listed it; "
                                      "the checkpoint is not complete") from None
        if stored != files[name]["size"]:
            raise objstore.StoreError(f"{root.join(tag, name)}: {stored} bytes in the store, {files[name]['size']} "
                                      "written by its node; the checkpoint is not complete")
    manifest = {"format": local.MANIFEST_FORMAT, "world_size": world_size, "files": files}
    objstore.put_bytes(str(root.join(tag, COMPLETE)), (json.dumps(manifest, indent=1) + "\n").encode())
    objstore.put_bytes(str(root.join(LATEST)), f"{tag}\n".encode())


def complete_tags(url: str) -> list[str]:
    """The store's complete tags, oldest first."""
    tags = {key.split("/")[0] for key, _ in objstore.list_objects(url) if key.endswith(f"/{COMPLETE}")}
    return sorted((t for t in tags if is_tag(t)), key=step_of)


def latest_complete(url: str, tags: list[str] | None = None) -> str | None:
    """The tag the store's ``latest`` names if it is complete, else its newest complete tag (``tags``: the store's
    complete tags, when the caller has listed them already)."""
    tags = complete_tags(url) if tags is None else tags
    try:
        named = objstore.read_bytes(str(objstore.Url.parse(url).join(LATEST))).decode(errors="replace").strip()
    except objstore.StoreNotFound:
        named = None
    return named if named in tags else (tags[-1] if tags else None)


def prune(url: str, keep: list[str]) -> None:
    """Delete the store's tags not in ``keep`` (COMPLETE first: a tag half deleted is incomplete, not damaged)."""
    root = objstore.Url.parse(url)
    by_tag: dict[str, list[str]] = {}
    for key, _ in objstore.list_objects(url):
        tag = key.split("/")[0]
        if is_tag(tag) and tag not in keep and "/" in key:
            by_tag.setdefault(tag, []).append(key)
    for keys in by_tag.values():
        for key in sorted(keys, key=lambda k: not k.endswith(f"/{COMPLETE}")):
            objstore.delete(str(root.join(key)))


def download_tag(url: str, tag: str, directory: Path) -> tuple[int, float]:
    """The store's complete tag ``url/tag`` into ``directory/tag`` (which must not exist); returns the bytes
    and the seconds taken."""
    started, root = time.perf_counter(), objstore.Url.parse(url)
    try:
        manifest = parse_manifest(objstore.read_bytes(str(root.join(tag, COMPLETE))))
    except ValueError as error:
        raise CheckpointError(f"{root.join(tag)}/{error}; {DAMAGED_TAG}") from None
    names = sorted(manifest["files"]) if manifest is not None else \
        sorted(key for key, _ in objstore.list_objects(str(root.join(tag))) if is_file_in_tag(key))
    # Outside the try: the line is made once the partial copy is deleted, so the space free it names is real.
    with full_disk_says(directory / tag, f"no part of {tag} is kept there (its partial download is deleted), the "
                                         f"checkpoints already there and {root.join(tag)} are untouched"):
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{tag}.download-{uuid.uuid4().hex[:8]}"
        try:
            received = 0
            for name in names:
                objstore.download(str(root.join(tag, name)), tmp / name)
                received += (tmp / name).stat().st_size
            objstore.download(str(root.join(tag, COMPLETE)), tmp / COMPLETE)
            tmp.rename(directory / tag)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return received, time.perf_counter() - started


def _sweep_downloads(directory: Path, locked: bool) -> None:
    """Delete the temporary directories of downloads whose process died (killed, or stopped by a signal before
    training: it exits at once); only while holding the download lock, when no live download can be among them."""
    if locked:
        for stale in directory.glob(".step*.download-*"):
            shutil.rmtree(stale, ignore_errors=True)


def fetch_newer(directory: Path, url: str, verify_mode: str = "checksum") -> str | None:
    """Download the store's newest complete tag into ``directory`` (and point ``latest`` at it) when the
    directory has none as new: a fresh machine, a lost disk. Every process of a node may call it at once:
    one downloads, the others wait for it and find the tag there. Returns a line saying what was fetched.

    A tag whose copy fails ``verify_mode`` (a file missing from the store, or not the one its manifest lists)
    is deleted from the disk with one warning and the next older one is fetched, as ``choose_resume_tag``
    does on a disk: one damaged object costs the steps since the older checkpoint, not the run. None intact,
    and none on the disk either, is an error (starting from step 0 would drop the run silently)."""
    directory.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(directory / ".store-download.lock") as locked:
        _sweep_downloads(directory, locked)
        remote, here = complete_tags(url), local.latest_complete(directory)
        first = latest_complete(url, remote)
        candidates = remote[:remote.index(first) + 1][::-1] if first else []  # the one latest names, then older
        damaged = []
        for tag in (t for t in candidates if here is None or step_of(t) > step_of(here)):
            shutil.rmtree(directory / tag, ignore_errors=True)  # an interrupted save of that step, if any
            try:
                size, seconds = download_tag(url, tag, directory)
                # Rank 0 checks it again before loading (choose_resume_tag): a download is rare, and a copy
                # found damaged only then could no longer be replaced by the store's older tag.
                problem = local.verify(directory / tag, verify_mode)
            except (objstore.StoreNotFound, CheckpointError) as error:
                problem = str(error)
            if problem is None:
                write_text_atomically(directory / LATEST, tag + "\n")
                return (f"downloaded checkpoint {tag} from {url} into {directory} ({size / 2**20:,.1f} MiB in "
                        f"{seconds:.1f} s)")
            shutil.rmtree(directory / tag, ignore_errors=True)
            damaged.append(f"{tag}: {problem}")
            log.warning(f"checkpoint {tag} in {url} is damaged ({problem}); trying the next older one",
                        extra=EVERY_RANK)
    if damaged and here is None:
        raise CheckpointError(f"no intact checkpoint in {url}: {'; '.join(damaged)}; restore the damaged files, "
                              "or move the tags out of the store to start from step 0")
    return None


def local_copy(url: str, tag: str | None = None) -> tuple[Path, str]:
    """A checkpoint in the store (``s3://.../checkpoints``, or one tag in it) as a directory on this disk, in
    the cache (``~/.cache/convbert_ds/checkpoints/BUCKET/PREFIX``); returns it and the tag (default: the
    newest complete)."""
    root = objstore.Url.parse(url)
    last = root.key.rsplit("/", 1)[-1]
    if tag is None and is_tag(last):
        root, tag = objstore.Url(root.bucket, root.key[:-len(last)].rstrip("/")), last
    tags = complete_tags(str(root))
    tag = tag or latest_complete(str(root))
    if tag is None or tag not in tags:
        raise CheckpointError(f"{root}: no complete checkpoint {tag or ''} there (a stepNNNNNNNN prefix with a "
                              f"{COMPLETE} object); complete tags: {tags or 'none'}")
    directory = objstore.default_cache_dir() / "checkpoints" / root.bucket / root.key
    directory.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(directory / ".store-download.lock") as locked:
        _sweep_downloads(directory, locked)
        if not (directory / tag / COMPLETE).is_file():
            shutil.rmtree(directory / tag, ignore_errors=True)
            download_tag(str(root), tag, directory)
            problem = local.verify(directory / tag, "checksum")  # once, as it arrives: the cache is kept whole
            if problem is not None:
                shutil.rmtree(directory / tag)
                raise CheckpointError(f"{root.join(tag)}: {problem}; {DAMAGED_TAG}; complete tags: {tags}")
    return directory, tag
