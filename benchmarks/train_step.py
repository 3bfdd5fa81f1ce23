"""Training-step cost of our DeepSpeed engine vs a plain PyTorch loop vs transformers' ConvBERT, same batches.

One process, one rank. Three rows, each an ELECTRA step (generator MLM + 50 x replaced-token detection,
AdamW, gradient clipping at 1.0) on the same batches from the real data path (standard-library
docstrings, tokenizer, shards, packing), steps alternating A B C A B C so machine noise hits all alike:

* ``plain PyTorch``: our model in a plain loop, ``torch.optim.AdamW(fused=True)`` where the device has it;
* ``DeepSpeed engine``: our model through ``deepspeed.initialize`` with the DeepSpeed config the trainer
  builds (``engine.plan.build_ds_config`` over ``ds_configs/NAME.json``, precision overridden) and stepped
  as the trainer steps it (``engine/optimizer_step.py``);
* ``transformers ConvBERT``: transformers' own classes in the same plain loop (``HFElectra``, in
  ``benchmarks/common.py``), same sizes, same starting weights, same masks.

Prints median step time, samples/s, TFLOP/s and MFU per row (FLOPs of the model, the same for all rows),
the ratios of the medians, then the ops (about one kernel launch each) and host-device syncs of one more
step per row, forward+backward and optimizer step apart (``convbert_ds.model.op_count``). With
``--precision bf16`` each loop runs its usual recipe: DeepSpeed's (bf16 weights, fp32 master copy in the
optimizer; with ``--ds-config zero0_autocast_bf16``, the plain loops' own) against the plain loops'
``torch.autocast`` over fp32 weights. Batches are checked on the host
(``check_inputs``) and our model is called with ``check=False``, as the trainer does.

    python benchmarks/train_step.py [--preset small] [--batch 16] [--seq 128] [--steps 20] [--threads 1]
    python benchmarks/train_step.py --preset base --batch 64 --seq 128 --precision bf16   # on a GPU
    python benchmarks/train_step.py --preset base --batch 2 --seq 128 --counts-only --threads 1   # CPU: counts

``--compile`` puts every row's encoder layers through torch.compile (``train.compile_mode: layers``);
``--compile-step`` our two rows' whole step (``train.compile_mode: step``, inductor's CUDA graphs on a GPU)
and the transformers row's model through plain torch.compile (graph breaks allowed: transformers' code has
them). ``--capture`` (CUDA only) captures our two rows' forward and backward by hand as CUDA graphs
(``train.cuda_graphs: capture``), eager or compiled (then without inductor's graphs); the transformers row
is left as a user would run it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.config import PRESET_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/train_step.py` finds common

from benchmarks.common import HFElectra, build_shards, compile_hf_layers, electra_config  # noqa: E402

PLAIN, ENGINE, HF = "plain PyTorch", "DeepSpeed engine", "transformers ConvBERT"
ROW_NAMES = {"plain": PLAIN, "engine": ENGINE, "transformers": HF}  # --rows
# --ds-config: the files a plain (not pipelined) engine runs
ENGINE_DS_CONFIGS = sorted(path.stem for path in (Path(__file__).resolve().parent.parent / "ds_configs").glob("*.json")
                           if not path.stem.startswith("pipeline"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="small")
    parser.add_argument("--batch", type=bounded(int, min=1), default=16)
    parser.add_argument("--seq", type=bounded(int, min=8), default=128)
    parser.add_argument("--steps", type=bounded(int, min=1), default=20, help="timed steps per row, after 2 of warm-up")
    parser.add_argument("--ds-config", choices=ENGINE_DS_CONFIGS, default="zero1_bf16",
                        help="the engine's ds_configs/NAME.json, precision overridden (default zero1_bf16: the "
                             "paper configs' file; zero0_autocast_bf16: fp32 weights, bf16 autocast, the trainer's "
                             "fused clipping; zero0_bf16 in bf16 runs DeepSpeed's unfused optimizer)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--vocab-size", type=bounded(int, min=1), default=30522, help="tokenizer built for the run (not with --shards)")
    parser.add_argument("--shards", type=Path, default=None,
                        help="an existing shard directory (its tokenizer sizes the model); default: build one from "
                             "the built-in corpus")
    compile_mode = parser.add_mutually_exclusive_group()
    compile_mode.add_argument("--compile", action="store_true",
                              help="every row's encoder layers through torch.compile (train.compile_mode=layers)")
    compile_mode.add_argument("--compile-step", action="store_true",
                              help="our rows' whole step as one graph (train.compile_mode=step); the transformers "
                                   "row through plain torch.compile")
    parser.add_argument("--capture", action="store_true",
                        help="our rows' forward and backward captured as CUDA graphs at their first step and "
                             "replayed (train.cuda_graphs=capture); CUDA only")
    parser.add_argument("--counts-only", action="store_true",
                        help="skip the timing: one warm-up step per row, then the ops/syncs table (fast on CPU)")
    parser.add_argument("--rows", default="plain,engine,transformers",
                        help="comma-separated subset of plain, engine, transformers to time (default: all three; "
                             "a subset saves the compile time of the others with --compile-step)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="after the timing, profile 3 more steps of each row (torch.profiler): print each "
                             "row's device busy time against its wall time and its costliest kernels, and write "
                             "its trace to DIR/<row>.pt.trace.json.gz (Perfetto opens it)")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None,
                        help="torch threads (1 gives stable figures on a shared machine)")
    parser.add_argument("--ready-file", type=Path, default=None, metavar="PATH",
                        help="written once every row's warm-up steps (compiles, captures) are done, before the "
                             "timed ones: a caller running other work beside this (the GPU acceptance) pauses it then")
    parser.add_argument("--go-file", type=Path, default=None, metavar="PATH",
                        help="with --ready-file: the timed steps wait until the caller has written PATH (its word "
                             "that nothing else runs now)")
    args = parser.parse_args(argv)
    args.rows = [name.strip() for name in args.rows.split(",") if name.strip()]
    unknown = sorted(set(args.rows) - set(ROW_NAMES))
    if unknown or not args.rows:
        parser.error(f"--rows {','.join(args.rows)}: unknown {unknown}; choose among {', '.join(ROW_NAMES)}")
    if args.compile_step and args.ds_config.startswith("zero3"):
        parser.error(f"--compile-step with --ds-config {args.ds_config}: ZeRO-3 gathers parameters in hooks inside "
                     "the forward, which split the graph; use a ZeRO-0/1/2 file or --compile")
    if args.go_file and not args.ready_file:
        parser.error("--go-file: it is the answer to --ready-file; give both, or neither")
    if args.capture and not torch.cuda.is_available():
        parser.error("--capture: CUDA graphs need a CUDA GPU; leave it out on CPU")
    if args.capture and args.ds_config.startswith("zero3"):
        parser.error(f"--capture with --ds-config {args.ds_config}: ZeRO-3 gathers parameters in hooks inside "
                     "the forward; use a ZeRO-0/1/2 file")
    return args


def trainer_ds_config(args: argparse.Namespace, steps: int):
    """The engine's DeepSpeed dict, built as the trainer builds it (``build_ds_config``), the norm the
    trainer clips to itself (0: DeepSpeed clips) and the training section whose optimiser settings the plain
    loops copy."""
    from convbert_ds.engine.plan import build_ds_config, load_ds_config, trainer_clip_norm
    from convbert_ds.formats.train_config import TrainConfig

    cfg = TrainConfig.from_dict({
        "train": {"global_batch_size": args.batch, "micro_batch_size": args.batch, "steps": steps,
                  "warmup_steps": 1, "precision": args.precision},
        "deepspeed": {"config": f"ds_configs/{args.ds_config}.json"}})
    ds = build_ds_config(cfg, load_ds_config(cfg), args.batch, 1, args.precision)
    return ds, trainer_clip_norm(cfg, ds), cfg.train


def adamw(params, train) -> tuple[torch.optim.Optimizer, bool]:
    """The plain loops' AdamW, with the trainer's settings; fused (one kernel per step, not one per tensor)
    where the parameters' device supports it."""
    settings = dict(lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    try:
        return torch.optim.AdamW(params, fused=True, **settings), True
    except RuntimeError:  # a device without a fused AdamW: torch's default (foreach) implementation
        return torch.optim.AdamW(params, **settings), False


@dataclass
class Row:
    """One loop's step, in the two parts the counts are split into."""

    name: str
    forward_backward: Callable[[dict], torch.Tensor]  # returns the loss, detached
    optimizer_step: Callable[[], None]

    def step(self, batch: dict) -> None:
        self.forward_backward(batch)
        self.optimizer_step()


def begin_step(cuda_graphs: bool) -> None:
    if cuda_graphs:  # as the trainer does: a new replay may reuse the last one's output memory
        torch.compiler.cudagraph_mark_step_begin()


def plain_row(name: str, model: torch.nn.Module, loss_of: Callable, optimizer: torch.optim.Optimizer,
              autocast: torch.autocast, grad_clip: float, cuda_graphs: bool) -> Row:
    """A plain PyTorch loop: autocast forward, backward; then clip, step, zero the gradients (what
    ``engine.step()`` does, so the two parts compare)."""

    def forward_backward(batch: dict) -> torch.Tensor:
        begin_step(cuda_graphs)
        with autocast:
            loss = loss_of(model, batch)
        loss.backward()
        return loss.detach()

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Row(name, forward_backward, optimizer_step)


def engine_row(engine, trainer_clip: float, cuda_graphs: bool) -> Row:
    """The trainer's step: its own fused clipping where DeepSpeed's is off (``trainer_clip`` > 0), then
    ``engine.step()``."""
    from convbert_ds.engine.optimizer_step import OptimizerStep

    optimizer_step = OptimizerStep(engine, trainer_clip, engine.zero_optimization_stage())  # one rank

    def forward_backward(batch: dict) -> torch.Tensor:
        begin_step(cuda_graphs)
        out = engine(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], check=False)
        engine.backward(out.loss)
        return out.loss.detach()

    return Row(ENGINE, forward_backward, optimizer_step)


