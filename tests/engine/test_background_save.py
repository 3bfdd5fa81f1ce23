"""``checkpoint.background``: interval checkpoints written, hashed and committed in a thread while training goes
on, on 2 gloo CPU ranks. The same training and the same checkpoints as saves the step loop waits for: losses
equal to the bit, an exact resume from a checkpoint saved in the background, the previous checkpoint the
newest complete one after a kill -9 mid-save, and a failed save that training survives."""

import shutil
from collections import OrderedDict

import pytest
import torch

from convbert_ds.engine.checkpoint import host_copy
from convbert_ds.formats.checkpoint import directory as tags
from launch import NOT_THE_SUBJECT, check, run_training, train_metrics

COMMON = ("train.steps=12", "train.warmup_steps=3", "eval.interval=0", "checkpoint.interval=4",
          "checkpoint.keep_last=2")
BACKGROUND = "checkpoint.background=true"
TAG4, TAG8, TAG12 = (tags.tag_for(step) for step in (4, 8, 12))
KEYS = ("loss", "mlm_loss", "rtd_loss", "grad_norm", "consumed_samples")


def test_the_host_copy_is_the_state_as_it_was_with_its_shared_storage(tmp_path):
    """What a background save writes: the states at the save, not as the step loop changes them next, and
    tensors that share storage still sharing it once saved and loaded (ZeRO's one ``step`` tensor for every
    parameter group: two equal ones instead made the resumed run diverge at its second step)."""
    flat = torch.arange(12.0)
    step = torch.tensor(4.0)
    state = OrderedDict(weights=[flat[:4], flat[4:].view(2, 4)], groups={0: {"step": step}, 1: {"step": step}},
                        config=("adam", 0.9), lr=1e-3)
    copied = host_copy(state)
    flat.add_(100)
    step.add_(1)
    assert type(copied) is OrderedDict and copied["config"] == ("adam", 0.9) and copied["lr"] == 1e-3
    assert torch.equal(copied["weights"][0], torch.arange(4.0)) and copied["weights"][1][1, 3].item() == 11.0
    torch.save(copied, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    loaded["groups"][0]["step"].add_(1)  # as an optimizer's step does: the other group sees it, as before
    assert loaded["groups"][1]["step"].item() == 5.0
    assert loaded["weights"][0].untyped_storage().data_ptr() == loaded["weights"][1].untyped_storage().data_ptr()


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """The same 12 steps saved every 4 steps, waited for and in the background."""
    done = {}
    for name, switch in (("waited", "checkpoint.background=false"), ("background", BACKGROUND)):
        run_dir = tmp_path_factory.mktemp(name)
        done[name] = run_dir, check(run_training(run_dir, tiny_corpus["shards"], *COMMON, switch,
                                                 launcher=NOT_THE_SUBJECT))
    return done


def _assert_same_steps(a_dir, b_dir, first: int):
    a, b = train_metrics(a_dir), train_metrics(b_dir)
    assert [r["step"] for r in b][-1] == 12
    for x, y in zip(a[first - 1:], [r for r in b if r["step"] >= first]):
        for key in KEYS:
            assert x[key] == y[key], (x["step"], key, x[key], y[key])


@pytest.mark.slow
def test_background_saves_train_as_waited_ones_and_say_what_the_loop_waited(runs):
    (waited, said_waited), (background, said) = runs["waited"], runs["background"]
    _assert_same_steps(waited, background, 1)
    ckpt = background / "checkpoints"
    for tag in (TAG4, TAG8):  # interval saves: started in the step loop, ended in the background
        assert f"saving checkpoint {ckpt / tag} in the background (the step loop waited " in said, said[-3000:]
        assert f"saved checkpoint {ckpt / tag} (in the background: " in said, said[-3000:]
    # The run's last save is waited for; so is every save without the switch.
    assert f"saved checkpoint {ckpt / TAG12} (the step loop waited " in said
    assert f"saved checkpoint {waited / 'checkpoints' / TAG8} (the step loop waited " in said_waited
    assert "in the background" not in said_waited
    # keep_last=2 applied by the background save too; latest names the last.
    assert tags.complete_tags(ckpt) == [TAG8, TAG12] and (ckpt / tags.LATEST).read_text().strip() == TAG12


@pytest.mark.slow
def test_a_checkpoint_saved_in_the_background_resumes_exactly(runs, tiny_corpus, tmp_path):
    """Step 8's checkpoint, written while steps 9+ trained, resumed with its checksums verified (the default):
    steps 9-12 again, to the bit."""
    straight = runs["background"][0]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / TAG12)
    (resumed / "checkpoints" / tags.LATEST).write_text(TAG8 + "\n")
    output = check(run_training(resumed, tiny_corpus["shards"], *COMMON, BACKGROUND, launcher=NOT_THE_SUBJECT))
    assert "at step 8" in output
    _assert_same_steps(straight, resumed, 9)


@pytest.mark.slow
def test_a_kill_during_a_background_save_leaves_the_previous_checkpoint(tiny_corpus, tmp_path):
    crashed = run_training(tmp_path, tiny_corpus["shards"], *COMMON, BACKGROUND, launcher=NOT_THE_SUBJECT,
                           faults={"kill_during_save": 8})
    assert crashed.returncode != 0
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / tags.LATEST).read_text().strip() == TAG4
    assert tags.complete_tags(ckpt) == [TAG4] and not (ckpt / TAG8 / tags.COMPLETE).exists()
    output = check(run_training(tmp_path, tiny_corpus["shards"], *COMMON, BACKGROUND, launcher=NOT_THE_SUBJECT))
    assert f"removed incomplete checkpoint(s) ['{TAG8}']" in output and "at step 4" in output
    assert tags.complete_tags(ckpt) == [TAG8, TAG12]


@pytest.mark.slow
def test_a_failed_background_save_is_a_warning_and_training_goes_on(runs, tiny_corpus, tmp_path):
    """ENOSPC on rank 1 after DeepSpeed's files (injected): both ranks learn it from the background save's own
    group, the step loop says it at its next wait, and the next save (the run's last) is complete."""
    output = check(run_training(tmp_path, tiny_corpus["shards"], *COMMON, BACKGROUND, launcher=NOT_THE_SUBJECT,
                                faults={"fail_save": 8}))
    ckpt = tmp_path / "checkpoints"
    warning = next(line for line in output.splitlines() if line.startswith("warning: checkpoint"))
    assert warning.startswith(f"warning: checkpoint {TAG8} not saved in {ckpt}: rank 1: [Errno 28]"), warning
    assert warning.endswith(f"latest still names {TAG4}; training goes on and saves again at step 12"), warning
    assert tags.complete_tags(ckpt) == [TAG4, TAG12] and not (ckpt / TAG8).exists()
    _assert_same_steps(runs["background"][0], tmp_path, 1)  # the failure changed nothing in training
