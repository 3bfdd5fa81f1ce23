"""Checkpoint layout conversion (issue 15): a ZeRO-2 checkpoint of ConvBERT-base ELECTRA -> the universal form.

    python benchmarks/reshape.py [--preset base] [--repeats 2] [--workdir DIR] [--keep] [--pss]
    python benchmarks/reshape.py --preset tiny      # smoke run: same steps on a few-MB model, under a minute

1. Writes a real checkpoint the way the trainer does: ``torchrun --nproc_per_node 2`` ranks (gloo) build
   ``ElectraForPretraining`` of ``ElectraConfig.from_preset(PRESET)`` (the preset's generator, vocabulary
   30,522), ``deepspeed.initialize`` with the DeepSpeed config the trainer builds
   (``ds_configs/zero2_bf16.json`` through ``engine.plan.build_ds_config``, fp32: ZeRO-2, torch AdamW) and
   the trainer's lr schedule (``model.optim.WarmupDecay``), run ONE optimizer step on a random batch (seq 32,
   micro-batch 1; so Adam's moments exist) and save through ``engine.checkpoint.save`` (tag ``step00000001``,
   trainer_state.json, manifest).
2. Measures, each in a fresh process, interleaved over ``--repeats`` rounds (every round starts from no
   output):
   - ``convbert_ds universal.convert``: ``convert(tag_dir, Layout.of_checkpoint(trainer_state), electra)``,
     i.e. ``tag_dir/universal/`` (fp32 weights + Adam moments, safetensors), what the trainer runs when
     it resumes on another layout;
   - ``deepspeed ds_to_universal (baseline)``: DeepSpeed's own offline converter
     (``deepspeed.checkpoint.ds_to_universal.main``, ``--num_extract_workers 2 --num_merge_workers 2
     --inject_missing_state``: our checkpoints carry no Megatron ``universal_checkpoint_info``), which
     forks worker processes and writes one torch file per parameter and quantity.
   "convert s" is the conversion call alone; "wall s" the process's, start-up and imports included.
   Memory (MiB): "imports" is the process's RSS once everything is imported; "peak" the largest RSS of the
   process tree: max(own ``ru_maxrss``, the sum of RSS over the process and its children sampled every
   20 ms); "conv" = peak - imports, what the conversion itself adds; "anon" the sampled peak of RSS less
   file-backed pages (a memory-mapped input's pages are clean page cache, counted in RSS); "child" the
   largest worker's own ``ru_maxrss``. The baseline's forked workers share their parent's pages, which a
   sum of RSS counts once per process: ``--pss`` adds an untimed run of each with the tree's PSS.
   Goals (issue 15): < 60 s and peak memory < 3x the fp32 size of the weights.
3. Checks that both converters produce the same fp32 weights and Adam moments, tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent

OURS, BASELINE, FALLBACK = "convbert_ds universal.convert", "deepspeed ds_to_universal", "deepspeed zero_to_fp32"
TAG, VOCAB, SEQ = "step00000001", 30522, 32
RESULT = "RESULT "  # marks the measured process's one JSON line among the converters' own output


def _env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "2",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


# 1. The checkpoint ------------------------------------------------------------------------------------
def write_rank(checkpoint_dir: Path, preset_name: str) -> NoReturn:
    """One rank of the 2-rank ZeRO-2 save, after one optimizer step (run under torchrun); ends the process."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from convbert_ds.config import ElectraConfig
    from convbert_ds.engine import checkpoint
    from convbert_ds.engine.distributed import exit_process, init_process_group
    from convbert_ds.engine.plan import build_ds_config
    from convbert_ds.formats.train_config import TrainConfig
    from convbert_ds.formats.checkpoint.run_state import RunState
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.optim import WarmupDecay, param_groups

    init_process_group("gloo")
    torch.manual_seed(0)
    electra = ElectraConfig.from_preset(preset_name, vocab_size=VOCAB)
    model = ElectraForPretraining(electra)
    world = dist.get_world_size()
    cfg = TrainConfig.from_dict({"train": dict(global_batch_size=world, micro_batch_size=1, grad_clip=1.0, lr=1e-4,
                                               adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-6, weight_decay=0.01,
                                               warmup_steps=10, steps=100)})
    train = cfg.train
    base = json.loads((REPO / "ds_configs" / "zero2_bf16.json").read_text())
    ds_config = build_ds_config(cfg, base, train.micro_batch_size, 1, "fp32")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, train.weight_decay),
                                      config=ds_config, lr_scheduler=WarmupDecay.of(train))
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    ids = torch.randint(5, VOCAB, (1, SEQ), generator=generator)
    ids[0, 0], ids[0, -1] = 2, 3  # [CLS] ... [SEP]
    out = engine(ids, torch.ones_like(ids), torch.zeros_like(ids))
    engine.backward(out.loss)
    engine.step()
    state = RunState(step=1, data={"consumed_samples": world}, tokens_seen=world * SEQ, samples_seen=world,
                     electra_config=electra.to_dict(), precision="fp32", zero_stage=2, pipeline_stages=1,
                     world_size=world)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.save(engine, checkpoint_dir, 1, state, keep_last=1)
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then


