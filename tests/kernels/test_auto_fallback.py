"""``sdconv_impl="auto"`` falls back to the torch path, with one warning line, where the Triton kernels fail.

``auto`` only tries Triton on CUDA; without one, these tests force it to try on CPU (``resolve_impl``
patched), where the kernels really fail: without ``TRITON_INTERPRET`` they cannot launch at all, and a
kernel size they do not take is refused on any device. The numbers must then be the reference's.
"""

import os
import subprocess
import sys

import torch

from convbert_ds.model import sdconv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels run in Triton's interpreter


def _inputs(kernel_size: int, head_dim: int = 16):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, 12, 3, kernel_size, generator=gen).to(DEVICE),
            torch.randn(2, 12, 3, head_dim, generator=gen).to(DEVICE))


def _prefer_triton(monkeypatch):
    monkeypatch.setattr(sdconv, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(sdconv, "_TRITON_PROBED", {})


def test_a_kernel_the_kernels_refuse_falls_back_once_with_the_reason(monkeypatch, capsys):
    _prefer_triton(monkeypatch)
    logits, values = _inputs(kernel_size=33)  # Triton's kernels take K <= 31
    for _ in range(3):
        out = sdconv.dynamic_conv(logits, values, impl="auto")
        assert torch.equal(out, sdconv.dynamic_conv_reference(logits, values))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings  # once per device, dtype and layout, not once per call
    assert "sdconv_impl=auto" in warnings[0] and "K=33" in warnings[0]
    assert "ValueError: triton_dynamic_conv supports K <= 31" in warnings[0]
    assert warnings[0].endswith("using the torch implementation")


def test_kernels_that_work_are_used_without_a_warning(monkeypatch, capsys):
    _prefer_triton(monkeypatch)  # on CPU they run in Triton's interpreter (set by the root conftest)
    logits, values = _inputs(kernel_size=9)
    assert sdconv.triton_unusable_reason(values.device, logits.dtype, values.dtype, 9, 16) is None
    out = sdconv.dynamic_conv(logits, values, impl="auto")
    torch.testing.assert_close(out, sdconv.dynamic_conv_reference(logits, values), rtol=1e-4, atol=1e-4)
    assert "warning" not in capsys.readouterr().err


def test_kernels_that_cannot_launch_fall_back_and_triton_by_name_still_fails():
    # A fresh process without the interpreter: Triton's kernels cannot launch on this CPU-only machine,
    # which stands in for a GPU that Triton or its driver does not support.
    script = """
import torch
from convbert_ds.model import sdconv
sdconv.resolve_impl = lambda impl, device: "triton"
logits, values = torch.randn(2, 12, 3, 9), torch.randn(2, 12, 3, 16, requires_grad=True)
out = sdconv.dynamic_conv(logits, values, impl="auto")
out.sum().backward()
assert torch.equal(out, sdconv.dynamic_conv_reference(logits, values)), "not the reference's numbers"
try:
    sdconv.dynamic_conv(logits, values, impl="triton")
except RuntimeError as error:
    print("by name:", error)
"""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert "cannot run on cpu" in warnings[0] and "RuntimeError" in warnings[0] and "need a GPU" in warnings[0]
    assert "by name: triton_dynamic_conv got CPU tensors" in result.stdout


def test_a_probe_inside_a_compiled_function_runs_eagerly():
    """``sdconv.eager_only`` (the probes' decorator, torch's lazy disable): a compiled caller breaks its graph
    there and the probe runs as Python, never traced (it runs kernels and prints)."""
    seen = []

    @sdconv.eager_only
    def probe(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    compiled = torch.compile(lambda x: probe(x) * 2, backend="eager")
    assert compiled(torch.ones(2)).tolist() == [4.0, 4.0] and seen == [False]
