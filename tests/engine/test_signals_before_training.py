"""A stopping signal before the first step has ended: the trainer has nothing to save, so it stops at once, in
one line, with ``EXIT_PREEMPTED`` (a job script requeues on it), whatever it is doing. Here: waiting in the
rendezvous for peers that never come (in C++, where Python's own handlers do not run: a trainer sent SIGTERM
there was still waiting 8 minutes later), importing, downloading its shards from a store that does not
answer (the store's patience is minutes), building its sample index, and compiling its first step."""

import signal
import subprocess
import sys
import time

import psutil
import pytest

from convbert_ds.engine.distributed import free_port
from convbert_ds.engine.step_guard import EXIT_PREEMPTED
from launch import REPO, TINY_CONFIG, env
from object_store import S3Server

pytestmark = pytest.mark.slow
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]


def trainer(shards, run_dir, *overrides: str, **variables: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "convbert_ds.train", "--config", str(TINY_CONFIG),
               f"data.sets=[{{path: '{shards}', weight: 1.0}}]", f"checkpoint.dir={run_dir / 'checkpoints'}",
               f"log.dir={run_dir / 'logs'}", "log.interval=1", *overrides]
    return subprocess.Popen(command, cwd=REPO, env={**env(), **variables}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _importing_torch(pid: int) -> bool:
    """Whether process ``pid`` has begun to load torch's libraries (``import torch`` is under way)."""
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


def stopped_within(process: subprocess.Popen, sig: signal.Signals, seconds: float) -> str:
    sent = time.monotonic()
    process.send_signal(sig)
    output = process.communicate(timeout=60)[0]
    assert time.monotonic() - sent < seconds, f"{sig.name}: {time.monotonic() - sent:.1f} s\n{output[-3000:]}"
    assert process.returncode == EXIT_PREEMPTED, output[-3000:]
    assert f"received {sig.name}: stopped before training started: nothing to save" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return output


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_rank_waiting_for_its_peers_stops_at_once(sig, tiny_corpus, tmp_path):
    port = free_port()
    rank0 = trainer(tiny_corpus["shards"], tmp_path, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    deadline = time.monotonic() + 120
    while not any(c.laddr and c.laddr.port == int(port) and c.status == psutil.CONN_LISTEN
                  for c in psutil.Process(rank0.pid).net_connections()):  # rank 0 hosts the rendezvous' store
        assert rank0.poll() is None and time.monotonic() < deadline, "rank 0 never reached the rendezvous"
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the wait for rank 1
    stopped_within(rank0, sig, 10)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").glob("step*"))


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_trainer_still_importing_stops_at_once(sig, tiny_corpus, tmp_path):
    """Before ``main`` runs: the module's own first lines take the signals while torch and DeepSpeed import."""
    rank = trainer(tiny_corpus["shards"], tmp_path, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    deadline = time.monotonic() + 60
    while not _importing_torch(rank.pid):  # torch and DeepSpeed take seconds more
        assert rank.poll() is None and time.monotonic() < deadline, "the trainer never imported torch"
        time.sleep(0.02)
    output = stopped_within(rank, sig, 10)
    assert "KeyboardInterrupt" not in output


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_run_waiting_for_its_store_stops_at_once(sig, tmp_path):
    """The shards' store is down (its port closed): the trainer retries for up to the store's patience, and a
    signal then ends it at once. (Nothing is uploaded: the first request, for the manifest, never answers.)"""
    with S3Server() as server:
        server.pause()
        run = trainer("s3://shards/tiny", tmp_path, f"data.cache_dir={tmp_path / 'cache'}", RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port(), CONVBERT_DS_STORE_PATIENCE="600", **server.env)
        said = []
        for line in run.stdout:
            said.append(line)
            if "the store did not answer" in line:
                break
        assert run.poll() is None, "".join(said)[-3000:]
        stopped_within(run, sig, 10)


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_run_building_its_sample_index_stops_at_once(sig, tiny_corpus, tmp_path):
    """Packing: the sample index of the training split, built afresh (an empty ``data.cache_dir``) with its
    progress bar on the terminal; the signal comes once the bar has shown."""
    run = trainer(tiny_corpus["shards"], tmp_path, f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16",
                  RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=free_port())
    said = ""
    while "packing shards/train" not in said:  # tqdm ends no line until the bar closes: read as it comes
        char = run.stdout.read(1)
        assert char, said[-3000:]
        said += char
    stopped_within(run, sig, 10)
    cache = [p.name for p in (tmp_path / "cache").iterdir()]
    assert not [name for name in cache if name.endswith(".samples")], cache  # stopped inside the build


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_run_compiling_its_first_step_stops_at_once(sig, tiny_corpus, tmp_path):
    run = trainer(tiny_corpus["shards"], tmp_path, "train.compile=true", "train.compile_mode=step",
                  "checkpoint.interval=1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    said = []
    for line in run.stdout:  # the note comes just before the model is built and its first step compiles
        said.append(line)
        if "note: train.compile=true" in line:
            break
    assert run.poll() is None, "".join(said)[-3000:]
    time.sleep(5.0)  # into the compile (a tiny step takes about 30 s here)
    stopped_within(run, sig, 10)
    assert not any((tmp_path / "checkpoints").glob("step*")), "step 1 never ended: there is nothing to save"
