"""The trainer with a fault injected, for the crash and failed-save tests: what ``python -m convbert_ds.train``
runs, after the faults given here are set in this rank's process (``launch.run_training(..., faults=...)``).

    python tests/faulty_train.py [--kill-during-save STEP] [--fail-save STEP] [--fail-upload STEP]
                                 [--kill-during-conversion]
                                 TRAINER ARGUMENTS ...

--kill-during-save STEP   rank 0 is SIGKILLed in the save of step STEP, its files written, before the ranks
                          agree (``deepspeed_seam.FAULTS.kill_during_save_at``)
--fail-save STEP          one rank's save of step STEP fails with ENOSPC after DeepSpeed wrote its files
                          (rank 1 when there is one: ``deepspeed_seam.FAULTS.fail_save_at``)
--fail-upload STEP        on node-local checkpoint disks, the last node's upload of its part of step STEP
                          fails (``deepspeed_seam.FAULTS.fail_upload_at``)
--kill-during-conversion  the process converting a checkpoint to a universal copy is SIGKILLed once the
                          first quantity is written (``formats.checkpoint.universal.after_quantity_written``)

Every other argument (the launcher's ``--local_rank`` included) goes to the trainer's own parser.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _die(*_) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(argv: list[str]) -> list[str]:
    """Set the faults ``argv`` asks for; returns the trainer's arguments."""
    from convbert_ds.engine import deepspeed_seam  # after sys.path is python -m's (below)
    from convbert_ds.formats.checkpoint import universal  # the same

    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--kill-during-save", type=int)
    parser.add_argument("--fail-save", type=int)
    parser.add_argument("--fail-upload", type=int)
    parser.add_argument("--kill-during-conversion", action="store_true")
    faults, rest = parser.parse_known_args(argv)
    deepspeed_seam.FAULTS.kill_during_save_at = faults.kill_during_save
    deepspeed_seam.FAULTS.fail_save_at = faults.fail_save
    deepspeed_seam.FAULTS.fail_upload_at = faults.fail_upload
    if faults.kill_during_conversion:
        universal.after_quantity_written = _die
    return rest


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as ``python -m convbert_ds.train`` starts: the working directory, not tests/
    from convbert_ds import train  # here: after the path above
    from convbert_ds.engine import distributed  # the same

    distributed.exit_process(train.main(install(sys.argv[1:])))
