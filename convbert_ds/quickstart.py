"""Quickstart: pretrain a tiny ConvBERT ELECTRA on built-in real text, then show that it transfers.

1. data (``convbert_ds.data.transfer_task``, nothing downloaded): about 10 MB of English prose from
   the docstrings and docs of the installed packages, and a 7-way text classification task built
   from other packages' docstrings, whose text is held out of the corpus;
2. ``preprocessing.tokenizer`` (sentencepiece, 8,000 pieces) and ``preprocessing.shard``
   (megatron-core token shards + manifest);
3. ``deepspeed --num_gpus 2 --module convbert_ds.train --config configs/quickstart.yaml``: ZeRO-2 on
   2 CPU ranks, the whole step compiled, printing the losses and the discriminator's RTD AUC;
4. ``convbert_ds.convert``: HuggingFace ConvBERT directories, verified against transformers;
5. ``convbert_ds.finetune`` on the task, the converted discriminator against the same architecture
   from random weights, over seeds, and the margin between them.

About 17 minutes on 2 CPU cores, set-up included; ``--smoke`` runs every step on a small budget in a few
minutes (its model is too small to beat random init: it checks the machinery, not the claim). Rerunning
resumes training from the last checkpoint; fine-tuning is redone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from convbert_ds.data.transfer_task import write_pretraining_corpus, write_transfer_task
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart.yaml"
SMOKE = {"corpus_bytes": 2_000_000, "steps": 100, "seeds": 1}
# The short fine-tuning protocol of benchmarks/RESULTS.md: 4 epochs, max length 32, lr 1e-3 for both inits.
FINETUNE = ["--max-seq-length", "32", "--epochs", "4", "--learning-rate", "1e-3", "--layerwise-lr-decay", "1.0"]


def _env(**extra: str) -> dict:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def _run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO, env=_env())


def prepare_data(work: Path, vocab_size: int, corpus_bytes: int | None = None) -> tuple[Path, Path]:
    """WORK/{corpus.txt, tokenizer/, shards/, task/}, each built once; returns (shards, task)."""
    python = sys.executable
    corpus, tokenizer, shards, task = work / "corpus.txt", work / "tokenizer", work / "shards", work / "task"
    if not corpus.exists():
        print("building the corpus from the installed packages' docstrings and docs...", flush=True)
        write_pretraining_corpus(corpus, max_bytes=corpus_bytes)
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB)", flush=True)
    if not (tokenizer / "tokenizer.json").exists():
        _run([python, "-m", "preprocessing.tokenizer", "--input", str(corpus), "--out", str(tokenizer),
              "--vocab-size", str(vocab_size)])
    if not (shards / "manifest.json").exists():
        _run([python, "-m", "preprocessing.shard", "--input", str(corpus), "--tokenizer", str(tokenizer),
              "--out", str(shards), "--valid-fraction", "0.02"])
    if not (task / "validation.jsonl").exists():
        write_transfer_task(task)
    return shards, task


def pretrain(work: Path, shards: Path, steps: int | None, ranks: int) -> Path:
    checkpoints, logs = work / "checkpoints", work / "logs"
    overrides = [f"data.sets=[{{path: '{shards}', weight: 1.0}}]", f"checkpoint.dir={checkpoints}", f"log.dir={logs}",
                 f"train.micro_batch_size={64 // ranks}"]
    if steps is not None:
        overrides += [f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 10)}",
                      f"checkpoint.interval={max(1, steps // 2)}", f"eval.interval={max(1, steps // 2)}",
                      f"log.interval={max(1, steps // 10)}"]
    _run([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--module", "convbert_ds.train",
          "--config", str(CONFIG), *overrides])
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    train, evals = [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "valid"]
    first, last = train[0], train[-1]
    print(f"\ntrain loss {first['loss']:.2f} -> {last['loss']:.2f} (generator MLM {first['mlm_loss']:.2f} -> "
          f"{last['mlm_loss']:.2f}, discriminator RTD {first['rtd_loss']:.3f} -> {last['rtd_loss']:.3f})")
    if evals:
        print("validation RTD AUC by step: " + ", ".join(f"{r['step']}: {r['rtd_auc']:.3f}" for r in evals))
    print(f"checkpoints: {checkpoints}; logs: {logs} (plot: python -m convbert_ds.plot {logs})\n")
    return checkpoints


def _finetune_command(model: Path, task: Path, out: Path, seeds: int, random_init: bool) -> list[str]:
    return [sys.executable, "-m", "convbert_ds.finetune", "--model", str(model), "--out", str(out), "--force",
            "--train", str(task / "train.jsonl"), "--validation", str(task / "validation.jsonl"),
            "--text-column", "text", "--label-column", "label", "--seeds", str(seeds), *FINETUNE,
            *(["--random-init"] if random_init else [])]


def _accuracies(out: Path) -> list[float]:
    results = json.loads((out / "results.json").read_text())
    return [seed["final"]["validation"]["accuracy"] for seed in results["seeds"]]


def finetune_both(model: Path, task: Path, out: Path, seeds: int) -> tuple[list[float], list[float]]:
    """Dev accuracy per seed of the pretrained and the random init, ``python -m convbert_ds.finetune`` each in
    its own process, as a user runs it. The two run side by side on half the cores each: a second thread
    gains the tiny model only 1.5x (a one-seed run in 22 s on 2 threads, 34 s on 1), so on 2 cores both inits
    are done in 2.6 minutes with the conversion, against 4.2 one after the other (benchmarks/RESULTS.md). The
    pretrained run prints to the terminal, the random init's to OUT/random_init.log."""
    # the cores this process may use (Linux: its affinity, as under Slurm); elsewhere the machine's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    threads = str(max(1, cores // 2))
    pretrained, random = (_finetune_command(model, task, out / name, seeds, name == "random_init")
                          for name in ("pretrained", "random_init"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "random_init.log"
    print(f"$ {' '.join(random)} > {log} &\n$ {' '.join(pretrained)}", flush=True)
    with log.open("w") as log_file:
        background = subprocess.Popen(random, cwd=REPO, env=_env(OMP_NUM_THREADS=threads), stdout=log_file,
                                      stderr=subprocess.STDOUT)
        try:
            subprocess.run(pretrained, check=True, cwd=REPO, env=_env(OMP_NUM_THREADS=threads))
        finally:
            background.wait()
    if background.returncode != 0:
        raise subprocess.CalledProcessError(background.returncode, random, output=f"see {log}")
    return _accuracies(out / "pretrained"), _accuracies(out / "random_init")


def report(pretrained: list[float], random: list[float]) -> str:
    margin = statistics.median(pretrained) - statistics.median(random)
    above = sum(score > max(random) for score in pretrained)
    show = lambda scores: ", ".join(f"{s:.3f}" for s in scores)  # noqa: E731
    return (f"dev accuracy, median over {len(pretrained)} seed(s):\n"
            f"  pretrained   {statistics.median(pretrained):.3f}  ({show(pretrained)})\n"
            f"  random init  {statistics.median(random):.3f}  ({show(random)})\n"
            f"  margin       {100 * margin:+.1f} points; {above}/{len(pretrained)} pretrained seeds above the "
            f"best random-init seed")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default=None, help="where everything is written (None: runs/quickstart, "
                                                         "or runs/quickstart-smoke with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="every step on a small budget, in a few minutes")
    parser.add_argument("--steps", type=bounded(int, min=1), default=None,
                        help="pretraining steps (None: configs/quickstart.yaml's, 100 with --smoke)")
    parser.add_argument("--seeds", type=bounded(int, min=1), default=None,
                        help="fine-tuning seeds per init (None: 5, 1 with --smoke)")
    parser.add_argument("--ranks", type=int, default=2, choices=(1, 2, 4, 8),
                        help="processes for the deepspeed launcher (the global batch stays 64)")
    parser.add_argument("--vocab-size", type=bounded(int, min=1), default=8000, help="the tokenizer's vocabulary size")
    args = parser.parse_args(argv)
    smoke = SMOKE if args.smoke else {}
    work = Path(args.work_dir or ("runs/quickstart-smoke" if args.smoke else "runs/quickstart")).resolve()
    steps = args.steps if args.steps is not None else smoke.get("steps")
    seeds = args.seeds or smoke.get("seeds", 5)  # 3 were too few to separate the inits (RESULTS)

    shards, task = prepare_data(work, args.vocab_size, smoke.get("corpus_bytes"))
    checkpoints = pretrain(work, shards, steps, args.ranks)
    hf = work / "hf"
    _run([sys.executable, "-m", "convbert_ds.convert", "--checkpoint", str(checkpoints), "--out", str(hf),
          "--verify", "--force"])
    print(f"HuggingFace ConvBERT: {hf / 'discriminator'} (AutoModel) and {hf / 'generator'} (AutoModelForMaskedLM)\n")

    print(f"does it transfer? fine-tuning on {task} (7 classes), pretrained vs random init...", flush=True)
    pretrained, random = finetune_both(hf / "discriminator", task, work / "finetune", seeds)
    summary = report(pretrained, random)
    (work / "transfer.txt").write_text(summary + "\n")
    print("\n" + summary)
    print(f"fine-tuned classifier (transformers ConvBertForSequenceClassification): "
          f"{work / 'finetune' / 'pretrained' / 'best'}")
    if args.smoke:
        print("(smoke budget: this model is too small to beat random init; the full quickstart is what measures it)")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
