"""Where ``checkpoint.dir`` lives: one directory every rank sees (a shared filesystem, or a run on one node),
or one disk per node (node-local scratch, the same path on every node) whose checkpoints are whole only in
``checkpoint.mirror``.

``probe`` finds out at the start of a run by writing, not by asking the user: every rank writes one file into
a directory named by a token rank 0 draws, and the ranks compare which of those files each of them sees.
Everybody sees everybody's: shared. The ranks fall into groups that see exactly each other's files (the
ranks of one node): node-local. A network filesystem may show another node's files late, so a verdict
other than "shared" is taken only after looking again for ``SETTLE_S`` seconds (when a node-local verdict
would stop the run, as long as the Slurm scripts' own check waits: ``CONVBERT_DS_SHARED_DISK_WAIT``, default
30); one that is still neither is an error. A shared disk taken for node-local ones (files later than that)
still checkpoints correctly with a mirror, only with every node uploading the same files. The Slurm scripts'
own check has looked that long already when it exports ``NODE_LOCAL_VARIABLE`` (naming the directory it
found node-local): a node-local verdict is then taken at the first look, and each attempt of a job on
node-local disks starts ``SETTLE_S`` sooner.

On node-local disks each node's first rank is its directory's keeper (what rank 0 does on a shared disk:
removing interrupted saves, choosing and verifying the tag to resume, converting it to another layout,
pruning old tags), and a checkpoint is complete only once every node's part is in the store
(``engine.checkpoint``). Without a mirror there is no place where the parts meet: the run stops before it
builds anything, in one line naming both ways out.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from convbert_ds.errors import UserError
from convbert_ds.log import get_logger

SETTLE_S = 5.0
NODE_LOCAL_VARIABLE = "CONVBERT_DS_NODE_LOCAL_DIR"  # set by slurm/common.sh's cbd_check_nodes
log = get_logger(__name__)


class UnsharedCheckpointDir(UserError):
    """``checkpoint.dir`` is on node-local disks and there is no ``checkpoint.mirror`` to join the parts."""


@dataclass(frozen=True)
class CheckpointDisk:
    shared: bool  # every rank sees the same files there
    keeper: bool  # this rank does the directory's own work: rank 0 on a shared disk, each node's first rank else
    group_ranks: tuple[int, ...] = ()  # the ranks that see this rank's directory (its node's, when node-local)


def one_disk() -> CheckpointDisk:
    """A run without a process group, or one process: its own directory."""
    return CheckpointDisk(shared=True, keeper=True, group_ranks=(0,))


def probe(directory: Path, mirror: str | None) -> CheckpointDisk:
    """Every rank, once the process group is up: is ``directory`` shared or node-local? Raises
    ``UnsharedCheckpointDir`` (on every rank) for node-local disks without a mirror."""
    directory = Path(directory)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return one_disk()
    rank, world = dist.get_rank(), dist.get_world_size()
    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    where = directory / f".disk-check-{token[0]}"
    where.mkdir(parents=True, exist_ok=True)
    (where / f"rank{rank:05d}").write_text(socket.gethostname() + "\n")
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname().split(".")[0])
    settle = SETTLE_S if mirror else float(os.environ.get("CONVBERT_DS_SHARED_DISK_WAIT", "30"))
    # The job script waited for the other nodes' files in this directory already and found it node-local.
    said = os.environ.get(NODE_LOCAL_VARIABLE)
    known_node_local = bool(mirror and said) and Path(said) == directory
    deadline = time.monotonic() + settle
    while True:
        dist.barrier()
        seen = sorted(int(p.name[4:]) for p in where.iterdir() if p.name.startswith("rank"))
        views: list[list[int] | None] = [None] * world
        dist.all_gather_object(views, seen)
        everyone = list(range(world))
        if all(view == everyone for view in views):
            verdict = "shared"
            break
        blocks = _partition(views)
        # Every rank decides from the same gathered views and the same clock test on rank 0's time.
        late = [time.monotonic() >= deadline or (known_node_local and blocks is not None)]
        dist.broadcast_object_list(late, src=0)
        if late[0]:
            verdict = "node-local" if blocks else "neither"
            break
        time.sleep(1.0)
    (where / f"rank{rank:05d}").unlink(missing_ok=True)
    dist.barrier()
    shutil.rmtree(where, ignore_errors=True)  # empty by now; every rank tries, one per disk succeeds
    if verdict == "shared":
        return CheckpointDisk(shared=True, keeper=rank == 0, group_ranks=tuple(everyone))
    if verdict == "neither":
        raise UserError(f"checkpoint.dir={directory}: the ranks see each other's files there inconsistently "
                        f"after {settle:.0f} s (which ranks each rank saw: {views}); use a directory every "
                        "node mounts, or one node-local path with checkpoint.mirror set")
    mine = next(block for block in blocks if rank in block)
    if not mirror:
        others = sorted({hosts[r] for r in everyone if r not in mine})
        raise UnsharedCheckpointDir(
            f"checkpoint.dir={directory} is not shared: files written there on {', '.join(others)} are not "
            f"visible on {hosts[rank]}; put checkpoint.dir on a filesystem every node mounts, or set "
            "checkpoint.mirror=s3://BUCKET/PREFIX so that every node uploads its own part of each checkpoint")
    if rank == 0:
        log.info(f"checkpoint.dir {directory} is node-local ({len(blocks)} disks: "
                 + "; ".join(f"{hosts[b[0]]}: ranks {b[0]}-{b[-1]}" for b in blocks)
                 + f"); each node uploads its own part of a checkpoint to {mirror}, which is complete once "
                   "every part is there")
    return CheckpointDisk(shared=False, keeper=rank == mine[0], group_ranks=tuple(mine))


def _partition(views: list[list[int]]) -> list[list[int]] | None:
    """The groups of ranks that each see exactly their group's files, or None when the views are not such
    a partition (a rank that does not see its own file, or two ranks that disagree about each other)."""
    blocks = {tuple(view) for view in views}
    for rank, view in enumerate(views):
        if rank not in view or any(views[other] != view for other in view):
            return None
    return sorted(list(block) for block in blocks)
