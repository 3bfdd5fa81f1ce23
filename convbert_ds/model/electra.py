"""ELECTRA-style pretraining of ConvBERT: generator MLM + discriminator replaced-token detection.

One step, as in ELECTRA (Clark et al. 2020) and the ConvBERT paper's appendix:
1. mask 15% of the real tokens (``ElectraConfig.masking``: the official code's fixed count per
   sequence by default, or each token independently); of those, 85% become [MASK], 15% keep their token;
2. the generator (a narrower ConvBERT sharing the embedding tables) predicts the
   masked tokens (MLM loss) and one replacement per masked position is sampled
   from its softmax with Gumbel noise at temperature 1 (no gradient flows
   through the sample);
3. the discriminator sees the corrupted sequence and predicts, per real token,
   whether it was replaced; a position counts as replaced only when the sample
   differs from the original;
4. loss = mlm + rtd_weight (50) * rtd.

``tie_generator_body`` is ELECTRA's "tie all weights" variant: the generator is the discriminator's own
encoder under an MLM head, so the encoder learns from both losses. At the tiny preset, with rtd_weight
1, this is what makes pretraining transfer (configs/quickstart.yaml, benchmarks/RESULTS.md).

The ``mlm`` objective trains the masked-LM model alone (BERT-style baseline).
Each step is a small function so the pipeline engine can place them on stages.

The step never waits for the device: every shape is fixed by the batch (the masked positions are ``P``
slots per sequence, gathered and scattered, never selected by a boolean mask), nothing is read back with
``.item()``, and the metrics are computed only when asked. So a GPU's host can queue steps ahead, and the
whole forward and backward compile into one graph (``train.compile_mode=step``);
``tests/model/test_step_budget.py`` counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from convbert_ds.config import ElectraConfig
from convbert_ds.model.convbert import ConvBertForMaskedLM, ConvBertForPreTraining, check_inputs

IGNORE_INDEX = -100


class Masking(NamedTuple):
    """One draw of dynamic masking, in static shapes: ``P`` slots per sequence (``prediction_slots``), of which
    ``chosen`` are masked positions and the rest weigh nothing."""

    masked_ids: torch.Tensor  # [B, T] the generator's input
    labels: torch.Tensor  # [B, T] the original token where masked, -100 elsewhere
    positions: torch.Tensor  # [B, P] distinct positions of each sequence, the masked ones among them
    chosen: torch.Tensor  # [B, P] bool: the position is masked


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: ElectraConfig,
                generator: torch.Generator | None = None) -> Masking:
    """Dynamic masking, without a host-device sync and in shapes that do not depend on the draw.

    Which positions: ``config.masking`` (see ``ElectraConfig``). Of those, ``mask_token_prob`` (85%) become
    [MASK] and the rest keep their token; none gets a random token (ELECTRA's and ConvBERT's code).
    """
    can_mask = torch.ones_like(input_ids, dtype=torch.bool)
    for special in (*config.special_token_ids, config.mask_token_id):
        can_mask &= input_ids != special
    if attention_mask is not None:
        can_mask &= attention_mask.bool()
    if config.masking == "fixed":
        masked = _fixed_count(can_mask, attention_mask, config, generator)
        draw = torch.rand(input_ids.shape, device=input_ids.device, generator=generator)
        use_mask_token = masked & (draw < config.mask_token_prob)
    else:
        draw = torch.rand(input_ids.shape, device=input_ids.device, generator=generator)
        masked = can_mask & (draw < config.mask_prob)
        # Re-use the same draw: among masked positions (draw < p), the lowest 85% of the range get [MASK].
        use_mask_token = masked & (draw < config.mask_prob * config.mask_token_prob)
    masked_ids = torch.where(use_mask_token, torch.full_like(input_ids, config.mask_token_id), input_ids)
    labels = torch.where(masked, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return Masking(masked_ids, labels, *masked_positions(labels, config))


def masked_positions(labels: torch.Tensor, config: ElectraConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """MLM labels ``[B, T]`` -> (``[B, P]`` positions, the masked ones first, in order; ``[B, P]`` bool: masked).

    ``P = prediction_slots(config, T)``. A stable sort instead of ``nonzero``: no sync, a static shape, and
    the same slots wherever the labels are (the pipeline recovers them from the labels it carries).
    """
    masked = labels != IGNORE_INDEX
    slots = prediction_slots(config, labels.shape[1])
    positions = torch.sort((~masked).to(torch.uint8), dim=1, stable=True).indices[:, :slots]
    return positions, masked.gather(1, positions)


def _fixed_count(can_mask: torch.Tensor, attention_mask: torch.Tensor | None, config: ElectraConfig,
                 generator: torch.Generator | None) -> torch.Tensor:
    """The official count per sequence, k = max(1, min(cap, round(mask_prob x real tokens))), at k distinct
    positions drawn uniformly among the maskable ones (fewer only when fewer are maskable).

    The official code draws its k positions with replacement, so a duplicate masks one position less
    (about 17.7 instead of 19 at 128 tokens); we draw k distinct positions: the count is the formula's.
    """
    batch, seq_len = can_mask.shape
    real = attention_mask.sum(-1) if attention_mask is not None else torch.full((batch,), seq_len)
    cap = prediction_slots(config, seq_len)  # "fixed": the cap, at most the sequence
    count = torch.minimum(_fixed_k(real, config, cap).to(can_mask.device), can_mask.sum(-1))
    # Uniform scores, non-candidates last: the ``cap`` lowest are a uniform draw without replacement.
    scores = torch.rand(can_mask.shape, device=can_mask.device, generator=generator).masked_fill(~can_mask, 2.0)
    chosen = scores.topk(cap, dim=-1, largest=False).indices
    keep = torch.arange(cap, device=can_mask.device) < count[:, None]
    return torch.zeros_like(can_mask).scatter_(1, chosen, keep)


def _fixed_k(real_tokens: torch.Tensor, config: ElectraConfig, cap: int) -> torch.Tensor:
    """"fixed" masking's count per sequence, max(1, min(cap, round(mask_prob x real tokens))), rounded half to
    even, before the maskable tokens bound it; ``cap``: ``prediction_slots``."""
    return torch.round(real_tokens.to(torch.float64) * config.mask_prob).long().clamp(1, cap)


def prediction_slots(config: ElectraConfig, seq_len: int) -> int:
    """``P``: how many positions per sequence the generator's head runs on: the "fixed" cap, or every position
    for "bernoulli" (whose count has no bound)."""
    return min(config.max_predictions(seq_len), seq_len) if config.masking == "fixed" else seq_len


def predictions_per_sequence(config: ElectraConfig, seq_len: int) -> float:
    """How many positions the MLM loss predicts in a sequence of ``seq_len`` real tokens: "fixed" masking's
    count (``_fixed_count``'s k), or ``mask_prob`` of the tokens for "bernoulli" (a bound on its expectation
    from above: [CLS] and [SEP] are never drawn). The model FLOPs of the generator's head (``engine.flops``)
    count these: the head's other slots (``prediction_slots``) are work the loss does not use."""
    if config.masking == "fixed":
        return float(_fixed_k(torch.tensor(seq_len), config, prediction_slots(config, seq_len)))
    return config.mask_prob * seq_len


