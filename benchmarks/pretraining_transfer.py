"""Does our pretraining transfer? Pretrain -> convert -> fine-tune, pretrained against random init, over seeds.

    python benchmarks/pretraining_transfer.py --work-dir runs/transfer   # defaults: 2 CPU cores, about 40 min
    python benchmarks/pretraining_transfer.py --work-dir runs/transfer --objective mlm --label mlm
    python benchmarks/pretraining_transfer.py --shards SHARD_DIR --task-dir TASK_DIR ...   # your own data

Data (built once in WORK/data, nothing downloaded): the pretraining corpus and the downstream task of
``convbert_ds.data.transfer_task`` (docstring prose of the installed packages; a 7-way task on the first
paragraphs of docstrings of 7 pinned libraries, whose text is held out of the corpus), a sentencepiece
tokenizer and shards. Pretraining: ``deepspeed --num_gpus RANKS --module convbert_ds.train`` (CPU ranks
without a GPU), saving ``--curve`` evenly spaced checkpoints. Fine-tuning: ``python -m convbert_ds.finetune``
on every checkpoint (protocol "short") and on the last one (every protocol), and with ``--random-init``
once per protocol, the same seeds and settings. Prints a table, writes WORK/LABEL/transfer.json.

Protocols (fine-tuning recipe otherwise the paper's, at ``--finetune-lr``; max length 64 covers the task's texts):
    short      4 epochs on the 3,500 training examples
    converged  15 epochs
    low        50 examples per class, 20 epochs
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.config import PRESET_NAMES
from convbert_ds.engine.distributed import free_port
from convbert_ds.quickstart import prepare_data

REPO = Path(__file__).resolve().parent.parent
PROTOCOLS = {
    "short": ["--epochs", "4"],
    "converged": ["--epochs", "15"],
    "low": ["--examples-per-class", "50", "--epochs", "20"],
}


def _run(command: list[str], log: Path | None = None) -> None:
    print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log, "a") if log else open(os.devnull, "w") as sink:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=sink if log else None, stderr=subprocess.STDOUT)
    if result.returncode:
        raise SystemExit(f"command failed ({result.returncode}){f'; see {log}' if log else ''}: {' '.join(command)}")


def pretrain(args, shards: Path, run: Path) -> list[Path]:
    """Train (or resume) to ``args.steps``; returns the curve's checkpoint directories, oldest first."""
    from convbert_ds.formats.checkpoint.directory import complete_tags

    cuda = torch.cuda.is_available()
    interval = max(1, args.steps // args.curve)
    ranks = args.ranks or (torch.cuda.device_count() if cuda else 2)
    overrides = [
        f"data.sets=[{{path: '{shards}', weight: 1.0}}]", f"checkpoint.dir={run / 'checkpoints'}",
        f"log.dir={run / 'logs'}", f"model.preset={args.preset}", f"model.objective={args.objective}",
        f"model.rtd_weight={args.rtd_weight}", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}",
        f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch // ranks}",
        f"train.lr={args.lr}", f"train.warmup_steps={int(args.warmup_fraction * args.steps)}",
        f"checkpoint.interval={interval}", f"checkpoint.keep_last={args.curve + 1}",
        f"eval.interval={interval}", "eval.samples=256", "log.interval=50",
        "deepspeed.config=ds_configs/zero2_bf16.json", f"train.precision={'bf16' if cuda else 'fp32'}"]
    if args.generator_multiplier:
        overrides.append(f"model.generator_multiplier={args.generator_multiplier}")
    overrides += args.train_override
    port = free_port()  # several benchmarks may share a machine: never the launcher's default port
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port,
                "--module", "convbert_ds.train", "--config", str(REPO / "configs" / "tiny_cpu.yaml")]
    start = time.perf_counter()
    run.mkdir(parents=True, exist_ok=True)
    _run(launcher + overrides, run / "pretrain.log")
    print(f"pretraining: {time.perf_counter() - start:.0f} s (log: {run / 'pretrain.log'})", flush=True)
    steps = [int(tag[4:]) for tag in complete_tags(run / "checkpoints")]
    return [run / "checkpoints" / f"step{s:08d}" for s in steps if s % interval == 0 or s == args.steps]


