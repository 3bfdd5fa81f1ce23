"""One encoder layer whose input projections (query, key, value, the conv heads' values) are one matmul over
their weights stacked, as the model runs them, against the same layer calling the four ``nn.Linear``s one by
one, as transformers does and the model did before: forward + backward, same weights, same inputs.

    python benchmarks/input_projections.py             # base; CUDA: 128 x 128, bf16 autocast; CPU: 8 x 128, fp32
    python benchmarks/input_projections.py --compile   # each layer through torch.compile (the paper configs' path)
    python benchmarks/input_projections.py --preset small --batch 8 --threads 2

Samples packed from three documents each (the trainer's default input). Each row prints its median time over
``--reps`` runs after warm-up (the two layers take turns) and the ATen ops that one forward + backward
dispatches (about one kernel each; counted eager, whatever ``--compile`` says). The ratio is the stacked
layer's over the separate one's. The outputs are checked against each other first.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/input_projections.py`

from benchmarks.document_conv import three_documents_per_sample  # noqa: E402
from benchmarks.timing import medians_ms  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES, preset  # noqa: E402
from convbert_ds.model.layers import ConvBertLayer, padding_masks  # noqa: E402
from convbert_ds.model.op_count import OpCounter  # noqa: E402

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
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base", help="the discriminator's layer")
    parser.add_argument("--batch", type=bounded(int, min=1), default=None, help="default: 128 on CUDA, 8 on CPU")
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--reps", type=bounded(int, min=1), default=20)
    parser.add_argument("--compile", action="store_true", help="each layer through torch.compile (inductor)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch = args.batch or (128 if cuda else 8)
    config = preset(args.preset, vocab_size=1000, max_position_embeddings=max(512, args.seq))  # sdconv_impl auto
    torch.manual_seed(0)
    layer = ConvBertLayer(config).to(device)
    layers = {STACKED: layer, SEPARATE: with_separate_projections(layer)}
    x = torch.randn(batch, args.seq, config.hidden_size, device=device, requires_grad=True)
    grad_out = torch.randn_like(x)
    masks = padding_masks(None, three_documents_per_sample(batch, args.seq, device), config.conv_kernel_size)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    torch.manual_seed(1)  # dropout: the same draws for both layers in the check below
    with autocast:
        stacked = layers[STACKED](x, masks).float()
        torch.manual_seed(1)
        difference = (layers[SEPARATE](x, masks).float() - stacked).abs().max() / stacked.abs().max()

    def fwd_bwd(module):
        def once():
            with autocast:
                out = module(x, masks)
            torch.autograd.grad(out, [x, *module.parameters()], grad_out.to(out.dtype))
        return once

    ops = {}
    for name, module in layers.items():
        with OpCounter() as counter:
            fwd_bwd(module)()
        ops[name] = counter.total
    runs = {name: torch.compile(module) if args.compile else module for name, module in layers.items()}
    times = medians_ms({name: fwd_bwd(module) for name, module in runs.items()}, args.reps, cuda)
    print(f"device={torch.cuda.get_device_name() if cuda else 'cpu'} preset={args.preset} layer (hidden "
          f"{config.hidden_size}, heads {config.num_heads} x {config.head_dim}) batch={batch} seq={args.seq} "
          f"precision={'bf16 autocast' if cuda else 'fp32'} compile={'on' if args.compile else 'off'} "
          f"threads={torch.get_num_threads()} reps={args.reps}")
    print(f"largest difference of the outputs over the largest output: {difference:.1e}")
    print(f"{'layer':<40}{'fwd+bwd (ms)':>14}{'eager ops':>11}")
    for name in layers:
        print(f"{name:<40}{times[name]:>14.3f}{ops[name]:>11,}")
    print(f"stacked / separate: {times[STACKED] / times[SEPARATE]:.3f} (time), "
          f"{ops[STACKED] / ops[SEPARATE]:.3f} (ops)")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
