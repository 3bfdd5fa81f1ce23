"""The training loop: a resolved ``RunPlan`` -> a DeepSpeed engine (plain or pipeline), its data, its
checkpoints (saved every ``checkpoint.interval`` steps and on SIGUSR1/SIGTERM) and its metrics."""

from __future__ import annotations

import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from convbert_ds.data.blending import describe_blend
from convbert_ds.data.loader import build_dataloader
from convbert_ds.engine import checkpoint, distributed
from convbert_ds.engine.compile_cache import CompileCache
from convbert_ds.engine.downstream_probe import DownstreamProbes
from convbert_ds.engine.flops import device_peak_tflops, training_flops_per_sample
from convbert_ds.engine.pipeline import build_pipeline_module, load_plain_state_dict, pipeline_batch, pipeline_metrics
from convbert_ds.engine.metrics_log import MetricsLog
from convbert_ds.engine.optimizer_step import OptimizerStep
from convbert_ds.engine.plan import RunPlan
from convbert_ds.engine.profiling import StepProfiler
from convbert_ds.engine.progress import RunProgress
from convbert_ds.engine.step_graphs import StepGraphs
from convbert_ds.engine.step_guard import StepGuard, Verdict
from convbert_ds.engine.universal import load_into
from convbert_ds.formats.checkpoint import directory as tags, universal
from convbert_ds.formats.init_dir import load_init_weights
from convbert_ds.formats.train_config import DownstreamSection
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.convbert import check_inputs
from convbert_ds.model.layers import compile_layers, compile_step, compiled_graph_count, probe_triton_kernels
from convbert_ds.model.optim import param_groups

