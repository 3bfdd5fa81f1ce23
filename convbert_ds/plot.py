"""Render a run's loss curves (and its downstream scores, with ``eval.downstream``) to a PNG.

    python -m convbert_ds.plot LOG_DIR [--out curves.png]

LOG_DIR holds the ``metrics.jsonl`` the trainer writes (``log.dir``, by default
``logs/`` next to the checkpoint directory).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from convbert_ds.cli import ArgumentParser, exit_on_user_error
from convbert_ds.errors import UserError
from convbert_ds.log import get_logger

log = get_logger(__name__)

PANELS = (("loss", "total loss"), ("mlm_loss", "generator MLM loss"), ("rtd_loss", "discriminator RTD loss"),
          ("rtd_accuracy", "RTD accuracy"))


def read_metrics(log_dir: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``; a line that is not one (a run killed mid-write leaves a torn last line;
    an edit, anything) is skipped with one warning: a plot of what is readable beats none."""
    path = log_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found: pass the run's log.dir (it holds metrics.jsonl)")
    rows, skipped = [], []
    for number, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and _number(row.get("step")):
            rows.append(row)
        else:
            skipped.append(number)
    if skipped:
        log.warning(f"warning: {path}: skipped {len(skipped)} line(s) that are not metrics rows (line {skipped[0]}"
                    f"{' and others' if len(skipped) > 1 else ''})")
    if not rows:
        raise UserError(f"{path} holds no metrics rows: pass the log.dir of a run that has logged a step")
    return rows


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot(log_dir: Path, out: Path) -> Path:
    import matplotlib  # here: slow to import, and it must be switched to Agg before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(log_dir)
    downstream = [r for r in rows if r.get("split") == "downstream" and _number(r.get("score"))]
    fig, axes = plt.subplots(2, 3 if downstream else 2, figsize=(16 if downstream else 11, 7))
    if downstream:
        _plot_downstream(axes[0, 2], downstream)
        axes[1, 2].axis("off")
    for ax, (key, title) in zip([a for a in axes.flat if not a.has_data() and a.axison], PANELS):
        for split, style in (("train", "-"), ("valid", "o-")):
            points = [(r["step"], r[key]) for r in rows if r.get("split") == split and _number(r.get(key))]
            if points:
                ax.plot(*zip(*points), style, label=split, markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(str(log_dir))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _plot_downstream(ax, rows: list[dict]) -> None:
    """The probe's score per checkpoint, against the random-init baseline: does pretraining transfer?"""
    rows = sorted(rows, key=lambda r: r["step"])
    ax.plot([r["step"] for r in rows], [r["score"] for r in rows], "o-", label="pretrained", markersize=4)
    baseline = next((r["random_init"] for r in rows if _number(r.get("random_init"))), None)
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", label="random init")
    ax.set_title("downstream score (fine-tuned)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", type=Path, help="the run's log.dir (it holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (None: LOG_DIR/curves.png)")
    args = parser.parse_args(argv)
    print(f"wrote {plot(args.log_dir, args.out or args.log_dir / 'curves.png')}")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
