"""What convbert_ds touches inside DeepSpeed beyond its documented API, declared in one place.

``INTERNALS`` lists every such attribute: the DeepSpeed class (or module) that has it, what we do with it
(patch it on one object for a while, set it, call it, read it), which of our modules does, and why.
``tests/engine/test_deepspeed_seam.py`` holds the pinned DeepSpeed to that list, on its classes and, for
the attributes that exist only on an instance, on real engines of every kind the trainer builds: a DeepSpeed
upgrade that renames one fails there, naming it, not in a run.

The trainer's saves and optimizer step reach DeepSpeed's internals only through the functions here:

    route_checkpoint_writes(engine, through, save)   for a block: each file DeepSpeed writes for a save goes
                                                     through ``through(write, *args)``, its state files
                                                     through ``save`` instead when given
    checkpoint_engine_save(engine)                   the writer of one state file, outside that block
    turn_off_backward_allreduce(engine)              DeepSpeed reduces no gradients inside ``backward``
    gradient_allreduce(engine)                       DeepSpeed's own ZeRO-0 all-reduce of a gradient list

Each looks up what it uses when it is called, and the trainer calls them (or ``check_checkpoint_writes``) at
set-up: an attribute that is not there raises ``DeepSpeedMismatch`` on every rank alike, naming it and the
installed DeepSpeed version. Nothing is skipped when it is missing (a write that then went unrouted could
fail on one rank and leave the others waiting in DeepSpeed's barriers). The other modules named in
``INTERNALS`` (engine/universal.py, engine/pipeline/, engine/trainer.py, engine/distributed.py,
formats/safe_pickle.py, model/op_count.py) keep their own code: formats and model are layers below this one.

``FAULTS``: failures a test injects into the save path (``tests/faulty_train.py`` sets them in a test run's
ranks); a real run never sets them, and nothing reads them from the environment.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import importlib.metadata
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from convbert_ds.errors import UserError

TESTED_WITH = "0.19.8"  # the DeepSpeed that requirements.txt pins (the contract test keeps the two equal)

_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
_PIPE_ENGINE = "deepspeed.runtime.pipe.engine.PipelineEngine"
_PIPE_MODULE = "deepspeed.runtime.pipe.module.PipelineModule"
_GRID = "deepspeed.runtime.pipe.topology.PipelineParallelGrid"
_CHECKPOINT_ENGINE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine"
_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
_ZERO3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_BF16 = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"
_UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"
SEAM = "engine/deepspeed_seam.py"


@dataclass(frozen=True)
class Internal:
    """One DeepSpeed attribute we rely on. ``on``: where it can be seen: ``class`` (a method, a class or
    module attribute), ``instance`` (set by the object's ``__init__``, or by a pipeline schedule for
    ``fwd_outputs``) or ``parameter`` (set on each model parameter by the optimizer ``owner``)."""

    owner: str  # the dotted path of the DeepSpeed class or module
    attribute: str
    use: str  # patched (on one object, for a while) | set | called | read
    on: str
    where: str  # our module that touches it, under convbert_ds/
    why: str

    @property
    def name(self) -> str:
        return f"{self.owner.rpartition('.')[2]}.{self.attribute}"


def _declare(owner: str, attributes: str, use: str, on: str, where: str, why: str) -> list[Internal]:
    return [Internal(owner, attribute, use, on, where, why) for attribute in attributes.split()]


_ROUTED = ("a write error is kept, not raised inside save_checkpoint (the other ranks would wait in its "
           "barriers forever); with checkpoint.background a state is copied to host memory instead")
_UNIVERSAL = "engine/universal.py"
_PIPELINE = "engine/pipeline/module.py"
INTERNALS: tuple[Internal, ...] = tuple([
    # A save (engine/checkpoint.py, through route_checkpoint_writes) and a load.
    *_declare(_ENGINE, "checkpoint_engine", "read", "instance", SEAM, "the object DeepSpeed writes every state file with"),
    *_declare(_CHECKPOINT_ENGINE, "save makedirs", "patched", "class", SEAM, _ROUTED),
    *_declare(_ENGINE, "_copy_recovery_script", "patched", "class", SEAM,
              "DeepSpeed copies zero_to_fp32.py into each tag itself, outside its checkpoint engine: " + _ROUTED),
    *_declare(_ENGINE, "checkpoint_engine", "read", "instance", "formats/safe_pickle.py",
              "the object DeepSpeed loads every state file with"),
    *_declare(_CHECKPOINT_ENGINE, "load", "patched", "class", "formats/safe_pickle.py",
              "a refused or damaged file is named while engine.load_checkpoint runs"),
    # The optimizer step (engine/optimizer_step.py, through turn_off_backward_allreduce and gradient_allreduce).
    *_declare(_ENGINE, "enable_backward_allreduce", "set", "instance", SEAM,
              "off where the trainer reduces the gradients itself, or there is nothing to reduce: DeepSpeed's "
              "copies each gradient back one tensor at a time"),
    *_declare(_ENGINE, "allreduce_bucket", "called", "class", SEAM,
              "the trainer's all-reduce is DeepSpeed's own flatten and all-reduce (its averaging, "
              "communication_data_type)"),
    *_declare(_ENGINE, "unflatten", "called", "instance", SEAM, "the reduced flat buffer as the gradients' shapes"),
    *_declare(_ENGINE, "seq_data_parallel_group", "read", "instance", SEAM,
              "the group DeepSpeed's ZeRO-0 all-reduce reduces over"),
    # A resume in another layout (engine/universal.py).
    *_declare(_ENGINE, "global_steps global_samples skipped_steps", "set", "instance", _UNIVERSAL,
              "DeepSpeed's counters, restored from a universal copy"),
    *_declare(_ZERO12, "optimizer", "read", "instance", _UNIVERSAL, "the torch optimizer inside ZeRO-1/2's wrapper"),
    *_declare(_ZERO3, "optimizer", "read", "instance", _UNIVERSAL, "the torch optimizer inside ZeRO-3's wrapper"),
    *_declare(_BF16, "optimizer", "read", "instance", _UNIVERSAL, "the torch optimizer inside the bf16 wrapper"),
    *_declare(_UNFUSED, "optimizer", "read", "instance", _UNIVERSAL,
              "the torch optimizer inside the bf16 wrapper without ZeRO"),
    *_declare(_ZERO12, "_lazy_init_hp_params_optimizer_state", "called", "class", _UNIVERSAL,
              "points ZeRO-1/2's per-parameter views at Adam's state once it is set"),
    *_declare(_ZERO12, "_hp_optimizer_states_linked", "set", "instance", _UNIVERSAL,
              "cleared so that the views are linked again"),
    *_declare(_BF16, "_lazy_init_hp_params_optimizer_state", "called", "class", _UNIVERSAL,
              "the same for the bf16 optimizer (ZeRO-1 with fp32 gradient accumulation)"),
    *_declare(_BF16, "_hp_optimizer_states_linked", "set", "instance", _UNIVERSAL, "the same"),
    *_declare(_ZERO3, "_get_fp32_opt_state_partition _get_param_partition_rank", "called", "class", _UNIVERSAL,
              "ZeRO-3's set_full_hp_param reads past a padded last piece: this rank's piece is set by hand"),
    *_declare(_ZERO3, "fp32_partitioned_groups_flat fp16_partitioned_groups_flat", "read", "instance", _UNIVERSAL,
              "ZeRO-3's fp32 pieces that Adam updates, and the module's pieces copied from them"),
    *_declare(_UNFUSED, "fp16_groups fp32_groups", "read", "instance", _UNIVERSAL,
              "bf16 without ZeRO: the fp32 copy Adam updates for each module parameter"),
    *_declare(_ZERO3, "ds_id", "read", "parameter", _UNIVERSAL, "marks a ZeRO-3 parameter (the loader's path)"),
    *_declare(_ZERO12, "_hp_mapping set_full_hp_param", "read", "parameter", _UNIVERSAL,
              "marks a parameter whose fp32 fragment ZeRO-1/2 holds, and sets it"),
    *_declare(_BF16, "_hp_mapping set_full_hp_param", "read", "parameter", _UNIVERSAL, "the same for bf16"),
    # The pipeline engine (engine/pipeline/module.py, engine/trainer.py).
    *_declare(_PIPE_MODULE, "_local_start forward_funcs tied_modules", "read", "instance", _PIPELINE,
              "this stage's layers and their global indices, to load a plain model's weights into them"),
    *_declare(_PIPE_ENGINE, "fwd_outputs", "read", "instance", _PIPELINE,
              "one loss per micro-batch of the last schedule: how many records the metrics average"),
    *_declare(_PIPE_ENGINE, "is_data_parallel dp_world_size is_pipe_parallel num_stages grid", "read", "instance",
              _PIPELINE, "where the last stage's metrics are reduced and broadcast"),
    *_declare(_PIPE_ENGINE, "is_last_stage", "called", "class", _PIPELINE, "the stage that computed the metrics"),
    *_declare(_GRID, "get_data_parallel_group stage_to_global get_pipe_parallel_group", "called", "class", _PIPELINE,
              "the groups the metrics are reduced over"),
    *_declare(_PIPE_ENGINE, "stage_id", "read", "instance", "engine/trainer.py", "the compile cache's writer per stage"),
    *_declare(_GRID, "get_data_parallel_rank get_data_parallel_world_size", "called", "class", "engine/trainer.py",
              "the data loader's shard of a pipelined run"),
    *_declare("deepspeed.runtime.activation_checkpointing.checkpointing", "non_reentrant_checkpoint", "called",
              "class", _PIPELINE, "the encoder layers' activation checkpointing (the reentrant one frees inputs "
              "the generator's loss still needs)"),
    # Start-up and measurement.
    *_declare("deepspeed.ops", "__compatible_ops__", "set", "class", "engine/distributed.py",
              "marks the CPU shared-memory all-reduce incompatible, so that it is never JIT-built"),
    *_declare("deepspeed.ops.op_builder.cpu.ShareMemCommBuilder", "NAME", "read", "class", "engine/distributed.py",
              "that op's key"),
    *_declare("deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator", "synchronize", "patched", "class",
              "model/op_count.py", "counted as a device sync (DeepSpeed's timers call it directly)"),
])


def deepspeed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _not_found(internal: Internal, what: str) -> str:
    return (f"DeepSpeed {deepspeed_version()} has no {what} ({internal.owner}.{internal.attribute}, "
            f"{internal.use} by convbert_ds/{internal.where}: {internal.why})")


class DeepSpeedMismatch(UserError):
    """The installed DeepSpeed lacks an attribute listed in ``INTERNALS``: found at set-up, on every rank."""

    def __init__(self, internal: Internal, obj):
        super().__init__(f"{_not_found(internal, f'{type(obj).__name__}.{internal.attribute}')}; convbert_ds is "
                         f"tested with DeepSpeed {TESTED_WITH} (requirements.txt): install that version, or "
                         f"update {__name__} and its contract test")


def _internal(owner: str, attribute: str) -> Internal:
    for internal in INTERNALS:
        if internal.owner == owner and internal.attribute == attribute and internal.where == SEAM:
            return internal
    raise RuntimeError(f"{__name__} uses {owner}.{attribute} without declaring it in INTERNALS")


def _get(obj, owner: str, attribute: str):
    """``obj.attribute``, a declared internal; ``DeepSpeedMismatch`` when DeepSpeed has none."""
    internal = _internal(owner, attribute)
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise DeepSpeedMismatch(internal, obj) from None


# Checkpoint writes ----------------------------------------------------------------------------------


def _write_targets(engine) -> list[tuple[object, str]]:
    """(object, attribute) of every DeepSpeed write a save routes, each checked to be there."""
    checkpoint_engine = _get(engine, _ENGINE, "checkpoint_engine")
    targets = [(checkpoint_engine, _CHECKPOINT_ENGINE, "save"), (checkpoint_engine, _CHECKPOINT_ENGINE, "makedirs"),
               (engine, _ENGINE, "_copy_recovery_script")]
    for obj, owner, attribute in targets:
        _get(obj, owner, attribute)
    return [(obj, attribute) for obj, _, attribute in targets]


def check_checkpoint_writes(engine) -> None:
    """Raise ``DeepSpeedMismatch`` now (at set-up) when a save could not route DeepSpeed's writes."""
    _write_targets(engine)


