"""The captured step's plumbing (``model/step_capture.py``) on CPU, with ``RerunRecorder`` standing in for
the CUDA graphs (``tests/rerun_recorder.py``; the recording itself is checked on a GPU by
``tests/engine/test_cuda_graphs.py``).

What is checked: a replayed step computes what the eager step computes (losses, every gradient, the weights
after a few optimizer steps), whether the backward writes ``.grad`` itself (``write_grads``) or hands the
gradients to autograd; with ``write_grads`` autograd runs no ``AccumulateGrad`` per parameter (ConvBERT-base
has 568 parameter tensors: on an H100 their ``AccumulateGrad`` calls took 4.3 ms of host time a step,
profiled); several micro-batches per step add up as in eager (``accumulates``), and so do gradients
autograd left in ``.grad`` (a dropped micro-batch's zeros); and gradients the graph could overwrite are an
error, not a silent loss.
"""

import copy

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.step_capture import capture_step
from rerun_recorder import RerunRecorder

STEPS = 3


def _model_and_batch():
    torch.manual_seed(0)
    model = ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=300, max_position_embeddings=64))
    input_ids = torch.randint(5, 300, (2, 32))
    input_ids[:, 0] = 2
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 24:] = 0  # a padded row
    return model, (input_ids * attention_mask, attention_mask, torch.zeros_like(input_ids))


def _train(model, batch) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """STEPS steps as the trainer takes them (fused AdamW, gradients cleared to None), each from the same seed
    for both models: (loss, gradients) of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    seen = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        out = model(*batch, check=False)
        out.loss.backward()
        seen.append((out.loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen


def _autograd_nodes(loss: torch.Tensor) -> list[str]:
    """The nodes autograd runs for ``loss.backward()`` outside the replays, by type."""
    seen, todo, names = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(fn for fn, _ in node.next_functions)
    return names


@pytest.mark.parametrize("write_grads", [True, False], ids=["grads-written", "grads-through-autograd"])
def test_a_replayed_step_trains_as_the_eager_step(write_grads):
    model, batch = _model_and_batch()
    twin = copy.deepcopy(model)
    recorder = RerunRecorder()
    captured = capture_step(model, write_grads, recorder=recorder)
    replayed, eager = _train(model, batch), _train(twin, batch)
    assert captured.graphs == 2 and recorder.replays == 2 * STEPS  # a forward and a backward replay per step
    for step, ((loss, grads), (eager_loss, eager_grads)) in enumerate(zip(replayed, eager)):
        assert torch.equal(loss, eager_loss), (step, loss, eager_loss)
        for name, g, e in zip([n for n, _ in model.named_parameters()], grads, eager_grads):
            assert torch.equal(g, e), (step, name, (g - e).abs().max())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert captured.fields == ["loss", "mlm_loss", "mlm_accuracy", "rtd_loss", "rtd_accuracy", "rtd_logits",
                               "is_replaced", "real"]


@pytest.mark.parametrize("write_grads", [True, False], ids=["grads-written", "grads-through-autograd"])
def test_written_gradients_take_no_accumulate_grad_per_parameter(write_grads):
    model, batch = _model_and_batch()
    capture_step(model, write_grads, recorder=RerunRecorder())
    tensors = sum(1 for _ in model.parameters())
    model(*batch, check=False).loss.backward()  # the first call records
    model.zero_grad(set_to_none=True)
    loss = model(*batch, check=False).loss
    nodes = _autograd_nodes(loss)
    # Written: one AccumulateGrad, for the tensor that gives the loss its gradient; through autograd: one more
    # per parameter.
    assert nodes.count("AccumulateGrad") == (1 if write_grads else tensors + 1), (len(nodes), tensors)
    assert nodes.count("_ReplayBackward") == 1 and len(nodes) == nodes.count("AccumulateGrad") + 1, set(nodes)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def _train_accumulating(model, batches) -> list[list[torch.Tensor]]:
    """Two optimizer steps of len(batches) micro-batches each (the loss scaled as DeepSpeed scales it); the
    summed gradients of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    summed = []
    for step in range(2):
        for micro, batch in enumerate(batches):
            torch.manual_seed(100 + 10 * step + micro)
            (model(*batch, check=False).loss / len(batches)).backward()
        summed.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return summed


