"""Building the ELECTRA ``PipelineModule``, its loss, metrics, plain-weight loading and config checks."""

from __future__ import annotations

from collections import deque
from functools import partial

import torch
from deepspeed import comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
from torch import nn

from convbert_ds.config import ConfigError, ElectraConfig
from convbert_ds.formats.checkpoint.names import SHARED_EMBEDDINGS_LAYER, pipeline_layer_names, pipeline_layer_prefixes
from convbert_ds.model.electra import (METRIC_NAMES as ELECTRA_METRIC_NAMES, PretrainingOutput, electra_output,
                                       histogram_auc)
from convbert_ds.engine.pipeline.layers import (MAX_INT_FIELDS, DiscriminatorHidden, EmbeddingProjection, EncoderLayer,
                                                GeneratorHead, GeneratorHidden, MaskedLMOutput, MaskingLayer, RTDHead,
                                                SharedEmbeddings, from_pipe, generator_output_forward, row_float)

EMBEDDINGS_KEY = "embeddings"
_EMBEDDING_PARAMS = ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
                     "LayerNorm.weight", "LayerNorm.bias")
METRIC_NAMES = {"electra": ELECTRA_METRIC_NAMES, "mlm": ("loss", "mlm_loss", "mlm_accuracy")}


def _layer_plan(config: ElectraConfig, seed: int | None = None, packed: bool = False) -> list[LayerSpec]:
    """A spec for every pipeline layer, in the order of ``pipeline_layer_prefixes`` (which names their
    parameters). ``packed``: batches hold several documents (``document_ids``), kept apart as the plain
    model does."""
    electra = config.objective == "electra"
    disc, gen = config.discriminator, (config.generator if electra else config.discriminator)
    # Every stage holding a copy of the table keeps the tensors it uses in step: all of them for ELECTRA
    # (the discriminator's embeddings), only the word table for MLM (its output layer). Listing a tensor
    # a stage never uses would leave it without a gradient to all-reduce.
    tied = list(_EMBEDDING_PARAMS) if electra else ["word_embeddings.weight"]

    def shared(forward_fn=None) -> TiedLayerSpec:
        return TiedLayerSpec(EMBEDDINGS_KEY, SharedEmbeddings, disc, packed, forward_fn=forward_fn,
                             tied_weight_attr=tied)

    def body(model_config, state) -> list[LayerSpec]:
        projection = [LayerSpec(EmbeddingProjection, model_config, state)] \
            if model_config.embedding_size != model_config.hidden_size else []
        return projection + [LayerSpec(EncoderLayer, model_config, state, packed)
                             for _ in range(model_config.num_hidden_layers)]

    plan = [LayerSpec(MaskingLayer, config, seed), shared(), *body(gen, GeneratorHidden),
            LayerSpec(GeneratorHead, gen, config), shared(partial(generator_output_forward, config=config))]
    if electra:
        plan += [*body(disc, DiscriminatorHidden), LayerSpec(RTDHead, disc)]
    if len(plan) != len(pipeline_layer_prefixes(config)):
        raise AssertionError("the pipeline's layers and formats.checkpoint.names disagree: change both together")
    return plan


class ElectraPipelineLoss:
    """``loss_fn`` of the last stage: ``mlm + rtd_weight * rtd`` exactly as ``ElectraForPretraining``.

    Keeps each micro-batch's metrics for ``pipeline_metrics`` (bounded, in case nobody asks). While
    ``count_rtd_scores`` is set (evaluation sets it), it also counts the discriminator's scores
    (``rtd_score_counts``), so that ``pipeline_metrics`` reports the AUC of all those micro-batches together.
    """

    def __init__(self, config: ElectraConfig):
        self.config = config
        self.names = METRIC_NAMES[config.objective]
        self.records: deque[torch.Tensor] = deque(maxlen=4096)
        self.count_rtd_scores = False
        self.rtd_counts: torch.Tensor | None = None

    def __call__(self, outputs, labels) -> torch.Tensor:
        if self.config.objective == "mlm":
            s = from_pipe(MaskedLMOutput, outputs)
            out = PretrainingOutput(s.mlm_loss, s.mlm_loss.detach(), row_float(s.mlm_accuracy_bits))
        else:
            s = from_pipe(DiscriminatorHidden, outputs)
            # The value of the exact float32 loss, the gradient of the copy in the model's dtype.
            mlm = s.mlm_loss.float() + (row_float(s.mlm_loss_bits) - s.mlm_loss.detach().float())
            out = electra_output(mlm, row_float(s.mlm_accuracy_bits), s.hidden, s.is_replaced.bool(),
                                 s.attention_mask, self.config.rtd_weight)
        self.records.append(torch.stack(list(out.metric_tensors().values())))
        if self.count_rtd_scores:
            self.rtd_counts = out.rtd_score_counts(self.rtd_counts)
        return out.loss

    def take_rtd_counts(self) -> torch.Tensor | None:
        counts, self.rtd_counts = self.rtd_counts, None
        return counts


