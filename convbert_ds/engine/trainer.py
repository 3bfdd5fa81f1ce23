"""The training run: a resolved ``RunPlan`` -> a DeepSpeed engine (plain or pipeline), its data, the
checkpoint it resumes from, and the step loop (checkpoints every ``checkpoint.interval`` steps and on
SIGUSR1/SIGTERM, evaluation, logging, profiling, downstream probes, the compile cache).

The loop is a list of calls: each component decides itself whether it is due at a step (``due(step)``) and
keeps its own timers and counters. What a step does is ``train_step.py``; where a run starts, ``resume.py``."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from convbert_ds.data.blending import describe_blend
from convbert_ds.data.loader import build_dataloader
from convbert_ds.engine import checkpoint
from convbert_ds.engine.checkpoint_disk import probe as probe_checkpoint_disk
from convbert_ds.engine.compile_cache import CompileCache
from convbert_ds.engine.downstream_probe import DownstreamProbes
from convbert_ds.engine.evaluation import Evaluation
from convbert_ds.engine.flops import device_peak_tflops, training_flops_per_sample
from convbert_ds.engine.metrics_log import MetricsLog
from convbert_ds.engine.optimizer_step import OptimizerStep
from convbert_ds.engine.pipeline import build_pipeline_module, load_plain_state_dict
from convbert_ds.engine.plan import RunPlan
from convbert_ds.engine.profiling import StepProfiler
from convbert_ds.engine.progress import RunProgress
from convbert_ds.engine.resume import resume
from convbert_ds.engine.step_graphs import StepGraphs
from convbert_ds.engine.step_guard import EXIT_PREEMPTED, StepGuard, TrainingError, Verdict
from convbert_ds.engine.step_log import StepLog
from convbert_ds.engine.train_step import TrainStep
from convbert_ds.formats.checkpoint.run_state import RunState
from convbert_ds.formats.init_dir import load_init_weights
from convbert_ds.formats.train_config import DownstreamSection
from convbert_ds.log import get_logger, rank as log_rank
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.layers import compile_layers, compile_step, probe_triton_kernels
from convbert_ds.model.optim import param_groups

__all__ = ["EXIT_PREEMPTED", "Preemption", "Trainer", "TrainingError"]

log = get_logger(__name__)

# The name train.py and job scripts know: it catches SIGUSR1/SIGTERM/SIGINT from the start (see step_guard.py).
Preemption = StepGuard


class Trainer:
    """``setup()`` builds what a run holds, in the order its parts depend on each other; ``train(guard)``
    runs the step loop from the position ``setup`` resumed, and returns the process's exit code."""

    def __init__(self, plan: RunPlan):
        self.plan, self.cfg = plan, plan.cfg
        self.ckpt_dir = Path(plan.cfg.checkpoint.dir)
        self.step = 0

    # Set-up: each call takes what the calls before it made ------------------------------------------------
    def setup(self) -> None:
        # First, before minutes of building: node-local checkpoint disks without a mirror stop the run here.
        self.disk = probe_checkpoint_disk(self.ckpt_dir, self.cfg.checkpoint.mirror)
        model, self.graphs = self._build_model()
        self.engine = self._start_engine(model)
        # Before anything compiles (the first step): one writer per pipeline stage, whose graphs are its own.
        self.compile_cache = CompileCache.for_run(self.plan, self.engine.stage_id if self.plan.pipelined else 0,
                                                  writes=self.dp_rank == 0)
        self.compile_cache.load()
        self.train_loader, self.valid_loader = self._loaders()
        self.position = resume(self.plan, self.engine, self.train_loader, self.disk)
        self.step = self.position.step
        if self.step == 0:  # a resumed run has its RNG states back from the checkpoint
            torch.manual_seed(self.cfg.train.seed + 1 + dist.get_rank())

    def _build_model(self) -> tuple[torch.nn.Module, StepGraphs]:
        """The model, compiled as the CUDA-graph mode the plan chose needs (a capture by hand comes later,
        once the engine has placed the parameters)."""
        model, t, cuda = self._uncompiled_model(), self.cfg.train, torch.cuda.is_available()
        graphs = StepGraphs(self.plan.cuda_graphs, t, cuda)
        if (t.compile or graphs.mode == "capture") and cuda:
            # sdconv_impl=auto decides per layout by running the kernels once: eagerly, before tracing or
            # capturing.
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.plan.precision, torch.float32)
            probe_triton_kernels(model, torch.device("cuda", torch.cuda.current_device()), dtype)
        if t.compile and t.compile_mode == "step":
            compile_step(model, cuda_graphs=graphs.trees, layers_once=t.compile_layers_once,
                         autotune=t.compile_autotune, eager_random=t.compile_random == "eager",
                         options=self.plan.compile_options)
        elif t.compile:
            compile_layers(model, eager_random=t.compile_random == "eager", options=self.plan.compile_options)
        return model, graphs

    def _uncompiled_model(self) -> torch.nn.Module:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        if self.plan.pipelined:
            module = build_pipeline_module(self.plan.electra, cfg.pipeline.stages, cfg.pipeline.partition_method,
                                           activation_checkpoint_interval=1 if cfg.train.activation_checkpointing
                                           else 0, seed=cfg.train.seed, packed=cfg.data.pack_documents)
            if cfg.model.init_from_hf:
                load_plain_state_dict(module, self._initial_plain_model().state_dict())
            return module
        model = self._initial_plain_model()
        for module in model.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = cfg.train.activation_checkpointing
        return model

    def _initial_plain_model(self) -> ElectraForPretraining:
        """The plain model, from published weights when ``model.init_from_hf`` is set."""
        model, init = ElectraForPretraining(self.plan.electra), self.cfg.model.init_from_hf
        if init:
            fresh = load_init_weights(model, init)
            log.info(f"initialised from {init}; fresh: {len(fresh)} tensors "
                     f"({', '.join(fresh[:4])}{' ...' if len(fresh) > 4 else ''})")
        return model

    def _start_engine(self, model: torch.nn.Module):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(
            model, self.cfg.train.weight_decay), config=self.plan.ds_config, lr_scheduler=self.plan.lr_schedule)
        # After the engine has put the parameters where they stay: a capture records their addresses.
        self.graphs.capture(engine.module, engine.device, write_grads=self.plan.whole_fp32_grads,
                            accumulates=self.plan.grad_accum > 1)
        if self.plan.pipelined:
            self.dp_rank = engine.grid.get_data_parallel_rank()
            self.dp_size = engine.grid.get_data_parallel_world_size()
            self.optimizer_step = None  # the pipeline engine steps inside train_batch
        else:
            self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
            self.optimizer_step = OptimizerStep(engine, self.plan.trainer_clip_norm, self.plan.zero_stage,
                                                self.dp_size, self.plan.whole_fp32_grads)
        return engine

    def _loaders(self):
        """The training loader, and the validation one when the run evaluates (else None)."""
        cfg, data = self.cfg, self.cfg.data  # data.sets is not read again: plan.sets is what the plan checked
        loader = partial(build_dataloader, self.plan.sets, seq_len=data.seq_len,
                         micro_batch_size=self.plan.micro_batch_size, seed=data.seed, dp_rank=self.dp_rank,
                         dp_size=self.dp_size, cache_dir=data.cache_dir, cache_limit_gb=data.cache_limit_gb,
                         progress=dist.get_rank() == 0, size_exponent=data.size_exponent,
                         pack_documents=data.pack_documents,
                         # Pinned batches copy to the GPU asynchronously (TrainStep.to_device's non_blocking); a
                         # copy from pageable memory is staged by the driver, which may first wait for the stream.
                         pin_memory=self.engine.device.type == "cuda")
        train = loader("train", num_workers=data.num_workers)
        run_samples = cfg.train.steps * cfg.train.global_batch_size
        if log_rank() == 0:  # describe_blend reads every sample index: the one rank that prints it pays for it
            log.info(f"data: {run_samples:,} samples over the run ({cfg.train.steps:,} steps x "
                     f"{cfg.train.global_batch_size}):\n  " + "\n  ".join(describe_blend(train.dataset, run_samples)))
        evaluates = self.plan.has_valid and cfg.eval.samples > 0 and cfg.eval.interval > 0
        return train, loader("valid", max_samples=cfg.eval.samples) if evaluates else None

    # The step loop ------------------------------------------------------------------------------------------
    def train(self, guard: StepGuard) -> int:
        self._start_loop(guard)
        try:
            return self._train_steps()
        finally:  # every way out (done, preempted, an error): profiles written, TensorBoard flushed, W&B finished
            self.profiler.close()
            self.metrics_log.close()

    def _start_loop(self, guard: StepGuard) -> None:
        """The loop's components, each counting from the step the run resumed at."""
        cfg, step, rank0 = self.cfg, self.step, dist.get_rank() == 0
        self.guard = guard
        guard.start(self.engine.device, cfg.train, self.plan.precision, step, self.position.nonfinite_total,
                    self.ckpt_dir)
        self.graphs.start(step)  # counted from this process's first step: a resumed run records anew
        self.train_step = TrainStep(self.engine, self.plan.electra.discriminator, guard, self.graphs,
                                    self.optimizer_step, self.plan.grad_accum, self.plan.pipelined)
        self.metrics_log = MetricsLog(cfg.log_dir, step, rank0, cfg.log, run_config=cfg.to_dict())
        self.progress = RunProgress(step, cfg.train.steps)
        self.step_log = StepLog(cfg, training_flops_per_sample(self.plan.electra, cfg.data.seq_len),
                                device_peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available()
                                                   else "cpu", cfg.train.peak_tflops),
                                self.engine, self._grad_norm, self._counts, self.graphs, self.progress,
                                self.metrics_log, step)
        self.evaluation = Evaluation(self.train_step, self.valid_loader, cfg.eval.interval, cfg.data.seed,
                                     self.dp_rank, self.progress, self.metrics_log)
        self.profiler = StepProfiler(cfg.train.profile, cfg.log_dir, dist.get_rank())
        self.probes = DownstreamProbes(cfg.eval.downstream if rank0 else DownstreamSection(), cfg.log_dir,
                                       partial(self.metrics_log.write, prefix="downstream"))
        # A save queues a probe of the checkpoint it wrote.
        self.saves = checkpoint.RunSaves(self.engine, cfg.checkpoint, cfg.train.steps, self.probes.after_save,
                                         self.disk)
        self.saves.start(step)

    def _train_steps(self) -> int:
        batches = iter(self.train_loader)
        while self.step < self.cfg.train.steps:
            if self._step(batches).preempted:
                return self._preempted()
        saved = self.saves.save_last(self.step, self.run_state)
        if self.evaluation.run_last(self.step):
            self.compile_cache.after_step()  # the final evaluation may have compiled graphs
        self.probes.wait()
        self._summary()
        return 0 if saved else checkpoint.EXIT_NOT_SAVED

    def _step(self, batches) -> Verdict:
        """One optimizer step, then every component that is due at it, in this order."""
        step = self.step + 1
        logging = self.step_log.due(step)  # asked first: only logging steps read their metrics
        self.profiler.begin_step(step)
        metrics = self.train_step.step(batches, logging)
        self.step = step
        self.profiler.end_step(step)
        self.probes.poll()
        saving = self.saves.due(step)
        # Stops the run (TrainingError) on non-finite losses before a checkpoint could hold them.
        verdict = self.guard.end_step(step, before_save=saving or step == self.cfg.train.steps)
        if logging:
            self.step_log.write(step, metrics)
        evaluating = self.evaluation.due(step)
        if evaluating:
            self.evaluation.run(step)
        self.compile_cache.after_step()  # writes only when this process has built more graphs
        if saving:  # a failed save is retried at the next interval, or by the run's last save
            self.saves.save(step, self.run_state(), final=False)
        else:
            self.saves.poll()  # a background save is said when it ends, not at the next save
        if evaluating or saving:  # not training time: the next throughput starts after them
            self.step_log.pause(step)
        return verdict

    def _preempted(self) -> int:
        if not self.saves.save_last(self.step, self.run_state):
            return checkpoint.EXIT_NOT_SAVED
        log.info(f"preempted at step {self.step}: checkpoint saved, exiting with {EXIT_PREEMPTED}")
        self._summary()
        return EXIT_PREEMPTED

    # What the loop reads of the run -------------------------------------------------------------------------
    def run_state(self) -> RunState:
        """What a checkpoint records of the run besides DeepSpeed's states (``trainer_state.json``)."""
        cfg, phase, consumed = self.cfg, self.position.phase, self.train_loader.consumed_samples
        return RunState(
            step=self.step, data=self.train_loader.state_dict(), nonfinite_total=self.guard.nonfinite_total,
            # Totals over every phase of the model (the checkpoint's model has seen all of them).
            samples_seen=phase.samples_before + consumed, tokens_seen=phase.tokens_before + consumed * cfg.data.seq_len,
            phase=phase, config=cfg.to_dict(), electra_config=self.plan.electra.to_dict(),
            # What the weights are stored in, which decides the files' layout (fp32 under torch autocast, whose
            # compute precision the saved config and DeepSpeed file give).
            precision=self.plan.layout.precision, pipeline_stages=cfg.pipeline.stages,
            world_size=dist.get_world_size(), zero_stage=self.plan.zero_stage, tokenizer=self.plan.tokenizer,
            data_sets=[{"path": str(p), "weight": w} for p, w in self.plan.sets])

    def _grad_norm(self):
        return self.optimizer_step.norm if self.plan.trainer_clip_norm else self.engine.get_global_grad_norm()

    def _counts(self) -> dict:
        return {"nonfinite_total": self.guard.nonfinite_total, "consumed_samples": self.train_loader.consumed_samples}

    def _summary(self) -> None:
        samples = self.train_loader.consumed_samples  # this phase's, resumed runs included
        log.info(self.progress.summary(self.step, samples, samples * self.cfg.data.seq_len))