def checkpoint_engine_save(engine) -> Callable:
    """``save(state_dict, path)`` as DeepSpeed's checkpoint engine writes a state file, never routed: for the
    states a background save staged, written after the block."""
    return _get(_get(engine, _ENGINE, "checkpoint_engine"), _CHECKPOINT_ENGINE, "save")


@contextlib.contextmanager
def route_checkpoint_writes(engine, through: Callable, save: Callable | None = None) -> Iterator[None]:
    """While the block runs (``engine.save_checkpoint``), each write DeepSpeed makes for ``engine`` (its
    checkpoint engine's ``save`` and ``makedirs``, the recovery scripts it copies) is ``through(write, *args,
    **kwargs)``; with ``save``, a state file's ``write`` is ``save`` instead of DeepSpeed's. Only this engine's
    objects are changed (an attribute on each instance, removed after the block); nothing in DeepSpeed's
    modules is."""
    targets = _write_targets(engine)
    for obj, attribute in targets:
        if attribute in vars(obj):
            raise RuntimeError(f"{type(obj).__name__}.{attribute} is routed already (a save inside a save?)")
    try:
        for obj, attribute in targets:
            write = save if save is not None and attribute == "save" else getattr(obj, attribute)
            setattr(obj, attribute, functools.partial(through, write))
        yield
    finally:
        for obj, attribute in targets:
            vars(obj).pop(attribute, None)  # the instance attribute set above: the class's method shows again


