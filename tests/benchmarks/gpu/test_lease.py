"""A GPU lease's one command (``bash benchmarks/gpu/lease.sh``) without a GPU: the rows it queues are the ones
meant, in the order meant, and each is a run the trainer's plan takes on a GPU; without CUDA it installs and
measures nothing, says so and exits 0; and with ``LEASE_CPU_SMOKE=1`` the same path runs one tiny row on CPU and
leaves its record and logs under ``$OUT``, as a lent machine hands them back."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import REPO

LEASE = REPO / "benchmarks" / "gpu" / "lease.sh"
PAPER_PATH = "base | 128 x 256 | zero0_autocast_bf16 | bf16, bf16 residual | auto | step"


def _setting(name: str) -> str:
    """The first value the lease script gives ``name`` (``NAME=value`` or ``NAME='value'``)."""
    found = re.search(rf"^{name}='?([^'\n]*?)'?(?:\s+#.*)?$", LEASE.read_text(), re.MULTILINE)
    assert found, f"{name} is not set in {LEASE.name}"
    return found.group(1)


def _lease(out: Path, **env: str) -> subprocess.CompletedProcess:
    if (REPO / ".wheels" / "install-on-gpu.sh").exists():
        pytest.skip("a wheelhouse is here: the lease would install it")
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "OUT": str(out), **env,
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # its python3: this one
    environment.pop("TRITON_INTERPRET", None)  # as a user runs it
    return subprocess.run(["bash", str(LEASE)], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=900)


def test_the_lease_runs_the_queued_rows_and_only_them(tmp_path):
    from benchmarks.gpu.acceptance import GPU, Acceptance, _row_pattern

    acceptance = Acceptance(GPU, tmp_path, budget_s=1)
    rows = _row_pattern(_setting("ROWS"))
    chosen = [acceptance._label(spec) for spec in GPU.runs if rows.search(acceptance._label(spec))]
    assert chosen == [f"{PAPER_PATH}, capture", f"{PAPER_PATH}, tuned matmuls, capture",
                      f"{PAPER_PATH.replace('bf16, bf16', 'fp16, fp16')}, capture"], chosen
    # All three compile at once; a 9-minute lease keeps about a minute for the install and the start-up.
    assert int(_setting("TOGETHER")) == len(chosen) and 400 <= int(_setting("BUDGET_S")) <= 480


def test_the_fp16_row_is_one_the_trainers_plan_takes_on_a_gpu(tiny_corpus, tmp_path):
    """fp16 beside bf16 on the paper path: autocast's dtype fp16 over the fp32 weights, the step captured (the
    plan refuses what the capture cannot replay; the lent machine is no place to find out)."""
    from benchmarks.gpu.acceptance import GPU, Acceptance
    from benchmarks.gpu.pretrain_rows import PretrainRun
    from convbert_ds.engine.plan import resolve
    from convbert_ds.formats.train_config import load_config

    acceptance = Acceptance(GPU, tmp_path, budget_s=1)
    fp16 = [spec for spec in GPU.runs
            if isinstance(spec, PretrainRun) and spec.precision == "fp16" and acceptance._shape(spec) == (128, 256)]
    assert len(fp16) == 1, fp16
    args = acceptance._train_args(fp16[0], tiny_corpus["shards"], tmp_path / "run", steps=10)
    plan = resolve(load_config(args[1], args[2:]), 1, cuda=True)
    assert (plan.precision, plan.cuda_graphs) == ("fp16", "capture"), plan
    assert plan.ds_config["torch_autocast"] == {"enabled": True, "dtype": "fp16"}
    assert not plan.ds_config["fp16"]["enabled"] and not plan.ds_config["bf16"]["enabled"]  # fp32 weights


@pytest.mark.slow
def test_without_a_gpu_the_lease_installs_nothing_measures_nothing_and_says_so(tmp_path):
    runs = sorted((REPO / "benchmarks" / "runs").glob("*"))
    result = _lease(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "deepspeed already imports: nothing to install" in result.stdout, result.stdout
    assert "nothing measured, no record written" in result.stdout, result.stdout
    assert result.stdout.splitlines()[-1].startswith("lease: record not written (nothing measured); logs in "), \
        result.stdout
    assert not list(tmp_path.glob("*.md")) and sorted((REPO / "benchmarks" / "runs").glob("*")) == runs


@pytest.mark.slow
def test_the_lease_on_cpu_leaves_its_record_and_logs_under_out(tmp_path):
    result = _lease(tmp_path, LEASE_CPU_SMOKE="1")
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    record = tmp_path / f"{datetime.date.today().isoformat()}-cpu.md"
    assert result.stdout.splitlines()[-1].startswith(f"lease: record {record}; logs in {tmp_path / 'logs'}"), \
        result.stdout[-3000:]
    text = record.read_text()
    assert "--parts pretrain --budget 450 --rows '^tiny \\| .* \\| fp32 \\| torch \\| off$' --together 3" in text, text
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    # --rows runs only the rows it matches: the fp32 one of the smoke run's two pretraining rows, not the bf16 one.
    assert len(rows) == 1 and rows[0].split("|")[4:7] == [" fp32 ", " torch ", " off "], rows
    assert float(rows[0].split("|")[7].replace(",", "")) > 0, rows
    assert "vocabulary 2,000 (a BPE tokenizer of the built-in corpus)" in text  # the size asked for, and got
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    logs = tmp_path / "logs"
    assert (logs / "record.md").read_text() == text and "the record: " in (logs / "lease.log").read_text()
    assert list(logs.glob("pretrain_tiny_*.log")) and list(logs.glob("*.pt.trace.json.gz"))
