"""Fuzzing the typed training config: every key gets values of the wrong type, out of its range, empty,
huge, negative and non-finite, alone and in combinations, through the trainer's own command line
(``--check-config``, in this process). Each case must end before any process group in one line naming
the key, exit code 2, or be valid. Anything else (another exception type, a traceback) is our bug and
fails here with its traceback.

The bad values come from the typed config itself (``train_config.Key``'s bounds, the fields' types), so
a new key is fuzzed without touching this file. Hypothesis runs a bounded number of examples from a
fixed seed; every failure it ever found is kept below as an ``@example`` and replayed on every run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Annotated, Literal

import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from convbert_ds import train
from convbert_ds.formats.train_config import Key, TrainConfig
from launch import TINY_CONFIG

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _keys(cls=TrainConfig, where: str = "") -> list[tuple[str, object, Key]]:
    """(dotted key, its type, its Key) for every leaf of the typed config."""
    out = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _keys(hint, f"{where}{f.name}.")
        else:
            kind, key = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint, Key(""))
            out.append((f"{where}{f.name}", kind, key))
    return out


KEYS = _keys()


@pytest.fixture(autouse=True, scope="module")
def _elsewhere(tmp_path_factory):
    """Run from a scratch directory: a fuzzed relative path (a cache or output dir) must not land in the repo."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        yield


def _allowed(kind) -> tuple:
    return typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)


def bad_values(kind, key: Key) -> list:
    """Values a user could type that are wrong for this key, or at its edges (some of them valid)."""
    allowed = _allowed(kind)
    values = ["not a number", [1, 2], {"a": 1}, "", -1, 0, 10**18, -(10**18), 1e300, math.nan, math.inf, True]
    if type(None) not in allowed:
        values.append(None)
    for bound in (key.min, key.max, key.below):
        if bound is not None:
            values += [bound - 1, bound - 0.5, bound, bound + 0.5, bound + 1]
    for option in allowed:
        if typing.get_origin(option) is Literal:
            values += ["no-such-choice", list(typing.get_args(option))]
    return values


def _yaml(value) -> str:
    """A value as the user would write it after ``key=`` (YAML)."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    return json.dumps(value)


def _check(shards, overrides: list[str], capsys) -> tuple[int, str]:
    args = ["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}'}}]", *overrides,
            "--check-config", "--world-size", "2"]
    code = train.main(args)  # any exception that is not a UserError propagates: a bug, with its traceback
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "[WARNING]" not in line]
    return code, "\n".join(lines)


def _one_line_naming(code: int, err: str, names: list[str]) -> None:
    assert code in (0, 2), (code, err)
    if code == 2:
        assert len(err.splitlines()) == 1, err
        assert err.startswith("config error (2 processes): "), err
        assert any(name in err for name in names), (names, err)


single = st.sampled_from(KEYS).flatmap(
    lambda entry: st.tuples(st.just(entry[0]), st.sampled_from(bad_values(entry[1], entry[2]))))


@seed(20261124)
@FUZZ
@given(case=single)
@example(case=("data.seq_len", 100000))  # passed validation, then died allocating 320 GB (issue 19)
@example(case=("train.warmup_steps", -3))  # was accepted and ignored (issue 19)
@example(case=("train.lr", math.nan))  # a non-finite float passed every bound check (found by this suite)
@example(case=("data.num_workers", 10**18))  # spawned workers until the machine gave up (found by this suite)
@example(case=("train.adam_beta2", 1.0))  # Adam's bias correction divides by zero (found by this suite)
@example(case=("data.sets", [1, 2]))  # a set that is neither a path nor a mapping: a traceback (found by this suite)
def test_every_key_rejects_bad_values_in_one_line_or_accepts_them(case, tiny_corpus, capsys):
    path, value = case
    code, err = _check(tiny_corpus["shards"], [f"{path}={_yaml(value)}"], capsys)
    # The line names the key itself, or the section when the value is not even the right shape.
    _one_line_naming(code, err, [path, path.rsplit(".", 1)[0]])


CONFLICTS = [
    ["train.global_batch_size=30", "train.micro_batch_size=8"],  # 30 is not 8 x 2 ranks x k
    ["pipeline.stages=2", "deepspeed.config=ds_configs/zero3_bf16.json"],  # pipelines take ZeRO-0/1
    ["pipeline.stages=3"],  # does not divide 2 ranks
    ["train.precision=fp16"],  # DeepSpeed refuses fp16 on CPU
    ["data.sets=[{path: '/no/such/dir'}]"],
    ["data.sets=[{path: SHARDS, weight: -1}]"],
    ["data.sets=[]"],
    ["data.seq_len=1024"],  # beyond the 512 positions
    ["model.overrides={hidden_size: 100, num_attention_heads: 3}"],
    ["model.tie_generator_body=true", "pipeline.stages=2"],
    ["eval.downstream.interval=150", "checkpoint.interval=100"],
    ["train.profile.start_step=2", "train.profile.what=[nvtx]"],
]


@seed(20261124)
@FUZZ
@given(combo=st.lists(st.sampled_from(CONFLICTS), min_size=1, max_size=3).map(lambda x: sum(x, [])),
       extra=st.lists(single, max_size=2))
def test_conflicting_combinations_end_in_one_line(combo, extra, tiny_corpus, capsys):
    overrides = [item.replace("SHARDS", f"'{tiny_corpus['shards']}'") for item in combo]
    overrides += [f"{path}={_yaml(value)}" for path, value in extra]
    code, err = _check(tiny_corpus["shards"], overrides, capsys)
    names = [item.split("=", 1)[0] for item in overrides]
    _one_line_naming(code, err, names + [name.rsplit(".", 1)[0] for name in names] + ["deepspeed", "data.sets"])


def test_every_key_is_fuzzed():
    """The suite covers the whole typed config, nested sections included."""
    paths = {path for path, _, _ in KEYS}
    assert {"train.lr", "data.seq_len", "log.wandb.mode", "train.profile.what", "eval.downstream.nice"} <= paths
    assert len(paths) > 60


@pytest.mark.parametrize("text, message", [
    ("model:\n  preset: [tiny\n", "bad.yaml is not valid YAML: line 3, column 1: expected ',' or ']'"),  # issue 19
    ("- just\n- a list\n", "bad.yaml holds a list, not a mapping of sections"),
    ("model: {preset: tiny}\ntrain: {lr: 1e-3, warmup: 3}\n", "train: unknown key(s) ['warmup']; valid keys are"),
])
def test_broken_config_files_are_one_line(text, message, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert train.main(["--config", str(config), "--check-config"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "[WARNING]" not in line]
    assert len(err) == 1 and message in err[0], err


def test_a_config_that_is_not_utf8_or_not_a_file_is_one_line(tmp_path, capsys):
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("model: {preset: 'caf\u00e9'}\n".encode("latin-1"))
    for path, message in ((binary, "is not UTF-8 text (byte 0xe9 at offset 20); save it as UTF-8"),
                          (tmp_path, "is a directory; pass a YAML file"),
                          (tmp_path / "missing.yaml", "not found")):
        assert train.main(["--config", str(path), "--check-config"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "[WARNING]" not in line]
        assert len(err) == 1 and str(path) in err[0] and message in err[0], err
