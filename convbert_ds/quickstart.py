"""Quickstart: pretrain a tiny ConvBERT ELECTRA on built-in real text, then measure how far it transfers.

1. data (nothing downloaded): about 10 MB of English prose from the docstrings and docs of the installed
   packages (``convbert_ds.builtin.docstring_summaries``), and three tasks whose text is held out of it: a
   7-way classification of other packages' docstring summaries (in-domain), cloze questions over the same
   summaries in SQuAD's format (``convbert_ds.builtin.docstring_questions``), and a 6-way classification of
   passages of the AWS API reference botocore ships (``convbert_ds.builtin.aws_api_passages``, out of domain);
2. ``preprocessing.tokenizer`` (sentencepiece, 8,000 pieces) and ``preprocessing.shard``
   (megatron-core token shards + manifest);
3. ``deepspeed --num_gpus 2 --module convbert_ds.train --config configs/quickstart.yaml``: ZeRO-2 on
   2 CPU ranks, the whole step compiled, printing the losses and the discriminator's RTD AUC;
4. ``convbert_ds.convert``: HuggingFace ConvBERT directories, verified against transformers;
5. ``convbert_ds.finetune`` on each task, the converted discriminator against the same architecture from
   random weights, over seeds; the margin of each, with a bootstrap 95% interval over the seeds.

It runs on 2 CPU cores, set-up included (its time: benchmarks/RESULTS.md#row-quickstart-time); ``--smoke``
runs every step on a small budget in a few minutes (its model is too small to beat random init: it checks the
machinery, not the claim). Rerunning resumes training from the last checkpoint; fine-tuning is redone.

Each step's output in WORK is whole or absent (written under a temporary name, then renamed), so a rerun
takes what a stopped run left as done and goes on. A full WORK ends the run in one line naming the file,
the space free and what is kept: the quickstart's own writes say it here, each command it runs in its own
last line (the quickstart then stops with that command's exit code, adding nothing after it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from convbert_ds.builtin.aws_api_passages import write_cloud_docs_task
from convbert_ds.builtin.docstring_questions import write_qa_task
from convbert_ds.builtin.docstring_summaries import write_pretraining_corpus, write_transfer_task
from convbert_ds.disk_full import full_disk_says
from convbert_ds.finetune.margin import Margin, seed_scores
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.errors import UserError
from convbert_ds.fsutil import write_text_atomically

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart.yaml"
SMOKE = {"corpus_bytes": 2_000_000, "steps": 100}
# The short fine-tuning protocol of benchmarks/RESULTS.md: 4 epochs, max length 32, lr 1e-3 for both inits.
FINETUNE = ("--max-seq-length", "32", "--epochs", "4", "--learning-rate", "1e-3", "--layerwise-lr-decay", "1.0")
# A context (3 summaries) fits 128 tokens; the rest of the recipe is the paper's (layer-wise decay 0.8).
FINETUNE_QUESTIONS = ("--max-seq-length", "128", "--doc-stride", "32", "--batch-size", "16", "--learning-rate", "2e-3")
# 60 labelled passages a class, 30 to 120 words: more epochs over fewer, longer examples. At 1e-3 both inits do
# their best; 2e-3 made random init's seeds fail, which is not transfer (benchmarks/RESULTS.md#row-ood-fair
# against #row-ood-grouped). Batches grouped by length cut most of the padded positions, so 10 seeds a side take
# less time than 8 did ungrouped (benchmarks/RESULTS.md#row-ood-grouped against #row-ood-recipe).
FINETUNE_CLOUD_DOCS = ("--max-seq-length", "128", "--epochs", "12", "--batch-size", "16", "--learning-rate", "1e-3",
                       "--layerwise-lr-decay", "1.0", "--group-by-length", "4")
CLOUD_DOCS_SEEDS = 10
KEPT = ("the data built and the checkpoints saved so far are kept there, each whole: a rerun goes on from them "
        "(fine-tuning is redone)")


def _env(**extra: str) -> dict:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def _run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    code = subprocess.run(command, cwd=REPO, env=_env()).returncode
    if code:  # the command said why in its last line (a full disk: the file, the space free, what it kept)
        raise SystemExit(code)


class BuiltinData(NamedTuple):
    """What ``prepare_data`` builds in WORK: the corpus's shards and the three held-out tasks."""

    shards: Path
    task: Path  # in-domain: train.jsonl, validation.jsonl (builtin.docstring_summaries)
    questions: Path  # the same held-out text as questions: train.json, validation.json (builtin.docstring_questions)
    cloud_docs: Path  # out of domain: train.jsonl, validation.jsonl (builtin.aws_api_passages)


