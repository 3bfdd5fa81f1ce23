"""``tests/spawn_ranks.py``, the launcher of the runs whose subject is not the launcher: ranks forked from its
zygote (or from fresh imports) see what a process of their own would, exit with their own codes, and leave
nothing running when the caller is killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import REPO, env, run_group, spawn_ranks

pytestmark = pytest.mark.slow

RANK_SCRIPT = """
import json, os, sys
# One write a line: print's text and newline are two writes to the unbuffered stdout, and the other rank's
# line came between them.
grandparent = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])
sys.stdout.write(json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:],
                             "path0": sys.path[0], "main": __name__, "torch_loaded": "torch" in sys.modules,
                             "grandparent": grandparent}) + "\\n")
sys.stdout.flush()
sys.exit(int(os.environ["RANK"]) + int(sys.argv[1]))
"""


def _wait_for_zygote(timeout: float = 120) -> int:
    """The zygote's pid, once it answers (its imports made; until then runs make their own)."""
    from launch import _zygote, _zygote_socket

    ready = Path(_zygote_socket() + ".env")
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert time.monotonic() < deadline, "the zygote did not start"
        time.sleep(0.2)
    return _zygote["process"].pid


@pytest.mark.parametrize("extra_env", [{}, {"OMP_NUM_THREADS": "3"}], ids=["zygote", "fresh-imports"])
def test_each_rank_runs_the_script_as_python_would_with_its_own_exit_code(tmp_path, extra_env):
    zygote = _wait_for_zygote()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = run_group(spawn_ranks(2, [sys.executable, str(script), "0"]), 120, cwd=REPO,
                       env={**env(), **extra_env})
    rows = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                  key=lambda row: row["rank"])
    assert [(r["rank"], r["world"], r["argv"], r["main"]) for r in rows] == [("0", "2", ["0"], "__main__"),
                                                                             ("1", "2", ["0"], "__main__")]
    assert all(r["path0"] == str(tmp_path) and r["torch_loaded"] for r in rows), rows  # forked after the imports
    # Forked by a spawner that the zygote forked, or (another environment) by spawn_ranks.py, which this
    # process started: the rank's grandparent says which way the run went.
    assert all(r["grandparent"] == (os.getpid() if extra_env else zygote) for r in rows), (rows, zygote)
    assert result.returncode == 1, result.stderr[-2000:]  # rank 1's code; rank 0's was 0


def test_a_killed_caller_leaves_no_rank_running(tmp_path):
    _wait_for_zygote()
    script = tmp_path / "sleeper.py"
    script.write_text("import os, pathlib, sys, time\n"
                      "pathlib.Path(sys.argv[1], 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "time.sleep(300)\n")
    with pytest.raises(subprocess.TimeoutExpired):  # run_group kills the caller's process group
        run_group(spawn_ranks(2, [sys.executable, str(script), str(tmp_path)]), 8, cwd=REPO, env=env())
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in pids if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
