"""``train.profile``: a window of steps traced by the torch profiler on real DeepSpeed ranks, and the
one-line errors for windows and kinds that cannot work."""

import json
import re

import pytest

from convbert_ds.config import ConfigError
from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import TINY_CONFIG, check, run_training


@pytest.mark.slow
def test_a_cpu_run_writes_one_trace_per_rank_for_its_window(tiny_corpus, tmp_path):
    output = check(run_training(tmp_path, tiny_corpus["shards"], "train.steps=5", "train.warmup_steps=1",
                                "eval.interval=0", "checkpoint.interval=100", "train.profile.start_step=2",
                                "train.profile.steps=2"))
    profile = tmp_path / "logs" / "profile"
    assert f"profile: steps 2-3 (trace) written to {profile}" in output
    traces = sorted(profile.glob("*.pt.trace.json"))
    assert [path.name.split(".")[0] for path in traces] == ["rank0", "rank1"]
    for path in traces:
        names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
        assert {"train step 2", "train step 3"} <= names  # the window, step by step
        assert not {"train step 1", "train step 4"} & names  # and nothing outside it
        assert {"aten::mm", "aten::scaled_dot_product_attention"} <= names  # the model's ops inside
    # Each rank's summary of its window; rank 0 prints its own. On CPU: the wall time and the host's ops.
    summaries = {rank: (profile / f"summary_rank{rank}.txt").read_text().splitlines() for rank in (0, 1)}
    printed = output.split("profile summary (rank 0, 2 steps):\n")[1].splitlines()
    assert printed[:len(summaries[0])] == [f"  {line}" for line in summaries[0]]
    for lines in summaries.values():
        wall_ms = float(re.fullmatch(r"wall ([\d.]+) ms/step; no CUDA kernels recorded \(a CPU run: the host does "
                                     r"it all\)", lines[0]).group(1))
        assert 0 < wall_ms < 60_000
        assert lines[1] == "  host: the ops with the most CPU time of their own"
        host = [re.fullmatch(r" +([\d.]+) ms/step x(\d+) +(\S.*)", line) for line in lines[2:]]
        assert len(host) == 6 and all(host), lines
        assert all(float(m.group(1)) <= wall_ms for m in host)  # one op's own time within the step's


@pytest.mark.parametrize("overrides, message", [
    (["train.profile.start_step=2", "train.profile.what=[memory]"],
     "train.profile.what=['memory']: ['memory'] need a GPU (CUDA memory snapshots, NVTX ranges); use [trace] on CPU"),
    (["train.profile.start_step=2", "train.profile.what=[trace, flame]"],
     "train.profile.what=['trace', 'flame']: use a non-empty list of ['trace', 'memory', 'nvtx']"),
    (["train.profile.start_step=500", "train.steps=200"],
     "train.profile.start_step=500 is after the last step (train.steps=200)"),
])
def test_profile_windows_that_cannot_work_are_one_line(overrides, message, tiny_corpus):
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(cfg, world_size=2, cuda=False)
