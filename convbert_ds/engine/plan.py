"""The run's plan: the training config checked and resolved once, before any process group starts.

``resolve(cfg, world_size)`` holds every check of the training config that needs more than one key, the
shards, the DeepSpeed file or the world size, and returns a ``RunPlan``: the DeepSpeed dict, gradient
accumulation, precision, the ELECTRA/model config sized to the shards' tokenizer, and the pipeline
layout. The trainer, ``--check-config`` (the Slurm scripts' up-front check) and ``--print-config`` all
start from it, so they cannot disagree.

It reads what it checks (the shards' manifests, the DeepSpeed file, the checkpoints' states, the store's
newest tag) and writes nothing anywhere, so checking a config changes no directory and no store. What a
run needs written first (the store's newest checkpoint downloaded, the shards' checksum stamps, a store's
index files in the cache) is ``convbert_ds.engine.prepare``'s, which the trainer's start calls after it.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from convbert_ds.config import (ConfigError, ElectraConfig, ModelConfig, generator_config, preset,
                                preset_generator_multiplier)
from convbert_ds.data.loader import parse_sets
from convbert_ds.data.shards import ShardSplit, check_same_tokenizer, open_split
from convbert_ds.engine.compile_options import inductor_options
from convbert_ds.engine.compile_plan import check_compile
from convbert_ds.engine.pipeline import check_pipeline_ds_config
from convbert_ds.formats.checkpoint import store as checkpoint_store
from convbert_ds.formats.checkpoint import run_state
from convbert_ds.formats.checkpoint.directory import COMPLETE, latest_complete, step_of
from convbert_ds.formats.checkpoint.names import pipeline_layer_names
from convbert_ds.formats.checkpoint.universal import Layout
from convbert_ds.formats.train_config import PROFILE_KINDS, DataSection, TrainConfig
from convbert_ds.formats.init_dir import init_generator_config, init_model_config, read_init
from convbert_ds.formats.shard_manifest import read_manifest, read_store_manifest
from convbert_ds.model.optim import WarmupDecay
from convbert_ds.errors import UserError
from convbert_ds.fsutil import read_json
from convbert_ds.objstore import StoreError, Url, is_url

REPO_ROOT = Path(__file__).resolve().parents[2]

# DeepSpeed keys the trainer writes from the training config; in a DeepSpeed file they would be ignored
# without a word, so they are an error naming the key to set instead.
TRAINER_OWNED_DS_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation = global / (micro x data-parallel ranks))",
    "gradient_clipping": "train.grad_clip",
    "optimizer": "train.lr, train.weight_decay and train.adam_*",
    "scheduler": "train.warmup_steps and train.steps",
    "steps_per_print": "log.interval",
}
# What may change in a published model's config when pretraining continues from it (model.init_from_hf).
INIT_SAFE_OVERRIDES = ("sdconv_impl", "residual_dtype", "hidden_dropout_prob", "attention_probs_dropout_prob")
# What a resumed checkpoint must share with the run: the networks and the special tokens (the masking rate
# and the loss weight may change between runs).
_ARCHITECTURE_KEYS = ("discriminator", "generator", "objective", "tie_generator_body", "mask_token_id",
                      "special_token_ids")


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig
    world_size: int
    ds_config: dict  # what deepspeed.initialize gets
    grad_accum: int
    precision: str
    electra: ElectraConfig
    sets: list  # [(shard dir, weight)]
    tokenizer: dict  # the shards' tokenizer, as their manifest records it
    has_valid: bool  # every shard dir has a validation split (as listed; prepare opens them)
    micro_batch_size: int  # train.micro_batch_size, or global / data-parallel ranks when that is null
    # the lr schedule as it runs (deepspeed.initialize's lr_scheduler: DeepSpeed's own runs 2+ warm-up steps)
    lr_schedule: WarmupDecay
    # train.cuda_graphs resolved (inductor, capture or off: auto decided) and, when auto did not capture, why
    cuda_graphs: str = "inductor"
    cuda_graphs_why: str = ""
    # train.compile_options by inductor's dotted names, checked (compile_options.inductor_options)
    compile_options: dict = field(default_factory=dict)
    # phase.continue_from resolved to one checkpoint, when this run starts from it (its own dir is empty;
    # prepare resolves it again once the store's newest checkpoint is on this disk)
    continue_from: Path | None = None

    @property
    def pipelined(self) -> bool:
        return self.cfg.pipeline.stages > 1

    @property
    def zero_stage(self) -> int:
        return self.ds_config.get("zero_optimization", {}).get("stage", 0)

    @property
    def layout(self) -> Layout:
        return Layout(self.world_size, self.zero_stage, self.cfg.pipeline.stages, weights_precision(self.ds_config))

    @property
    def trainer_clip_norm(self) -> float:
        return trainer_clip_norm(self.cfg, self.ds_config)

    @property
    def whole_fp32_grads(self) -> bool:
        return whole_fp32_grads(self.ds_config, self.cfg.pipeline.stages, self.precision)


def load_ds_config(cfg: TrainConfig) -> dict:
    """The DeepSpeed file's own part: ZeRO stage, offload, communication, bucket sizes, precision flag."""
    raw, where = cfg.deepspeed.config, "deepspeed.config"
    if isinstance(raw, str):
        # A relative path is relative to the working directory, else to this repository.
        path = Path(raw)
        if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
            path = REPO_ROOT / path
        if not path.is_file():
            raise ConfigError(f"deepspeed.config={raw!r}: file not found; use one of ds_configs/*.json "
                              "or an inline mapping")
        where = str(path)
        raw = read_json(path, ConfigError, "fix the file or use one of ds_configs/*.json")
    if not isinstance(raw, dict):
        raise ConfigError(f"deepspeed.config: expected a path or a mapping, got {raw!r}")
    owned = [(key, use) for key, use in TRAINER_OWNED_DS_KEYS.items() if key in raw]
    if "activation_checkpoint_interval" in (raw.get("pipeline") or {}):
        owned.append(("pipeline.activation_checkpoint_interval", "train.activation_checkpointing"))
    if owned:
        (key, use), also = owned[0], ", ".join(k for k, _ in owned[1:])
        raise ConfigError(f"{where}: {key} is set by the trainer from the training config; delete it there and "
                          f"set {use} instead" + (f" (also: {also})" if also else ""))
    return json.loads(json.dumps(raw))