def gumbel_sample(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), via the Gumbel-max trick; no gradient."""
    with torch.no_grad():
        # Drawn by shape (as ``rand_like`` would, the same numbers): ``rand_like`` of a fused value makes a compiled
        # step with torch's own draws store the logits only to hand that op a tensor to copy the shape of.
        uniform = torch.rand(logits.shape, dtype=torch.float32, device=logits.device)
        gumbel = -torch.log((-torch.log(uniform.clamp_min(1e-9))).clamp_min(1e-9))
        return (logits.float() / temperature + gumbel).argmax(dim=-1)


METRIC_NAMES = ("loss", "mlm_loss", "rtd_loss", "mlm_accuracy", "rtd_accuracy", "rtd_auc", "replaced_fraction")


@dataclass
class PretrainingOutput:
    """``loss`` is differentiable; the rest is detached and stays on the device.

    ``metric_tensors()`` turns it into the logged metrics (``METRIC_NAMES``) without reading anything back to
    the host, and only when asked: the trainer asks on logging steps. ``replaced_fraction`` is the share of
    real tokens the generator replaced, so ``1 - replaced_fraction`` is the accuracy of a discriminator that
    always answers "original"; ``rtd_auc`` (0.5 = no skill) shows learning even while accuracy sits there.
    Here ``rtd_auc`` is this batch's exact AUC (a training step logs the mean over its micro-batches); the
    validation pass reports the AUC of the whole set instead, from ``rtd_score_counts`` (``histogram_auc``).
    """

    loss: torch.Tensor
    mlm_loss: torch.Tensor
    mlm_accuracy: torch.Tensor
    rtd_loss: torch.Tensor | None = None
    rtd_accuracy: torch.Tensor | None = None
    rtd_logits: torch.Tensor | None = None  # [B, T]
    is_replaced: torch.Tensor | None = None  # [B, T] bool
    real: torch.Tensor | None = None  # [B, T] bool: not padding

    def metric_tensors(self, batch_auc: bool = True) -> dict[str, torch.Tensor]:
        """``batch_auc=False`` leaves ``rtd_auc`` out (and its sort undone): for a caller that takes the AUC
        of many batches together (``rtd_score_counts``)."""
        metrics = {"loss": self.loss.detach(), "mlm_loss": self.mlm_loss, "mlm_accuracy": self.mlm_accuracy}
        if self.rtd_logits is not None:
            weight = self.real.float()
            metrics.update(rtd_loss=self.rtd_loss, rtd_accuracy=self.rtd_accuracy,
                           replaced_fraction=(self.is_replaced.float() * weight).sum() / weight.sum().clamp_min(1))
            if batch_auc:
                metrics["rtd_auc"] = binary_auc(self.rtd_logits, self.is_replaced, weight)
        return {name: metrics[name].float() for name in METRIC_NAMES if name in metrics}

    def rtd_score_counts(self, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """This batch's discriminator scores counted into ``into`` (``rtd_score_counts``); None for ``mlm``."""
        if self.rtd_logits is None:
            return into
        return rtd_score_counts(self.rtd_logits, self.is_replaced, self.real, into)

    def metrics(self) -> dict[str, float]:
        metrics = self.metric_tensors()
        return dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))


