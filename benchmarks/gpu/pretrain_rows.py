"""The pretraining rows of the GPU acceptance (``benchmarks/gpu/acceptance.py``'s ``pretrain`` part): what
each row runs through ``convbert_ds.train``, and which rows run, in which order, on a GPU and in the CPU
smoke run; a started row's run (``StartedRow``). Beside them, the reference row (``ReferenceRun``,
``ReferenceRow``): transformers' own ConvBERT in a plain loop at the same shape, what a user would otherwise
run, timed by ``benchmarks/train_step.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from benchmarks.gpu.limited_run import LimitedRun, where_it_stopped
from convbert_ds.formats.train_config import option_text
from convbert_ds.fsutil import file_name_part

if TYPE_CHECKING:  # the rows are built and named without torch
    from convbert_ds.model.layers import AutotuneLevel


@dataclass(frozen=True)
class PretrainRun:
    preset: str
    precision: str
    sdconv: str
    compile: bool
    compile_mode: str = "layers"  # train.compile_mode when compile is on: layers, or step (the whole step)
    seq: int | None = None  # None: the scale's; longer sequences get a smaller batch (same tokens per step)
    batch: int | None = None  # global batch; None: the scale's tokens per step at this row's seq
    ds_config: str = "zero1_bf16"  # ds_configs/NAME.json, precision overridden
    graph_partition: bool = True  # False: TORCHINDUCTOR_GRAPH_PARTITION=0 (inductor then reports CUDA-graph skips)
    cuda_graphs: str = "inductor"  # train.cuda_graphs: inductor, capture (by hand) or off
    profile: bool = False  # after the timed steps, PROFILED_STEPS more, profiled (not in the medians)
    layers_once: bool = False  # train.compile_layers_once (step only): one compiled layer per width, reused
    autotune: AutotuneLevel = False  # train.compile_autotune (step only): "kernels" tunes the fused kernels,
    # "matmuls" times Triton matmul templates (epilogues fused) against cuBLAS, True is inductor's max-autotune, both
    residual: str = "fp32"  # model.overrides.residual_dtype: "autocast" (the paper configs') keeps it in bf16
    random: str = "eager"  # train.compile_random: "inductor" draws dropout and sampling in inductor's kernels
    options: tuple = ()  # train.compile_options as (inductor's name, value) pairs

    @property
    def option_texts(self) -> list[str]:
        """Each of ``options`` as ``name=value``: the overrides (``train.compile_options.`` before it), the label."""
        return [option_text(name, value) for name, value in self.options]

    def run_name(self, seq: int, batch: int) -> str:
        """The run's directory (and its log's and trace's file name) in the acceptance's work directory."""
        mode = "eager" if not self.compile else "compiled" if self.compile_mode == "layers" else "compiled_step"
        return (f"pretrain_{self.preset}_{self.precision}_{self.sdconv}_{mode}_seq{seq}_batch{batch}_"
                f"{self.ds_config}{'_layers_once' if self.layers_once else ''}"
                f"{'_' + AUTOTUNE_LABELS[self.autotune].replace(' ', '_') if self.autotune else ''}"
                f"{'_inductor_random' if self.random == 'inductor' else ''}"
                f"{''.join('_' + file_name_part(text) for text in self.option_texts)}"
                f"{'' if self.residual == 'fp32' else f'_{self.residual}_residual'}"
                f"{'' if self.graph_partition else '_no_partition'}"
                f"{'' if self.cuda_graphs == 'inductor' else '_' + self.cuda_graphs}")

    @property
    def limit_s(self) -> float:
        """Its time limit run on its own: compiling base takes 60-150 s on an H100 or H200 with warm caches,
        over 200 s on a fresh machine (the first row); autotuning, minutes more."""
        return (360 if self.autotune else 270) if self.compile else 120

    @property
    def precision_label(self) -> str:
        return self.precision if self.residual == "fp32" else f"{self.precision}, {self.precision} residual"

    @property
    def compile_label(self) -> str:
        label = "off" if not self.compile else "on" if self.compile_mode == "layers" else self.compile_mode
        label = f"{label}, layers once" if self.layers_once else label
        label = f"{label}, {AUTOTUNE_LABELS[self.autotune]}" if self.autotune else label
        label = f"{label}, inductor random" if self.random == "inductor" else label
        label = ", ".join([label, *self.option_texts])
        label = label if self.graph_partition else f"{label}, no partition"
        return label if self.cuda_graphs == "inductor" else f"{label}, {self.cuda_graphs}"


PROFILED_STEPS = 3  # steps a profiled row runs after its timed ones, under the profiler
GRAPHS_CELL = 5  # the index of the CUDA-graphs cell in StartedRow.figures
FIGURE_CELLS = 7  # StartedRow.figures' cells: samples/s, tokens/s, TFLOP/s, MFU, to first step, CUDA graphs, peak
# Each train.compile_autotune level as the tables and the run names say it.
AUTOTUNE_LABELS = {False: "", "kernels": "tuned kernels", "matmuls": "tuned matmuls", True: "autotune"}
AUTOCAST = "zero0_autocast_bf16"  # fp32 weights, bf16 autocast, torch's fused AdamW, the trainer's fused clip


# What the pretraining table's columns and labels mean (the record prints it above the table).
COLUMNS = ("Each run: `python -m convbert_ds.train --config configs/PRESET.yaml train.precision=P "
           "model.overrides.sdconv_impl=S train.compile=C train.compile_mode=M train.cuda_graphs=G ...` (compile on: "
           "M=layers, step: M=step; G=inductor unless the row says capture; the full line is in the log). CUDA "
           "graphs: those the step had recorded after warm-up (`cuda_graphs` in metrics.jsonl; 2 or more when "
           "captured, 0 when it runs kernel by kernel, A -> B when it re-records); peak GiB: the most GPU memory the "
           "run's allocator held (`gpu_memory_gib`); no partition: `TORCHINDUCTOR_GRAPH_PARTITION=0`; capture: the "
           "step captured by hand (`train.cuda_graphs=capture`); layers once: one compiled layer per width "
           "(`train.compile_layers_once=true`); tuned kernels: the block sizes of inductor's fused kernels tuned "
           "(`train.compile_autotune=kernels`); tuned matmuls: each matmul timed as Triton templates, elementwise "
           "epilogues fused in, against cuBLAS (`train.compile_autotune=matmuls`); autotune: inductor's max-autotune "
           "(`train.compile_autotune=true`); inductor random: dropout and sampling drawn in inductor's kernels "
           "(`train.compile_random=inductor`); NAME=VALUE: that option of inductor's "
           "(`train.compile_options.NAME=VALUE`), over those the config sets (the paper configs: `combo_kernels: "
           "true`); P, P residual: the residual stream in P as well (`model.overrides.residual_dtype=autocast`); vs "
           "transformers: the row's samples/s over those of transformers' own ConvBERT at the same preset and shape, "
           "its faster row when it has two (compiled and eager; its rows: `benchmarks/train_step.py --rows "
           "transformers`, a plain loop under torch.autocast, each step timed between two device syncs; its "
           "first-step column: until its warm-up steps were done; its peak GiB: its whole process's, our model and "
           "engine built beside it among it).")


def short_summary(lines: list[str], kernels: int = 4, host: int = 2) -> list[str]:
    """A profile summary (``device_time_summary``'s lines) cut for the record: its wall-time line, its top
    ``kernels`` kernels, the device's time by kind of kernel, the top ``host`` ops of the host."""
    at = {name: next((i for i, line in enumerate(lines) if line.startswith(f"  {name}")), len(lines))
          for name in ("by kind of kernel", "host:")}
    top_end = min(at.values())
    return [*lines[:min(top_end, 1 + kernels)], *lines[at["by kind of kernel"]:at["host:"]],
            *lines[at["host:"]:at["host:"] + 1 + host]]


def unfilled(verdict: str) -> list[str]:
    """A row's figure cells when it has none: ``verdict`` says why, the rest are empty."""
    return [verdict] + [""] * (FIGURE_CELLS - 1)


def verdict(code: int) -> str:
    """Why a run with exit ``code`` has no figures: -1 never started, 124 stopped at its limit."""
    return {-1: "not run", 124: "timed out"}.get(code, "failed")


@dataclass
class StartedRow:
    """A pretraining row's run, started: where it logs, when its first step was logged, and from which of its
    logged rows on it ran alone (``benchmarks.gpu.limited_run.next_turn``)."""
    spec: PretrainRun
    name: str
    run_dir: Path
    run: LimitedRun | None  # None: no time was left to start it
    first_step_s: float | None = None  # seconds it ran (pauses not counted) until its first step was logged
    alone_from: int = 0  # the index in metrics.jsonl of its first logged row that ran alone from start to end

    @property
    def metrics(self) -> Path:
        return self.run_dir / "logs" / "metrics.jsonl"

    def profile_summary(self) -> list[str]:
        """The summary the trainer wrote at the end of its profile window (``convbert_ds/engine/profiling.py``),
        under the heading it prints it with, cut for the record (``short_summary``; the trainer printed all of it
        in the row's log); empty when the window did not end (or was not asked for)."""
        path = self.run_dir / "logs" / "profile" / "summary_rank0.txt"
        if not path.is_file():
            return []
        return [f"profile summary (rank 0, {PROFILED_STEPS} steps):", *short_summary(path.read_text().splitlines())]

    def figures(self, code: int, output: str, steps: int, warmup_rows: int) -> tuple[list[str], list[str]]:
        """The table's cells from samples/s on (medians of the logged rows after ``warmup_rows`` that ran
        alone, up to ``steps``), and the profile summary; or why there are none (the run's exit ``code``:
        -1 not run, 124 stopped at its limit; ``output``: its log)."""
        try:  # (line index, logged row)
            rows = list(enumerate(map(json.loads, self.metrics.read_text().splitlines())))
        except OSError:
            rows = []
        rows = [(i, row) for i, row in rows if row.get("split") == "train" and row["step"] <= steps]
        steady = [row for i, row in rows if i >= max(warmup_rows, self.alone_from)]
        profile = self.profile_summary()
        timed = bool(steady) and steady[-1]["step"] >= steps
        if code != 0 and timed and self.spec.profile:  # the timed steps are whole; only the profiled ones failed
            profile = ["the run stopped in its profile window:", *output.strip().splitlines()[-8:]]
        elif code != 0 or not steady:
            if code == 124:  # where it stood: a compile, a capture, a collective...
                profile = ["stopped at its limit; the main thread was in:", *where_it_stopped(output)]
            return unfilled(verdict(code)), profile

        def median(key: str, fmt: str) -> str:
            values = [row[key] for row in steady if row.get(key) is not None]
            return format(statistics.median(values), fmt) if values else "n/a"

        # This run's allocator at its peak (GPU only; without the CUDA context's own memory).
        peak = f"{rows[-1][1]['gpu_memory_gib']:.1f}" if "gpu_memory_gib" in rows[-1][1] else "-"
        # Constant once warmed up; growing means the CUDA-graph trees re-record (shown as first -> last).
        graphs = [row["cuda_graphs"] for row in steady if row.get("cuda_graphs") is not None]
        graphs_cell = ("-" if not graphs else str(graphs[0]) if graphs[0] == graphs[-1]
                       else f"{graphs[0]} -> {graphs[-1]}")
        return [median("samples_per_s", ",.0f"), median("tokens_per_s", ",.0f"), median("tflops", ".1f"),
                median("mfu", ".1%"), self.first_step_cell, graphs_cell, peak], profile

    @property
    def first_step_cell(self) -> str:
        return "n/a" if self.first_step_s is None else f"{self.first_step_s:.1f}"

    def timing_began(self) -> bool:
        """Whether its first step is logged: it has started, compiled (and captured) its step; what follows
        is timed."""
        with contextlib.suppress(OSError):
            return self.metrics.stat().st_size > 0
        return False

    def ready(self) -> bool:
        """Whether its timing has begun (``timing_began``); the first time it has, how long that took."""
        if not self.timing_began():
            return False
        if self.first_step_s is None:
            self.first_step_s = self.run.ran_s()
        return True

    def runs_alone(self) -> None:
        """From now on no other row runs: count its logged rows from the second after its last complete
        line. The trainer times a logged row from the moment it began writing the one before, so the
        next row's time began before now; and so may the one after, if a line is still in the writer's
        buffer or part-written."""
        try:
            text = self.metrics.read_text()
        except OSError:
            text = ""
        self.alone_from = text.count("\n") + 2


@dataclass(frozen=True)
class ReferenceRun:
    """transformers' own ConvBERT (``ConvBertForMaskedLM`` generator, discriminator with a token-classification
    head: ``HFElectra`` in ``benchmarks/common.py``) in a plain loop, timed by ``benchmarks/train_step.py --rows
    transformers`` at one of the table's shapes: the figure each of our rows of that preset and shape is read
    against (the table's last column). Named like a ``PretrainRun`` where the pretraining part reads it."""
    preset: str
    precision: str = "bf16"  # under torch.autocast over fp32 weights, as a user of transformers runs it
    compile: bool = True  # train_step's --compile-step: torch.compile, mode reduce-overhead on CUDA
    seq: int | None = None
    batch: int | None = None
    # Read where the pretraining part reads a PretrainRun's; the same for every reference row.
    graph_partition: ClassVar[bool] = True
    profile: ClassVar[bool] = False
    ds_config: ClassVar[str] = "none (transformers' ConvBERT, plain loop)"  # the table's DeepSpeed-file column
    sdconv: ClassVar[str] = "transformers'"  # its own conv (unfold)

    @property
    def limit_s(self) -> float:
        """Its time limit run on its own: as a trainer row's, for one compile in train_step."""
        return 270 if self.compile else 120

    @property
    def precision_label(self) -> str:
        return self.precision

    @property
    def compile_label(self) -> str:
        return "torch.compile" if self.compile else "off"

    def run_name(self, seq: int, batch: int) -> str:
        return f"reference_transformers_{self.preset}_{self.precision}_{self.compile_label.replace('.', '_')}_" \
               f"seq{seq}_batch{batch}"

    def command(self, shards: Path, seq: int, batch: int, steps: int, ready_file: Path, go_file: Path | None,
                cpu: bool) -> list[str]:
        """``benchmarks/train_step.py``'s arguments (after the script) for this row: ``steps`` timed steps of
        the transformers row alone, the ready file written once its warm-up steps (its compile) are done; the
        timed steps then wait for ``go_file`` (None: at once)."""
        return ["--rows", "transformers", "--preset", self.preset, "--batch", str(batch), "--seq", str(seq),
                "--steps", str(steps), "--precision", self.precision, "--ds-config", AUTOCAST,
                *(["--compile-step"] if self.compile else []), *(["--threads", "1"] if cpu else []),
                "--shards", str(shards), "--ready-file", str(ready_file),
                *(["--go-file", str(go_file)] if go_file else [])]


@dataclass
class ReferenceRow(StartedRow):
    """The reference row's run: ready once ``train_step.py`` has written its ready file (its warm-up steps,
    the compile among them, done); run beside others, it then waits for the go file (``runs_alone``) before
    its timed steps. Its figures come from what it printed; its peak GiB is its whole process's (our model and
    engine, built beside transformers' and left unused, among it: about 1 GiB at base)."""
    seq: int = 0

    @property
    def ready_file(self) -> Path:
        return self.run_dir / "ready"

    @property
    def go_file(self) -> Path:
        return self.run_dir / "go"

    def timing_began(self) -> bool:
        return self.ready_file.exists()

    def runs_alone(self) -> None:
        """The others are paused: its timed steps, which wait for the go file, begin now. None of them ran
        beside another row (though a paused row's last queued GPU work may still drain: one step's worth at
        most, in a median of 40)."""
        self.go_file.write_text("the other rows are paused\n")

    def figures(self, code: int, output: str, steps: int, warmup_rows: int) -> tuple[list[str], list[str]]:
        line = next((line for line in output.splitlines() if line.startswith("transformers ConvBERT ")), None)
        if code != 0 or line is None:  # beside the table: where it stood at its limit, or how it failed
            why = [] if code == -1 else where_it_stopped(output) if code == 124 else output.strip().splitlines()[-8:]
            return unfilled(verdict(code)), why
        # train_step's timing table: name, median step (s), samples/s, TFLOP/s, MFU
        _, samples, tflops, mfu = line[len("transformers ConvBERT"):].split()
        peak = next((line.split()[3] for line in output.splitlines() if line.startswith("peak GPU memory: ")), "-")
        return [f"{float(samples):,.0f}", f"{float(samples) * self.seq:,.0f}", f"{float(tflops):.1f}", mfu,
                self.first_step_cell, "-", peak], []


def partitioning_captured(spec: PretrainRun, graphs_of: dict[PretrainRun, str]) -> str:
    """Why a run without inductor's graph partitioning would tell nothing (empty: it would): the same run
    with partitioning (profiled or not) already recorded CUDA graphs; ``graphs_of``: the CUDA-graphs cell of
    each run so far. The row exists to find out why the partitioned step captured none, which inductor
    only says with partitioning off."""
    if spec.graph_partition:
        return ""
    twin = dataclasses.replace(spec, graph_partition=True, profile=False)
    cell = next((cell for run, cell in graphs_of.items()  # the reference rows (ReferenceRun) have no twin
                 if isinstance(run, PretrainRun) and dataclasses.replace(run, profile=False) == twin), "")
    captured = cell.split(" -> ")[-1].isdigit() and int(cell.split(" -> ")[-1]) > 0
    return f"the partitioned step recorded {cell} CUDA graphs" if captured else ""


# The most telling first (a 15-minute lease reaches the first four or five, four at a time; compiling base's whole step
# takes 120-190 s on a fresh H200, about 260 s with four compiling at once). The issue's figures, on the paper configs'
# path (the autocast file, the whole step compiled and captured by hand: what their cuda_graphs=auto picks on one GPU;
# the residual stream in bf16, model.overrides.residual_dtype=autocast; inductor's combo kernels, their
# train.compile_options): base with sdconv_impl=auto as the configs run it (the packed conv through inductor when
# compiled, model/depthwise.py) at configs/base.yaml's own global batch of 256, which one GPU runs as one micro-batch,
# profiled: where the step's time goes, kernel by kernel, and the baseline every other row of a lease is read against
# (leases run on different machines; 29.6% MFU on the 2026-11-30 H200); transformers' ConvBERT compiled in a plain loop
# at the same shape (the issue's ratio, in the same command as the MFU figure; its compile overlaps the others'); the
# same with its matmuls timed as Triton templates against cuBLAS, the GELU after the FFN's first matmul fused in as a
# template's epilogue where a template wins (train.compile_autotune=matmuls, profiled: the GELUs and their backwards are
# 6.8 ms of the step, the lever the queued ones leave; its timing runs while the step compiles, none at the first call);
# the same in fp16 (the fp16 row beside bf16: the same file, train.precision=fp16 makes autocast's dtype fp16 over the
# fp32 weights, with DeepSpeed's loss scaler, which it keeps for ZeRO-0 under autocast; the plan accepts the capture,
# one micro-batch a step); the same with the fused kernels' block sizes tuned (train.compile_autotune=kernels, profiled:
# inductor's elementwise and reduction kernels are 22.6 ms of its 63.5, the GELUs running at about 2.7-3 TB/s of the
# H200's 4.8; it has never reached its first step beside other compiles: its tuning runs in the captured step's
# warm-up); the same without combo kernels (their A/B: 3,901 against 3,947 samples/s on the 2026-11-30 H200, 3,864
# against 3,917 on the 2026-11-29 one); transformers' ConvBERT eager at that shape (the ratio's fallback, and what a
# user who does not compile runs); small and base at seq 512 (the issue asks for them beside base); max-autotune at
# batch 256 (profiled: what its matmul templates and fused epilogues change, the GELUs and their backwards being 6.8 ms
# of the step; its compile outlasted the 141 s one lease had left); base at the acceptance's batch of 128, profiled (the
# baseline of the early leases); the Triton conv forced (the A/B of the conv); the residual stream in fp32 as autocast
# leaves it (the A/B of the bf16 stream: 3,119 against 3,265 samples/s on the 2026-11-27 H200); ZeRO-1's bf16 weights,
# captured (no autocast casts, half the elementwise traffic; DeepSpeed's optimizer step outside the graphs); the paper
# path captured eager, which starts in seconds; each layer width compiled once (train.compile_layers_once: the same
# samples/s on the H200, its gradients checked there); inductor drawing dropout and sampling in its fused kernels
# (train.compile_random=inductor: 0.974x the eager draws' samples/s on the 2026-11-28 H200, profiled); programmatic
# dependent launch (train.compile_options.triton.enable_pdl: 3,902 against 3,901 samples/s on the 2026-11-30 H200, where
# each of inductor's kernels may start while the one before it drains). Then inductor's CUDA graphs instead of the
# capture (profiled), and without inductor's graph partitioning (run only when the partitioned step recorded no CUDA
# graph); eager (profiled); then what each other switch changes, one at a time, with the residual stream autocast leaves
# (the rows of earlier leases). Every compiled row of configs/PRESET.yaml takes its train.compile_options too (combo
# kernels).
PAPER_PATH = dict(ds_config=AUTOCAST, cuda_graphs="capture", residual="autocast")
GPU_RUNS = [PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, batch=256, profile=True),
            ReferenceRun("base", batch=256),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, batch=256, autotune="matmuls",
                        profile=True),
            PretrainRun("base", "fp16", "auto", True, "step", **PAPER_PATH, batch=256),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, batch=256, autotune="kernels",
                        profile=True),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, batch=256,
                        options=(("combo_kernels", False),), profile=True),
            ReferenceRun("base", batch=256, compile=False),
            PretrainRun("small", "bf16", "auto", True, "step", **PAPER_PATH),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, seq=512),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, batch=256, autotune=True, profile=True),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, profile=True),
            PretrainRun("base", "bf16", "triton", True, "step", **PAPER_PATH),
            PretrainRun("base", "bf16", "auto", True, "step", **{**PAPER_PATH, "residual": "fp32"}),
            PretrainRun("base", "bf16", "auto", True, "step", cuda_graphs="capture"),
            PretrainRun("base", "bf16", "auto", False, **PAPER_PATH),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, layers_once=True),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, random="inductor", profile=True),
            PretrainRun("base", "bf16", "auto", True, "step", **PAPER_PATH, batch=256,
                        options=(("triton.enable_pdl", True),), profile=True),
            PretrainRun("base", "bf16", "triton", True, "step", ds_config=AUTOCAST, profile=True),
            PretrainRun("base", "bf16", "triton", True, "step", ds_config=AUTOCAST, graph_partition=False),
            PretrainRun("base", "bf16", "triton", False, ds_config=AUTOCAST, profile=True),
            PretrainRun("small", "bf16", "triton", True, "step", **PAPER_PATH, seq=512),
            PretrainRun("base", "bf16", "triton", False), PretrainRun("small", "bf16", "triton", False),
            PretrainRun("base", "bf16", "torch", False), PretrainRun("base", "bf16", "triton", True),
            PretrainRun("base", "fp16", "triton", False), PretrainRun("small", "bf16", "torch", False),
            PretrainRun("base", "fp16", "triton", True), PretrainRun("small", "fp16", "triton", False),
            PretrainRun("base", "bf16", "torch", True)]
# Two eager rows, one profiled: the part's machinery (the table, the profile window, the run names) on the
# default file and on the paper configs' (bf16 autocast, the bf16 residual stream). No compiled row: on 2 CPU
# cores its compile took a third of the whole smoke run, and the compiled trainer has tests of its own
# (tests/engine/test_compile.py).
CPU_SMOKE_RUNS = [PretrainRun("tiny", "fp32", "torch", False, profile=True),
                  PretrainRun("tiny", "bf16", "torch", False, ds_config=AUTOCAST, residual="autocast"),
                  ReferenceRun("tiny", "fp32", compile=False)]
