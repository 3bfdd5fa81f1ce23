"""A fine-tuning run over several seeds, and what it leaves in OUT.

    OUT/run.json            the resolved settings (task source, model, init, recipe); a rerun with other
                            settings is refused, a rerun with the same ones resumes
    OUT/seeds/seedN.json    one finished seed: {"seed", "history": [...per evaluated epoch...],
                            "final": {split: metrics}}
    OUT/seeds/seedN.jsonl   its per-step training log ({"step", "loss", "lr"})
    OUT/state/seedN/        the unfinished seed's resumable state (deleted when the seed finishes)
    OUT/converted/TAG/      a training checkpoint converted for fine-tuning (when --model is one)
    OUT/predictions/seedN/SPLIT/predictions.json (and null_odds.json)
                            question answering: the official files of the seed's last evaluation
    OUT/best/               the best seed's model: transformers ConvBertForSequenceClassification (or
                            ConvBertForQuestionAnswering, ConvBertForTokenClassification) with its tokenizer and
                            id2label, written atomically whenever a seed beats the best so far
    OUT/results.json        the metric per seed, their median, the command and the model it started from
    OUT/results.md          the same as a Markdown table

Each file and directory is written whole or not at all (a temporary name, then a rename). A write that finds
the disk full ends the run in one line naming it, the space free there and what is kept for the rerun that
goes on: the unfinished seed's last state, a finished seed's state at its last step (so the rerun writes its
results without training it again), the finished seeds' results.
"""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from convbert_ds.convert.to_hf import tokenizer_files
from convbert_ds.disk_full import full_disk_says
from convbert_ds.engine import distributed
from convbert_ds.finetune.batches import encode
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.loop import Classification, Placement, train_seed
from convbert_ds.finetune.model_source import ModelSource, initial_model, resolve_model
from convbert_ds.finetune.qa import SpanObjective
from convbert_ds.finetune.recipe import Recipe
from convbert_ds.finetune.squad import QATask, windows
from convbert_ds.finetune.tagging import TaggingTask, TagObjective, encode_tags
from convbert_ds.finetune.tasks import TaskData
from convbert_ds.fsutil import FORCE_FLAG, read_json, write_json_atomically, write_text_atomically
from convbert_ds.model import (ConvBertForQuestionAnswering, ConvBertForSequenceClassification,
                               ConvBertForTokenClassification)
from convbert_ds.model.hf_io import read_tokenizer

SEEDS_DIR, STATE_DIR, BEST_DIR, PREDICTIONS_DIR = "seeds", "state", "best", "predictions"


@dataclass
class RunSpec:
    task: TaskData | QATask | TaggingTask
    model: str  # --model as given
    out: Path
    recipe: Recipe
    random_init: bool = False
    command: str = ""
    force: bool = False  # delete OUT's previous run first


SUBSET_SEED = 0  # fixed: the subset must not follow the fine-tuning seed


def select_train(task: TaskData, recipe: Recipe) -> list:
    """``--examples-per-class`` / ``--max-train-examples``: one seeded subset, the same for every fine-tuning
    seed and for the random-init baseline, so low-resource results compare like with like."""
    examples = task.train
    if recipe.examples_per_class is None and recipe.max_train_examples is None:
        return examples
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(SUBSET_SEED)).tolist()
    picked, per_class = [], {}
    for i in order:
        label = examples[i].label if task.task_type == "classification" else None
        if recipe.examples_per_class is not None and task.task_type == "classification":
            if per_class.get(label, 0) >= recipe.examples_per_class:
                continue
            per_class[label] = per_class.get(label, 0) + 1
        picked.append(i)
        if recipe.max_train_examples is not None and len(picked) >= recipe.max_train_examples:
            break
    return [examples[i] for i in sorted(picked)]


def _placement() -> Placement:
    restore = distributed.saved_torch_vars()
    distributed.discover()
    world, rank = distributed.world_size(), distributed.rank()
    if world == 1:  # one process needs no rendezvous: leave the environment as it was
        restore()
    return Placement(distributed.place(group_when_alone=False), rank, world)


