"""The jobs on the devices there are: one worker process per GPU (it sees that GPU alone), or ``--jobs`` of
them on a CPU (the cores shared out); each worker runs jobs one after another, largest first. A job that
raises fails alone (its traceback in its log.txt); a worker that dies (killed, out of memory) ends the pool,
and every job not finished is named as failed. A job already finished (its results.json there) is not run
again by the next call; one that was cut resumes through fine-tuning's own state."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from functools import lru_cache

from convbert_ds.errors import UserError
from convbert_ds.evaluate.plan import Job, TaskSource
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.run import RunSpec, run
from convbert_ds.fsutil import read_json
from convbert_ds.log import get_logger

log = get_logger(__name__)


@dataclass
class Outcome:
    job: Job
    final: dict | None  # {split: metrics} of the job's seed; None when it failed
    error: str = ""
    seconds: float = 0.0


def slots(jobs_asked: int | None) -> list[str | None]:
    """What each worker sees: a GPU index each (CUDA_VISIBLE_DEVICES), or ``None`` for each CPU worker."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return [str(i) for i in range(min(gpus, jobs_asked or gpus))]
    return [None] * (jobs_asked or 1)


def run_all(todo: list[Job], devices: list[str | None]) -> list[Outcome]:
    """Run every job of ``todo``; the finished ones are read back. Prints a line as each job ends."""
    outcomes = [Outcome(job, final(job)) for job in todo if job.results.is_file()]
    pending = [job for job in todo if not job.results.is_file()]
    if outcomes:
        log.info(f"{len(outcomes)} of {len(todo)} job(s) finished before; running the other {len(pending)}")
    if not pending:
        return outcomes
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; each worker starts clean
    queue = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // len(devices))
    for device in devices:
        queue.put(device)
    # A job that starts from another's model (--from-mnli) waits for it; the others start largest first.
    waiting: dict[str, list[Job]] = {}
    for job in pending:
        if job.after and not (job.out.parent / job.after / "results.json").is_file():
            waiting.setdefault(job.after, []).append(job)
    started, done = time.monotonic(), 0

    def report(outcome: Outcome) -> None:
        nonlocal done
        done += 1
        outcomes.append(outcome)
        job = outcome.job
        said = f"failed: {outcome.error} (log: {job.out / 'log.txt'})" if outcome.final is None else \
            f"done in {outcome.seconds:.0f} s"
        log.info(f"[{done}/{len(pending)}, {time.monotonic() - started:.0f} s] {job.name} {said}")

    with ProcessPoolExecutor(len(devices), mp_context=context, initializer=_start_worker,
                             initargs=(queue, threads)) as pool:
        held = {later.name for group in waiting.values() for later in group}
        running = {pool.submit(_run, job): job for job in pending if job.name not in held}
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                job = running.pop(future)
                try:
                    outcome = future.result()
                except Exception as error:  # noqa: BLE001 - a worker died (killed, out of memory): the pool is broken
                    outcome = Outcome(job, None, f"its worker died ({type(error).__name__}: {error})")
                report(outcome)
                for later in waiting.pop(job.name, []):
                    if outcome.final is None:
                        report(Outcome(later, None, f"{job.name}, whose model it starts from, failed"))
                    else:
                        running[pool.submit(_run, later)] = later
    for after, group in waiting.items():  # its MNLI job was neither finished nor run here
        for later in group:
            report(Outcome(later, None, f"{after}, whose model it starts from, did not run"))
    return outcomes


def _start_worker(queue, threads: int) -> None:
    if sys.platform.startswith("linux"):  # a worker ends with the evaluation, however that ends (kill -9 too)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    device = queue.get()
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device  # before anything asks CUDA
    import torch

    torch.set_num_threads(threads)


@lru_cache(maxsize=2)
def _task(source: TaskSource):
    return source.read()  # a worker reads a task once for all its seeds


def _run(job: Job) -> Outcome:
    started = time.monotonic()
    job.out.mkdir(parents=True, exist_ok=True)
    command = f"python -m convbert_ds.evaluate (job {job.name})"
    with open(job.out / "log.txt", "a") as said, redirect_stdout(said), redirect_stderr(said):
        try:
            run(RunSpec(_task(job.task), str(job.model), job.out, job.recipe, job.random_init, command))
        except UserError as error:
            log.error(f"error: {error}")  # into the job's log.txt (stderr is redirected), which the last line names
            return Outcome(job, None, str(error))
        except Exception:  # noqa: BLE001 - the traceback goes to the job's log; the evaluation goes on
            traceback.print_exc()
            return Outcome(job, None, "an unexpected error, traceback in the log")
    return Outcome(job, final(job), seconds=time.monotonic() - started)


def final(job: Job) -> dict:
    """The finished job's metrics: {split: metrics} of its one seed."""
    fix = f"delete it and rerun the same command: job {job.name} runs again"
    try:
        return read_json(job.results, FinetuneError, fix, needs=("seeds",))["seeds"][0]["final"]
    except (IndexError, KeyError, TypeError):
        raise FinetuneError(f"{job.results}: its first seed has no final metrics; {fix}") from None
