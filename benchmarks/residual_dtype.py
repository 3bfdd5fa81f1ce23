"""One encoder layer under bf16 autocast with its residual stream in bf16 (``model.overrides.residual_dtype=
autocast``: the LayerNorms write autocast's dtype) against the same layer with it in fp32, as autocast leaves
it (the default, transformers' behaviour): forward + backward, same weights, same inputs, each layer fed
what the layer before it would hand it (bf16 or fp32).

    python benchmarks/residual_dtype.py --compile   # base; CUDA: 128 x 128; CPU: 8 x 128; inductor's counts too
    python benchmarks/residual_dtype.py             # eager
    python benchmarks/residual_dtype.py --preset small --batch 8 --threads 2

What each row prints, and how: ``compare`` in ``benchmarks/common.py``; on a CPU too the layers run under
bf16 autocast. The ratio is the bf16 stream's over the fp32 one's. The LayerNorms' statistics are fp32
either way: the outputs differ by bf16's rounding of what they write.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/residual_dtype.py`

from benchmarks.common import Variant, compare, parse_arguments, ratio_line  # noqa: E402
from convbert_ds.cli import exit_on_user_error  # noqa: E402
from convbert_ds.config import preset  # noqa: E402
from convbert_ds.model.layers import ConvBertLayer  # noqa: E402

FP32, BF16 = "fp32 residual stream (autocast's, default)", "bf16 residual stream (residual_dtype=autocast)"


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(__doc__, argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    configs = {dtype: preset(args.preset, vocab_size=1000, max_position_embeddings=max(512, args.seq),
                             residual_dtype=dtype) for dtype in ("fp32", "autocast")}
    layers = {}
    for dtype, config in configs.items():
        torch.manual_seed(0)  # the same weights
        layers[dtype] = ConvBertLayer(config).to(device)
    figures = compare(args, configs["fp32"], {FP32: Variant(layers["fp32"]),
                                              BF16: Variant(layers["autocast"], torch.bfloat16)}, autocast=True)
    print(ratio_line("bf16 / fp32 residual stream", figures[BF16], figures[FP32]))


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
