"""The compiled step with the GPU's kernels run by Triton's interpreter (``benchmarks/analysis/interpreted_step.py``):
without inductor options and with combo kernels (as the paper configs compile it), every gradient is eager's;
and what runs is inductor's kernel, in the interpreter (a wrong erf there shows). About a minute a compiled step
on 2 cores."""

from __future__ import annotations

import pytest
import torch

from benchmarks.analysis import interpreted_step
from convbert_ds.errors import UserError


@pytest.mark.slow
def test_the_gpus_kernels_with_and_without_combo_kernels_give_the_eager_gradients():
    plain = interpreted_step.check_step({})
    combo = interpreted_step.check_step({"combo_kernels": True})
    for check in (plain, combo):
        # Measured: 5e-7 at most, the loss equal to the last digit printed (fp32).
        assert check.worst[0][0] < 1e-5, check.worst
        assert abs(check.compiled_loss - check.eager_loss) <= 1e-6 * abs(check.eager_loss), check
        assert check.compared > 50, check  # every parameter but the keys' biases
    # Measured: 127 launches, and 80 with combo kernels: they were formed, and it was they that ran.
    assert 0 < combo.launches < plain.launches, (plain.launches, combo.launches)


@pytest.mark.slow
def test_tuned_matmuls_take_the_ffns_gelu_and_its_backward_into_their_epilogues():
    # train.compile_autotune=matmuls (the GPU acceptance's "tuned matmuls" row) is there for the GELUs: on the
    # H200 they and their backwards are 6.8 ms of the step, in kernels of their own that read and write the
    # 3,072-wide activation. Where its templates win, that work goes into the matmuls: here they are chosen.
    plain, matmuls = interpreted_step.check_ffn(False), interpreted_step.check_ffn("matmuls")
    for check in (plain, matmuls):
        assert check.worst < 1e-5, check  # measured: 2.3e-7 and 3.0e-7
        gelus = [name for name in check.kernels if "gelu" in name]
        assert len(gelus) == 2 and "gelu_backward" in gelus[1], check  # the forward's, then the backward's
    assert not any("_tem_" in name for name in plain.kernels), plain  # cuBLAS's matmuls: not Triton's
    assert all(name.startswith("triton_poi_") for name in plain.kernels if "gelu" in name), plain
    assert all(name.startswith("triton_tem_") and "mm" in name for name in matmuls.kernels if "gelu" in name), matmuls


def test_the_ffn_check_refuses_what_it_would_ignore():
    with pytest.raises(UserError, match="--ffn checks the feed-forward block alone, in fp32: drop --layers and --bf16"):
        interpreted_step.main(["--ffn", "--bf16"])


@pytest.mark.parametrize("erf_scale", [1.0, 1.01])
def test_what_runs_is_inductors_kernel_in_the_interpreter(monkeypatch, erf_scale):
    # The erf of inductor's GELU kernel made 1% off where the interpreter takes it from: the compiled GELU is
    # off, so what ran is that kernel, in the interpreter (eager's GELU is torch's own, and stays right).
    right = interpreted_step._libdevice_interpreted

    def with_erf_scaled():
        given = right()
        exact = given["erf"]
        return {**given, "erf": lambda x: exact(x) * erf_scale}

    monkeypatch.setattr(interpreted_step, "_libdevice_interpreted", with_erf_scaled)
    x = torch.linspace(-3, 3, 256)
    torch._dynamo.reset()
    with interpreted_step.gpu_kernels_interpreted():
        compiled = torch.compile(torch.nn.functional.gelu)(x)
    torch._dynamo.reset()
    error = (compiled - torch.nn.functional.gelu(x)).abs().max().item()
    assert (error < 1e-6) if erf_scale == 1.0 else (error > 1e-3), error


def test_without_the_interpreter_it_says_how_to_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="TRITON_INTERPRET=1 python benchmarks/analysis/interpreted_step.py"):
        with interpreted_step.gpu_kernels_interpreted():
            pass
