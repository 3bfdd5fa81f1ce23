"""The training step's CUDA graphs (``train.cuda_graphs``): which kind a run asks for, what was recorded,
and a warning when inductor was asked and recorded none.

- ``inductor``, with ``train.compile_mode: step`` on a GPU: ``compile_step``'s ``reduce-overhead`` trees.
  Each step begins with ``cudagraph_mark_step_begin`` (a replay may reuse the last one's output memory:
  the previous micro-batch is done with it).
- ``capture``: the step recorded by hand at its first training call (``model/step_capture.py``); where
  ``.grad`` is what the optimizer reads (``plan.whole_fp32_grads``), the backward graph writes it, and
  adds to it over a step's micro-batches.
- Neither: the step launches its kernels one by one.
"""

from __future__ import annotations

import torch

from convbert_ds.formats.train_config import TrainSection
from convbert_ds.log import get_logger
from convbert_ds.model.layers import cuda_graphs_recorded, cudagraph_skips
from convbert_ds.model.step_capture import CapturedStep, capture_step

log = get_logger(__name__)


class StepGraphs:
    def __init__(self, mode: str, train: TrainSection, cuda: bool):
        """``mode``: ``train.cuda_graphs`` as the plan resolved it (inductor, capture or off)."""
        self.mode = mode
        self.trees = train.compile and train.compile_mode == "step" and cuda and mode == "inductor"
        self.captured: CapturedStep | None = None
        self.check_at: int | None = None

    def capture(self, model: torch.nn.Module, device: torch.device, write_grads: bool, accumulates: bool) -> None:
        """With ``capture``: make ``model`` record its step (call it once the engine has put the parameters
        where they stay); without CUDA, say that the run goes without. ``write_grads``: the graphs write
        ``.grad`` themselves (``plan.whole_fp32_grads``); ``accumulates``: several micro-batches per step
        (see ``model/step_capture.py``)."""
        if self.mode != "capture":
            return
        if device.type == "cuda":
            self.captured = capture_step(model, write_grads, accumulates)
        else:
            log.info("note: train.cuda_graphs=capture: no CUDA device, so the step runs without CUDA graphs")

    def begin_step(self) -> None:
        if self.trees:
            torch.compiler.cudagraph_mark_step_begin()

    def start(self, step: int) -> None:
        """The process's first step is ``step`` + 1; the trees record on a function's second call, so the
        check comes 3 steps on (a resumed run is not warned about before its graphs could be recorded)."""
        self.check_at = step + 3 if self.trees else None

    def recorded(self) -> int | None:
        """Forward, backward and evaluation graphs (more when inductor partitions one; 2 when captured by
        hand, 3 with several micro-batches a step); 0: none; None: none asked for."""
        if self.trees:
            return cuda_graphs_recorded()
        return self.captured.graphs if self.captured else None

    def check(self, step: int, recorded: int | None) -> None:
        """Say so, once, when the compiled step asked inductor for CUDA graphs and none was recorded by the
        check step: the run goes on, kernel by kernel."""
        if recorded is None or self.check_at is None or step < self.check_at:
            return
        self.check_at = None
        if recorded == 0:
            log.warning(f"warning: train.compile_mode=step: no CUDA graph was captured by step {step} (inductor "
                  f"reported {cudagraph_skips()} skip(s)); the compiled step launches its kernels one by one. "
                  "TORCH_LOGS=cudagraphs prints the reasons inductor gives; with TORCHINDUCTOR_GRAPH_PARTITION=0 "
                  "it also gives the reasons graph partitioning keeps to itself. train.cuda_graphs=capture "
                  "captures the step by hand instead")