def precision_of(cfg: TrainConfig, ds_config: dict) -> str:
    """The precision the model computes in: train.precision, else the DeepSpeed file's (``bf16``, ``fp16``
    or ``torch_autocast``'s dtype)."""
    if cfg.train.precision is not None:
        return cfg.train.precision
    if autocast_enabled(ds_config):
        dtype = str(ds_config["torch_autocast"].get("dtype", "bf16"))
        if dtype not in _AUTOCAST_DTYPES:
            raise ConfigError(f"deepspeed.config: torch_autocast.dtype={dtype!r}; use bf16 or fp16 (or set "
                              "torch_autocast.enabled=false)")
        return _AUTOCAST_DTYPES[dtype]
    return weights_precision(ds_config)


# DeepSpeed's spellings of the autocast dtypes (its DtypeEnum) -> ours.
_AUTOCAST_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
                    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}


def trainer_clip_norm(cfg: TrainConfig, ds_config: dict) -> float:
    """The norm the trainer clips the gradients to itself, in one fused call, where ``build_ds_config``
    turned DeepSpeed's per-tensor clipping off; 0 where DeepSpeed clips (or nothing is clipped)."""
    return cfg.train.grad_clip if ds_config.get("gradient_clipping") == 0 else 0.0


def whole_fp32_grads(ds_config: dict, pipeline_stages: int, precision: str) -> bool:
    """Each parameter's ``.grad`` holds its whole fp32 gradient: ZeRO-0 (no partitions), no pipeline, fp32
    weights (fp32, or torch autocast), no fp16 loss scale. The trainer then clips (one fused norm, where
    DeepSpeed takes one per tensor) and all-reduces (one multi-tensor copy back) itself."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    return stage == 0 and pipeline_stages == 1 and weights_precision(ds_config) == "fp32" and precision != "fp16"


def autocast_enabled(ds_config: dict) -> bool:
    """Mixed precision the torch way (``torch_autocast``): fp32 weights, gradients and optimizer; the
    forward's matrix work in bf16/fp16 under ``torch.autocast``."""
    return bool((ds_config.get("torch_autocast") or {}).get("enabled"))


