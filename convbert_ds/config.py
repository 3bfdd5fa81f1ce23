"""Typed model configuration, the paper's presets, and ELECTRA pretraining settings.

Field names follow transformers' ``ConvBertConfig`` so a config.json from the
hub maps one to one. Everything is validated when the object is built, and an
error names the field, the bad value and a fix.

Heads: ``num_attention_heads`` is the head count *before* the bottleneck, as in
transformers. The model has ``n = num_attention_heads // head_ratio``
self-attention heads and as many conv heads, each of size
``d = hidden_size // n // 2`` (``hidden_size // num_attention_heads`` for
``conv_type="none"``), i.e. the paper's Table 5 "Attention heads" is ``n``.

``attention_head_size`` overrides ``d``: the official code's layout for generators too narrow for the
bottleneck (ConvBERT-small's: 1 self-attention head of 64 + 1 conv head of 64 at hidden 64), which
transformers cannot express (``generator_config(..., heads="official")``; such a body is not exported).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from convbert_ds.errors import UserError

CONV_TYPES = ("sdconv", "dynamic", "conventional", "none")
SDCONV_IMPLS = ("auto", "triton", "torch")
RESIDUAL_DTYPES = ("fp32", "autocast")
HIDDEN_ACTS = ("gelu", "gelu_new", "relu", "silu", "tanh")
OBJECTIVES = ("electra", "mlm")
MASKING_MODES = ("fixed", "bernoulli")
GENERATOR_HEADS = ("transformers", "official")
MAX_KERNEL_SIZE = 31
# config.json's model_type for bodies transformers' ConvBERT cannot express (ModelConfig.to_native_dict).
NATIVE_MODEL_TYPE = "convbert_ds"


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the field and a fix."""


def _fail(owner: str, name: str, value, problem: str, fix: str) -> None:
    raise ConfigError(f"{owner}.{name}={value!r}: {problem}; {fix}")


