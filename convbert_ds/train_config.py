"""The training run's one config file: typed, loaded from YAML/JSON + ``key=value`` overrides,
validated once, before any process group starts.

    model:      {preset: small, objective: electra, overrides: {...}, init_from_hf: null}
    data:       {sets: [{path: SHARD_DIR, weight: 1.0}], seq_len: 128}
    train:      {micro_batch_size: 32, global_batch_size: 128, steps: 1000000, lr: 3e-4, ...}
    checkpoint: {dir: runs/x/checkpoints, interval: 5000, keep_last: 3}
    eval:       {interval: 5000, samples: 2048}
    log:        {interval: 50, dir: null}
    deepspeed:  {config: ds_configs/zero1_bf16.json}       # a path, or an inline dict
    pipeline:   {stages: 1}

Batch sizes, optimiser, schedule, precision and gradient clipping live here and
are written into the DeepSpeed config (one source of truth); the DeepSpeed
file contributes the ZeRO stage, offload and communication settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from convbert_ds.config import ConfigError, ElectraConfig, generator_config, preset, preset_generator_multiplier

PRECISIONS = ("fp32", "bf16", "fp16")
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ModelSection:
    preset: str = "small"
    objective: str = "electra"
    generator_multiplier: float | None = None  # default: the paper's (1/4 small, 1/3 base)
    rtd_weight: float = 50.0
    # ELECTRA's "tie all weights": the generator is the discriminator's encoder under its own MLM head
    # (generator_multiplier 1.0). With rtd_weight 1, what makes the tiny preset transfer (configs/quickstart.yaml).
    tie_generator_body: bool = False
    mask_prob: float = 0.15
    overrides: dict = field(default_factory=dict)  # any ModelConfig field, e.g. {num_hidden_layers: 2}
    # Continue pretraining a published model: a directory written by
    # `python -m convbert_ds.convert --from-hf HF_DIR --out INIT_DIR`; its config replaces preset/overrides.
    init_from_hf: str | None = None


@dataclass
class DataSection:
    sets: list = field(default_factory=list)  # [{path: SHARD_DIR, weight: 1.0}, ...]
    seq_len: int = 128
    seed: int = 1234
    num_workers: int = 1
    cache_dir: str | None = None  # where sample indexes go when the shard dirs are read-only


@dataclass
class TrainSection:
    micro_batch_size: int = 32
    global_batch_size: int = 128
    steps: int = 1000
    lr: float = 3e-4
    warmup_steps: int = 10000
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-6
    grad_clip: float = 1.0
    precision: str | None = None  # fp32 | bf16 | fp16; None: as the DeepSpeed file says
    seed: int = 1234
    activation_checkpointing: bool = False
    max_nonfinite_in_a_row: int = 10
    peak_tflops: float | None = None  # per device, for MFU; None: known GPUs only


@dataclass
class CheckpointSection:
    dir: str = "runs/default/checkpoints"
    interval: int = 1000
    keep_last: int = 3


@dataclass
class DownstreamSection:
    """Transfer watched during pretraining: every ``interval`` steps (at a checkpoint) rank 0 fine-tunes
    that checkpoint's discriminator on a task, in a separate low-priority process (convbert_ds.finetune),
    and logs the score next to a random-init baseline measured once per run. ``interval`` 0 = off."""

    interval: int = 0
    glue_task: str | None = None
    data_dir: str | None = None
    train: str | None = None
    validation: str | None = None
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    task_type: str | None = None
    finetune_args: list = field(default_factory=list)  # more finetune options, e.g. [--epochs, 2, --seeds, 3]
    random_baseline: bool = True
    nice: int = 10  # scheduling priority of the probe: the training ranks come first
    threads: int = 1  # torch threads of the probe process


@dataclass
class EvalSection:
    interval: int = 1000
    samples: int = 1024
    downstream: DownstreamSection = field(default_factory=DownstreamSection)


@dataclass
class LogSection:
    interval: int = 10
    dir: str | None = None  # TensorBoard events + metrics.jsonl; default: next to checkpoint.dir


@dataclass
class DeepSpeedSection:
    config: typing.Any = "ds_configs/zero1_bf16.json"


@dataclass
class PipelineSection:
    stages: int = 1
    partition_method: str = "parameters"


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: LogSection = field(default_factory=LogSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def log_dir(self) -> Path:
        return Path(self.log.dir) if self.log.dir else Path(self.checkpoint.dir).parent / "logs"


# Loading ----------------------------------------------------------------------


def _build(cls, values: dict, where: str):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types by name."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        path = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, path)
        else:
            kwargs[name] = _coerce(value, hint, path)
    return cls(**kwargs)


def _coerce(value, hint, path: str):
    if hint is typing.Any:
        return value
    allowed = typing.get_args(hint) or (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{path}: may not be null")
    for kind in allowed:
        origin = typing.get_origin(kind) or kind
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin in (str, bool, list, dict) and isinstance(value, origin):
            return value
    names = [getattr(k, "__name__", str(k)) for k in allowed]
    raise ConfigError(f"{path}={value!r}: expected {' or '.join(names)}")


def _set_path(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """``["train.lr=1e-4", "model.overrides.num_hidden_layers=2"]`` -> nested dict (values parsed as YAML)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), yaml.safe_load(raw))
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> TrainConfig:
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        with open(path) as f:
            values = (json.load(f) if path.suffix == ".json" else yaml.safe_load(f)) or {}
    return _build(TrainConfig, _merge(values, parse_overrides(list(overrides))), "")


