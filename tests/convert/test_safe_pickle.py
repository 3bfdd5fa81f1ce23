"""Checkpoint files are read without running code they could carry (``convbert_ds.formats.safe_pickle``).

Real runs of the trainer write the checkpoints (one layout per kind of DeepSpeed file: ZeRO-0 model
states, ZeRO-1/2 and ZeRO-3 optimizer partitions, pipeline layer files): every file loads weights-only
with the allow-list, and together they need every global on it. Crafted files carrying code are refused
with nothing run; a truncated file is told apart from a crafted one; DeepSpeed's own loader, guarded, is
refused the crafted file too (unguarded, it runs the code).
"""

import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from convbert_ds.errors import UserError
from convbert_ds.formats.safe_pickle import (ALLOWED_GLOBALS, DamagedCheckpointFileError, UnsafeCheckpointError,
                                             check_directory, forced_weights_only, safe_load)
from launch import NOT_THE_SUBJECT, REPO, check, env, free_port, run_training

TAG = "step00000002"

# One run per kind of DeepSpeed file (the survey of every layout x precision x 1/2 ranks is in the module's
# docstring); names say ZeRO stage, precision and ranks.
LAYOUTS = {
    "zero0-fp32-1rank": (1, ["deepspeed.config=ds_configs/zero0_bf16.json", "train.precision=fp32"]),
    "zero2-bf16-2ranks": (2, ["deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=bf16"]),
    "zero3-fp32-2ranks": (2, ["deepspeed.config=ds_configs/zero3_bf16.json", "train.precision=fp32"]),
    "pipeline-zero1-bf16-2ranks": (2, ["deepspeed.config=ds_configs/pipeline_zero1_bf16.json", "train.precision=bf16",
                                       "pipeline.stages=2", "train.micro_batch_size=4"]),
}


