"""``train.compile_autotune``'s levels as inductor options (``step_inductor_options``): every option set is one
torch.compile takes; ``kernels`` tunes inductor's own kernels without max-autotune's matmul templates (the
minutes of compiling that did not finish in a GPU lease), and ``matmuls`` the templates without that tuning.
What each gains is measured on a GPU (``benchmarks/gpu/acceptance.py``, the pretraining rows ``tuned kernels``,
``tuned matmuls`` and ``autotune``); on CPU they change nothing.

``train.compile_options``: the rest of inductor's options, checked against the installed torch when the run
is planned, and handed to both compile modes."""

import typing

import pytest
import torch
from torch import nn

from convbert_ds.config import ConfigError, preset
from convbert_ds.engine.compile_options import OPTIONS_OWNED, inductor_options
from convbert_ds.formats.train_config import TrainSection, load_config, option_text
from convbert_ds.model.layers import (AutotuneLevel, ConvBertLayer, compile_layers, compile_step, cpu_wrapper,
                                     step_inductor_options)
from launch import REPO

LEVELS = typing.get_args(AutotuneLevel)


def test_the_model_takes_the_levels_the_config_declares():
    assert LEVELS == typing.get_args(typing.get_type_hints(TrainSection)["compile_autotune"]) == \
        (False, "kernels", "matmuls", True)


@pytest.mark.parametrize("autotune", LEVELS)
def test_each_level_is_options_that_torch_compile_takes(autotune):
    options = step_inductor_options(cuda_graphs=False, layers_once=True, autotune=autotune, eager_random=True)
    torch._dynamo.reset()
    double = torch.compile(lambda x: 2 * x, fullgraph=True, dynamic=False, options=options)
    assert torch.equal(double(torch.arange(4.0)), torch.arange(0.0, 8.0, 2.0))  # an unknown option would raise


def test_kernels_tunes_inductors_kernels_and_matmuls_the_matmul_templates_alone():
    off, kernels, matmuls, full = (step_inductor_options(False, False, level, True) for level in LEVELS)
    tuning = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "coordinate_descent_tuning")
    assert not any(off.get(name) for name in tuning)
    assert {name for name in tuning if kernels.get(name)} == {"max_autotune_pointwise", "coordinate_descent_tuning"}
    assert {name for name in tuning if matmuls.get(name)} == {"max_autotune_gemm"}
    assert full["max_autotune"] and full["coordinate_descent_tuning"]


def test_the_config_takes_each_level_by_its_yaml_spelling_and_names_the_choices_otherwise():
    config = REPO / "configs" / "tiny_cpu.yaml"
    spelled = {"false": False, "kernels": "kernels", "matmuls": "matmuls", "true": True}
    for text, level in spelled.items():
        value = load_config(config, [f"train.compile_autotune={text}"]).train.compile_autotune
        assert value == level and type(value) is type(level), (text, value)
    for bad in ("1", "kernel"):  # YAML's 1 is an int, not true
        with pytest.raises(ConfigError,
                           match=r"train.compile_autotune=.*use one of \[False, 'kernels', 'matmuls', True\]"):
            load_config(config, [f"train.compile_autotune={bad}"])


# train.compile_options: more of inductor's options, checked by the plan (engine/compile_options.py) ------------

def _options(*overrides, mode="step"):
    return inductor_options(load_config(REPO / "configs" / "tiny_cpu.yaml",
                                        [f"train.compile_mode={mode}", *overrides]))


def test_options_are_taken_by_inductors_names_dotted_or_nested_and_torch_compile_takes_them():
    assert _options() == {}
    assert _options("train.compile_options.combo_kernels=true") == {"combo_kernels": True}
    assert _options("train.compile_options.triton.multi_kernel=1") == {"triton.multi_kernel": 1}
    options = _options("train.compile_options={'triton.multi_kernel': 1, cpp: {simdlen: 8}, max_fusion_size: 8, "
                       "min_overlap_ratio: 1, realize_opcount_threshold: 30, combo_kernels: true}")
    assert options == {"triton.multi_kernel": 1, "cpp.simdlen": 8, "max_fusion_size": 8, "min_overlap_ratio": 1.0,
                       "realize_opcount_threshold": 30, "combo_kernels": True}
    assert type(options["min_overlap_ratio"]) is float  # YAML's 1 for a float option: torch.compile wants a float
    torch._dynamo.reset()
    double = torch.compile(lambda x: 2 * x, fullgraph=True, dynamic=False, options=options)
    assert torch.equal(double(torch.arange(4.0)), torch.arange(0.0, 8.0, 2.0))  # a wrong type would raise


def test_a_dotted_override_replaces_what_the_file_nests(tmp_path):
    """As the README says: nested in the file, an option is replaced by the dotted override, its siblings kept."""
    config = tmp_path / "run.yaml"
    config.write_text("train: {compile_mode: step, compile_options: {triton: {multi_kernel: 1, max_tiles: 2}}}\n")
    cfg = load_config(config, ["train.compile_options.triton.multi_kernel=2"])
    assert inductor_options(cfg) == {"triton.multi_kernel": 2, "triton.max_tiles": 2}


def test_the_options_other_keys_set_are_refused_by_compile_mode():
    """In the step mode, what ``compile_step`` sets with every key on; in the layers mode, only what
    ``compile_layers`` sets (and the CUDA graphs, train.cuda_graphs's): max-autotune is then the user's."""
    set_by_a_level = {name for level in LEVELS
                      for name in step_inductor_options(cuda_graphs=True, layers_once=True, autotune=level,
                                                        eager_random=True)}
    assert set(OPTIONS_OWNED["step"]) == set_by_a_level
    assert _options("train.compile_options.max_autotune=true", mode="layers") == {"max_autotune": True}
    with pytest.raises(ConfigError, match=r"fallback_random=True: train.compile_random decides this option "
                                          r"\(train.compile_mode=layers\); use that key"):
        _options("train.compile_options.fallback_random=true", mode="layers")
    with pytest.raises(ConfigError, match=r"triton.cudagraphs=True: train.cuda_graphs decides this option"):
        _options("train.compile_options.triton.cudagraphs=true", mode="layers")