@dataclass
class ModelConfig:
    """One ConvBERT body (discriminator or generator)."""

    vocab_size: int = 30522
    hidden_size: int = 256
    num_hidden_layers: int = 12
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    embedding_size: int = 128
    head_ratio: int = 2
    conv_kernel_size: int = 9
    num_groups: int = 1
    # Ablations of the paper's Table 2: span-based dynamic conv (ConvBERT),
    # dynamic conv with the kernel from the query alone, a conventional
    # depthwise-separable conv, or no conv heads at all (BERT/ELECTRA).
    conv_type: str = "sdconv"
    # torch, triton or auto (Triton on CUDA once probed): the dynamic conv's kernels and the packed
    # documents' depthwise conv's (model/sdconv.py, model/depthwise.py).
    sdconv_impl: str = "auto"
    # transformers lets padded values leak into the conv window of real tokens;
    # parity needs that, so masking them is opt-in.
    sdconv_mask_padding: bool = False
    # Under torch.autocast only: the dtype of the LayerNorms' outputs, which are the residual stream between
    # layers. "fp32" is what autocast writes (on CUDA its LayerNorm runs and returns fp32; transformers' too);
    # "autocast" casts them to autocast's dtype (bf16/fp16), as Megatron keeps its bf16 residual stream, so
    # that the memory-bound kernels around every LayerNorm move half the bytes, forward and backward. The
    # norms' statistics are still computed in fp32. Without autocast (fp32, DeepSpeed's bf16 weights) no effect.
    residual_dtype: str = "fp32"
    # None: derived from hidden_size and the heads, as transformers does (module docstring).
    attention_head_size: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_heads(self) -> int:
        """Self-attention heads after the bottleneck (= conv heads when there is a conv branch)."""
        return self.num_attention_heads // self.head_ratio

    @property
    def head_dim(self) -> int:
        return self.derived_head_dim if self.attention_head_size is None else self.attention_head_size

    @property
    def derived_head_dim(self) -> int:
        """The head size transformers' ConvBERT computes from hidden_size and the heads."""
        return self.hidden_size // (self.num_attention_heads if self.conv_type == "none" else self.num_heads * 2)

    @property
    def attention_width(self) -> int:
        """Width A of the self-attention branch (and of the conv branch)."""
        return self.num_heads * self.head_dim

    @property
    def has_conv(self) -> bool:
        return self.conv_type != "none"

    def validate(self) -> None:
        own = type(self).__name__
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size", "embedding_size", "head_ratio",
                     "conv_kernel_size", "num_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(own, name, value, "must be a positive integer", "set a value >= 1")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                _fail(own, name, value, "must be a probability in [0, 1)", "use e.g. 0.1")
        if self.hidden_act not in HIDDEN_ACTS:
            _fail(own, "hidden_act", self.hidden_act, "unknown activation", f"use one of {HIDDEN_ACTS}")
        if self.conv_type not in CONV_TYPES:
            _fail(own, "conv_type", self.conv_type, "unknown conv type", f"use one of {CONV_TYPES}")
        if self.sdconv_impl not in SDCONV_IMPLS:
            _fail(own, "sdconv_impl", self.sdconv_impl, "unknown implementation", f"use one of {SDCONV_IMPLS}")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            _fail(own, "residual_dtype", self.residual_dtype, "unknown residual dtype",
                  f"use one of {RESIDUAL_DTYPES} (\"autocast\": the LayerNorms' outputs in autocast's dtype)")
        if not 0 <= self.pad_token_id < self.vocab_size:
            _fail(own, "pad_token_id", self.pad_token_id, f"must be a token id in [0, vocab_size={self.vocab_size})",
                  "use the tokenizer's [PAD] id (0 for tokenizers built by preprocessing.tokenizer)")
        if self.hidden_size % self.num_attention_heads:
            _fail(own, "num_attention_heads", self.num_attention_heads,
                  f"hidden_size={self.hidden_size} is not divisible by it", "pick a divisor of hidden_size")
        if self.num_attention_heads < self.head_ratio:
            _fail(own, "num_attention_heads", self.num_attention_heads,
                  f"is smaller than head_ratio={self.head_ratio}, which would leave no attention head",
                  f"use at least {self.head_ratio} heads or lower head_ratio")
        if self.num_attention_heads % self.head_ratio:
            _fail(own, "head_ratio", self.head_ratio,
                  f"does not divide num_attention_heads={self.num_attention_heads}",
                  "pick a head_ratio that divides the head count (2 in the paper, 1 disables the bottleneck)")
        size = self.attention_head_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            _fail(own, "attention_head_size", size, "must be a positive integer or None",
                  "leave it None (derived from hidden_size, as in transformers)")
        if size is None and self.has_conv and self.hidden_size % (2 * self.num_heads):
            _fail(own, "hidden_size", self.hidden_size,
                  f"must split into 2 x {self.num_heads} heads (self-attention + conv)",
                  f"use a multiple of {2 * self.num_heads}")
        if self.conv_kernel_size % 2 == 0 or self.conv_kernel_size > MAX_KERNEL_SIZE:
            _fail(own, "conv_kernel_size", self.conv_kernel_size,
                  f"must be odd and at most {MAX_KERNEL_SIZE} (the convolution is centred on each token)",
                  "use 9 as in the paper")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % self.num_groups:
                _fail(own, "num_groups", self.num_groups, f"does not divide {name}={getattr(self, name)}",
                      "pick a group count that divides both hidden_size and intermediate_size")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # transformers' ConvBertConfig has none of these fields; only "sdconv" bodies are representable there.
    _HF_ONLY_OURS = ("conv_type", "sdconv_impl", "sdconv_mask_padding", "attention_head_size", "residual_dtype")

    def not_in_transformers(self) -> str | None:
        """Why transformers' ConvBERT cannot express this body, or None when it can."""
        if self.conv_type != "sdconv":
            return (f"ModelConfig.conv_type={self.conv_type!r}: transformers' ConvBERT only has span-based dynamic "
                    "convolution; only conv_type='sdconv' models can be exported")
        if self.head_dim != self.derived_head_dim:
            return (f"ModelConfig.attention_head_size={self.attention_head_size}: transformers' ConvBERT derives the "
                    f"head size from hidden_size={self.hidden_size} and num_attention_heads={self.num_attention_heads} "
                    f"({self.derived_head_dim}) and cannot load this layout (the official code's generator heads); "
                    "export the discriminator only, or pretrain with model.generator_heads=transformers")
        return None

    def to_hf_dict(self, architectures: list[str]) -> dict:
        if (why := self.not_in_transformers()) is not None:
            raise ConfigError(why)
        hf = {k: v for k, v in self.to_dict().items() if k not in self._HF_ONLY_OURS}
        hf.update(model_type="convbert", architectures=architectures, tie_word_embeddings=True)
        return hf

    def to_native_dict(self, architectures: list[str]) -> dict:
        """config.json for a body transformers cannot express (Table 2's conv types, no conv heads, the official
        generator heads): every field of ours, under ``model_type`` convbert_ds, so that transformers refuses
        the directory instead of building another model from it; our classes load it (the ablations'
        fine-tuning)."""
        return {**self.to_dict(), "model_type": NATIVE_MODEL_TYPE, "architectures": architectures,
                "tie_word_embeddings": True}

    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> "ModelConfig":
        if hf.get("model_type") not in ("convbert", NATIVE_MODEL_TYPE):
            raise ConfigError(f"config.json has model_type={hf.get('model_type')!r}; expected 'convbert'")
        native = hf["model_type"] == NATIVE_MODEL_TYPE
        known = {f.name for f in fields(cls)} - (set() if native else set(cls._HF_ONLY_OURS))
        values = {k: hf[k] for k in known if k in hf}
        if "pad_token_id" not in hf or hf["pad_token_id"] is None:
            values["pad_token_id"] = 1  # transformers' ConvBertConfig default
        values.update(overrides)
        return cls(**values)


