"""The generator's output layer over the tied table (``vocabulary_logits``): eagerly ``addmm``, compiled a matmul with
its bias added after it."""

from types import SimpleNamespace

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from convbert_ds.model.convbert import VocabularyOutput
from convbert_ds.model.electra import mlm_loss_and_sample

VOCAB, WIDTH = 1009, 24  # a vocabulary no other size of the test shares, to find its matmul in inductor's code


def _head_and_batch(seed: int = 0):
    torch.manual_seed(seed)
    head = VocabularyOutput(WIDTH, VOCAB)
    torch.nn.init.normal_(head.bias, std=0.5)  # a bias far from zero, so that a lost or doubled one shows
    hidden = torch.randn(4, 16, WIDTH)
    input_ids = torch.randint(5, VOCAB, (4, 16))
    positions = torch.stack([torch.randperm(16)[:5] for _ in range(4)])
    chosen = torch.rand(4, 5) < 0.8
    return head, hidden, input_ids, positions, chosen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_it_computes_the_linear_layer_and_its_gradients(compiled):
    """Eagerly it is ``addmm``; compiled, a matmul and then the bias: the same values, gradients and dtype."""
    head, hidden, *_ = _head_and_batch()
    reference = torch.nn.Linear(WIDTH, VOCAB)
    reference.load_state_dict(head.state_dict())
    torch._dynamo.reset()
    run = torch.compile(head, fullgraph=True) if compiled else head
    ours, theirs = run(hidden), reference(hidden)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    torch.testing.assert_close(head.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.bias.grad, reference.bias.grad, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the dtype addmm gives under autocast, about its values
        ours, theirs = run(hidden), reference(hidden)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


def test_compiled_the_vocabulary_matmul_stays_a_matmul_and_the_loss_is_eagers():
    """Inductor folds an add on a matmul's output back into ``addmm`` (its post-grad ``addmm`` pattern); on a
    GPU that ``addmm`` copies the broadcast bias into the padded output first. The head's add sits on the
    ``[B, P, V]`` view of the matmul, which the pattern does not match: the compiled step keeps the ``mm``."""
    head, hidden, input_ids, positions, chosen = _head_and_batch()
    generator = SimpleNamespace(head=head)  # what mlm_loss_and_sample calls, as the pipeline's tied output

    def loss_and_accuracy(hidden):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, accuracy, _ = mlm_loss_and_sample(generator, hidden, input_ids, positions, chosen,
                                                    temperature=1.0, sample=False)
        return loss, accuracy

    torch._dynamo.reset()
    (loss, accuracy), code = run_and_get_code(torch.compile(loss_and_accuracy, fullgraph=True), hidden)
    eager_loss, eager_accuracy = loss_and_accuracy(hidden)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(accuracy, eager_accuracy)
    matmuls = [line for line in "\n".join(code).splitlines()
               if "extern_kernels." in line and f"{VOCAB})" in line.replace(" ", "")]
    assert matmuls and all("extern_kernels.mm(" in line for line in matmuls), matmuls
