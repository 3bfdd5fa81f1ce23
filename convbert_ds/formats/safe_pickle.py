"""Reading ``torch.save`` files without running code that a file could carry.

``torch.load(weights_only=False)`` (what DeepSpeed's loaders use) executes whatever a pickle asks for: a
checkpoint from someone else can run any command. ``torch.load(weights_only=True)`` rebuilds only tensors,
containers and plain values, plus the globals allowed here. ``ALLOWED_GLOBALS`` holds the few DeepSpeed
classes that our trainer's checkpoints contain, found with ``torch.serialization.get_unsafe_globals_in_checkpoint``
over real checkpoints of every layout the trainer writes (ZeRO 0/1/2/3, ZeRO-3 with offload, a 2-stage
pipeline with ZeRO-1; fp32 and bf16; 1 and 2 ranks; DeepSpeed 0.19.8): model-state files
(``mp_rank_XX_model_states.pt``, ZeRO-3's ``zero_pp_rank_R_mp_rank_XX_model_states.pt``, pipeline
``layer_XX-model_states.pt``) and our ``rng_rankNNNNN.pt`` need none; every ZeRO optimizer file
(``[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt``) needs the first two, stage 1/2's (pipeline included)
also the third. Allowing a class lets a file call it with arguments of its choosing and set attributes on
the result: these three only store numbers.

    safe_load(path, **torch_load_kwargs)   torch.load(weights_only=True) with the allow-list; errors below
    check_directory(tag_dir)               safe-load (mmap: no tensor data read) every *.pt under a tag
                                           directory, before DeepSpeed's own loader touches them
    deepspeed_loads_weights_only(engine)   while DeepSpeed's ``engine.load_checkpoint`` runs: its loads are
                                           weights_only too, and a refused file is named
    forced_weights_only()                  every torch.load in the block is weights_only (third-party
                                           readers such as DeepSpeed's zero_to_fp32)

``UnsafeCheckpointError``: the file asks for a global outside the list (a crafted file, or a DeepSpeed version
or layout that pickles something new: then extend the list, after checking what the class does on unpickling).
``DamagedCheckpointFileError``: the file is truncated or corrupt (re-copy it or use another checkpoint).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from convbert_ds.errors import UserError

# Dotted names, resolved only when a file is loaded: importing DeepSpeed costs seconds and most users of
# this module (tests, converter checks) would otherwise pay it at import.
ALLOWED_GLOBALS: tuple[str, ...] = (
    # Every ZeRO optimizer file (stages 1-3, offload, pipeline; fp32 and bf16): the static loss scaler that
    # bf16/fp32 optimizers keep. Pickled as NEWOBJ + BUILD: an object holding the scale, no code.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    # Every ZeRO optimizer file: the stage. Pickled as ZeroStageEnum(2): an int Enum lookup.
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    # ZeRO stage 1/2 optimizer files (pipeline's ZeRO-1 included): ``param_slice_mappings``, one per
    # parameter fragment. A dataclass of two ints (start, numel), NEWOBJ + BUILD.
    "deepspeed.utils.tensor_fragment.fragment_address",
    # Our rng_rankNNNNN.pt files written before they held only tensors (still resumable): numpy's random
    # state array. Rebuilt as an empty array whose raw bytes are then filled in: no code.
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",  # the array's dtype class, built (not imported by name) while unpickling
)

_TRUST_HINT = (f"only load checkpoints from a source you trust; if this file is yours (another DeepSpeed "
               f"version or layout), add the global to ALLOWED_GLOBALS in {__name__}")
_GLOBAL = re.compile(r"GLOBAL (\S+)")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format; only it can be memory-mapped
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch's own switch: weights_only=True for every load


class UnsafeCheckpointError(UserError):
    """A pickle in the file asks for something outside the allow-list; nothing of it was run."""


class DamagedCheckpointFileError(UserError):
    """The file is not a whole ``torch.save`` file (truncated, corrupt): damage, not malice."""


@functools.cache
def allowed_globals() -> tuple:
    """The classes named in ``ALLOWED_GLOBALS`` (what ``torch.serialization.safe_globals`` takes)."""
    resolved = []
    for name in ALLOWED_GLOBALS:
        module, _, attribute = name.rpartition(".")
        resolved.append(getattr(importlib.import_module(module), attribute))
    return tuple(resolved)


def _enum_member(cls, name):
    """``builtins.getattr`` as a pickle may call it: some Python versions (3.11.2, Debian 12's) pickle an Enum
    member by name, ``getattr(ZeroStageEnum, 'gradients')``, where others call ``ZeroStageEnum(2)``. Only a
    member of an allowed Enum is looked up; any other attribute of anything is refused."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in allowed_globals()
            and isinstance(name, str) and name in cls.__members__):
        return cls[name]
    raise pickle.UnpicklingError(f"Trying to call reduce for unrecognized function getattr({cls!r}, {name!r}): "
                                 "only members of an allowed Enum are looked up by name")


