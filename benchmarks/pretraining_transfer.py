"""Does our pretraining transfer? Pretrain -> convert -> fine-tune, pretrained against random init, over seeds.

    python benchmarks/pretraining_transfer.py --work-dir runs/transfer   # defaults: 2 CPU cores, about 40 min
    python benchmarks/pretraining_transfer.py --work-dir runs/transfer --objective mlm --label mlm
    python benchmarks/pretraining_transfer.py --shards SHARD_DIR --task-dir TASK_DIR ...   # your own data

Data (built once in WORK/data, nothing downloaded): the pretraining corpus and the downstream task of
``convbert_ds.builtin.docstring_summaries`` (docstring prose of the installed packages; a 7-way task on the first
paragraphs of docstrings of 7 pinned libraries, whose text is held out of the corpus), a sentencepiece
tokenizer and shards. Pretraining: ``deepspeed --num_gpus RANKS --module convbert_ds.train`` (CPU ranks
without a GPU), saving ``--curve`` evenly spaced checkpoints. Fine-tuning: ``python -m convbert_ds.finetune``
on every checkpoint (protocol "short") and on the last one (every protocol), and with ``--random-init``
once per protocol, the same seeds and settings; then the last checkpoint and random init on the out-of-domain
task (``convbert_ds.builtin.aws_api_passages``: passages of the AWS API reference botocore ships, 6 services) with
the quickstart's recipe, ``--ood-seeds`` each. Prints every gain with its bootstrap 95% interval over the seeds
(``convbert_ds.finetune.margin``), writes WORK/LABEL/transfer.json.

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
from convbert_ds.finetune.margin import Margin, seed_scores
from convbert_ds.quickstart import CLOUD_DOCS_SEEDS, FINETUNE_CLOUD_DOCS, prepare_data

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


def protocol_recipe(protocol: str, extra: list[str]) -> list[str]:
    """The fine-tuning options of a protocol: max length 64 (the task's texts fit), its epochs, then ``extra``."""
    return ["--max-seq-length", "64", *PROTOCOLS[protocol], *extra]


def finetune(model: Path, task: Path, out: Path, recipe: list[str], seeds: int, random_init: bool) -> list[float]:
    """Dev accuracy per seed of ``python -m convbert_ds.finetune`` on ``task`` (kept in OUT: reruns reuse it)."""
    from convbert_ds.finetune.__main__ import main as finetune_main

    if not (out / "results.json").exists():
        args = ["--model", str(model), "--train", str(task / "train.jsonl"), "--validation",
                str(task / "validation.jsonl"), "--text-column", "text", "--label-column", "label", "--out", str(out),
                "--seeds", str(seeds), "--eval-every-epochs", "0", *recipe]  # the margins read the last epoch
        if random_init:
            args.append("--random-init")
        if finetune_main(args) != 0:
            raise SystemExit(f"fine-tuning failed: {out}")
    return seed_scores(out, "accuracy")


def _points(scores: list[float]) -> list[float]:
    return [100 * score for score in scores]


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("runs/transfer"))
    parser.add_argument("--label", default=None, help="name of this configuration (default: from the options)")
    parser.add_argument("--shards", type=Path, help="your own shard dir instead of the built-in corpus")
    parser.add_argument("--task-dir", type=Path, help="your own task (train.jsonl, validation.jsonl: text, label)")
    parser.add_argument("--ood-task-dir", type=Path,
                        help="your own out-of-domain task (None: the built-in AWS reference passages, "
                             "builtin.aws_api_passages)")
    parser.add_argument("--ood-seeds", type=bounded(int, min=1), default=CLOUD_DOCS_SEEDS,
                        help="fine-tuning seeds on it, per init")
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
    data = prepare_data(work / "data", args.vocab_size)  # the quickstart's data, built once
    shards, task, ood = args.shards or data.shards, args.task_dir or data.task, args.ood_task_dir or data.cloud_docs
    run = work / label
    checkpoints = pretrain(args, shards, run)
    protocols = args.protocols.split(",")
    extra = ["--learning-rate", str(args.finetune_lr)] + [a for arg in args.finetune_arg for a in arg.split()]
    recipe = {p: protocol_recipe(p, extra) for p in protocols}
    started = time.perf_counter()
    baseline = {p: finetune(checkpoints[-1], task, work / "random_init" / args.preset / p, recipe[p], args.seeds, True)
                for p in protocols}
    rows = []
    for ckpt in checkpoints:
        for protocol in protocols if ckpt == checkpoints[-1] else protocols[:1]:
            got = finetune(ckpt, task, run / "finetune" / f"{ckpt.name}-{protocol}", recipe[protocol], args.seeds, False)
            rows.append(Margin(f"step {int(ckpt.name[4:])}, {protocol}", "accuracy x 100", _points(got),
                               _points(baseline[protocol])))
    # The out-of-domain task, the last checkpoint against random init, with the quickstart's recipe and seeds.
    ood_recipe = list(FINETUNE_CLOUD_DOCS)
    ood_margin = Margin(f"out of domain ({ood.name}), last checkpoint", "accuracy x 100",
                        _points(finetune(checkpoints[-1], ood, run / "finetune" / f"ood-{ood.name}", ood_recipe,
                                         args.ood_seeds, False)),
                        _points(finetune(checkpoints[-1], ood, work / "random_init" / args.preset / f"ood-{ood.name}",
                                         ood_recipe, args.ood_seeds, True)))
    print(f"fine-tuning: {time.perf_counter() - started:.0f} s", flush=True)
    summary = {"label": label, "args": {k: str(v) for k, v in vars(args).items()},
               "rows": [m.as_dict() for m in rows], "out_of_domain": ood_margin.as_dict(),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    (run / "transfer.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{label}: dev accuracy x 100, median over the seeds [min, max]; gain and its bootstrap 95% interval")
    print(f"{'checkpoint, protocol':<46} {'pretrained':>18} {'random init':>18} {'gain':>6}  interval")
    for m in [*rows, ood_margin]:
        fmt = lambda scores: f"{statistics.median(scores):.1f} [{min(scores):.1f}, {max(scores):.1f}]"  # noqa: E731
        interval = f"{m.interval[0]:+.1f} to {m.interval[1]:+.1f}" if m.interval else "(too few seeds)"
        print(f"{m.task:<46} {fmt(m.pretrained):>18} {fmt(m.random_init):>18} {m.value:>+6.1f}  {interval}")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
