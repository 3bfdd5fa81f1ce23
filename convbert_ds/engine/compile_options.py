"""``train.compile_options``: more of inductor's options for the compiled code, checked against the installed
torch when the run is planned, before any process starts, rather than by ``torch.compile`` at the first step
(after the process group, the data and the engine), whose own check stops at the outer type.

Each option is named as ``torch._inductor.config`` names it (``combo_kernels``, ``triton.multi_kernel``),
dotted or nested under its prefix, and its value must be of the option's declared type, item by item: an
int is taken for a float, a list for a tuple; a ``Literal``'s choices are checked; a callable (a graph pass)
cannot come from a config file. The options that other keys set are theirs.
"""

from __future__ import annotations

import difflib
import types
import typing

import torch

from convbert_ds.config import ConfigError
from convbert_ds.formats.train_config import TrainConfig

# The inductor options that other keys decide, in each compile mode, and those keys: what ``compile_step``
# sets (``model/layers.py``: ``step_inductor_options``) and what ``compile_layers`` sets (the random stream).
# CUDA graphs are train.cuda_graphs's in both: inductor's own, per compiled layer, would clash with a capture
# of the whole step by hand.
_OWNED_IN_BOTH = {"triton.cudagraphs": "train.cuda_graphs", "fallback_random": "train.compile_random"}
OPTIONS_OWNED = {"step": {**_OWNED_IN_BOTH, "max_autotune": "train.compile_autotune",
                          "max_autotune_pointwise": "train.compile_autotune",
                          "max_autotune_gemm": "train.compile_autotune",
                          "coordinate_descent_tuning": "train.compile_autotune",
                          "allow_buffer_reuse": "train.compile_layers_once"},
                 "layers": _OWNED_IN_BOTH}


def inductor_options(cfg: TrainConfig) -> dict:
    """``train.compile_options`` by inductor's own dotted names, each checked (see the module docstring);
    a mapping under a prefix (``{triton: {multi_kernel: 1}}``) is the dotted name (``triton.multi_kernel``)."""
    if not cfg.train.compile_options:
        return {}  # without importing inductor (about a second)
    import torch._inductor.config as inductor_config

    known = {name: value for name, value in inductor_config.get_config_copy().items()
             if name != "TYPE_CHECKING" and not any(part.startswith("_") for part in name.split("."))}
    owned = OPTIONS_OWNED[cfg.train.compile_mode]
    declared = getattr(inductor_config, "get_type", None)  # torch < 2.6: the default's type
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
                raise ConfigError(f"{where}: {owned[name]} decides this option "
                                  f"(train.compile_mode={cfg.train.compile_mode}); use that key")
            if name in options:
                raise ConfigError(f"{where}: {name} is given twice, dotted and nested under its prefix; in a "
                                  "file, nest it (as a dotted override on the command line nests it), once")
            options[name] = _option_value(where, value, declared(name) if declared else type(known[name]))

    take(cfg.train.compile_options, "")
    if options.get("cpp_wrapper") and cfg.train.compile_mode == "step" and cfg.train.compile_layers_once:
        raise ConfigError("train.compile_options.cpp_wrapper=True: torch's C++ wrapper cannot call the layers "
                          "compiled once (train.compile_layers_once=true); turn one of them off")
    return options


def _option_value(where: str, value, kind):
    """``value`` as an option of type ``kind`` takes it (an int as a float, a list as a tuple; items checked
    too), or a ConfigError that says what the option takes."""
    origin, args = typing.get_origin(kind) or kind, typing.get_args(kind)
    if kind is typing.Any:
        return value
    if kind is None or kind is type(None):  # typing writes None as NoneType in a Union, not in tuple[None, str]
        if value is None:
            return value
    elif origin is typing.Literal:
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
    elif origin in (typing.Union, types.UnionType):
        for member in args:
            try:
                return _option_value(where, value, member)
            except ConfigError:
                continue
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif origin in (list, tuple, set, frozenset, dict):
        return _container_value(where, tuple(value) if origin is tuple and isinstance(value, list) else value,
                                origin, args)
    elif isinstance(kind, type) and isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: this option takes {_type_text(kind)}; {value!r} is not one"
                      + (" (a callable cannot come from a config file)" if "Callable" in _type_text(kind) else ""))


def _container_value(where: str, value, container: type, args: tuple):
    if not isinstance(value, container):
        raise ConfigError(f"{where}: this option takes a {container.__name__}; {value!r} is not one")
    if not args:
        return value
    if container is dict:
        return {_option_value(where, key, args[0]): _option_value(where, item, args[1]) for key, item in value.items()}
    if container is tuple and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{where}: this option takes {len(args)} items; {value!r} has {len(value)}")
        return tuple(_option_value(where, item, arg) for item, arg in zip(value, args))
    return container(_option_value(where, item, args[0]) for item in value)


def _type_text(kind) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
