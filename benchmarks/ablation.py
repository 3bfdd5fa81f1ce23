"""The ConvBERT paper's ablations (Tables 1 and 2) at a small scale: one pretraining run per variant, same budget.

    python benchmarks/ablation.py --work-dir runs/ablation --threads 2    # defaults: 2 CPU cores, about 50 min
    python benchmarks/ablation.py --work-dir runs/ablation --variants bnk-sdconv,dynamic,conventional
    python benchmarks/ablation.py --shards SHARD_DIR --task-dir TASK_DIR ...   # your own data

Every variant is the tiny preset with ``model.overrides`` for the architecture (``VARIANTS``), pretrained
(ELECTRA objective) on the same data, seed, steps and batch, i.e. the same number of samples; the FLOPs
that budget costs differ by architecture, so each row also gives the model FLOPs per training sample
(``convbert_ds.engine.flops``) and the wall time. Per variant: the held-out (valid) MLM and RTD losses at
the final step, and fine-tuning (``--protocol``, ``--seeds`` seeds) of the final checkpoint against a
random init of the same architecture (a baseline per variant: the architectures differ). Data, the
fine-tuning recipe and the helpers are ``benchmarks/pretraining_transfer.py``'s. The pretraining recipe is
the quickstart's (``configs/quickstart.yaml``: the generator is the discriminator's encoder, RTD weight 1,
64 tokens x 64 samples, lr 1e-3), the one that transfers at this scale (benchmarks/RESULTS.md); the paper's
(untied, weight 50) loses to random init here, which would leave nothing for the variants to differ in.

Table 1 (model): ELECTRA (no conv heads, no bottleneck), +BNK (bottleneck: half the attention heads),
+BNK+GL (grouped linear FFN, 2 groups), +BNK+SDConv (= ConvBERT), +BNK+GL+SDConv.
Table 2 (convolution, all with BNK): conventional, dynamic, span-based dynamic (= ConvBERT's row of
Table 1, run once and shown in both), and span-based dynamic with kernel 5 and 17 (ConvBERT's is 9).

Budget (2 CPU cores, fp32, 2 ranks): data 2.3 min once; per variant about 2.5 min of pretraining (600 steps
of 64 x 64 tokens, about 0.2 s a step, plus start-up, evals and saves) and 2.7 min of fine-tuning (3 seeds x
2 inits, "short"): about 50 min for all 9 variants. Wall times are comparable between variants only on an
otherwise idle machine.

Writes WORK/ablation.json and WORK/ablation.md and prints the tables and whether the paper's ordering
(span-based > dynamic > conventional, by fine-tuning median) shows. Re-running resumes: a finished
pretraining is skipped (an unfinished one resumes from its last checkpoint), and so is a finished
fine-tuning; a fine-tuning that fails is recorded with its error and retried on the next run (shown n/a
with the fine-tuning CLI's reason). Bodies transformers' ConvBERT cannot express (no conv heads, dynamic,
conventional) are fine-tuned from the converter's own format (``ModelConfig.to_native_dict``). Other settings (batch, sequence length, fine-tuning options) need a
new --work-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/ablation.py` finds its sibling

from benchmarks.pretraining_transfer import PROTOCOLS, finetune, pretrain, protocol_recipe  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES, ElectraConfig  # noqa: E402
from convbert_ds.engine.flops import training_flops_per_sample  # noqa: E402
from convbert_ds.formats.checkpoint import run_state  # noqa: E402
from convbert_ds.formats.checkpoint.directory import complete_tags  # noqa: E402
from convbert_ds.quickstart import prepare_data  # noqa: E402

STEPS = 600  # the default budget, measured: see the module docstring
# ConvBERT as the tiny preset builds it, spelled out so that no row depends on the preset's defaults.
_CONVBERT = {"conv_type": "sdconv", "head_ratio": 2, "num_groups": 1, "conv_kernel_size": 9}
# slug -> ({table: row name}, ModelConfig fields); slugs name the run directories.
VARIANTS: dict[str, tuple[dict[int, str], dict]] = {
    "electra": ({1: "ELECTRA"}, {**_CONVBERT, "conv_type": "none", "head_ratio": 1}),
    "bnk": ({1: "+BNK"}, {**_CONVBERT, "conv_type": "none"}),
    "bnk-gl": ({1: "+BNK+GL"}, {**_CONVBERT, "conv_type": "none", "num_groups": 2}),
    "bnk-sdconv": ({1: "+BNK+SDConv (ConvBERT)", 2: "span-based dynamic, K=9"}, _CONVBERT),
    "bnk-gl-sdconv": ({1: "+BNK+GL+SDConv"}, {**_CONVBERT, "num_groups": 2}),
    "conventional": ({2: "conventional, K=9"}, {**_CONVBERT, "conv_type": "conventional"}),
    "dynamic": ({2: "dynamic, K=9"}, {**_CONVBERT, "conv_type": "dynamic"}),
    "k5": ({2: "span-based dynamic, K=5"}, {**_CONVBERT, "conv_kernel_size": 5}),
    "k17": ({2: "span-based dynamic, K=17"}, {**_CONVBERT, "conv_kernel_size": 17}),
}
TABLES = {1: "Table 1: model ablation", 2: "Table 2: convolution type and kernel size"}
ORDERING = ("bnk-sdconv", "dynamic", "conventional")  # the paper's Table 2: best first
# pretrain()'s options this script does not expose: one ELECTRA recipe for every variant, the quickstart's
# (tied generator, RTD weight 1; see the module docstring). curve 4: checkpoints (and valid evals) at every
# quarter, so an interrupted run loses at most a quarter.
_PRETRAIN_FIXED = {"objective": "electra", "rtd_weight": 1.0, "generator_multiplier": 1.0,
                   "warmup_fraction": 0.1, "curve": 4}
_TIED = "model.tie_generator_body=true"
VALID_KEYS = ("mlm_loss", "rtd_loss", "rtd_auc", "mlm_accuracy", "rtd_accuracy")


def pretrain_variant(args, slug: str, shards: Path, run: Path) -> tuple[Path, float | None]:
    """Pretrain (or resume) one variant; returns its final checkpoint and the pretraining wall seconds,
    summed over the attempts (kept in RUN/pretrain_wall.json, so a finished run is not relaunched)."""
    final = run / "checkpoints" / f"step{args.steps:08d}"
    record = run / "pretrain_wall.json"
    seconds = json.loads(record.read_text())["seconds"] if record.exists() else None  # None: not timed here
    if final.name not in complete_tags(run / "checkpoints"):
        overrides = [f"model.overrides.{key}={value}" for key, value in VARIANTS[slug][1].items()]
        options = argparse.Namespace(**{**_PRETRAIN_FIXED, **vars(args),
                                        "train_override": [_TIED, *overrides, *args.train_override]})
        start = time.perf_counter()
        try:
            pretrain(options, shards, run)
        finally:  # a failed or interrupted attempt still counts towards the variant's wall time
            run.mkdir(parents=True, exist_ok=True)
            seconds = (seconds or 0.0) + time.perf_counter() - start
            record.write_text(json.dumps({"seconds": seconds}) + "\n")
    return final, seconds


def final_valid(metrics: Path, step: int) -> dict:
    """The held-out metrics logged at ``step`` (the last such row: a resumed run may log the step twice)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    valid = [r for r in rows if r["split"] == "valid" and r["step"] == step]
    if not valid:
        raise SystemExit(f"{metrics}: no valid row at step {step} (does the shard dir have a valid split?)")
    return {key: valid[-1][key] for key in VALID_KEYS if key in valid[-1]}