def generator_config(discriminator: ModelConfig, size_multiplier: float, heads: str = "transformers"
                     ) -> ModelConfig:
    """ELECTRA generator: same depth and embeddings, hidden/FFN/heads scaled by ``size_multiplier``.

    ``heads="transformers"``: a generator with fewer heads than head_ratio (1/4 of ConvBERT-small's 4 is
    1) keeps ``head_ratio`` heads, one attention and one conv head of ``hidden / 2`` each: what
    transformers' ConvBERT builds from such a config, so the generator exports.
    ``heads="official"``: the official code's layout (yitu-opensource/ConvBert, ``attention_layer``):
    ``max(1, int(heads x multiplier))`` heads of size ``hidden / heads``; when that leaves fewer than one
    head after the bottleneck, the bottleneck is switched off (one attention and one conv head of the
    full head size, whose concatenation is wider than hidden). Where the two agree (medium-small, base)
    the result is the same config.
    """
    if heads not in GENERATOR_HEADS:
        _fail("generator_config", "heads", heads, "unknown head layout", f"use one of {GENERATOR_HEADS}")
    hidden, ratio = int(round(discriminator.hidden_size * size_multiplier)), discriminator.head_ratio
    # Heads scaled down, keeping at least one head after the bottleneck.
    scaled = discriminator.replace(
        hidden_size=hidden, intermediate_size=int(round(discriminator.intermediate_size * size_multiplier)),
        num_attention_heads=max(ratio, int(round(discriminator.num_attention_heads * size_multiplier / ratio)) * ratio))
    if heads == "transformers" or not scaled.has_conv:
        return scaled
    official_heads = max(1, int(discriminator.num_attention_heads * size_multiplier))
    head_size = hidden // official_heads
    if official_heads // discriminator.head_ratio < 1:  # no head left after the bottleneck: switch it off
        official = scaled.replace(num_attention_heads=1, head_ratio=1, attention_head_size=head_size)
    else:
        official = scaled.replace(num_attention_heads=official_heads // ratio * ratio, attention_head_size=head_size)
    # Stated explicitly only where transformers' derivation would give another size (so it still exports).
    return official.replace(attention_head_size=None) if official.derived_head_dim == head_size else official


# The ConvBERT paper, Table 5 (pre-training hyper-parameters) and Table 1 (groups).
# num_attention_heads is transformers' pre-bottleneck count: Table 5's heads x head_ratio.
_PRESETS: dict[str, tuple[dict, float]] = {
    "small": (dict(hidden_size=256, num_attention_heads=4, intermediate_size=1024, embedding_size=128,
                   num_groups=1), 1 / 4),
    "medium-small": (dict(hidden_size=384, num_attention_heads=8, intermediate_size=1536, embedding_size=128,
                          num_groups=2), 1 / 4),
    "base": (dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, embedding_size=768,
                  num_groups=1), 1 / 3),
    # Not from the paper: a few-MB model for tests, the quickstart and CPU smoke runs.
    "tiny": (dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                  embedding_size=64), 1 / 4),
}
PRESET_NAMES = tuple(_PRESETS)


def preset(name: str, **overrides) -> ModelConfig:
    """The discriminator (main model) config of a named preset: small, medium-small, base (or tiny)."""
    if name not in _PRESETS:
        raise ConfigError(f"preset {name!r} is unknown; use one of {PRESET_NAMES}")
    values, _ = _PRESETS[name]
    # from_dict: a field that does not exist is a ConfigError naming it (model.overrides), not a TypeError.
    defaults = dict(num_hidden_layers=12, conv_kernel_size=9, head_ratio=2)
    return ModelConfig.from_dict({**defaults, **values, **overrides})