def our_loss(model, batch: dict) -> torch.Tensor:
    return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], check=False).loss


def hf_loss(model, batch: dict) -> torch.Tensor:
    return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])


def time_rows(rows: list[Row], batches, steps: int, cuda: bool, warmup: int = 2, ready_file: Path | None = None,
              go_file: Path | None = None) -> dict[str, list[float]]:
    """Seconds per step of each row, interleaved; every row gets the same batch and random seed each step.
    ``ready_file`` is written between the warm-up steps and the timed ones, which then wait for ``go_file``."""
    times = {row.name: [] for row in rows}
    for i in range(steps + warmup):
        if i == warmup and ready_file is not None:
            ready_file.write_text(f"{warmup} warm-up step(s) done\n")
            while go_file is not None and not go_file.exists():
                time.sleep(0.01)
        batch = next(batches)
        for row in rows:
            torch.manual_seed(i)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            row.step(batch)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times[row.name].append(time.perf_counter() - start)
    return times


@dataclass
class Counts:
    forward_backward: object  # OpCounter
    optimizer: object  # OpCounter
    loss: float


def site_counter():
    """An ``OpCounter`` whose sync sites also name transformers' frames (``OpCounter`` names the innermost frame
    of ours or DeepSpeed's, which the transformers row has none of)."""
    from convbert_ds.model.op_count import OpCounter

    class SiteCounter(OpCounter):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # torch.compile refuses to trace under a dispatch mode that wants every eager op; this one then
            # sees what a compiled step still dispatches: its extern kernels (GEMMs), not the fused ones.
            return True

        def _record_sync(self, name: str) -> None:
            self.sync_ops[name] += 1
            frames = [f for f in traceback.extract_stack()[:-2]
                      if any(part in f.filename for part in ("convbert_ds", "deepspeed", "transformers"))]
            where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else "torch"
            self.sites[f"{where} {name}"] += 1

    return SiteCounter()


