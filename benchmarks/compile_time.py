"""How long the whole ELECTRA step takes to compile (``train.compile_mode: step``): every encoder layer
unrolled into the step's graph, against each layer width compiled once and reused
(``train.compile_layers_once``, ``compile_step(layers_once=True)``), and against the unrolled step again
as a restart on another node compiles it: with the compile cache file the first variant wrote loaded
(``train.compile_cache``, ``convbert_ds/engine/compile_cache.py``).

    python benchmarks/compile_time.py                     # CUDA: base, 128 x 128, bf16 autocast; CPU: small, 2 x 128
    python benchmarks/compile_time.py --preset tiny --layers 6 --batch 2 --seq 64 --threads 2
    python benchmarks/compile_time.py --variants unrolled,cached   # the compile cache file's saving alone

Each variant runs in a process of its own whose inductor cache directory starts empty, one after the
other, on the same seeded model and batch (three packed documents a sample, as the trainer packs them). A
variant past ``--timeout`` is stopped with every process it started, and where it stood is printed. The
first step's forward and backward are timed apart: each includes its compile (tracing and the forward
graph, then the backward graph at the first backward; the cache file's load counts in the forward). The
next step is timed too, compiled. The ratio is each variant's first step over the unrolled one's; the last
column counts the graphs inductor found in its caches (only the file can have put them there). All
variants should compute the same first loss (they draw the same dropout and masks); the largest
difference from the first is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/compile_time.py` finds common

from benchmarks.common import three_documents_per_sample  # noqa: E402
from benchmarks.gpu.limited_run import run_group, where_it_stopped  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES, ElectraConfig  # noqa: E402

# --variants name -> (the table's label, layers_once, what the variant does with the compile cache file: write
# it, nothing, or load it). The first is the baseline of the ratios; "cached" loads the file "unrolled" wrote.
VARIANTS = {"unrolled": ("unrolled (every layer in the graph)", False, "write"),
            "once": ("layers once (one per width)", True, None),
            "cached": ("unrolled, the compile cache file loaded", False, "load")}


def variant_names(text: str) -> list[str]:
    """``--variants``: names of ``VARIANTS``, comma-separated, in the table's order; "unrolled" always runs."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    return [name for name in VARIANTS if name == "unrolled" or name in names]


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(args, layers_once: bool, cache: str | None) -> dict:
    """One variant, in this process: seconds of the first forward and backward (compiling, after loading
    ``args.cache_file`` when ``cache`` is ``load``), milliseconds of the next step, and the first step's loss;
    ``cache`` ``write``: the cache file written after the first step."""
    from convbert_ds.engine.compile_cache import built_artifacts, inductor_cache_use, load_artifacts
    from convbert_ds.fsutil import write_bytes_atomically
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.layers import compile_step, probe_triton_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    config = ElectraConfig.from_preset(args.preset, vocab_size=args.vocab, max_position_embeddings=args.seq,
                                       **overrides)
    model = ElectraForPretraining(config).to(device)
    if cuda:  # as the trainer does: sdconv_impl=auto decides by running the kernels, before any tracing
        probe_triton_kernels(model, device, torch.bfloat16)
    compile_step(model, cuda_graphs=False, layers_once=layers_once)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    documents = three_documents_per_sample(args.batch, args.seq, device)
    inputs = (input_ids, torch.ones_like(input_ids), torch.zeros_like(input_ids))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    times, losses = [], []
    load_start = time.perf_counter()  # the file's load counts in the first forward: a restart pays it
    if cache == "load" and load_artifacts(args.cache_file) is None:
        sys.exit(f"error: no compile cache file at {args.cache_file} to load")
    load_s = time.perf_counter() - load_start
    for step in range(2):
        torch.manual_seed(100 + step)
        _synchronize(cuda)
        start = time.perf_counter()
        with autocast:
            out = model(*inputs, check=False, document_ids=documents)
        _synchronize(cuda)
        middle = time.perf_counter()
        out.loss.backward()
        _synchronize(cuda)
        times.append((middle - start, time.perf_counter() - middle))
        losses.append(out.loss.item())
        model.zero_grad(set_to_none=True)
        if cache == "write" and step == 0:
            write_bytes_atomically(args.cache_file, built_artifacts())
    return {"graphs_cached": inductor_cache_use()[0],
            "forward_s": load_s + times[0][0], "backward_s": times[0][1], "next_step_ms": 1e3 * sum(times[1]),
            "loss": losses[0], "layers": config.discriminator.num_hidden_layers,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "threads": torch.get_num_threads()}


