"""``python -m convbert_ds.finetune``: fine-tune a ConvBERT on GLUE, SQuAD, token tagging or a custom task, over seeds.

Runs on CPU, one GPU (bf16 by default there) or several ranks started by torchrun / the deepspeed
launcher / srun / mpirun (data parallel). Bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import torch.distributed as dist

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.engine.distributed import exit_process
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.recipe import Recipe, add_recipe_options
from convbert_ds.finetune.run import RunSpec, run
from convbert_ds.finetune.squad import SQUAD_TASKS, QATask, read_squad
from convbert_ds.finetune.tagging import TAGGING_TASKS, TaggingTask, label_set, read_conll
from convbert_ds.finetune.tasks import POSITIVE_LABEL_OPTION, TASK_TYPES, read_custom, read_glue
from convbert_ds.fsutil import FORCE_FLAG


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m convbert_ds.finetune", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="a transformers ConvBERT directory, or a convbert_ds.train checkpoint directory")
    parser.add_argument("--out", required=True, help="results.json, results.md, best/ and the resumable state")
    parser.add_argument("--random-init", action="store_true",
                        help="same architecture and tokenizer as --model, random weights: the baseline")
    parser.add_argument(FORCE_FLAG, action="store_true", help="delete OUT's previous run first")
    glue = parser.add_argument_group("GLUE (official files on disk)")
    glue.add_argument("--glue-task", help="cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli")
    glue.add_argument("--data-dir", help="the task's folder from the GLUE download (train.tsv, dev.tsv, ...)")
    qa = parser.add_argument_group("question answering (SQuAD's JSON) and token tagging (CoNLL-style files), as "
                                   "--train and --validation")
    qa.add_argument("--task", choices=(*SQUAD_TASKS, *TAGGING_TASKS),
                    help="squad (v1.1), squad_v2 (v2.0, with unanswerable questions), conll or tokens (a token and its "
                    "tag a line, the tag last; CoNLL-2003's files as they are)")
    qa.add_argument("--doc-stride", type=bounded(int, min=0), default=128,
                    help="context tokens that consecutive windows of a long context share")
    qa.add_argument("--n-best", type=bounded(int, min=1), default=20, help="start and end candidates per window")
    qa.add_argument("--max-answer-length", type=bounded(int, min=1), default=30, help="longest answer, in tokens")
    custom = parser.add_argument_group("custom task (TSV, CSV, JSONL or a datasets save_to_disk directory)")
    custom.add_argument("--train", help="the training split's file or directory")
    custom.add_argument("--validation", help="the validation split's file or directory")
    custom.add_argument("--text-column", help="the column holding the text")
    custom.add_argument("--text-pair-column", help="the column holding a pair's second text (None: single texts)")
    custom.add_argument("--label-column", help="the column holding the label")
    custom.add_argument("--task-type", choices=TASK_TYPES, help="None: regression if every train label is a number "
                        "and one is not whole, else classification")
    custom.add_argument(POSITIVE_LABEL_OPTION, metavar="LABEL",
                        help="F1's positive class, for two labels (None: the positive side of 1/0, 1/-1, true/false, "
                        "yes/no, positive/negative or pos/neg in any case, else the label that sorts second)")
    add_recipe_options(parser)
    return parser.parse_args(argv)


def read_task(args: argparse.Namespace):
    _check_positive_label(args)
    if args.task and (args.glue_task or not (args.train and args.validation)):
        files = "SQuAD's JSON files (e.g. train-v1.1.json, dev-v1.1.json)" if args.task in SQUAD_TASKS else \
            "CoNLL-style files (e.g. CoNLL-2003's train.txt and valid.txt)"
        raise FinetuneError(f"--task {args.task} takes {files} as --train and --validation, and no --glue-task")
    if args.task in TAGGING_TASKS:
        train, dev = read_conll(args.train), read_conll(args.validation)
        return TaggingTask(args.task, label_set(train, {"validation": dev}, args.train), train, {"validation": dev},
                           {"train": args.train, "validation": args.validation})
    if args.task in SQUAD_TASKS:
        version_2 = args.task == "squad_v2"
        return QATask(args.task, read_squad(args.train, version_2), {"validation": read_squad(args.validation, version_2)},
                      {"train": args.train, "validation": args.validation}, doc_stride=args.doc_stride,
                      n_best=args.n_best, max_answer_length=args.max_answer_length)
    custom = {"--train": args.train, "--validation": args.validation, "--text-column": args.text_column,
              "--label-column": args.label_column}
    if args.glue_task:
        if any(custom.values()):
            raise FinetuneError("--glue-task and the custom-task options (--train, --validation, ...) exclude each "
                                "other; pass one kind of task")
        if not args.data_dir:
            raise FinetuneError(f"--glue-task {args.glue_task} needs --data-dir: the task's folder from the GLUE "
                                "download")
        return read_glue(args.glue_task, args.data_dir)
    missing = [name for name, value in custom.items() if not value]
    if missing:
        raise FinetuneError(f"no task: pass --glue-task NAME --data-dir DIR, or a custom task (missing "
                            f"{', '.join(missing)})")
    return read_custom(args.train, args.validation, args.text_column, args.label_column,
                       text_pair_column=args.text_pair_column, task_type=args.task_type,
                       positive_label=args.positive_label)


def _check_positive_label(args: argparse.Namespace) -> None:
    """--positive-label is a custom task's; the others' positive class is fixed or there is none. (A custom
    task's labels are checked once read, in read_custom.)"""
    if args.positive_label is None:
        return
    option = f"{POSITIVE_LABEL_OPTION} {args.positive_label}"
    if args.glue_task:
        raise FinetuneError(f"{option}: GLUE tasks keep the benchmark's positive class (MRPC's and QQP's '1'); drop "
                            "the option, which is for custom classification tasks with two labels")
    if args.task:
        raise FinetuneError(f"{option}: --task {args.task} has no positive class; drop the option, which is for "
                            "custom classification tasks with two labels")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def finetune() -> None:
        args = parse_args(argv)
        recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
        recipe.validate()
        task = read_task(args)
        out = Path(args.out)
        command = "python -m convbert_ds.finetune " + shlex.join(argv)
        if run(RunSpec(task, args.model, out, recipe, args.random_init, command, force=args.force)) is not None:
            print((out / "results.md").read_text())

    return exit_on_user_error(finetune, prefix="finetune error")


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():  # a torchrun rank: gloo's threads can abort a finished run at interpreter exit
        exit_process(code)
    sys.exit(code)