def _settings(spec: RunSpec, recipe: Recipe, model_description: str) -> dict:
    task = {"name": spec.task.name, "type": spec.task.task_type, "labels": spec.task.label_names,
            "metric": spec.task.metric, "source": spec.task.source}
    # A two-label custom task's F1 positive class: it changes the number. (GLUE's is the benchmark's, fixed by the
    # task's name; recording it too would refuse to resume every MRPC and QQP run begun before it was recorded.)
    if spec.task.name == "custom" and getattr(spec.task, "positive_label", None) is not None:
        task["positive_label"] = spec.task.positive_label
    return {"task": task,
            "model": spec.model, "model_resolved": model_description,
            "init": "random" if spec.random_init else "pretrained", "recipe": asdict(recipe)}


def check_resume(path: Path, settings: dict, what: str = "a run") -> None:
    """A rerun resumes only what the same settings started: ``path`` (run.json, evaluation.json) holds them,
    and is written when it is not there yet."""
    if path.is_file():
        before = read_json(path, FinetuneError, f"delete it to go on with this command's settings, or pass "
                                                f"{FORCE_FLAG} to start over in --out", needs=("model",))
        changed = sorted(k for k in settings if before.get(k) != settings[k])
        if changed:
            raise FinetuneError(f"--out {path.parent} holds {what} with different {', '.join(changed)}; use another "
                                "--out, or --force to start over there")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        with full_disk_says(path, f"no part of {path.name} is left there: a rerun starts {what} afresh"):
            write_json_atomically(path, settings)


def _primary(task: TaskData, result: dict) -> float:
    return result[next(iter(task.evals))][task.metric]


def _save_best(model, source_dir: Path, out: Path, command: str, seed: int, final: dict) -> None:
    extra = {p.name: p.read_bytes() for p in tokenizer_files(source_dir)}
    extra["README.md"] = (f"# Fine-tuned ConvBERT (seed {seed})\n\nDev metrics: `{json.dumps(final)}`\n\n"
                          f"Made by:\n\n```\n{command}\n```\n").encode()
    model.save_hf_pretrained(out / BEST_DIR, extra_files=extra, native_ok=True)  # an ablation's body: ours


def _report(spec: RunSpec, settings: dict, seeds: list[dict]) -> dict:
    task = spec.task
    values = [_primary(task, s["final"]) for s in seeds]
    best = max(seeds, key=lambda s: _primary(task, s["final"]))
    results = {**settings, "command": spec.command, "primary": {"split": next(iter(task.evals)), "metric": task.metric},
               "seeds": [{"seed": s["seed"], "final": s["final"], "history": s["history"]} for s in seeds],
               "median": statistics.median(values), "best_seed": best["seed"], "best_dir": str(spec.out / BEST_DIR)}
    results["median_by_metric"] = {
        split: {name: statistics.median(s["final"][split][name] for s in seeds) for name in seeds[0]["final"][split]}
        for split in seeds[0]["final"]}
    kept = f"every seed's result is kept in {spec.out / SEEDS_DIR}: a rerun writes the results without training"
    with full_disk_says(spec.out / "results.json", kept):
        write_json_atomically(spec.out / "results.json", results)
    with full_disk_says(spec.out / "results.md", kept):
        write_text_atomically(spec.out / "results.md", markdown_table(results))
    return results


def markdown_table(results: dict) -> str:
    splits = list(results["median_by_metric"])
    columns = [(split, name) for split in splits for name in results["median_by_metric"][split]]
    head = "| seed | " + " | ".join(f"{split} {name}" for split, name in columns) + " |"
    rows = [head, "|" + " --- |" * (len(columns) + 1)]
    for s in results["seeds"]:
        rows.append(f"| {s['seed']} | " + " | ".join(f"{s['final'][a][b]:.4f}" for a, b in columns) + " |")
    rows.append("| median | " + " | ".join(f"{results['median_by_metric'][a][b]:.4f}" for a, b in columns) + " |")
    task = results["task"]
    return (f"# {task['name']}: {results['init']} init from `{results['model']}`\n\n" + "\n".join(rows) + "\n\n"
            f"Primary metric: {results['primary']['split']} {results['primary']['metric']}, median "
            f"{results['median']:.4f} over {len(results['seeds'])} seed(s); best seed {results['best_seed']} "
            f"in `{results['best_dir']}`.\n\nCommand: `{results['command']}`\n")