# The resolved pieces the trainer needs --------------------------------------------


def resolve_ds_path(value: str) -> Path:
    """DeepSpeed config paths are relative to the working directory, else to this repository."""
    path = Path(value)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    if not path.is_file():
        raise ConfigError(f"deepspeed.config={value!r}: file not found; use one of ds_configs/*.json "
                          "or an inline mapping")
    return path


def load_ds_config(cfg: TrainConfig) -> dict:
    raw = cfg.deepspeed.config
    if isinstance(raw, dict):
        return json.loads(json.dumps(raw))
    if not isinstance(raw, str):
        raise ConfigError(f"deepspeed.config: expected a path or a mapping, got {raw!r}")
    with open(resolve_ds_path(raw)) as f:
        return json.load(f)


def precision_of(cfg: TrainConfig, ds_config: dict) -> str:
    if cfg.train.precision is not None:
        return cfg.train.precision
    if ds_config.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def electra_config(cfg: TrainConfig, vocab_size: int, special_ids: dict) -> ElectraConfig:
    """The model, sized to the tokenizer the shards were made with."""
    if cfg.model.init_from_hf:
        return _electra_from_init(cfg, vocab_size, special_ids)
    overrides = dict(cfg.model.overrides)
    if overrides.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(f"model.overrides.vocab_size={overrides['vocab_size']} but the shards' tokenizer has "
                          f"{vocab_size} tokens; drop the override (the vocabulary is read from the manifest)")
    overrides.update(vocab_size=vocab_size, pad_token_id=special_ids["pad"])
    overrides.setdefault("max_position_embeddings", max(cfg.data.seq_len, 128))
    disc = preset(cfg.model.preset, **overrides)
    tied = cfg.model.tie_generator_body
    mult = cfg.model.generator_multiplier or (1.0 if tied else preset_generator_multiplier(cfg.model.preset))
    return ElectraConfig(
        discriminator=disc, generator=generator_config(disc, mult) if cfg.model.objective == "electra" else None,
        objective=cfg.model.objective, rtd_weight=cfg.model.rtd_weight, mask_prob=cfg.model.mask_prob,
        tie_generator_body=tied,
        mask_token_id=special_ids["mask"],
        special_token_ids=tuple(special_ids[k] for k in ("pad", "cls", "sep")))


