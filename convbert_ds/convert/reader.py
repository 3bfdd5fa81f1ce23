"""Reading a trainer checkpoint (any ZeRO stage, pipeline layer files, fp32/bf16/fp16) into one fp32
state dict under ``ElectraForPretraining``'s parameter names.

Where the weights come from:
- ZeRO 1/2/3: the fp32 master weights, consolidated by DeepSpeed's own
  ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``;
- ZeRO 0: the module weights in ``mp_rank_00_model_states.pt`` (fp32 training), or, for bf16/fp16,
  the optimizer's fp32 master copies, each checked to round to the module's weight;
- pipeline: ``layer_XX-model_states.pt`` mapped through ``formats.checkpoint.names.pipeline_layer_names``;
  for bf16/fp16 with ZeRO-1 the fp32 masters of each stage, consolidated like ZeRO-1 above.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from convbert_ds.config import ConfigError, ElectraConfig
from convbert_ds.formats.checkpoint import directory as tags
from convbert_ds.formats.checkpoint import run_state
from convbert_ds.formats.checkpoint import store as checkpoint_store
from convbert_ds.formats.checkpoint.names import meta_model, pipeline_layer_names, pipeline_to_plain
from convbert_ds.formats.checkpoint.universal import META, Layout
from convbert_ds.formats.init_dir import ConvertError, match_weights
from convbert_ds.formats.safe_pickle import check_directory, forced_weights_only, safe_load
from convbert_ds.model import WeightsError
from convbert_ds.model.optim import param_groups
from convbert_ds.model.tied import fill_tied
from convbert_ds.objstore import is_url

@dataclass
class Checkpoint:
    root: Path  # the trainer's checkpoint.dir
    tag: str
    state: run_state.RunState  # trainer_state.json
    electra: ElectraConfig

    def __post_init__(self) -> None:  # the run's layout, as trainer_state.json records it
        layout = Layout.of_checkpoint(self.state)
        self.stages, self.zero_stage = layout.pipeline_stages, layout.zero_stage
        self.precision, self.world_size = layout.precision, layout.world_size

    @property
    def directory(self) -> Path:
        return self.root / self.tag

    def describe(self) -> str:
        return str(Layout.of_checkpoint(self.state))


def open_checkpoint(checkpoint_dir, tag: str | None = None) -> Checkpoint:
    """The trainer's ``checkpoint.dir`` (or one tag directory in it) and a tag (default: newest complete).
    A store URL (``checkpoint.mirror``, or one tag in it) is downloaded into the local cache first."""
    if is_url(checkpoint_dir):
        checkpoint_dir, tag = checkpoint_store.local_copy(str(checkpoint_dir), tag)
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise ConvertError(f"checkpoint directory {root} does not exist")
    if tag is None and (root / tags.TRAINER_STATE).is_file():
        root, tag = root.parent, root.name
    if tag is None:
        tag = tags.latest_complete(root)
        if tag is None:
            raise ConvertError(f"{root} holds no complete checkpoint (a stepNNNNNNNN directory with a "
                               f"{tags.COMPLETE} file); pass the trainer's checkpoint.dir")
    path = root / tag
    if not path.is_dir():
        raise ConvertError(f"checkpoint tag {tag} not found in {root}; complete tags: "
                           f"{tags.complete_tags(root) or 'none'}")
    if not (path / tags.COMPLETE).is_file():
        raise ConvertError(f"checkpoint {path} is incomplete (no {tags.COMPLETE} file: its save was "
                           f"interrupted); complete tags: {tags.complete_tags(root) or 'none'}")
    state_file = path / tags.TRAINER_STATE
    if not state_file.is_file():
        raise ConvertError(f"{state_file} not found: not a checkpoint written by convbert_ds.train")
    state = run_state.read(path)
    try:
        electra = ElectraConfig(**state.electra_config)
    except (KeyError, TypeError, ConfigError) as error:
        raise ConvertError(f"{state_file}: unusable electra_config ({error})") from None
    return Checkpoint(root, tag, state, electra)


def _optim_file(directory: Path, dp_rank: int, mp_rank: int, precision: str) -> str:
    """DeepSpeed's name for one data-parallel rank's optimizer shard ("bf16_" in bf16 runs)."""
    name = f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
    return "bf16_" + name if precision == "bf16" and not (directory / name).is_file() else name


def expected_files(ckpt: Checkpoint) -> list[str]:
    """Every file of ``ckpt.directory`` the conversion reads."""
    d, precision = ckpt.directory, ckpt.precision
    if ckpt.stages > 1:
        files = [f"layer_{i:02d}-model_states.pt" for i in sorted(pipeline_layer_names(ckpt.electra))]
        if precision != "fp32" and ckpt.zero_stage >= 1:
            for stage in range(ckpt.stages):
                files.append(f"mp_rank_{stage:02d}_model_states.pt")
                files += [_optim_file(d, r, stage, precision) for r in range(ckpt.world_size // ckpt.stages)]
        return files
    if ckpt.zero_stage == 0:
        return ["mp_rank_00_model_states.pt"]
    ranks = range(ckpt.world_size)
    models = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks] if ckpt.zero_stage == 3
              else ["mp_rank_00_model_states.pt"])
    return models + [_optim_file(d, r, 0, precision) for r in ranks]


def check_files(ckpt: Checkpoint) -> None:
    missing = [name for name in expected_files(ckpt) if not (ckpt.directory / name).is_file()]
    if missing:
        raise ConvertError(f"checkpoint {ckpt.directory} ({ckpt.describe()}) is missing {len(missing)} file(s): "
                           f"{', '.join(missing)}; copy the whole tag directory from every node")


@contextlib.contextmanager
def quiet():
    """zero_to_fp32 prints progress to stdout and tqdm bars to stderr; keep both out of the CLI's output."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def _zero_to_fp32(root: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        # The saved fp32 partitions require grad: consolidated with autograd on, every output would keep
        # the whole mmapped optimizer files alive through its graph (as much memory again as the model).
        with quiet(), torch.no_grad(), forced_weights_only(f"DeepSpeed's consolidation of {root / tag}"):
            return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    except Exception as error:  # noqa: BLE001 - DeepSpeed's reader fails in many ways on a damaged checkpoint
        reason = " ".join(str(error).split())  # the CLI prints one line
        raise ConvertError(f"DeepSpeed could not consolidate {root / tag}: {type(error).__name__}: {reason}") from None