# The optimizer step ---------------------------------------------------------------------------------


def turn_off_backward_allreduce(engine) -> None:
    """DeepSpeed's gradient all-reduce inside ``engine.backward`` is not run (ZeRO-0: its all-reduce copies each
    gradient back one tensor at a time)."""
    _get(engine, _ENGINE, "enable_backward_allreduce")  # set in its __init__: a rename would go unnoticed
    engine.enable_backward_allreduce = False


def gradient_allreduce(engine) -> Callable[[list], list]:
    """``reduce(grads)``: the tensors of ``grads`` all-reduced as DeepSpeed's ZeRO-0 ``backward`` does
    (``_reduce_non_expert_gradients``: its flatten, averaging and communication dtype, over its data-parallel
    group), as views of one flat buffer shaped as ``grads``. What it uses is looked up once, here."""
    bucket = _get(engine, _ENGINE, "allreduce_bucket")
    unflatten = _get(engine, _ENGINE, "unflatten")
    group = _get(engine, _ENGINE, "seq_data_parallel_group")

    def reduce(grads: list) -> list:
        return unflatten(bucket(grads, group), grads)

    return reduce


# The contract ---------------------------------------------------------------------------------------


def resolve(owner: str):
    """The DeepSpeed class or module a dotted path names; None when there is none."""
    try:
        return importlib.import_module(owner)
    except ModuleNotFoundError:
        module, _, name = owner.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name, None)
        except ModuleNotFoundError:
            return None