def weights_precision(ds_config: dict) -> str:
    """What the weights are stored in, which decides the layout of DeepSpeed's files: bf16/fp16 with
    DeepSpeed's own mixed precision (fp32 masters beside them), fp32 otherwise (autocast included)."""
    return next((name for name in ("bf16", "fp16") if ds_config.get(name, {}).get("enabled")), "fp32")


def build_ds_config(cfg: TrainConfig, base: dict, micro_batch_size: int, grad_accum: int, precision: str) -> dict:
    """The training config's batch, optimiser, schedule and precision written into the DeepSpeed file's."""
    t = cfg.train
    ds = dict(base)
    autocast = autocast_enabled(ds)
    ds.update(train_batch_size=t.global_batch_size, train_micro_batch_size_per_gpu=micro_batch_size,
              gradient_accumulation_steps=grad_accum, gradient_clipping=t.grad_clip, steps_per_print=10**9)
    ds["optimizer"] = {"type": "AdamW", "params": {
        "lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps, "weight_decay": t.weight_decay,
        # torch's AdamW: no CUDA extension to build, and it runs on CPU ranks too. fused: one kernel per
        # parameter group instead of a dozen ops per tensor (DeepSpeed passes the key on to torch).
        "torch_adam": True, "adam_w_mode": True, "fused": True}}
    # No "scheduler": the trainer hands DeepSpeed its own (RunPlan.lr_schedule, model.optim.WarmupDecay).
    # The trainer logs its own throughput; DeepSpeed's timer (on unless a file says otherwise) syncs twice a step.
    ds["timers"] = {**ds.get("timers", {})}
    ds["timers"]["throughput"] = {"enabled": False, **ds["timers"].get("throughput", {})}
    if autocast:  # train.precision picks autocast's dtype; fp32 turns it off
        ds["torch_autocast"] = {**ds["torch_autocast"], "enabled": precision != "fp32",
                                "dtype": "bf16" if precision == "fp32" else precision}
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision == "bf16" and not autocast}
    ds["fp16"] = {**ds.get("fp16", {}), "enabled": precision == "fp16" and not autocast}
    if whole_fp32_grads(ds, cfg.pipeline.stages, precision):
        # The trainer clips with one fused norm over all of them (trainer_clip_norm) where DeepSpeed would
        # take one norm per parameter tensor, a few hundred launches a step.
        ds["gradient_clipping"] = 0.0
    if precision == "fp16" and not autocast:
        ds["fp16"].setdefault("loss_scale", 0)  # dynamic loss scaling
        ds["fp16"].setdefault("initial_scale_power", 16)
    return ds


def host_sync_warnings(ds: dict) -> list[str]:
    """DeepSpeed settings that make every step wait on the device (per-tensor syncs, timers), one line each
    naming the setting and the fix; empty for the files in ds_configs/ other than zero0_bf16/zero0_fp16."""
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    bf16 = (ds.get("bf16") or {}).get("enabled", False)
    lines = []
    for name in ("bf16", "fp16"):
        if (ds.get(name) or {}).get("enabled") and stage == 0:
            lines.append(f"{name} with zero_optimization.stage=0 runs DeepSpeed's unfused optimizer (an fp32 copy, "
                         "overflow test and host sync per parameter tensor every step); use torch autocast "
                         "(ds_configs/zero0_autocast_bf16.json, the default), stage 1 "
                         f"(ds_configs/zero1_{name}.json) or fp32")
    if bf16 and stage in (1, 2) and (ds.get("bf16") or {}).get("check_grad_overflow", True):
        lines.append(f"bf16.check_grad_overflow is true (DeepSpeed's default) at ZeRO-{stage}: an inf/NaN test per "
                     "gradient tensor and a host sync every step; set it to false (the trainer's non-finite-loss "
                     "check, train.nonfinite_check_interval, stops a bf16 run that goes bad)")
    throughput = (ds.get("timers") or {}).get("throughput") or {}
    if throughput.get("enabled", True) and throughput.get("synchronized", True):
        lines.append('DeepSpeed\'s throughput timer is on: two device synchronize() every step; set '
                     '"timers": {"throughput": {"enabled": false}} (the trainer logs samples_per_s itself)')
    if ds.get("wall_clock_breakdown"):
        lines.append("wall_clock_breakdown=true synchronizes the device around forward, backward and step; set it "
                     "to false (train.profile traces a few steps instead)")
    if ds.get("memory_breakdown"):
        lines.append("memory_breakdown=true runs gc.collect() and prints memory at every forward and step; set it "
                     "to false")
    return lines


