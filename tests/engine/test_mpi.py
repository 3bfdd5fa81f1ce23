"""``mpirun -np N python -m convbert_ds.train``: ranks discovered through mpi4py (MPICH's mpiexec
from PyPI, installed by requirements.txt beside the interpreter)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import REPO, TINY_CONFIG, check, env, train_metrics

pytestmark = pytest.mark.slow

MPIEXEC = Path(sys.executable).parent / "mpiexec"


def mpi_env() -> dict:
    # Whatever launched pytest (torchrun, a Slurm step) must not decide the ranks here.
    return {k: v for k, v in env().items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_"))}


def mpiexec(*command: str, timeout: int = 300) -> subprocess.CompletedProcess:
    assert MPIEXEC.is_file(), f"{MPIEXEC} missing: pip install mpich (requirements.txt)"
    return subprocess.run([str(MPIEXEC), "-n", "2", *command], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_mpi_discovery_gives_each_rank_its_identity():
    script = ("import json, os; from convbert_ds.engine import distributed; launcher = distributed.discover(); "
              "print(json.dumps({'launcher': launcher, **{k: os.environ[k] for k in "
              "('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}}))")
    output = check(mpiexec(sys.executable, "-c", script, timeout=120))
    ranks = sorted((json.loads(found) for found in re.findall(r"\{[^{}]*\}", output)),  # lines may interleave
                   key=lambda r: r["RANK"])
    assert [(r["launcher"], r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("mpi", "0", "0", "2"), ("mpi", "1", "1", "2")]
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1  # rank 0's, broadcast


def test_mpirun_two_ranks_train_and_checkpoint(tiny_corpus, tmp_path):
    output = check(mpiexec(
        sys.executable, "-m", "convbert_ds.train", "--config", str(TINY_CONFIG),
        f"data.sets=[{{path: '{tiny_corpus['shards']}', weight: 1.0}}]", f"checkpoint.dir={tmp_path / 'checkpoints'}",
        f"log.dir={tmp_path / 'logs'}", "log.interval=1", "train.steps=4", "train.warmup_steps=2", "eval.interval=0",
        "deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32"))
    assert "launcher=mpi world_size=2" in output
    rows = train_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)
    checkpoint = tmp_path / "checkpoints" / "step00000004"
    assert json.loads((checkpoint / "COMPLETE").read_text())["world_size"] == 2
    assert sorted(p.name for p in checkpoint.glob("rng_rank*.pt")) == ["rng_rank00000.pt", "rng_rank00001.pt"]
