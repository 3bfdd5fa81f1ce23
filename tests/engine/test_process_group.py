"""Starting the process group leaves nothing on the machine that a later run could wait on: DeepSpeed's CPU
shared-memory all-reduce (an extension built under a machine-wide file lock) is neither built nor mapped."""

from pathlib import Path

import pytest

from launch import check, run_training, train_metrics

pytestmark = pytest.mark.slow


def test_a_lock_left_by_a_killed_extension_build_does_not_hold_a_run(tiny_corpus, tmp_path):
    # What a rank killed mid-build (kill -9, a time limit) leaves: torch waits for this file to go before it
    # loads the extension, forever. A run that built the extension would hang here until the timeout.
    extensions = tmp_path / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    # The deepspeed launcher, 2 ranks: the launcher that sets what the buffer needs.
    check(run_training(tmp_path / "run", tiny_corpus["shards"], "train.steps=1", "train.warmup_steps=1",
                       "eval.interval=0", "checkpoint.interval=100",
                       extra_env={"TORCH_EXTENSIONS_DIR": str(extensions)}, timeout=240))
    assert [row["step"] for row in train_metrics(tmp_path / "run")] == [1]
    assert [p.name for p in extensions.iterdir()] == ["deepspeed_shm_comm"]  # nothing else built either
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before