class _Tee(io.StringIO):
    """stderr that is kept as well as shown: the fine-tuning CLI's one-line error is the reason we record."""

    def __init__(self) -> None:
        super().__init__()
        self.shown = sys.stderr

    def write(self, text: str) -> int:
        self.shown.write(text)
        return super().write(text)


def finetune_or_error(args, checkpoint: Path, task: Path, out: Path, random_init: bool) -> dict:
    """``finetune``'s {median, scores}, or {error} with the fine-tuning CLI's reason when it refuses the model
    (e.g. an architecture it cannot convert): one variant's refusal must not end the whole ablation."""
    extra = ["--learning-rate", str(args.finetune_lr)] + [a for arg in args.finetune_arg for a in arg.split()]
    tee = _Tee()
    try:
        with contextlib.redirect_stderr(tee):
            scores = finetune(checkpoint, task, out, protocol_recipe(args.protocol, extra), args.seeds, random_init)
        return {"median": statistics.median(scores), "scores": scores}
    except SystemExit as failure:
        said = [line.split(": ", 1)[1] for line in tee.getvalue().splitlines() if line.startswith("finetune error: ")]
        return {"error": said[-1] if said else str(failure)}


def run_variant(args, slug: str, shards: Path, task: Path, work: Path) -> dict:
    run = work / slug
    final, seconds = pretrain_variant(args, slug, shards, run)
    electra = ElectraConfig(**run_state.read(final).electra_config)  # exactly what the trainer built
    tuned = {kind: finetune_or_error(args, final, task, run / "finetune" / f"{final.name}-{args.protocol}-{kind}",
                                     random_init=kind == "random_init")
             for kind in ("pretrained", "random_init")}
    both = all("median" in tuned[kind] for kind in tuned)
    return {"rows": VARIANTS[slug][0], "model_overrides": VARIANTS[slug][1],
            "flops_per_sample": training_flops_per_sample(electra, args.seq_len),
            "pretrain_wall_s": seconds, "valid": final_valid(run / "logs" / "metrics.jsonl", args.steps),
            "finetune": tuned, "gain": tuned["pretrained"]["median"] - tuned["random_init"]["median"] if both else None}