def prepare_data(work: Path, vocab_size: int, corpus_bytes: int | None = None) -> BuiltinData:
    """WORK/{corpus.txt, tokenizer/, shards/, task/, questions/, cloud_docs/}, each built once."""
    python = sys.executable
    corpus, tokenizer = work / "corpus.txt", work / "tokenizer"
    data = BuiltinData(work / "shards", work / "task", work / "questions", work / "cloud_docs")
    if not corpus.exists():
        print("building the corpus from the installed packages' docstrings and docs...", flush=True)
        with full_disk_says(corpus, KEPT):
            write_pretraining_corpus(corpus, max_bytes=corpus_bytes)
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB)", flush=True)
    if not (tokenizer / "tokenizer.json").exists():
        _run([python, "-m", "preprocessing.tokenizer", "--input", str(corpus), "--out", str(tokenizer),
              "--vocab-size", str(vocab_size)])
    if not (data.shards / "manifest.json").exists():
        _run([python, "-m", "preprocessing.shard", "--input", str(corpus), "--tokenizer", str(tokenizer),
              "--out", str(data.shards), "--valid-fraction", "0.02"])
    for folder, last_written, write in ((data.task, "validation.jsonl", write_transfer_task),
                                        (data.questions, "validation.json", write_qa_task),
                                        (data.cloud_docs, "validation.jsonl", write_cloud_docs_task)):
        if not (folder / last_written).exists():  # each file is whole; the last one written marks the task done
            with full_disk_says(folder, KEPT):
                write(folder)
    return data


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


@dataclass(frozen=True)
class Downstream:
    """A held-out task both inits are fine-tuned on: its ``python -m convbert_ds.finetune`` data and recipe
    arguments, the metric of its results.json, and how many seeds per init."""

    name: str
    title: str
    metric: str
    scale: float  # to points: accuracy x 100; SQuAD's F1 is in points already
    args: tuple[str, ...]
    seeds: int


def downstream_tasks(data: BuiltinData, smoke: bool, seeds: int | None) -> list[Downstream]:
    """The held-out tasks of ``data``: the 7-class docstring task (``docstring_summaries``, in-domain), the
    cloze questions over the same held-out text (``docstring_questions``) and the AWS reference passages
    (``aws_api_passages``, out of domain). The question recipe (4 epochs, batch 16, lr 2e-3) is the best of
    those tried in the time it is given (benchmarks/RESULTS.md#row-qa-recipe); longer ones took more time for a
    similar margin."""
    task, questions, cloud = data.task, data.questions, data.cloud_docs
    classification = ("--text-column", "text", "--label-column", "label")
    return [
        Downstream("docstrings", "in-domain: which library a docstring summary documents (7 classes)", "accuracy",
                   100.0, ("--train", str(task / "train.jsonl"), "--validation", str(task / "validation.jsonl"),
                           *classification, *FINETUNE),
                   seeds or (1 if smoke else 5)),  # 3 were too few to separate the inits (RESULTS)
        Downstream("questions", "extractive QA: the word a cloze question over 3 summaries asks for", "f1", 1.0,
                   ("--task", "squad", "--train", str(questions / "train.json"),
                    "--validation", str(questions / "validation.json"), *FINETUNE_QUESTIONS,
                    "--epochs", "1" if smoke else "4"),
                   seeds or (1 if smoke else 2)),
        Downstream("cloud_docs", "out of domain: which AWS service a passage of its API reference documents (6 "
                   "classes)", "accuracy", 100.0,
                   ("--train", str(cloud / "train.jsonl"), "--validation", str(cloud / "validation.jsonl"),
                    *classification, *FINETUNE_CLOUD_DOCS),
                   seeds or (1 if smoke else CLOUD_DOCS_SEEDS)),
    ]


def _finetune_command(model: Path, task: Downstream, out: Path, random_init: bool) -> list[str]:
    # A margin reads the last epoch only: evaluating after the earlier ones too cost time for the same scores
    # (benchmarks/RESULTS.md#out-of-domain-the-aws-reference-task).
    return [sys.executable, "-m", "convbert_ds.finetune", "--model", str(model), "--out", str(out), "--force",
            *task.args, "--seeds", str(task.seeds), "--eval-every-epochs", "0",
            *(["--random-init"] if random_init else [])]


