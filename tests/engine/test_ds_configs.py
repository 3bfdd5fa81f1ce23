"""Every file in ds_configs/ as DeepSpeed's own config parser reads it, after the trainer has written
our batch sizes, optimiser, schedule and precision into it (`build_ds_config`); and a DeepSpeed file
that sets what the trainer owns is refused, naming the training-config key to use.

The training runs with these files are in test_train.py (and test_convert.py for ZeRO-0 fp32). DeepSpeed
refuses fp16 on CPU, so for the fp16 files this parse is the check that runs here; training with them
needs a GPU."""

import json
import re

import pytest
import torch
from deepspeed.runtime.config import DeepSpeedConfig

from convbert_ds.config import ConfigError
from convbert_ds.engine.plan import build_ds_config, host_sync_warnings, load_ds_config, precision_of
from convbert_ds.formats.train_config import load_config
from launch import REPO, TINY_CONFIG

FILES = sorted((REPO / "ds_configs").glob("*.json"))


def test_every_precision_and_zero_stage_has_a_file():
    names = {path.stem for path in FILES}
    for stage in range(4):
        assert {f"zero{stage}_bf16", f"zero{stage}_fp16"} <= names
    assert {"zero0_fp32", "zero3_offload_bf16", "pipeline_zero1_bf16"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_file_parses_in_deepspeed_as_its_name_says(path):
    # train.precision=null: the precision comes from the file, as for a user who does not set it.
    cfg = load_config(TINY_CONFIG, [f"deepspeed.config={path}", "train.precision=null"])
    base = load_ds_config(cfg)
    precision = precision_of(cfg, base)
    assert precision == path.stem.split("_")[-1]
    grad_accum = cfg.train.global_batch_size // cfg.train.micro_batch_size  # one data-parallel rank
    parsed = DeepSpeedConfig(build_ds_config(cfg, base, cfg.train.micro_batch_size, grad_accum, precision))

    stage = 1 if path.stem.startswith("pipeline") else int(path.stem[len("zero")])
    assert parsed.zero_optimization_stage == stage
    autocast = "autocast" in path.stem  # fp32 weights and optimizer, the forward in bf16 under torch.autocast
    assert parsed.torch_autocast_enabled == autocast
    if autocast:
        assert parsed.torch_autocast_dtype == torch.bfloat16
    enabled = parsed.float16_config.enabled, parsed.bfloat16_config.enabled
    assert enabled == (precision == "fp16" and not autocast, precision == "bf16" and not autocast)
    # ZeRO-0 with fp32 weights: the trainer clips in one fused call and DeepSpeed not at all.
    assert parsed.gradient_clipping == (0 if stage == 0 and not any(enabled) else cfg.train.grad_clip)
    assert parsed.train_batch_size == cfg.train.global_batch_size
    assert parsed.gradient_accumulation_steps == grad_accum
    if precision == "fp16":
        assert parsed.float16_config.loss_scale == 0  # dynamic: overflowing steps are skipped, the scale backs off
    if "offload" in path.stem:
        assert parsed.zero_config.offload_optimizer.device == "cpu"
    # The lean step (test_engine_budget.py counts it): no throughput timer, no per-tensor overflow test in bf16
    # ZeRO-1/2, torch's fused AdamW; only the unfused ZeRO-0 fp16/bf16 optimizer is left to warn about.
    assert not parsed.timers_config.enabled and not parsed.wall_clock_breakdown
    assert parsed.optimizer_params["fused"] is True
    if precision == "bf16" and stage in (1, 2):
        assert parsed.bfloat16_config.check_grad_overflow is False
    warnings = host_sync_warnings(build_ds_config(cfg, base, cfg.train.micro_batch_size, grad_accum, precision))
    if stage == 0 and any(enabled):
        assert len(warnings) == 1 and warnings[0].startswith(f"{precision} with zero_optimization.stage=0")
    else:
        assert warnings == []


def test_settings_that_sync_every_step_are_named_with_their_fix():
    ds = {"wall_clock_breakdown": True, "memory_breakdown": True, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2}}
    warnings = host_sync_warnings(ds)
    assert [line.split(" ")[0] for line in warnings] == [
        "bf16.check_grad_overflow", "DeepSpeed's", "wall_clock_breakdown=true", "memory_breakdown=true"]
    assert all("set it to false" in line or '"enabled": false' in line for line in warnings)
    assert host_sync_warnings({"timers": {"throughput": {"synchronized": False}}}) == []
    stage0 = host_sync_warnings({**ds, "zero_optimization": {}})[0]
    assert "use torch autocast (ds_configs/zero0_autocast_bf16.json, the default)" in stage0
    assert "stage 1 (ds_configs/zero1_bf16.json)" in stage0


@pytest.mark.parametrize("extra, message", [
    ({"train_batch_size": 256}, "train_batch_size is set by the trainer from the training config; delete it there "
                                "and set train.global_batch_size instead"),
    ({"optimizer": {"type": "AdamW"}}, "set train.lr, train.weight_decay and train.adam_* instead"),
    ({"pipeline": {"activation_checkpoint_interval": 1}}, "set train.activation_checkpointing instead"),
])
def test_a_key_the_trainer_owns_is_refused_by_name(extra, message, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, **extra}))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_ds_config(load_config(TINY_CONFIG, [f"deepspeed.config={path}"]))


def test_an_autocast_dtype_that_is_not_bf16_or_fp16_is_refused_by_name():
    cfg = load_config(TINY_CONFIG, ["deepspeed.config={torch_autocast: {enabled: true, dtype: fp32}}",
                                    "train.precision=null"])
    with pytest.raises(ConfigError, match=re.escape("torch_autocast.dtype='fp32'; use bf16 or fp16")):
        precision_of(cfg, load_ds_config(cfg))