def _task_kind(task, tokenizer, recipe: Recipe):
    """How a kind of task is tokenized, trained and scored, and its model's head: (examples -> the loop's data,
    the loop's objective, config -> model)."""
    if isinstance(task, QATask):
        return (lambda questions: windows(tokenizer, questions, recipe.max_seq_length, task.doc_stride),
                SpanObjective(task, task.evals), ConvBertForQuestionAnswering)
    if isinstance(task, TaggingTask):
        return (lambda sentences: encode_tags(tokenizer, task, sentences, recipe.max_seq_length),
                TagObjective(task, task.evals), lambda config: ConvBertForTokenClassification(config, task.label_names))
    labels = task.label_names if task.task_type == "classification" else None
    return (lambda examples: encode(tokenizer, task, examples, recipe.max_seq_length), Classification(task),
            lambda config: ConvBertForSequenceClassification(config, label_names=labels,
                                                             num_labels=1 if labels is None else None))


def _resolve(spec: RunSpec, cuda: bool) -> tuple[ModelSource, Recipe]:
    """The one place the model and the recipe are resolved, on rank 0 alone (it writes OUT): OUT emptied by
    --force, a checkpoint --model converted into it, the recipe's defaults filled in for that model, and a
    rerun's settings checked against run.json."""
    out = spec.out
    if spec.force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model(spec.model, out)
    recipe = spec.recipe.resolve(spec.task.name, source.config, cuda)
    check_resume(out / "run.json", _settings(spec, recipe, source.description))
    (out / SEEDS_DIR).mkdir(exist_ok=True)
    return source, recipe


def run(spec: RunSpec) -> dict | None:
    """Fine-tune every seed (resuming finished and unfinished ones); returns results.json's content on rank 0."""
    place = _placement()
    out = spec.out
    # Every rank gets rank 0's resolution (or its error): the model it converted, the recipe it recorded.
    source, recipe = distributed.on_rank0(lambda: _resolve(spec, place.device.type == "cuda"))
    settings = _settings(spec, recipe, source.description)
    tokenizer = read_tokenizer(source.hf_dir)
    task = spec.task
    prepare_split, objective, head = _task_kind(task, tokenizer, recipe)
    train = prepare_split(select_train(task, recipe))
    evals = {split: prepare_split(examples) for split, examples in task.evals.items()}

    finished = []
    for seed in range(recipe.first_seed, recipe.first_seed + recipe.seeds):
        done = out / SEEDS_DIR / f"seed{seed}.json"
        if done.is_file():
            finished.append(read_json(done, FinetuneError, f"delete it and rerun the same command: seed {seed} is "
                                                           "fine-tuned again", needs=("seed", "final")))
            continue
        model = initial_model(source, head, recipe.dropout, seed, spec.random_init)
        if isinstance(objective, SpanObjective):
            objective.write_to = out / PREDICTIONS_DIR / f"seed{seed}"
        history = train_seed(model, objective, train, evals, recipe, seed, place, out / STATE_DIR / f"seed{seed}",
                             out / SEEDS_DIR / f"seed{seed}.jsonl")
        result = {"seed": seed, "history": history, "final": history[-1]["metrics"]}
        if place.main:
            state_dir = out / STATE_DIR / f"seed{seed}"
            kept = f"seed {seed}'s state at its last step is kept whole in {state_dir}: a rerun finishes it " \
                   "without training"
            if not finished or _primary(task, result["final"]) > max(_primary(task, s["final"]) for s in finished):
                best = out / BEST_DIR  # replaced whole: the model that was there stays until the new one is in
                with full_disk_says(best, (f"{best} still holds the best earlier seed's model; " if best.is_dir()
                                           else "") + kept):
                    _save_best(model, source.hf_dir, out, spec.command, seed, result["final"])
            with full_disk_says(done, kept):
                write_json_atomically(done, result)
            shutil.rmtree(state_dir, ignore_errors=True)
        place.barrier()
        finished.append(result)
    return _report(spec, settings, finished) if place.main else None
