"""The layer benchmarks compiled (``compare`` in ``benchmarks/common.py``), end to end at the tiny preset:
inductor's own count of each variant's kernels and bytes comes back, from a fresh compile (its on-disk caches
would bring back the byte total but not the kernels)."""

from __future__ import annotations

import sys

import pytest

from launch import REPO, env, run_group

pytestmark = pytest.mark.slow


def _rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer") and "MB fused" in line)
    rows = [line.rsplit(maxsplit=5) for line in lines[header + 1:header + 3]]  # name, then 5 figures
    return {row[0]: row[1:] for row in rows}


def test_the_bf16_residual_stream_compiles_to_fewer_bytes(tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "residual_dtype.py"), "--preset", "tiny", "--batch", "2",
               "--seq", "32", "--reps", "1", "--threads", "1", "--compile"]
    result = run_group(command, timeout=300, cwd=REPO, env={**env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = _rows(result.stdout)
    (_, fp32), (_, bf16) = rows.items()
    # (fp32's, bf16's) of each column after the time
    ops, kernels, moved, fused = ((float(a.replace(",", "")), float(b.replace(",", "")))
                                  for a, b in zip(fp32[1:], bf16[1:]))
    for figures in (ops, kernels, moved, fused):
        assert figures[0] > 0 and figures[1] > 0, rows
    assert 0 < fused[0] < moved[0] and 0 < fused[1] < moved[1], rows  # the matmuls' bytes are in "moved" only
    assert fused[1] < fused[0] and moved[1] < moved[0], rows  # what the bf16 stream is for
    assert ops[1] <= ops[0] and kernels[1] <= kernels[0], rows
