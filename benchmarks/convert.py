"""Checkpoint conversion on CPU: a base-sized ELECTRA checkpoint, ZeRO-2 over 2 ranks -> transformers.

    python benchmarks/convert.py [--repeats 3] [--workdir DIR] [--verify]

1. Writes the checkpoint with a real 2-rank DeepSpeed save (``torchrun``, gloo, no training step):
   ``ElectraForPretraining`` of ``preset("base")`` (discriminator ~106M parameters + the 1/3-width
   generator), ZeRO-2, fp32, through ``convbert_ds.engine.checkpoint.save`` (the trainer's layout), with a
   30,522-token WordPiece tokenizer.
2. Measures, each in a fresh process, interleaved over ``--repeats`` rounds (medians reported):
   - ``zero_to_fp32 (baseline)``: DeepSpeed's own ``convert_zero_checkpoint_to_fp32_state_dict`` to one
     ``pytorch_model.bin`` (its safetensors option refuses ELECTRA's tied embeddings), the bare
     consolidation every converter starts with;
   - ``convbert_ds.convert``: ``python -m convbert_ds.convert --checkpoint ... --out ...`` (both HF dirs,
     RTD head, tokenizer files, model card); with ``--verify`` also a run that verifies.
   Wall time is the process's, start-up and imports included; peak RSS is the process's own
   ``ru_maxrss`` (exact). Goals: < 60 s and peak RSS < 3x the fp32 size of the checkpoint's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error

REPO = Path(__file__).resolve().parent.parent
BASELINE, OURS, VERIFY = "zero_to_fp32 (baseline)", "convbert_ds.convert", "convbert_ds.convert --verify"
VOCAB = 30522


def _env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "2",
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def write_tokenizer(directory: Path) -> None:
    import transformers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = specials + letters + [f"##{c}" for c in letters]
    vocab += [f"w{i}" for i in range(VOCAB - len(vocab))]
    transformers.ConvBertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(str(directory))


def write_checkpoint_rank(checkpoint_dir: Path, tokenizer_dir: Path) -> NoReturn:
    """One rank of the 2-rank save (run under torchrun); ends the process."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from convbert_ds.engine.distributed import exit_process, init_process_group
    from convbert_ds.engine import checkpoint
    from convbert_ds.config import ElectraConfig
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.formats.checkpoint.run_state import RunState
    from convbert_ds.model.optim import param_groups
    from preprocessing.tokenizer import load_tokenizer

    init_process_group("gloo")
    torch.manual_seed(0)
    electra = ElectraConfig.from_preset("base")
    model = ElectraForPretraining(electra)
    ds_config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
                 "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01), config=ds_config)
    tok = load_tokenizer(tokenizer_dir)
    state = RunState(step=0, data={"consumed_samples": 0}, electra_config=electra.to_dict(), precision="fp32",
                     zero_stage=2, pipeline_stages=1, world_size=dist.get_world_size(),
                     tokenizer={"dir": str(tokenizer_dir), **tok.describe()})
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.save(engine, checkpoint_dir, 0, state, keep_last=1)
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then