def missing_on_classes(internals=INTERNALS, resolve=resolve) -> list[str]:
    """One line per declared internal that DeepSpeed lacks where no engine is needed to see it: a class or
    module attribute, or the owner class of an instance or parameter attribute."""
    missing = []
    for internal in internals:
        owner = resolve(internal.owner)
        if owner is None:
            missing.append(_not_found(internal, internal.owner))
        elif internal.on == "class" and not hasattr(owner, internal.attribute):
            missing.append(_not_found(internal, internal.name))
    return missing


def missing_on(obj, internals=INTERNALS, resolve=resolve, parameters=()) -> tuple[list[str], set[Internal]]:
    """The instance attributes declared for ``obj``'s class (and its bases) that ``obj`` lacks, and the
    parameter attributes declared for it (an optimizer) that one of ``parameters`` lacks; with the
    internals that were checked."""
    missing, checked = [], set()
    for internal in internals:
        owner = resolve(internal.owner)
        if internal.on not in ("instance", "parameter") or not isinstance(owner, type) or not isinstance(obj, owner):
            continue
        if internal.on == "parameter":
            if not parameters:
                continue
            lacking = [p for p in parameters if not hasattr(p, internal.attribute)]
        else:
            lacking = [] if hasattr(obj, internal.attribute) else [obj]
        checked.add(internal)
        if lacking:
            missing.append(_not_found(internal, f"{type(obj).__name__}.{internal.attribute}"
                                                + (" on its parameters" if internal.on == "parameter" else "")))
    return missing, checked


# Faults a test injects ------------------------------------------------------------------------------


@dataclass
class Faults:
    """At step N of a save (only ``tests/faulty_train.py`` sets them, in a test run's ranks):"""

    kill_during_save_at: int | None = None  # rank 0 is SIGKILLed once its files are written, before the ranks agree
    # One rank's save fails with ENOSPC after DeepSpeed wrote its files (so partial files exist): rank 1 when
    # there is one, so that the ranks must agree on the outcome.
    fail_save_at: int | None = None
    # On node-local disks, the last node's upload of its part fails (the store refused it).
    fail_upload_at: int | None = None


FAULTS = Faults()


def injected_write_failure(step: int, tag_dir: Path) -> None:
    """A point of the save path where a write fails when a test asked for it (``FAULTS.fail_save_at``)."""
    if FAULTS.fail_save_at == step and dist.get_rank() == min(1, dist.get_world_size() - 1):
        raise OSError(errno.ENOSPC, "No space left on device (injected by a test)", str(tag_dir))


def injected_upload_failure(step: int, last_keeper: bool) -> None:
    """Where a node's upload of its part fails when a test asked for it (``FAULTS.fail_upload_at``): raised on
    the last node's keeper."""
    if FAULTS.fail_upload_at == step and last_keeper:
        raise PermissionError("the store refused the upload (injected by a test)")


def injected_kill(step: int) -> None:
    """A point of the save path where rank 0 dies when a test asked for it (``FAULTS.kill_during_save_at``)."""
    if FAULTS.kill_during_save_at == step and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