def _electra_config(cfg: TrainConfig, vocab_size: int, special_ids: dict, init: dict | None) -> ElectraConfig:
    """The model, sized to the tokenizer the shards were made with."""
    m = cfg.model
    if m.init_from_hf:
        body, generator = _init_bodies(cfg, vocab_size, init)
    else:
        overrides = dict(m.overrides)
        if overrides.get("vocab_size", vocab_size) != vocab_size:
            raise ConfigError(f"model.overrides.vocab_size={overrides['vocab_size']} but the shards' tokenizer has "
                              f"{vocab_size} tokens; drop the override (the vocabulary is read from the manifest)")
        overrides.update(vocab_size=vocab_size, pad_token_id=special_ids["pad"])
        try:  # ModelConfig names its field; the user wrote it under model.overrides
            body = preset(m.preset, **overrides)
        except ConfigError as error:
            raise ConfigError(f"model.overrides={m.overrides!r}: {error}") from None
        if cfg.data.seq_len > body.max_position_embeddings:
            raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds max_position_embeddings="
                              f"{body.max_position_embeddings} (model.overrides); raise it (512 by default, whatever "
                              "the training length, so that exported models take 512 tokens) or shorten seq_len")
        mult = m.generator_multiplier or (1.0 if m.tie_generator_body else preset_generator_multiplier(m.preset))
        generator = generator_config(body, mult, heads=m.generator_heads)
    return ElectraConfig(
        discriminator=body, generator=generator if m.objective == "electra" else None, objective=m.objective,
        rtd_weight=m.rtd_weight, mask_prob=m.mask_prob, masking=m.masking,
        max_predictions_per_seq=m.max_predictions_per_seq, tie_generator_body=m.tie_generator_body,
        mask_token_id=special_ids["mask"], special_token_ids=tuple(special_ids[k] for k in ("pad", "cls", "sep")))


def _init_bodies(cfg: TrainConfig, vocab_size: int, recorded: dict) -> tuple[ModelConfig, ModelConfig]:
    """Discriminator and generator configs of ``model.init_from_hf`` (its init.json, read once by ``resolve``),
    with the overrides that are safe there."""
    init, overrides = cfg.model.init_from_hf, cfg.model.overrides
    body = init_model_config(recorded).replace(**overrides)
    if body.vocab_size != vocab_size:
        raise ConfigError(f"model.init_from_hf={init!r} has vocab_size={body.vocab_size} but the shards' tokenizer "
                          f"has {vocab_size}; shard the corpus with --tokenizer {init}/tokenizer")
    if cfg.data.seq_len > body.max_position_embeddings:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the initial model's max_position_embeddings="
                          f"{body.max_position_embeddings}")
    generator = init_generator_config(recorded)
    mult = cfg.model.generator_multiplier or preset_generator_multiplier(cfg.model.preset)
    return body, (generator.replace(**overrides) if generator else generator_config(body, mult))