def count_rows(rows: list[Row], batch: dict) -> dict[str, Counts]:
    """Ops and syncs of one step per row (after warm-up: no first-step allocations or compiles)."""
    counts = {}
    for row in rows:
        torch.manual_seed(10**6)
        with site_counter() as forward_backward:
            loss = row.forward_backward(batch)
        with site_counter() as optimizer:
            row.optimizer_step()
        counts[row.name] = Counts(forward_backward, optimizer, float(loss))  # read after counting
    return counts


def profile_rows(rows: list[Row], batches, out: Path, steps: int = 3) -> None:
    """Each row's device time against its wall time over ``steps`` steps, with its trace written to ``out``."""
    from convbert_ds.engine.profiling import device_time_summary

    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for row in rows:
        step_batches = [next(batches) for _ in range(steps)]
        with torch.profiler.profile(activities=activities) as profile:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for batch in step_batches:
                row.step(batch)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        trace = out / f"{row.name.split()[0].lower()}.pt.trace.json.gz"
        profile.export_chrome_trace(str(trace))
        print(f"profile of {row.name} ({steps} steps, trace {trace.name}):")
        print("\n".join(f"  {line}" for line in device_time_summary(profile, steps, wall)))


def print_times(times: dict[str, list[float]], flops: float, batch: int, peak: float | None) -> None:
    print(f"{'loop':<23}{'median step (s)':>16}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>7}")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        tflops = flops / median / 1e12
        mfu = f"{tflops / peak:.1%}" if peak else "n/a"
        print(f"{name:<23}{median:>16.4f}{batch / median:>11.1f}{tflops:>9.3f}{mfu:>7}")
    print("  (TFLOP/s and MFU: our model's FLOPs for every row; transformers' LM head over every position, not "
          "only the masked ones, is extra work not credited)")
    print("ratios of median step times (below 1: the first is faster):")
    for first, second in ((ENGINE, PLAIN), (PLAIN, HF), (ENGINE, HF)):
        if first not in medians or second not in medians:
            continue
        ratio = medians[first] / medians[second]
        print(f"  {first} / {second}: {ratio:.3f} ({ratio - 1:+.1%}; {1 / ratio:.2f}x the throughput)")