def build_pipeline_module(config: ElectraConfig, num_stages: int, partition_method: str = "parameters",
                          activation_checkpoint_interval: int = 0, seed: int | None = None,
                          packed: bool = False) -> PipelineModule:
    """The ELECTRA (or MLM) pretraining step as a ``PipelineModule`` of the model's own layer classes.

    ``seed``: seeds the per-micro-batch masking/Gumbel streams (offset by the global rank, so
    data-parallel replicas differ); None draws them from torch's global RNG, which ``torch.manual_seed``
    governs as it does for the plain model. ``packed``: batches hold several documents each
    (``data.pack_documents``; ``pipeline_batch`` passes their ``document_ids``). Needs
    a process group first (``engine.distributed.init_process_group``, as the trainer starts it).
    Only encoder layers are activation-checkpointed (recomputing the masking or sampling layers would
    draw new randomness), non-reentrantly: the generator's loss passes through checkpointed layers of
    the discriminator and DeepSpeed's reentrant checkpoint frees its inputs after the first of the
    engine's per-output backward calls.
    """
    widths = {config.discriminator.embedding_size, config.discriminator.hidden_size}
    if config.objective == "electra":
        widths.add(config.generator.hidden_size)
    if min(widths) <= MAX_INT_FIELDS:  # see layers.py: the first float must outgrow the integer fields
        raise ConfigError(f"hidden and embedding widths {sorted(widths)} must exceed {MAX_INT_FIELDS} for the "
                          "pipeline engine; use wider models")
    if seed is not None:
        seed += dist.get_rank()
    plan = _layer_plan(config, seed, packed)
    module = PipelineModule(
        layers=plan, num_stages=num_stages, loss_fn=ElectraPipelineLoss(config),
        partition_method=partition_method, activation_checkpoint_interval=activation_checkpoint_interval,
        activation_checkpoint_func=non_reentrant_checkpoint, checkpointable_layers=[EncoderLayer.__name__])
    module.electra_config = config
    return module


@torch.no_grad()
def load_plain_state_dict(module: PipelineModule, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy an ``ElectraForPretraining`` state dict into this rank's layers (call before ``deepspeed.initialize``).

    Every parameter a local layer holds must be in ``state_dict`` (KeyError otherwise).
    """
    names = pipeline_layer_names(module.electra_config)

    def load(layer: nn.Module, prefix: str) -> None:
        layer.load_state_dict({key: state_dict[prefix + key] for key in layer.state_dict()})

    for local_index, layer in enumerate(module.forward_funcs):
        prefix = names.get(module._local_start + local_index)
        if prefix is not None:
            load(layer, prefix)
    for shared in module.tied_modules.values():  # also the copies that no layer file holds
        load(shared, names[SHARED_EMBEDDINGS_LAYER])


def pipeline_metrics(engine) -> dict[str, float]:
    """The plain model's ``PretrainingOutput.metrics()`` for the last ``train_batch``/``eval_batch``.

    Averaged over its micro-batches and the data-parallel replicas; a collective: every rank calls it
    and gets the same dict. Where the loss counted the discriminator's scores (``count_rtd_scores``:
    evaluation), ``rtd_auc`` is the AUC of all the micro-batches of every replica together instead.
    """
    loss_fn: ElectraPipelineLoss = engine.module.loss_fn
    values = torch.zeros(len(loss_fn.names), device=engine.device)
    if engine.is_last_stage():
        # The engine resets fwd_outputs at every schedule: one loss per micro-batch of the last step.
        micro_batches = len(engine.fwd_outputs)
        values = torch.stack(list(loss_fn.records)[-micro_batches:]).mean(0).to(engine.device)
        loss_fn.records.clear()
        counts = loss_fn.take_rtd_counts()
        if engine.is_data_parallel:
            dist.all_reduce(values, group=engine.grid.get_data_parallel_group())
            values /= engine.dp_world_size
            if counts is not None:
                dist.all_reduce(counts, group=engine.grid.get_data_parallel_group())
        if counts is not None:
            values[loss_fn.names.index("rtd_auc")] = histogram_auc(counts)
    if engine.is_pipe_parallel:
        dist.broadcast(values, src=engine.grid.stage_to_global(engine.num_stages - 1),
                       group=engine.grid.get_pipe_parallel_group())
    return dict(zip(loss_fn.names, values.tolist()))


def pipeline_batch(batch: dict[str, torch.Tensor]) -> tuple:
    """A data-loader batch -> ``(inputs, labels)`` for ``PipelineEngine.train_batch``'s iterator.

    ``labels`` is empty: what the loss needs (masks, corruptions, the generator's loss) is made on the
    first stage and travels down the pipe, so the last stage's batch cannot disagree with the first's.
    """
    input_ids = batch["input_ids"].long()
    attention_mask, token_type_ids = batch.get("attention_mask"), batch.get("token_type_ids")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    token_type_ids = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids.long()
    # The tuple's shape is fixed: unpacked batches send a copy of the mask that no layer reads.
    document_ids = batch["document_ids"].long() if "document_ids" in batch else attention_mask
    return (input_ids, attention_mask, token_type_ids, document_ids), ()


def check_pipeline_ds_config(ds_config: dict) -> None:
    """Reject DeepSpeed settings the pipeline engine cannot run, before it starts."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage >= 2:
        raise ConfigError(f"zero_optimization.stage={stage} cannot be combined with pipeline parallelism; "
                          "use stage 0 or 1")
    if (ds_config.get("torch_autocast") or {}).get("enabled"):
        raise ConfigError("torch_autocast.enabled=true with pipeline parallelism: not supported (the pipeline's "
                          "checkpoints and clipping are built for DeepSpeed's bf16); use "
                          "ds_configs/pipeline_zero1_bf16.json")
    if (ds_config.get("bf16") or {}).get("enabled") and stage != 1:
        raise ConfigError(f"bf16.enabled=true with zero_optimization.stage={stage}: DeepSpeed's pipeline engine "
                          "cannot reload such checkpoints; set zero_optimization.stage=1")
    clipping = ds_config.get("gradient_clipping", 1.0)  # DeepSpeed's default
    if stage == 0 and clipping and not (ds_config.get("fp16") or {}).get("enabled"):
        raise ConfigError(f"gradient_clipping={clipping} with zero_optimization.stage=0 in fp32: DeepSpeed's pipeline "
                          "engine then clips by the norm of the first stage's gradients only; use "
                          "zero_optimization.stage=1 or set gradient_clipping=0")
