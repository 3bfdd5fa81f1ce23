"""A captured step's cuBLAS kernels paired with the matmuls inductor issues (``benchmarks/matmul_rates.py``).

The matmuls are the tiny step's, recorded on this CPU as the benchmark records them. The traces are written
here in the format torch's profiler writes (graph replays, their kernels, split-K reductions, inductor's
kernels between them), each matmul's kernel timed at a rate the test chooses, for the benchmark to find
again: no GPU trace of the tiny step exists to read.
"""

from __future__ import annotations

import gzip
import json
import random
import sys

import pytest
import torch

from benchmarks import matmul_rates
from convbert_ds.errors import UserError
from launch import REPO, env, run_group

pytestmark = pytest.mark.slow

SEQ, VOCAB = 32, 512
RATES = {"forward": 500.0, "backward": 250.0}  # TFLOP/s the written traces' kernels run at


@pytest.fixture(scope="module")
def recorded():
    """The tiny step's matmuls at batch 2, by graph."""
    matmuls = matmul_rates.recorded_matmuls("tiny", 2, SEQ, VOCAB, {}, {})
    torch._dynamo.reset()
    return matmuls


def _kernel(matmul) -> str:
    """A name that cuBLAS would give one shape's calls (it picks one kernel for one shape and layout)."""
    return f"nvjet_sm90_tst_{matmul.op}_{'x'.join(map(str, matmul.shape))}_TNN"


def write_trace(path, recorded, scale: float = 1.0, steps: int = 2, shuffle_backward: bool = False,
                drop: str | None = None):
    """A trace of ``steps`` captured steps whose matmul kernels take what ``RATES`` gives their FLOPs (times
    ``scale``: the traced batch over the recorded one)."""
    events, correlation, clock = [], 0, 0.0
    for _ in range(steps):
        for graph in matmul_rates.GRAPHS:
            matmuls = list(recorded[graph])
            if shuffle_backward and graph == "backward":
                random.Random(0).shuffle(matmuls)
            if drop == graph:
                matmuls.pop()
            correlation += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": clock, "dur": 5,
                           "args": {"correlation": correlation}})
            for i, matmul in enumerate(matmuls):
                us = scale * matmul.flops / RATES[graph] / 1e6
                parts = [(_kernel(matmul), us)]
                if i % 3 == 0:  # a split-K GEMM: its reduction is a kernel of its own
                    parts = [(_kernel(matmul), 0.75 * us), ("void cublasLt::splitKreduce_kernel<32, 16>", 0.25 * us)]
                parts.append(("triton_poi_fused_add_0", 1.0))  # inductor's: not a matmul
                for name, dur in parts:
                    events.append({"ph": "X", "cat": "kernel", "name": name, "ts": clock, "dur": dur,
                                   "args": {"correlation": correlation}})
                    clock += dur + 1
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)
    return path


def _shape_rows(lines: list[str], graph: str) -> list[list[str]]:
    """The cells of ``graph``'s shape-by-shape table: the indented lines under its title, less its header."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{graph}, shape by shape"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("  "):
            break
        rows.append(line.split())
    return rows


def _totals(lines: list[str]) -> dict[str, float]:
    """Each graph's TFLOP/s, from the report's first table."""
    return {line.split()[0]: float(line.split()[4]) for line in lines[1:4]}


def test_each_graph_and_each_shape_run_at_the_rate_written(recorded, tmp_path):
    trace = write_trace(tmp_path / "step.pt.trace.json.gz", recorded, scale=64 / 2)
    lines = matmul_rates.paired_lines(recorded, matmul_rates.traced_matmul_kernels(trace), 64 / 2, 2)
    totals = _totals(lines)
    flops = {graph: sum(m.flops for m in recorded[graph]) for graph in matmul_rates.GRAPHS}
    both = sum(flops.values()) / sum(flops[graph] / RATES[graph] for graph in flops)
    assert totals == pytest.approx({**RATES, "both": both}, abs=1), lines
    for graph in matmul_rates.GRAPHS:
        rows = _shape_rows(lines, graph)
        shapes = {(m.op, m.shape) for m in recorded[graph]}
        assert len(rows) == len(shapes), lines
        assert {float(row[3]) for row in rows} == {RATES[graph]}, lines  # every shape at its graph's rate
        assert sum(int(row[1]) for row in rows) == len(recorded[graph]), lines


def test_a_graph_run_in_another_order_gives_its_total_only(recorded, tmp_path):
    trace = write_trace(tmp_path / "step.pt.trace.json.gz", recorded, shuffle_backward=True)
    lines = matmul_rates.paired_lines(recorded, matmul_rates.traced_matmul_kernels(trace), 1.0, 2)
    text = "\n".join(lines)
    assert "forward, shape by shape" in text and "backward, shape by shape" not in text, text
    assert "ran in another order than the CPU's: its total only" in text, text
    assert _totals(lines)["backward"] == pytest.approx(250, abs=1), text  # the total holds in any order


def test_a_trace_of_another_step_is_refused(recorded, tmp_path):
    trace = write_trace(tmp_path / "step.pt.trace.json.gz", recorded, drop="backward")
    with pytest.raises(UserError, match=r"backward graph ran \d+ matmul kernels where the step compiled here issues"):
        matmul_rates.paired_lines(recorded, matmul_rates.traced_matmul_kernels(trace), 1.0, 2)
    uncaptured = tmp_path / "eager.pt.trace.json"
    uncaptured.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "nvjet_x", "ts": 0,
                                                       "dur": 1, "args": {"correlation": 1}}]}))
    with pytest.raises(UserError, match="0 CUDA-graph replays.*train.cuda_graphs=capture"):
        matmul_rates.traced_matmul_kernels(uncaptured)
    not_a_trace = tmp_path / "notes.txt"
    not_a_trace.write_text("no trace here")
    with pytest.raises(UserError, match="notes.txt: not a readable profiler trace"):
        matmul_rates.main([str(not_a_trace), "--preset", "tiny"])  # before any compile


def test_the_command_end_to_end_recording_at_another_batch(recorded, tmp_path):
    # The trace is written for batch 64 from the matmuls at batch 2; the command records them at batch 4 and
    # scales to 64. The rates come out as written only if each matmul's FLOPs are proportional to the batch.
    trace = write_trace(tmp_path / "tiny.pt.trace.json.gz", recorded, scale=64 / 2, steps=3)
    command = [sys.executable, str(REPO / "benchmarks" / "matmul_rates.py"), str(trace), "--preset", "tiny",
               "--seq", str(SEQ), "--vocab", str(VOCAB), "--batch", "64", "--record-batch", "4"]
    result = run_group(command, timeout=600, cwd=REPO, env=env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout.splitlines()
    assert out[0].startswith("matmuls of tiny.pt.trace.json.gz") and "batch=64" in out[0], out
    totals = _totals(out[1:])
    assert (totals["forward"], totals["backward"]) == pytest.approx((500, 250), abs=1), out
    rows = _shape_rows(out, "forward")
    assert rows and {float(row[3]) for row in rows} == {500.0}, out  # each forward matmul scaled alike
