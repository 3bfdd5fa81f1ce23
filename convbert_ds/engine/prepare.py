"""What a run needs on this machine before it builds anything, done once by every process at its start.

``resolve`` (plan.py) checks the config and writes nothing, so ``--check-config`` and ``--print-config`` leave
every directory and store as they were. A run then calls ``prepare(plan)``, which does the I/O that changes
things, in this order:

1. every directory the run writes in (checkpoint.dir, the log dir, the caches) checked: it can be made and
   written on this machine (on a login node where ``--check-config`` may run, the same path may not exist);
2. ``checkpoint.mirror``: the store's newest complete checkpoint downloaded into ``checkpoint.dir`` when the
   disk has none as new (a fresh machine, a lost disk), ``latest`` pointed at it;
3. ``data.verify``: every shard file hashed against its manifest, by rank 0 (a stamp beside the sample indexes
   records what was hashed, so a later start hashes only what changed);
4. every set's train split opened (a store's index files fetched into the cache, its ``.bin`` sizes checked);
5. every set's validation split opened where its manifest lists one (a damaged one is an error, not a reason
   to run without evaluation);
6. the checkpoint this run resumes, or the previous phase it continues, checked against the model again: the
   first step may have brought a newer one.

It returns the plan with what it found (``has_valid``, ``continue_from``): the trainer reads those there.

``check_shards(plan)`` is step 3 read-only, for ``--check-config``: a bit flip is found before a job queues,
and no stamp is written (a store's shards are not read: that would fill the local cache).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from convbert_ds.config import ConfigError
from convbert_ds.data.remote_shards import StoreCache
from convbert_ds.data.shards import open_manifest, open_split, verify_checksums
from convbert_ds.disk_full import why_no_directory
from convbert_ds.engine import distributed
from convbert_ds.engine.plan import RunPlan, check_checkpoints
from convbert_ds.formats.checkpoint import store as checkpoint_store
from convbert_ds.formats.train_config import DataSection, TrainConfig
from convbert_ds.log import EVERY_RANK, get_logger
from convbert_ds.objstore import is_url

log = get_logger(__name__)


def prepare(plan: RunPlan) -> RunPlan:
    """Fetch, verify and open what the run reads (see the module docstring); raises a ``UserError`` naming
    the file and the fix, before any process group."""
    cfg, data = plan.cfg, plan.cfg.data
    _check_output_dirs(cfg)
    if cfg.checkpoint.mirror:
        # Every process of a node may call it at once: one downloads and says so, the others wait for it.
        fetched = checkpoint_store.fetch_newer(Path(cfg.checkpoint.dir), cfg.checkpoint.mirror,
                                               cfg.checkpoint.verify)
        if fetched:
            log.info(fetched, extra=EVERY_RANK)
    if distributed.rank() == 0:
        # Rank 0 alone reads every byte (once per file unless "always", see verify_checksums); the others
        # check sizes.
        _verify_checksums(plan, plan.sets, record=True)
    for path, _ in plan.sets:
        open_split(path, "train", data.cache_dir, data.cache_limit_gb)
    has_valid = all(_has_valid(path, data) for path, _ in plan.sets)
    continue_from = check_checkpoints(cfg, plan.electra, plan.tokenizer, store=False)
    return dataclasses.replace(plan, has_valid=has_valid, continue_from=continue_from)


def _check_output_dirs(cfg: TrainConfig) -> None:
    """Every directory the run writes in can be made there: a file in the way, or a read-only disk, is one
    line before anything starts, not a traceback on every rank from the first ``mkdir``."""
    beside = " (null: next to checkpoint.dir)"
    dirs = [("checkpoint.dir", Path(cfg.checkpoint.dir), ""), ("log.dir", cfg.log_dir, "" if cfg.log.dir else beside)]
    if cfg.train.compile and cfg.train.compile_cache:
        dirs.append(("train.compile_cache_dir", cfg.compile_cache_dir, "" if cfg.train.compile_cache_dir else beside))
    if cfg.data.cache_dir:
        dirs.append(("data.cache_dir", Path(cfg.data.cache_dir), ""))
    for key, path, note in dirs:
        if why := why_no_directory(path):
            raise ConfigError(f"{key}={str(path)!r}{note} {why}; set {key} to a directory this job can write")


def _has_valid(path: Path | str, data: DataSection) -> bool:
    """Whether a shard dir has documents to evaluate on; a damaged validation split is an error, not a
    reason to run without evaluation."""
    cache = StoreCache.at(data.cache_dir, data.cache_limit_gb)
    split = open_manifest(path, cache, splits=())[1]["splits"].get("valid")
    if not (split and split["documents"]):
        return False
    open_split(path, "valid", data.cache_dir, data.cache_limit_gb)  # raises, naming the damage, if a shard
    return True  # file is missing or truncated


def check_shards(plan: RunPlan) -> None:
    """``data.verify`` on the local sets without writing the stamp: what ``--check-config`` hashes."""
    _verify_checksums(plan, [(path, weight) for path, weight in plan.sets if not is_url(path)], record=False)


def _verify_checksums(plan: RunPlan, sets: list, record: bool) -> None:
    data = plan.cfg.data
    if data.verify == "size":
        return
    for path, _ in sets:
        verify_checksums(path, data.cache_dir, trust_stamp=data.verify == "checksum",
                         cache_limit_gb=data.cache_limit_gb, record=record)
