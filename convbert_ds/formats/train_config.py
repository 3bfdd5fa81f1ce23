"""The training run's one config file: typed, loaded from YAML/JSON + ``key=value`` overrides.

    model:      {preset: small, objective: electra, overrides: {...}, init_from_hf: null}
    data:       {sets: [{path: SHARD_DIR, weight: 1.0}], seq_len: 128}
    train:      {micro_batch_size: 32, global_batch_size: 128, steps: 1000000, lr: 3e-4, ...}
    checkpoint: {dir: runs/x/checkpoints, interval: 5000, keep_last: 3}
    eval:       {interval: 5000, samples: 2048}
    log:        {interval: 50, dir: null}
    deepspeed:  {config: ds_configs/zero0_autocast_bf16.json}  # a path, or an inline dict
    pipeline:   {stages: 1}
    phase:      {continue_from: null}                       # a phase 2 names phase 1's checkpoint.dir

Each key's type, default, lower bound and meaning are declared once, below (``Key``); loading checks
them and ``python -m convbert_ds.train --help`` prints them. Checks that need several keys, the shards
or the world size live in ``engine/plan.py``, which resolves this config into the run's plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Literal

import yaml

from convbert_ds.config import PRESET_NAMES, ConfigError
from convbert_ds.formats.sample_packing import MIN_SEQ_LEN
from convbert_ds.formats.task_names import GLUE_TASKS, TASK_TYPES


@dataclass(frozen=True)
class Key:
    """What a config key means, and the values it takes: at least ``min``, at most ``max``, below ``below``
    (None: no bound). The one place the valid ranges live: loading enforces them, ``--help`` shows them,
    and the fuzz tests draw their out-of-range values from them."""

    help: str
    min: float | None = None
    max: float | None = None
    below: float | None = None
    choices: tuple | None = None  # the values a string key takes, when they are not a fixed Literal

    def check(self, value, path: str, given) -> None:
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{path}={given!r}: use one of {list(self.choices)} ({self.help})")
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if self.min is not None and value < self.min:
            raise ConfigError(f"{path}={given!r}: must be >= {self.min:g} ({self.help})")
        if self.max is not None and value > self.max:
            raise ConfigError(f"{path}={given!r}: must be <= {self.max:g} ({self.help})")
        if self.below is not None and value >= self.below:
            raise ConfigError(f"{path}={given!r}: must be < {self.below:g} ({self.help})")


Precision = Literal["fp32", "bf16", "fp16"]


@dataclass
class ModelSection:
    preset: Annotated[str, Key("model size: tiny, small, medium-small or base (the paper's Table 5)",
                               choices=PRESET_NAMES)] = "small"
    objective: Annotated[Literal["electra", "mlm"], Key("electra: generator + replaced-token detection; "
                                                        "mlm: masked LM alone")] = "electra"
    generator_multiplier: Annotated[float | None, Key("generator width / discriminator width; null: the "
                                                      "paper's (1/4 small, 1/3 base)", min=0.0)] = None
    rtd_weight: Annotated[float, Key("weight of the discriminator's loss (ELECTRA: 50)", min=0.0)] = 50.0
    tie_generator_body: Annotated[bool, Key(
        "ELECTRA's 'tie all weights': the generator is the discriminator's encoder under its own MLM head "
        "(generator_multiplier 1.0); with rtd_weight 1 what makes the tiny preset transfer")] = False
    mask_prob: Annotated[float, Key("share of tokens masked", min=0.0, max=1.0)] = 0.15
    masking: Annotated[Literal["fixed", "bernoulli"], Key(
        "fixed: the official code's count per sequence, max(1, min(max_predictions_per_seq, round(mask_prob x "
        "real tokens))) positions; bernoulli: each token with probability mask_prob")] = "fixed"
    max_predictions_per_seq: Annotated[int | None, Key(
        "cap of fixed masking; null: the official int((mask_prob + 0.005) x seq_len), 19 at 128, 79 at 512",
        min=1)] = None
    generator_heads: Annotated[Literal["transformers", "official"], Key(
        "generator heads when it is too narrow for the bottleneck (small): transformers (1+1 heads of hidden/2; "
        "exports) or official (1+1 heads of the full head size, as yitu-opensource/ConvBert; not exported)")] = \
        "transformers"
    overrides: Annotated[dict, Key("any ModelConfig field, e.g. {num_hidden_layers: 2}; with init_from_hf only "
                                   "the dropouts, sdconv_impl and residual_dtype")] = field(default_factory=dict)
    init_from_hf: Annotated[str | None, Key("continue pretraining a published model: a directory written by "
                                            "python -m convbert_ds.convert --from-hf HF_DIR --out DIR")] = None


@dataclass
class DataSection:
    sets: Annotated[list, Key("shard directories: [{path: SHARD_DIR, weight: 1.0}, ...]")] = field(
        default_factory=list)
    seq_len: Annotated[int, Key("tokens per sample", min=MIN_SEQ_LEN)] = 128
    seed: Annotated[int, Key("seed of the sample order and the masks", min=0)] = 1234
    pack_documents: Annotated[bool, Key(
        "samples hold several documents (or pieces of them), so no compute goes to padding; attention and both "
        "convolutions stay inside each document and its position ids restart at 0 (convbert_ds/data/"
        "cross_document.py); false: one piece of one document per sample, padded")] = True
    num_workers: Annotated[int, Key("data-loader worker processes per rank", min=0, max=256)] = 1
    cache_dir: Annotated[str | None, Key(
        "where sample indexes go when the shard dirs are read-only; for sets in an object store (s3://...) "
        "also their manifests, index files and token blocks (default ~/.cache/convbert_ds)")] = None
    cache_limit_gb: Annotated[float, Key(
        "token blocks of sets in an object store kept on this machine's disk at most (all ranks and sets "
        "together; the least recently used go first)", min=0.0)] = 20.0
    verify: Annotated[Literal["size", "checksum", "always"], Key(
        "how shard files are checked at start: size; checksum (also sha256 against the manifest, on rank 0, "
        "once per file: a stamp in the index cache skips files whose size and mtime are unchanged since); "
        "always (sha256 of every file at every start: bit rot that keeps size and mtime is caught too)")] = "checksum"
    size_exponent: Annotated[float, Key(
        "alpha of temperature sampling: set i is drawn in proportion to weight_i x samples_i^alpha; 0: the "
        "weights alone; 1: in proportion to size too; 0.3-0.7: as multilingual pretraining samples languages",
        min=0.0)] = 0.0


PROFILE_KINDS = ("trace", "memory", "nvtx")


@dataclass
class ProfileSection:
    """A window of steps to profile (``convbert_ds/engine/profiling.py``); every rank writes its own files."""

    start_step: Annotated[int, Key("first step profiled; 0: no profiling", min=0)] = 0
    steps: Annotated[int, Key("how many steps from start_step", min=1)] = 3
    what: Annotated[list, Key(f"any of {list(PROFILE_KINDS)}: trace = torch profiler trace (TensorBoard, "
                              "Chrome/Perfetto), memory = CUDA memory snapshot (GPU), nvtx = NVTX ranges for "
                              "nsys (GPU)")] = field(default_factory=lambda: ["trace"])


@dataclass
class TrainSection:
    micro_batch_size: Annotated[int | None, Key("samples per rank per forward/backward; null: global_batch_size / "
                                                "data-parallel ranks (no gradient accumulation)", min=1)] = 32
    global_batch_size: Annotated[int, Key("samples per optimiser step, all ranks (gradient accumulation "
                                          "makes up the rest)", min=1)] = 128
    steps: Annotated[int, Key("optimiser steps", min=1)] = 1000
    lr: Annotated[float, Key("peak learning rate (AdamW, linear warm-up then linear decay)", min=0.0)] = 3e-4
    warmup_steps: Annotated[int, Key("linear warm-up steps", min=0)] = 10000
    weight_decay: Annotated[float, Key("AdamW weight decay (not on biases and LayerNorm)", min=0.0)] = 0.01
    adam_beta1: Annotated[float, Key("AdamW beta1", min=0.0, below=1.0)] = 0.9
    adam_beta2: Annotated[float, Key("AdamW beta2", min=0.0, below=1.0)] = 0.999
    adam_eps: Annotated[float, Key("AdamW epsilon", min=0.0)] = 1e-6
    grad_clip: Annotated[float, Key("gradient-norm clipping; 0: off", min=0.0)] = 1.0
    precision: Annotated[Precision | None, Key("fp32, bf16 or fp16; null: as the DeepSpeed file's "
                                               "bf16/fp16 'enabled' says")] = None
    seed: Annotated[int, Key("seed of the initial weights")] = 1234
    activation_checkpointing: Annotated[bool, Key("recompute activations in the backward (less memory)")] = False
    compile: Annotated[bool, Key("run the model through torch.compile (inductor, see compile_mode); off by "
                                 "default: a start-up compile, for little on CPU with the layers alone and "
                                 "much more with the whole step at the quickstart's tiny size "
                                 "(benchmarks/RESULTS.md#row-compile-layers-cpu, #row-compile-step-cpu)")] = False
    compile_mode: Annotated[Literal["layers", "step"], Key(
        "what train.compile compiles: layers = every encoder layer (masking, sampling and losses eager); step = "
        "the whole ELECTRA forward and its backward as one graph with no graph break (CUDA graphs: see "
        "cuda_graphs)")] = "layers"
    compile_layers_once: Annotated[bool, Key(
        "with train.compile_mode=step (ignored otherwise): compile one encoder layer per width and call it for "
        "every layer instead of unrolling them all into the step's graph: a much shorter first step on CPU "
        "(benchmarks/compile_time.py), no fusion across a layer's edges; off: on a GPU it gave the unrolled "
        "step's speed and no shorter compile (benchmarks/RESULTS.md#row-compile-layers-once)")] = False
    compile_autotune: Annotated[Literal[False, "kernels", "matmuls", True], Key(
        "with train.compile_mode=step (ignored otherwise), on GPUs: kernels = the block sizes of inductor's fused "
        "elementwise and reduction kernels tuned by timing them (the matmuls stay cuBLAS's); matmuls = each "
        "matmul timed as Triton templates, the elementwise kernel after it fused in as their epilogue, against "
        "cuBLAS (the fused kernels keep their heuristic block sizes); true = inductor's max-autotune, both; "
        "minutes more of compiling at the first step; off until a GPU shows one pays "
        "(benchmarks/gpu/acceptance.py)")] = False
    compile_random: Annotated[Literal["eager", "inductor"], Key(
        "with train.compile on: who draws dropout, masking and sampling inside compiled code: eager = torch's "
        "generator, the same draws as eager (a compiled run follows the eager one; each dropout is an aten kernel "
        "of its own); inductor = inductor's own Philox stream inside its fused kernels (other draws than eager's, "
        "seeded from torch's generator, whose state checkpoints keep); eager until a GPU shows inductor pays "
        "(benchmarks/gpu/acceptance.py)")] = "eager"
    compile_options: Annotated[dict, Key(
        "with train.compile on: more of inductor's options for the compiled code, by torch._inductor.config's "
        "names, e.g. {combo_kernels: true} or train.compile_options.combo_kernels=true (nested names such as "
        "triton.multi_kernel as a mapping or dotted); checked against the installed torch at start (names, "
        "types); those that other train.compile_* keys and train.cuda_graphs set are theirs "
        "(convbert_ds/engine/compile_options.py)")] = field(default_factory=dict)
    compile_cache: Annotated[bool, Key(
        "with train.compile on: keep the compiled graphs (and on GPUs their kernels) in train.compile_cache_dir, "
        "written after the first step, and load them at the next start (a resume, a requeue on other nodes), "
        "which then skips most of the first step's compile (convbert_ds/engine/compile_cache.py)")] = True
    compile_cache_dir: Annotated[str | None, Key(
        "where train.compile_cache keeps its files (one per torch, device, pipeline stage and graph settings, so "
        "runs may share it); null: compile_cache beside checkpoint.dir")] = None
    cuda_graphs: Annotated[Literal["inductor", "capture", "auto", "off"], Key(
        "CUDA graphs on GPUs, so the host does not queue each kernel (nothing on CPU): inductor = inductor's "
        "CUDA-graph trees for train.compile_mode=step (reduce-overhead; inductor may decline, see cuda_graphs in "
        "the log); capture = the whole ELECTRA forward and backward captured at the first step and replayed, "
        "eager or compiled (no pipeline, ZeRO 0-2, no activation checkpointing; several micro-batches a step "
        "only at ZeRO-0 with fp32 weights); auto = "
        "capture where the run allows it, else inductor (the start line says which and why); off = "
        "none")] = "inductor"
    profile: ProfileSection = field(default_factory=ProfileSection)
    max_nonfinite_in_a_row: Annotated[int, Key("stop after this many steps in a row with a non-finite loss, where "
                                               "their updates are skipped (fp16, or nonfinite_check_interval 1); "
                                               "elsewhere the first one stops the run", min=1)] = 10
    nonfinite_check_interval: Annotated[int, Key(
        "steps between the host's reads of the device's non-finite-loss count (also before every checkpoint), so "
        "the GPU is not stalled every step; 1: every micro-batch's loss is read and a bad one dropped before its "
        "backward (a device sync each)", min=1)] = 10
    peak_tflops: Annotated[float | None, Key("per-device peak for MFU; null: known GPUs only", min=0.0)] = None


@dataclass
class CheckpointSection:
    dir: Annotated[str, Key("checkpoint directory; rerunning the command resumes from it")] = \
        "runs/default/checkpoints"
    interval: Annotated[int, Key("steps between checkpoints", min=1)] = 1000
    keep_last: Annotated[int, Key("complete checkpoints kept", min=1)] = 3
    background: Annotated[bool, Key(
        "write, hash and commit interval checkpoints in a thread while training goes on (the step loop waits "
        "only for a copy of the states in host memory); the run's last save and a preemption's wait for it")] = \
        True
    mirror: Annotated[str | None, Key(
        "an object store (s3://BUCKET/PREFIX) every complete checkpoint is uploaded to, COMPLETE last, the local "
        "copy kept until then; a run whose checkpoint.dir has none as new (a fresh machine) resumes from there")] = None
    verify: Annotated[Literal["size", "checksum"], Key(
        "how the checkpoint to resume from is checked against its manifest: size (a stat per file) or "
        "checksum (also sha256: a bit flip does not change a size; about a second per GB, once per start)")] = \
        "checksum"


@dataclass
class DownstreamSection:
    """Transfer watched during pretraining: every ``interval`` steps (at a checkpoint) rank 0 fine-tunes
    that checkpoint's discriminator on a task, in a separate low-priority process (convbert_ds.finetune),
    and logs the score next to a random-init baseline measured once per run."""

    interval: Annotated[int, Key("steps between probes, a multiple of checkpoint.interval; 0: off", min=0)] = 0
    glue_task: Annotated[str | None, Key("a GLUE task name (with data_dir)", choices=(None, *GLUE_TASKS))] = None
    data_dir: Annotated[str | None, Key("the GLUE task's directory")] = None
    train: Annotated[str | None, Key("a custom task's training file")] = None
    validation: Annotated[str | None, Key("a custom task's validation file")] = None
    text_column: Annotated[str, Key("a custom task's text column")] = "text"
    text_pair_column: Annotated[str | None, Key("a custom task's second text column")] = None
    label_column: Annotated[str, Key("a custom task's label column")] = "label"
    task_type: Annotated[str | None, Key("classification or regression; null: from the labels",
                                         choices=(None, *TASK_TYPES))] = None
    finetune_args: Annotated[list, Key("more fine-tuning options, e.g. [--epochs, 2, --seeds, 3]")] = field(
        default_factory=list)
    random_baseline: Annotated[bool, Key("also fine-tune a random init once, for comparison")] = True
    nice: Annotated[int, Key("scheduling priority of the probe (0-19): the training ranks come first",
                             min=0, max=19)] = 10
    threads: Annotated[int, Key("torch threads of the probe process", min=1)] = 1


@dataclass
class EvalSection:
    interval: Annotated[int, Key("steps between validation passes; 0: off", min=0)] = 1000
    samples: Annotated[int, Key("validation samples per pass", min=0)] = 1024
    downstream: DownstreamSection = field(default_factory=DownstreamSection)


@dataclass
class WandbSection:
    """Weights & Biases tracking from rank 0 (the optional ``wandb`` package): one W&B run per training run,
    continued across resumes and Slurm requeues (``convbert_ds/engine/metrics_log.py``)."""

    project: Annotated[str | None, Key("W&B project; null: no W&B")] = None
    entity: Annotated[str | None, Key("W&B entity (user or team); null: your default")] = None
    name: Annotated[str | None, Key("run name; null: the name of the log directory's parent (the run's)")] = None
    tags: Annotated[list, Key("run tags, a list of strings")] = field(default_factory=list)
    mode: Annotated[Literal["online", "offline"], Key(
        "offline: write the run under log.dir/wandb for compute nodes without internet, then `wandb sync`")] = \
        "online"


@dataclass
class LogSection:
    interval: Annotated[int, Key("steps between log lines", min=1)] = 10
    dir: Annotated[str | None, Key("TensorBoard events + metrics.jsonl; null: next to checkpoint.dir")] = None
    csv: Annotated[bool, Key("also write metrics.csv (step, split, metric, value), one row per value")] = True
    wandb: WandbSection = field(default_factory=WandbSection)


@dataclass
class DeepSpeedSection:
    config: Annotated[typing.Any, Key("a ds_configs/*.json path or an inline mapping: ZeRO stage, offload, "
                                      "communication and bucket sizes (the rest is set here); the default is "
                                      "the leanest step (fp32 weights, bf16 autocast, fused AdamW)")] = \
        "ds_configs/zero0_autocast_bf16.json"


@dataclass
class PipelineSection:
    stages: Annotated[int, Key("pipeline stages; must divide the number of processes", min=1)] = 1
    partition_method: Annotated[str, Key("DeepSpeed's layer partitioning: parameters, uniform or "
                                         "type:REGEX")] = "parameters"


@dataclass
class PhaseSection:
    """A new phase of a finished (or stopped) run, e.g. the paper's 10% more steps at length 512: the model
    and, by default, Adam's moments come from that run's checkpoint; this run's own steps, batch, learning-
    rate schedule and data order (rebuilt for its seq_len) start from zero, in its own checkpoint.dir."""

    continue_from: Annotated[str | None, Key(
        "the previous phase's checkpoint.dir (its newest complete checkpoint) or one checkpoint in it; used "
        "once, when this run's checkpoint.dir has no checkpoint yet; null: a first phase")] = None
    optimizer_state: Annotated[bool, Key("also carry the previous phase's Adam moments (else a fresh "
                                         "optimizer)")] = True


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
    phase: PhaseSection = field(default_factory=PhaseSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """The inverse of ``to_dict`` (e.g. the config a checkpoint recorded), validated as a file would be."""
        return _build(cls, values, "")

    @property
    def log_dir(self) -> Path:
        return Path(self.log.dir) if self.log.dir else Path(self.checkpoint.dir).parent / "logs"

    @property
    def compile_cache_dir(self) -> Path:
        return Path(self.train.compile_cache_dir or Path(self.checkpoint.dir).parent / "compile_cache")


# Loading ----------------------------------------------------------------------


def _build(cls, values: dict, where: str):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys, wrong types and values too small."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
    kwargs = {}
    for name, value in values.items():
        hint, path = hints[name], f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, path)
            continue
        hint, key = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint, None)
        kwargs[name] = _coerce(value, hint, path)
        if key is not None:
            key.check(kwargs[name], path, value)
    return cls(**kwargs)


def _coerce(value, hint, path: str):
    if hint is typing.Any:
        return value
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{path}: may not be null")
    for kind in allowed:
        origin = typing.get_origin(kind) or kind
        if origin is Literal:  # by type too: YAML's 1 is not true
            if any(value == choice and type(value) is type(choice) for choice in typing.get_args(kind)):
                return value
            raise ConfigError(f"{path}={value!r}: use one of {list(typing.get_args(kind))}")
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{path}={value!r}: must be a finite number")
            return float(value)
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin in (str, bool, list, dict) and isinstance(value, origin):
            return value
    names = [getattr(k, "__name__", str(k)) for k in allowed]
    raise ConfigError(f"{path}={value!r}: expected {' or '.join(names)}")


def describe_keys(cls=TrainConfig, where: str = "") -> list[str]:
    """One line per key: ``section.key  TYPE = DEFAULT  meaning`` (the trainer's ``--help``)."""
    lines, defaults = [], cls()
    for f in fields(cls):
        hint, path = typing.get_type_hints(cls, include_extras=True)[f.name], f"{where}{f.name}"
        if dataclasses.is_dataclass(hint):
            lines += describe_keys(hint, path + ".")
            continue
        kind, key = typing.get_args(hint)
        name = str(kind).replace("typing.", "") if typing.get_origin(kind) else kind.__name__
        bound = "".join(f", {sign} {limit:g}" for sign, limit in ((">=", key.min), ("<=", key.max), ("<", key.below))
                        if limit is not None)
        lines.append(f"  {path} ({name}{bound}) = {getattr(defaults, f.name)!r}\n      {key.help}")
    return lines


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
        try:
            _set_path(tree, key.strip(), yaml.safe_load(raw))
        except yaml.YAMLError as error:
            raise ConfigError(f"override {item!r}: not a YAML value ({error.problem})") from None
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def option_text(name: str, value) -> str:
    """``name=value`` as an override (``train.compile_options.`` + this) writes it, so that it loads back as
    ``value``: YAML's spelling (``true``, ``1.0e-05``, which JSON would write ``1e-05``, a string to YAML)."""
    plain = json.loads(json.dumps(value))  # tuples as lists: YAML's safe writer has no tuple
    return f"{name}={yaml.safe_dump([plain], default_flow_style=True, width=10**9).strip()[1:-1]}"


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> TrainConfig:
    values: dict = {}
    if path is not None:
        values = _read_config_file(Path(path))
    return _build(TrainConfig, _merge(values, parse_overrides(list(overrides))), "")


def _read_config_file(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass a YAML file such as configs/small.yaml")
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        text = path.read_bytes().decode("utf-8")
        if not text.strip():
            raise ConfigError(f"config file {path} is empty; start from one of configs/*.yaml")
        values = (json.loads(text) if kind == "JSON" else yaml.safe_load(text)) or {}
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                          f"offset {error.start}); save it as UTF-8") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"config file {path} is not valid JSON: line {error.lineno}, column {error.colno}: "
                          f"{error.msg}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML: {where}{what}"
                          + (f" ({error.context})" if getattr(error, "context", None) else "")) from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} holds a {type(values).__name__}, not a mapping of sections "
                          "(model:, data:, train:, ...)")
    return values
