"""The compiled step with the GPU's kernels run by Triton's interpreter (``benchmarks/interpreted_step.py``): as
the configs compile it and with combo kernels, every gradient is eager's; and a kernel that computes wrong is
caught, so the gradients compared are those of the interpreted kernels. About a minute a step on 2 cores."""

from __future__ import annotations

import pytest

from benchmarks import interpreted_step
from convbert_ds.errors import UserError

pytestmark = pytest.mark.slow


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


def test_a_kernel_that_computes_wrong_is_caught(monkeypatch):
    # The GELU's erf off by 1% in inductor's kernels alone: eager computes its own.
    right = interpreted_step._libdevice_interpreted

    def erf_off():
        given = right()
        exact = given["erf"]
        return {**given, "erf": lambda x: exact(x) * 1.01}

    monkeypatch.setattr(interpreted_step, "_libdevice_interpreted", erf_off)
    check = interpreted_step.check_step({})
    assert check.worst[0][0] > 1e-3, check.worst
    assert ".intermediate." in check.worst[0][1] or ".output." in check.worst[0][1], check.worst  # the FFN's


def test_without_the_interpreter_it_says_how_to_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="TRITON_INTERPRET=1 python benchmarks/interpreted_step.py"):
        with interpreted_step.gpu_kernels_interpreted():
            pass