def test_micro_batches_add_up_as_in_eager():
    """``accumulates``: the first micro-batch's backward writes ``.grad``, the next ones add to it in place."""
    model, first = _model_and_batch()
    second = (first[0].flip(0), first[1].flip(0), first[2])
    twin = copy.deepcopy(model)
    recorder = RerunRecorder()
    capture_step(model, True, accumulates=True, recorder=recorder)
    micro_batches = [first, second, first]
    replayed, eager = _train_accumulating(model, micro_batches), _train_accumulating(twin, micro_batches)
    assert recorder.replays == 2 * 3 * 2
    for step, (grads, eager_grads) in enumerate(zip(replayed, eager)):
        for name, g, e in zip([n for n, _ in model.named_parameters()], grads, eager_grads):
            assert torch.equal(g, e), (step, name, (g - e).abs().max())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def test_gradients_of_autograd_s_own_are_added_to():
    """A micro-batch the trainer drops (``nonfinite_check_interval: 1``: a zero loss through every parameter)
    leaves autograd's own zeros in ``.grad``; the next captured backward adds to them, as autograd would, and
    never aliases them."""
    model, batch = _model_and_batch()
    twin = copy.deepcopy(model)
    capture_step(model, True, recorder=RerunRecorder())
    model(*batch, check=False).loss.backward()  # the first call records
    model.zero_grad(set_to_none=True)
    grads = []
    for net in (model, twin):
        torch.manual_seed(7)
        sum(p.sum() * 0.0 for p in net.parameters()).backward()  # the trainer's dropped micro-batch
        first = next(net.parameters())
        first.grad = None  # and one parameter without a gradient yet
        net(*batch, check=False).loss.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for g, e in zip(*grads):
        assert torch.equal(g, e)
    written = model.forward.captured.grads
    assert not any(p.grad.data_ptr() == g.data_ptr() for p, g in zip(model.parameters(), written) if g is not None)


def test_gradients_partly_replaced_are_an_error():
    model, batch = _model_and_batch()
    capture_step(model, True, accumulates=True, recorder=RerunRecorder())
    model(*batch, check=False).loss.backward()
    first = next(model.parameters())
    first.grad = torch.zeros_like(first)  # replaced, while the others hold the graph's memory
    with pytest.raises(RuntimeError, match=r"some parameters' .grad is the captured backward's memory"):
        model(*batch, check=False).loss.backward()
    with pytest.raises(ValueError, match="accumulates=True needs write_grads=True"):
        capture_step(_model_and_batch()[0], False, accumulates=True)


def test_a_gradient_not_cleared_is_an_error():
    model, batch = _model_and_batch()
    capture_step(model, True, recorder=RerunRecorder())
    model(*batch, check=False).loss.backward()
    with pytest.raises(RuntimeError, match=r"still in .grad.*would overwrite.*zero_grad\(set_to_none=True\)"):
        model(*batch, check=False).loss.backward()


def test_evaluation_and_other_shapes_run_uncaptured(capsys):
    model, batch = _model_and_batch()
    recorder = RerunRecorder()
    capture_step(model, True, recorder=recorder)
    model(*batch, check=False).loss.backward()
    model.zero_grad(set_to_none=True)
    replays = recorder.replays
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(*batch, check=False).loss)
    model.train()
    shorter = tuple(t[:, :16].contiguous() for t in batch)
    out = model(*shorter, check=False)
    assert out.rtd_logits.shape == (2, 16) and out.loss.requires_grad
    assert recorder.replays == replays  # neither call replayed
    assert "differs from the captured" in capsys.readouterr().err
