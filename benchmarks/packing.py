"""Real tokens per second: documents packed into shared samples vs one document per padded sample.

Same model, batch size and sequence length for both rows, so a step costs about the same; what differs is
how many of its positions hold real tokens (the rest is padding the model computes for nothing). Each row
is an ELECTRA training step (AdamW) on batches from the real data path (``build_dataloader`` with
``pack_documents`` true / false), steps alternating A B A B so machine noise hits both alike.

    python benchmarks/packing.py                              # tiny preset, seq 128 and 512, built-in corpus
    python benchmarks/packing.py --preset small --batch 16 --seq 128 512 --shards SHARD_DIR

Prints per row and length: median step time, real tokens per step, real tokens per second, and the ratio
packed / padded (real tokens per second; above 1: packing wins).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/packing.py` finds common

from benchmarks.common import build_shards, electra_config  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.config import PRESET_NAMES


def time_rows(model, loaders: dict, steps: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """Median seconds per step and mean real tokens per step of each loader's batches, interleaved."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    streams = {name: iter(loader) for name, loader in loaders.items()}
    times = {name: [] for name in loaders}
    tokens = {name: [] for name in loaders}
    for i in range(steps + warmup):
        for name, stream in streams.items():
            batch = next(stream)
            torch.manual_seed(i)
            start = time.perf_counter()
            out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], check=False,
                        document_ids=batch.get("document_ids"))
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                tokens[name].append(int(batch["attention_mask"].sum()))
    return {name: (statistics.median(times[name]), statistics.mean(tokens[name])) for name in loaders}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="model preset (default tiny)")
    parser.add_argument("--batch", type=bounded(int, min=1), default=8, help="samples per step (default 8)")
    parser.add_argument("--seq", type=bounded(int, min=8), nargs="+", default=[128, 512], help="sequence lengths (default 128 512)")
    parser.add_argument("--steps", type=bounded(int, min=1), default=10, help="timed steps per row, after 2 of warm-up")
    parser.add_argument("--shards", type=Path, default=None, help="a shard directory (default: built-in corpus)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from convbert_ds.data.loader import build_dataloader
    from convbert_ds.data.shards import open_split
    from convbert_ds.model import ElectraForPretraining

    with tempfile.TemporaryDirectory() as tmp:
        shards = args.shards or build_shards(Path(tmp), vocab_size=8000)
        config = electra_config(args.preset, open_split(shards, "train"))
        torch.manual_seed(0)
        model = ElectraForPretraining(config)
        print(f"preset={args.preset} batch={args.batch} steps={args.steps} threads={torch.get_num_threads()} "
              f"shards={shards if args.shards else 'built-in corpus'}")
        print(f"{'seq':>5} {'samples':<28}{'step (s)':>9}{'real tok/step':>15}{'real tok/s':>12}")
        for seq_len in args.seq:
            loaders = {name: build_dataloader([{"path": shards}], "train", seq_len=seq_len,
                                              micro_batch_size=args.batch, progress=False, pack_documents=packed)
                       for name, packed in (("one document each, padded", False),
                                            ("documents packed together", True))}
            rows = time_rows(model, loaders, args.steps)
            rates = {}
            for name, (step, tokens) in rows.items():
                rates[name] = tokens / step
                print(f"{seq_len:>5} {name:<28}{step:>9.3f}{tokens:>15,.0f}{rates[name]:>12,.0f}")
            padded, packed = rates.values()
            print(f"{seq_len:>5} packed / padded, real tokens per second: {packed / padded:.2f}x")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
