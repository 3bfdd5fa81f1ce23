"""``train.cuda_graphs: capture``: the ELECTRA step's forward and backward captured by hand as two CUDA graphs.

On a fast GPU the step is thousands of small kernels and the host cannot queue them as fast as the device
runs them. Inductor's CUDA-graph trees (``compile_step``'s ``reduce-overhead``) remove that cost only where
inductor decides to capture, and it may decide not to without a word. This route does not ask: at the first
training call ``capture_step`` records the whole forward (masking, both bodies, sampling, losses) and its
backward with ``torch.cuda.make_graphed_callables``; every later call copies the batch into the graph's
input memory and replays. The model may be eager or compiled (inductor's kernels are captured like any
other); a parameter update then costs the optimizer's own launches (one fused AdamW) plus two replays.

What the capture relies on, which the step was built for: no host read inside it (static masking, inputs
checked on the host), one batch shape, randomness from torch's CUDA generator (a replay draws from the
generator's current state, as eager would). What it imposes:

- The outputs and the gradients live in the graphs' memory and are overwritten by the next replay. The
  trainer reads a step's outputs before its next forward, and steps once per micro-batch: gradient
  accumulation would keep the first micro-batch's gradients in memory that the second overwrites, so the
  plan refuses it (as it refuses the pipeline engine, ZeRO-3 and activation checkpointing).
- A call the graphs do not fit (evaluation, no grad, another batch shape, packed documents appearing or
  going) runs the uncaptured forward: correct, at eager cost.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from convbert_ds.model.electra import PretrainingOutput

_FIELDS = [f.name for f in dataclasses.fields(PretrainingOutput)]


class _StepTensors(nn.Module):
    """The step as ``make_graphed_callables`` takes it: tensors in, a tuple of tensors out; the model as a
    submodule, so that its parameters are the graphed backward's inputs."""

    def __init__(self, model: nn.Module, forward):
        super().__init__()
        self.model, self.step_forward = model, forward
        self.fields: list[str] = []  # the output's fields that are set (3 for the MLM objective, 8 for ELECTRA)

    def forward(self, input_ids, attention_mask, token_type_ids, document_ids=None):
        out = self.step_forward(input_ids, attention_mask, token_type_ids, check=False, document_ids=document_ids)
        self.fields = [name for name in _FIELDS if getattr(out, name) is not None]
        return tuple(getattr(out, name) for name in self.fields)


class CapturedStep:
    """Stands in for ``model.forward`` (see ``capture_step``)."""

    def __init__(self, model: nn.Module, forward):
        self.model, self.uncaptured = model, forward
        self.graphed, self.signature, self.fields = None, None, None
        self.warned = False

    @property
    def graphs(self) -> int:
        """CUDA graphs captured: the forward's and the backward's once the first training call has run."""
        return 0 if self.graphed is None else 2

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, check=True, document_ids=None):
        if not (self.model.training and torch.is_grad_enabled()) or check or attention_mask is None \
                or token_type_ids is None or not input_ids.is_cuda:
            return self.uncaptured(input_ids, attention_mask, token_type_ids, check=check, document_ids=document_ids)
        args = (input_ids, attention_mask, token_type_ids) + (() if document_ids is None else (document_ids,))
        signature = tuple((tuple(a.shape), a.dtype) for a in args)
        if self.graphed is None:
            try:
                self._capture(args, signature)
            except RuntimeError as error:  # torch's message says what broke the capture; this says what to do
                raise RuntimeError(f"train.cuda_graphs=capture: capturing the training step failed ({error}); "
                                   "run with train.cuda_graphs=inductor or off") from error
        elif signature != self.signature:
            self._warn_once(signature)
            return self.uncaptured(*args[:3], check=False, document_ids=document_ids)
        values = self.graphed(*args)
        # Only ``loss`` is differentiable (the graphed function marks every float output so).
        return PretrainingOutput(**{name: value if name == "loss" else value.detach()
                                    for name, value in zip(self.fields, values)})

    def _capture(self, args: tuple, signature: tuple) -> None:
        # Static input memory of the graphs: copies, so that the caller's tensors stay the caller's.
        sample = tuple(a.clone() for a in args)
        step = _StepTensors(self.model, self.uncaptured)
        # The warm-up iterations and the capture draw random numbers: the run's stream is put back after,
        # so that the first replay draws what the first eager step would (and a resume sees the same stream).
        # The autocast cache would hold casts made while capturing: make_graphed_callables refuses it.
        device = args[0].device
        with torch.random.fork_rng(devices=[device]), torch.autocast(
                "cuda", dtype=torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"),
                cache_enabled=False):
            self.graphed = torch.cuda.make_graphed_callables(step, sample, allow_unused_input=True)
        self.signature, self.fields = signature, step.fields

    def _warn_once(self, signature: tuple) -> None:
        if not self.warned:
            self.warned = True
            print(f"warning: train.cuda_graphs=capture: a training batch of shapes {[s for s, _ in signature]} "
                  f"differs from the captured {[s for s, _ in self.signature]}; such batches run uncaptured",
                  file=sys.stderr, flush=True)


def capture_step(model: nn.Module) -> CapturedStep:
    """Make ``model`` (an ``ElectraForPretraining``, eager or after ``compile_step``) capture its training
    step as CUDA graphs at its first training call and replay them after. Call it once the parameters are
    where training keeps them (after the engine is built): the graphs read them at fixed addresses.
    Returns the stand-in, whose ``graphs`` says what was captured."""
    captured = CapturedStep(model, model.forward)
    model.forward = captured
    return captured
