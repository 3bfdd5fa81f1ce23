"""``train.cuda_graphs: capture``: the ELECTRA step's forward and backward captured by hand as CUDA graphs.

On a fast GPU the step is thousands of small kernels and the host cannot queue them as fast as the device
runs them. Inductor's CUDA-graph trees (``compile_step``'s ``reduce-overhead``) remove that cost only where
inductor decides to capture, and it may decide not to without a word. This route does not ask: at the first
training call ``capture_step`` records the whole forward (masking, both bodies, sampling, losses) and its
backward, in one memory pool; every later call copies the batch into the graphs' input memory and replays.
The model may be eager or compiled (inductor's kernels are captured like any other).

Where the gradients go (``write_grads``):

- ``True``: the backward graph writes each parameter's gradient into memory of its own, and that memory
  *is* ``param.grad``. Autograd then runs one node for the whole step and none per parameter: no
  ``AccumulateGrad`` per tensor, whose node calls cost host time every step to hand over gradients that
  were already in place (benchmarks/RESULTS.md#row-no-accumulate-grad). For layouts where ``.grad`` is
  what the optimizer reads (``plan.whole_fp32_grads``: ZeRO-0, fp32 weights, no fp16 loss scale). As
  autograd would, a backward writes the gradients where ``.grad`` is None (cleared after each optimizer
  step: DeepSpeed's ``zero_grad`` and torch's default do that) and, with ``accumulates`` (several
  micro-batches per optimizer step), adds them where ``.grad`` still holds the step's earlier micro-batches'
  (a third graph, recorded from the same forward, adds in place). Gradients autograd put in ``.grad``
  itself (the zeros of a micro-batch the trainer drops) are added to as well, at the cost of a copy.
- ``False``: the backward graph's gradients go back through autograd, one ``AccumulateGrad`` per parameter,
  so the hooks that ZeRO-1/2 and DeepSpeed's own mixed precision hang there still run. ``.grad`` then
  aliases the graph's memory, which the next replay overwrites: one micro-batch per optimizer step only.

What the capture relies on, which the step was built for: no host read inside it (static masking, inputs
checked on the host), one batch shape, randomness from torch's CUDA generator (a replay draws from the
generator's current state, as eager would). What it imposes:

- The outputs live in the graphs' memory and are overwritten by the next replay: the trainer reads a
  micro-batch's outputs before its next forward. The plan refuses what the graphs cannot replay (the
  pipeline engine, ZeRO-3, activation checkpointing, several micro-batches a step without ``write_grads``).
- A call the graphs do not fit (evaluation, no grad, another batch shape, packed documents appearing or
  going) runs the uncaptured forward: correct, at eager cost.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Protocol

import torch
from torch import nn

from convbert_ds.model.electra import PretrainingOutput
from convbert_ds.model.layers import is_training_call

_FIELDS = [f.name for f in dataclasses.fields(PretrainingOutput)]
WARMUP_CALLS = 3  # as torch's make_graphed_callables: lazy initialisation (cuBLAS, autotuning) stays out of the graphs


class Recorder(Protocol):
    """How a step is recorded and replayed: ``record(fn)`` runs ``fn`` once, recording it, and returns its
    result and a replay that reruns the recorded work into the result's memory."""

    def warm_up(self, fn: Callable[[], object]) -> None: ...

    def record(self, fn: Callable[[], object]) -> tuple[object, Callable[[], None]]: ...


