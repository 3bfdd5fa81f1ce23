"""What more than one benchmark uses, in one place (a module, not a script):

- the timing loop of the op benchmarks (``medians_ms``) and their packed input (``three_documents_per_sample``);
- the model and data of the step benchmarks (``build_shards``, ``electra_config``, ``electra_config_for``,
  ``SPECIAL_IDS``);
- inductor's own count of what a compiled function launches (``compiled_counts``, for ``--compile``);
- transformers' ConvBERT as an ELECTRA step (``HFElectra``): the baseline row of ``train_step.py``;
- one encoder layer in two variants, side by side (``compare``): ``input_projections.py``, ``residual_dtype.py``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from convbert_ds.cli import ArgumentParser, bounded
from convbert_ds.config import PRESET_NAMES, ElectraConfig, ModelConfig
from convbert_ds.model.electra import IGNORE_INDEX, gumbel_sample, mask_tokens
from convbert_ds.model.hf_io import config_json
from convbert_ds.model.layers import padding_masks
from convbert_ds.model.op_count import OpCounter

if TYPE_CHECKING:  # transformers is imported by the one row that runs it (seconds to import)
    import transformers


def medians_ms(runs: dict[str, Callable[[], object]], reps: int, cuda: bool, warmup: int = 3) -> dict[str, float]:
    """Median wall time in milliseconds of each of ``runs`` over ``reps`` calls, after ``warmup`` untimed ones
    (where ``torch.compile`` compiles). The runs take turns, one call each per round, so a machine that slows
    down or speeds up part of the way through (a shared CPU, a GPU's clocks) weighs on all of them alike.
    On CUDA each call is timed between two synchronizations: its kernels count whole, and none of the
    previous call's spill into it."""
    for once in runs.values():
        for _ in range(warmup):
            once()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, once in runs.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            once()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in times.items()}