def _check_combinations(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """Checks across keys; returns the micro-batch size and the gradient accumulation."""
    t, p, m = cfg.train, cfg.pipeline, cfg.model
    if m.tie_generator_body:
        if m.objective != "electra":
            raise ConfigError("model.tie_generator_body=true ties the ELECTRA generator to the discriminator; the "
                              f"objective is {m.objective!r}: drop the key or use model.objective=electra")
        if p.stages > 1 or m.init_from_hf:
            raise ConfigError("model.tie_generator_body=true is not supported with pipeline.stages > 1 or "
                              "model.init_from_hf; drop one of them")
    unsafe = sorted(set(m.overrides) - set(INIT_SAFE_OVERRIDES)) if m.init_from_hf else []
    if unsafe:
        raise ConfigError(f"model.overrides {unsafe} cannot change a published model (model.init_from_hf="
                          f"{m.init_from_hf!r}); only {list(INIT_SAFE_OVERRIDES)} can: drop the others")
    if world_size % p.stages:
        raise ConfigError(f"pipeline.stages={p.stages}: must divide the number of processes ({world_size})")
    data_parallel = world_size // p.stages
    micro = t.micro_batch_size
    if micro is None:
        if t.global_batch_size % data_parallel:
            raise ConfigError(f"train.micro_batch_size=null splits train.global_batch_size={t.global_batch_size} "
                              f"between the {data_parallel} data-parallel ranks, which it is not a multiple of; set "
                              "train.micro_batch_size, or a global batch that is a multiple of the ranks")
        micro = t.global_batch_size // data_parallel
    per_step = micro * data_parallel
    if t.global_batch_size % per_step:
        fits = [m for m in range(micro, 0, -1) if t.global_batch_size % (m * data_parallel) == 0]
        fix = (f"keep the published batch with train.micro_batch_size={fits[0]} (gradient accumulation makes up the "
               "rest) or null" if fits else f"use a global batch that is a multiple of {data_parallel}")
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size "
                          f"({micro}) x data-parallel ranks ({data_parallel}) = {per_step}; {fix}")
    d = cfg.eval.downstream
    if d.interval:
        if d.interval % cfg.checkpoint.interval:
            raise ConfigError(f"eval.downstream.interval={d.interval}: the probe fine-tunes a saved checkpoint, so "
                              f"use a multiple of checkpoint.interval={cfg.checkpoint.interval} (0 turns it off)")
        if bool(d.glue_task) == bool(d.train or d.validation):
            raise ConfigError("eval.downstream: give either glue_task + data_dir or train + validation (a custom "
                              "task as python -m convbert_ds.finetune takes it)")
        for name in ("data_dir",) if d.glue_task else ("train", "validation"):
            value = getattr(d, name)
            if not value or not Path(value).exists():
                raise ConfigError(f"eval.downstream.{name}={value!r}: not found; point it at the task's files")
    return micro, t.global_batch_size // per_step


def _check_store_urls(cfg: TrainConfig) -> None:
    if is_url(cfg.checkpoint.dir):
        raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir!r}: DeepSpeed writes checkpoints to a directory; keep "
                          f"one on this disk and set checkpoint.mirror={cfg.checkpoint.dir!r} to upload them there")
    if cfg.checkpoint.mirror is not None:
        try:
            Url.parse(cfg.checkpoint.mirror)
        except StoreError as error:
            raise ConfigError(f"checkpoint.mirror={cfg.checkpoint.mirror!r}: {error}") from None


def _listed_set(path: Path | str, data: DataSection) -> tuple[ShardSplit, bool]:
    """A set's train split and whether its manifest lists documents to evaluate on, read without writing:
    a local directory's split opened (open_split only reads there: the manifest, every file's size); a
    store's manifest alone, with no shards (opening them fetches the index files into the cache:
    prepare.py does, and opens the validation splits, which fail on damage)."""
    if is_url(path):
        manifest = read_store_manifest(str(path))[1]
        tokenizer = manifest["tokenizer"]
        train = ShardSplit(Path(), "train", (), tokenizer, dict(tokenizer["special_ids"]),
                           int(tokenizer["vocab_size"]), origin=str(path))
    else:
        train = open_split(path, "train", data.cache_dir, data.cache_limit_gb)
        manifest = read_manifest(train.shard_dir, verify=False)
    valid = manifest["splits"].get("valid")
    return train, bool(valid and valid["documents"])