def mlm_loss_and_sample(generator: ConvBertForMaskedLM, hidden: torch.Tensor, input_ids: torch.Tensor,
                        positions: torch.Tensor, chosen: torch.Tensor, temperature: float, sample: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """MLM loss and accuracy over the masked positions, and optionally a Gumbel sample per position.

    The LM head runs on the ``P`` gathered positions only (``V x`` less work than on every token); the
    unchosen ones among them weigh nothing. Shapes are static and nothing is read back to the host.
    Returns the loss, the accuracy and the samples ``[B, P]`` (or None).
    """
    picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, P, H]
    logits = generator.head(picked)  # [B, P, V]
    targets = input_ids.gather(1, positions)
    weight = chosen.float()
    count = weight.sum().clamp_min(1)
    per_position = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    loss = (per_position * weight.flatten()).sum() / count
    accuracy = ((logits.detach().argmax(-1) == targets).float() * weight).sum() / count
    sampled = gumbel_sample(logits.detach(), temperature) if sample else None
    return loss, accuracy, sampled


def binary_auc(scores: torch.Tensor, positive: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Area under the ROC curve (Mann-Whitney U; ties count as half) over the entries with ``weight`` 1
    (all when None); 0.5 when a class is empty. No host-device sync: ranks come from a sort and
    ``searchsorted`` (a tied group's average rank = those below it + (its size + 1) / 2)."""
    # NaN would sort past every number and index past the end: a diverged model's AUC is a number, not a crash.
    scores, positive = torch.nan_to_num(scores.detach().float().flatten()), positive.flatten().float()
    weight = torch.ones_like(scores) if weight is None else weight.flatten().float()
    ordered, order = torch.sort(scores)
    below_or_equal = torch.cumsum(weight[order], 0)  # counted entries <= ordered[i]
    below = below_or_equal - weight[order]
    first = torch.searchsorted(ordered, scores, right=False)  # the first of each score's tied group
    last = torch.searchsorted(ordered, scores, right=True) - 1
    ranks = (below[first] + below_or_equal[last] + 1) / 2
    n_pos = (positive * weight).sum()
    n_neg = weight.sum() - n_pos
    u = (ranks * positive * weight).sum() - n_pos * (n_pos + 1) / 2
    return torch.where(n_pos * n_neg > 0, u / (n_pos * n_neg).clamp_min(1), torch.full_like(u, 0.5))


# The AUC of a whole validation set, from counts: the discriminator's logits fall into AUC_BINS equal bins over
# [-AUC_LOGIT_RANGE, AUC_LOGIT_RANGE] (beyond it, into the end bins), counted per class on the device, batch
# after batch; ranks add their counts with the pass's one all-reduce and the AUC is read once at the end.
# Bins of 2**-15 logits: within one bin, scores tie (count half), which is the only error (``histogram_auc``);
# a bf16 logit's own spacing is wider outside |x| < 2**-8. 2 x 2**20 float64 counts: 16 MiB per evaluation.
AUC_BINS = 2**20
AUC_LOGIT_RANGE = 16.0


def rtd_score_counts(logits: torch.Tensor, is_replaced: torch.Tensor, real: torch.Tensor,
                     into: torch.Tensor | None = None) -> torch.Tensor:
    """Add each real token's logit to per-class bin counts; returns ``into`` (or a new one), shape
    ``[2 * AUC_BINS]`` float64: the originals' counts, then the replaced tokens'. No host-device sync, and
    float64 counts of whole numbers are exact whatever order the device adds them in.

    NaN counts as 0 (as ``binary_auc`` reads it): a diverged model's AUC is a number, not a crash."""
    x = torch.nan_to_num(logits.detach().float(), nan=0.0).clamp(-AUC_LOGIT_RANGE, AUC_LOGIT_RANGE)
    # Monotone in x (so scores in different bins keep their order); x + range >= 0, so truncation is floor.
    bins = ((x + AUC_LOGIT_RANGE) * (AUC_BINS / (2 * AUC_LOGIT_RANGE))).long().clamp_max(AUC_BINS - 1)
    index = (bins + AUC_BINS * is_replaced.long()).flatten()
    if into is None:
        into = torch.zeros(2 * AUC_BINS, dtype=torch.float64, device=logits.device)
    return into.index_add_(0, index, real.flatten().to(torch.float64))


def histogram_auc(counts: torch.Tensor) -> torch.Tensor:
    """The Mann-Whitney AUC (P(replaced scores above original), ties half) of the scores ``rtd_score_counts``
    counted, with scores in one bin taken as tied; 0.5 when a class is empty. A 0-dim float64 tensor: no read.

    Error bound: only pairs (replaced, original) sharing a bin can differ from the exact AUC, each by at most
    half, so ``|histogram_auc - exact| <= histogram_auc_bound(counts)`` = 1/2 x sum over bins of
    replaced x original / (all replaced x all original). For logits with a density of at most f per unit
    logit that is at most f x 2**-16: 6e-6 for logits of unit variance (f = 0.4), 1.2e-4 for the narrow
    logits of an untrained discriminator (standard deviation 0.05, f = 8)."""
    original, replaced = counts.view(2, AUC_BINS)
    originals_below = torch.cumsum(original, 0) - original
    n_replaced, n_original = replaced.sum(), original.sum()
    u = (replaced * (originals_below + 0.5 * original)).sum()
    pairs = n_replaced * n_original
    return torch.where(pairs > 0, u / pairs.clamp_min(1), torch.full_like(u, 0.5))


def histogram_auc_bound(counts: torch.Tensor) -> torch.Tensor:
    """The most ``histogram_auc(counts)`` can differ from the exact AUC of the scores counted (see there)."""
    original, replaced = counts.view(2, AUC_BINS)
    return 0.5 * (replaced * original).sum() / (replaced.sum() * original.sum()).clamp_min(1)


def rtd_loss(logits: torch.Tensor, is_replaced: torch.Tensor, attention_mask: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean binary cross-entropy over real tokens, and the discriminator's accuracy there."""
    weight = torch.ones_like(logits) if attention_mask is None else attention_mask.to(logits.dtype)
    per_token = F.binary_cross_entropy_with_logits(logits.float(), is_replaced.float(), reduction="none")
    count = weight.sum().clamp_min(1)
    loss = (per_token * weight).sum() / count
    accuracy = (((logits.detach() > 0) == is_replaced).to(weight.dtype) * weight).sum() / count
    return loss, accuracy


def electra_output(mlm: torch.Tensor, mlm_accuracy: torch.Tensor, rtd_logits: torch.Tensor,
                   is_replaced: torch.Tensor, attention_mask: torch.Tensor | None, rtd_weight: float
                   ) -> PretrainingOutput:
    """The ELECTRA loss (``mlm + rtd_weight * rtd``) and metrics from the generator's MLM loss and accuracy
    and the discriminator's logits; shared by the plain model and the pipeline's last stage."""
    rtd, rtd_acc = rtd_loss(rtd_logits, is_replaced, attention_mask)
    real = torch.ones_like(is_replaced) if attention_mask is None else attention_mask.bool()
    return PretrainingOutput(mlm + rtd_weight * rtd, mlm.detach(), mlm_accuracy.detach(), rtd.detach(),
                             rtd_acc.detach(), rtd_logits.detach(), is_replaced, real)


class ElectraForPretraining(nn.Module):
    """Generator + discriminator with shared embeddings; ``forward`` returns a ``PretrainingOutput``."""

    def __init__(self, config: ElectraConfig):
        super().__init__()
        self.config = config
        if config.objective == "mlm":
            self.generator = ConvBertForMaskedLM(config.discriminator)
            self.discriminator = None
        else:
            self.discriminator = ConvBertForPreTraining(config.discriminator)
            shared_body = self.discriminator.convbert if config.tie_generator_body else None
            self.generator = ConvBertForMaskedLM(config.generator, self.discriminator.convbert.embeddings, shared_body)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, check: bool = True,
                document_ids: torch.Tensor | None = None) -> PretrainingOutput:
        """``check=False``: the caller has checked these inputs (the trainer checks each batch on the host,
        where reading its values costs no device sync); the step then never waits for the device.
        ``document_ids``: packed samples (``ConvBertModel.forward``); both bodies keep documents apart."""
        config = self.config
        if check:
            check_inputs(config.discriminator, input_ids, attention_mask, token_type_ids, document_ids)
        masking = mask_tokens(input_ids, attention_mask, config)
        hidden = self.generator.convbert(masking.masked_ids, attention_mask, token_type_ids, check=False,
                                         document_ids=document_ids)
        mlm, mlm_acc, sampled = mlm_loss_and_sample(self.generator, hidden, input_ids, masking.positions,
                                                    masking.chosen, config.temperature,
                                                    sample=self.discriminator is not None)
        if self.discriminator is None:
            return PretrainingOutput(mlm, mlm.detach(), mlm_acc)
        corrupted, is_replaced = corrupt(input_ids, masking.positions, masking.chosen, sampled)
        rtd_logits = self.discriminator(corrupted, attention_mask, token_type_ids, check=False,
                                        document_ids=document_ids)
        return electra_output(mlm, mlm_acc, rtd_logits, is_replaced, attention_mask, config.rtd_weight)


def corrupt(input_ids: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor, sampled: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Put the generator's samples ``[B, P]`` at the chosen positions (a scatter: no sync); replaced = the
    sample differs from the original."""
    at_positions = input_ids.gather(1, positions)
    corrupted = input_ids.scatter(1, positions, torch.where(chosen, sampled.to(input_ids.dtype), at_positions))
    return corrupted, corrupted != input_ids