def _accuracy(result: dict) -> str:
    if "error" in result:
        return "n/a"
    return f"{result['median']:.3f} [{min(result['scores']):.3f}, {max(result['scores']):.3f}]"


def _number(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def _row(slug: str, name: str, r: dict) -> str:
    cells = [slug, name, f"{r['flops_per_sample'] / 1e9:.3f}", _number(r["pretrain_wall_s"], ".0f"),
             _number(r["valid"].get("mlm_loss")), _number(r["valid"].get("rtd_loss")),
             _accuracy(r["finetune"]["pretrained"]), _accuracy(r["finetune"]["random_init"]),
             _number(r["gain"], "+.3f")]
    return "| " + " | ".join(cells) + " |"


def markdown(results: dict[str, dict]) -> str:
    """One markdown table per paper table; a variant in both tables is one run shown twice."""
    header = ("| variant | row | GFLOP/sample | pretrain wall s | valid MLM loss | valid RTD loss "
              "| fine-tune acc. pretrained | random init | gain |\n|---|---|---|---|---|---|---|---|---|")
    parts = []
    for table, title in TABLES.items():
        lines = [_row(slug, r["rows"][table], r) for slug, r in results.items() if table in r["rows"]]
        if lines:
            parts.append(f"### {title}\n\n{header}\n" + "\n".join(lines))
    errors = sorted({f"- {slug} ({kind}): {got['error']}" for slug, r in results.items()
                     for kind, got in r["finetune"].items() if "error" in got})
    if errors:
        parts.append("Fine-tuning failed (n/a above):\n" + "\n".join(errors))
    return "\n\n".join(parts) + "\n"


def ordering(results: dict[str, dict]) -> str:
    """Whether span-based > dynamic > conventional by the pretrained fine-tuning median, computed."""
    missing = [f"{slug} ({'not run' if slug not in results else 'fine-tuning failed'})" for slug in ORDERING
               if slug not in results or "median" not in results[slug]["finetune"]["pretrained"]]
    if missing:
        return f"paper's ordering {' > '.join(ORDERING)}: cannot tell, no fine-tuning result for {', '.join(missing)}"
    got = [results[slug]["finetune"]["pretrained"] for slug in ORDERING]
    holds = all(a["median"] > b["median"] for a, b in zip(got, got[1:]))
    # Overlapping seed ranges: the order of the medians may be the seeds' doing, not the architecture's.
    overlap = any(min(a["scores"]) <= max(b["scores"]) for a, b in zip(got, got[1:]))
    shown = " vs ".join(f"{slug} {g['median']:.3f}" for slug, g in zip(ORDERING, got))
    return (f"paper's ordering {' > '.join(ORDERING)} by fine-tuning median: {'holds' if holds else 'does not hold'}"
            f" ({shown}){'; the seed ranges overlap' if overlap else ''}")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("runs/ablation"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--shards", type=Path, help="your own shard dir instead of the built-in corpus")
    parser.add_argument("--task-dir", type=Path, help="your own task (train.jsonl, validation.jsonl: text, label)")
    # pretraining, every variant alike (defaults: the quickstart's recipe, the step count measured for 2 cores)
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    parser.add_argument("--steps", type=bounded(int, min=1), default=STEPS)
    parser.add_argument("--batch", type=bounded(int, min=1), default=64)
    parser.add_argument("--seq-len", type=bounded(int, min=8), default=64)
    parser.add_argument("--lr", type=bounded(float, above=0), default=1e-3)
    parser.add_argument("--ranks", type=bounded(int, min=1), default=None, help="pretraining processes (default: GPUs, or 2 CPU ranks)")
    parser.add_argument("--train-override", action="append", default=[], help="extra trainer key=value (repeatable)")
    # fine-tuning, both inits alike
    parser.add_argument("--protocol", choices=tuple(PROTOCOLS), default="short")
    parser.add_argument("--seeds", type=bounded(int, min=1), default=3)
    parser.add_argument("--finetune-lr", type=bounded(float, above=0), default=1e-3)
    parser.add_argument("--finetune-arg", action="append", default=[], help="extra finetune option (repeatable)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None, help="torch threads for fine-tuning")
    args = parser.parse_args(argv)
    slugs = args.variants.split(",")
    if unknown := [slug for slug in slugs if slug not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; use {', '.join(VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work_dir.resolve()
    shards, task = args.shards, args.task_dir
    if shards is None or task is None:  # the built-in data is built once in WORK/data, only when needed
        built = prepare_data(work / "data", 8000)
        shards, task = shards or built.shards, task or built.task
    results = {}
    for slug in slugs:
        print(f"\n=== {slug}: {VARIANTS[slug][1]}", flush=True)
        results[slug] = run_variant(args, slug, shards.resolve(), task.resolve(), work)
        report = write_reports(args, work, results)  # after every variant: a long run shows its progress
    print("\n" + report)


def write_reports(args, work: Path, results: dict[str, dict]) -> str:
    """WORK/ablation.json and WORK/ablation.md; returns the markdown."""
    report = (f"Budget per variant: {args.steps} steps x {args.batch} samples x {args.seq_len} tokens (preset "
              f"{args.preset}, lr {args.lr}); the FLOPs of a sample differ by architecture. Fine-tuning: protocol "
              f"{args.protocol}, lr {args.finetune_lr}, dev accuracy median [min, max] over {args.seeds} seed(s).\n\n"
              f"{markdown(results)}\n{ordering(results)}\n")
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "variants": results, "ordering": ordering(results),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    (work / "ablation.json").write_text(json.dumps(summary, indent=2) + "\n")
    (work / "ablation.md").write_text(report)
    return report


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