def write_checkpoint(ckpt: Path, preset_name: str) -> float:
    from convbert_ds.engine.distributed import free_port

    start = time.perf_counter()
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", free_port(), __file__,
                           "--write-rank", str(ckpt), "--preset", preset_name], env=_env(), capture_output=True,
                          text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"writing the checkpoint failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


# 2. One conversion, in its own process ----------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(mode: str, tag_dir: Path, out: Path) -> dict:
    """Imports, then one conversion; returns its times and its own memory figures (bytes)."""
    import torch  # noqa: F401  (imported before the RSS baseline, as every converter needs it)

    if mode == OURS:
        from convbert_ds.config import ElectraConfig
        from convbert_ds.formats.checkpoint import run_state
        from convbert_ds.formats.checkpoint.universal import Layout, convert

        state = run_state.read(tag_dir)
        layout, electra = Layout.of_checkpoint(state), ElectraConfig(**state.electra_config)
        work = lambda: convert(tag_dir, layout, electra)  # noqa: E731
    elif mode == BASELINE:
        from deepspeed.checkpoint import ds_to_universal

        args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=2,
                                  num_merge_workers=2, keep_temp_folder=False, strict=True, inject_missing_state=True)
        work = lambda: ds_to_universal.main(args)  # noqa: E731
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        work = lambda: get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)  # noqa: E731
    imports_rss, imports_max = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    return {"convert_s": seconds, "imports_rss": imports_rss, "imports_maxrss": imports_max,
            "self_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def _sample_tree(pid: int, peaks: dict, stop: threading.Event, pss: bool) -> None:
    """Largest sums of RSS, of its anonymous part (RSS less file-backed pages such as a memory-mapped
    input's) and, with ``pss``, of PSS, over the process and its children."""
    import psutil

    root = psutil.Process(pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
            infos = [p.memory_info() for p in procs]  # statm: cheap
            peaks["rss"] = max(peaks["rss"], sum(i.rss for i in infos))
            peaks["anon"] = max(peaks["anon"], sum(i.rss - i.shared for i in infos))  # less file-backed pages
            if pss:  # reads smaps_rollup: walks every page table, and slows the process it watches
                peaks["pss"] = max(peaks["pss"], sum(p.memory_full_info().pss for p in procs))
        except psutil.Error:  # a worker came or went between the listing and the read
            pass
        stop.wait(0.2 if pss else 0.02)


def measure(mode: str, tag_dir: Path, out: Path, pss: bool = False) -> dict:
    """Runs ``run_one`` in a fresh process from no output; returns its figures, or {"error": ...}."""
    if mode == OURS:
        shutil.rmtree(tag_dir / "universal", ignore_errors=True)
    else:  # the baseline also writes ``latest_universal`` beside ``out``
        shutil.rmtree(out.parent, ignore_errors=True)
        out.parent.mkdir(parents=True)
    peaks, stop = {"rss": 0, "anon": 0, "pss": 0}, threading.Event()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--run-one", mode, str(tag_dir), str(out)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    sampler = threading.Thread(target=_sample_tree, args=(proc.pid, peaks, stop, pss), daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (stderr.strip() or stdout.strip()).splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return {"error": tail[0][:300], "log": (stdout[-2000:], stderr[-4000:])}
    result = json.loads(lines[-1][len(RESULT):])
    result["peak"] = max(result["self_maxrss"], peaks["rss"])
    return {**result, "wall_s": wall, "tree_rss": peaks["rss"], "tree_anon": peaks["anon"], "tree_pss": peaks["pss"],
            "load": os.getloadavg()[0]}


# 3. Do both converters agree? -------------------------------------------------------------------------
def compare(tag_dir: Path, ds_out: Path) -> str:
    """Max abs difference per quantity between our universal files and DeepSpeed's ``zero/NAME/QUANTITY.pt``
    (DeepSpeed also writes a tied twin's fp32 weights under the twin's name: compared too)."""
    import torch
    from safetensors.torch import load_file

    from convbert_ds.config import ElectraConfig
    from convbert_ds.formats.checkpoint import run_state
    from convbert_ds.formats.checkpoint.names import canonical_names
    from convbert_ds.formats.checkpoint.universal import QUANTITIES

    electra = ElectraConfig(**run_state.read(tag_dir).electra_config)
    canonical = canonical_names(electra)
    worst, covered = {}, {}
    for quantity in QUANTITIES:
        ours = load_file(str(tag_dir / "universal" / f"{quantity}.safetensors"))
        worst[quantity], covered[quantity] = 0.0, set()
        for param_dir in sorted(p for p in (ds_out / "zero").iterdir() if p.is_dir()):
            if not (param_dir / f"{quantity}.pt").is_file():
                continue
            name = canonical[param_dir.name]
            theirs = torch.load(param_dir / f"{quantity}.pt", weights_only=False)["param"]
            worst[quantity] = max(worst[quantity], (ours[name] - theirs.reshape(ours[name].shape)).abs().max().item())
            covered[quantity].add(name)
        if covered[quantity] != set(ours):
            return f"DeepSpeed's {quantity} lacks {sorted(set(ours) - covered[quantity])[:3]} of ours"
    figures = ", ".join(f"{q} {v:.1e}" for q, v in worst.items())
    return f"check: ours vs DeepSpeed's output, all {len(covered['fp32'])} tensors: max abs difference {figures}"


# Report -----------------------------------------------------------------------------------------------
def _mib(n: float) -> float:
    return n / 2**20


def _row(mode: str, r: dict, size: float) -> str:
    conv = _mib(r["peak"] - r["imports_rss"])
    return (f"{mode:34s} {r['convert_s']:9.2f} {r['wall_s']:7.2f} {_mib(r['imports_rss']):8.0f} "
            f"{_mib(r['peak']):8.0f} {conv:8.0f} {conv / size:7.2f} {_mib(r['peak']) / size:7.2f} "
            f"{_mib(r['tree_anon']):8.0f} {_mib(r['children_maxrss']):8.0f}")


def main(argv: list[str] | None = None) -> int:
    from convbert_ds.config import PRESET_NAMES
    from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error

    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base", choices=PRESET_NAMES,
                        help="the discriminator preset (tiny: a smoke run)")
    parser.add_argument("--repeats", type=bounded(int, min=1), default=2, help="rounds of each converter (best and all reported)")
    parser.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temporary "
                        "directory, deleted at the end); an existing checkpoint there is reused")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--pss", action="store_true", help="also one untimed run of each with the tree's PSS sampled "
                        "(shared pages counted once; reading it slows the process watched, hence untimed)")
    parser.add_argument("--run-one", nargs=3, metavar=("MODE", "TAG_DIR", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--write-rank", metavar="CKPT", help=argparse.SUPPRESS)
    return exit_on_user_error(lambda: _main(parser.parse_args(argv)))


def _main(args) -> None:
    if args.run_one:
        result = run_one(args.run_one[0], Path(args.run_one[1]), Path(args.run_one[2]))
        print(RESULT + json.dumps(result), flush=True)
        return
    if args.write_rank:
        write_rank(Path(args.write_rank), args.preset)
        return
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="reshape-bench-"))
    try:
        _benchmark(args, work)
    finally:
        if not (args.keep or args.workdir):
            shutil.rmtree(work, ignore_errors=True)


