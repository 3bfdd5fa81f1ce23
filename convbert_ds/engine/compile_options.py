"""``train.compile_options``: more of inductor's options for the compiled code, checked against the installed
torch when the run is planned, before any process starts, rather than by ``torch.compile`` at the first step
(after the process group, the data and the engine).

Each option is named as ``torch._inductor.config`` names it (``combo_kernels``, ``triton.multi_kernel``),
dotted or nested under its prefix, and its value must be of the option's declared type: an int is a float
option's value, a list a tuple option's, and an option whose type a config file cannot give (a callable, a
graph pass) is refused. The options that other keys set are theirs.
"""

from __future__ import annotations

import collections.abc
import difflib
import json
import types
import typing

import torch

from convbert_ds.config import ConfigError
from convbert_ds.formats.train_config import TrainConfig

# The inductor options that other keys set in each compile mode (``model/layers.py``: ``step_inductor_options``
# for the step, ``compile_layers`` for the layers), and those keys.
_OWNED_IN_BOTH = {"triton.cudagraphs": "train.cuda_graphs", "fallback_random": "train.compile_random"}
OPTIONS_OWNED = {"step": {**_OWNED_IN_BOTH, "max_autotune": "train.compile_autotune",
                          "max_autotune_pointwise": "train.compile_autotune",
                          "coordinate_descent_tuning": "train.compile_autotune",
                          "allow_buffer_reuse": "train.compile_layers_once"},
                 "layers": _OWNED_IN_BOTH}


def inductor_options(cfg: TrainConfig) -> dict:
    """``train.compile_options`` by inductor's own dotted names, each checked (see the module docstring);
    a mapping under a prefix (``{triton: {multi_kernel: 1}}``) is the dotted name (``triton.multi_kernel``)."""
    if not cfg.train.compile_options:
        return {}  # without importing inductor (about a second)
    import torch._inductor.config as inductor_config

    known, owned = inductor_config.get_config_copy(), OPTIONS_OWNED[cfg.train.compile_mode]
    options: dict = {}

    def take(mapping: dict, prefix: str) -> None:
        for key, value in mapping.items():
            name = f"{prefix}{key}"
            if name not in known and isinstance(value, dict):
                take(value, f"{name}.")
                continue
            where = f"train.compile_options.{name}={value!r}"
            if name not in known:
                near = difflib.get_close_matches(name, known, n=3)
                raise ConfigError(f"{where}: torch {torch.__version__}'s inductor has no option {name!r}"
                                  + (f"; did you mean {', '.join(near)}?" if near else
                                     "; torch._inductor.list_options() lists them"))
            if name in owned:
                raise ConfigError(f"{where}: {owned[name]} sets this option "
                                  f"(train.compile_mode={cfg.train.compile_mode}); use that key")
            if name in options:
                raise ConfigError(f"{where}: {name} is given twice, dotted and nested under its prefix (in the "
                                  "file or the overrides); spell it one way")
            options[name] = _option_value(where, value, inductor_config.get_type(name))

    take(cfg.train.compile_options, "")
    return options


def option_text(name: str, value) -> str:
    """One option as the start line and the benchmarks' labels show it: ``combo_kernels=true``."""
    return f"{name}={json.dumps(value, separators=(',', ':'))}"


def _option_value(where: str, value, kind):
    """``value`` as an option of type ``kind`` takes it (an int as a float, a list as a tuple), or a
    ConfigError that says what the option takes."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is typing.Any:
        return value
    if origin is typing.Literal:
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise ConfigError(f"{where}: use one of {list(args)}")
    if origin in (typing.Union, types.UnionType):
        for member in args:
            try:
                return _option_value(where, value, member)
            except ConfigError:
                continue
    elif kind is type(None):
        if value is None:
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif origin is not None and origin is not collections.abc.Callable:
        value = tuple(value) if origin is tuple and isinstance(value, list) else value
        if isinstance(value, origin):
            return value
    elif isinstance(kind, type) and isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: this option takes {_type_text(kind)}, not {type(value).__name__}")


def _type_text(kind) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
