"""``trainer_state.json`` as one typed, versioned RunState: files written before the version key (by the
trainer of tests/convert/checkpoint_v1, and the dict today's Trainer.save builds) read into the same values
and write back the same bytes plus the key; a newer version, and a damaged file, are one line naming it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from convbert_ds.formats.checkpoint.directory import TRAINER_STATE, CheckpointError
from convbert_ds.formats.checkpoint.run_state import FIRST_PHASE, SCHEMA_VERSION, Phase, RunState, read
from convbert_ds.formats.checkpoint.universal import Layout

V1_TAG = Path(__file__).parents[1] / "convert" / "checkpoint_v1" / "checkpoints" / "step00000002"


def _v1_dict() -> dict:
    return json.loads((V1_TAG / TRAINER_STATE).read_text())


def _todays_save(tmp_path: Path) -> dict:
    """The dict Trainer.save builds, here for a phase 2 (continued_from, from_step) whose config holds a
    path (as TrainConfig.to_dict may): json.dumps(default=str) writes it as a string."""
    state = _v1_dict()
    state["config"]["checkpoint"]["dir"] = tmp_path / "checkpoints"
    phase = {"index": 2, "samples_before": 8, "tokens_before": 256,
             "continued_from": str(tmp_path / "phase1" / "step00000002"), "from_step": 2}
    return {**state, "phase": phase, "samples_seen": 8 + 40, "tokens_seen": 256 + 40 * 64}


def _with_version(text: str) -> str:
    """Today's text with the version key, where to_json puts it: first."""
    assert text.startswith("{\n")
    return "{\n" + f'  "schema_version": {SCHEMA_VERSION},\n' + text[2:]


def _write(tag_dir: Path, content) -> Path:
    tag_dir.mkdir(parents=True, exist_ok=True)
    path = tag_dir / TRAINER_STATE
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_checkpoint_written_before_the_version_key_reads_the_same_values_and_bytes():
    state, text = read(V1_TAG), (V1_TAG / TRAINER_STATE).read_text()
    raw = json.loads(text)
    assert state.step == raw["step"] == 2 and state.data == raw["data"]
    assert state.phase == FIRST_PHASE and state.config == raw["config"] and state.tokenizer == raw["tokenizer"]
    assert (state.samples_seen, state.tokens_seen, state.nonfinite_total) == (8, 256, 0)
    assert Layout.of_checkpoint(state) == Layout(world_size=2, zero_stage=1, pipeline_stages=1, precision="bf16")
    assert (state.global_batch_size, state.seq_len, state.sets) == (4, 32, [("shards", 1.0)])
    assert state.to_json() == _with_version(text)
    assert {k: v for k, v in json.loads(state.to_json()).items() if k != "schema_version"} == raw


def test_todays_trainer_dict_writes_the_same_bytes_plus_the_version(tmp_path):
    todays = _todays_save(tmp_path)
    text = json.dumps(todays, indent=2, default=str)  # what engine.checkpoint.stage wrote before RunState
    assert RunState.from_dict(todays, "Trainer.save").to_json() == _with_version(text)
    state = read(_write(tmp_path / "step00000040", text).parent)
    assert state.phase == Phase(2, 8, 256, str(tmp_path / "phase1" / "step00000002"), 2)
    assert state.config["checkpoint"]["dir"] == str(tmp_path / "checkpoints")


def test_round_trip(tmp_path):
    state = RunState(step=7, data={"consumed_samples": 56, "num_samples": 100, "seed": 1, "shuffle": True},
                     nonfinite_total=1, samples_seen=56, tokens_seen=56 * 32, phase=FIRST_PHASE,
                     config={"train": {"global_batch_size": 8}, "data": {"seq_len": 32}},
                     electra_config={"objective": "mlm"}, precision="bf16", pipeline_stages=2, world_size=4,
                     zero_stage=1, tokenizer={"dir": "tok", "sha256": "ab"},
                     data_sets=[{"path": "shards", "weight": 1.0}])
    path = _write(tmp_path / "step00000007", state.to_json())
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION == 2
    assert read(path.parent) == state
    follow = state.next_phase(path.parent)
    assert follow == Phase(2, 56, 56 * 32, str(path.parent), 7)
    phase_2 = dataclasses.replace(state, phase=follow)
    assert RunState.from_dict(json.loads(phase_2.to_json()), path) == phase_2


def test_missing_optional_keys_take_the_one_set_of_defaults(tmp_path):
    state = read(_write(tmp_path / "step00000005", {"step": 5, "data": {"consumed_samples": 5},
                                                     "electra_config": {}}).parent)
    assert (state.nonfinite_total, state.samples_seen, state.tokens_seen, state.phase) == (0, 0, 0, FIRST_PHASE)
    assert (state.config, state.tokenizer, state.data_sets) == ({}, None, [])
    assert Layout.of_checkpoint(state) == Layout(world_size=1, zero_stage=0, pipeline_stages=1, precision="fp32")
    assert (state.global_batch_size, state.seq_len, state.sets) == (None, None, [])
    assert RunState.from_dict({"step": 5, "data": {}, "electra_config": {}, "phase": {"index": 3}}, "x").phase \
        == Phase(index=3)


def test_a_newer_schema_version_is_refused_in_one_line(tmp_path):
    path = _write(tmp_path / "step00000005", {**_v1_dict(), "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(CheckpointError) as refused:
        read(path.parent)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and str(path) in message
    assert f"schema_version {SCHEMA_VERSION + 1}" in message and "upgrade convbert_ds" in message


@pytest.mark.parametrize("content, says", [
    ('{"step": 2, "da', "not valid JSON"), ("[1, 2]", "a JSON list"),
    ('{"data": {}, "electra_config": {}}', "no 'step' key"),
    ('{"step": "2", "data": {}, "electra_config": {}}', "step is '2', not an integer"),
    ('{"step": 2, "data": {}, "electra_config": {}, "world_size": true}', "world_size is True"),
    ('{"step": 2, "data": {}, "electra_config": {}, "phase": {"index": 1.5}}', "phase.index is 1.5"),
    ('{"schema_version": "2", "step": 2, "data": {}, "electra_config": {}}', "schema_version is '2'"),
])
def test_a_damaged_file_is_one_line_naming_it(content, says, tmp_path):
    path = _write(tmp_path / "step00000002", content)
    with pytest.raises(CheckpointError) as damaged:
        read(path.parent)
    message = str(damaged.value)
    assert len(message.splitlines()) == 1 and str(path) in message, message
    assert says in message and "the tag is damaged" in message, message
