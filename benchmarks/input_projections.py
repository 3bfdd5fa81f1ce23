"""One encoder layer whose input projections (query, key, value, the conv heads' values) are one matmul over
their weights stacked, as the model runs them, against the same layer calling the four ``nn.Linear``s one by
one, as transformers does and the model did before: forward + backward, same weights, same inputs.

    python benchmarks/input_projections.py             # base; CUDA: 128 x 128, bf16 autocast; CPU: 8 x 128, fp32
    python benchmarks/input_projections.py --compile   # each layer through torch.compile (the paper configs' path)
    python benchmarks/input_projections.py --preset small --batch 8 --threads 2

What each row prints, and how: ``compare`` in ``benchmarks/common.py``. The ratio is the stacked layer's
over the separate one's.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/input_projections.py`

from benchmarks.common import Variant, compare, parse_arguments, ratio_line  # noqa: E402
from convbert_ds.cli import exit_on_user_error  # noqa: E402
from convbert_ds.config import preset  # noqa: E402
from convbert_ds.model.layers import ConvBertLayer  # noqa: E402

STACKED, SEPARATE = "stacked: one matmul (the model)", "separate: one nn.Linear each (before)"


def with_separate_projections(layer: ConvBertLayer) -> ConvBertLayer:
    """A copy of ``layer`` (same weights) whose attention calls its input projections one by one."""
    separate = copy.deepcopy(layer)
    attention = separate.attention.self
    projections = [attention.query, attention.key, attention.value]
    if hasattr(attention, "conv_out_layer"):
        projections.append(attention.conv_out_layer)
    attention._input_projections = lambda hidden_states: [p(hidden_states) for p in projections]
    return separate


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(__doc__, argv)
    cuda = torch.cuda.is_available()
    config = preset(args.preset, vocab_size=1000, max_position_embeddings=max(512, args.seq))  # sdconv_impl auto
    torch.manual_seed(0)
    layer = ConvBertLayer(config).to("cuda" if cuda else "cpu")
    figures = compare(args, config, {STACKED: Variant(layer), SEPARATE: Variant(with_separate_projections(layer))},
                      autocast=cuda)
    print(ratio_line("stacked / separate", figures[STACKED], figures[SEPARATE]))


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