EXIT_PREEMPTED = 3
# A checkpoint's record of its phase; a run without phase.continue_from is phase 1 with nothing before it.
FIRST_PHASE = {"index": 1, "samples_before": 0, "tokens_before": 0}


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite losses in a row); the message says how to resume."""


# The name train.py and job scripts know: it catches SIGUSR1/SIGTERM from the start (see step_guard.py).
Preemption = StepGuard


def format_line(step: int, steps: int, m: dict) -> str:
    parts = [f"step {step}/{steps}"]
    for key, label, fmt in (("loss", "loss", ".4f"), ("mlm_loss", "gen", ".4f"), ("rtd_loss", "disc", ".4f"),
                            ("mlm_accuracy", "mlm_acc", ".3f"), ("rtd_accuracy", "rtd_acc", ".3f"), ("lr", "lr", ".2e"),
                            ("grad_norm", "gnorm", ".3f"), ("samples_per_s", "samples/s", ".1f"),
                            ("tokens_per_s", "tok/s", ".0f"), ("tflops", "TFLOP/s", ".2f"), ("mfu", "MFU", ".1%"),
                            ("gpu_memory_gib", "GPU GiB", ".1f")):
        if m.get(key) is not None:
            parts.append(f"{label} {m[key]:{fmt}}")
    return " | ".join(parts)


class Trainer:
    def __init__(self, plan: RunPlan):
        self.plan, self.cfg = plan, plan.cfg
        self.electra, self.sets, self.grad_accum = plan.electra, plan.sets, plan.grad_accum
        self.precision, self.ds_config, self.pipelined = plan.precision, plan.ds_config, plan.pipelined

    # Setup (after the process group exists) -------------------------------------
    def _initial_plain_model(self):
        """The plain model, from published weights when ``model.init_from_hf`` is set."""
        model = ElectraForPretraining(self.electra)
        if self.cfg.model.init_from_hf:
            fresh = load_init_weights(model, self.cfg.model.init_from_hf)
            if dist.get_rank() == 0:
                print(f"initialised from {self.cfg.model.init_from_hf}; fresh: {len(fresh)} tensors "
                      f"({', '.join(fresh[:4])}{' ...' if len(fresh) > 4 else ''})", flush=True)
        return model

    def _build_model(self):
        model, t, cuda = self._build_uncompiled_model(), self.cfg.train, torch.cuda.is_available()
        self.graphs = StepGraphs(self.plan.cuda_graphs, t, cuda)  # a capture by hand: setup(), after the engine
        if (t.compile or self.graphs.mode == "capture") and cuda:
            # sdconv_impl=auto decides per layout by running the kernels once: eagerly, before tracing or
            # capturing.
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)
            probe_triton_kernels(model, torch.device("cuda", torch.cuda.current_device()), dtype)
        if t.compile and t.compile_mode == "step":
            compile_step(model, cuda_graphs=self.graphs.trees, layers_once=t.compile_layers_once,
                         autotune=t.compile_autotune, eager_random=t.compile_random == "eager",
                         options=self.plan.compile_options)
        elif t.compile:
            compile_layers(model, eager_random=t.compile_random == "eager", options=self.plan.compile_options)
        return model

    def _build_uncompiled_model(self):
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        if self.pipelined:
            module = build_pipeline_module(self.electra, cfg.pipeline.stages, cfg.pipeline.partition_method,
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

    def setup(self):
        cfg = self.cfg
        model = self._build_model()
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(
            model, cfg.train.weight_decay), config=self.ds_config)
        self.device = self.engine.device
        self.graphs.capture(self.engine.module, self.device, announce=dist.get_rank() == 0,
                            write_grads=self.plan.whole_fp32_grads, accumulates=self.grad_accum > 1)
        self.optimizer_step = None  # the pipeline engine steps inside train_batch
        if self.pipelined:
            self.dp_rank = self.engine.grid.get_data_parallel_rank()
            self.dp_size = self.engine.grid.get_data_parallel_world_size()
        else:
            self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
            self.optimizer_step = OptimizerStep(self.engine, self.plan.trainer_clip_norm, self.plan.zero_stage,
                                                self.dp_size, self.plan.whole_fp32_grads)
        # Before anything compiles (the first step): one writer per pipeline stage, whose graphs are its own.
        self.compile_cache = CompileCache.for_run(self.plan, self.engine.stage_id if self.pipelined else 0,
                                                  writes=self.dp_rank == 0, announce=self.dp_rank == 0)
        self.compile_cache.load()
        self.is_logger = dist.get_rank() == 0
        data = cfg.data  # data.sets is not read again: self.sets is what the plan parsed and checked
        loader = partial(build_dataloader, self.sets, seq_len=data.seq_len, micro_batch_size=self.plan.micro_batch_size,
                         seed=data.seed, dp_rank=self.dp_rank, dp_size=self.dp_size, cache_dir=data.cache_dir,
                         cache_limit_gb=data.cache_limit_gb,
                         progress=self.is_logger, size_exponent=data.size_exponent, pack_documents=data.pack_documents,
                         # Pinned batches copy to the GPU asynchronously (_to_device's non_blocking); a copy
                         # from pageable memory is staged by the driver, which may first wait for the stream.
                         pin_memory=self.device.type == "cuda")
        self.train_loader = loader("train", num_workers=data.num_workers)
        if self.is_logger:
            run_samples = cfg.train.steps * cfg.train.global_batch_size
            print(f"data: {run_samples:,} samples over the run ({cfg.train.steps:,} steps x "
                  f"{cfg.train.global_batch_size}):\n  "
                  + "\n  ".join(describe_blend(self.train_loader.dataset, run_samples)), flush=True)
        self.valid_loader = None
        if self.plan.has_valid and cfg.eval.samples > 0 and cfg.eval.interval > 0:  # never read otherwise
            self.valid_loader = loader("valid", max_samples=cfg.eval.samples)
        self.ckpt_dir = Path(cfg.checkpoint.dir)
        self.step, self.nonfinite_total = 0, 0
        self.phase = dict(FIRST_PHASE)  # which phase this run is, and what the earlier ones saw
        self._resume()
        if self.step == 0:  # a resumed run has its RNG states back from the checkpoint
            torch.manual_seed(cfg.train.seed + 1 + dist.get_rank())
        self.flops_per_sample = training_flops_per_sample(self.electra, cfg.data.seq_len)
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.peak_tflops = device_peak_tflops(name, cfg.train.peak_tflops)
        self.log = MetricsLog(cfg.log_dir, self.step, self.is_logger, cfg.log, run_config=cfg.to_dict())
        self.progress = RunProgress(self.step, cfg.train.steps)
        self.profiler = StepProfiler(cfg.train.profile, cfg.log_dir, dist.get_rank(), announce=self.is_logger)
        self.probes = DownstreamProbes(cfg.eval.downstream if self.is_logger else DownstreamSection(), cfg.log_dir,
                                       lambda step, row: self.log.write(step, row, prefix="downstream"))
        self.saves = checkpoint.RunSaves(self.engine, cfg.checkpoint, cfg.train.steps, self.is_logger,
                                         self.probes.after_save)

    def _resume(self):
        if dist.get_rank() == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            removed = tags.remove_incomplete(self.ckpt_dir)
            if removed:
                print(f"removed incomplete checkpoint(s) {removed} (an interrupted save)", flush=True)
        dist.barrier()
        tag = distributed.on_rank0(lambda: tags.choose_resume_tag(self.ckpt_dir, self.cfg.checkpoint.verify))
        if tag is None:
            if self.plan.continue_from is not None:
                self._start_phase(self.plan.continue_from)
            return
        state = tags.read_trainer_state(self.ckpt_dir / tag)
        self.phase = state.get("phase", self.phase)
        saved, now = universal.Layout.of_checkpoint(state), self.plan.layout
        if saved == now:  # the bit-exact path: every rank reads its own files
            checkpoint.load(self.engine, self.ckpt_dir, tag)
            changed = ""
        else:
            changed = self._load_other_layout(tag, saved)
        self.train_loader.load_state_dict(state["data"])
        self.step, self.nonfinite_total = state["step"], state.get("nonfinite_total", 0)
        if self.is_logger:
            print(f"resumed from {self.ckpt_dir / tag} at step {self.step} "
                  f"({state['data']['consumed_samples']} samples consumed){changed}", flush=True)
            before = state.get("config", {}).get("train", {}).get("global_batch_size")
            if before not in (None, self.cfg.train.global_batch_size):
                print(f"train.global_batch_size changed from {before} to {self.cfg.train.global_batch_size}: "
                      "the sample stream goes on where it stopped, each step now takes the new batch, and the "
                      "learning-rate schedule still counts steps", flush=True)

    def _start_phase(self, tag_dir: Path) -> None:
        """Begin a new phase from the previous one's checkpoint (``phase.continue_from``): its weights and
        (``phase.optimizer_state``) Adam's moments, in any layout; this run's step, schedule and data start at 0."""
        state = tags.read_trainer_state(tag_dir)

        def check() -> None:
            problem = tags.verify(tag_dir, self.cfg.checkpoint.verify)
            if problem is not None:
                raise tags.CheckpointError(f"phase.continue_from: {tag_dir} is damaged ({problem}); point "
                                                 "phase.continue_from at an older checkpoint of that run")

        distributed.on_rank0(check)
        self._convert_to_universal(tag_dir, universal.Layout.of_checkpoint(state))
        load_into(self.engine, tag_dir / tags.UNIVERSAL, self.electra, self.pipelined,
                            new_phase=True, moments=self.cfg.phase.optimizer_state)
        before = state.get("phase", FIRST_PHASE)
        # A checkpoint's counts are totals over its phase and every one before it.
        samples, tokens = state.get("samples_seen", 0), state.get("tokens_seen", 0)
        self.phase = {"index": before["index"] + 1, "samples_before": samples, "tokens_before": tokens,
                      "continued_from": str(tag_dir), "from_step": state["step"]}
        if self.is_logger:
            old_len = state.get("config", {}).get("data", {}).get("seq_len")
            print(f"phase {self.phase['index']}: continuing from {tag_dir} (its step {state['step']}, seq_len "
                  f"{old_len} -> {self.cfg.data.seq_len}, {tokens:,} tokens seen before); "
                  f"{'weights and Adam moments' if self.cfg.phase.optimizer_state else 'weights only'}, then "
                  f"{self.cfg.train.steps} steps of its own: new learning-rate schedule, new data order", flush=True)

    def _convert_to_universal(self, tag_dir: Path, saved: universal.Layout) -> None:
        """Rank 0 writes ``tag_dir/universal`` once (kept there for the next reader); every rank waits."""
        def convert() -> None:
            if not (tag_dir / tags.UNIVERSAL / universal.META).is_file():
                print(f"converting {tag_dir} ({saved}) to a universal checkpoint for {self.plan.layout}", flush=True)
            try:
                universal.convert(tag_dir, saved, self.electra)
            except OSError as error:  # e.g. no space for the copy: one line, not a traceback per rank
                raise universal.ReshapeError(f"cannot read {tag_dir} in another layout: {error}") from None

        distributed.on_rank0(convert)

    def _load_other_layout(self, tag: str, saved: universal.Layout) -> str:
        """Resume a checkpoint written in another layout through its universal copy (converted once by
        rank 0, kept beside the checkpoint for the next resume); returns the log line's addition."""
        tag_dir = self.ckpt_dir / tag
        self._convert_to_universal(tag_dir, saved)
        load_into(self.engine, tag_dir / tags.UNIVERSAL, self.electra, self.pipelined)
        # The saved random streams belong to the old ranks; new ones, the same on every rerun.
        seed = np.random.SeedSequence([self.cfg.train.seed, tags.step_of(tag), dist.get_rank()])
        torch.manual_seed(int(seed.generate_state(1)[0]))
        return (f"; layout changed: {saved} -> {self.plan.layout} (through {tag_dir / tags.UNIVERSAL}, kept "
                "for the next resume; random streams reseeded)")

    # The loop ---------------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        """Checked here, on the host copy, where reading token ids costs no device sync (the model is then
        called with ``check=False``)."""
        check_inputs(self.electra.discriminator, batch["input_ids"], batch.get("attention_mask"),
                     batch.get("token_type_ids"), batch.get("document_ids"))
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _forward(self, batch: dict):
        batch = self._to_device(batch)
        self.graphs.begin_step()
        return self.engine(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], check=False,
                           document_ids=batch.get("document_ids"))

    def _plain_step(self, batches, want_metrics: bool) -> dict:
        """One optimizer step; its metrics (mean over micro-batches) only when ``want_metrics``: reading them
        is a device sync, so only logging steps pay for it."""
        sums, count = {}, 0
        for _ in range(self.grad_accum):
            out = self._forward(next(batches))
            self.guard.record(out.loss)
            if self.guard.drops_nonfinite and not self._agreed_finite(out.loss):
                # Drop this micro-batch: a zero loss that touches every parameter keeps DeepSpeed's
                # gradient hooks in step, without back-propagating through non-finite activations.
                self.engine.backward(sum(p.sum() * 0.0 for p in self.engine.module.parameters()))
            else:
                self.engine.backward(out.loss)
                if want_metrics:
                    for key, value in out.metric_tensors().items():
                        sums[key] = sums[key] + value if key in sums else value
                    count += 1
            self.optimizer_step()
        if not sums:
            return {}
        values = (torch.stack(list(sums.values())) / count).tolist()  # the step's one read of its metrics
        return dict(zip(sums, values))

    def _agreed_finite(self, loss: torch.Tensor) -> bool:
        finite = torch.isfinite(loss.detach()).float()
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def _pipeline_step(self, batches, want_metrics: bool) -> dict:
        loss = self.engine.train_batch(data_iter=(pipeline_batch(self._to_device(b)) for b in batches))
        self.guard.record(loss)
        return pipeline_metrics(self.engine) if want_metrics else {}

    def evaluate(self) -> dict | None:
        if self.valid_loader is None:
            return None
        self.engine.eval()
        sums, count = defaultdict(float), 0
        # Evaluation draws its masks from a fixed seed, off the training RNG stream, so that
        # evaluating (or not) never changes training and every evaluation sees the same masks.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(self.cfg.data.seed + 7919 * (1 + self.dp_rank))
            if self.pipelined:
                batches = [pipeline_batch(self._to_device(b)) for b in self.valid_loader]
                if batches:
                    self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))
                    sums, count = pipeline_metrics(self.engine), 1
            else:
                for batch in self.valid_loader:
                    out = self._forward(batch)
                    for key, value in out.metric_tensors().items():
                        sums[key] = sums[key] + value if key in sums else value
                    count += 1
                sums, count = self._mean_over_ranks(sums, count), 1
        self.engine.train()
        return {k: v / max(count, 1) for k, v in sums.items()}

    def _mean_over_ranks(self, sums: dict, count: int) -> dict:
        keys = sorted(sums)
        # On the rank's device: NCCL reduces CUDA tensors only (a CPU tensor fails the first eval on GPUs).
        packed = torch.zeros(len(keys) + 1, dtype=torch.float64, device=self.device)
        if keys:
            packed[:-1] = torch.stack([sums[k] for k in keys])
        packed[-1] = count
        dist.all_reduce(packed)
        return {k: packed[i].item() / max(packed[-1].item(), 1) for i, k in enumerate(keys)}

    def save(self, final: bool = False) -> bool:
        """Save this step's checkpoint with the trainer's state (``RunSaves.save``); False when it failed."""
        state = {
            "step": self.step, "data": self.train_loader.state_dict(), "nonfinite_total": self.nonfinite_total,
            # Totals over every phase of the model (the checkpoint's model has seen all of them).
            "samples_seen": self.phase["samples_before"] + self.train_loader.consumed_samples,
            "tokens_seen": self.phase["tokens_before"] + self.train_loader.consumed_samples * self.cfg.data.seq_len,
            "phase": self.phase,
            "config": self.cfg.to_dict(), "electra_config": self.electra.to_dict(),
            # What the weights are stored in, which decides the files' layout (fp32 under torch autocast, whose
            # compute precision the saved config and DeepSpeed file give).
            "precision": self.plan.layout.precision,
            "pipeline_stages": self.cfg.pipeline.stages, "world_size": dist.get_world_size(),
            "zero_stage": self.plan.zero_stage,
            "tokenizer": self.plan.tokenizer, "data_sets": [{"path": str(p), "weight": w} for p, w in self.sets],
        }
        return self.saves.save(self.step, state, final)

    def _save_last(self) -> bool:
        """The run's last save (its end, a preemption), unless this step is saved already; False when it
        failed. A background save still in flight ends first: if it failed, this step is saved again."""
        self.saves.finish_background()
        return self.saves.saved_at == self.step or self.save(final=True)

    def train(self, guard: StepGuard) -> int:
        try:
            return self._train_steps(guard)
        finally:  # every way out (done, preempted, an error): profiles written, TensorBoard flushed, W&B finished
            self.profiler.close()
            self.log.close()

    def _train_steps(self, guard: StepGuard) -> int:
        cfg, t = self.cfg, self.cfg.train
        self.guard = guard
        guard.start(self.device, t.nonfinite_check_interval, t.max_nonfinite_in_a_row,
                    skips_nonfinite=self.precision == "fp16")
        # Counted from this process's first step, not the run's: a resumed run compiles and records anew.
        self.graphs.start(self.step)
        batches = iter(self.train_loader)
        self.saves.saved_at, checked_at = self.step, self.step
        # Throughput is measured between logging steps, whose metric read waits for the device: between
        # them the host runs ahead of the GPU, so one step's host time says nothing.
        timed_from, timed_step = time.perf_counter(), self.step
        while self.step < t.steps:
            self.profiler.begin_step(self.step + 1)
            logging = (self.step + 1) % cfg.log.interval == 0 or self.step + 1 in (1, t.steps)
            metrics = (self._pipeline_step if self.pipelined else self._plain_step)(batches, logging)
            self.step += 1
            self.profiler.end_step(self.step)
            self.probes.poll()
            interval_save = self.step % cfg.checkpoint.interval == 0 and self.step < t.steps
            verdict = guard.end_step(self.step, before_save=interval_save or self.step == t.steps)
            if verdict.checked:
                self._stop_if_nonfinite(verdict, checked_at)
                checked_at = self.step
            if logging:
                now = time.perf_counter()
                self._log_step(metrics, (now - timed_from) / (self.step - timed_step))
                timed_from, timed_step = now, self.step
            evaluating = cfg.eval.interval and self.step % cfg.eval.interval == 0
            if evaluating:
                self._log_eval()
            self.compile_cache.after_step()  # writes only when this process has built more graphs
            # A failed save leaves saved_at behind: the next interval, or the run's last save, tries again.
            if interval_save:
                self.save()
            else:
                self.saves.poll()  # a background save is said when it ends, not at the next save
            if evaluating or interval_save:  # not training time: the next throughput starts after them
                timed_from, timed_step = time.perf_counter(), self.step
            if verdict.preempted:
                if not self._save_last():
                    return checkpoint.EXIT_NOT_SAVED
                if self.is_logger:
                    print(f"preempted at step {self.step}: checkpoint saved, exiting with {EXIT_PREEMPTED}",
                          flush=True)
                    self._print_summary()
                return EXIT_PREEMPTED
        saved = self._save_last()
        if cfg.eval.interval and self.step % cfg.eval.interval:
            self._log_eval()
            self.compile_cache.after_step()
        self.probes.wait()
        if self.is_logger:
            self._print_summary()
        return 0 if saved else checkpoint.EXIT_NOT_SAVED

    def _stop_if_nonfinite(self, verdict: Verdict, checked_at: int) -> None:
        self.nonfinite_total += verdict.nonfinite
        if not self.guard.must_stop(verdict):
            return
        fix = "with a lower train.lr, or train.precision=bf16 instead of fp16"
        if self.guard.drops_nonfinite or self.guard.skips_nonfinite:
            raise TrainingError(f"{verdict.worst_in_a_row} steps in a row had a non-finite loss (by step {self.step})"
                                f"; stopping. Resume from {self.ckpt_dir} {fix}")
        raise TrainingError(
            f"{verdict.nonfinite} micro-batch(es) had a non-finite loss in steps {checked_at + 1}-{self.step} and "
            f"{self.precision} does not skip their updates; stopping before any checkpoint holds them. Resume from "
            f"{self.ckpt_dir} (its last checkpoint predates them) {fix} (train.nonfinite_check_interval=1 drops "
            "such micro-batches instead, at a device sync each)")

    def _print_summary(self) -> None:
        samples = self.train_loader.consumed_samples  # this phase's, resumed runs included
        print(self.progress.summary(self.step, samples, samples * self.cfg.data.seq_len), flush=True)

    def _log_step(self, metrics: dict, step_seconds: float) -> None:
        t = self.cfg.train
        samples_per_s = t.global_batch_size / step_seconds
        tflops = self.flops_per_sample * samples_per_s / dist.get_world_size() / 1e12
        grad_norm = self.optimizer_step.norm if self.plan.trainer_clip_norm else self.engine.get_global_grad_norm()
        metrics = {**metrics, "lr": self.engine.get_lr()[0],
                   "grad_norm": float(grad_norm) if grad_norm is not None else None,
                   "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * self.cfg.data.seq_len,
                   "tflops": tflops, "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
                   "nonfinite_total": self.nonfinite_total,
                   "consumed_samples": self.train_loader.consumed_samples,
                   # Constant after warm-up; growing means something recompiles every step.
                   "compiled_graphs": compiled_graph_count() if t.compile else None,
                   "cuda_graphs": self.graphs.recorded(),
                   # The most this process's allocator has held since it started (the allocator's own count:
                   # no device sync): what a larger batch, or another process on the GPU, has left to use.
                   "gpu_memory_gib": (torch.cuda.max_memory_reserved(self.device) / 2**30
                                      if self.device.type == "cuda" else None)}
        self.graphs.check(self.step, metrics["cuda_graphs"], announce=self.is_logger)
        if self.is_logger:
            print(f"{self.progress.prefix()} {format_line(self.step, t.steps, metrics)} | "
                  f"{self.progress.suffix(self.step)}", flush=True)
        self.progress.record_step(metrics)
        self.log.write(self.step, {k: v for k, v in metrics.items() if v is not None})

    def _log_eval(self) -> None:
        metrics = self.evaluate()
        if metrics is None:
            return
        if self.is_logger:
            print(f"{self.progress.prefix()} eval step {self.step} | "
                  + " | ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
                  + f" | {self.progress.suffix(self.step)}", flush=True)
        self.progress.record_eval(metrics)
        self.log.write(self.step, metrics, prefix="valid")