class CudaGraphRecorder:
    """CUDA graphs sharing one memory pool; recorded in the order they first replay (forward, backward, then
    the adding backward), so that a replay never overwrites memory a later one still reads."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], object]) -> None:
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(WARMUP_CALLS):
                fn()
        torch.cuda.synchronize()

    def record(self, fn: Callable[[], object]) -> tuple[object, Callable[[], None]]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            result = fn()
        return result, graph.replay


class _Graphs:
    """The recorded forward and backward and their fixed memory: the inputs, the outputs, the incoming
    gradient of the loss, the parameters' gradients. ``write_grads`` and ``adds`` (``accumulates``): see the
    module's docstring; with ``adds`` a third graph adds the gradients to those in place."""

    def __init__(self, step: Callable, args: tuple, params: list[nn.Parameter], recorder: Recorder,
                 write_grads: bool, adds: bool):
        self.params, self.write_grads = params, write_grads
        # What ``_Replay`` takes besides the batch: the parameters when autograd is to receive their gradients.
        self.autograd_inputs = () if write_grads else tuple(params)
        self.inputs = tuple(a.clone() for a in args)  # copies: the caller's tensors stay the caller's
        self.fields: list[str] = []
        self._live: tuple | None = None  # the forward's outputs with their autograd graph, for the backward
        self.loss_grad: torch.Tensor | None = None
        self.grads: tuple = ()

        def forward() -> tuple:
            out = step(*self.inputs)
            self.fields = [name for name in _FIELDS if getattr(out, name) is not None]
            self._live = tuple(getattr(out, name) for name in self.fields)
            return tuple(value.detach() for value in self._live)

        def gradients(retain: bool) -> tuple:
            return torch.autograd.grad(self._live[0], params, grad_outputs=self.loss_grad, allow_unused=True,
                                       retain_graph=retain)

        def backward() -> tuple:
            return gradients(retain=adds)  # kept for the adding backward, recorded from the same forward

        def add_backward() -> tuple:
            _add_into(self.grads, gradients(retain=False))  # what AccumulateGrad would do
            return ()

        def warm_up() -> None:
            forward()
            self.loss_grad = torch.ones_like(self._live[0])
            self.grads = backward()
            if adds:
                add_backward()

        recorder.warm_up(warm_up)
        self.outputs, self._replay_forward = recorder.record(forward)
        self.loss_grad = torch.empty_like(self.outputs[0])
        self.grads, self._replay_backward = recorder.record(backward)
        self._replay_add = recorder.record(add_backward)[1] if adds else None
        self._live = None  # the backwards are recorded: the forward's autograd graph is not needed again
        written = [(p, g) for p, g in zip(params, self.grads) if g is not None]
        self._written_params, self._written_grads = [p for p, _ in written], [g for _, g in written]

    def forward(self, args: tuple) -> tuple:
        for static, given in zip(self.inputs, args):
            static.copy_(given)
        self._replay_forward()
        return tuple(value.detach() for value in self.outputs)  # new tensor objects over the fixed memory

    def backward(self, loss_grad: torch.Tensor) -> None:
        """Without ``write_grads``: the gradients into the graph's memory (``grads``), replacing what is there."""
        self._take(loss_grad)
        self._replay_backward()

    def backward_into_grads(self, loss_grad: torch.Tensor) -> None:
        """With ``write_grads``: the gradients into ``.grad``, as autograd would put them there: written where it
        is None (then ``.grad`` is the graph's memory), added where it holds the step's earlier micro-batches'
        (the adding graph) or tensors of autograd's own (a dropped micro-batch's zeros). One pass over the
        parameters' ``.grad`` to tell which, no device op."""
        self._take(loss_grad)
        held = [param.grad for param in self._written_params]
        if all(h is None for h in held):
            self._replay_backward()
            for param, grad in zip(self._written_params, self._written_grads):
                param.grad = grad
            return
        ours = [h is grad for h, grad in zip(held, self._written_grads)]
        if all(ours):
            if self._replay_add is None:
                raise RuntimeError(
                    "train.cuda_graphs=capture: the last backward's gradients are still in .grad, and the step was "
                    "captured for one micro-batch per optimizer step, so this backward would overwrite them rather "
                    "than add to them; clear gradients to None after each optimizer step "
                    "(zero_grad(set_to_none=True), as DeepSpeed's engine does), or capture with accumulates=True")
            self._replay_add()
        elif any(ours):
            raise RuntimeError(
                "train.cuda_graphs=capture: some parameters' .grad is the captured backward's memory and others' "
                "is not, so the next replay would overwrite gradients it cannot add to; clear gradients to None "
                "(zero_grad(set_to_none=True)) rather than replacing some of them")
        else:  # autograd's own tensors (and None): added to, at the cost of a copy, never aliased
            self._replay_backward()
            _add_into(held, self._written_grads)
            for h, param, grad in zip(held, self._written_params, self._written_grads):
                if h is None:
                    param.grad = grad.clone()

    def _take(self, loss_grad: torch.Tensor) -> None:
        if loss_grad.data_ptr() != self.loss_grad.data_ptr():
            self.loss_grad.copy_(loss_grad)


def _add_into(totals, new) -> None:
    """``totals[i] += new[i]`` in one multi-tensor op, skipping the Nones of either list."""
    pairs = [(t, n) for t, n in zip(totals, new) if t is not None and n is not None]
    torch._foreach_add_([t for t, _ in pairs], [n for _, n in pairs])


