"""A checkpoint written before the checkpoint format moved (``checkpoint_v1/README.md``) still verifies,
reads, converts and resumes exactly as the code that wrote it did."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tensor_digest import tensors_digest

from convbert_ds.convert import open_checkpoint, read_state_dict
from convbert_ds.convert.__main__ import main as convert_main
from convbert_ds.formats.checkpoint.directory import choose_resume_tag
from convbert_ds.formats.checkpoint.universal import QUANTITIES, Layout, read_quantity
from launch import NOT_THE_SUBJECT, REPO, TINY_CONFIG, check, env, run_group, train_command

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "checkpoint_v1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
RUN = ("model.overrides={hidden_size: 32, embedding_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
       "intermediate_size: 64}", "deepspeed.config=ds_configs/zero1_bf16.json", "train.precision=bf16",
       "train.warmup_steps=1", "eval.interval=0", "checkpoint.interval=2", "train.micro_batch_size=2",
       "train.global_batch_size=4", "data.seq_len=32", "log.interval=1")


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "run")
    return tmp_path / "run"


def test_it_verifies_and_reads_the_same_tensors(copy):
    assert choose_resume_tag(copy / "checkpoints", "checksum") == EXPECTED["tag"]
    ckpt = open_checkpoint(copy / "checkpoints")
    assert tensors_digest(read_state_dict(ckpt)[0]) == EXPECTED["read_state_dict"]
    layout = Layout.of_checkpoint(ckpt.state)
    for quantity in QUANTITIES:
        read = read_quantity(ckpt.directory, layout, ckpt.electra, quantity)
        assert tensors_digest(read) == EXPECTED[f"universal_{quantity}"], quantity


def test_it_converts_to_the_same_transformers_weights(copy, monkeypatch):
    out = copy / "hf"
    monkeypatch.setattr(sys, "argv", ["convert", "--checkpoint", str(copy / "checkpoints"), "--out", str(out),
                                      "--tokenizer", str(copy / "tokenizer")])
    assert convert_main() == 0
    for part in ("discriminator", "generator"):
        assert tensors_digest(load_file(str(out / part / "model.safetensors"))) == EXPECTED[f"hf_{part}"], part


def test_it_resumes_with_the_same_losses(copy):
    """The resumed steps' losses as the old code logged them (to float32 rounding: another CPU may sum in
    another order, the checkpoint itself is read bit for bit above)."""
    command = train_command(NOT_THE_SUBJECT, 2) + [
        "--config", str(TINY_CONFIG), "data.sets=[{path: shards, weight: 1.0}]", "checkpoint.dir=checkpoints",
        "log.dir=logs", "train.steps=4", *RUN]
    output = check(run_group(command, 420, cwd=copy, env={**env(), "PYTHONPATH": str(REPO)}))
    assert "resumed from checkpoints/step00000002 at step 2" in output
    rows = [json.loads(line) for line in (copy / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = {str(r["step"]): [r["loss"], r["mlm_loss"], r["rtd_loss"]] for r in rows if r.get("split") == "train"}
    assert losses.keys() == EXPECTED["resumed_losses"].keys()
    for step, values in EXPECTED["resumed_losses"].items():
        assert losses[step] == pytest.approx(values, rel=1e-5), step