def _differences(saved, now, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        return [d for key in sorted(set(saved) | set(now)) if key not in INIT_SAFE_OVERRIDES
                for d in _differences(saved.get(key), now.get(key), f"{path}.{key}" if path else key)]
    return [] if saved == now else [f"{path}={saved!r} there, {now!r} here"]


def _check_resumable(tag_dir: Path, key: str, electra: ElectraConfig, tokenizer: dict) -> None:
    """A checkpoint this run would resume (``key``: checkpoint.dir) or continue (phase.continue_from) must
    hold the same model, made from the same tokenizer: any layout can be resumed, another model cannot (its
    weights would not fit, or would mean other tokens)."""
    try:
        state = run_state.read(tag_dir)
    except (OSError, ValueError):  # damaged: the resume's verification sets the tag aside and says so
        return
    where = f"{key}={str(tag_dir if key != 'checkpoint.dir' else tag_dir.parent)!r}"
    fix = ("resume with the model config it was trained with, or set checkpoint.dir to a new directory"
           if key == "checkpoint.dir" else "use the model config of that phase (model.preset, model.overrides)")
    saved_model = {k: v for k, v in state.electra_config.items() if k in _ARCHITECTURE_KEYS}
    model = json.loads(json.dumps({k: v for k, v in electra.to_dict().items() if k in _ARCHITECTURE_KEYS}))
    changed = _differences(saved_model, model)
    if changed:
        positions = [c for c in changed if "max_position_embeddings" in c]
        if positions and len(positions) == len(changed):
            fix = ("a model's position table is fixed when it is created: its phase 1 must be trained with the "
                   "positions phase 2 needs (512 by default)")
        raise ConfigError(f"{where} holds a run of another model ({tag_dir.name}: {'; '.join(changed[:3])}); {fix}")
    if state.tokenizer is not None and state.tokenizer.get("sha256") != tokenizer.get("sha256"):
        raise ConfigError(f"{where} holds a run on shards of another tokenizer ({tag_dir.name}); shard the corpus "
                          f"with that run's tokenizer, or set {key} to another directory")


def previous_phase(cfg: TrainConfig, exists: bool = True) -> Path | None:
    """``phase.continue_from`` as one complete checkpoint: the directory's newest, or the tag named
    (``exists=False``: only the check that it is not this run's own directory)."""
    value = cfg.phase.continue_from
    if value is None:
        return None
    path, own = Path(value), Path(cfg.checkpoint.dir)
    if path.resolve() == own.resolve() or own.resolve() in path.resolve().parents:
        raise ConfigError(f"phase.continue_from={value!r} is inside this run's checkpoint.dir={str(own)!r}; a new "
                          "phase writes its own checkpoints: give it another checkpoint.dir")
    if not exists:
        return None
    if (path / COMPLETE).is_file():
        return path
    tag = latest_complete(path) if path.is_dir() else None
    if tag is None:
        raise ConfigError(f"phase.continue_from={value!r}: no complete checkpoint there; point it at the previous "
                          "phase's checkpoint.dir (or one stepNNNNNNNN directory in it)")
    return path / tag


def check_checkpoints(cfg: TrainConfig, electra: ElectraConfig, tokenizer: dict, store: bool = True) -> Path | None:
    """Check the checkpoint this run resumes (checkpoint.dir's newest) or continues (phase.continue_from)
    against its model and tokenizer, reading only; returns the one it continues from, None once this phase
    has a checkpoint of its own. ``store``: a newer complete tag in checkpoint.mirror is this phase's own (a
    run downloads it first and checks it then, prepare.py); False once it is downloaded."""
    directory, mirror = Path(cfg.checkpoint.dir), cfg.checkpoint.mirror
    own = latest_complete(directory)
    stored = checkpoint_store.latest_complete(mirror) if store and mirror else None
    newer_in_store = stored is not None and (own is None or step_of(stored) > step_of(own))
    if own is not None and not newer_in_store:
        _check_resumable(directory / own, "checkpoint.dir", electra, tokenizer)
    # Once this phase has a checkpoint of its own, the previous phase is not read again (nor needed).
    continue_from = previous_phase(cfg, exists=own is None and not newer_in_store)
    if continue_from is not None:
        _check_resumable(continue_from, "phase.continue_from", electra, tokenizer)
    return continue_from


def _check_profile(cfg: TrainConfig, cuda: bool) -> None:
    p = cfg.train.profile
    if not p.start_step:
        return
    unknown = [kind for kind in p.what if kind not in PROFILE_KINDS]
    if unknown or not p.what:
        raise ConfigError(f"train.profile.what={p.what!r}: use a non-empty list of {list(PROFILE_KINDS)}")
    gpu_only = [kind for kind in p.what if kind in ("memory", "nvtx")]
    if gpu_only and not cuda:
        raise ConfigError(f"train.profile.what={p.what!r}: {gpu_only} need a GPU (CUDA memory snapshots, NVTX "
                          "ranges); use [trace] on CPU")
    if p.start_step > cfg.train.steps:
        raise ConfigError(f"train.profile.start_step={p.start_step} is after the last step (train.steps="
                          f"{cfg.train.steps}); choose a step inside the run, after warm-up (e.g. 10)")


def _check_tracking(cfg: TrainConfig) -> None:
    w = cfg.log.wandb
    if w.project is None:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"log.wandb.project={w.project!r} needs the wandb package, which is not installed: "
                          "pip install wandb (or set log.wandb.project=null)")
    if not all(isinstance(tag, str) and tag for tag in w.tags):
        raise ConfigError(f"log.wandb.tags={w.tags!r}: tags are non-empty strings, e.g. [phase1, small]")


