"""What the host must learn between steps, learnt without stalling the accelerator every step.

Two things can stop a training loop: a preemption signal (SIGUSR1/SIGTERM, on any rank) and losses that
are no longer finite.

Before the first step has ended there is nothing to save, so SIGUSR1, SIGTERM and SIGINT stop the process at
once, whatever it is doing: waiting for its peers, downloading from a store, building indexes, compiling.
Python runs a signal handler only when the main thread is back in Python, and a rank waiting in the
rendezvous is in C++ for as long as its timeout. So the handlers only record the signal; its number also reaches a
wakeup socket (``signal.set_wakeup_fd``, written at C level by the interpreter's own handler), which a thread
of its own reads: it says ``received SIGTERM: stopped before training started: nothing to save`` and exits
with ``EXIT_PREEMPTED``, as a preempted run does (a job script requeues on it; the newest checkpoint, if
any, is where a rerun resumes). From the end of the first step on, SIGUSR1 and SIGTERM mean: finish the
step, save, exit ``EXIT_PREEMPTED``; SIGINT is Python's KeyboardInterrupt again.

Between steps: Reading either from a device tensor every step (``.item()`` after an all-reduce)
makes the host wait for the whole step to finish before it may queue the next one, which on a GPU costs
more than the step's small kernels. So:

- the preemption flag is host state: the ranks agree on it every step through an all-reduce of a CPU
  tensor over a gloo group (the default group when it is gloo, else a gloo group made once), which waits
  for the other hosts, never for a device;
- non-finite losses are counted on the device (``record``, ``end_step``: tensor ops, no read), and the
  host reads the counts every ``train.nonfinite_check_interval`` steps and before every checkpoint, in
  the same all-reduce. A run therefore stops within that many steps of a bad loss, and never saves one.

What a non-finite loss means then depends on who skips the update. In fp16, DeepSpeed's loss scaler finds
the overflowing gradients and skips that step itself, so the run stops only after
``train.max_nonfinite_in_a_row`` bad steps in a row, as it always did. In bf16 and fp32 nothing skips it
(the step has already been taken when the host learns of it), so the first one stops the run, and the
resume goes back to the last checkpoint, which predates it. ``nonfinite_check_interval: 1`` keeps the
exact old behaviour instead: every micro-batch's loss is read before its backward, and a bad one is
dropped; it costs a device sync per micro-batch.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from convbert_ds.formats.train_config import TrainSection
from convbert_ds.log import EVERY_RANK, get_logger

log = get_logger(__name__)

EXIT_PREEMPTED = 3  # stopped by a signal; what is on disk is the newest checkpoint: rerun (or requeue) to resume
STOPPING_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite losses in a row); the message says how to resume."""


@dataclass
class Verdict:
    """What the ranks agreed on at the end of a step."""

    preempted: bool
    checked: bool  # the non-finite counts below were read this step
    nonfinite: int = 0  # micro-batches with a non-finite loss since the last check (max over ranks)
    worst_in_a_row: int = 0  # the longest run of steps with one since the last check (max over ranks)


def _stop_before_training(what: str) -> None:
    """Exit now, in one line: nothing has been trained, so nothing is saved or lost."""
    log.error(f"received {what}: stopped before training started: nothing to save", extra=EVERY_RANK)
    sys.stderr.flush()
    os._exit(EXIT_PREEMPTED)  # the main thread may be in C++ for minutes: no unwinding