def test_the_cpu_wrapper_is_the_users_to_turn_off_but_not_on_with_layers_compiled_once():
    """Without a GPU the compile modes ask for inductor's C++ wrapper (``cpu_wrapper``), which cannot call a
    region compiled once: there, the Python wrapper."""
    assert cpu_wrapper() == ({} if torch.cuda.is_available() else {"cpp_wrapper": True})
    assert cpu_wrapper(layers_once=True) == {}
    assert _options("train.compile_options.cpp_wrapper=false") == {"cpp_wrapper": False}
    with pytest.raises(ConfigError, match=r"^train.compile_options.cpp_wrapper=True: torch's C\+\+ wrapper cannot "
                                          r"call the layers compiled once \(train.compile_layers_once=true\)"):
        _options("train.compile_options.cpp_wrapper=true", "train.compile_layers_once=true")


@pytest.mark.parametrize("override, message", [
    ("combo_kernel=true", r"combo_kernel=True: torch .*'s inductor has no option 'combo_kernel'; did you mean "
                          r"combo_kernels\b"),
    ("no_such_thing=1", r"no_such_thing=1: torch .* no option 'no_such_thing'; "
                        r"torch._inductor.list_options\(\) lists them"),
    ("_raise_error_for_testing=true", r"_raise_error_for_testing=True: torch .* no option"),  # private
    ("combo_kernels=1", r"combo_kernels=1: this option takes bool; 1 is not one$"),
    ("max_fusion_size=true", r"max_fusion_size=True: this option takes int; True is not one$"),
    ("triton.multi_kernel=5", r"triton.multi_kernel=5: this option takes Literal\[0, 1, 2, 3\]; 5 is not one$"),
    ("realize_opcount_threshold=high", r"realize_opcount_threshold='high': this option takes int \| None; 'high' "),
    ("multi_kernel_hints=[8, x]", r"multi_kernel_hints=\[8, 'x'\]: this option takes int; 'x' is not one$"),
    ("cpp.cxx=[null]", r"cpp.cxx=\[None\]: this option takes 2 items; \(None,\) has 1$"),
    ("post_grad_custom_pre_pass=my_pass", r"post_grad_custom_pre_pass='my_pass': this option takes .*Callable.*; "
                                          r"'my_pass' is not one \(a callable cannot come from a config file\)$"),
    ("fallback_random=false", r"fallback_random=False: train.compile_random decides this option "
                              r"\(train.compile_mode=step\); use that key"),
    ("triton={cudagraphs: true}", r"triton.cudagraphs=True: train.cuda_graphs decides this option"),
    ("max_autotune=true", r"max_autotune=True: train.compile_autotune decides this option"),
    ("max_autotune_gemm=true", r"max_autotune_gemm=True: train.compile_autotune decides this option"),
    ("allow_buffer_reuse=true", r"allow_buffer_reuse=True: train.compile_layers_once decides this option"),
    ("{triton: {multi_kernel: 1}, 'triton.multi_kernel': 2}", r"triton.multi_kernel=2: triton.multi_kernel is given "
                                                               r"twice, dotted and nested under its prefix; in a file, "
                                                               r"nest it"),
])
def test_a_wrong_option_names_the_key_the_value_and_the_fix(override, message):
    assignment = f"train.compile_options={override}" if override.startswith("{") else \
        f"train.compile_options.{override}"
    with pytest.raises(ConfigError, match=r"^train.compile_options." + message):
        _options(assignment)


@pytest.mark.parametrize("name, value", [("combo_kernels", True), ("max_fusion_size", 8), ("min_overlap_ratio", 1e-5),
                                         ("realize_opcount_threshold", None), ("cpp.cxx", (None, "g++")),
                                         ("multi_kernel_hints", [8, 16])])
def test_an_option_as_the_start_line_and_the_benchmarks_write_it_loads_back(name, value):
    """``option_text``: ``1e-05`` (JSON's spelling) would be a string to YAML, a tuple is no YAML value."""
    text = option_text(name, value)
    assert " " not in text.split("=", 1)[0]
    assert _options(f"train.compile_options.{text}") == {name: value}, text


@pytest.mark.slow
def test_the_options_reach_inductor_in_both_compile_modes():
    """Real compiles of one tiny layer, forward and backward, counted by inductor itself: ``max_fusion_size: 1``
    (at most one op a fused kernel) launches more kernels than the default, through ``compile_step`` (the
    paper configs' mode; any module will do) and through ``compile_layers`` alike."""
    from benchmarks.common import compiled_counts

    def kernels(compile_, options) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        layer = ConvBertLayer(preset("tiny"))
        compile_(layer, options)
        x = torch.randn(2, 16, layer.output.dense.out_features, requires_grad=True)
        return compiled_counts("layer", lambda: layer(x).sum().backward())["kernels"]

    def step(layer, options):
        compile_step(layer, cuda_graphs=False, options=options)

    def layers(layer, options):
        assert compile_layers(nn.ModuleList([layer]), options=options) == 1

    unfused = kernels(step, {"max_fusion_size": 1})
    assert unfused > kernels(step, {})
    assert kernels(layers, {"max_fusion_size": 1}) == unfused
