"""``python -m convbert_ds.finetune``: fine-tune a ConvBERT on a GLUE task or a custom task, over seeds.

Runs on CPU, one GPU (bf16 by default there) or several ranks started by torchrun / the deepspeed
launcher / srun / mpirun (data parallel). Bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from convbert_ds.config import ConfigError
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.recipe import PRECISIONS, Recipe
from convbert_ds.finetune.run import RunSpec, run
from convbert_ds.finetune.tasks import read_custom, read_glue

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise FinetuneError(message)


def _recipe_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("recipe (defaults: ConvBERT Table 6 and ELECTRA's fine-tuning settings)")
    defaults = Recipe()
    helps = {
        "learning_rate": "peak LR (default by model width: 3e-4 up to 512 wide, 1e-4 up to 768, else 5e-5)",
        "epochs": "default 3, 10 for RTE and STS-B",
        "dropout": "default: the model's hidden_dropout_prob",
        "precision": f"{PRECISIONS}; auto = bf16 on a GPU, fp32 on CPU",
        "seeds": "fine-tune this many seeds (first-seed, first-seed+1, ...) and report the median",
        "examples_per_class": "low-resource runs: this many training examples per class (one seeded subset)",
        "max_train_examples": "train on at most this many examples (one seeded subset)",
        "save_steps": "write the resumable state every N steps (and after every epoch)",
    }
    for field in dataclasses.fields(Recipe):
        default = getattr(defaults, field.name)
        kind = {"int": int, "float": float, "str": str}[field.type.split(" ")[0]]
        group.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=default,
                           help=helps.get(field.name, f"default {default}"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m convbert_ds.finetune", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="a transformers ConvBERT directory, or a convbert_ds.train checkpoint directory")
    parser.add_argument("--out", required=True, help="results.json, results.md, best/ and the resumable state")
    parser.add_argument("--random-init", action="store_true",
                        help="same architecture and tokenizer as --model, random weights: the baseline")
    parser.add_argument("--force", action="store_true", help="delete OUT's previous run first")
    glue = parser.add_argument_group("GLUE (official files on disk)")
    glue.add_argument("--glue-task", help="cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli")
    glue.add_argument("--data-dir", help="the task's folder from the GLUE download (train.tsv, dev.tsv, ...)")
    custom = parser.add_argument_group("custom task (TSV, CSV, JSONL or a datasets save_to_disk directory)")
    custom.add_argument("--train")
    custom.add_argument("--validation")
    custom.add_argument("--text-column")
    custom.add_argument("--text-pair-column")
    custom.add_argument("--label-column")
    custom.add_argument("--task-type", choices=("classification", "regression"))
    _recipe_options(parser)
    return parser.parse_args(argv)


def read_task(args: argparse.Namespace):
    custom = [args.train, args.validation, args.text_column, args.label_column]
    if args.glue_task:
        if any(custom):
            raise FinetuneError("--glue-task and the custom-task options (--train, --validation, ...) exclude each "
                                "other; pass one kind of task")
        if not args.data_dir:
            raise FinetuneError(f"--glue-task {args.glue_task} needs --data-dir: the task's folder from the GLUE "
                                "download")
        return read_glue(args.glue_task, args.data_dir)
    missing = [name for name, value in zip(("--train", "--validation", "--text-column", "--label-column"), custom)
               if not value]
    if missing:
        raise FinetuneError(f"no task: pass --glue-task NAME --data-dir DIR, or a custom task (missing "
                            f"{', '.join(missing)})")
    return read_custom(args.train, args.validation, args.text_column, args.label_column,
                       text_pair_column=args.text_pair_column, task_type=args.task_type)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
        recipe.validate()
        task = read_task(args)
        out = Path(args.out)
        command = "python -m convbert_ds.finetune " + shlex.join(argv)
        results = run(RunSpec(task, args.model, out, recipe, args.random_init, command, force=args.force))
    except (FinetuneError, ConfigError) as error:
        print(f"finetune error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if results is not None:
        print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