def preset_generator_multiplier(name: str) -> float:
    if name not in _PRESETS:
        raise ConfigError(f"preset {name!r} is unknown; use one of {PRESET_NAMES}")
    return _PRESETS[name][1]


@dataclass
class ElectraConfig:
    """Replaced-token-detection pretraining (ELECTRA, as the ConvBERT paper used it).

    Token ids default to the layout ``preprocessing.tokenizer`` writes:
    [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4.
    """

    discriminator: ModelConfig = field(default_factory=lambda: preset("small"))
    generator: ModelConfig | None = None
    objective: str = "electra"
    mask_prob: float = 0.15
    mask_token_prob: float = 0.85  # of the masked positions; the rest keep their token
    # "fixed": the official code's per-sequence count, k = max(1, min(cap, round(mask_prob x real tokens)))
    # positions of each sequence (real tokens counted with [CLS]/[SEP]); "bernoulli": every maskable
    # token independently with probability mask_prob (BERT/transformers' collator).
    masking: str = "fixed"
    # The cap of "fixed" masking; None: the official int((mask_prob + 0.005) x seq_len), 19 at 128, 79 at 512.
    max_predictions_per_seq: int | None = None
    rtd_weight: float = 50.0
    temperature: float = 1.0
    tie_generator_body: bool = False  # the generator is the discriminator's encoder + an MLM head
    mask_token_id: int = 4
    special_token_ids: tuple[int, ...] = (0, 2, 3)  # never masked: [PAD], [CLS], [SEP]

    def __post_init__(self) -> None:
        if isinstance(self.discriminator, dict):
            self.discriminator = ModelConfig.from_dict(self.discriminator)
        if isinstance(self.generator, dict):
            self.generator = ModelConfig.from_dict(self.generator)
        self.special_token_ids = tuple(self.special_token_ids)
        self.validate()

    def validate(self) -> None:
        own = "ElectraConfig"
        if self.objective not in OBJECTIVES:
            _fail(own, "objective", self.objective, "unknown objective", f"use one of {OBJECTIVES}")
        if self.objective == "electra" and self.generator is None:
            _fail(own, "generator", None, "the electra objective needs a generator",
                  "use ElectraConfig.from_preset(...) or generator_config(discriminator, 1/4)")
        if self.masking not in MASKING_MODES:
            _fail(own, "masking", self.masking, "unknown masking mode", f"use one of {MASKING_MODES}")
        cap = self.max_predictions_per_seq
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            _fail(own, "max_predictions_per_seq", cap, "must be a positive integer or None",
                  "leave it None for the official int((mask_prob + 0.005) x seq_len)")
        for name in ("mask_prob", "mask_token_prob"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                _fail(own, name, value, "must be in (0, 1]", "use 0.15 / 0.85 as in ELECTRA")
        if self.rtd_weight < 0 or self.temperature <= 0:
            _fail(own, "rtd_weight/temperature", (self.rtd_weight, self.temperature), "must be >= 0 / > 0",
                  "use 50.0 and 1.0 as in ELECTRA")
        disc = self.discriminator
        if not 0 <= self.mask_token_id < disc.vocab_size:
            _fail(own, "mask_token_id", self.mask_token_id, f"is outside the vocabulary (size {disc.vocab_size})",
                  "use the tokenizer's [MASK] id")
        if self.tie_generator_body and self.generator != disc:
            _fail(own, "tie_generator_body", True, "needs a generator of the discriminator's size",
                  "use generator_multiplier 1.0 (model.generator_multiplier=1.0)")
        if self.generator is not None:
            for name in ("vocab_size", "embedding_size", "max_position_embeddings", "type_vocab_size",
                         "pad_token_id"):
                if getattr(self.generator, name) != getattr(disc, name):
                    _fail(own, f"generator.{name}", getattr(self.generator, name),
                          f"differs from discriminator.{name}={getattr(disc, name)} but the embeddings are shared",
                          "make them equal")

    def max_predictions(self, seq_len: int) -> int:
        """The most positions "fixed" masking takes from one sequence of ``seq_len`` tokens."""
        fixed = self.max_predictions_per_seq
        return max(1, int((self.mask_prob + 0.005) * seq_len)) if fixed is None else fixed

    @classmethod
    def from_preset(cls, name: str, generator_multiplier: float | None = None, **model_overrides) -> "ElectraConfig":
        disc = preset(name, **model_overrides)
        mult = preset_generator_multiplier(name) if generator_multiplier is None else generator_multiplier
        return cls(discriminator=disc, generator=generator_config(disc, mult))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
