"""CPU forward+backward: our ConvBERT, eager and compiled, vs transformers' ConvBertModel, same weights, same batch.

Runs all side by side in this process, interleaved (A B C A B C ...) so machine
noise hits them alike, and prints medians, the speed ratios, and activation
memory (bytes of the distinct tensors autograd keeps for backward; this is
what grows with batch and sequence length, and it is measured exactly rather
than read off a noisy process RSS). "compiled" is our model with its encoder
layers through torch.compile, as ``train.compile: true`` runs it; its compile
time (first call) is printed, not counted in the medians.

    python benchmarks/model_cpu.py [--preset small] [--batch 16] [--seq 128] [--runs 7] [--threads 2] [--no-compile]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import transformers

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.config import PRESET_NAMES, preset
from convbert_ds.model import ConvBertModel
from convbert_ds.model.layers import compile_layers


def saved_tensor_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves during ``step()``."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="small")
    parser.add_argument("--batch", type=bounded(int, min=1), default=16)
    parser.add_argument("--seq", type=bounded(int, min=1), default=128)
    parser.add_argument("--runs", type=bounded(int, min=1), default=7)
    parser.add_argument("--threads", type=bounded(int, min=1), default=None,
                        help="torch threads (1 gives stable figures on a shared machine)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled model (no compiler needed)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = preset(args.preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, sdconv_impl="torch")
    theirs = transformers.ConvBertModel(transformers.ConvBertConfig(**config.to_hf_dict(["ConvBertModel"])))
    ours = ConvBertModel(config)
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if k in ours.state_dict()})
    models = {"ours": ours, "transformers": theirs}
    if not args.no_compile:
        models["ours compiled"] = ConvBertModel(config)
        models["ours compiled"].load_state_dict(ours.state_dict())
        compile_layers(models["ours compiled"])
    input_ids = torch.randint(5, config.vocab_size, (args.batch, args.seq))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[: args.batch // 2, -args.seq // 4:] = 0  # half the batch padded, as in real batches

    def hidden(name: str) -> torch.Tensor:
        if name == "transformers":
            return theirs(input_ids, attention_mask=attention_mask).last_hidden_state
        return models[name](input_ids, attention_mask)

    steps = {name: (lambda name=name: hidden(name).float().pow(2).mean().backward()) for name in models}
    for model in models.values():
        model.train()
    first_call = {}
    for name, step in steps.items():  # warm-up (and the compile)
        start = time.perf_counter()
        step()
        first_call[name] = time.perf_counter() - start
    # With grad on: under no_grad the compiled layers would compile a second graph.
    reference = hidden("transformers").detach()
    diff = {name: (hidden(name).detach() - reference).abs().max().item() for name in models if name != "transformers"}

    times = {name: [] for name in models}
    for _ in range(args.runs):
        for name, step in steps.items():
            for model in models.values():
                model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    memory = {name: saved_tensor_bytes(step) for name, step in steps.items() if name != "ours compiled"}

    print(f"preset={args.preset} batch={args.batch} seq={args.seq} runs={args.runs} "
          f"threads={torch.get_num_threads()} torch={torch.__version__} transformers={transformers.__version__}")
    print("max |ours - transformers| (forward, no dropout): "
          + ", ".join(f"{name} {value:.2e}" for name, value in diff.items()))
    print(f"{'model':<16}{'median fwd+bwd (s)':>20}{'min (s)':>10}{'activation MB':>16}{'first call (s)':>16}")
    for name in steps:
        activation = f"{memory[name] / 2**20:.1f}" if name in memory else "n/a"
        print(f"{name:<16}{statistics.median(times[name]):>20.3f}{min(times[name]):>10.3f}{activation:>16}"
              f"{first_call[name]:>16.1f}")
    for name in (name for name in models if name != "transformers"):
        speedup = statistics.median(times["transformers"]) / statistics.median(times[name])
        print(f"speed-up (transformers / {name}, medians): {speedup:.2f}x")
    print(f"activation memory ratio (ours / transformers): {memory['ours'] / memory['transformers']:.2f}")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
