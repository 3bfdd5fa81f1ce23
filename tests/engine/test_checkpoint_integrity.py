"""Checkpoint integrity: the COMPLETE manifest, resuming past a damaged checkpoint (truncated, bit-flipped),
and saves that fail (injected ENOSPC on one rank, a real full filesystem) without losing the run.

The format and verification tests need no DeepSpeed; the rest train on 2 gloo CPU ranks, a few steps each.
"""

import os
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

from convbert_ds.formats.checkpoint import directory as checkpoint
from convbert_ds.formats.checkpoint import rng
from launch import NOT_THE_SUBJECT, check, run_training, train_metrics

TAG2, TAG4, TAG6 = (checkpoint.tag_for(step) for step in (2, 4, 6))
COMMON = ("train.steps=6", "train.warmup_steps=3", "eval.interval=0", "checkpoint.interval=2",
          "checkpoint.keep_last=3")


# The manifest, without DeepSpeed ------------------------------------------------------------------


def _fake_tag(directory, step, payload=b"weights" * 1000):
    tag_dir = directory / checkpoint.tag_for(step)
    (tag_dir / "sub").mkdir(parents=True)
    (tag_dir / "model.pt").write_bytes(payload)
    (tag_dir / "sub" / "layer_01.pt").write_bytes(b"x" * 10)
    (tag_dir / checkpoint.UNIVERSAL).mkdir()
    (tag_dir / checkpoint.UNIVERSAL / "converted.pt").write_bytes(b"cached later, not part of the save")
    checkpoint.write_manifest(tag_dir, world_size=2)
    return tag_dir


def _flip_a_bit(path, offset=None):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_round_trip(tmp_path):
    tag_dir = _fake_tag(tmp_path, 2)
    manifest = checkpoint.read_manifest(tag_dir)
    assert manifest["format"] == 1 and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == ["model.pt", "sub/layer_01.pt"]  # not COMPLETE, not universal/
    assert manifest["files"]["model.pt"]["size"] == 7000
    assert len(manifest["files"]["model.pt"]["sha256"]) == 64
    assert checkpoint.verify(tag_dir, "size") is None and checkpoint.verify(tag_dir, "checksum") is None
    (tag_dir / checkpoint.UNIVERSAL / "converted.pt").write_bytes(b"changed")  # not the manifest's business
    assert checkpoint.verify(tag_dir, "checksum") is None


def test_verify_names_the_file_and_what_is_wrong(tmp_path):
    tag_dir = _fake_tag(tmp_path, 2)
    _flip_a_bit(tag_dir / "model.pt")
    assert checkpoint.verify(tag_dir, "size") is None  # a bit flip does not change a size
    assert checkpoint.verify(tag_dir, "checksum") == "model.pt: checksum mismatch"
    (tag_dir / "model.pt").write_bytes(b"short")
    assert checkpoint.verify(tag_dir, "size") == "model.pt: size 5, expected 7000"
    (tag_dir / "sub" / "layer_01.pt").unlink()
    assert checkpoint.verify(tag_dir, "size") == "model.pt: size 5, expected 7000"  # the first in path order
    (tag_dir / "model.pt").write_bytes(b"weights" * 1000)
    assert checkpoint.verify(tag_dir, "size") == "sub/layer_01.pt: missing"
    (tag_dir / checkpoint.COMPLETE).write_text("{not json")
    assert checkpoint.verify(tag_dir, "size") == "COMPLETE: not valid JSON"


def test_old_complete_marker_still_loads_unverified(tmp_path):
    tag_dir = tmp_path / TAG2
    tag_dir.mkdir()
    (tag_dir / "model.pt").write_bytes(b"anything")
    (tag_dir / checkpoint.COMPLETE).write_text("2\n")
    assert checkpoint.read_manifest(tag_dir) is None
    assert checkpoint.verify(tag_dir, "checksum") is None
    assert checkpoint.choose_resume_tag(tmp_path, "checksum") == TAG2