def three_documents_per_sample(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """``document_ids`` ``[batch, seq]`` of samples packed from three documents of about a third each (ids 1-3;
    a remainder of ``seq`` past three thirds is a fourth)."""
    return (torch.arange(seq, device=device) // max(1, seq // 3) + 1).expand(batch, -1).contiguous()


def build_shards(work: Path, vocab_size: int) -> Path:
    """``work/shards``: the built-in corpus (the standard library's docstrings) under a tokenizer of
    ``vocab_size`` pieces, through the real preprocessing."""
    from convbert_ds.builtin.stdlib_docstrings import write_corpus
    from preprocessing.shard import shard_corpus
    from preprocessing.tokenizer import train_tokenizer

    corpus = write_corpus(work / "corpus.txt")
    tokenizer = train_tokenizer([str(corpus)], str(work / "tokenizer"), vocab_size=vocab_size)
    shard_corpus([str(corpus)], str(tokenizer), str(work / "shards"), workers=1)
    return work / "shards"


def electra_config(preset: str, split):
    """The model for ``preset``, sized to the shards' tokenizer (as ``engine.plan`` sizes it)."""
    return electra_config_for(preset, split.vocab_size, split.special_ids)


# The special tokens' ids (pad, cls, sep, mask) of a model built without shards, over BERT's vocabulary size.
VOCAB, SPECIAL_IDS = 30522, {"pad": 0, "cls": 2, "sep": 3, "mask": 4}


def electra_config_for(preset: str, vocab_size: int, ids: dict, max_position_embeddings: int = 512,
                       **body_overrides):
    """The model for ``preset`` over a vocabulary of ``vocab_size`` whose special tokens are ``ids`` (pad, cls,
    sep, mask); ``body_overrides`` go to the body's preset (e.g. ``sdconv_impl``)."""
    from convbert_ds.config import generator_config, preset_generator_multiplier
    from convbert_ds.config import preset as body_preset

    body = body_preset(preset, vocab_size=vocab_size, pad_token_id=ids["pad"],
                       max_position_embeddings=max_position_embeddings, **body_overrides)
    return ElectraConfig(discriminator=body, generator=generator_config(body, preset_generator_multiplier(preset)),
                         mask_token_id=ids["mask"], special_token_ids=(ids["pad"], ids["cls"], ids["sep"]))


# The logger inductor checks before it counts a graph's bytes (torch._inductor.compile_fx's artifact logger).
_INDUCTOR_METRICS_LOGGER = "torch._inductor.compile_fx.__inductor_metrics"


@contextlib.contextmanager
def inductor_metrics_counted():
    """Inside: inductor adds each graph it compiles to ``torch._inductor.metrics`` (reset on entry): the bytes
    (``num_bytes_accessed``) and the kernels they are of (``nodes_num_elem``). It counts only when its metrics
    logger is enabled (the logger's records are dropped here), and a graph from its on-disk caches brings
    the total back but not the kernels, so the caches are off inside."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics

    logger = logging.getLogger(_INDUCTOR_METRICS_LOGGER)
    saved = logger.level, logger.propagate, list(logger.handlers)
    logger.setLevel(logging.INFO)
    logger.propagate, logger.handlers = False, [logging.NullHandler()]
    metrics.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            yield metrics
    finally:
        logger.level, logger.propagate, logger.handlers = saved[0], saved[1], saved[2]


def compiled_counts(name: str, first_call: Callable[[], object]) -> dict[str, float]:
    """Inductor's own count (``torch._inductor.metrics``) of what ``first_call`` compiles, the first forward and
    backward of a ``torch.compile``d function: ``kernels`` it launches, matmuls included; ``mb``, the bytes all
    of them read and write ("MB moved"); ``fused_mb``, those of the kernels inductor fuses itself ("MB
    fused": the elementwise and reduction work between the matmuls, bound by its bytes on a GPU). ``name``
    says which function, in the error when nothing was counted."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    with inductor_metrics_counted() as metrics:
        first_call()
    counts = {"kernels": sum(not isinstance(node, NopKernelSchedulerNode) for node, _ in metrics.nodes_num_elem),
              "mb": metrics.num_bytes_accessed / 1e6,
              "fused_mb": 4 * sum(quarter for node, quarter in metrics.nodes_num_elem  # (bytes // 4) per kernel
                                  if not isinstance(node, ExternKernelSchedulerNode)) / 1e6}
    if not counts["kernels"]:
        raise RuntimeError(f"inductor counted no kernel for {name!r}: this torch ({torch.__version__}) does not "
                           f"count through the logger {_INDUCTOR_METRICS_LOGGER!r} or compiled from a cache; run "
                           "without --compile, or update benchmarks/common.py")
    return counts


def hf_config(config: ModelConfig, architecture: str) -> transformers.ConvBertConfig:
    """Our ModelConfig as transformers' ConvBertConfig (the config.json our exports write)."""
    import transformers

    return transformers.ConvBertConfig(**config_json(config, architecture, native_ok=False))


class HFElectra(nn.Module):
    """ELECTRA's generator + discriminator built from transformers' ConvBERT classes, as a user would write it
    on top of transformers; ``forward`` returns the loss. ``ConvBertForMaskedLM`` is the generator (our
    generator's sizes), ``ConvBertModel`` under ELECTRA's replaced-token-detection head (transformers'
    ``ElectraDiscriminatorPredictions``: the head our discriminator has), the embeddings shared as ELECTRA
    shares them. Masking is ours (``mask_tokens``), so both sides mask the same positions at the same rate;
    the generator's loss and logits are transformers' (the LM head over every position, where ours runs it
    on the masked ones only), the replacement is a Gumbel sample at every masked position, and loss = mlm +
    rtd_weight (50) x rtd. ``train_step.py`` runs it in the same plain loop as our model."""

    def __init__(self, config: ElectraConfig):
        import transformers
        from transformers.models.electra.modeling_electra import ElectraDiscriminatorPredictions

        super().__init__()
        if config.objective != "electra" or config.tie_generator_body:
            raise ValueError(f"HFElectra: objective={config.objective!r}, tie_generator_body="
                             f"{config.tie_generator_body}: the baseline builds the default ELECTRA pair only; "
                             "use objective='electra' with an untied generator")
        self.config = config
        disc = config.discriminator
        self.generator = transformers.ConvBertForMaskedLM(hf_config(config.generator, "ConvBertForMaskedLM"))
        self.discriminator = transformers.ConvBertModel(hf_config(disc, "ConvBertModel"))
        self.discriminator_predictions = ElectraDiscriminatorPredictions(
            transformers.ElectraConfig(hidden_size=disc.hidden_size, hidden_act=disc.hidden_act))
        # ELECTRA shares the embedding tables (ElectraConfig checks their sizes agree); the generator's LM
        # head stays tied to the word embeddings, now the shared ones.
        self.generator.convbert.embeddings = self.discriminator.embeddings
        self.generator.generator_lm_head.weight = self.discriminator.embeddings.word_embeddings.weight

    @torch.no_grad()
    def load_from(self, ours: nn.Module) -> None:
        """Start from the weights of our ``ElectraForPretraining`` (our modules carry transformers' names), so
        every row of the benchmark starts from the same model."""
        self.generator.load_state_dict(ours.generator.state_dict(), strict=True)
        self.discriminator.load_state_dict(ours.discriminator.convbert.state_dict(), strict=True)
        self.discriminator_predictions.load_state_dict(ours.discriminator.discriminator_predictions.state_dict(),
                                                       strict=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
                ) -> torch.Tensor:
        config = self.config
        masking = mask_tokens(input_ids, attention_mask, config)
        generated = self.generator(masking.masked_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   labels=masking.labels)
        # A sample at every position, kept at the masked ones: no boolean indexing, so whatever syncs this
        # row shows come from transformers, not from this loop.
        sampled = gumbel_sample(generated.logits.detach(), config.temperature)
        corrupted = torch.where(masking.labels != IGNORE_INDEX, sampled, input_ids)
        hidden = self.discriminator(corrupted, attention_mask=attention_mask,
                                    token_type_ids=token_type_ids).last_hidden_state
        logits = self.discriminator_predictions(hidden)
        weight = attention_mask.float()
        per_token = F.binary_cross_entropy_with_logits(logits.float(), (corrupted != input_ids).float(),
                                                       reduction="none")
        rtd = (per_token * weight).sum() / weight.sum().clamp_min(1)
        return generated.loss + config.rtd_weight * rtd


def compile_hf_layers(model: HFElectra) -> int:
    """transformers' encoder layers through torch.compile, as ``compile_layers`` does ours (``--compile``)."""
    from transformers.models.convbert.modeling_convbert import ConvBertLayer

    layers = [module for module in model.modules() if isinstance(module, ConvBertLayer)]
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)


@dataclass
class Variant:
    """One variant of a layer benchmark: the layer, and the dtype the layer before it hands it (the
    residual stream's)."""
    layer: nn.Module
    input_dtype: torch.dtype = torch.float32


def parse_arguments(doc: str, argv: list[str] | None):
    """The layer benchmarks' command line (``doc``: the script's docstring); sets ``--threads``."""
    parser = ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base", help="the discriminator's layer")
    parser.add_argument("--batch", type=bounded(int, min=1), default=None, help="default: 128 on CUDA, 8 on CPU")
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--reps", type=bounded(int, min=1), default=20)
    parser.add_argument("--compile", action="store_true", help="each layer through torch.compile (inductor)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def compare(args, config: ModelConfig, variants: dict[str, Variant], autocast: bool) -> dict[str, dict[str, float]]:
    """Print the comparison of ``variants`` of ``config``'s layer at ``args``' sizes (``parse_arguments``),
    forward + backward on the same weights and inputs (samples packed from three documents each, the
    trainer's default input); the first variant is the one the others' outputs are checked against. Each
    variant's figures are returned and printed: ``ms`` (median over ``reps`` after warm-up, the variants
    taking turns), ``ops`` (the ATen ops one forward + backward dispatches, eager: about one kernel each on a
    GPU), and with ``--compile`` ``compiled_counts``' ``kernels``, ``mb`` and ``fused_mb``."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch, seq, reps, compile = args.batch or (128 if cuda else 8), args.seq, args.reps, args.compile
    x32 = torch.randn(batch, seq, config.hidden_size, device=device)
    inputs = {name: x32.to(v.input_dtype).requires_grad_() for name, v in variants.items()}
    grad_out = torch.randn_like(x32)
    masks = padding_masks(None, three_documents_per_sample(batch, seq, device), config.conv_kernel_size)
    precision = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)

    def fwd_bwd(name: str, module: nn.Module):
        def once():
            with precision:
                out = module(inputs[name], masks)
            torch.autograd.grad(out, [inputs[name], *module.parameters()], grad_out.to(out.dtype))
        return once

    outputs = []
    for name, variant in variants.items():
        torch.manual_seed(1)  # dropout: the same draws for every variant
        with precision:
            outputs.append(variant.layer(inputs[name], masks).float())
    difference = max((out - outputs[0]).abs().max() for out in outputs[1:]) / outputs[0].abs().max()
    figures: dict[str, dict[str, float]] = {}
    for name, variant in variants.items():
        with OpCounter() as counter:
            fwd_bwd(name, variant.layer)()
        figures[name] = {"ops": counter.total}
    runs = {}
    for name, variant in variants.items():
        runs[name] = fwd_bwd(name, torch.compile(variant.layer) if compile else variant.layer)
        if compile:
            figures[name].update(compiled_counts(name, runs[name]))  # compiles its forward and backward
    for name, ms in medians_ms(runs, reps, cuda).items():
        figures[name]["ms"] = ms
    print(f"device={torch.cuda.get_device_name() if cuda else 'cpu'} preset={args.preset} layer (hidden "
          f"{config.hidden_size}, heads {config.num_heads} x {config.head_dim}) batch={batch} seq={seq} "
          f"precision={'bf16 autocast' if autocast else 'fp32'} compile={'on' if compile else 'off'} "
          f"threads={torch.get_num_threads()} reps={reps}")
    print(f"largest difference of the outputs over the largest output: {difference:.1e}")
    print(f"{'layer':<48}{'fwd+bwd (ms)':>14}{'eager ops':>11}"
          + (f"{'kernels':>9}{'MB moved':>10}{'MB fused':>10}" if compile else ""))
    for name, f in figures.items():
        print(f"{name:<48}{f['ms']:>14.3f}{f['ops']:>11,}"
              + (f"{f['kernels']:>9,}{f['mb']:>10.1f}{f['fused_mb']:>10.1f}" if compile else ""))
    return figures


def ratio_line(label: str, top: dict[str, float], bottom: dict[str, float]) -> str:
    """``label: T (time), O (ops)[, K (compiled kernels), B (bytes), F (fused kernels' bytes)]``: one
    variant's figures over another's."""
    parts = [f"{top[key] / bottom[key]:.3f} ({what})" for key, what in
             (("ms", "time"), ("ops", "ops"), ("kernels", "compiled kernels"), ("mb", "bytes"),
              ("fused_mb", "fused kernels' bytes")) if key in top]
    return f"{label}: " + ", ".join(parts)