class Payload:
    """What a crafted checkpoint carries: unpickled by a full unpickler, it calls ``function(*args)``."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _crafted(path, marker, kind: str) -> None:
    """A checkpoint-looking file (tensors, DeepSpeed-like keys) that creates ``marker`` if unpickled."""
    if kind == "exec":
        payload, protocol = Payload(exec, f"open({str(marker)!r}, 'w').close()"), 2
    else:
        payload, protocol = Payload(os.system, f"touch '{marker}'"), 4 if kind == "protocol4" else 2
    state = {"module": {"weight": torch.ones(3, 3)}, "dp_world_size": 1, "extra": payload}
    torch.save(state, path, pickle_protocol=protocol)


def _one_line_naming(error: Exception, path) -> str:
    message = str(error)
    assert "\n" not in message and str(path) in message, message
    return message


@pytest.fixture(scope="module")
def checkpoint(tiny_corpus, tmp_path_factory):
    """``checkpoint(layout)`` -> the step-2 tag directory of a real 2-step run (trained once per module)."""
    done = {}

    def tag_dir(layout: str):
        if layout not in done:
            nproc, overrides = LAYOUTS[layout]
            run_dir = tmp_path_factory.mktemp(layout)
            check(run_training(run_dir, tiny_corpus["shards"], *overrides, "train.steps=2", "train.warmup_steps=1",
                               "checkpoint.interval=2", "eval.interval=0", nproc=nproc, launcher=NOT_THE_SUBJECT))
            done[layout] = run_dir / "checkpoints" / TAG
        return done[layout]

    return tag_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_file_of_a_real_checkpoint_loads_weights_only(layout, checkpoint):
    tag = checkpoint(layout)
    files = check_directory(tag)
    assert files == sorted(tag.glob("*.pt")) and any(f.name.startswith("rng_rank") for f in files)
    for file in files:
        state = safe_load(file)  # whole, not memory-mapped: the tensors' bytes are read too
        assert isinstance(state, dict), file.name  # (a pipeline layer without parameters saves an empty one)
        needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(file))  # beyond torch's own safe set
        # getattr: where Python pickles Enum members by name, the guarded getattr of safe_pickle stands in for it
        assert needed - {"builtins.getattr"} <= set(ALLOWED_GLOBALS), (file.name, needed)


@pytest.mark.slow
def test_the_allow_list_is_what_these_checkpoints_need(checkpoint, tmp_path):
    """Minimal: each allowed global is needed by some layout, or by the RNG files of older checkpoints
    (numpy's state pickled as an array), which stay resumable (weights-only loading refuses it without it)."""
    old_rng = tmp_path / "rng_rank00000.pt"
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               old_rng)
    # The scan leaves out globals registered process-wide, and libraries imported by other tests register
    # some (numpy's, for one): scan with nothing registered.
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(old_rng))
        for layout in LAYOUTS:
            for file in checkpoint(layout).glob("*.pt"):
                needed |= set(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    finally:
        torch.serialization.add_safe_globals(registered)
    # numpy's dtype class is built while unpickling, not imported by name: torch's scan does not list it.
    # Where Python pickles Enum members by name (getattr), the guarded getattr below stands in for it.
    assert (needed - {"builtins.getattr"}) | {"numpy.dtypes.UInt32DType"} == set(ALLOWED_GLOBALS)
    optimizer_file = next(checkpoint("zero2-bf16-2ranks").glob("*optim_states.pt"))
    with pytest.raises(Exception, match="not an allowed global"):
        torch.load(optimizer_file, weights_only=True, mmap=True)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")  # torch's, for the protocol-4 file
@pytest.mark.parametrize("kind, global_name", [("system", f"{os.system.__module__}.system"), ("exec", "exec"),
                                               ("protocol4", "FRAME")])
def test_a_file_carrying_code_is_refused_and_nothing_runs(kind, global_name, tmp_path):
    crafted, marker = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "MARKER"
    _crafted(crafted, marker, kind)
    for mmap in (False, True):
        with pytest.raises(UnsafeCheckpointError) as refused:
            safe_load(crafted, mmap=mmap)
        message = _one_line_naming(refused.value, crafted)
        assert global_name in message and "source you trust" in message and "ALLOWED_GLOBALS" in message, message
        assert not marker.exists()
    # The file is live: a full unpickler (what DeepSpeed and the converter used) runs its code.
    torch.load(crafted, weights_only=False)
    assert marker.exists()


class _ByName:
    """Pickles as ``getattr(owner, name)``: how Python 3.11.2 pickles an Enum member."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_an_allowed_enum_member_pickled_by_name_loads_and_nothing_else_does(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    member = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"zero_stage": _ByName(ZeroStageEnum, "gradients")}, member)
    assert safe_load(member) == {"zero_stage": ZeroStageEnum.gradients}
    # An allowed class's other attributes (a method: code) are refused, and so is getattr on anything else.
    for owner, name in ((LossScaler, "update_scale"), (ZeroStageEnum, "__class__"),
                        (subprocess.Popen, "wait")):
        crafted = tmp_path / f"{name}.pt"
        torch.save({"x": _ByName(owner, name)}, crafted)
        with pytest.raises(UnsafeCheckpointError) as refused:
            safe_load(crafted)
        _one_line_naming(refused.value, crafted)


@pytest.mark.parametrize("keep", ["nothing", "10 bytes", "half", "all but 1 byte"])
def test_a_truncated_file_is_damaged_not_unsafe(keep, tmp_path):
    whole = tmp_path / "whole.pt"
    torch.save({"module": {"weight": torch.randn(64, 64)}, "step": 3}, whole)
    data = whole.read_bytes()
    cut = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    kept = {"nothing": 0, "10 bytes": 10, "half": len(data) // 2, "all but 1 byte": len(data) - 1}[keep]
    cut.write_bytes(data[:kept])
    for mmap in (False, True):
        with pytest.raises(DamagedCheckpointFileError) as damaged:
            safe_load(cut, mmap=mmap)
        message = _one_line_naming(damaged.value, cut)
        assert not isinstance(damaged.value, UnsafeCheckpointError) and "truncated or corrupt" in message, message
    assert safe_load(whole)["step"] == 3


def test_third_party_loads_are_weights_only_in_the_block(tmp_path):
    """What DeepSpeed's zero_to_fp32 does (``torch.load(weights_only=False)``) is refused inside the block."""
    crafted, marker, plain = tmp_path / "crafted.pt", tmp_path / "MARKER", tmp_path / "plain.pt"
    _crafted(crafted, marker, "system")
    torch.save({"step": 3}, plain)
    with pytest.raises(UnsafeCheckpointError, match=f"zero_to_fp32's read: asks for the global {os.system.__module__}"):
        with forced_weights_only("zero_to_fp32's read"):
            assert torch.load(plain, weights_only=False) == {"step": 3}
            torch.load(crafted, weights_only=False)
    assert not marker.exists() and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_missing_paths_are_user_errors_not_damage(tmp_path):
    with pytest.raises(UserError, match="No such file") as missing:
        safe_load(tmp_path / "absent.pt")
    assert not isinstance(missing.value, DamagedCheckpointFileError)
    with pytest.raises(UserError, match="not a checkpoint directory"):
        check_directory(tmp_path / "absent")


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["crafted", "truncated"])
def test_check_directory_names_the_one_bad_file(bad, checkpoint, tmp_path):
    tag = shutil.copytree(checkpoint("zero2-bf16-2ranks"), tmp_path / TAG)
    assert len(check_directory(tag)) == 5  # model states, 2 optimizer partitions, 2 RNG files
    victim = next(tag.glob("*zero_pp_rank_1_*optim_states.pt"))
    if bad == "crafted":
        _crafted(victim, tmp_path / "MARKER", "system")
    else:
        victim.write_bytes(victim.read_bytes()[:-4096])
    expected = UnsafeCheckpointError if bad == "crafted" else DamagedCheckpointFileError
    with pytest.raises(expected) as error:
        check_directory(tag)
    message = _one_line_naming(error.value, victim)
    assert all(str(other) not in message for other in tag.glob("*.pt") if other != victim)
    assert not (tmp_path / "MARKER").exists()