def test_choose_resume_tag_sets_a_damaged_tag_aside(tmp_path, capsys):
    for step in (2, 4, 6):
        _fake_tag(tmp_path, step)
    (tmp_path / checkpoint.LATEST).write_text(TAG6 + "\n")
    _flip_a_bit(tmp_path / TAG6 / "sub" / "layer_01.pt", 0)
    assert checkpoint.choose_resume_tag(tmp_path, "size") == TAG6  # size mode cannot see a bit flip
    assert checkpoint.choose_resume_tag(tmp_path, "checksum") == TAG4
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "sub/layer_01.pt: checksum mismatch" in lines[0]
    assert f"kept as {TAG6}.damaged" in lines[0] and lines[0].endswith(f"resuming from {TAG4}")
    assert (tmp_path / f"{TAG6}.damaged" / "model.pt").is_file()  # kept for inspection, never chosen again
    assert (tmp_path / checkpoint.LATEST).read_text() == TAG6 + "\n"  # moves at the next complete save
    assert checkpoint.complete_tags(tmp_path) == [TAG2, TAG4]
    assert checkpoint.choose_resume_tag(tmp_path, "checksum") == TAG4
    # ``latest`` written back to an older tag by hand: verification starts there.
    (tmp_path / checkpoint.LATEST).write_text(TAG2 + "\n")
    assert checkpoint.choose_resume_tag(tmp_path, "checksum") == TAG2


