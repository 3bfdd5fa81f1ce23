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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from convbert_ds.config import ElectraConfig
from convbert_ds.model.convbert import ConvBertForMaskedLM, ConvBertForPreTraining, check_inputs

IGNORE_INDEX = -100


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: ElectraConfig,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic masking. Returns ``(masked_ids, mlm_labels)``; labels are ``-100`` where not masked.

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
    return masked_ids, labels


def _fixed_count(can_mask: torch.Tensor, attention_mask: torch.Tensor | None, config: ElectraConfig,
                 generator: torch.Generator | None) -> torch.Tensor:
    """The official count per sequence, k = max(1, min(cap, round(mask_prob x real tokens))), at k distinct
    positions drawn uniformly among the maskable ones (fewer only when fewer are maskable).

    The official code draws its k positions with replacement, so a duplicate masks one position less
    (about 17.7 instead of 19 at 128 tokens); we draw k distinct positions: the count is the formula's.
    """
    batch, seq_len = can_mask.shape
    real = attention_mask.sum(-1) if attention_mask is not None else torch.full((batch,), seq_len)
    cap = min(config.max_predictions(seq_len), seq_len)
    count = torch.round(real.to(torch.float64) * config.mask_prob).long().clamp(1, cap)  # round half to even
    count = torch.minimum(count.to(can_mask.device), can_mask.sum(-1))
    # Uniform scores, non-candidates last: the ``cap`` lowest are a uniform draw without replacement.
    scores = torch.rand(can_mask.shape, device=can_mask.device, generator=generator).masked_fill(~can_mask, 2.0)
    chosen = scores.topk(cap, dim=-1, largest=False).indices
    keep = torch.arange(cap, device=can_mask.device) < count[:, None]
    return torch.zeros_like(can_mask).scatter_(1, chosen, keep)


def gumbel_sample(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), via the Gumbel-max trick; no gradient."""
    with torch.no_grad():
        uniform = torch.rand_like(logits, dtype=torch.float32)
        gumbel = -torch.log((-torch.log(uniform.clamp_min(1e-9))).clamp_min(1e-9))
        return (logits.float() / temperature + gumbel).argmax(dim=-1)


@dataclass
class PretrainingOutput:
    """Losses are differentiable tensors; the rest are detached scalars for logging.

    ``replaced_fraction`` is the share of real tokens the generator replaced, so
    ``1 - replaced_fraction`` is the accuracy of a discriminator that always answers "original";
    ``rtd_auc`` (0.5 = no skill) shows learning even while accuracy sits at that baseline.
    """

    loss: torch.Tensor
    mlm_loss: torch.Tensor
    rtd_loss: torch.Tensor | None
    mlm_accuracy: torch.Tensor
    rtd_accuracy: torch.Tensor | None
    rtd_auc: torch.Tensor | None
    replaced_fraction: torch.Tensor | None

    def metrics(self) -> dict[str, float]:
        return {k: float(v.detach()) for k, v in vars(self).items() if v is not None}


def mlm_loss_and_sample(generator: ConvBertForMaskedLM, hidden: torch.Tensor, labels: torch.Tensor,
                        temperature: float, sample: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """MLM loss and accuracy over masked positions only (the LM head runs on those alone, saving
    ``V x`` work at the other 85%), and optionally a Gumbel sample per masked position."""
    positions = labels != IGNORE_INDEX
    targets = labels[positions]
    logits = generator.head(hidden[positions])  # [M, V]
    count = max(int(targets.numel()), 1)
    loss = F.cross_entropy(logits.float(), targets, reduction="sum") / count
    accuracy = (logits.detach().argmax(-1) == targets).float().sum() / count
    sampled = gumbel_sample(logits.detach(), temperature) if sample else None
    return loss, accuracy, sampled


def binary_auc(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve (Mann-Whitney U; ties count as half); 0.5 when a class is empty."""
    scores, positive = scores.detach().float().flatten(), positive.flatten()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return torch.tensor(0.5, device=scores.device)
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, device=scores.device, dtype=scores.dtype)
    # Average the ranks of tied scores.
    unique, inverse = torch.unique(scores, return_inverse=True)
    if unique.numel() < scores.numel():
        sums = torch.zeros_like(unique).index_add_(0, inverse, ranks)
        counts = torch.zeros_like(unique).index_add_(0, inverse, torch.ones_like(ranks))
        ranks = (sums / counts)[inverse]
    return (ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


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
    replaced_fraction = is_replaced[real].float().mean()
    auc = binary_auc(rtd_logits[real], is_replaced[real])
    return PretrainingOutput(mlm + rtd_weight * rtd, mlm.detach(), rtd.detach(), mlm_accuracy, rtd_acc, auc,
                             replaced_fraction)


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
                token_type_ids: torch.Tensor | None = None) -> PretrainingOutput:
        config = self.config
        check_inputs(config.discriminator, input_ids, attention_mask, token_type_ids)
        masked_ids, labels = mask_tokens(input_ids, attention_mask, config)
        hidden = self.generator.convbert(masked_ids, attention_mask, token_type_ids, check=False)
        mlm, mlm_acc, sampled = mlm_loss_and_sample(self.generator, hidden, labels, config.temperature,
                                                    sample=self.discriminator is not None)
        if self.discriminator is None:
            return PretrainingOutput(mlm, mlm.detach(), None, mlm_acc, None, None, None)
        corrupted, is_replaced = corrupt(input_ids, labels, sampled)
        rtd_logits = self.discriminator(corrupted, attention_mask, token_type_ids)
        return electra_output(mlm, mlm_acc, rtd_logits, is_replaced, attention_mask, config.rtd_weight)


def corrupt(input_ids: torch.Tensor, labels: torch.Tensor, sampled: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Put the generator's samples at the masked positions; replaced = the sample differs from the original."""
    corrupted = input_ids.clone()
    corrupted[labels != IGNORE_INDEX] = sampled.to(input_ids.dtype)
    return corrupted, corrupted != input_ids
