"""``torchrun --nnodes=1:2`` with its c10d rendezvous: two agents on loopback (two "nodes" of 2 ranks each),
one killed with everything it started, as a dead machine leaves them. The other agent's ranks stop in one
line each, it starts them again on its own node (the rendezvous closes at the 1 node left), and the run goes
on from the newest complete checkpoint at 2 ranks with the global batch held; started again, the killed agent
joins, and the run grows back to 4 ranks. No sample is skipped or repeated: step N's consumed count is N x
the global batch."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launch import REPO, TINY_CONFIG, env, free_port, train_metrics

pytestmark = pytest.mark.slow

STEPS, GLOBAL_BATCH = 100, 16


def agent(name: str, port: str, shards: Path, run: Path, host: bool) -> subprocess.Popen:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--nnodes=1:2", "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=elastic-test", "--max-restarts=3", "--monitor-interval=1",
               # a lost agent is noticed within seconds; a rendezvous closes 5 s after its last arrival (both
               # agents make the first one); on one machine both agents would take themselves for the store's
               # host: say which one is
               "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5,join_timeout=120,"
               f"is_host={str(host).lower()}",
               "-m", "convbert_ds.train", "--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}', weight: 1.0}}]",
               f"checkpoint.dir={run / 'checkpoints'}", f"log.dir={run / 'logs'}", "log.interval=1",
               f"train.steps={STEPS}", "train.warmup_steps=5", "eval.interval=0", "checkpoint.interval=4",
               "train.micro_batch_size=4", "deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32"]
    log = open(run.parent / f"{name}.log", "a")  # noqa: SIM115 - the agent writes it as long as it runs
    # Without it, an agent that stays rank 0 while another joins does not publish the new round's rank-0
    # address, and the joining agent waits for it until the rendezvous times out (torch 2.13's shared store).
    grows = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(command, cwd=REPO, env={**env(), **grows}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_tree(process: subprocess.Popen) -> None:
    """The agent and everything it started (its ranks run in sessions of their own)."""
    root = psutil.Process(process.pid)
    for each in [*root.children(recursive=True), root]:
        try:
            each.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def wait_for(condition, timeout: float, what: str, *agents: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    for each in agents:
        kill_tree(each)
    raise TimeoutError(what)


def test_an_agent_lost_the_run_goes_on_at_2_ranks_then_grows_back(tiny_corpus, tmp_path):
    run, port = tmp_path / "run", free_port()
    run.mkdir()
    a = agent("a", port, tiny_corpus["shards"], run, host=True)
    b = agent("b", port, tiny_corpus["shards"], run, host=False)
    said = lambda name: (tmp_path / f"{name}.log").read_text()  # noqa: E731
    steps = lambda: [r["step"] for r in train_metrics(run)] if (run / "logs" / "metrics.jsonl").is_file() else []  # noqa: E731
    try:
        wait_for(lambda: steps() and steps()[-1] >= 10, 240, "the run did not reach step 10", a, b)
        assert "launcher=torch world_size=4" in said("a") + said("b")
        kill_tree(b)
        # b starts again once a's 2 ranks have resumed: a join before that restarts them before they go on
        went_on = lambda: "resumed from" in said("a").partition("launcher=torch world_size=2")[2]  # noqa: E731
        wait_for(went_on, 120, "a did not go on alone", a)
        b = agent("b", port, tiny_corpus["shards"], run, host=False)
        # rank 0 of the grown run may be on either agent
        grown = lambda: (said("a") + said("b")).count("launcher=torch world_size=4") == 2  # noqa: E731
        wait_for(grown, 120, "the run did not grow back", a, b)
        assert a.wait(timeout=300) == 0 and b.wait(timeout=60) == 0, said("a")[-4000:] + said("b")[-4000:]
    finally:
        for each in (a, b):
            if each.poll() is None:
                kill_tree(each)
    alone = said("a").split("launcher=torch world_size=2")
    assert alone[0].count("lost its connection to another rank") == 2, alone[0][-4000:]  # a's 2 ranks, a line each
    assert "grad_accum=2" in alone[1] and "resumed from" in alone[1]
    rows = train_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in rows] == [GLOBAL_BATCH * r["step"] for r in rows]
