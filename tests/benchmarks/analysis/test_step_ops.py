"""``benchmarks/analysis/step_ops.py`` end to end on CPU, at its toy defaults: an eager step's ops, one-document
samples against packed ones, side by side."""

from __future__ import annotations

import sys

import pytest

from launch import REPO, env, run_group


@pytest.mark.slow
def test_step_ops_profiles_one_document_and_packed_samples():
    result = run_group([sys.executable, str(REPO / "benchmarks" / "analysis" / "step_ops.py"), "--top", "3"],
                       timeout=400, cwd=REPO, env=env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    times = [line for line in lines if "ms/step of host time" in line]
    assert [line.split(":")[0] for line in times] == ["one document per sample", "packed"], lines
    assert all(float(line.split()[-5]) > 0 for line in times), times
    assert any("Input Shapes" in line for line in lines)  # the table grouped by shape
    assert lines[-1].startswith("packed / one document: ")
