"""What a run says on its console: one logger per module, that knows its rank.

    from convbert_ds.log import EVERY_RANK, get_logger
    log = get_logger(__name__)
    log.info("resumed from ...")                         # rank 0 only, on stdout
    log.info("rank-local detail", extra=EVERY_RANK)      # every rank
    log.warning("warning: ...")                          # rank 0 only, on stderr

Every message is written as it is (no level or time prefix: the lines are the product's log format, read by
job scripts and tests) and flushed at once, so a killed run's last line is on disk. The rank is asked when a
message is written, not when the logger is made: modules log before and after the process group starts.
Under ``torch.distributed`` it is the group's rank; before, ``RANK`` as every launcher sets it (the
trainer's ``distributed.discover`` sets it for srun and mpirun). What a module says of its own rank's
disk, store or cache (a retry, a rebuilt index) is ``EVERY_RANK``. A caller that wants its own handlers
(a notebook, another program) configures the ``convbert_ds`` logger as usual.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "convbert_ds"
EVERY_RANK = {"every_rank": True}  # ``extra=`` for a message each rank writes (its own state, its own error)


def rank() -> int:
    import torch.distributed as dist  # here: the base layer imports no torch at module load

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "every_rank", False) or rank() == 0


class _Console(logging.Handler):
    """stdout below WARNING, stderr from it, looked up at each message (a test's capture, a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: a failed write is reported, not raised
            self.handleError(record)


def _root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Console) for h in root.handlers):
        handler = _Console()
        handler.addFilter(_RankZero())
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # one line per message even when the caller configured the root logger
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (``__name__``), under the package's console handler."""
    _root()
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")