# A real DeepSpeed engine (1 rank, ZeRO-2 bf16: optimizer files need all three allowed globals) saves,
# reloads under the guard, then meets a crafted optimizer file: guarded it is refused, unguarded it runs.
GUARD_SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    import torch, deepspeed
    from convbert_ds.engine.distributed import exit_process, init_process_group
    from convbert_ds.formats.safe_pickle import UnsafeCheckpointError, deepspeed_loads_weights_only

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch '{root / 'MARKER'}'",)

    root = Path(sys.argv[1])
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    init_process_group("gloo")  # as the trainer starts it
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    engine.save_checkpoint(str(root), tag="t")
    with deepspeed_loads_weights_only(engine):
        print("GUARDED_LOAD", engine.load_checkpoint(str(root), tag="t")[0] is not None)
    print("RESTORED", "load" not in vars(engine.checkpoint_engine), os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD"))
    optimizer_file = next((root / "t").glob("*optim_states.pt"))
    state = torch.load(optimizer_file, weights_only=False)
    torch.save({**state, "payload": Payload()}, optimizer_file)
    try:
        with deepspeed_loads_weights_only(engine):
            engine.load_checkpoint(str(root), tag="t")
    except UnsafeCheckpointError as error:
        print("REFUSED", error)
    print("MARKER_AFTER_GUARDED", (root / "MARKER").exists())
    engine.load_checkpoint(str(root), tag="t")
    print("MARKER_AFTER_UNGUARDED", (root / "MARKER").exists())
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then
""")


@pytest.mark.slow
def test_deepspeeds_own_loader_is_weights_only_under_the_guard(tmp_path):
    script = tmp_path / "guard.py"
    script.write_text(GUARD_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), free_port()], cwd=REPO,
                            env={**env(), "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=300)
    lines = {line.split(" ", 1)[0]: line for line in result.stdout.splitlines()}
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert lines["GUARDED_LOAD"] == "GUARDED_LOAD True" and lines["RESTORED"] == "RESTORED True None"
    refused = lines.get("REFUSED", result.stdout[-3000:])
    assert f"optim_states.pt: asks for the global {os.system.__module__}.system" in refused, refused
    assert lines["MARKER_AFTER_GUARDED"] == "MARKER_AFTER_GUARDED False"
    assert lines["MARKER_AFTER_UNGUARDED"] == "MARKER_AFTER_UNGUARDED True"  # the guard is what stopped it
