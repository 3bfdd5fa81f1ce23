"""CPU forward+backward: our ConvBERT vs transformers' ConvBertModel, same weights, same batch.

Runs both side by side in this process, interleaved (A B A B ...) so machine
noise hits both alike, and prints medians, the speed ratio, and activation
memory (bytes of the distinct tensors autograd keeps for backward; this is
what grows with batch and sequence length, and it is measured exactly rather
than read off a noisy process RSS).

    python benchmarks/model_cpu.py [--preset small] [--batch 16] [--seq 128] [--runs 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from convbert_ds.config import preset
from convbert_ds.model import ConvBertModel


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 gives stable figures on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = preset(args.preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, sdconv_impl="torch")
    theirs = transformers.ConvBertModel(transformers.ConvBertConfig(**config.to_hf_dict(["ConvBertModel"])))
    ours = ConvBertModel(config)
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if k in ours.state_dict()})
    theirs.train(), ours.train()
    input_ids = torch.randint(5, config.vocab_size, (args.batch, args.seq))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[: args.batch // 2, -args.seq // 4:] = 0  # half the batch padded, as in real batches

    def step_ours():
        ours(input_ids, attention_mask).float().pow(2).mean().backward()

    def step_theirs():
        theirs(input_ids, attention_mask=attention_mask).last_hidden_state.pow(2).mean().backward()

    with torch.no_grad():
        diff = (ours.eval()(input_ids, attention_mask)
                - theirs.eval()(input_ids, attention_mask=attention_mask).last_hidden_state).abs().max()
    ours.train(), theirs.train()

    times = {"ours": [], "transformers": []}
    steps = {"ours": step_ours, "transformers": step_theirs}
    for name, step in steps.items():  # warm-up
        step()
    for _ in range(args.runs):
        for name, step in steps.items():
            ours.zero_grad(set_to_none=True), theirs.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    memory = {name: saved_tensor_bytes(step) for name, step in steps.items()}

    print(f"preset={args.preset} batch={args.batch} seq={args.seq} runs={args.runs} "
          f"threads={torch.get_num_threads()} torch={torch.__version__} transformers={transformers.__version__}")
    print(f"max |ours - transformers| (eval forward) = {diff:.2e}")
    print(f"{'model':<14}{'median fwd+bwd (s)':>20}{'min (s)':>10}{'activation MB':>16}")
    for name in steps:
        print(f"{name:<14}{statistics.median(times[name]):>20.3f}{min(times[name]):>10.3f}"
              f"{memory[name] / 2**20:>16.1f}")
    speedup = statistics.median(times["transformers"]) / statistics.median(times["ours"])
    print(f"speed-up (transformers / ours, medians): {speedup:.2f}x; "
          f"activation memory ratio (ours / transformers): {memory['ours'] / memory['transformers']:.2f}")


if __name__ == "__main__":
    main()