def _electra_from_init(cfg: TrainConfig, vocab_size: int, special_ids: dict) -> ElectraConfig:
    from convbert_ds.convert.from_hf import init_generator_config, init_model_config

    body = init_model_config(cfg.model.init_from_hf)
    if body.vocab_size != vocab_size:
        raise ConfigError(f"model.init_from_hf={cfg.model.init_from_hf!r} has vocab_size={body.vocab_size} but the "
                          f"shards' tokenizer has {vocab_size}; shard the corpus with "
                          f"--tokenizer {cfg.model.init_from_hf}/tokenizer")
    if cfg.data.seq_len > body.max_position_embeddings:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the initial model's max_position_embeddings="
                          f"{body.max_position_embeddings}")
    generator = None
    if cfg.model.objective == "electra":
        mult = cfg.model.generator_multiplier or preset_generator_multiplier(cfg.model.preset)
        generator = init_generator_config(cfg.model.init_from_hf) or generator_config(body, mult)
    return ElectraConfig(
        discriminator=body, generator=generator, objective=cfg.model.objective, rtd_weight=cfg.model.rtd_weight,
        mask_prob=cfg.model.mask_prob, mask_token_id=special_ids["mask"],
        special_token_ids=tuple(special_ids[k] for k in ("pad", "cls", "sep")))


def validate(cfg: TrainConfig, world_size: int) -> tuple[dict, int]:
    """Every check that needs no process group; returns (DeepSpeed config, gradient accumulation)."""
    t, p = cfg.train, cfg.pipeline
    ds = load_ds_config(cfg)
    if cfg.model.objective not in ("electra", "mlm"):
        raise ConfigError(f"model.objective={cfg.model.objective!r}: use 'electra' or 'mlm'")
    precision = precision_of(cfg, ds)
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}: use one of {PRECISIONS}")
    for name in ("micro_batch_size", "global_batch_size", "steps"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)}: must be >= 1")
    if cfg.model.tie_generator_body:
        if cfg.model.objective != "electra":
            raise ConfigError("model.tie_generator_body=true ties the ELECTRA generator to the discriminator; the "
                              f"objective is {cfg.model.objective!r}: drop the key or use model.objective=electra")
        if p.stages > 1 or cfg.model.init_from_hf:
            raise ConfigError("model.tie_generator_body=true is not supported with pipeline.stages > 1 or "
                              "model.init_from_hf; drop one of them")
    if p.stages < 1 or world_size % p.stages:
        raise ConfigError(f"pipeline.stages={p.stages}: must divide the number of processes ({world_size})")
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if p.stages > 1 and stage > 1:
        raise ConfigError(f"deepspeed zero_optimization.stage={stage} cannot be combined with pipeline.stages="
                          f"{p.stages}; use ds_configs/pipeline_zero1_bf16.json or stage 0/1")
    if p.stages > 1 and precision == "bf16" and stage == 0:
        raise ConfigError("bf16 with pipeline parallelism needs zero_optimization.stage=1 (stage 0 cannot reload "
                          "its checkpoints); use ds_configs/pipeline_zero1_bf16.json")
    data_parallel = world_size // p.stages
    per_step = t.micro_batch_size * data_parallel
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel ranks ({data_parallel}) = {per_step}; "
                          f"use e.g. {per_step * max(1, round(t.global_batch_size / per_step))}")
    if cfg.checkpoint.interval < 1 or cfg.checkpoint.keep_last < 1:
        raise ConfigError("checkpoint.interval and checkpoint.keep_last must be >= 1")
    if cfg.data.seq_len < 8:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len}: must be at least 8")
    _validate_downstream(cfg)
    return ds, t.global_batch_size // per_step


def _validate_downstream(cfg: TrainConfig) -> None:
    d = cfg.eval.downstream
    if d.interval == 0:
        return
    if d.interval < 0 or d.interval % cfg.checkpoint.interval:
        raise ConfigError(f"eval.downstream.interval={d.interval}: the probe fine-tunes a saved checkpoint, so use a "
                          f"positive multiple of checkpoint.interval={cfg.checkpoint.interval} (0 turns it off)")
    if bool(d.glue_task) == bool(d.train or d.validation):
        raise ConfigError("eval.downstream: give either glue_task + data_dir or train + validation (a custom task "
                          "as python -m convbert_ds.finetune takes it)")
    files = [d.data_dir] if d.glue_task else [d.train, d.validation]
    for name, value in zip(("data_dir",) if d.glue_task else ("train", "validation"), files):
        if not value or not Path(value).exists():
            raise ConfigError(f"eval.downstream.{name}={value!r}: not found; point it at the task's files")
    if d.threads < 1 or not 0 <= d.nice <= 19:
        raise ConfigError(f"eval.downstream: threads={d.threads} must be >= 1 and nice={d.nice} in [0, 19]")