def resolve(cfg: TrainConfig, world_size: int, cuda: bool | None = None) -> RunPlan:
    """Check everything that needs no process group and resolve the run (see the module docstring)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    micro_batch_size, grad_accum = _check_combinations(cfg, world_size)
    base_ds = load_ds_config(cfg)
    precision = precision_of(cfg, base_ds)
    if precision == "fp16" and not cuda:
        raise ConfigError("fp16 needs a GPU (DeepSpeed refuses fp16 on CPU); use train.precision=bf16 or fp32")
    _check_tracking(cfg)
    _check_profile(cfg, cuda)
    ds_config = build_ds_config(cfg, base_ds, micro_batch_size, grad_accum, precision)
    if cfg.pipeline.stages > 1:
        check_pipeline_ds_config(ds_config)
    cuda_graphs, cuda_graphs_why = check_compile(cfg, ds_config, grad_accum, cuda,
                                                 whole_fp32_grads(ds_config, cfg.pipeline.stages, precision))
    compile_options = inductor_options(cfg)
    sets = parse_sets(cfg.data.sets)
    train_splits, with_valid = zip(*(_listed_set(path, cfg.data) for path, _ in sets))
    check_same_tokenizer(list(train_splits))
    first = train_splits[0]
    init, recorded = cfg.model.init_from_hf, None
    if init:
        try:  # the format's own error names the file; the user needs to know which key pointed there
            recorded = read_init(init)
        except UserError as error:
            raise ConfigError(f"model.init_from_hf={init!r}: {error}") from None
        if recorded["tokenizer"]["sha256"] != first.tokenizer.get("sha256"):
            raise ConfigError(f"model.init_from_hf={init!r}: the shards were made with another tokenizer; shard "
                              f"the corpus with --tokenizer {init}/tokenizer")
    electra = _electra_config(cfg, first.vocab_size, first.special_ids, recorded)
    layers = len(pipeline_layer_names(electra))
    if cfg.pipeline.stages > layers:
        raise ConfigError(f"pipeline.stages={cfg.pipeline.stages}: the model has {layers} layers with weights to "
                          f"divide between the stages; use at most {layers} stages")
    _check_store_urls(cfg)
    continue_from = check_checkpoints(cfg, electra, first.tokenizer)
    return RunPlan(cfg=cfg, world_size=world_size, ds_config=ds_config, grad_accum=grad_accum, precision=precision,
                   lr_schedule=WarmupDecay.of(cfg.train),
                   electra=electra, sets=sets, tokenizer=first.tokenizer,
                   has_valid=all(with_valid), micro_batch_size=micro_batch_size,
                   continue_from=continue_from, cuda_graphs=cuda_graphs, cuda_graphs_why=cuda_graphs_why,
                   compile_options=compile_options)