def finetune_both(model: Path, task: Downstream, out: Path) -> Margin:
    """Both inits fine-tuned on ``task``, ``python -m convbert_ds.finetune`` each in its own process, as a user
    runs it. The two run side by side on half the cores each: a second thread gains the tiny model little, so
    both inits are done sooner side by side than one after the other (benchmarks/RESULTS.md#row-finetune-threads).
    The pretrained run prints to the
    terminal, the random init's to OUT/random_init.log."""
    # the cores this process may use (Linux: its affinity, as under Slurm); elsewhere the machine's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    threads = str(max(1, cores // 2))
    pretrained, random = (_finetune_command(model, task, out / name, name == "random_init")
                          for name in ("pretrained", "random_init"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "random_init.log"
    print(f"$ {' '.join(random)} > {log} &\n$ {' '.join(pretrained)}", flush=True)
    with log.open("w") as log_file:
        background = subprocess.Popen(random, cwd=REPO, env=_env(OMP_NUM_THREADS=threads), stdout=log_file,
                                      stderr=subprocess.STDOUT)
        try:
            code = subprocess.run(pretrained, cwd=REPO, env=_env(OMP_NUM_THREADS=threads)).returncode
        finally:
            background.wait()
    if code:  # its last line, on the terminal, said why (as _run's commands do)
        raise SystemExit(code)
    if background.returncode != 0:  # its last line is in the log: said here, as the run's last
        said = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise UserError(f"the random-init fine-tuning stopped ({said[-1] if said else 'no output'}); its output: "
                        f"{log}")
    return Margin(task.title, task.metric.replace("accuracy", "accuracy x 100"),
                  seed_scores(out / "pretrained", task.metric, task.scale),
                  seed_scores(out / "random_init", task.metric, task.scale))


def writable_work_dir(work: Path) -> Path:
    """``work``, made if missing; one line if it cannot be written, or its disk is full (before any of the work
    that fills it: the corpus alone takes seconds to build)."""
    probe = work / f".write-check-{os.getpid()}"
    try:
        with full_disk_says(work, KEPT):
            work.mkdir(parents=True, exist_ok=True)
            try:
                probe.write_bytes(b"\0")  # a byte, not an empty file: a full disk makes that (an inode) and no more
            finally:
                probe.unlink(missing_ok=True)
    except OSError as error:
        raise UserError(f"--work-dir {work}: cannot write there ({error.strerror or type(error).__name__}); pass "
                        "--work-dir with a directory you can write (a full run leaves about 90 MB there)") from None
    return work


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default=None, help="where everything is written (None: runs/quickstart, "
                                                         "or runs/quickstart-smoke with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="every step on a small budget, in a few minutes")
    parser.add_argument("--steps", type=bounded(int, min=1), default=None,
                        help="pretraining steps (None: configs/quickstart.yaml's, 100 with --smoke)")
    parser.add_argument("--seeds", type=bounded(int, min=1), default=None,
                        help="fine-tuning seeds per init on every task (None: each task's own, 1 with --smoke)")
    parser.add_argument("--ranks", type=int, default=2, choices=(1, 2, 4, 8),
                        help="processes for the deepspeed launcher (the global batch stays 64)")
    parser.add_argument("--vocab-size", type=bounded(int, min=1), default=8000, help="the tokenizer's vocabulary size")
    args = parser.parse_args(argv)
    smoke = SMOKE if args.smoke else {}
    work = writable_work_dir(Path(args.work_dir or ("runs/quickstart-smoke" if args.smoke else "runs/quickstart"))
                             .resolve())
    steps = args.steps if args.steps is not None else smoke.get("steps")

    data = prepare_data(work, args.vocab_size, smoke.get("corpus_bytes"))
    checkpoints = pretrain(work, data.shards, steps, args.ranks)
    hf = work / "hf"
    _run([sys.executable, "-m", "convbert_ds.convert", "--checkpoint", str(checkpoints), "--out", str(hf),
          "--verify", "--force"])
    print(f"HuggingFace ConvBERT: {hf / 'discriminator'} (AutoModel) and {hf / 'generator'} (AutoModelForMaskedLM)\n")

    margins = []
    for downstream in downstream_tasks(data, args.smoke, args.seeds):
        print(f"does it transfer? {downstream.title}: pretrained vs random init...", flush=True)
        margins.append(finetune_both(hf / "discriminator", downstream, work / "finetune" / downstream.name))
        print(f"\n{margins[-1].report()}\n", flush=True)
    summary = "\n".join(margin.report() for margin in margins)
    for name, text in (("transfer.txt", summary + "\n"),
                       ("transfer.json", json.dumps([m.as_dict() for m in margins], indent=2) + "\n")):
        with full_disk_says(work / name, KEPT):
            write_text_atomically(work / name, text)
    print("pretrained against random init, each task's fine-tuning seeds (" + str(work / "transfer.json") + "):\n")
    print(summary)
    print(f"fine-tuned models (transformers ConvBertFor...): {work / 'finetune'}/*/pretrained/best")
    if args.smoke:
        print("(smoke budget: this model is too small to beat random init; the full quickstart is what measures it)")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
