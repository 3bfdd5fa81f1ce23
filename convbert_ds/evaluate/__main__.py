"""``python -m convbert_ds.evaluate glue|squad|all``: the paper's tables for one model (see the package's
docstring). Bad input ends in one line on stderr and exit code 2, before any job starts; a job that fails is
named at the end (exit code 1), and the same command runs it again."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import shutil
import sys
from pathlib import Path

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
import convbert_ds.evaluate as package
from convbert_ds.evaluate import plan, report, workers
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.model_source import resolve_model
from convbert_ds.finetune.recipe import Recipe, add_recipe_options
from convbert_ds.finetune.run import check_resume
from convbert_ds.fsutil import FORCE_FLAG, write_json_atomically, write_text_atomically
from convbert_ds.log import get_logger

log = get_logger(__name__)


def parse_args(argv: list[str]):
    parser = ArgumentParser(prog="python -m convbert_ds.evaluate", description=package.__doc__)
    parser.add_argument("benchmark", choices=tuple(plan.BENCHMARKS), help="GLUE's 9 tasks, SQuAD v1.1 and v2.0, or both")
    parser.add_argument("--model", required=True, help="a ConvBERT directory, or a convbert_ds.train checkpoint "
                                                       "(converted once into OUT/converted)")
    parser.add_argument("--out", required=True, help="results.md, results.json and every job's run")
    parser.add_argument("--glue-dir", help="the GLUE download's folder: CoLA/, SST-2/, MRPC/, QQP/, STS-B/, MNLI/, "
                                           "QNLI/, RTE/, WNLI/")
    parser.add_argument("--squad-dir", help="the folder with train-v1.1.json, dev-v1.1.json, train-v2.0.json and "
                                            "dev-v2.0.json")
    parser.add_argument("--doc-stride", type=bounded(int, min=0), default=128,
                        help="SQuAD: context tokens consecutive windows share")
    parser.add_argument("--tasks", help="some of the benchmark's tasks, comma-separated (default: all of them)")
    parser.add_argument("--random-init-baseline", action="store_true",
                        help="fine-tune every (task, seed) from a random init too: a row and a margin per task")
    parser.add_argument("--from-mnli", action="store_true",
                        help="start RTE, MRPC and STS-B from MNLI's fine-tuned model of the same init and seed "
                             "(RoBERTa's and MosaicBERT's recipe; the ConvBERT paper's numbers are without it)")
    parser.add_argument("--jobs", type=bounded(int, min=1),
                        help="jobs side by side (default: one per GPU, or 1 on a CPU, where the cores are shared out)")
    parser.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                        help="run the K-th of N equal shares of the jobs (0-based; slurm/evaluate.sbatch as an "
                             "array job: one per task), the table from every job finished in OUT")
    parser.add_argument(FORCE_FLAG, action="store_true", help="delete OUT's previous evaluation first")
    add_recipe_options(parser)
    parser.set_defaults(seeds=5)
    return parser.parse_args(argv)


def _shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"{text!r}: K/N with 0 <= K < N, e.g. 0/4")
    return int(k), int(n)


def _settings(args, names: tuple[str, ...], recipe: Recipe, resolved: str) -> dict:
    """What evaluation.json records: a rerun must give the same (--shard aside)."""
    return {"model": args.model, "model_resolved": resolved, "tasks": list(names), "seeds": args.seeds,
            "doc_stride": args.doc_stride, "first_seed": args.first_seed,
            "random_init_baseline": args.random_init_baseline, "from_mnli": args.from_mnli,
            "recipe": {k: v for k, v in dataclasses.asdict(recipe).items() if k not in ("seeds", "first_seed")}}


def evaluate(argv: list[str]) -> int:
    args = parse_args(argv)
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    recipe.validate()
    out = Path(args.out)
    if args.force and args.shard[1] > 1:
        raise FinetuneError(f"{FORCE_FLAG} with --shard {args.shard[0]}/{args.shard[1]}: each share would delete the "
                            "others' work; empty --out once, before the shares start")
    names = plan.task_names(args.benchmark, args.tasks, args.from_mnli)
    tasks = plan.sources(names, args.glue_dir, args.squad_dir, args.doc_stride)
    plan.check_files(tasks)
    if args.force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model(args.model, out)
    plan.check_lengths(tasks, source.config, args.model, recipe)
    settings = _settings(args, names, recipe, source.description)
    check_resume(out / "evaluation.json", settings, "an evaluation")
    settings = {**settings, "command": "python -m convbert_ds.evaluate " + shlex.join(argv)}
    every = plan.jobs(tasks, args.seeds, args.random_init_baseline, source.hf_dir, recipe, out, args.from_mnli)
    k, n = args.shard
    todo = plan.share(every, k, n)
    devices = workers.slots(args.jobs)
    log.info(f"{len(todo)} fine-tuning job(s) ({len(names)} task(s) x {args.seeds} seed(s)"
             f"{' x 2 inits' if args.random_init_baseline else ''}{f', share {k}/{n}' if n > 1 else ''}) on "
             f"{len(devices)} worker(s){'' if devices[0] is None else ' (one GPU each)'}; logs in {out / 'jobs'}")
    outcomes = workers.run_all(todo, devices)
    ran = {o.job.name for o in outcomes}
    others = [job for job in every if job.name not in ran]  # the other shares' jobs, as far as they are
    outcomes += [workers.Outcome(job, workers.final(job)) for job in others if job.results.is_file()]
    settings = {**settings, "unfinished_elsewhere": sorted(j.name for j in others if not j.results.is_file())}
    summary = report.summarise(outcomes, names, source.config, settings)
    write_json_atomically(out / "results.json", summary)
    write_text_atomically(out / "results.md", report.markdown(summary))
    print((out / "results.md").read_text())
    if summary["failed"]:
        log.warning(f"error: {len(summary['failed'])} job(s) failed ({', '.join(summary['failed'])}); each one's "
                    f"log.txt under {out / 'jobs'} says why; the same command runs them again")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return exit_on_user_error(lambda: evaluate(argv), prefix="evaluate error")


if __name__ == "__main__":
    sys.exit(main())
