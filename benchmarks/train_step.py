"""Training-step cost of our DeepSpeed engine vs a plain PyTorch loop, same model, same batches.

One process, one rank. Both models start from the same weights and see the
same batches from the real data path (standard-library docstrings, tokenizer,
shards, packing); steps alternate A B A B so machine noise hits both alike.
Prints median step times and the engine's overhead. With --precision bf16 each side
runs its usual recipe: DeepSpeed's (bf16 weights, fp32 master copy in the optimizer) against
the plain loop's torch.autocast over fp32 weights.

    python benchmarks/train_step.py [--preset small] [--batch 16] [--seq 128] [--steps 20] [--threads 1]
    python benchmarks/train_step.py --preset base --batch 64 --seq 128 --precision bf16   # on a GPU

``--compile`` puts both models' encoder layers through torch.compile, as ``train.compile: true`` does.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_shards(work: Path, vocab_size: int) -> Path:
    from convbert_ds.data.builtin_corpus import write_corpus
    from preprocessing.shard import shard_corpus
    from preprocessing.tokenizer import train_tokenizer

    corpus = write_corpus(work / "corpus.txt")
    tokenizer = train_tokenizer([str(corpus)], str(work / "tokenizer"), vocab_size=vocab_size)
    shard_corpus([str(corpus)], str(tokenizer), str(work / "shards"), workers=1)
    return work / "shards"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--compile", action="store_true", help="both sides' encoder layers through torch.compile")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 gives stable figures on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with socket.socket() as free:  # a port nobody listens on, so two runs on one machine never collide
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

    import deepspeed

    from convbert_ds.config import ElectraConfig
    from convbert_ds.data.loader import build_dataloader
    from convbert_ds.engine.distributed import init_process_group
    from convbert_ds.engine.flops import device_peak_tflops, training_flops_per_sample
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.layers import compile_layers
    from convbert_ds.model.optim import param_groups

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    init_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        shards = build_shards(Path(tmp), args.vocab_size)
        config = ElectraConfig.from_preset(args.preset, vocab_size=args.vocab_size, max_position_embeddings=512)
        torch.manual_seed(0)
        plain = ElectraForPretraining(config).to(device)
        torch.manual_seed(0)
        wrapped = ElectraForPretraining(config)
        if args.compile:
            compile_layers(plain), compile_layers(wrapped)
        lr, betas, eps, wd = 2e-4, (0.9, 0.999), 1e-6, 0.01
        ds_config = {
            "train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch,
            "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                      "weight_decay": wd, "torch_adam": True}},
            "zero_optimization": {"stage": args.zero_stage}, "bf16": {"enabled": args.precision == "bf16"}}
        engine, _, _, _ = deepspeed.initialize(model=wrapped, model_parameters=param_groups(wrapped, wd),
                                               config=ds_config)
        optimizer = torch.optim.AdamW(param_groups(plain, wd), lr=lr, betas=betas, eps=eps)
        loader = iter(build_dataloader([{"path": shards}], "train", seq_len=args.seq, micro_batch_size=args.batch,
                                       progress=False))
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

        def plain_step(batch):
            with autocast:
                loss = plain(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            optimizer.step()

        def engine_step(batch):
            out = engine(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
            engine.backward(out.loss)
            engine.step()

        times = {"plain PyTorch": [], "DeepSpeed engine": []}
        steps = {"plain PyTorch": plain_step, "DeepSpeed engine": engine_step}
        for i in range(args.steps + 2):
            batch = {k: v.to(device) for k, v in next(loader).items()}
            for name, step in steps.items():
                torch.manual_seed(i)
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step(batch)
                if cuda:
                    torch.cuda.synchronize()
                if i >= 2:  # warm-up
                    times[name].append(time.perf_counter() - start)

    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    flops = training_flops_per_sample(config, args.seq) * args.batch
    peak = device_peak_tflops(device_name, None)
    print(f"device={device_name} preset={args.preset} batch={args.batch} seq={args.seq} "
          f"precision={args.precision} zero={args.zero_stage} steps={args.steps} threads={torch.get_num_threads()} "
          f"compile={args.compile}")
    print(f"{'loop':<18}{'median step (s)':>16}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        tflops = flops / median / 1e12
        mfu = f"{tflops / peak:.1%}" if peak else "n/a"
        print(f"{name:<18}{median:>16.4f}{args.batch / median:>11.1f}{tflops:>9.3f}{mfu:>7}")
    overhead = statistics.median(times["DeepSpeed engine"]) / statistics.median(times["plain PyTorch"]) - 1
    print(f"DeepSpeed engine overhead vs plain PyTorch (medians): {overhead:+.1%}")


if __name__ == "__main__":
    main()
