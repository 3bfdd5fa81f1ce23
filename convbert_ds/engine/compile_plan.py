"""The plan's part for ``train.compile`` and ``train.cuda_graphs``: what would split the compiled step's one
graph or break its capture as CUDA graphs is refused before any process group starts, and
``cuda_graphs: auto`` is decided here, once."""

from __future__ import annotations

from convbert_ds.config import ConfigError
from convbert_ds.formats.train_config import TrainConfig


def check_compile(cfg: TrainConfig, ds_config: dict, grad_accum: int, cuda: bool,
                  whole_grads: bool) -> tuple[str, str]:
    """``compile_mode: step`` puts the whole step in one graph, ``cuda_graphs: capture`` records it as CUDA
    graphs; what would split the one or break the other is refused up front. ``whole_grads``:
    ``plan.whole_fp32_grads`` (the captured backward then writes ``.grad`` itself, and can add to it).
    Returns ``train.cuda_graphs`` resolved, and why ``auto`` did not capture (empty when it did, or was not
    asked)."""
    t = cfg.train
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    refused = _capture_refusals(cfg, stage, grad_accum, whole_grads)
    if t.cuda_graphs == "capture" and refused:
        setting, reason = refused[0]
        raise ConfigError(f"train.cuda_graphs=capture with {setting}: {reason}")
    mode, why = t.cuda_graphs, ""
    if mode == "auto":
        if not cuda:  # nothing to capture, and nothing to note
            mode = "off"
        elif refused:  # inductor's trees, where there are any: a compiled step
            mode, why = "inductor" if t.compile and t.compile_mode == "step" else "off", refused[0][0]
        else:
            mode = "capture"
    if t.compile and t.compile_mode == "step":
        _check_compile_step(cfg, stage)
    return mode, why


def _check_compile_step(cfg: TrainConfig, stage: int) -> None:
    if cfg.pipeline.stages > 1:
        raise ConfigError(f"train.compile_mode=step with pipeline.stages={cfg.pipeline.stages}: the pipeline engine "
                          "runs the step layer by layer; use train.compile_mode=layers")
    if stage == 3:
        raise ConfigError("train.compile_mode=step with zero_optimization.stage=3: ZeRO-3 gathers parameters in hooks "
                          "inside the forward, which split the graph; use stage 0-2 or train.compile_mode=layers")


def _capture_refusals(cfg: TrainConfig, stage: int, grad_accum: int, whole_grads: bool) -> list[tuple[str, str]]:
    """What ``model/step_capture.py`` cannot replay, as (setting, reason) pairs (checked on CPU too: the same
    file runs on the cluster)."""
    other = "use train.cuda_graphs=inductor, auto or off"
    refused = [(cfg.pipeline.stages > 1, f"pipeline.stages={cfg.pipeline.stages}",
                f"the pipeline engine runs the step layer by layer; {other}"),
               (stage == 3, "zero_optimization.stage=3",
                f"ZeRO-3 gathers parameters in hooks inside the forward; use stage 0-2, or {other}"),
               (cfg.train.activation_checkpointing, "train.activation_checkpointing=true",
                f"the recomputation saves and restores the random state inside the backward; {other}"),
               (grad_accum > 1 and not whole_grads, f"{grad_accum} micro-batches per step",
                "with ZeRO-1/2, DeepSpeed's own bf16/fp16 weights or fp16's loss scaling, the captured backward "
                "hands its gradients to DeepSpeed in memory that the next micro-batch's replay overwrites before "
                "they add up; set "
                "train.micro_batch_size to train.global_batch_size / ranks, use a ZeRO-0 file with fp32 weights "
                f"(ds_configs/zero0_autocast_bf16.json, where the captured step adds them up itself), or {other}")]
    return [(setting, reason) for refuse, setting, reason in refused if refuse]
