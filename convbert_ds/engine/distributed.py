"""One way to find this process's rank, whatever started it.

- ``deepspeed`` / ``torchrun``: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT are set.
- ``srun python -m convbert_ds.train``: translated from SLURM_PROCID / SLURM_NTASKS /
  SLURM_LOCALID; the master is the first host of the job's node list.
- ``mpirun -np N python -m convbert_ds.train``: asked of MPI through mpi4py.
- nothing: a single process.

``init_process_group`` then starts DeepSpeed's process group the one way every entry point uses, and
``place`` binds the process's GPU before it: the trainer and fine-tuning both start that way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from convbert_ds.errors import UserError

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
FAILED_RANK_GRACE_S = 5.0  # see exit_process
_left_together = False  # set by leave_together: every rank is past rank 0's last line
_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split()
        if hosts:
            return hosts[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")


def _from_slurm() -> dict[str, str]:
    job = int(os.environ.get("SLURM_JOB_ID", "0"))
    return {
        "RANK": os.environ["SLURM_PROCID"],
        "WORLD_SIZE": os.environ["SLURM_NTASKS"],
        "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or _first_slurm_host(),
        # Jobs sharing a node must not fight over one port, and none may take a port the kernel hands out to
        # connections (Linux's default ephemeral range starts at 32768): 20000-31999.
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(20000 + job % 12000),
    }


def _mpirun_inside_slurm() -> bool:
    """``mpirun`` in a Slurm job starts its ranks through ``srun`` (one task per node), so they
    inherit that step's SLURM_PROCID/SLURM_NTASKS, which are not their ranks; ``srun --mpi=pmi2``
    tasks carry the same numbers in both."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
    size = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE"))
    if rank is None and size is None:
        return False
    return (rank, size) != (os.environ["SLURM_PROCID"], os.environ["SLURM_NTASKS"])


def _from_mpi() -> dict[str, str]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    master = comm.bcast(socket.gethostbyname(socket.gethostname()) if rank == 0 else None, root=0)
    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", master), "MASTER_PORT": os.environ.get("MASTER_PORT", port)}


def free_port() -> str:
    """A TCP port nobody listens on now (the OS picks it): for a rendezvous that must not collide with
    another run's on the same machine. The one helper for this: the trainer, the benchmarks and the tests."""
    with socket.socket() as s:
        s.bind(("", 0))
        return str(s.getsockname()[1])


def saved_torch_vars() -> Callable[[], None]:
    """``TORCH_VARS`` as they are now; calling the result puts them back. ``discover`` sets them even for one
    process, and a caller in the same process (a test, a benchmark) must not pass RANK=0 WORLD_SIZE=1 on to
    the launchers it starts next."""
    before = {name: os.environ.get(name) for name in TORCH_VARS}

    def restore() -> None:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return restore


def discover() -> str:
    """Fill the torch.distributed variables from the launcher; return the launcher's name."""
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE")):
        os.environ.setdefault("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
        launcher = "torch"
    elif (all(v in os.environ for v in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"))
          and not _mpirun_inside_slurm()):
        os.environ.update(_from_slurm())
        launcher = "slurm"
    elif any(v in os.environ for v in _MPI_MARKERS):
        os.environ.update(_from_mpi())
        launcher = "mpi"
    else:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        launcher = "single"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", free_port() if os.environ["WORLD_SIZE"] == "1" else "29500")
    _check_launch_vars()
    return launcher


class LaunchError(UserError):
    """A rank variable the launcher (or the user) set that no rendezvous can work with."""


LAUNCH_FIX = "the launcher sets them (deepspeed, torchrun, srun, mpirun); unset them to run one process"
HOST_LOOKUPS = 3  # tries, 2 s apart: a cluster's name service may answer late as a job starts


def _check_launch_vars() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT and (with peers) MASTER_ADDR, checked before any rendezvous:
    a non-number fails deep inside torch, and a rank outside the world or a host that does not exist waits
    for peers that never come."""
    def integer(name: str, low: int, high: int | None = None) -> int:
        value = os.environ[name]
        if not re.fullmatch(r"\d+", value) or int(value) < low or (high is not None and int(value) > high):
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise LaunchError(f"{name}={value!r}: not an integer {bounds}; {LAUNCH_FIX}")
        return int(value)

    world, rank = integer("WORLD_SIZE", 1), integer("RANK", 0)
    integer("LOCAL_RANK", 0)
    port = integer("MASTER_PORT", 1, 65535)
    if rank >= world:
        raise LaunchError(f"RANK={rank} with WORLD_SIZE={world}: ranks go from 0 to {world - 1}; {LAUNCH_FIX}")
    if world == 1:
        return
    host = os.environ["MASTER_ADDR"]
    for attempt in range(HOST_LOOKUPS):
        try:
            socket.getaddrinfo(host, port)
            return
        except (socket.gaierror, UnicodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            if attempt + 1 < HOST_LOOKUPS:
                time.sleep(2)
    raise LaunchError(f"MASTER_ADDR={host!r}: no such host ({reason}); set it to rank 0's host name or address, "
                      "which every rank can resolve")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_process_group(backend: str | None = None) -> str:
    """``deepspeed.init_distributed`` (default: NCCL on GPUs, gloo on CPU), without DeepSpeed's CPU
    shared-memory all-reduce.

    DeepSpeed's CPU accelerator JIT-builds that extension in every process that starts a process group, yet
    only its inference all-reduce uses it: training reduces over gloo. Each process takes the build's file
    lock in the user's torch extensions directory, even when nothing is rebuilt, and a process killed while
    holding it (kill -9, a time limit, preemption) leaves a lock that every later run on the machine waits
    on forever, silently, before its first step. Each rank also mapped a 67 MB /dev/shm buffer that was never
    unlinked. Marked incompatible, the extension is neither built nor loaded; on GPUs it never was.
    """
    import deepspeed  # here: rank discovery stays light, and DeepSpeed logs to stdout when imported
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    # The probe's result is cached in the module, and DeepSpeed reads this dict before building an op.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    global _left_together
    _left_together = False  # a new group (a caller in this process that runs again): not left yet
    return backend


def place(group_when_alone: bool = True) -> torch.device:
    """Bind this process to its device and start the process group; return the device. Call after ``discover``.

    The device is LOCAL_RANK's GPU when there is a GPU (modulo the GPUs this process sees: a task bound to
    one GPU by --gpus-per-task sees only that one), else the CPU. The group is started by
    ``init_process_group``; ``group_when_alone=False`` starts none for a single process (fine-tuning's
    plain loop needs none, and leaves the process as it found it; DeepSpeed's engine always needs one).
    """
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if group_when_alone or world_size() > 1:
        init_process_group()
    return device


T = TypeVar("T")


def _travels(error: Exception) -> Exception:
    """``error``, or its text in a RuntimeError when it cannot be pickled to another rank."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception that cannot travel: its text can
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def on_rank0(work: Callable[[], T]) -> T:
    """``work()`` on rank 0 only; every rank returns its result, or raises its exception (the others would
    otherwise wait forever in the next collective). A process that started no group (a single one) is rank 0
    alone: ``work()`` simply runs there."""
    if not dist.is_initialized():
        return work()
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = (True, work())
        except Exception as error:  # noqa: BLE001 - handed to every rank, raised there
            outcome[0] = (False, _travels(error))
    dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def on_ranks(work: Callable[[], T], mine: bool, group=None) -> list[T | None]:
    """``work()`` on every rank where ``mine`` is true (each node's first rank on node-local disks, say), the
    others waiting; every rank returns the list of results by rank (None where it did not run), or raises the
    first exception raised on any rank, by rank order."""
    if not dist.is_initialized():
        return [work() if mine else None]
    outcome = (True, None)
    if mine:
        try:
            outcome = (True, work())
        except Exception as error:  # noqa: BLE001 - handed to every rank, raised there
            outcome = (False, _travels(error))
    outcomes = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, outcome, group=group)
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]


