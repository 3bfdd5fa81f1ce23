"""results.json and results.md: per task the median over seeds with every seed's value, the two GLUE
averages, the paper's row for the same model size, and the random-init row with the margin per task."""

from __future__ import annotations

import statistics

from convbert_ds.config import PRESET_NAMES, ModelConfig, preset
from convbert_ds.evaluate.paper import (GLUE, LEADERBOARD_METRICS, PAPER_AVERAGE_TASKS, PAPER_METRIC, SECOND_METRIC,
                                        SQUAD, TABLE_3_TEST, TABLE_4_DEV, TITLES, metric_label, scale)
from convbert_ds.evaluate.workers import Outcome

_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "embedding_size",
                "num_groups", "conv_kernel_size", "head_ratio")


def paper_size(model: ModelConfig) -> str | None:
    """The paper's model size this model has (small, medium-small, base), or None."""
    for name in PRESET_NAMES:
        reference = preset(name)
        if name != "tiny" and all(getattr(model, f) == getattr(reference, f) for f in _SIZE_FIELDS):
            return name
    return None


def summarise(outcomes: list[Outcome], tasks: tuple[str, ...], model: ModelConfig, settings: dict) -> dict:
    finished = [o for o in outcomes if o.final is not None]
    rows = {}
    for init in ("pretrained", "random"):
        by_task = {}
        for task in tasks:
            seeds = sorted((o for o in finished if o.job.task.name == task and o.job.init == init),
                           key=lambda o: o.job.seed)
            if seeds:
                by_task[task] = _task_row(task, seeds)
        if by_task:
            rows[init] = {"tasks": by_task, **_averages(by_task)}
    size = paper_size(model)
    summary = {**settings, "paper_size": size, "rows": rows,
               "failed": sorted(o.job.name for o in outcomes if o.final is None)}
    if size:
        summary["paper"] = {"glue_test": TABLE_3_TEST[size], "squad_dev": TABLE_4_DEV[size]}
    if "random" in rows and "pretrained" in rows:
        summary["margin"] = {task: rows["pretrained"]["tasks"][task]["median"] - row["median"]
                             for task, row in rows["random"]["tasks"].items() if task in rows["pretrained"]["tasks"]}
    return summary


def _value(task: str, final: dict, where: tuple[str, str]) -> float:
    split, metric = where
    return final[split][metric] * scale(task)


def _task_row(task: str, seeds: list[Outcome]) -> dict:
    values = [_value(task, o.final, PAPER_METRIC[task]) for o in seeds]
    row = {"metric": "/".join(PAPER_METRIC[task]), "seeds": {o.job.seed: v for o, v in zip(seeds, values)},
           "median": statistics.median(values)}
    if task in SECOND_METRIC:
        row["second"] = {"metric": "/".join(SECOND_METRIC[task]),
                         "median": statistics.median(_value(task, o.final, SECOND_METRIC[task]) for o in seeds)}
    if task in GLUE:
        pairs = LEADERBOARD_METRICS.get(task, (PAPER_METRIC[task],))
        # the median over seeds of each metric, then their mean
        row["leaderboard"] = statistics.fmean(statistics.median(_value(task, o.final, p) for o in seeds) for p in pairs)
    return row


def _averages(by_task: dict) -> dict:
    missing = [t for t in PAPER_AVERAGE_TASKS if t not in by_task]
    averages = {"glue_average": None if missing else statistics.fmean(by_task[t]["median"] for t in PAPER_AVERAGE_TASKS)}
    averages["leaderboard_average"] = None if missing or "wnli" not in by_task else \
        statistics.fmean(by_task[t]["leaderboard"] for t in GLUE)
    return averages


def markdown(summary: dict) -> str:
    tasks = [t for t in summary["tasks"] if t in GLUE] + [t for t in summary["tasks"] if t in SQUAD]
    average = any(t in GLUE for t in tasks)  # the GLUE average's column, where there are GLUE tasks

    def row(name: str, cells: list[str], last: str) -> str:
        return f"| {name} | " + " | ".join(cells) + (f" | {last} |" if average else " |")

    head = [row("", [f"{TITLES[t]} ({metric_label(t)})" for t in tasks], "GLUE avg"),
            "|---" * (len(tasks) + 1 + average) + "|"]
    lines = []
    for init, found in summary["rows"].items():
        cells = [f"{found['tasks'][t]['median']:.1f}" if t in found["tasks"] else "-" for t in tasks]
        lines.append(row(f"ours, {init} init (median)", cells, _number(found["glue_average"])))
    if "margin" in summary:
        cells = [f"{summary['margin'][t]:+.1f}" if t in summary["margin"] else "-" for t in tasks]
        lines.append(row("margin (pretrained - random)", cells, ""))
    if summary.get("paper"):
        glue, squad = summary["paper"]["glue_test"], summary["paper"]["squad_dev"]
        cells = [f"{glue[t]:.1f}" if t in glue else f"{squad[t][1]:.1f}" if t in squad else "-" for t in tasks]
        lines.append(row(f"paper, ConvBERT-{summary['paper_size']}", cells, f"{glue['average']:.1f}"))
    out = [f"# Evaluation of `{summary['model']}`", "", *head, *lines, "",
           "Ours: the dev sets, the median over seeds. " + _paper_note(summary), ""]
    out += _details(summary, tasks)
    if summary["failed"]:
        out += ["", f"Failed jobs (rerun the same command to retry them): {', '.join(summary['failed'])}."]
    if summary.get("unfinished_elsewhere"):
        out += ["", f"Not finished yet by the other shares (--shard), so left out: "
                    f"{', '.join(summary['unfinished_elsewhere'])}. The last share to end writes the whole table."]
    out += ["", f"Command: `{summary['command']}`", ""]
    return "\n".join(out)


def _paper_note(summary: dict) -> str:
    if not summary.get("paper"):
        return ("The model is none of the paper's sizes (small, medium-small, base), so no paper row is shown.")
    return ("The paper's GLUE numbers are on the GLUE *test* set (its Table 3), "
            "its SQuAD numbers (F1 here, EM below) on the dev sets (Table 4).")


def _details(summary: dict, tasks: list[str]) -> list[str]:
    out = ["## Every seed", "", "| task | init | metric | median | seeds |", "|---|---|---|---|---|"]
    for init, row in summary["rows"].items():
        for task in tasks:
            if task not in row["tasks"]:
                continue
            cell = row["tasks"][task]
            seeds = ", ".join(f"{seed}: {value:.2f}" for seed, value in cell["seeds"].items())
            out.append(f"| {TITLES[task]} | {init} | {cell['metric']} | {cell['median']:.2f} | {seeds} |")
            if "second" in cell:
                out.append(f"| {TITLES[task]} | {init} | {cell['second']['metric']} | {cell['second']['median']:.2f} | |")
    if not any(t in GLUE for t in tasks):
        return out
    out += ["", "## Averages", ""]
    for init, row in summary["rows"].items():
        out.append(f"- {init} init: the papers' GLUE average (8 tasks, WNLI left out; CoLA MCC, STS-B Spearman, "
                   f"accuracy elsewhere, MNLI matched) {_number(row['glue_average'])}; leaderboard-style (9 tasks; "
                   f"MRPC and QQP F1/accuracy, STS-B Pearson/Spearman, MNLI m/mm averaged first; on dev, not the "
                   f"leaderboard's test set) {_number(row['leaderboard_average'])}")
    return out


def _number(value: float | None) -> str:
    return "n/a (not every task ran)" if value is None else f"{value:.1f}"