def test_no_intact_checkpoint_is_an_error(tmp_path):
    (_fake_tag(tmp_path, 2) / "model.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=f"no intact checkpoint in .*{TAG2}: model.pt: missing"):
        checkpoint.choose_resume_tag(tmp_path, "size")
    assert (tmp_path / TAG2).is_dir()


def test_rng_file_loads_with_weights_only(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal()  # a cached gaussian in numpy's state too
    torch.save(rng.rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    rng.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]
    # Files written before (numpy's state pickled as an array) stay resumable, weights-only too.
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               tmp_path / "old.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    rng.set_rng_state(rng.load_rng_file(tmp_path / "old.pt"))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


# Real training on 2 ranks -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def failed_save_run(tiny_corpus, tmp_path_factory):
    """6 steps, a checkpoint every 2; rank 1's save at step 4 fails (after DeepSpeed wrote its files). It and
    the resumes from its damaged copies are the trainer's work, not the launcher's (``NOT_THE_SUBJECT``); what
    ``deepspeed`` users see of a refused checkpoint and of a failed final save is tested under it, below."""
    run_dir = tmp_path_factory.mktemp("failed_save")
    output = check(run_training(run_dir, tiny_corpus["shards"], *COMMON, launcher=NOT_THE_SUBJECT,
                                faults={"fail_save": 4}))
    return run_dir, output


def _resume_after_damage(failed_save_run, tiny_corpus, run_dir, damage, *overrides) -> str:
    shutil.copytree(failed_save_run[0], run_dir)
    damage(run_dir / "checkpoints" / TAG6)
    return check(run_training(run_dir, tiny_corpus["shards"], *COMMON, *overrides, launcher=NOT_THE_SUBJECT))


def _assert_resumed_bitwise(straight_dir, resumed_dir):
    straight, resumed = train_metrics(straight_dir), train_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(straight[2:], resumed[2:]):
        for key in ("loss", "mlm_loss", "rtd_loss", "grad_norm", "consumed_samples"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_failed_save_warns_and_training_goes_on(failed_save_run):
    run_dir, output = failed_save_run
    ckpt = run_dir / "checkpoints"
    warnings = [line for line in output.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 1, output[-4000:]
    assert (f"{TAG4} not saved in {ckpt}: rank 1: [Errno 28] No space left on device" in warnings[0]
            and " free there, a checkpoint takes " in warnings[0] and f"latest still names {TAG2}" in warnings[0]
            and warnings[0].endswith("saves again at step 6")), warnings[0]
    assert not (ckpt / TAG4).exists()  # the partial files are gone
    assert f"saved checkpoint {ckpt / TAG6}" in output and "done: 6 steps" in output
    assert checkpoint.complete_tags(ckpt) == [TAG2, TAG6] and (ckpt / "latest").read_text().strip() == TAG6
    assert [r["step"] for r in train_metrics(run_dir)] == list(range(1, 7))


@pytest.mark.slow
def test_truncated_file_falls_back_to_the_previous_checkpoint(failed_save_run, tiny_corpus, tmp_path):
    """verify=size is enough for a truncation; the resume from step 2 matches the run that never stopped."""
    def truncate(tag_dir):
        with open(tag_dir / "mp_rank_00_model_states.pt", "r+b") as f:
            f.truncate(1000)

    size = (failed_save_run[0] / "checkpoints" / TAG6 / "mp_rank_00_model_states.pt").stat().st_size
    output = _resume_after_damage(failed_save_run, tiny_corpus, tmp_path / "run", truncate, "checkpoint.verify=size")
    warnings = [line for line in output.splitlines() if line.startswith("warning: checkpoint")]
    assert warnings == [f"warning: checkpoint {tmp_path / 'run' / 'checkpoints' / TAG6} is damaged "
                        f"(mp_rank_00_model_states.pt: size 1000, expected {size}); kept as {TAG6}.damaged for "
                        f"inspection, resuming from {TAG2}"], output[-4000:]
    assert "at step 2 (32 samples consumed)" in output
    ckpt = tmp_path / "run" / "checkpoints"
    assert checkpoint.complete_tags(ckpt) == [TAG2, TAG4, TAG6] and (ckpt / "latest").read_text().strip() == TAG6
    assert (ckpt / f"{TAG6}.damaged" / "mp_rank_00_model_states.pt").stat().st_size == 1000
    _assert_resumed_bitwise(failed_save_run[0], tmp_path / "run")


@pytest.mark.slow
def test_bit_flip_is_caught_by_the_checksum(failed_save_run, tiny_corpus, tmp_path):
    output = _resume_after_damage(failed_save_run, tiny_corpus, tmp_path / "run",
                                  lambda tag_dir: _flip_a_bit(tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    warnings = [line for line in output.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 1 and "(zero_pp_rank_1_mp_rank_00_optim_states.pt: checksum mismatch)" in warnings[0]
    assert warnings[0].endswith(f"resuming from {TAG2}") and "at step 2 (32 samples consumed)" in output
    _assert_resumed_bitwise(failed_save_run[0], tmp_path / "run")


class _RunsACommand:
    """Unpickled by full pickle, it runs a shell command: what a crafted checkpoint file would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.slow
def test_a_pickled_global_is_one_line_and_nothing_runs(failed_save_run, tiny_corpus, tmp_path):
    """A crafted optimizer file in an otherwise intact checkpoint (its manifest rewritten to match, as by
    someone who controls the directory): refused before DeepSpeed reads it, one line, no code run."""
    run_dir, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(failed_save_run[0], run_dir)
    tag_dir = run_dir / "checkpoints" / TAG6
    crafted = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _RunsACommand(f"touch '{marker}'")}, crafted)
    checkpoint.write_manifest(tag_dir, world_size=2)
    result = run_training(run_dir, tiny_corpus["shards"], *COMMON, "train.steps=8")
    assert result.returncode == 2, (result.stdout + result.stderr)[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(crafted) in errors[0] and "posix.system" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not marker.exists()


def _final_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error: checkpoint")]
    assert len(lines) == 1, output[-4000:]
    return lines[0]


@pytest.mark.slow
def test_failed_final_save_exits_non_zero_and_says_what_is_lost(tiny_corpus, tmp_path):
    result = run_training(tmp_path, tiny_corpus["shards"], *COMMON, "train.steps=4",
                          faults={"fail_save": 4})
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "done:" not in output
    ckpt = tmp_path / "checkpoints"
    line = _final_line(output)
    assert line.startswith(f"error: checkpoint {TAG4} not saved in {ckpt}: rank 1: [Errno 28]"), line
    assert line.endswith(f"steps 3-4 are not saved; the last complete checkpoint is {ckpt / TAG2}"), line
    assert checkpoint.complete_tags(ckpt) == [TAG2] and not (ckpt / TAG4).exists()
    assert (ckpt / "latest").read_text().strip() == TAG2


@pytest.mark.slow
def test_a_full_filesystem(tiny_corpus, tmp_path):
    """A real ENOSPC in the middle of DeepSpeed's own writes: one checkpoint (6.8 MB) fits in 9 MB, two do not."""
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(ckpt)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        result = run_training(tmp_path, tiny_corpus["shards"], *COMMON, "train.steps=4", launcher=NOT_THE_SUBJECT)
        output = result.stdout + result.stderr
        assert result.returncode != 0
        line = _final_line(output)
        # torch.save's zip writer reports a full disk as "unexpected pos N vs M": the free space says why
        assert f"{TAG4} not saved in {ckpt}: rank " in line and " MB free there, a checkpoint takes " in line, line
        assert line.endswith(f"the last complete checkpoint is {ckpt / TAG2}"), line
        assert checkpoint.complete_tags(ckpt) == [TAG2] and not (ckpt / TAG4).exists()
        assert checkpoint.verify(ckpt / TAG2, "checksum") is None
    finally:
        subprocess.run(["umount", str(ckpt)], check=True)
