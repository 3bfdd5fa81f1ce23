"""Model FLOPs of one ELECTRA training sample, for TFLOP/s and MFU.

Counted as 2 FLOPs per multiply-add of every matmul-like operation, forward
only, then x3 for training (the backward pass costs twice the forward). Per
token and per layer of a body with hidden H, attention width A (per branch),
n heads, kernel K, FFN width I, G groups, sequence length T:

    q, k, v projections           3 * 2*H*A
    span-aware key (sdconv)       2*H*K (depthwise) + 2*H*A (pointwise)
    conv kernel + conv values     2*A*n*K + 2*H*A
    dynamic convolution           2*K*A
    attention scores + context    2 * 2*T*A
    attention output dense        2*(2A)*H          (2*A*H without conv heads)
    feed-forward (grouped)        2 * 2*H*I/G
plus the embedding projection (2*E*H), the generator's MLM head on the
positions its loss predicts only (``predictions_per_sequence``: 19 of 128
tokens, 77 of 512; 2*H*E + 2*E*V each) and the discriminator's RTD head
(2*H*H + 2*H). The generator and the discriminator are both counted.
Elementwise work (softmax, LayerNorm, GELU) is not counted, as usual for MFU.

tests/engine/test_flops.py checks this count against torch's FlopCounterMode
over a real forward and backward. That counter drops a grouped convolution's
groups in its weight gradient: it counts the depthwise conv's weight gradient
768 times over in ConvBERT-base, about 18 GFLOP a sample that nobody computes
(``python benchmarks/analysis/flop_count.py``).
"""

from __future__ import annotations

from convbert_ds.config import ElectraConfig, ModelConfig
from convbert_ds.model.electra import predictions_per_sequence

# Dense bf16 peak per device (tensor cores), TFLOP/s.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def body_forward_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    hidden, width, heads, kernel = c.hidden_size, c.attention_width, c.num_heads, c.conv_kernel_size
    per_layer = 3 * 2 * hidden * width + 2 * 2 * seq_len * width
    if c.conv_type in ("sdconv", "conventional"):  # the separable conv (sdconv's span-aware key)
        per_layer += 2 * hidden * kernel + 2 * hidden * width
    if c.conv_type in ("sdconv", "dynamic"):
        per_layer += 2 * width * heads * kernel + 2 * hidden * width + 2 * kernel * width
    per_layer += 2 * width * (2 if c.has_conv else 1) * hidden
    per_layer += 2 * 2 * hidden * c.intermediate_size / c.num_groups
    projection = 2 * c.embedding_size * hidden if c.embedding_size != hidden else 0
    return c.num_hidden_layers * per_layer + projection


def mlm_head_forward_flops(c: ModelConfig) -> float:
    """The MLM head's forward on one position: its dense layer to the embedding width, then the logits."""
    return 2 * c.hidden_size * c.embedding_size + 2 * c.embedding_size * c.vocab_size


def training_flops_per_sample(config: ElectraConfig, seq_len: int) -> float:
    gen = config.generator if config.objective == "electra" else config.discriminator
    forward = seq_len * body_forward_flops_per_token(gen, seq_len)
    forward += predictions_per_sequence(config, seq_len) * mlm_head_forward_flops(gen)
    if config.objective == "electra":
        disc = config.discriminator
        forward += seq_len * (body_forward_flops_per_token(disc, seq_len)
                              + 2 * disc.hidden_size * disc.hidden_size + 2 * disc.hidden_size)
    return 3 * forward


def device_peak_tflops(device_name: str, override: float | None) -> float | None:
    return override or next((value for key, value in PEAK_TFLOPS.items() if key in device_name), None)
