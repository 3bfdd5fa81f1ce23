"""``train.compile_autotune``'s levels as inductor options (``step_inductor_options``): every option set is one
torch.compile takes, and ``kernels`` tunes inductor's own kernels without max-autotune's matmul templates
(the minutes of compiling that did not finish in a GPU lease). What the tuning gains is measured on a GPU
(``benchmarks/gpu_acceptance.py``, the pretraining part's second row); on CPU it changes nothing."""

import pytest
import torch

from convbert_ds.config import ConfigError
from convbert_ds.formats.train_config import load_config
from convbert_ds.model.layers import step_inductor_options
from launch import REPO

LEVELS = (False, "kernels", True)


@pytest.mark.parametrize("autotune", LEVELS)
def test_each_level_is_options_that_torch_compile_takes(autotune):
    options = step_inductor_options(cuda_graphs=False, layers_once=True, autotune=autotune, eager_random=True)
    torch._dynamo.reset()
    double = torch.compile(lambda x: 2 * x, fullgraph=True, dynamic=False, options=options)
    assert torch.equal(double(torch.arange(4.0)), torch.arange(0.0, 8.0, 2.0))  # an unknown option would raise


def test_kernels_tunes_inductors_kernels_and_leaves_the_matmuls_to_cublas():
    off, kernels, full = (step_inductor_options(False, False, level, True) for level in LEVELS)
    assert not any(off.get(name) for name in ("max_autotune", "max_autotune_pointwise", "coordinate_descent_tuning"))
    assert kernels["max_autotune_pointwise"] and kernels["coordinate_descent_tuning"]
    assert "max_autotune" not in kernels
    assert full["max_autotune"] and full["coordinate_descent_tuning"]


def test_the_config_takes_each_level_by_its_yaml_spelling_and_names_the_choices_otherwise():
    config = REPO / "configs" / "tiny_cpu.yaml"
    spelled = {"false": False, "kernels": "kernels", "true": True}
    for text, level in spelled.items():
        value = load_config(config, [f"train.compile_autotune={text}"]).train.compile_autotune
        assert value == level and type(value) is type(level), (text, value)
    for bad in ("1", "kernel"):  # YAML's 1 is an int, not true
        with pytest.raises(ConfigError, match=r"train.compile_autotune=.*use one of \[False, 'kernels', True\]"):
            load_config(config, [f"train.compile_autotune={bad}"])