@contextlib.contextmanager
def _allow_list() -> Iterator[None]:
    # torch's safe_globals removes its globals on exit even when an outer block added them too: add only
    # the missing ones, so a safe_load inside deepspeed_loads_weights_only leaves the outer list intact.
    present = set(torch.serialization.get_safe_globals())
    wanted = [*allowed_globals(), (_enum_member, "builtins.getattr")]
    with torch.serialization.safe_globals([g for g in wanted if g not in present]):
        yield


def _one_line(text: str) -> str:
    return " ".join(text.split())


# Opcodes torch.save never writes (it pickles with protocol 2, whose only import opcode is GLOBAL, named in
# torch's message) and torch's weights-only unpickler does not implement ("Unsupported operand N"): the
# old import opcodes, and protocol 4's framing, which a pickle.dump-ed payload starts with. A file using
# them was not written by torch.save's defaults: refused as unsafe, not reported as damage.
_FOREIGN_OPCODES = {ord("i"): "INST", ord("o"): "OBJ", 0x93: "STACK_GLOBAL", 0x92: "NEWOBJ_EX", 0x82: "EXT1",
                    0x83: "EXT2", 0x84: "EXT4", 0x95: "FRAME (pickle protocol 4+)"}
_OPERAND = re.compile(r"Unsupported operand (\d+)")
# The weights-only unpickler's refusals to build an object it was not allowed to build.
_REFUSALS = ("Can only", "Trying to call reduce", "persistent_load", "must be imported to load")


