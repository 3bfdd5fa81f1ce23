"""The model FLOPs behind MFU (``convbert_ds.engine.flops``), against torch's own counter over a real step.

    python benchmarks/analysis/flop_count.py                  # small and base, seq 128 and 512
    python benchmarks/analysis/flop_count.py --preset base --seq 128

For each preset and sequence length, one forward and backward of ``ElectraForPretraining`` (batch 1, CPU,
fp32, torch's SDConv) runs under ``torch.utils.flop_counter.FlopCounterMode``, and the table prints, in
GFLOP a sample:

- ``formula``: the trainer's count, ``training_flops_per_sample``, what MFU divides by;
- ``counted``: the counter's sum over the matmuls and convolutions that ran, with a grouped convolution's
  backward counted as twice its forward, plus the dynamic convolution's taps (2*K*A a token and layer: an
  elementwise multiply-add in torch's SDConv, which the counter does not see). It matches ``formula`` but
  for the generator's head on the slots the loss leaves unused (``prediction_slots`` less
  ``predictions_per_sequence``: none at 128 tokens, 2 of 79 at 512), which ``formula`` does not count;
- ``torch's own``: the counter as torch ships it. Its formula for a convolution's weight gradient ignores
  ``groups``, so each depthwise conv's weight gradient counts its channels (768 in base) times over;
- samples/s at 40% MFU on a 989 TFLOP/s GPU (H100, H200) by ``formula`` and by ``torch's own``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `python benchmarks/analysis/flop_count.py` finds common

from benchmarks.common import SPECIAL_IDS, VOCAB, electra_config_for  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded  # noqa: E402
from convbert_ds.config import PRESET_NAMES, ElectraConfig, ModelConfig  # noqa: E402
from convbert_ds.engine.flops import PEAK_TFLOPS, training_flops_per_sample  # noqa: E402
from convbert_ds.model import ElectraForPretraining  # noqa: E402

TARGET_MFU = 0.40


def grouped_conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                                transposed, _output_padding, _groups, output_mask, out_shape, **_) -> int:
    """A convolution's backward: its input gradient and its weight gradient each cost the forward's
    multiply-adds. The forward's count is right for groups: the weight's shape holds C_in / groups."""
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


@dataclass
class StepCount:
    counted: float  # per sample: the counter with grouped backwards right, plus the dynamic conv's taps
    torch_own: float  # per sample: the counter as torch ships it


def dynamic_conv_taps(body: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs a sequence of the dynamic convolution's K taps over A channels a token and layer."""
    return 2.0 * body.conv_kernel_size * body.attention_width * seq_len * body.num_hidden_layers \
        if body.conv_type in ("sdconv", "dynamic") else 0.0


def count_training_flops(config: ElectraConfig, seq_len: int, batch: int = 1, seed: int = 0) -> StepCount:
    """FLOPs a sample of one forward and backward of the pretraining model on a random full batch (CPU)."""
    torch.manual_seed(seed)
    model = ElectraForPretraining(config)
    input_ids = torch.randint(5, config.discriminator.vocab_size, (batch, seq_len))
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "token_type_ids": torch.zeros_like(input_ids)}

    def run(counter: FlopCounterMode) -> FlopCounterMode:
        with counter:
            model(**inputs, check=False).loss.backward()
        model.zero_grad(set_to_none=True)
        return counter

    fixed = run(FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten.convolution_backward: grouped_conv_backward_flops}))
    own = run(FlopCounterMode(display=False))
    bodies = [config.discriminator] + ([config.generator] if config.objective == "electra" else [])
    taps = 3 * sum(dynamic_conv_taps(body, seq_len) for body in bodies)  # forward + a backward of twice it
    return StepCount(fixed.get_total_flops() / batch + taps, own.get_total_flops() / batch + taps)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, nargs="+", default=["small", "base"])
    parser.add_argument("--seq", type=bounded(int, min=8), nargs="+", default=[128, 512])
    args = parser.parse_args(argv)
    peak = PEAK_TFLOPS["H200"]  # and the H100's
    at_target = peak * 1e12 * TARGET_MFU
    print(f"torch {torch.__version__}; GFLOP a sample, one forward + backward, batch 1, fp32 on CPU; samples/s "
          f"at {TARGET_MFU:.0%} MFU of {peak:.0f} TFLOP/s")
    print(f"{'preset':>8} {'seq':>4} {'formula':>9} {'counted':>9} {'ratio':>8} {'torch own':>10}"
          f" {'s/s by formula':>15} {'s/s by torch own':>17}")
    for name in args.preset:
        for seq in args.seq:
            config = electra_config_for(name, VOCAB, SPECIAL_IDS, max_position_embeddings=max(512, seq),
                                        sdconv_impl="torch")
            formula, step = training_flops_per_sample(config, seq), count_training_flops(config, seq)
            print(f"{name:>8} {seq:>4} {formula / 1e9:9.3f} {step.counted / 1e9:9.3f} {step.counted / formula:8.5f}"
                  f" {step.torch_own / 1e9:10.3f} {at_target / formula:15,.0f} {at_target / step.torch_own:17,.0f}")


if __name__ == "__main__":
    main()