def _benchmark(args, work: Path) -> None:
    import deepspeed
    import torch

    from convbert_ds.config import ElectraConfig
    from convbert_ds.model import ElectraForPretraining

    ckpt, tag_dir, ds_out = work / "checkpoints", work / "checkpoints" / TAG, work / "ds_universal" / TAG
    print(f"CPU: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} | torch {torch.__version__} | "
          f"deepspeed {deepspeed.__version__} | preset {args.preset}, vocab {VOCAB}", flush=True)
    if not (tag_dir / "trainer_state.json").is_file():
        seconds = write_checkpoint(ckpt, args.preset)
        print(f"wrote a 2-rank ZeRO-2 fp32 checkpoint after one optimizer step in {seconds:.1f} s", flush=True)
    files = {p.name: p.stat().st_size for p in sorted(tag_dir.iterdir()) if p.is_file()}
    print(f"checkpoint {TAG}: {_mib(sum(files.values())):.0f} MiB on disk: "
          + ", ".join(f"{n} {_mib(s):.0f} MiB" for n, s in files.items() if s > 2**20), flush=True)
    with torch.device("meta"):
        model = ElectraForPretraining(ElectraConfig.from_preset(args.preset, vocab_size=VOCAB))
    params = sum(p.numel() for p in model.parameters())
    size = _mib(params * 4)
    print(f"model: {params / 1e6:.1f} M parameters (discriminator and generator, shared embeddings once); "
          f"fp32 size {size:.0f} MiB\n", flush=True)

    modes, rows, errors = [OURS, BASELINE], {OURS: [], BASELINE: []}, {}
    for round_ in range(1, args.repeats + 1):
        for mode in list(modes):
            r = measure(mode, tag_dir, ds_out)
            if "error" in r and mode == BASELINE:  # DeepSpeed's converter cannot read it: the weights-only one
                errors[mode] = r["error"]
                print(f"  {BASELINE} failed on this checkpoint: {r['error']}\n  baseline from now on: {FALLBACK} "
                      "(weights only, in memory, nothing written)", flush=True)
                modes[modes.index(BASELINE)] = FALLBACK
                rows[FALLBACK] = []
                mode, r = FALLBACK, measure(FALLBACK, tag_dir, ds_out)
            if "error" in r:
                raise SystemExit(f"{mode} failed: {r['error']}\n{r['log'][0]}\n{r['log'][1]}")
            rows[mode].append(r)
            print(f"  round {round_}: {mode:34s} convert {r['convert_s']:6.2f} s  wall {r['wall_s']:6.2f} s  "
                  f"peak RSS {_mib(r['peak']):6.0f} MiB (imports {_mib(r['imports_rss']):4.0f}, anonymous "
                  f"{_mib(r['tree_anon']):4.0f})  (load {r['load']:.1f})", flush=True)
        if round_ == args.repeats and BASELINE in modes:
            print("  " + compare(tag_dir, ds_out), flush=True)
    _report(modes, rows, size, args.repeats, args.preset)
    if errors:
        print(f"\n{BASELINE} could not run: {errors[BASELINE]}")
    if args.pss:
        pss = {mode: _mib(measure(mode, tag_dir, ds_out, pss=True)["tree_pss"]) for mode in modes}
        print("peak PSS (one more, untimed run each; shared pages counted once): "
              + ", ".join(f"{mode} {v:.0f} MiB ({v / size:.2f}x)" for mode, v in pss.items()))