def _unsafe_error(path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{path}: {what}; it was not loaded and none of its code ran: {_TRUST_HINT}")


def classify(path, error: BaseException) -> UserError:
    """The one-line error for ``torch.load(path, weights_only=True)`` failing with ``error``.

    A global outside the allow-list (the usual attack: a ``__reduce__`` returning ``os.system``), an object
    build torch refuses, or an opcode torch.save never writes -> ``UnsafeCheckpointError`` naming it.
    Anything else a load raises on bad bytes (torch's zip reader: RuntimeError, or OSError EINVAL; a
    pickle cut short: EOFError; bytes that decode to nonsense: UnicodeDecodeError, KeyError, ``Unsupported
    operand``, ...) -> ``DamagedCheckpointFileError``. Missing or unreadable -> ``UserError``. (A byte flipped inside a
    global's name reads as an unknown global: nothing in the file tells the two apart.)
    """
    if isinstance(error, pickle.UnpicklingError):
        message = str(error)
        found = _GLOBAL.search(message)
        if found:
            return _unsafe_error(path, f"asks for the global {found.group(1)}, which is not on the allow-list")
        operand = _OPERAND.search(message)
        if operand and int(operand.group(1)) in _FOREIGN_OPCODES:
            name = _FOREIGN_OPCODES[int(operand.group(1))]
            return _unsafe_error(path, f"uses the pickle opcode {name}, which torch.save never writes and "
                                       "weights-only loading refuses")
        if any(refusal in message for refusal in _REFUSALS):
            reason = _one_line(message.split("WeightsUnpickler error:")[-1].split("Check the documentation")[0])
            return _unsafe_error(path, f"holds an object weights-only loading refuses to build ({reason[:200]})")
    if isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return UserError(f"{path}: {error.strerror or error}")  # about the path, not the bytes
    reason = _one_line(str(error)).split(" This is an internal miniz error")[0] or "unexpected end of file"
    return DamagedCheckpointFileError(
        f"{path}: not a whole torch.save file ({type(error).__name__}: {reason[:200]}); it is truncated or "
        "corrupt: copy it again from its source, or resume from another checkpoint")


@contextlib.contextmanager
def _translated_errors(path) -> Iterator[None]:
    try:
        yield
    except UserError:
        raise
    except pickle.UnpicklingError as error:  # torch's message is many lines of advice: ours replaces it
        raise classify(path, error) from None
    except Exception as error:  # noqa: BLE001 - bad bytes surface as many exception types (see classify)
        raise classify(path, error) from error


def safe_load(path, **torch_load_kwargs):
    """``torch.load(path, weights_only=True, **torch_load_kwargs)`` with ``ALLOWED_GLOBALS`` allowed.

    ``map_location`` defaults to ``"cpu"`` (a GPU-saved file loads on any machine). Raises
    ``UnsafeCheckpointError`` or ``DamagedCheckpointFileError``, one line naming the file.
    """
    if torch_load_kwargs.pop("weights_only", True) is not True:
        raise ValueError("safe_load always loads with weights_only=True")
    torch_load_kwargs.setdefault("map_location", "cpu")
    # The allow-list is resolved outside the translation: a broken DeepSpeed install is not a damaged file.
    with _allow_list(), _translated_errors(path):
        return torch.load(path, weights_only=True, **torch_load_kwargs)


def check_directory(path) -> list[Path]:
    """Prove that no ``*.pt`` under ``path`` (a checkpoint tag directory) needs a global outside the list.

    Each file is safe-loaded memory-mapped: the pickles are parsed and every tensor is only mapped, not
    read, so the check costs milliseconds per file whatever the model size. (A file in torch's legacy,
    non-zip format cannot be mapped and is read whole.) Returns the files checked, sorted. Raises
    ``UnsafeCheckpointError`` / ``DamagedCheckpointFileError`` naming the first bad file, or ``UserError``
    when ``path`` is not a directory.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"{directory}: not a checkpoint directory (it does not exist or is a file)")
    files = sorted(p for p in directory.rglob("*.pt") if p.is_file())
    for file in files:
        with _translated_errors(file), open(file, "rb") as f:
            mmap = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
        safe_load(file, map_location="cpu", mmap=mmap)
    return files


@contextlib.contextmanager
def forced_weights_only(what: str = "a file loaded in this block") -> Iterator[None]:
    """Every ``torch.load`` in the block is weights-only with ``ALLOWED_GLOBALS``, whatever its caller
    passes: for third-party readers that call ``torch.load(weights_only=False)`` themselves (DeepSpeed's
    ``zero_to_fp32``, its universal-checkpoint loaders). A refused file raises ``UnsafeCheckpointError``;
    the file is not known here, so the message names ``what`` (run ``check_directory`` first to name it).
    """
    # torch reads this variable on every torch.load call and then ignores the caller's weights_only=False:
    # it is torch's documented switch, so third-party calls become safe without patching them. It is
    # process-wide: another thread's torch.load during the block is weights-only too.
    previous = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with _allow_list():
            try:
                yield
            except pickle.UnpicklingError as error:
                raise classify(what, error) from None
    finally:
        if previous is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = previous


@contextlib.contextmanager
def deepspeed_loads_weights_only(engine) -> Iterator[None]:
    """Make every ``torch.load`` inside the block weights-only with ``ALLOWED_GLOBALS``; meant around
    ``engine.load_checkpoint(...)``.

    Two layers. (1) ``forced_weights_only``: torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` switch turns
    DeepSpeed's ``torch.load(weights_only=False)`` calls into weights-only ones, wherever they are.
    (2) DeepSpeed reads every file of our layouts through ``engine.checkpoint_engine.load(path,
    map_location)`` (its pluggable checkpoint-engine interface); that bound method is shadowed on this one
    engine object for the block (the engine's own ``load`` still does the reading) so that a refused file
    becomes ``UnsafeCheckpointError`` / ``DamagedCheckpointFileError`` naming it. Nothing in DeepSpeed's
    modules is replaced.
    """
    checkpoint_engine = engine.checkpoint_engine
    if "load" in vars(checkpoint_engine):
        raise RuntimeError("deepspeed_loads_weights_only is already active for this engine")
    unguarded = checkpoint_engine.load

    def load(path, map_location=None, *args, **kwargs):
        with _translated_errors(path):
            return unguarded(path, map_location, *args, **kwargs)

    checkpoint_engine.load = load
    try:
        with forced_weights_only("a file DeepSpeed loaded outside its checkpoint engine"):
            yield
    finally:
        del checkpoint_engine.load
