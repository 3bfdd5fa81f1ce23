"""How long a checkpoint save stops the step loop: saves waited for against saves in the background
(``checkpoint.background``), side by side in one command.

    python benchmarks/background_save.py                          # base preset, 2 CPU ranks, ZeRO-2
    python benchmarks/background_save.py --preset tiny --steps 7  # a quick look

Both variants train the same run under the ``deepspeed`` launcher (the built-in corpus, fp32, ZeRO-2,
``--steps`` steps, a checkpoint every ``--interval``), one after the other, and the trainer's own lines are
read back: "the step loop waited S s" for each interval save, and for a background save how long it took
from its start. The run's last save is always waited for and is not counted. Prints, per variant, each
interval save's blocked seconds and their median, the run's wall time (the trainer's summary), and the
background/waited ratio of the medians. On a machine whose cores the ranks already fill (CPU training), the
background thread's writing and hashing slows the steps it overlaps: the blocked time moves into them, and
the wall time says how much of it is won; on GPU nodes the thread uses host cores the step leaves idle.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/background_save.py`

from benchmarks.common import build_shards  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES  # noqa: E402
from convbert_ds.engine.distributed import free_port  # noqa: E402
from convbert_ds.errors import UserError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WAITED = re.compile(r"(?:saving|saved) checkpoint \S+step(\d+)(?: in the background)? "
                    r"\(the step loop waited ([\d.]+) s\)")
WALL = re.compile(r"summary \|.*\| wall (\d+):(\d+):(\d+) \|")
TOOK = re.compile(r"saved checkpoint \S+step(\d+) \(in the background: ([\d.]+) s from its start\)")


def run_variant(args, shards: Path, work: Path, background: bool) -> dict:
    """One run; {step: blocked seconds} and {step: seconds the background save took} of its interval saves."""
    run = work / ("background" if background else "waited")
    shutil.rmtree(run, ignore_errors=True)  # a run of its own every time: a kept one would only resume
    command = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", free_port(),
               "--module", "convbert_ds.train", "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
               f"data.sets=[{{path: '{shards}', weight: 1.0}}]", f"checkpoint.dir={run / 'checkpoints'}",
               f"log.dir={run / 'logs'}", f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
               "train.global_batch_size=2", "train.micro_batch_size=1", f"train.steps={args.steps}",
               "train.warmup_steps=1", f"checkpoint.interval={args.interval}", "checkpoint.keep_last=2",
               "eval.interval=0", "log.interval=1", "deepspeed.config=ds_configs/zero2_bf16.json",
               "train.precision=fp32", f"checkpoint.background={'true' if background else 'false'}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    output = result.stdout + result.stderr
    (work / f"{run.name}.log").write_text(output)
    if result.returncode != 0:
        raise UserError(f"the {run.name} run exited with {result.returncode}; its log: {work / run.name}.log\n"
                        + output[-3000:])
    interval_save = lambda step: step % args.interval == 0 and step < args.steps  # noqa: E731
    waited = {int(s): float(t) for s, t in WAITED.findall(output) if interval_save(int(s))}
    took = {int(s): float(t) for s, t in TOOK.findall(output) if interval_save(int(s))}
    hours, minutes, seconds = (int(part) for part in WALL.search(output).groups())
    return {"waited": waited, "took": took, "wall": 3600 * hours + 60 * minutes + seconds}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base")
    parser.add_argument("--steps", type=bounded(int, min=3), default=7)
    parser.add_argument("--interval", type=bounded(int, min=1), default=2)
    parser.add_argument("--seq-len", type=bounded(int, min=8), default=128)
    parser.add_argument("--vocab", type=bounded(int, min=100), default=8000, help="the built-in corpus' tokenizer")
    parser.add_argument("--work-dir", type=Path, help="keeps the shards, runs and logs (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.interval >= args.steps:
        parser.error(f"--interval {args.interval}: no interval save before the run's last step {args.steps}; "
                     "give it fewer than --steps")
    with tempfile.TemporaryDirectory(prefix="background_save_") as temporary:
        work = (args.work_dir or Path(temporary)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        shards = work / "shards" if (work / "shards" / "manifest.json").exists() else build_shards(work, args.vocab)
        results = {name: run_variant(args, shards, work, name == "background") for name in ("waited", "background")}
    print(f"preset={args.preset} ranks=2 zero=2 fp32 seq_len={args.seq_len} steps={args.steps} "
          f"interval={args.interval} (interval saves at steps {sorted(results['waited']['waited'])})")
    medians = {}
    for name, result in results.items():
        blocked = result["waited"]
        medians[name] = statistics.median(blocked.values())
        took = f", each took {statistics.median(result['took'].values()):.2f} s in all" if result["took"] else ""
        print(f"{name:<11} the step loop waited per save: "
              f"{', '.join(f'{blocked[s]:.2f}' for s in sorted(blocked))} s (median {medians[name]:.2f} s{took}); "
              f"the run's wall time {result['wall']} s")
    print(f"background / waited: {medians['background'] / medians['waited']:.1%} of the blocked time")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
