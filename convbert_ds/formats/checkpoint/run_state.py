"""``trainer_state.json``: the run's own state in each checkpoint tag, written and read here only.

The trainer writes it with every save (``engine.checkpoint.stage``: ``RunState.to_json()``); resuming, a new
phase, the plan's checks, the layout reshape and the converter read it back through ``read``. It is one JSON
object, its keys in this order (``indent=2``; values JSON cannot hold, e.g. paths, written as strings)::

    schema_version   2 (see the history below); a file without it is version 1
    step             the optimizer steps this phase has taken                          required
    data             the train sampler's ``state_dict()`` (consumed_samples, ...)       required
    nonfinite_total  micro-batches with a non-finite loss so far in this phase          default 0
    samples_seen     samples trained on, over this phase and every one before it       default 0
    tokens_seen      the same in tokens (samples x data.seq_len of each phase)         default 0
    phase            {index, samples_before, tokens_before} and, from phase 2 on,      default phase 1,
                     continued_from (the previous phase's tag directory) and            nothing before it
                     from_step (its step): which phase this is, what came before
    config           the resolved ``TrainConfig.to_dict()``                             default {}
    electra_config   the ``ElectraConfig.to_dict()`` the weights were built from        required
    precision        what the weights are stored in: fp32 under torch autocast,        default "fp32"
                     else "bf16" / "fp16" (one of the layout's four numbers)
    pipeline_stages  pipeline stages (the layout)                                      default 1
    world_size       ranks (the layout)                                                default 1
    zero_stage       the ZeRO stage (the layout)                                       default 0
    tokenizer        the shards' tokenizer record (dir, kind, vocab_size,              default null
                     special_ids, sha256), as their manifest has it
    data_sets        [{"path", "weight"}]: the data.sets trained on                    default []

A key a file lacks takes its default (keys were added over time); a required key missing, a value of the
wrong type, or a file that is not a JSON object is a damaged tag. Keys this version does not know are
ignored.

Version history:

- 1: no ``schema_version`` key (every file written before it existed);
- 2: ``schema_version`` added; every other key as in version 1, so older readers still read it.

A file of a newer version than ``SCHEMA_VERSION`` is refused: it may mean something this code would misread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from convbert_ds.formats.checkpoint.directory import DAMAGED_TAG, TRAINER_STATE, CheckpointError
from convbert_ds.fsutil import read_json

SCHEMA_VERSION = 2
VERSION_KEY = "schema_version"
UNVERSIONED = 1  # the version of a file without VERSION_KEY
# In every file ever written, and nothing resumes or converts without them: a file that lacks one is damaged.
REQUIRED = ("step", "data", "electra_config")


@dataclass(frozen=True)
class Phase:
    """Which training phase a checkpoint belongs to, and what the phases before it trained on."""

    index: int = 1
    samples_before: int = 0
    tokens_before: int = 0
    continued_from: str | None = None  # the previous phase's tag directory (phase 2 on)
    from_step: int | None = None  # that checkpoint's step

    def to_dict(self) -> dict:
        """As written: phase 1 has no continued_from / from_step keys at all."""
        out = {"index": self.index, "samples_before": self.samples_before, "tokens_before": self.tokens_before}
        if self.continued_from is not None:
            out["continued_from"] = self.continued_from
        if self.from_step is not None:
            out["from_step"] = self.from_step
        return out


FIRST_PHASE = Phase()  # a run without phase.continue_from: phase 1, nothing before it

# What each key's value must be: (types accepted, what the error calls it). ``bool`` is an ``int`` to Python,
# never a count here.
_INT, _DICT = ((int,), "an integer"), ((dict,), "a JSON object")
_KINDS = {"step": _INT, "data": _DICT, "nonfinite_total": _INT, "samples_seen": _INT, "tokens_seen": _INT,
          "phase": _DICT, "config": _DICT, "electra_config": _DICT, "precision": ((str,), "a string"),
          "pipeline_stages": _INT, "world_size": _INT, "zero_stage": _INT,
          "tokenizer": ((dict, type(None)), "a JSON object or null"), "data_sets": ((list,), "a JSON list")}
_PHASE_KINDS = {"index": _INT, "samples_before": _INT, "tokens_before": _INT,
                "continued_from": ((str, type(None)), "a string or null"),
                "from_step": ((int, type(None)), "an integer or null")}


@dataclass(frozen=True, kw_only=True)
class RunState:
    """One checkpoint's ``trainer_state.json`` (the module docstring describes every field)."""

    step: int
    data: dict
    nonfinite_total: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    phase: Phase = FIRST_PHASE
    config: dict = field(default_factory=dict)
    electra_config: dict
    precision: str = "fp32"
    pipeline_stages: int = 1
    world_size: int = 1
    zero_stage: int = 0
    tokenizer: dict | None = None
    data_sets: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, state: object, source: Path | str) -> RunState:
        """``state`` as read from ``source`` (the file, named in every error): version 1 or 2."""
        if not isinstance(state, dict):
            raise CheckpointError(f"{source}: a JSON {type(state).__name__}, not the trainer's state object; "
                                  f"{DAMAGED_TAG}")
        version = state.get(VERSION_KEY, UNVERSIONED)
        _check(version, _INT, source, VERSION_KEY)
        if version > SCHEMA_VERSION:
            raise CheckpointError(f"{source}: {VERSION_KEY} {version} is newer than this convbert_ds reads (up to "
                                  f"{SCHEMA_VERSION}); upgrade convbert_ds to read this checkpoint")
        if version < UNVERSIONED:
            raise CheckpointError(f"{source}: {VERSION_KEY} {version} is no version convbert_ds wrote; {DAMAGED_TAG}")
        values = {}
        for name in (f.name for f in fields(cls)):
            if name in state:
                values[name] = _check(state[name], _KINDS[name], source, name)
        missing = [name for name in REQUIRED if name not in values]
        if missing:
            raise CheckpointError(f"{source}: no {missing[0]!r} key; {DAMAGED_TAG}")
        if "phase" in values:
            phase = values["phase"]
            values["phase"] = Phase(**{key: _check(phase[key], _PHASE_KINDS[key], source, f"phase.{key}")
                                       for key in _PHASE_KINDS if key in phase})
        return cls(**values)

    def to_dict(self) -> dict:
        """The JSON object written: VERSION_KEY first, then every field in the order above."""
        out = {VERSION_KEY: SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Phase) else value
        return out

    def to_json(self) -> str:
        """The file's text (``default=str``: the config's paths are written as strings)."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    # What readers need beyond the fields, each with the one default a file without it gets ------------------
    @property
    def global_batch_size(self) -> int | None:
        """``train.global_batch_size`` of the run that saved it (None: its config does not say)."""
        return self.config.get("train", {}).get("global_batch_size")

    @property
    def seq_len(self) -> int | None:
        """``data.seq_len`` of the run that saved it (None: its config does not say)."""
        return self.config.get("data", {}).get("seq_len")

    @property
    def sets(self) -> list[tuple[str, float | None]]:
        """``data_sets`` as (path, weight) pairs."""
        return [(entry["path"], entry.get("weight")) for entry in self.data_sets]

    def next_phase(self, continued_from: Path) -> Phase:
        """The phase a run continuing from this checkpoint (at ``continued_from``) is: its counts are totals
        over this phase and every one before it."""
        return Phase(index=self.phase.index + 1, samples_before=self.samples_seen, tokens_before=self.tokens_seen,
                     continued_from=str(continued_from), from_step=self.step)


def _check(value, kind: tuple, source, name: str):
    types, what = kind
    if not isinstance(value, types) or isinstance(value, bool):
        raise CheckpointError(f"{source}: {name} is {value!r}, not {what}; {DAMAGED_TAG}")
    return value


def read(tag_dir: Path) -> RunState:
    """A tag's ``trainer_state.json``. A file that is not JSON, not an object, or lacks a required key raises
    ``CheckpointError`` naming it; so does a newer ``schema_version``. A missing file is ``FileNotFoundError``."""
    path = Path(tag_dir) / TRAINER_STATE
    return RunState.from_dict(read_json(path, CheckpointError, DAMAGED_TAG), path)