def run_variant(argv: list[str], name: str, timeout_s: float) -> dict:
    """``measure`` of variant ``name`` in a fresh process with empty compile caches: its result, or exit with
    its output."""
    with tempfile.TemporaryDirectory(prefix="compile_time_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        command = [sys.executable, __file__, *argv, "--child", name]
        # Stopped at the limit with its compile workers, its stack printed (where the compile stood).
        code, stdout, stderr = run_group(command, env, timeout_s)
    if code == 124:
        sys.exit(f"error: {name} did not finish within --timeout {timeout_s:.0f} s; give it more, or a smaller "
                 "--preset/--layers; it was in:\n" + "\n".join(where_it_stopped(stdout + stderr)))
    if code != 0:
        sys.exit(f"error: the variant's process exited with {code}:\n{stdout[-3000:]}{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base" if cuda else "small")
    parser.add_argument("--layers", type=bounded(int, min=1), default=None,
                        help="encoder layers per body (default: the preset's, 12)")
    parser.add_argument("--batch", type=bounded(int, min=1), default=128 if cuda else 2)
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--vocab", type=bounded(int, min=8), default=30522)
    parser.add_argument("--threads", type=bounded(int, min=1), default=None)
    parser.add_argument("--timeout", type=bounded(float, above=0), default=1800.0,
                        help="seconds each variant may take (default 1800)")
    parser.add_argument("--variants", type=variant_names, default=list(VARIANTS),
                        help=f"which to time, comma-separated (default: all, {','.join(VARIANTS)}); unrolled, the "
                             "baseline, always runs")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)  # internal: one variant
    parser.add_argument("--cache-file", type=Path, help=argparse.SUPPRESS)  # internal: the variants' file
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args, *VARIANTS[args.child][1:])))
        return
    own = sys.argv[1:] if argv is None else list(argv)
    with tempfile.TemporaryDirectory(prefix="compile_cache_") as kept:
        own += ["--cache-file", str(Path(kept) / "step.bin")]
        results = {VARIANTS[name][0]: run_variant(own, name, args.timeout) for name in args.variants}
    first = next(iter(results.values()))
    print(f"device={first['device']} preset={args.preset} layers={first['layers']} batch={args.batch} "
          f"seq={args.seq} precision={'bf16 autocast' if cuda else 'fp32'} threads={first['threads']} "
          "caches=empty")
    losses = [result["loss"] for result in results.values()]
    worst = max(abs(loss - losses[0]) for loss in losses) / max(abs(losses[0]), 1e-12)
    print(f"the first step's losses: {', '.join(f'{loss:.6f}' for loss in losses)} "
          f"(largest relative difference {worst:.1e})")
    baseline_s = first["forward_s"] + first["backward_s"]
    print(f"{'variant':<42}{'forward (s)':>12}{'backward (s)':>13}{'first step (s)':>15}{'/ unrolled':>11}"
          f"{'next step (ms)':>16}{'graphs from cache':>19}")
    for name, result in results.items():
        total = result["forward_s"] + result["backward_s"]
        print(f"{name:<42}{result['forward_s']:>12.1f}{result['backward_s']:>13.1f}{total:>15.1f}"
              f"{total / baseline_s:>11.2f}{result['next_step_ms']:>16.1f}{result['graphs_cached']:>19}")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
