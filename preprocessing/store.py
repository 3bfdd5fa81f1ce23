"""``preprocessing.shard --out s3://BUCKET/PREFIX``: shard into a local staging directory, then upload it.

The staging directory (``~/.cache/convbert_ds/staging/BUCKET/PREFIX``, or under ``XDG_CACHE_HOME``) is an
ordinary shard directory: an interrupted run resumes there, as a local one does. The upload sends every
shard file, then the manifest: a reader finds no manifest, or one whose files are all there.
"""

from __future__ import annotations

from pathlib import Path

from convbert_ds import objstore
from convbert_ds.formats.shard_manifest import MANIFEST, PROGRESS, read_store_manifest
from convbert_ds.fsutil import FORCE_FLAG
from preprocessing.errors import PreprocessingError

_NOT_UPLOADED = (PROGRESS, ".lock")


def staging_dir(url: str) -> Path:
    u = objstore.Url.parse(url)
    return objstore.default_cache_dir() / "staging" / u.bucket / u.key


def check_target(url: str, fingerprint: str, overwrite: bool) -> None:
    """Refuse to mix runs in one prefix: one that holds other shards needs ``--force`` (which first deletes its
    manifest, so no reader sees the old one with new files). First, that the store takes writes there: a
    missing bucket was found only after the whole corpus had been sharded locally."""
    objstore.check_writable(url)
    if not objstore.exists(str(objstore.Url.parse(url).join(MANIFEST))):
        return
    if overwrite:
        objstore.delete(str(objstore.Url.parse(url).join(MANIFEST)))
    elif read_store_manifest(url)[1].get("fingerprint") != fingerprint:
        raise PreprocessingError(f"{url} already holds shards made from other inputs, tokenizer or settings; "
                                 f"pass {FORCE_FLAG} to replace them")


def publish(root: Path, url: str, report=None) -> None:
    names = objstore.upload_tree(root, url, last=(MANIFEST,),
                                 skip=lambda name: name in _NOT_UPLOADED or name.startswith("index_cache/"))
    if report:
        report(f"uploaded {len(names)} files to {url} (the manifest last)")