def print_counts(counts: dict[str, Counts], compiled: bool) -> None:
    print("ops (dispatched ATen ops, about one kernel launch each) and host-device syncs of one step:")
    if compiled:
        print("  (compiled: a graph's fused kernels are not dispatched one by one, so they are not counted; the "
              "ops are what the host still dispatches)")
    print(f"{'loop':<23}{'fwd+bwd ops':>12}{'syncs':>7}{'optimizer ops':>15}{'syncs':>7}{'total ops':>11}"
          f"{'loss':>9}")
    for name, c in counts.items():
        fb, opt = c.forward_backward, c.optimizer
        print(f"{name:<23}{fb.total:>12,}{fb.syncs:>7}{opt.total:>15,}{opt.syncs:>7}{fb.total + opt.total:>11,}"
              f"{c.loss:>9.3f}")
    print("  (loss: of the counted step, same weights at the start and same masks; the engine keeps the trainer's "
          "warm-up schedule, the plain loops a constant lr, so its loss drifts from theirs)")
    for name, c in counts.items():  # where the syncs come from, so a regression names its culprit
        for part, counter in (("fwd+bwd", c.forward_backward), ("optimizer", c.optimizer)):
            if counter.syncs:
                sites = ", ".join(f"{site} x{n}" for site, n in counter.sync_sites()[:4])
                print(f"  {name}, {part} syncs: {sites}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from convbert_ds.engine.distributed import free_port
    # A port nobody listens on, so two runs on one machine never collide.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())

    import deepspeed

    from convbert_ds.data.loader import build_dataloader
    from convbert_ds.data.shards import open_split
    from convbert_ds.engine.distributed import init_process_group
    from convbert_ds.engine.flops import device_peak_tflops, training_flops_per_sample
    from convbert_ds.engine.plan import host_sync_warnings, whole_fp32_grads
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.convbert import check_inputs
    from convbert_ds.model.layers import compile_layers, compile_step, probe_triton_kernels
    from convbert_ds.model.optim import param_groups
    from convbert_ds.model.step_capture import capture_step

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    init_process_group()
    warmup = 1 if args.counts_only else 2
    with tempfile.TemporaryDirectory() as tmp:
        shards = args.shards or build_shards(Path(tmp), args.vocab_size)
        config = electra_config(args.preset, open_split(shards, "train"))
        ds_config, trainer_clip, train = trainer_ds_config(args, steps=args.steps + warmup + 10)
        torch.manual_seed(0)
        plain = ElectraForPretraining(config)
        torch.manual_seed(0)
        wrapped = ElectraForPretraining(config)
        hf = HFElectra(config)
        hf.load_from(plain)  # all three rows start from the same weights
        plain, hf = plain.to(device), hf.to(device)
        wanted = {ROW_NAMES[name] for name in args.rows}
        if args.compile:
            compile_layers(plain), compile_layers(wrapped), compile_hf_layers(hf)
        if cuda and (args.compile_step or args.capture):
            # As the trainer does: sdconv_impl=auto probes the kernels eagerly, not inside a graph.
            probe_triton_kernels(plain, device, torch.bfloat16 if args.precision == "bf16" else torch.float32)
        trees = cuda and not args.capture  # inductor's CUDA-graph trees for --compile-step
        if args.compile_step:
            compile_step(plain, trees), compile_step(wrapped, trees)
            hf.compile(dynamic=False, mode="reduce-overhead" if cuda else None)
        engine, _, _, _ = deepspeed.initialize(model=wrapped, config=ds_config,
                                               model_parameters=param_groups(wrapped, train.weight_decay))
        if args.capture:  # after the engine has put the parameters where they stay
            # The plain loop's fused AdamW reads .grad; the engine's layout decides, as in the trainer.
            capture_step(plain, write_grads=True)
            capture_step(wrapped, write_grads=whole_fp32_grads(ds_config, 1, args.precision))
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
        plain_opt, fused = adamw(param_groups(plain, train.weight_decay), train)
        hf_opt, _ = adamw(param_groups(hf, train.weight_decay), train)
        graphs = args.compile_step and trees  # compiled with mode="reduce-overhead": inductor's CUDA graphs
        rows = [plain_row(PLAIN, plain, our_loss, plain_opt, autocast, train.grad_clip, graphs),
                engine_row(engine, trainer_clip, graphs),
                plain_row(HF, hf, hf_loss, hf_opt, autocast, train.grad_clip, args.compile_step and cuda)]
        rows = [row for row in rows if row.name in wanted]  # compiled lazily: a row never run never compiles
        loader = iter(build_dataloader([{"path": shards}], "train", seq_len=args.seq, micro_batch_size=args.batch,
                                       progress=False))

        def batches():
            while True:
                batch = next(loader)  # checked here, on the host copy, where reading ids costs no device sync
                check_inputs(config.discriminator, batch["input_ids"], batch["attention_mask"],
                             batch["token_type_ids"])
                yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}

        stream = batches()
        times = time_rows(rows, stream, 0 if args.counts_only else args.steps, cuda, warmup, args.ready_file,
                          args.go_file)
        counts = count_rows(rows, next(stream))
        if args.profile:
            profile_rows(rows, stream, args.profile)

    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    mode = "step (transformers row: torch.compile)" if args.compile_step else \
        "layers (all rows)" if args.compile else "off"
    print(f"device={device_name} preset={args.preset} batch={args.batch} seq={args.seq} precision={args.precision} "
          f"ds_config={args.ds_config} steps={0 if args.counts_only else args.steps} threads={torch.get_num_threads()} "
          f"compile={mode}")
    print(f"optimizers: plain loops torch AdamW (fused={fused}); engine {type(engine.optimizer).__name__} "
          f"(ds_configs/{args.ds_config}.json through build_ds_config; clipped by "
          f"{'the trainer, one fused norm' if trainer_clip else 'DeepSpeed'})")
    for line in host_sync_warnings(ds_config):  # what the trainer warns about at start-up, here too
        print(f"warning: {line}")
    if not args.counts_only:
        flops = training_flops_per_sample(config, args.seq) * args.batch
        print_times(times, flops, args.batch, device_peak_tflops(device_name, None))
    if cuda:  # the allocator's own count, as the trainer logs it (gpu_memory_gib)
        print(f"peak GPU memory: {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB (all rows, one process)")
    print_counts(counts, compiled=args.compile or args.compile_step)


if __name__ == "__main__":
    from convbert_ds.engine.distributed import exit_process

    # Every row runs under the engine's process group. Left to finalization, such a process aborts now and then
    # after its figures are out (see exit_process), and the acceptance would count the part as failed.
    exit_process(exit_on_user_error(main))
