"""Start N ranks of a command on this machine with the variables torchrun hands its ranks, for the test runs
whose subject is not the launcher (``launch.NOT_THE_SUBJECT``):

    python tests/spawn_ranks.py N MASTER_PORT -- COMMAND ...

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (loopback) and MASTER_PORT, which is
what the trainer reads from any launcher (``convbert_ds/engine/distributed.py``), and inherits stdout and
stderr. What this saves is torchrun's own start-up: it imports torch before a rank starts, 2.4 s of each run
on 2 CPU cores; this file imports nothing beyond the standard library.

As torchrun does, it stops the other ranks when one fails (they would wait in a collective for it): SIGTERM,
then SIGKILL after a grace. It exits with the first failed rank's code (128 + N for a signal), else 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0  # for the other ranks to leave after SIGTERM (the trainer takes it for a preemption and may
# try to save: a save that waits on the failed rank is killed)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    ranks, port, command = int(argv[0]), argv[1], argv[3:]
    base = {**os.environ, "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port}
    running = [subprocess.Popen(command, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ranks)]
    failed = 0
    while running:
        for process in [p for p in running if p.poll() is not None]:
            running.remove(process)
            if process.returncode and not failed:
                failed = _exit_code(process.returncode)
                _stop(running)
        time.sleep(0.05)
    return failed


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
