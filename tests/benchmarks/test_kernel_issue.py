"""The instructions inductor's kernels issue on a GPU, counted from their sm_90 machine code on a CPU
(``benchmarks/kernel_issue.py``): an exact GELU issues several times what a scaling does per element, and a
looped reduction's count follows its trips. In a subprocess without TRITON_INTERPRET: the interpreter, set
for this process by conftest, makes Triton's own library uncompilable for a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.kernel_issue import refuse_interpreter
from convbert_ds.errors import UserError
from launch import REPO

SCRIPT = r"""
import json
import torch
from benchmarks.inductor_count import gpu_kernels_on_cpu
from benchmarks.kernel_issue import (instructions_per_thread, issue_ms, kernel_sass, launches_recorded,
                                     warp_instructions)

def counted(fn, *inputs):
    with gpu_kernels_on_cpu(), launches_recorded() as launches:
        torch.compile(fn, dynamic=False)(*inputs)  # one static kernel per shape, as in the step
    return launches

x = torch.zeros(4096, 1024, dtype=torch.bfloat16)
gelu, = counted(torch.nn.functional.gelu, x)
scaled, = counted(lambda t: t * 2, x)
figures = {"gelu": warp_instructions(gelu) * 32 / x.numel(), "scaled": warp_instructions(scaled) * 32 / x.numel()}
figures["names"] = [gelu.name, scaled.name]
figures["fused names"] = [gelu.fused_name, scaled.fused_name]  # how the plan joins launches to its kernels
for rows in (8192, 16384):
    figures[f"column sums {rows}"] = sum(map(warp_instructions, counted(lambda t: t.sum(0), torch.zeros(rows, 64))))
looped, = counted(lambda t: t.sum(-1), torch.zeros(64, 65536))  # 32 trips of 2,048: too many to unroll
sass = kernel_sass(looped.kernel, looped.kernel.configs[0])
figures["trips"] = [instructions_per_thread(sass, trips) for trips in (1, 2, 5)]
config = looped.kernel.configs[0]
figures["row sums"] = [warp_instructions(looped), config.num_warps, config.kwargs, dict(looped.sizes)]
figures["issue_ms"] = issue_ms(132 * 4 * 1.98e6)
print(json.dumps(figures))
"""


def test_instructions_counted_from_the_machine_code():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert "gelu" in figures["names"][0] and figures["names"][0].startswith("triton_poi_"), figures
    assert figures["fused names"] == ["fused_gelu", "fused_mul"], figures
    # erf in fp32 is a few dozen instructions an element; a scaling, loads, a multiply and stores.
    assert figures["gelu"] > 3 * figures["scaled"] > 0, figures
    assert 20 < figures["gelu"] < 80, figures
    # A reduction's loop issues its body once per trip: twice the rows, about twice the instructions.
    assert 1.5 < figures["column sums 16384"] / figures["column sums 8192"] < 2.5, figures
    one, two, five = figures["trips"]  # a loop the compiler kept: its body counted once a trip
    assert two > one and five - one == 4 * (two - one), figures
    issued, warps, blocks, sizes = figures["row sums"]
    assert sizes == {"xnumel": 64, "r0_numel": 65536} and blocks == {"XBLOCK": 1, "R0_BLOCK": 2048}, figures
    # 64 programs of one row, 32 trips each; another configuration of the kernel may issue fewer.
    assert 0 < issued <= 64 * warps * (one + 31 * (two - one)), figures
    assert abs(figures["issue_ms"] - 1.0) < 1e-9, figures  # an H200's issue of a millisecond's instructions


def test_the_plan_gives_each_part_its_issue_time_and_floor(capsys):
    from benchmarks.kernel_issue import H200_PEAK_TBPS, issue_ms
    from benchmarks.kernel_plan import print_plan, split_per_sample

    # Per sample: a GELU kernel moving 1 MB and issuing 1e6 warp instructions, a LayerNorm moving 2 MB and
    # issuing 1e3; a matmul beside them. Two batch sizes, as the plan compiles them.
    plans = {batch: [("GELU and its backward", "fused_gelu", 1.0 * batch, 1e6 * batch),
                     ("LayerNorm, dropout, residual adds", "fused_add_native_layer_norm", 2.0 * batch, 1e3 * batch),
                     ("extern", "aten.mm.out", 3.0 * batch, 0.0)] for batch in (2, 4)}
    split = split_per_sample(plans)
    assert split[("GELU and its backward", "fused_gelu")] == (1, 1.0, 0.0, 1e6, 0.0)
    print_plan(split, at=100, bandwidth=2.0, top=5)
    out = capsys.readouterr().out
    gelu = next(line for line in out.splitlines() if line.strip().startswith("GELU and its backward"))
    cells = [float(cell.replace(",", "")) for cell in gelu[2 + 44:].split()]
    assert cells[:5] == [1, 1.0, 0.0, 0.1, 0.05], gelu  # 100 MB at 2 TB/s
    issue = issue_ms(1e8)
    assert abs(cells[5] - round(issue, 2)) < 1e-9 and abs(cells[6] - round(max(0.1 / H200_PEAK_TBPS, issue), 2)) < 1e-9
    norm = next(line for line in out.splitlines() if line.strip().startswith("LayerNorm"))
    assert float(norm.split()[-1]) == round(0.2 / H200_PEAK_TBPS, 2), norm  # bound by its bytes
    assert "floor ms" in out and "aten.mm.out" in out, out


def test_the_scripts_that_compile_for_a_gpu_refuse_the_interpreter_and_name_their_command(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UserError, match=r"env -u TRITON_INTERPRET python benchmarks/random_issue.py"):
        refuse_interpreter("benchmarks/random_issue.py")
    for script in ("random_issue", "kernel_registers"):
        with pytest.raises(UserError, match=f"benchmarks/{script}.py"):
            __import__(f"benchmarks.{script}", fromlist=["main"]).main([])
    monkeypatch.delenv("TRITON_INTERPRET")
    refuse_interpreter("benchmarks/random_issue.py")  # without it: nothing to refuse
