"""What the GPU acceptance keeps in ``--logs DIR`` while it runs. A call stopped from outside (the end of a
lease, the machine's memory) still leaves behind everything that finished before it stopped:

- ``NAME.log``: one command's stdout and stderr (a part's, or one pretraining row's), written when it ends;
- ``RUN.pt.trace.json.gz``: a profiled row's torch.profiler trace, gzipped (tens of MB as JSON), written
  when its row ends. ``benchmarks/analysis/trace_summary.py`` reads any number of them back;
- ``pretrain.md``: the pretraining part's table so far, rewritten after each of its rows (the rows to come
  say "not yet");
- ``record.md``: the record of the parts done so far, rewritten after each part. After the last part it is
  the record the run writes (``benchmarks/gpu/record.py``)."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

class KeptLogs:
    """Where ``--logs`` keeps things (``directory``); without it (None), nothing is kept."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def log(self, name: str, text: str) -> None:
        if self.directory is not None:
            (self.directory / f"{name}.log").write_text(text)

    def traces(self, run_dir: Path) -> None:
        """The traces of one pretraining row (``run_dir``, the trainer's ``log.dir`` under it), as
        ``RUN.pt.trace.json.gz``, RUN being the run directory's name."""
        if self.directory is None:
            return
        for trace in run_dir.glob("logs/profile/*.pt.trace.json"):
            with trace.open("rb") as source, gzip.open(self.directory / f"{run_dir.name}.pt.trace.json.gz",
                                                       "wb") as target:
                shutil.copyfileobj(source, target)

    def file(self, name: str, text: str) -> None:
        """Replace the file ``name`` whole (written beside it first): a call stopped while it is written leaves
        the file as it was, never half of it."""
        if self.directory is None:
            return
        partial = self.directory / f".{name}.partial"
        partial.write_text(text.rstrip("\n") + "\n")
        os.replace(partial, self.directory / name)