class StepGuard:
    """From construction until the first step has ended, SIGUSR1/SIGTERM/SIGINT stop the process at once;
    from then on SIGUSR1/SIGTERM are remembered for ``end_step``. Counts non-finite losses on ``device``
    once ``start``ed. Construct it in the main thread, first."""

    def __init__(self):
        self.requested = False
        self.group = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOPPING_SIGNALS}
        reader, self._wakeup = socket.socketpair()
        self._wakeup.setblocking(False)  # the interpreter's C handler must never block on it
        self._previous_wakeup = signal.set_wakeup_fd(self._wakeup.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch_wakeup, args=(reader,), name="stop-before-training",
                         daemon=True).start()

    def _handle(self, signum, frame):
        self.requested = True

    def _watch_wakeup(self, reader: socket.socket) -> None:
        """The wakeup socket's reader: exits the process on the first stopping signal, until ``_trained``
        closes the socket."""
        while True:
            try:
                data = reader.recv(1)
            except OSError:
                return
            if not data:  # closed: training has begun
                return
            if data[0] in STOPPING_SIGNALS:
                _stop_before_training(signal.Signals(data[0]).name)

    def _close_wakeup(self) -> None:
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            self._wakeup.close()  # the reader sees the end and returns
            self._wakeup = None

    def _trained(self) -> None:
        """The first step has ended: signals are the step loop's from now on (main thread only)."""
        if self._wakeup is None:
            return
        self._close_wakeup()
        signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
        if self.requested:  # arrived while the first step ended, before the socket closed: still nothing saved
            _stop_before_training("a stopping signal")

    def close(self) -> None:
        """The process's signal handling as it was before (a caller that runs ``train.main`` in-process)."""
        self._close_wakeup()
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)

    def start(self, device: torch.device, train: TrainSection, precision: str, step: int, nonfinite_total: int,
              resume_dir: Path) -> None:
        """The step loop starts after ``step`` with ``nonfinite_total`` bad micro-batches behind it (a resumed
        run's count); ``resume_dir``: where the error that stops the run tells the user to resume from."""
        self.device, self.check_interval = device, train.nonfinite_check_interval
        self.max_in_a_row, self.precision = train.max_nonfinite_in_a_row, precision
        # fp16's loss scaler skips steps with non-finite gradients itself.
        self.skips_nonfinite = precision == "fp16"
        self.checked_at, self.nonfinite_total, self.resume_dir = step, nonfinite_total, resume_dir
        # gloo for host tensors: the backend of the default group may be NCCL, which reduces device tensors.
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        zero = torch.zeros((), dtype=torch.int32, device=device)
        self._bad_total, self._in_a_row, self._worst = zero.clone(), zero.clone(), zero.clone()
        self._step_bad = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def drops_nonfinite(self) -> bool:
        """Read every micro-batch's loss and drop the bad ones before backward (interval 1, a sync each)."""
        return self.check_interval == 1

    def record(self, loss: torch.Tensor) -> None:
        """Count ``loss`` if it is not finite (device ops only)."""
        bad = (~torch.isfinite(torch.as_tensor(loss, device=self.device).detach())).to(torch.int32)
        self._bad_total += bad
        self._step_bad |= bad

    def end_step(self, step: int, before_save: bool = False) -> Verdict:
        """Close a step with one host all-reduce; on check steps, before a save and on a preemption (which
        saves) it also carries the counts read from the device. Raises ``TrainingError`` when they say the
        run cannot go on."""
        self._trained()
        self._in_a_row = (self._in_a_row + 1) * self._step_bad
        self._worst = torch.maximum(self._worst, self._in_a_row)
        self._step_bad.zero_()
        verdict = self._agree(read=before_save or step % self.check_interval == 0)
        if verdict.preempted and not verdict.checked:  # every rank agreed on that, so every rank comes here
            verdict = self._agree(read=True)
        if verdict.checked:
            self.nonfinite_total += verdict.nonfinite
            if self.must_stop(verdict):
                raise TrainingError(self._stop_line(verdict, step))
            self.checked_at = step
        return verdict

    def _agree(self, read: bool) -> Verdict:
        values = [float(self.requested), 0.0, 0.0]
        if read:  # the one read of the device: two integers
            values[1:] = torch.stack([self._bad_total, self._worst]).tolist()
            self._bad_total.zero_(), self._worst.zero_()
        agreed = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        preempted, nonfinite, worst = (int(v) for v in agreed.tolist())
        return Verdict(bool(preempted), read, nonfinite, worst)

    def must_stop(self, verdict: Verdict) -> bool:
        """True when the losses say the run cannot go on (see the module docstring)."""
        return verdict.worst_in_a_row >= self.max_in_a_row if self.drops_nonfinite or self.skips_nonfinite \
            else verdict.nonfinite > 0

    def _stop_line(self, verdict: Verdict, step: int) -> str:
        fix = "with a lower train.lr, or train.precision=bf16 instead of fp16"
        if self.drops_nonfinite or self.skips_nonfinite:
            return (f"{verdict.worst_in_a_row} steps in a row had a non-finite loss (by step {step}); stopping. "
                    f"Resume from {self.resume_dir} {fix}")
        return (f"{verdict.nonfinite} micro-batch(es) had a non-finite loss in steps {self.checked_at + 1}-{step} "
                f"and {self.precision} does not skip their updates; stopping before any checkpoint holds them. "
                f"Resume from {self.resume_dir} (its last checkpoint predates them) {fix} "
                "(train.nonfinite_check_interval=1 drops such micro-batches instead, at a device sync each)")