def _zero0_masters(ckpt: Checkpoint, module: dict[str, torch.Tensor], optimizer: dict) -> dict[str, torch.Tensor]:
    """bf16/fp16 without ZeRO: the fp16 optimizer's fp32 copies, in the order the trainer grouped them."""
    model = meta_model(ckpt.electra)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in param_groups(model, 0.0) if g["params"]]
    if "fp32_groups" in optimizer:
        saved = [list(g) for g in optimizer["fp32_groups"]]
    else:
        saved = [list(torch.split(flat, [module[n].numel() for n in group]))
                 for flat, group in zip(optimizer["fp32_groups_flat"], groups)]
    if [len(g) for g in saved] != [len(g) for g in groups]:
        raise ConvertError(f"{ckpt.directory}: the optimizer's fp32 groups do not match the model's parameter "
                           "groups; was it written by this version of convbert_ds.train?")
    masters = {}
    for group, tensors in zip(groups, saved):
        for name, tensor in zip(group, tensors):
            tensor = tensor.reshape(module[name].shape)
            if not torch.equal(tensor.to(module[name].dtype), module[name]):
                raise ConvertError(f"{ckpt.directory}: the fp32 master copy of {name} does not round to the "
                                   "module's weight; the optimizer state does not belong to these weights")
            masters[name] = tensor
    return masters


