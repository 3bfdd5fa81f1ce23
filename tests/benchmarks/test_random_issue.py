"""``benchmarks/random_issue.py``: the instructions a keep mask's draw issues on an H200, by the draws a Philox
call yields, counted from sm_90 machine code on a CPU, and the draws the ELECTRA step's hidden dropouts make.
The counts run in a subprocess without TRITON_INTERPRET (set for this process by conftest), which would make
Triton's library uncompilable for a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.model import ElectraForPretraining
from launch import REPO


def test_the_draws_counted_are_those_of_the_models_dropouts():
    from benchmarks.random_issue import dropout_draws_per_sample

    config = ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=64)
    model = ElectraForPretraining(config).train()
    drawn = []
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.register_forward_hook(lambda module, args, out: drawn.append(args[0].numel()))
    input_ids = torch.randint(5, 1000, (3, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids, torch.ones_like(input_ids), torch.zeros_like(input_ids), check=False).loss.backward()
    assert drawn and sum(drawn) == 3 * dropout_draws_per_sample(config, seq=32)
    base = ElectraConfig.from_preset("base")
    assert dropout_draws_per_sample(base, seq=128) == 128 * (2 * 768 + 2 * 12 * 768 + 2 * 12 * 256)


def test_more_draws_a_philox_call_issue_fewer_instructions_a_draw():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "benchmarks/random_issue.py", "--preset", "tiny", "--seq", "32",
                             "--at", "4"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = [line for line in result.stdout.splitlines() if " a call" in line]
    assert len(rows) == 3, result.stdout
    one, four, eight = (float(line.split()[-2]) for line in rows)  # instructions a draw
    # Philox's ten rounds are most of a draw: four draws a call cost well under half of one draw a call.
    assert one > 2 * four > 0 and four > eight > 0, result.stdout
