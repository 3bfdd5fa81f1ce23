"""Every check that needs a GPU, in one command that fits a ten-minute lease, its figures written to a record
of its own (``benchmarks/gpu/record.py``: ``benchmarks/runs/DATE-DEVICE.md`` unless ``--record`` says where)
with the device, the versions, the commit and the command. ``benchmarks/gpu/lease.sh`` is a lease's one
command: the install and the queued rows.

    python -m benchmarks.gpu.acceptance                     # one CUDA GPU: run it all, write benchmarks/runs/...
    python -m benchmarks.gpu.acceptance --cpu-smoke OUT.md  # every part at toy sizes on CPU, written to OUT.md

Parts, in this order unless ``--parts`` picks and orders them, each under its own time limit and all
under one overall budget, so one that hangs or fails still leaves the others' figures:

1. ``cuda_graphs``: whether the step with each layer width compiled once gives the eager gradients on CUDA
   (``tests/model/test_compile_layers_once.py``); whether inductor captures the compiled step as CUDA graphs
   (``tests/engine/test_cuda_graphs.py``, inductor's graph partitioning on and off), and whether the step
   captured by hand (``train.cuda_graphs: capture``) trains, eager and compiled, and follows the eager step.
2. ``tests``: the Triton kernel tests, the auto-fallback tests and the transformers-parity tests on CUDA.
3. ``sdconv``: ``benchmarks/sdconv.py`` in bf16 and fp16 (batch 32-256 x seq 128/512, ConvBERT-base
   shapes, K = 9): fused kernels vs transformers' unfold path, bandwidth vs a copy, peak memory.
4. ``train_step``: ``benchmarks/train_step.py`` at base bf16: our plain loop on the paper path (the step
   compiled and captured) vs transformers' ConvBERT compiled; then our model in a plain loop vs through the
   DeepSpeed engine (``zero0_autocast_bf16``) vs transformers' ConvBERT, eager, step times, their ratios, and
   ops / syncs per step; then our two loops with the step captured as CUDA graphs (``--capture``).
5. ``pretrain``: one-GPU ELECTRA pretraining through ``convbert_ds.train`` itself at seq 128 and 512, small and
   base, bf16 and fp16, SDConv torch vs triton, compile off vs layers vs the whole step, ZeRO-1 bf16 vs ZeRO-0
   under torch autocast (``ds_configs/zero0_autocast_bf16.json``), the compiled step with and without inductor's
   graph partitioning, the step captured by hand (``train.cuda_graphs: capture``), its layers unrolled or
   compiled once per width (``train.compile_layers_once``), inductor's fused kernels tuned, its matmul templates
   and its max-autotune (``train.compile_autotune=kernels``, ``matmuls``, ``true``), the residual stream in bf16
   (``model.overrides.residual_dtype=autocast``), dropout and sampling drawn by inductor
   (``train.compile_random=inductor``); samples/s, tokens/s and MFU are the medians of the trainer's own
   ``metrics.jsonl`` after warm-up, with the CUDA graphs the step recorded (the most telling runs first). The
   headline rows then profile 3 more steps (``train.profile``): the device's busy time against the wall time, the
   top kernels and host ops. Beside them, transformers' ConvBERT in a plain loop at base's batch of 256
   (``benchmarks/train_step.py --rows transformers``, compiled and eager): each row's samples/s over its faster
   row's, at the same preset and shape. Up to ``--together`` rows run at once (4 on a GPU): their compiles,
   minutes each on the host, overlap; the first ready to time (its first step logged) goes on alone, the others
   paused.
6. ``nccl``: the trainer on 2 processes sharing the one GPU through NCCL, or a note saying why not.
7. ``layer_ops``: one layer's ops on their own at base's shape, eager and compiled:
   ``benchmarks/residual_dtype.py`` (the residual stream in bf16 against fp32, with inductor's count of its
   kernels and the bytes they move), ``benchmarks/input_projections.py`` (the stacked input projections against the
   four one by one) and ``benchmarks/document_conv.py`` (the packed documents' conv, Triton against torch).

Without CUDA (and without ``--cpu-smoke``) it says so and exits 0: nothing measured, no record written.
Exit code: 0 when every part that ran passed, 1 otherwise (the record is written either way).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu.limited_run import LimitedRun, next_turn, where_it_stopped
from benchmarks.gpu.logs import KeptLogs
from benchmarks.gpu.pretrain_rows import (AUTOCAST, COLUMNS, CPU_SMOKE_RUNS, GPU_RUNS, GRAPHS_CELL,
                                          PROFILED_STEPS, PretrainRun, ReferenceRow, ReferenceRun, StartedRow,
                                          partitioning_captured, unfilled)
from benchmarks.gpu.record import DEFAULT_BUDGET_S, REPO, record_path, record_text, trimmed, write_record
from benchmarks.gpu.shards import built_in_shards, shards_vocab_size
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error

TRAIN_STEP_BASE = ("--preset", "base", "--batch", "64", "--seq", "128", "--steps", "10", "--precision", "bf16",
                   "--ds-config", AUTOCAST)


@dataclass(frozen=True)
class Scale:
    """Sizes of one acceptance run: the real one on a GPU, or toy ones that exercise every part on CPU."""
    tests: tuple[str, ...]
    cuda_graph_tests: tuple[str, ...]  # the cuda_graphs part's pytest arguments
    sdconv_args: tuple[tuple[str, ...], ...]
    layer_op_commands: tuple[tuple[str, ...], ...]  # one benchmarks/SCRIPT command each: (SCRIPT, *args)
    train_step_args: tuple[tuple[str, ...], ...]  # one benchmarks/train_step.py command each
    runs: list[PretrainRun | ReferenceRun]
    batch: int
    seq: int
    steps: int
    warmup_rows: int  # logged rows (every log_interval steps) left out of the medians: compiling, warming up
    vocab_size: int
    log_interval: int = 5
    together: int = 1  # pretraining rows run at once (--together): their compiles overlap, not their timed steps


LAYERS_ONCE_ON_CUDA = ("tests/model/test_compile_layers_once.py::"
                       "test_layers_compiled_once_give_the_eager_gradients[cuda]")
CUDA_GRAPH_TESTS = "tests/engine/test_cuda_graphs.py"
# Not test_kernels_compile.py: it compiles for sm_90 without a GPU, which the GPU itself makes moot (and it
# took most of the first run's test budget).
GPU = Scale(tests=("tests/kernels", "--ignore=tests/kernels/test_kernels_compile.py",
                   "tests/model/test_sdconv_reference.py", "tests/model/test_hf_parity.py",
                   "tests/model/test_packed_documents.py"),
            cuda_graph_tests=(LAYERS_ONCE_ON_CUDA, CUDA_GRAPH_TESTS),
            sdconv_args=(("--dtype", "bf16"), ("--dtype", "fp16")),
            layer_op_commands=(("residual_dtype.py", "--compile"), ("input_projections.py",),
                               ("input_projections.py", "--compile"), ("document_conv.py",),
                               ("document_conv.py", "--compile")),
            # The paper path against transformers compiled first (the eager figures are in RESULTS.md already).
            train_step_args=((*TRAIN_STEP_BASE, "--compile-step", "--capture", "--rows", "plain,transformers"),
                             TRAIN_STEP_BASE, (*TRAIN_STEP_BASE, "--capture", "--rows", "plain,engine")),
            runs=GPU_RUNS, batch=128, seq=128,
            # together: base at batch 256 is about 25 GB of the GPU's 139 (estimated); 16 host cores
            steps=40, warmup_rows=2, vocab_size=30522, together=4)
CPU_SMOKE = Scale(tests=("tests/model/test_sdconv_reference.py",),
                  cuda_graph_tests=(CUDA_GRAPH_TESTS,),  # they say why they skip; the suite has the CPU gradients
                  sdconv_args=(("--dtype", "fp32", "--batch", "2", "--seq", "32", "--reps", "2"),),
                  layer_op_commands=(("input_projections.py", "--preset", "tiny", "--batch", "2", "--seq", "32",
                                      "--reps", "2"),
                                     ("residual_dtype.py", "--preset", "tiny", "--batch", "2", "--seq", "32",
                                      "--reps", "2")),
                  train_step_args=(("--preset", "tiny", "--batch", "4", "--seq", "64", "--steps", "2", "--threads",
                                    "1"),),
                  # 10 steps: rows that ran beside the other one before its turn are left out of the medians
                  runs=CPU_SMOKE_RUNS, batch=4, seq=64, steps=10, warmup_rows=2, vocab_size=2000, log_interval=1,
                  together=2)


class Acceptance:
    def __init__(self, scale: Scale, work: Path, budget_s: float, rows: re.Pattern | None = None,
                 together: int | None = None, keep: KeptLogs | None = None):
        self.scale, self.work, self.rows = scale, work, rows  # rows: which pretraining rows run (None: all)
        self.keep = keep or KeptLogs(None)  # --logs: each command's log and trace, kept as soon as it ends
        self.together = together or scale.together
        self.deadline = time.monotonic() + budget_s
        self.failed: list[str] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "HF_DATASETS_OFFLINE": "1"}

    def part(self, name: str) -> str:
        """One part's text. A part that raises fails with its traceback in its place: the parts after it still
        run, and the logs and the record still get what the others measured (a lease is not run twice)."""
        try:
            return getattr(self, name)()
        except Exception:
            self.failed.append(name)
            return _fenced(traceback.format_exc().strip().splitlines())

    def run(self, name: str, command: list[str], limit_s: float, env: dict | None = None) -> tuple[int, str, str]:
        """Run one command under min(limit, what is left of the budget), with ``env`` added to the
        environment: exit code, stdout, stdout + stderr (the last is logged)."""
        return self.finish(name, self.start(name, command, limit_s, env))

    def start(self, name: str, command: list[str], limit_s: float, env: dict | None = None,
              least_s: float = 5) -> LimitedRun | None:
        """Start one command (``finish`` waits for it): None when the budget has less than ``least_s`` left."""
        limit = min(limit_s, self.deadline - time.monotonic())
        if limit < least_s:
            return None
        print(f"=== {name}: {' '.join(command)}", flush=True)
        return LimitedRun(command, {**self.env, **(env or {})}, limit, cwd=REPO, deadline=self.deadline)

    def finish(self, name: str, run: LimitedRun | None) -> tuple[int, str, str]:
        """Wait for a started command (resumed, if paused): what ``run`` returns (-1: never started)."""
        if run is None:
            self.failed.append(f"{name} (no time left)")
            return -1, "", f"skipped: the overall budget was spent before {name}"
        code, stdout, stderr = run.finish()
        output = stdout + stderr + (f"\n(stopped at {run.stopped_by})" if code == 124 else "")
        self.keep.log(name, output)  # with --logs only: the parts read their figures from what this returns
        print(output[-3000:], f"=== {name}: exit code {code}", sep="\n", flush=True)
        if code != 0:
            self.failed.append(name)
        return code, stdout, output

    def cuda_graphs(self) -> str:
        """Whether each layer compiled once gives the eager gradients on CUDA too
        (``tests/model/test_compile_layers_once.py``), and whether the compiled step is captured as CUDA graphs,
        with inductor's graph partitioning on and off (``tests/engine/test_cuda_graphs.py``): one line per
        case, a failure's with its message."""
        _, _, output = self.run("cuda_graphs", [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                                             *self.scale.cuda_graph_tests], limit_s=300)
        lines = output.strip().splitlines()
        verdicts = [line for line in lines if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))]
        return _fenced(verdicts + lines[-1:] + where_it_stopped(output) or ["(no output)"])

    def tests(self) -> str:
        _, _, output = self.run("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       *self.scale.tests], limit_s=240)
        return _fenced(output.strip().splitlines()[-1:] or ["(no output)"])

    def sdconv(self) -> str:
        return self._scripts("sdconv", [("sdconv.py", *args) for args in self.scale.sdconv_args])

    def layer_ops(self) -> str:
        """One layer's ops on their own, eager and compiled: the stacked input projections against the separate
        ones they replaced, and the packed documents' conv, each variant beside its baseline."""
        return self._scripts("layer_ops", self.scale.layer_op_commands)

    def _scripts(self, part: str, commands: Sequence[tuple[str, ...]]) -> str:
        """Run each ``(SCRIPT, *args)`` of ``commands`` as ``python benchmarks/SCRIPT args``: what each printed
        (its first lines; all of it in its log)."""
        parts = []
        for i, (script, *args) in enumerate(commands):
            code, stdout, output = self.run(f"{part}_{i}", [sys.executable, f"benchmarks/{script}", *args],
                                            limit_s=120)
            report = trimmed(stdout, f"{part}_{i}") if code == 0 else trimmed(output, f"{part}_{i}", last=True)
            parts.append(f"$ python benchmarks/{' '.join([script, *args])}\n{report}")
        return _fenced(parts)

    def train_step(self) -> str:
        """The training loops side by side on the acceptance's own shards: on a GPU first our plain loop on the
        paper path (the whole step compiled, captured by hand) against transformers' ConvBERT through
        torch.compile; then the three loops (engine vs plain vs transformers) eager, and our two with the
        eager step captured as CUDA graphs."""
        parts = []
        for i, args in enumerate(self.scale.train_step_args):
            code, stdout, output = self.run(f"train_step_{i}", [sys.executable, "benchmarks/train_step.py", *args,
                                                                "--shards", str(self._shards())],
                                               limit_s=330 if "--compile-step" in args else 150)  # two compiles
            # From its first figures on: not DeepSpeed's start-up log.
            report = trimmed(stdout[stdout.find("device="):], f"train_step_{i}") if code == 0 else \
                trimmed(output, f"train_step_{i}", last=True)
            parts.append(f"$ python benchmarks/train_step.py {' '.join(args)}\n{report}")
        return _fenced(parts)

    def pretrain(self) -> str:
        shards = self._shards()
        chosen = [spec for spec in self.scale.runs if self.rows is None or self.rows.search(self._label(spec))]

        def row_done(done: dict) -> None:  # --logs: the table so far (pretrain.md), the rows to come marked so
            so_far = {spec: done.get(spec, (unfilled("not yet"), [])) for spec in chosen}
            self.keep.file("pretrain.md", self._pretrain_table(chosen, so_far, shards))

        return self._pretrain_table(chosen, self._run_rows(chosen, shards, row_done), shards)

    def _pretrain_table(self, chosen: list[PretrainRun | ReferenceRun],
                        results: dict[PretrainRun | ReferenceRun, tuple[list[str], list[str]]], shards: Path) -> str:
        """The pretraining part's text: what the columns mean, one row of figures a run, the profiles."""
        rows = ["| preset | seq x batch | DeepSpeed file | precision | SDConv | compile | samples/s | tokens/s | "
                "TFLOP/s | MFU | to first step (s) | CUDA graphs | peak GiB | vs transformers |",
                "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        profiles = []
        reference = {}  # (preset, shape): the fastest transformers row's samples/s (compiled or eager)
        for spec in chosen:
            if isinstance(spec, ReferenceRun) and _number(results[spec][0][0]):
                key = (spec.preset, self._shape(spec))
                reference[key] = max(reference.get(key, 0), _number(results[spec][0][0]))
        for spec in chosen:  # the table in its order, whichever order the rows ran in
            figures, profile = results[spec]
            theirs, ours = reference.get((spec.preset, self._shape(spec))), _number(figures[0])
            versus = "-" if isinstance(spec, ReferenceRun) or not (theirs and ours) else f"{ours / theirs:.2f}x"
            rows.append(f"| {self._label(spec)} | " + " | ".join([*figures, versus]) + " |")
            if profile:
                profiles += ["", f"`{self._label(spec)}`:", "", _fenced(profile)]
        if profiles:
            profiles.insert(0, f"\nProfiles of the rows marked for it, where a row that ran out of time stood "
                               f"(its Python stack when stopped), and the last lines of a reference row that "
                               f"failed: {PROFILED_STEPS} steps after the timed ones "
                               "(`train.profile.start_step=STEPS+1`), as the trainer prints them at the end of the "
                               "window, cut short (wall time per step, the profiler's own cost included, against the "
                               "device's busy time; the top kernels, the device's time by kind of kernel, the top host "
                               "ops; the whole summary is in the row's log, and its trace with --logs):")
        s = self.scale
        together = (f"Up to {self.together} rows run at once: their start-ups and compiles overlap; once its "
                    f"first step is logged, a row runs on alone, the others paused, and its medians begin with "
                    f"the second logged row that began after that. " if self.together > 1 else "")
        return "\n".join([f"Global batch {s.batch} x seq {s.seq} unless the row says otherwise (longer sequences: the "
                          f"same tokens per step), vocabulary {shards_vocab_size(shards):,} (a BPE tokenizer of the "
                          f"built-in corpus), one process, {s.steps} steps, the DeepSpeed file of each row "
                          f"(`ds_configs/NAME.json`, precision overridden); logged every {s.log_interval} steps, "
                          f"medians of the rows after the first {s.warmup_rows}. {COLUMNS} {together}".rstrip(), "",
                          *rows, *profiles])

    def _shards(self) -> Path:
        # Here: only the train-step and pretraining parts need preprocessing (built once, for both).
        return built_in_shards(self.work, self.scale.vocab_size)

    def _shape(self, spec: PretrainRun) -> tuple[int, int]:
        """(seq, global batch) of one run: the row's batch, or the scale's tokens per step (a longer sequence,
        a smaller batch)."""
        seq = spec.seq or self.scale.seq
        return seq, spec.batch or max(1, self.scale.batch * self.scale.seq // seq)

    def _train_args(self, spec: PretrainRun, shards: Path, run_dir: Path, steps: int) -> list[str]:
        """``convbert_ds.train``'s arguments for one throughput run (one process: micro = global batch); a
        profiled run goes on for PROFILED_STEPS steps after ``steps``, under the profiler."""
        seq, batch = self._shape(spec)
        config = REPO / "configs" / ("tiny_cpu.yaml" if spec.preset == "tiny" else f"{spec.preset}.yaml")
        profile = [f"train.profile.start_step={steps + 1}", f"train.profile.steps={PROFILED_STEPS}"]
        steps += PROFILED_STEPS if spec.profile else 0
        return ["--config", str(config), *(profile if spec.profile else []),
                f"data.sets=[{{path: '{shards}', weight: 1.0}}]", f"data.seq_len={seq}",
                "data.num_workers=2", f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
                f"train.steps={steps}", "train.warmup_steps=1",
                f"train.precision={spec.precision}", f"train.compile={str(spec.compile).lower()}",
                f"train.compile_mode={spec.compile_mode}", f"train.cuda_graphs={spec.cuda_graphs}",
                f"train.compile_layers_once={str(spec.layers_once).lower()}",
                f"train.compile_autotune={str(spec.autotune).lower()}", f"train.compile_random={spec.random}",
                f"model.overrides.sdconv_impl={spec.sdconv}", f"model.overrides.residual_dtype={spec.residual}",
                *(f"train.compile_options.{text}" for text in spec.option_texts),
                f"deepspeed.config=ds_configs/{spec.ds_config}.json",
                f"checkpoint.dir={run_dir / 'checkpoints'}", f"checkpoint.interval={steps}",
                # Every 5 steps: a logging step reads its metrics back (a sync), the steps between do not.
                f"log.dir={run_dir / 'logs'}", f"log.interval={self.scale.log_interval}", "eval.interval=0"]

    def _label(self, spec: PretrainRun) -> str:
        return " | ".join([spec.preset, "{} x {}".format(*self._shape(spec)), spec.ds_config, spec.precision_label,
                           spec.sdconv, spec.compile_label])

    def _run_rows(self, specs: list[PretrainRun | ReferenceRun], shards: Path,
                  row_done: Callable[[dict], None]) -> dict[PretrainRun | ReferenceRun, tuple[list[str], list[str]]]:
        """Each row's figures and profile (``_finish_row``). Up to ``together`` rows run at once, started in
        the table's order; the first ready to time (its first step logged, its compile done; a reference row:
        its warm-up steps done) runs on alone while the others wait, paused (``next_turn``), and once it has
        finished they go on and the next row starts. A row
        without graph partitioning starts once every row before it has finished: whether it runs at all
        depends on how its twin did (``partitioning_captured``). ``row_done`` gets the results so far after each
        row."""
        queue, running, results = list(specs), [], {}
        try:
            while queue or running:
                while queue and len(running) < self.together and (queue[0].graph_partition or not running):
                    spec = queue.pop(0)
                    graphs_of = {done: cells[GRAPHS_CELL] for done, (cells, _) in results.items()}
                    why = partitioning_captured(spec, graphs_of)
                    row = None if why else self._start_row(spec, shards, together=self.together > 1)
                    if row is not None and row.run is not None:
                        running.append(row)
                    else:
                        results[spec] = (unfilled(f"not run: {why}"), []) if why else self._finish_row(row)
                        row_done(results)
                if running:
                    row = next_turn(running)
                    running.remove(row)
                    if self.together > 1 and row.first_step_s is not None:  # (else it has exited)
                        row.runs_alone()
                        print(f"=== {row.name}: ready to time after {row.first_step_s:.0f} s (its first step "
                              f"logged, or its warm-up done); runs alone, {len(running)} other(s) paused", flush=True)
                    results[row.spec] = self._finish_row(row)
                    row_done(results)
                    for other in running:
                        other.run.resume()
        finally:  # an error here: no run is left behind, paused, holding the GPU
            for row in running:
                row.run.kill()
        return results

    def _start_row(self, spec: PretrainRun | ReferenceRun, shards: Path, together: bool) -> StartedRow:
        """Start one throughput run (``_finish_row`` waits for it and reads its figures): a trainer row through
        ``convbert_ds.train``, a reference row through ``benchmarks/train_step.py``."""
        seq, batch = self._shape(spec)
        name = spec.run_name(seq, batch)
        run_dir = self.work / name
        env = {} if spec.graph_partition else {"TORCHINDUCTOR_GRAPH_PARTITION": "0"}
        if together:  # NCCL's heartbeat monitor could take a paused watchdog thread for a hung one and abort
            env["TORCH_NCCL_ENABLE_MONITORING"] = "0"
        if isinstance(spec, ReferenceRun):
            row = ReferenceRow(spec, name, run_dir, None, seq=seq)
            run_dir.mkdir(parents=True, exist_ok=True)  # where its ready and go files go
            command = ["benchmarks/train_step.py", *spec.command(shards, seq, batch, self.scale.steps, row.ready_file,
                                                                 row.go_file if together else None,
                                                                 cpu=self.scale is not GPU)]
        else:
            row = StartedRow(spec, name, run_dir, None)
            command = ["-m", "convbert_ds.train", *self._train_args(spec, shards, run_dir, self.scale.steps)]
        row.run = self.start(name, [sys.executable, *command], limit_s=spec.limit_s * (1.5 if together else 1),
                             env=env, least_s=60 if spec.compile else 5)  # a compile alone takes a minute
        return row

    def _finish_row(self, started: StartedRow) -> tuple[list[str], list[str]]:
        """The row's figures, and the profile summary the trainer wrote (empty when not profiled)."""
        code, _, output = self.finish(started.name, started.run)
        try:
            return started.figures(code, output, self.scale.steps, self.scale.warmup_rows)
        finally:  # gigabytes for base; only figures matter
            self.keep.traces(started.run_dir)
            shutil.rmtree(started.run_dir / "checkpoints", ignore_errors=True)

    def nccl(self) -> str:
        from convbert_ds.engine.distributed import free_port

        on_gpu = self.scale is GPU
        # The paper configs' DeepSpeed file: its gradient all-reduce is the trainer's own (optimizer_step.py).
        spec = (PretrainRun("tiny", "fp32", "torch", False) if not on_gpu
                else PretrainRun("small", "bf16", "triton", False, ds_config=AUTOCAST))
        run_dir = self.work / "nccl"
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                   free_port(), "-m", "convbert_ds.train",
                   *self._train_args(spec, self.work / "shards", run_dir, steps=5), "train.micro_batch_size=null"]
        code, _, output = self.run("nccl", command, limit_s=120)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        if code == -1:
            return "Not run: the overall budget was spent before this part."
        backend = "nccl" if on_gpu else "gloo"
        if code == 0 and f"backend={backend}" in output:
            return f"2 processes on one device ({backend}): 5 steps of {spec.preset} ran and saved."
        shared = on_gpu and ("Duplicate GPU" in output or "ncclInvalidUsage" in output)
        if shared:
            self.failed.remove("nccl")  # NCCL's own rule, not our failure
            return "Skipped: NCCL refuses two ranks on one GPU (`Duplicate GPU detected`); it needs 2 GPUs."
        return "Failed: " + _fenced(output.strip().splitlines()[-15:])


# Each part (an ``Acceptance`` method of that name) and its section title, in the default order.
PARTS = {"cuda_graphs": "CUDA graphs of the step", "tests": "Kernel, fallback and parity tests", "sdconv": "SDConv kernel",
         "train_step": "Training step: plain PyTorch vs DeepSpeed engine vs transformers' ConvBERT",
         "pretrain": "One-GPU ELECTRA pretraining throughput (the trainer's own log)",
         "nccl": "Two processes on one GPU",
         "layer_ops": "One layer's ops: the stacked input projections, the packed documents' conv"}


def _row_pattern(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression ({error}); e.g. 'base \\| 128 x'")


def _part_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PARTS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give each of {', '.join(PARTS)} at most once, comma-separated")
    return names


def _number(cell: str) -> float | None:
    """A table cell's number (``3,904``), None for a failed or missing row's."""
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


def _fenced(lines) -> str:
    return "```\n" + "\n".join(lines) + "\n```"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", metavar="OUT.md", type=Path,
                        help="run every part at toy sizes on CPU and write the record to OUT.md")
    parser.add_argument("--record", metavar="PATH", type=Path,
                        help="where the record goes: a file, or a directory for the default name (default: "
                             "benchmarks/runs/DATE-DEVICE.md); an existing file is never overwritten (NAME-2.md)")
    parser.add_argument("--budget", type=bounded(float, above=0), default=DEFAULT_BUDGET_S,
                        help=f"seconds for all parts together (default {DEFAULT_BUDGET_S})")
    parser.add_argument("--parts", type=_part_list, default=list(PARTS),
                        help=f"comma-separated parts to run, in this order (default: {','.join(PARTS)}); a short "
                             "lease can put the figures it needs most first")
    parser.add_argument("--rows", metavar="REGEX", type=_row_pattern,
                        help="run only the pretraining rows whose table label matches (re.search over e.g. "
                             "'base | 128 x 128 | zero0_autocast_bf16 | bf16 | auto | step, capture'; escape its "
                             "| as \\|), in their order (default: every row, as the budget allows)")
    parser.add_argument("--together", metavar="N", type=bounded(int, min=1),
                        help="pretraining rows run at once (default: 4 on a GPU, 2 in the CPU smoke run): their "
                             "compiles overlap, and each runs its timed steps alone, the others paused; 1 runs "
                             "them one after another")
    parser.add_argument("--logs", metavar="DIR", type=Path,
                        help="also keep each command's full log (NAME.log), the profiled runs' traces "
                             "(RUN.pt.trace.json.gz), the pretraining table so far (pretrain.md) and the record so "
                             "far (record.md) in DIR, each as soon as it is done (default: only the record is kept)")
    args = parser.parse_args(argv)
    if args.cpu_smoke and args.record:
        parser.error("--record: the CPU smoke run writes its record to --cpu-smoke's OUT.md; give one of them")
    import torch
    on_gpu = torch.cuda.is_available()
    if not on_gpu and args.cpu_smoke is None:
        print("gpu acceptance: no CUDA GPU on this machine; nothing measured, no record written (run it on a "
              "machine with one GPU, or pass --cpu-smoke OUT.md to try every part on CPU)")
        return 0
    started, keep = time.monotonic(), KeptLogs(args.logs)
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_") as tmp:
        acceptance = Acceptance(GPU if on_gpu else CPU_SMOKE, Path(tmp), args.budget, args.rows, args.together, keep)
        body = []
        for name in args.parts:
            body.append((PARTS[name], acceptance.part(name)))
            record = record_text(args, list(PARTS), on_gpu, time.monotonic() - started, acceptance.failed, body)
            keep.file("record.md", record)
    path = record_path(args.cpu_smoke or args.record, on_gpu)
    write_record(path, record)
    print(f"gpu acceptance: failed parts: {', '.join(acceptance.failed) or 'none'}; the record: {path}")
    return 1 if acceptance.failed else 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
