"""``python -m preprocessing.shard`` that SIGKILLs itself once a progress checkpoint records STOP input chunks
as done: the crash/resume test's crash at a chosen point (``preprocessing.shard.after_checkpoint``).

    python tests/preprocessing/shard_killed_at.py STOP SHARD ARGUMENTS ...
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    from preprocessing import errors, shard  # after sys.path holds the repository (below)

    stop = int(sys.argv[1])

    def die_at_stop(chunks_done: int) -> None:
        if chunks_done >= stop:
            os.kill(os.getpid(), signal.SIGKILL)

    shard.after_checkpoint = die_at_stop
    sys.exit(errors.run_cli(shard.main, sys.argv[2:]))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # run as a script from the repository root, as python -m would
    main()
