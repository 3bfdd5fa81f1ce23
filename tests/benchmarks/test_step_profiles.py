"""``benchmarks/document_conv.py`` and ``benchmarks/compile_time.py`` end to end on CPU, at toy sizes: the
variants each report, side by side, with their ratio."""

from __future__ import annotations

import re
import sys

import pytest

from launch import REPO, env, run_group


def run(script: str, *args: str) -> list[str]:
    result = run_group([sys.executable, str(REPO / "benchmarks" / script), *args], timeout=400, cwd=REPO, env=env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout.splitlines()


@pytest.mark.slow
def test_document_conv_times_the_cpu_variants_against_the_einsum():
    # The Triton kernels are timed on a GPU only; their numbers are tests/kernels/test_document_conv.py's.
    lines = run("document_conv.py", "--batch", "2", "--seq", "32", "--channels", "16", "--reps", "2",
                "--threads", "1")
    agree = next(line for line in lines if line.startswith("the packed variants against the einsum"))
    differences = re.fullmatch(r".*: torch, fp32 pad kept \(before\) (\S+), shifted multiply-adds \(torch\) (\S+)",
                               agree)
    assert differences and all(float(d) < 1e-5 for d in differences.groups()), agree  # fp32: another order of sums
    header = lines.index(next(line for line in lines if line.startswith("variant")))
    ab = lines.index(next(line for line in lines if line.startswith("torch path / its form before: ")))
    rows = {line[:34].strip(): line[34:].split() for line in lines[header + 1:ab]}
    assert list(rows) == ["conv1d, one document (no mask)", "unfold + einsum (before)", "torch, fp32 pad kept (before)",
                          "shifted multiply-adds (torch)"]
    ratio = float(lines[ab].split(": ")[1].split()[0])
    assert abs(ratio - float(rows["shifted multiply-adds (torch)"][0]) / float(rows["torch, fp32 pad kept (before)"][0])) \
        <= 0.002 + 0.01 * ratio, lines[ab]
    assert rows["unfold + einsum (before)"][1] == "1.00"
    assert all(float(ms) > 0 and float(ratio) > 0 for ms, ratio, _ in rows.values()), rows
    least_bytes = 5 * 2 * 32 * 16 * 4  # x and out forward; the gradient, x and dx backward; fp32
    for ms, _, rate in rows.values():  # GB/s at the fewest bytes (toy sizes: hundredths of a GB/s here)
        assert abs(float(rate) - least_bytes / float(ms) / 1e6) <= 0.005 + 0.01 * float(rate), rows


def test_document_conv_refuses_an_even_kernel():
    result = run_group([sys.executable, str(REPO / "benchmarks" / "document_conv.py"), "--kernel", "8"],
                       timeout=120, cwd=REPO, env=env())
    assert result.returncode == 2 and "--kernel 8: the conv needs an odd kernel size" in result.stderr


@pytest.mark.slow
def test_compile_time_compiles_the_step_unrolled_and_from_the_cache_file():
    # One layer per body, the least there is to compile: the script's machinery. Without "once" (layers once,
    # whose regions tests/model/test_compile_layers_once.py checks: one library a kernel, the slowest variant
    # to build here). The second process starts with empty inductor caches, as a restart on another node, and
    # loads the file the first wrote (train.compile_cache): both of the step's graphs come from it, and give
    # the same bits.
    lines = run("compile_time.py", "--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "32", "--vocab",
                "1000", "--threads", "1", "--variants", "cached")
    assert lines[0].startswith("device=cpu preset=tiny layers=1 batch=2 seq=32") and "caches=empty" in lines[0]
    losses = next(line for line in lines if line.startswith("the first step's losses"))
    first_losses = [float(value) for value in losses.split(": ")[1].split(" (")[0].split(", ")]
    assert len(first_losses) == 2 and first_losses[1] == first_losses[0], losses  # the kernels from the file
    header = lines.index(next(line for line in lines if line.startswith("variant")))
    rows = {line[:42].strip(): [float(value) for value in line[42:].split()] for line in lines[header + 1:]}
    unrolled, cached = "unrolled (every layer in the graph)", "unrolled, the compile cache file loaded"
    assert list(rows) == [unrolled, cached], lines
    for forward, backward, first, ratio, next_ms, _ in rows.values():
        assert forward > 0 and backward > 0 and next_ms > 0
        assert abs(first - (forward + backward)) <= 0.11, rows  # one decimal each
    assert rows[unrolled][3] == 1.0
    assert abs(rows[cached][3] - rows[cached][2] / rows[unrolled][2]) <= 0.01 + 0.01 * rows[cached][3], rows
    assert rows[unrolled][5] == 0 and rows[cached][5] == 2, rows  # the step's forward and backward, from the file


def test_compile_time_refuses_an_unknown_variant():
    result = run_group([sys.executable, str(REPO / "benchmarks" / "compile_time.py"), "--variants", "cached,fast"],
                       timeout=120, cwd=REPO, env=env())
    assert result.returncode == 2 and "unknown variant(s) fast; choose from unrolled, once, cached" in result.stderr