class _Replay(torch.autograd.Function):
    """One autograd node for the captured step. Its inputs: the step's graphs, a tensor that needs a gradient
    (so that the loss has one), the batch, and ``graphs.autograd_inputs``."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, anchor: torch.Tensor, n_args: int, *tensors):
        ctx.graphs, ctx.n_args = graphs, n_args
        ctx.set_materialize_grads(False)  # no zero-filled gradients for the outputs the loss does not use
        outputs = graphs.forward(tensors[:n_args])
        ctx.mark_non_differentiable(*outputs[1:])  # metrics and logits: only the loss is trained on
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, loss_grad: torch.Tensor, *_):
        graphs, no_grads = ctx.graphs, (None,) * (3 + ctx.n_args)
        if graphs.write_grads:
            graphs.backward_into_grads(loss_grad)
            return no_grads
        graphs.backward(loss_grad)
        return no_grads + tuple(g if g is None else g.detach() for g in graphs.grads)


class CapturedStep:
    """Stands in for ``model.forward`` (see ``capture_step``)."""

    def __init__(self, model: nn.Module, forward, write_grads: bool, accumulates: bool, recorder: Recorder | None):
        self.model, self.uncaptured, self.write_grads, self.accumulates = model, forward, write_grads, accumulates
        self.recorder = recorder
        self.captured: _Graphs | None = None
        self.signature = None
        self.warned = False
        self._anchor: torch.Tensor | None = None

    @property
    def graphs(self) -> int:
        """CUDA graphs captured once the first training call has run: the forward's and the backward's, and
        the adding backward's with ``accumulates``."""
        return 0 if self.captured is None else 3 if self.accumulates else 2

    @property
    def fields(self) -> list[str] | None:
        """The output's fields that are set (3 for the MLM objective, 8 for ELECTRA), once captured."""
        return None if self.captured is None else self.captured.fields

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, check=True, document_ids=None):
        if not is_training_call(self.model) or check or attention_mask is None \
                or token_type_ids is None or not (input_ids.is_cuda or self.recorder is not None):
            return self.uncaptured(input_ids, attention_mask, token_type_ids, check=check, document_ids=document_ids)
        args = (input_ids, attention_mask, token_type_ids) + (() if document_ids is None else (document_ids,))
        signature = tuple((tuple(a.shape), a.dtype) for a in args)
        if self.captured is None:
            try:
                self._capture(args, signature)
            except RuntimeError as error:  # torch's message says what broke the capture; this says what to do
                raise RuntimeError(f"train.cuda_graphs=capture: capturing the training step failed ({error}); "
                                   "run with train.cuda_graphs=inductor or off") from error
        elif signature != self.signature:
            self._warn_once(signature)
            return self.uncaptured(*args[:3], check=False, document_ids=document_ids)
        values = _Replay.apply(self.captured, self._anchor, len(args), *args, *self.captured.autograd_inputs)
        return PretrainingOutput(**dict(zip(self.captured.fields, values)))

    def _capture(self, args: tuple, signature: tuple) -> None:
        def step(*inputs):
            return self.uncaptured(*inputs[:3], check=False, document_ids=inputs[3] if len(inputs) > 3 else None)

        params = [p for p in self.model.parameters() if p.requires_grad]
        device = args[0].device
        recorder = self.recorder or CudaGraphRecorder()
        # The warm-up calls and the capture draw random numbers: the run's stream is put back after, so that
        # the first replay draws what the first eager step would (and a resume sees the same stream). The
        # autocast cache would keep weight casts made while recording, outside the graphs: off.
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.autocast(
                device.type, dtype=torch.get_autocast_dtype(device.type),
                enabled=torch.is_autocast_enabled(device.type), cache_enabled=False):
            self.captured = _Graphs(step, args, params, recorder, self.write_grads, adds=self.accumulates)
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.signature = signature

    def _warn_once(self, signature: tuple) -> None:
        if not self.warned:
            self.warned = True
            print(f"warning: train.cuda_graphs=capture: a training batch of shapes {[s for s, _ in signature]} "
                  f"differs from the captured {[s for s, _ in self.signature]}; such batches run uncaptured",
                  file=sys.stderr, flush=True)


def capture_step(model: nn.Module, write_grads: bool, accumulates: bool = False,
                 recorder: Recorder | None = None) -> CapturedStep:
    """Make ``model`` (an ``ElectraForPretraining``, eager or after ``compile_step``) capture its training
    step as CUDA graphs at its first training call and replay them after. Call it once the parameters are
    where training keeps them (after the engine is built): the graphs read them at fixed addresses.
    ``write_grads``, ``accumulates`` (several micro-batches per optimizer step; needs ``write_grads``): see
    the module's docstring. ``recorder``: how to record (CUDA graphs when None; the step is then captured
    only for CUDA inputs). Returns the stand-in, whose ``graphs`` says what was captured."""
    if accumulates and not write_grads:
        raise ValueError("capture_step: accumulates=True needs write_grads=True (gradients handed to autograd "
                         "alias the graph's memory, which the next micro-batch's replay overwrites)")
    captured = CapturedStep(model, model.forward, write_grads, accumulates, recorder)
    model.forward = captured
    return captured