def run_one(mode: str, checkpoint_dir: Path, out: Path) -> dict:
    """In a fresh process: one conversion; returns its own peak RSS."""
    start = time.perf_counter()
    if mode == BASELINE:
        import contextlib
        import io

        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            # torch.save: DeepSpeed's safetensors path refuses the tied embeddings ("tensors share memory").
            convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint_dir), str(out), safe_serialization=False,
                                                       tag="step00000000", max_shard_size=None)
    else:
        from convbert_ds.convert.__main__ import main

        args = ["--checkpoint", str(checkpoint_dir), "--out", str(out), "--force"]
        if mode == VERIFY:
            args.append("--verify")
        if main(args) != 0:
            raise SystemExit(1)
    return {"inner_s": time.perf_counter() - start,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(mode: str, checkpoint_dir: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--run-one", mode, str(checkpoint_dir), str(out)], env=_env(),
                          capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **result, "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    from convbert_ds.engine.distributed import free_port

    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=bounded(int, min=1), default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--verify", action="store_true", help="also time a conversion with --verify")
    parser.add_argument("--run-one", nargs=3, metavar=("MODE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--write-rank", nargs=2, metavar=("CKPT", "TOKENIZER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        print(json.dumps(run_one(args.run_one[0], Path(args.run_one[1]), Path(args.run_one[2]))))
        return
    if args.write_rank:
        write_checkpoint_rank(Path(args.write_rank[0]), Path(args.write_rank[1]))
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    ckpt, tokenizer = work / "checkpoints", work / "tokenizer"
    if not (ckpt / "latest").is_file():
        write_tokenizer(tokenizer)
        start = time.perf_counter()
        torchrun = Path(sys.executable).parent / "torchrun"
        done = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", free_port(), __file__,
                               "--write-rank", str(ckpt), str(tokenizer)], env=_env(), capture_output=True, text=True,
                              cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"writing the checkpoint failed:\n{done.stderr[-4000:]}")
        print(f"wrote a 2-rank ZeRO-2 checkpoint in {time.perf_counter() - start:.1f} s: {ckpt}")
    tag_dir = ckpt / "step00000000"
    files = sorted(p.name for p in tag_dir.iterdir())
    print("files: " + ", ".join(f"{n} ({(tag_dir / n).stat().st_size / 2**20:.0f} MiB)" for n in files))


    modes = [BASELINE, OURS] + ([VERIFY] if args.verify else [])
    rows = {m: [] for m in modes}
    for round_ in range(1, args.repeats + 1):
        for mode in modes:
            r = measure(mode, ckpt, work / "out")
            rows[mode].append(r)
            print(f"  round {round_}: {mode:30s} {r['wall_s']:6.2f} s  (conversion {r['inner_s']:5.2f} s)  "
                  f"peak RSS {r['peak_rss_mb']:6.0f} MiB  (load {r['load']:.1f})", flush=True)
    total, disc = _checkpoint_params(ckpt)
    size_mb = total * 4 / 2**20
    print(f"\nparameters: {total / 1e6:.1f} M in the checkpoint (discriminator body {disc / 1e6:.1f} M); "
          f"fp32 size {size_mb:.0f} MiB\n")
    print(f"medians of {args.repeats} rounds:")
    print(f"{'method':32s} {'wall s':>7s} {'convert s':>9s} {'vs baseline':>11s} {'peak RSS MiB':>12s} {'x fp32':>7s}")
    base = statistics.median(r["wall_s"] for r in rows[BASELINE])
    for mode in modes:
        wall = statistics.median(r["wall_s"] for r in rows[mode])
        inner = statistics.median(r["inner_s"] for r in rows[mode])
        rss = statistics.median(r["peak_rss_mb"] for r in rows[mode])
        print(f"{mode:32s} {wall:7.2f} {inner:9.2f} {wall / base:11.2f} {rss:12.0f} {rss / size_mb:7.2f}")
    ours_wall = statistics.median(r["wall_s"] for r in rows[OURS])
    ours_rss = max(r["peak_rss_mb"] for r in rows[OURS])
    print(f"\ngoals: wall < 60 s -> {ours_wall:.1f} s ({'met' if ours_wall < 60 else 'MISSED'}); "
          f"peak RSS < 3 x {size_mb:.0f} MiB = {3 * size_mb:.0f} MiB -> {ours_rss:.0f} MiB (worst round, "
          f"{ours_rss / size_mb:.2f}x, {'met' if ours_rss < 3 * size_mb else 'MISSED'})")


def _checkpoint_params(ckpt: Path) -> tuple[int, int]:
    """(all parameters of the checkpoint's model, the discriminator body's)."""
    import torch

    from convbert_ds.convert import open_checkpoint
    from convbert_ds.model import ElectraForPretraining

    with torch.device("meta"):
        model = ElectraForPretraining(open_checkpoint(ckpt).electra)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.discriminator.convbert.parameters())


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
