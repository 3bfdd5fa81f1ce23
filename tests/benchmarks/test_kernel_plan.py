"""The GPU's kernels planned on a CPU (``benchmarks/kernel_plan.py``, ``inductor_count.gpu_kernels_on_cpu``):
inductor's Triton kernels are built and counted, never run, and torch is as it was afterwards; the plan of
the tiny step at two batch sizes, end to end."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from benchmarks.inductor_count import compiled_counts, gpu_kernels_on_cpu
from convbert_ds.config import ConfigError
from launch import REPO, env, run_group


def test_kernels_are_built_for_a_gpu_and_not_run():
    def scaled_sum(x):
        return (x * 3).sum(0)

    compiled = torch.compile(scaled_sum)
    x = torch.ones(4, 8, requires_grad=True)
    allocator = torch._C._dynamo.guards._empty_strided_cpu
    with gpu_kernels_on_cpu():
        import torch._inductor.config as inductor_config

        assert inductor_config.cpu_backend == "triton"
        counts = compiled_counts("scaled_sum", lambda: compiled(x).sum().backward())
        out = compiled(x)
    assert counts["kernels"] >= 2 and counts["fused_mb"] > 0, counts  # forward and backward each launch one
    assert torch.equal(out, torch.zeros(8)), out  # what the kernels would have computed, they did not
    assert torch._C._dynamo.guards._empty_strided_cpu is allocator
    assert inductor_config.cpu_backend != "triton"


def test_independent_kernels_join_into_combo_kernels_as_on_a_gpu():
    # Inductor never joins CPU kernels into combo kernels; the plan of a GPU's step must (the H200's step
    # went from 2,663 kernels to 1,958 with them). Three independent pointwise results: three kernels, or one.
    def three(x, y, z):
        return x.sin(), y.cos() * 2, z.exp() + 1

    inputs = [torch.ones(64, 128) for _ in range(3)]
    kernels = {}
    for combo in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(three, options={"combo_kernels": combo})
        with gpu_kernels_on_cpu():
            kernels[combo] = compiled_counts(f"combo_kernels={combo}", lambda: compiled(*inputs))["kernels"]
    torch._dynamo.reset()
    assert kernels == {False: 3, True: 1}, kernels


def test_a_wrong_inductor_option_stops_it_before_any_compile():
    from benchmarks import kernel_plan

    with pytest.raises(ConfigError, match="no option 'combo_kernel'; did you mean combo_kernels"):
        kernel_plan.main(["--preset", "tiny", "--option", "combo_kernel=true"])


def _figures(stdout: str, label: str) -> list[float]:
    line = next(line for line in stdout.splitlines() if line.strip().startswith(label))
    return [float(cell.replace(",", "")) for cell in line[len("  ") + 44:].split()]


@pytest.mark.slow
def test_the_tiny_step_planned_at_two_batches():
    command = [sys.executable, str(REPO / "benchmarks" / "kernel_plan.py"), "--preset", "tiny", "--seq", "32",
               "--batches", "2", "4", "--at", "64", "--top", "5", "--option", "max_fusion_size=64"]
    result = run_group(command, timeout=600, cwd=REPO, env=env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    assert "inductor max_fusion_size=64" in out.splitlines()[0], out  # checked, and in the header
    counts = [int(n.replace(",", "")) for n in re.findall(r"^batch \d+: ([\d,]+) fused kernels", out, re.M)]
    assert len(counts) == 2 and counts[0] == counts[1] > 0, out  # one static step: the same kernels at any batch
    table = out.split("by part of the layer")[1].split("ops inductor does not fuse")[0]
    parts = [line for line in table.splitlines()[2:] if line.strip() and "all of inductor's" not in line]
    kernels, per_sample, per_step, at_64, ms = _figures(out, "all of inductor's fused kernels")
    assert kernels == counts[0] and per_sample > 0 and per_step > 0, out
    assert abs(sum(_figures(line, line.strip()[:20])[0] for line in parts) - kernels) < 0.5, table
    assert abs(per_sample * 64 + per_step - at_64 * 1e3) < 6.0, out  # MB; the cells are rounded
    assert abs(at_64 / 2.80 - ms) < 0.011, out  # the default bandwidth, an H200's
    # As on a GPU, the SDConv is its Triton ops and attention one op, outside inductor's kernels.
    for op in ("convbert_ds.sdconv_forward", "convbert_ds.sdconv_backward", "convbert_ds.attention_stand_in.",
               "convbert_ds.attention_stand_in_backward", "aten.mm"):
        assert op in out.split("ops inductor does not fuse")[1], out
