"""Object stores in training (a real S3-compatible server on loopback, ``tests/object_store.py``), on 2 gloo CPU
ranks: shards read from the store train as the local copy does, to the bit, and resume exactly after kill -9;
checkpoints mirrored there resume a run on an emptied disk exactly and feed the converter and fine-tuning; a
store that is down when a run starts, or goes away mid-run, costs a pause and no checkpoint.

The store's outages close its port (``S3Server.pause``) and open it again with its objects, as a store process
restarted over its disk does: moto keeps its objects in memory, so a killed server would come back empty."""

import shutil
import threading

import pytest

from convbert_ds.convert import convert_checkpoint
from convbert_ds.finetune.model_source import resolve_model
from launch import NOT_THE_SUBJECT, check, run_cli, run_training, train_metrics
from object_store import S3Server

COMMON = ("train.steps=12", "train.warmup_steps=3", "eval.interval=0", "checkpoint.interval=4",
          "checkpoint.keep_last=2")
KEYS = ("loss", "mlm_loss", "rtd_loss", "grad_norm", "consumed_samples")
URL = "s3://shards/tiny"


def _upload(server: S3Server, shards) -> dict[str, bytes]:
    objects = {f"tiny/{p.relative_to(shards).as_posix()}": p.read_bytes() for p in sorted(shards.rglob("*"))
               if p.is_file() and "index_cache" not in p.parts}
    server.restore("shards", objects)
    return objects


@pytest.fixture(scope="module")
def local_run(tiny_corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("local")
    check(run_training(run_dir, tiny_corpus["shards"], *COMMON, launcher=NOT_THE_SUBJECT))
    return run_dir


def _assert_same_steps(a_dir, b_dir, steps):
    a = {r["step"]: r for r in train_metrics(a_dir)}
    b = {r["step"]: r for r in train_metrics(b_dir)}
    for step in steps:
        for key in KEYS:
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])


@pytest.mark.slow
def test_two_ranks_train_from_the_store_as_from_disk_and_resume_exactly_after_kill_9(tiny_corpus, local_run, tmp_path):
    """Killed mid-save at step 8 (steps 1-8 trained from the store), then run again with the same cache while
    the store is down, until it comes back 3 s after the rerun said it waits for it: the rerun resumes at step
    4 and trains steps 5-12; every step equals the local run's to the bit."""
    with S3Server() as server:
        _upload(server, tiny_corpus["shards"])
        cache = f"data.cache_dir={tmp_path / 'cache'}"
        crashed = run_training(tmp_path, URL, *COMMON, cache, launcher=NOT_THE_SUBJECT,
                               extra_env=server.env, faults={"kill_during_save": 8})
        assert crashed.returncode != 0 and "saving checkpoint" in crashed.stdout, crashed.stderr[-3000:]
        _assert_same_steps(local_run, tmp_path, range(1, 9))
        server.pause()
        comebacks = []

        def come_back_once_waited_for(line: str) -> None:  # not on a clock: a slow start would miss the outage
            if f"{URL}/manifest.json (get): the store did not answer" in line and not comebacks:
                comebacks.append(threading.Timer(3, server.resume))
                comebacks[0].start()
        try:
            output = check(run_training(tmp_path, URL, *COMMON, cache, launcher=NOT_THE_SUBJECT,
                                        on_line=come_back_once_waited_for,
                                        extra_env={**server.env, "CONVBERT_DS_STORE_PATIENCE": "120"}))
        finally:
            for comeback in comebacks:
                comeback.join()
    assert comebacks, "the rerun never said it waits for the store"
    assert "retrying for up to" in output
    assert "at step 4" in output
    _assert_same_steps(local_run, tmp_path, range(5, 13))
    # The tokens were read as blocks (never a whole .bin), cached for the rerun.
    assert list((tmp_path / "cache" / "blocks").glob("*/*")) and not list((tmp_path / "cache").rglob("*.bin"))

MIRROR = "s3://checkpoints/run"


def _store_tags(server: S3Server) -> tuple[list[str], str]:
    keys = server.snapshot("checkpoints")
    return sorted({k.split("/")[1] for k in keys if k.endswith("/COMPLETE")}), keys["run/latest"].decode().strip()


@pytest.mark.slow
def test_a_run_on_an_emptied_disk_resumes_exactly_from_the_checkpoints_in_the_store(s3, tiny_corpus, local_run,
                                                                                    tmp_path, monkeypatch):
    """Killed mid-save at step 8, then its whole checkpoint.dir deleted (a new machine): the rerun downloads
    step 4, complete in the store, and trains steps 5-12 as the local run did, to the bit, through a store
    outage during step 8's upload. The converter and fine-tuning then read the run's checkpoints from the
    store."""
    s3_server = s3
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the converter's copy goes
    s3_server.client().create_bucket(Bucket="checkpoints")
    mirror = f"checkpoint.mirror={MIRROR}"
    crashed = run_training(tmp_path, tiny_corpus["shards"], *COMMON, mirror, launcher=NOT_THE_SUBJECT,
                           extra_env=s3_server.env, faults={"kill_during_save": 8})
    assert crashed.returncode != 0 and f"uploaded checkpoint step00000004 to {MIRROR}" in crashed.stdout, \
        crashed.stderr[-3000:]
    assert _store_tags(s3_server) == (["step00000004"], "step00000004")  # step 8's upload never began
    shutil.rmtree(tmp_path / "checkpoints")
    timers = []

    def outage(line: str) -> None:  # the store goes away as step 8's save starts, back 3 s after the upload waits
        if "saving checkpoint" in line and "step00000008" in line and not timers:
            s3_server.pause()
            timers.append(None)
        if "(upload): the store did not answer" in line and timers == [None]:
            timers[0] = threading.Timer(3, s3_server.resume)
            timers[0].start()
    try:
        output = check(run_training(tmp_path, tiny_corpus["shards"], *COMMON, mirror, launcher=NOT_THE_SUBJECT,
                                    on_line=outage, extra_env={**s3_server.env, "CONVBERT_DS_STORE_PATIENCE": "120"}))
    finally:
        for timer in filter(None, timers):
            timer.join()
    assert timers, "the run never said it was saving step 8"
    assert f"downloaded checkpoint step00000004 from {MIRROR} into {tmp_path / 'checkpoints'}" in output
    assert "at step 4" in output
    # The upload in the background retried through the outage; training never stopped for it.
    assert "(upload): the store did not answer" in output and "retrying for up to" in output, output[-3000:]
    assert f"uploaded checkpoint step00000008 to {MIRROR}" in output
    _assert_same_steps(local_run, tmp_path, range(5, 13))
    assert _store_tags(s3_server) == (["step00000008", "step00000012"], "step00000012")  # keep_last=2 there too

    converted = run_cli("convbert_ds.convert", "--checkpoint", MIRROR, "--out", str(tmp_path / "from_store"))
    assert converted.returncode == 0, converted.stderr[-3000:]
    convert_checkpoint(tmp_path / "checkpoints", tmp_path / "from_disk")
    for part in ("discriminator", "generator"):
        assert (tmp_path / "from_store" / part / "model.safetensors").read_bytes() == \
            (tmp_path / "from_disk" / part / "model.safetensors").read_bytes()
    source = resolve_model(f"{MIRROR}/step00000008", tmp_path / "finetune")  # fine-tuning's --model, one tag
    assert source.hf_dir == tmp_path / "finetune" / "converted" / "step00000008" / "discriminator"
    assert source.config.vocab_size == 2000