EXIT_PEER_LOST = 5  # a collective lost a peer: another rank's process or its node is gone
# What gloo and NCCL say when the other end of a collective went away (a killed process, a dead node).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "Broken pipe",
              "remote process exited or there was a network error")
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")


def lost_peer(error: BaseException) -> str | None:
    """The one line to say when ``error`` is a collective that lost its peer, else None: which rank, and the
    address gloo names (the peer's host and port), instead of a traceback on every surviving rank."""
    text = str(error)
    said = next((marker for marker in _PEER_LOST if marker in text), None)
    if said is None or not isinstance(error, RuntimeError):
        return None
    address = _PEER_ADDRESS.search(text)
    peer = f"{address.group(1)}:{address.group(2)}, " if address else ""
    return (f"error: rank {rank()} lost its connection to another rank ({peer}{said.lower()}): a process or a node "
            f"of the run is gone; exiting with code {EXIT_PEER_LOST} (started again, by the job script or an elastic "
            "torchrun, the run resumes on the nodes left from its newest complete checkpoint)")


def leave_together() -> None:
    """End the process group once every rank has said its last line: stdio flushed, then a barrier. Past it
    no rank has anything left to lose, so ``exit_process`` needs no grace: a preempted rank that lingered
    would spend the seconds the scheduler gives between its signal and SIGKILL."""
    global _left_together
    _flush()
    dist.barrier()
    dist.destroy_process_group()
    _left_together = True


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def exit_process(code: int) -> NoReturn:
    """Leave a process that ran a process group with ``code``, skipping the interpreter's finalization.

    DeepSpeed keeps its process groups in module globals and on its engines, optimizers and parameters
    (``groups._WORLD_GROUP``, ``_dp_group``), so ``destroy_process_group`` cannot free them. Left to
    finalization, they are freed while gloo's worker threads still wait for the GIL being torn down, and a
    run that finished and saved aborts ("terminate called without an active exception", signal 6) now and
    then. Nothing is lost by skipping finalization: the trainer closes its logs and checkpoints before it
    returns, and only stdio and logging handlers still buffer.

    A rank other than 0 that fails waits ``FAILED_RANK_GRACE_S`` first, unless the ranks left together
    (``leave_together``). A failure found alike on every rank (a config error, a damaged checkpoint) is
    printed by rank 0 only, and the ``deepspeed`` launcher kills the whole group the moment any rank exits
    non-zero: a rank 1 that left at once could take rank 0 down before its one line was out, leaving an exit
    code 2 and no message. A rank that lost a peer (``EXIT_PEER_LOST``) leaves at once: it has said its own
    line, and while it waited, the ranks blocked on it in the next collective waited too, and so did the
    restart on the nodes left (benchmarks/RESULTS.md, ``row-node-local-start``).
    """
    if code not in (0, EXIT_PEER_LOST) and rank() != 0 and not _left_together:
        time.sleep(FAILED_RANK_GRACE_S)
    _flush()
    logging.shutdown()
    os._exit(code)
