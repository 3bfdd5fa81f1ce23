"""The learning-rate schedule a run resolves to runs ``train.warmup_steps`` as asked, 0 and 1 included:
driven as DeepSpeed's engine drives a scheduler (the optimizer steps at the groups' rate, then ``step()``), on
the plan ``--check-config`` and the trainer resolve from real shards. DeepSpeed's own WarmupDecayLR, which the
plan used to configure, ran at least 2 warm-up steps and two steps at 0 (asked for none: 0, 0, lr/2, lr)."""

import pytest
import torch

from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from convbert_ds.model.optim import LinearWarmupDecayLR
from launch import TINY_CONFIG

PEAK = 1e-3


def _plan(tiny_corpus, tmp_path, *overrides):
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}', weight: 1.0}}]",
                                    f"checkpoint.dir={tmp_path / 'checkpoints'}", f"train.lr={PEAK}", *overrides])
    return resolve(cfg, world_size=2)


def _rates(scheduler_factory, steps: int) -> list[float]:
    """The rate each optimizer step runs at, from the first: DeepSpeed's engine order (its ``_take_model_step``:
    the optimizer steps at the groups' rate, then the scheduler's ``step()``)."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}]
    optimizer = torch.optim.AdamW(groups, lr=123.0)  # the rate DeepSpeed's config gives: the schedule replaces it
    scheduler = scheduler_factory(optimizer)
    rates = []
    for _ in range(steps):
        assert len({g["lr"] for g in optimizer.param_groups}) == 1, "every group at the same rate"
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        if isinstance(scheduler, LinearWarmupDecayLR):  # what the step's log line reports: the rate it ran at
            assert scheduler.ran_lr() == pytest.approx([rates[-1]] * 2, abs=1e-15)
            other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1)) for _ in groups], lr=123.0)
            resumed = LinearWarmupDecayLR(other, scheduler.peak, scheduler.warmup_steps, scheduler.total_steps)
            resumed.load_state_dict(scheduler.state_dict())
            assert resumed.ran_lr() == pytest.approx([rates[-1]], abs=1e-15), "after a resume too"
    return rates


@pytest.mark.parametrize("warmup, expected", [
    (0, [1.0, 0.8, 0.6, 0.4, 0.2]),
    (1, [0.0, 1.0, 0.75, 0.5, 0.25]),
    (3, [0.0, 1 / 3, 2 / 3, 1.0, 0.5]),
])
def test_the_resolved_schedule_runs_the_warmup_asked(warmup, expected, tiny_corpus, tmp_path):
    plan = _plan(tiny_corpus, tmp_path, "train.steps=5", f"train.warmup_steps={warmup}")
    assert plan.lr_schedule.warmup_steps == warmup and plan.lr_schedule.total_steps == 5
    assert "scheduler" not in plan.ds_config, "one schedule: DeepSpeed's would clamp the warm-up to 2"
    assert _rates(plan.lr_schedule, 5) == pytest.approx([PEAK * f for f in expected], abs=1e-15)
    assert plan.lr_schedule.note(warmup) is None, "nothing to say: what runs is what was asked"


def test_a_warmup_longer_than_the_run_is_cut_and_said(tiny_corpus, tmp_path):
    """The peak is reached by the last step; the start-of-run note says the warm-up that runs."""
    plan = _plan(tiny_corpus, tmp_path, "train.steps=4", "train.warmup_steps=10")
    assert plan.lr_schedule.warmup_steps == 3
    assert _rates(plan.lr_schedule, 4) == pytest.approx([0.0, PEAK / 3, 2 * PEAK / 3, PEAK], abs=1e-15)
    assert plan.lr_schedule.note(plan.cfg.train.warmup_steps) == (
        "note: train.warmup_steps=10 with train.steps=4: the warm-up runs 3 steps, so that the peak learning rate "
        "is reached by the last step; set train.warmup_steps <= 3")


def test_a_checkpoints_scheduler_state_resumes_at_its_step():
    """The state is DeepSpeed's scheduler's (``last_batch_iteration`` = completed steps - 1): a checkpoint
    written with either resumes at the rate of its next step."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    straight = LinearWarmupDecayLR(optimizer, PEAK, 2, 10)
    for _ in range(4):
        straight.step()
    resumed = LinearWarmupDecayLR(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=PEAK), PEAK, 2, 10)
    resumed.load_state_dict(straight.state_dict())
    assert straight.state_dict() == {"last_batch_iteration": 3}
    assert resumed.get_lr() == straight.get_lr() == pytest.approx([PEAK * 6 / 8])  # step 5 of 10, after 2 up