def _pipeline_masters(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Per stage, DeepSpeed's ZeRO-1 consolidation run on a view holding only that stage's files."""
    plain, masters = pipeline_to_plain(ckpt.electra), {}
    for stage in range(ckpt.stages):
        with tempfile.TemporaryDirectory(prefix="convbert_ds-stage-") as view:
            tag_dir = Path(view) / ckpt.tag
            tag_dir.mkdir()
            # A stage's model-states file keeps its weights in the layer files ("module" is None).
            states = safe_load(ckpt.directory / f"mp_rank_{stage:02d}_model_states.pt", mmap=True)
            torch.save({**states, "module": states.get("module") or {}}, tag_dir / "mp_rank_00_model_states.pt")
            for rank in range(ckpt.world_size // ckpt.stages):
                source = _optim_file(ckpt.directory, rank, stage, ckpt.precision)
                os.symlink(ckpt.directory / source, tag_dir / source.replace(f"mp_rank_{stage:02d}", "mp_rank_00"))
            masters.update({plain(name): tensor for name, tensor in _zero_to_fp32(Path(view), ckpt.tag).items()})
    return masters


def _pipeline_state(ckpt: Checkpoint) -> tuple[dict[str, torch.Tensor], str]:
    layer_names = pipeline_layer_names(ckpt.electra)
    weights = {}
    for index, prefix in sorted(layer_names.items()):
        layer = safe_load(ckpt.directory / f"layer_{index:02d}-model_states.pt", map_location="cpu")
        weights.update({prefix + key: tensor for key, tensor in layer.items()})
    if ckpt.precision == "fp32" or ckpt.zero_stage == 0:
        how = "fp32" if ckpt.precision == "fp32" else f"{ckpt.precision}, upcast"
        return {k: v.float() for k, v in weights.items()}, f"pipeline layer files ({how})"
    masters = _pipeline_masters(ckpt)
    for name, tensor in weights.items():
        if name not in masters or not torch.equal(masters[name].to(tensor.dtype), tensor):
            raise ConvertError(f"{ckpt.directory}: the fp32 master copy of {name} is missing or does not round to "
                               "the layer file's weight; the optimizer shards do not belong to these layer files")
    return {k: masters[k] for k in weights}, "fp32 master weights of the pipeline stages (ZeRO-1 shards)"


def read_state_dict(ckpt: Checkpoint) -> tuple[dict[str, torch.Tensor], str]:
    """(fp32 weights under ``ElectraForPretraining`` names, incl. tied aliases; where they came from)."""
    converted = ckpt.directory / tags.UNIVERSAL
    if (converted / META).is_file():  # what a resume on another layout made: the same fp32 masters
        weights = load_file(str(converted / "fp32.safetensors"))
        source = f"fp32 master weights of the universal copy ({ckpt.describe()} before conversion)"
        return complete_aliases(weights, ckpt.electra, f"checkpoint {converted}"), source
    check_files(ckpt)
    check_directory(ckpt.directory)  # every pickle weights-only, before DeepSpeed's reader opens one
    if ckpt.stages > 1:
        weights, source = _pipeline_state(ckpt)
    elif ckpt.zero_stage >= 1:
        weights = _zero_to_fp32(ckpt.root, ckpt.tag)
        source = f"fp32 master weights (ZeRO-{ckpt.zero_stage} shards, deepspeed.utils.zero_to_fp32)"
    else:
        states = safe_load(ckpt.directory / "mp_rank_00_model_states.pt", mmap=True)
        module = states["module"]
        if ckpt.precision == "fp32":
            weights, source = {k: v.float() for k, v in module.items()}, "module weights (fp32)"
        else:
            weights = _zero0_masters(ckpt, module, states["optimizer"])
            source = f"fp32 master weights of the {ckpt.precision} optimizer"
    return complete_aliases(weights, ckpt.electra, f"checkpoint {ckpt.directory}"), source


def complete_aliases(weights: dict[str, torch.Tensor], electra: ElectraConfig, where: str
                     ) -> dict[str, torch.Tensor]:
    """Check ``weights`` against the model the config builds and fill every tied name from its twin.

    The generator shares the discriminator's embeddings and its LM head is the word-embedding table,
    so one tensor has several names; a checkpoint may hold any one of them.
    """
    model = meta_model(electra)
    try:  # unexpected names, wrong shapes
        match_weights(model, weights, where)
    except WeightsError as error:
        raise ConvertError(f"{error}; the config does not match the weights") from None
    params = dict(model.named_parameters(remove_duplicate=False))
    weights = fill_tied(weights, model)
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ConvertError(f"{where} lacks tensors of the configured model: {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''}; the config does not match the weights")
    return {name: weights[name] for name in params}