def _report(modes: list[str], rows: dict, size: float, repeats: int, preset_name: str) -> None:
    best = {m: min(rows[m], key=lambda r: r["convert_s"]) for m in modes}
    print(f"\nbest of {repeats} (by conversion time; memory of that run; MiB; x = / fp32 size {size:.0f} MiB):")
    print(f"{'converter':34s} {'convert s':>9s} {'wall s':>7s} {'imports':>8s} {'peak':>8s} {'conv':>8s} "
          f"{'conv x':>7s} {'peak x':>7s} {'anon':>8s} {'child':>8s}")
    for mode in modes:
        print(_row(mode, best[mode], size))
    ours, theirs = best[OURS], best[modes[1]]
    conv = {m: best[m]["peak"] - best[m]["imports_rss"] for m in modes}
    print(f"ours / {modes[1]}: conversion time {ours['convert_s'] / theirs['convert_s']:.2f}, wall "
          f"{ours['wall_s'] / theirs['wall_s']:.2f}, peak RSS {ours['peak'] / theirs['peak']:.2f}, conversion's own "
          f"memory {conv[OURS] / conv[modes[1]]:.2f}, anonymous {ours['tree_anon'] / theirs['tree_anon']:.2f}")
    print("(conv = peak - imports; anon = peak of RSS less file-backed pages, e.g. memory-mapped inputs; child = "
          "largest ru_maxrss of a worker process. The tree sums count pages that forked workers share with "
          "their parent once per process: --pss measures without that)")
    if preset_name != "base":
        print("goals: set for the base preset (this run shows the fixed costs only)")
        return
    worst_s = max(r["convert_s"] for r in rows[OURS])
    worst_conv = max(_mib(r["peak"] - r["imports_rss"]) for r in rows[OURS])
    worst_peak = max(_mib(r["peak"]) for r in rows[OURS])
    print(f"goals (worst of our {repeats} runs): conversion < 60 s -> {worst_s:.1f} s "
          f"({'met' if worst_s < 60 else 'MISSED'}); memory < 3 x {size:.0f} = {3 * size:.0f} MiB -> conversion's own "
          f"{worst_conv:.0f} MiB ({worst_conv / size:.2f}x, {'met' if worst_conv < 3 * size else 'MISSED'}), "
          f"whole process {worst_peak:.0f} MiB ({worst_peak / size:.2f}x, "
          f"{'met' if worst_peak < 3 * size else 'MISSED'})")


if __name__ == "__main__":
    sys.exit(main())
