"""How the trainer tells a shared ``checkpoint.dir`` from node-local disks (``engine.checkpoint_disk.probe``), on
two real gloo ranks. Node-local disks are the same path showing different files on each node; here each rank
is handed a directory of its own instead, which is what each rank then sees. On two emulated Slurm nodes, with
the job scripts: ``tests/slurm/test_several_nodes.py``."""

from __future__ import annotations

import json
import sys

import pytest

from convbert_ds.engine.checkpoint_disk import NODE_LOCAL_VARIABLE, SETTLE_S
from launch import REPO, env, run_group, spawn_ranks

pytestmark = pytest.mark.slow  # ranks launched

RANK_SCRIPT = """
import json, sys, time
from pathlib import Path
import torch.distributed as dist
from convbert_ds.engine.checkpoint_disk import probe

dist.init_process_group("gloo")
root, layout = Path(sys.argv[1]), sys.argv[2]
directory = root / ("shared" if layout == "shared" else f"disk{dist.get_rank()}")
start = time.monotonic()
disk = probe(directory, "s3://bucket/run")
sys.stdout.write(json.dumps({"rank": dist.get_rank(), "shared": disk.shared, "keeper": disk.keeper,
                             "group": list(disk.group_ranks), "seconds": time.monotonic() - start}) + "\\n")
"""


def probe_on_two_ranks(tmp_path, layout: str, **variables: str) -> list[dict]:
    script = tmp_path / "probe.py"
    script.write_text(RANK_SCRIPT)
    result = run_group(spawn_ranks(2, [sys.executable, str(script), str(tmp_path), layout]), 120, cwd=REPO,
                       env={**env(), **variables})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                  key=lambda row: row["rank"])


@pytest.mark.parametrize("told", [False, True], ids=["found-by-itself", "told-by-the-job-script"])
def test_node_local_disks_are_found_after_the_settle_wait_unless_the_job_script_waited_already(tmp_path, told):
    """Each rank a disk of its own: each is its disk's keeper. Alone, the trainer looks again for SETTLE_S
    seconds first (a network filesystem shows other nodes' files late); the job script's verdict for this
    directory (``cbd_check_nodes`` waited that long already) is taken at the first look."""
    variables = {NODE_LOCAL_VARIABLE: str(tmp_path / "disk0")} if told else {}
    rows = probe_on_two_ranks(tmp_path, "node-local", **variables)
    assert [(r["shared"], r["keeper"], r["group"]) for r in rows] == [(False, True, [0]), (False, True, [1])]
    waited = min(r["seconds"] for r in rows)
    assert waited < SETTLE_S - 2 if told else waited >= SETTLE_S, rows


def test_a_shared_directory_is_found_at_once_and_rank_0_keeps_it(tmp_path):
    rows = probe_on_two_ranks(tmp_path, "shared", **{NODE_LOCAL_VARIABLE: str(tmp_path / "elsewhere")})
    assert [(r["shared"], r["keeper"], r["group"]) for r in rows] == [(True, True, [0, 1]), (True, False, [0, 1])]
    assert max(r["seconds"] for r in rows) < SETTLE_S - 2, rows