def finetune(model: Path, task: Path, out: Path, protocol: str, seeds: int, random_init: bool,
             extra: list[str]) -> dict:
    from convbert_ds.finetune.__main__ import main as finetune_main

    if not (out / "results.json").exists():
        args = ["--model", str(model), "--train", str(task / "train.jsonl"), "--validation",
                str(task / "validation.jsonl"), "--text-column", "text", "--label-column", "label", "--out", str(out),
                "--max-seq-length", "64", "--seeds", str(seeds), *PROTOCOLS[protocol], *extra]
        if random_init:
            args.append("--random-init")
        if finetune_main(args) != 0:
            raise SystemExit(f"fine-tuning failed: {out}")
    results = json.loads((out / "results.json").read_text())
    scores = [s["final"]["validation"]["accuracy"] for s in results["seeds"]]
    return {"median": statistics.median(scores), "scores": scores}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("runs/transfer"))
    parser.add_argument("--label", default=None, help="name of this configuration (default: from the options)")
    parser.add_argument("--shards", type=Path, help="your own shard dir instead of the built-in corpus")
    parser.add_argument("--task-dir", type=Path, help="your own task (train.jsonl, validation.jsonl: text, label)")
    parser.add_argument("--vocab-size", type=bounded(int, min=1), default=8000)
    parser.add_argument("--objective", choices=("electra", "mlm"), default="electra")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    parser.add_argument("--generator-multiplier", type=bounded(float, above=0), default=None)
    parser.add_argument("--rtd-weight", type=bounded(float, min=0), default=50.0)
    parser.add_argument("--steps", type=bounded(int, min=1), default=3000)
    parser.add_argument("--batch", type=bounded(int, min=1), default=32)
    parser.add_argument("--seq-len", type=bounded(int, min=8), default=128)
    parser.add_argument("--lr", type=bounded(float, above=0), default=5e-4)
    parser.add_argument("--warmup-fraction", type=bounded(float, min=0, below=1), default=0.1)
    parser.add_argument("--curve", type=bounded(int, min=1), default=3, help="checkpoints along the run to fine-tune")
    parser.add_argument("--seeds", type=bounded(int, min=1), default=3)
    parser.add_argument("--protocols", default="short,converged,low")
    parser.add_argument("--ranks", type=bounded(int, min=1), default=None, help="pretraining processes (default: GPUs, or 2 CPU ranks)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None, help="torch threads for fine-tuning")
    # The paper's 3e-4 leaves the tiny preset near chance after 4 epochs (benchmarks/RESULTS.md).
    parser.add_argument("--finetune-lr", type=bounded(float, above=0), default=1e-3, help="fine-tuning learning rate, both inits")
    parser.add_argument("--finetune-arg", action="append", default=[], help="extra finetune option (repeatable)")
    parser.add_argument("--train-override", action="append", default=[], help="extra trainer key=value (repeatable)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    label = args.label or (f"{args.objective}-{args.preset}-{args.steps}steps"
                           + (f"-gen{args.generator_multiplier:g}" if args.generator_multiplier else ""))
    work = args.work_dir.resolve()
    shards, task = prepare_data(work / "data", args.vocab_size)  # the quickstart's data, built once
    shards, task = args.shards or shards, args.task_dir or task
    run = work / label
    checkpoints = pretrain(args, shards, run)
    protocols = args.protocols.split(",")
    extra = ["--learning-rate", str(args.finetune_lr)] + [a for arg in args.finetune_arg for a in arg.split()]
    started = time.perf_counter()
    baseline = {p: finetune(checkpoints[-1], task, work / "random_init" / args.preset / p, p, args.seeds, True, extra)
                for p in protocols}
    rows = []
    for ckpt in checkpoints:
        step = int(ckpt.name[4:])
        for protocol in protocols if ckpt == checkpoints[-1] else protocols[:1]:
            got = finetune(ckpt, task, run / "finetune" / f"{ckpt.name}-{protocol}", protocol, args.seeds, False, extra)
            rows.append({"step": step, "protocol": protocol, **got, "random_init": baseline[protocol]})
    print(f"fine-tuning: {time.perf_counter() - started:.0f} s", flush=True)
    summary = {"label": label, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    (run / "transfer.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{label}: dev accuracy, median over {args.seeds} seeds [min, max]")
    print(f"{'step':>7} {'protocol':<10} {'pretrained':>22} {'random init':>22} {'gain':>7}")
    for r in rows:
        fmt = lambda d: f"{d['median']:.3f} [{min(d['scores']):.3f}, {max(d['scores']):.3f}]"  # noqa: E731
        print(f"{r['step']:>7} {r['protocol']:<10} {fmt(r):>22} {fmt(r['random_init']):>22} "
              f"{r['median'] - r['random_init']['median']:>+7.3f}")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
