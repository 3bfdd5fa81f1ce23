"""A second phase (the paper's 10% more steps at length 512, here 32 -> 64 tokens) continues a finished run.

Phase 1 trains at 32 tokens on 2 ranks with ZeRO-2; phase 2 starts from its newest checkpoint at 64 tokens,
with its own batch, learning-rate schedule, checkpoint.dir and (ZeRO-1) layout. Checked: the weights it
starts from are phase 1's, its step, schedule and sample stream start at zero, the counts add up over the
phases, and a kill -9 inside phase 2 resumes phase 2 bit for bit (no sample replayed, phase 1 not reread).
"""

import json
import shutil

import pytest
import torch

from convbert_ds.config import ConfigError
from convbert_ds.convert import open_checkpoint, read_state_dict
from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import NOT_THE_SUBJECT, TINY_CONFIG, check, run_training, train_metrics

pytestmark = pytest.mark.slow

PHASE1 = ("data.seq_len=32", "train.steps=6", "train.warmup_steps=2", "checkpoint.interval=6", "eval.interval=0")
PHASE2 = ("data.seq_len=64", "train.steps=8", "train.warmup_steps=2", "train.lr=3.0e-4", "checkpoint.interval=4",
          "eval.interval=4", "train.micro_batch_size=4", "train.global_batch_size=8",
          "deepspeed.config=ds_configs/zero1_bf16.json", "train.precision=fp32", "data.num_workers=1")


@pytest.fixture(scope="module")
def phase1(tiny_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("phase1")
    check(run_training(run, tiny_corpus["shards"], *PHASE1, launcher=NOT_THE_SUBJECT))  # both phase 2s start here
    return run / "checkpoints"


def _phase2(run, tiny_corpus, phase1, *extra, **kwargs):
    # Every phase-2 run, the killed one too, under one launcher: the straight and the resumed runs are compared
    # bit for bit. How ``deepspeed`` reports a kill mid-save is tests/engine/test_train.py's.
    return run_training(run, tiny_corpus["shards"], *PHASE2, f"phase.continue_from={phase1}", *extra,
                        launcher=NOT_THE_SUBJECT, **kwargs)


@pytest.fixture(scope="module")
def straight(phase1, tiny_corpus, tmp_path_factory):
    """An uninterrupted phase 2: (its run directory, its output)."""
    run = tmp_path_factory.mktemp("phase2")
    return run, check(_phase2(run, tiny_corpus, phase1))


def _state(checkpoints, step):
    return json.loads((checkpoints / f"step{step:08d}" / "trainer_state.json").read_text())


def test_phase_2_starts_from_phase_1_with_its_own_schedule_and_data(phase1, straight):
    run, output = straight
    assert f"phase 2: continuing from {phase1 / 'step00000006'} (its step 6, seq_len 32 -> 64" in output
    assert "weights and Adam moments, then 8 steps of its own" in output
    rows = train_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["consumed_samples"] for r in rows] == [8 * s for s in range(1, 9)], "a new sample stream from 0"
    lrs = [r["lr"] for r in rows]
    # its own warm-up (2 steps) and decay (to 0 at step 8), each row the rate its step ran at
    assert lrs == pytest.approx([3e-4 * f for f in (0, 0.5, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6)], abs=1e-12)
    state, before = _state(run / "checkpoints", 8), _state(phase1, 6)
    assert state["phase"]["index"] == 2 and state["phase"]["from_step"] == 6
    assert state["samples_seen"] == before["samples_seen"] + 8 * 8 == 6 * 16 + 64
    assert state["tokens_seen"] == 6 * 16 * 32 + 8 * 8 * 64
    assert json.loads((run / "logs" / "metrics.jsonl").read_text().splitlines()[-1])["split"] == "valid"


def test_phase_2_begins_with_phase_1s_weights(phase1, tiny_corpus, tmp_path):
    """With a learning rate of 0 nothing moves: phase 2's checkpoint holds phase 1's weights exactly."""
    check(_phase2(tmp_path, tiny_corpus, phase1, "train.lr=0.0", "train.steps=4", "phase.optimizer_state=false"))
    ours, theirs = (read_state_dict(open_checkpoint(d))[0] for d in (tmp_path / "checkpoints", phase1))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_kill_inside_phase_2_resumes_phase_2_bit_for_bit(phase1, straight, tiny_corpus, tmp_path):
    straight, killed = straight[0], tmp_path / "killed"
    crashed = _phase2(killed, tiny_corpus, phase1, faults={"kill_during_save": 8})
    assert crashed.returncode != 0
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step00000004"
    output = check(_phase2(killed, tiny_corpus, phase1))
    assert "resumed from" in output and "at step 4 (32 samples consumed)" in output
    assert "phase 2: continuing" not in output, "phase 1 is read once, when phase 2 starts"
    a, b = train_metrics(straight), train_metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a[4:], b[4:]):
        for key in ("loss", "mlm_loss", "rtd_loss", "grad_norm", "consumed_samples", "lr"):
            assert x[key] == y[key], (x["step"], key)
    assert _state(killed / "checkpoints", 8)["phase"] == _state(straight / "checkpoints", 8)["phase"]


def test_a_phase_that_cannot_continue_is_refused_before_any_rank(phase1, tiny_corpus, tmp_path):
    def plan(*overrides):
        cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]",
                                        f"checkpoint.dir={tmp_path / 'p2'}", *overrides])
        return resolve(cfg, world_size=2)

    assert plan(f"phase.continue_from={phase1}").continue_from == phase1 / "step00000006"
    assert plan(f"phase.continue_from={phase1 / 'step00000006'}").continue_from == phase1 / "step00000006"
    cases = {
        "no complete checkpoint there": [f"phase.continue_from={tmp_path}"],
        "inside this run's checkpoint.dir": [f"phase.continue_from={phase1}", f"checkpoint.dir={phase1}"],
        "position table is fixed": [f"phase.continue_from={phase1}", "model.overrides={max_position_embeddings: 64}",
                                    "data.seq_len=64"],
        "use the model config of that phase": [f"phase.continue_from={phase1}",
                                               "model.overrides={num_hidden_layers: 1}"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            plan(*overrides)
    shutil.rmtree(tmp_path / "p2", ignore_errors=True)
