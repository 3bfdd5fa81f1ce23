"""Training across two nodes of the session's Slurm cluster (``slurm_cluster.py``: each node a ``slurmd`` in
namespaces of its own, with its own hostname and its own node-local disk at ``cluster.scratch``), with
checkpoints on those node-local disks joined in an object store (a real S3 server on loopback).

One run is cut and finished, and every step of it equals a one-node run's with the same 4 ranks, to the bit:
1. ``slurm/pretrain.sbatch`` (srun) on 2 nodes x 2 ranks saves at steps 4, 8 and 12 into each node's own disk:
   step 4 is complete in the store; the last node's upload of step 8 fails, so the store keeps step 4 as its
   newest complete checkpoint and ``latest``; rank 0 is killed in the save of step 12;
2. both nodes' disks are emptied (new machines), and ``slurm/pretrain_deepspeed.sbatch`` (one deepspeed
   launcher per node) on the same 2 nodes downloads step 4 onto each node's disk and trains steps 5-16.
"""

import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

from launch import FAULTY_TRAIN, NOT_THE_SUBJECT, REPO, check, run_training, train_metrics
from slurm_cluster import SLURMD_TIMEOUT, SlurmCluster
from test_slurm import (expect_completed, job_env, job_log, preempt, sbatch, submit, train_args, train_rows,
                        wait_for)

pytestmark = pytest.mark.slow

STEPS = 16
FOUR_RANKS = (f"train.steps={STEPS}", "train.micro_batch_size=4", "checkpoint.interval=4", "checkpoint.keep_last=2")
MIRROR = "s3://several-nodes/run"  # a bucket of this file's own: the S3 server lives for the session
TWO_NODES_SRUN = ("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=30")
TWO_NODES_DEEPSPEED = ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2", "--cpus-per-task=2", "--time=30")
KEYS = ("loss", "mlm_loss", "rtd_loss", "grad_norm", "consumed_samples")


def faulty_prefix(directory: Path, *faults: str) -> str:
    """A launch prefix (``CONVBERT_DS_LAUNCH_PREFIX``) that runs each trainer task as ``tests/faulty_train.py
    FAULTS`` (the same trainer, with the faults set) and every other process of the job unchanged."""
    script = directory / "faulty-exec"
    script.write_text(f"""#!/bin/bash
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = -m ] && [ "${{2:-}}" = convbert_ds.train ] && [[ " $* " != *" --check-config "* ]]; then
    args+=({FAULTY_TRAIN} {' '.join(faults)}); shift 2
  else
    args+=("$1"); shift
  fi
done
exec "${{args[@]}}"
""")
    script.chmod(0o755)
    return str(script)


def store_state(s3_server) -> tuple[list[str], str, set[str]]:
    """The store's complete tags, what its ``latest`` names, and every tag it holds objects of."""
    keys = {k[len("run/"):]: v for k, v in s3_server.snapshot("several-nodes").items()}
    complete = sorted(k.split("/")[0] for k in keys if k.endswith("/COMPLETE"))
    return complete, keys.get("latest", b"").decode().strip(), {k.split("/")[0] for k in keys if "/" in k}


def same_steps(rows: list[dict], reference: list[dict], steps) -> None:
    by_step = {r["step"]: r for r in rows}  # the last attempt's row of a step done twice
    expected = {r["step"]: r for r in reference}
    for step in steps:
        for key in KEYS:
            assert by_step[step][key] == expected[step][key], (step, key, by_step[step][key], expected[step][key])


@pytest.fixture(scope="module")
def one_node(tiny_corpus, tmp_path_factory) -> list[dict]:
    """The steps of the same run on one node (4 ranks, one launcher): what every run across 2 nodes must equal."""
    reference = tmp_path_factory.mktemp("one_node")
    check(run_training(reference, tiny_corpus["shards"], *FOUR_RANKS, "train.warmup_steps=5", "eval.interval=0",
                       "deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32", nproc=4,
                       launcher=NOT_THE_SUBJECT))
    return train_metrics(reference)


def test_node_local_disks_join_in_the_store_survive_a_failed_upload_and_resume_on_empty_disks(
        cluster: SlurmCluster, tiny_corpus, one_node, s3, tmp_path):
    expected = one_node
    s3.client().create_bucket(Bucket="several-nodes")
    run, local = tmp_path / "run", cluster.scratch / "run"
    args = [*train_args(tiny_corpus["shards"], run, *FOUR_RANKS, f"checkpoint.mirror={MIRROR}"),
            f"checkpoint.dir={local}"]
    prefix = faulty_prefix(tmp_path, "--fail-upload", "8", "--kill-during-save", "12")

    first = submit(cluster, tmp_path, "pretrain.sbatch", *args, options=TWO_NODES_SRUN,
                   env=job_env(cluster, CONVBERT_DS_LAUNCH_PREFIX=prefix))
    info = cluster.wait_job(first, 300)
    log = job_log(tmp_path, first)
    assert info["JobState"] == "FAILED" and info["NodeList"] == "n[1-2]", log[-6000:]
    assert "launcher=slurm world_size=4" in log and "nodes ok: 2 node(s) x 2 process(es)" in log, log[-6000:]
    assert f"checkpoint.dir {local} is node-local (2 disks: n1: ranks 0-1; n2: ranks 2-3)" in log, log[-6000:]
    assert f"uploaded checkpoint step00000004 to {MIRROR} from 2 nodes (n1 " in log
    assert (f"warning: checkpoint step00000008 not saved in {MIRROR}: n2's upload failed: the store refused the "
            "upload (injected by a test); latest still names step00000004") in log, log[-6000:]
    same_steps(train_rows(run), expected, range(1, 13))
    # Step 8's part from n1 is in the store, but without COMPLETE the tag does not count; latest never moved.
    complete, latest, present = store_state(s3)
    assert (complete, latest) == (["step00000004"], "step00000004") and "step00000008" in present
    # Each node's disk holds the files of its own ranks only: the two parts are disjoint, and whole together.
    parts = {node: {p.name for p in (cluster.disk(node) / "run" / "step00000004").iterdir()} for node in cluster.nodes}
    assert parts["n1"].isdisjoint(parts["n2"]), parts
    assert {"rng_rank00002.pt", "rng_rank00003.pt"} <= parts["n2"] and "trainer_state.json" in parts["n1"]
    manifest = json.loads(s3.snapshot("several-nodes")["run/step00000004/COMPLETE"])
    assert set(manifest["files"]) == parts["n1"] | parts["n2"] and manifest["world_size"] == 4
    assert not (cluster.disk("n1") / "run" / "step00000008").exists()  # a failed save's part is removed

    for node in cluster.nodes:  # new machines: nothing on their disks
        shutil.rmtree(cluster.disk(node) / "run")
    second = submit(cluster, tmp_path, "pretrain_deepspeed.sbatch", *args, options=TWO_NODES_DEEPSPEED)
    info = cluster.wait_job(second, 300)
    log = job_log(tmp_path, second)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert "launcher=torch world_size=4" in log and "--node_rank=1" in log, log[-6000:]
    assert log.count(f"downloaded checkpoint step00000004 from {MIRROR} into {local}") == 2, log[-6000:]  # a node each
    assert f"resumed from {local}/step00000004 at step 4" in log
    same_steps(train_rows(run), expected, range(1, STEPS + 1))
    complete, latest, present = store_state(s3)
    assert (complete, latest) == (["step00000012", "step00000016"], "step00000016"), (complete, present)
    for node in cluster.nodes:  # keep_last=2 on each node's disk as in the store
        assert sorted(p.name for p in (cluster.disk(node) / "run").iterdir() if p.name.startswith("step")) == \
            ["step00000012", "step00000016"]


def test_mpirun_across_two_nodes_trains_as_one_node(cluster: SlurmCluster, tiny_corpus, one_node, tmp_path):
    """``mpiexec -n 4`` in a job of 2 nodes x 2 tasks: MPICH starts one proxy per node through ``srun`` and each
    proxy starts its node's 2 ranks; the ranks take their numbers from MPI (not from the proxies' Slurm step)
    and train, step for step, as 4 ranks on one node do."""
    run = tmp_path / "run"
    mpiexec = Path(sys.executable).parent / "mpiexec"
    placement = ("import json, os, socket; from convbert_ds.engine import distributed; distributed.discover(); "
                 "print(json.dumps(['placed', os.environ['RANK'], os.environ['LOCAL_RANK'], socket.gethostname()]))")
    trainer = [sys.executable, "-u", "-m", "convbert_ds.train", "--config",
               *train_args(tiny_corpus["shards"], run, *FOUR_RANKS)]
    command = " && ".join(" ".join(shlex.quote(a) for a in [str(mpiexec), "-n", "4", *what])
                          for what in ([sys.executable, "-c", placement], trainer))
    job = sbatch(cluster, tmp_path, "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                 f"--output={tmp_path}/mpi-%j.out", f"--chdir={REPO}", "--wrap", command)
    info = cluster.wait_job(job, 300)
    text = (tmp_path / f"mpi-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), text[-6000:]
    placed = sorted(json.loads(found)[1:] for found in re.findall(r'\["placed"[^\]]*\]', text))
    assert placed == [["0", "0", "n1"], ["1", "1", "n1"], ["2", "0", "n2"], ["3", "1", "n2"]], text[-6000:]
    assert "launcher=mpi world_size=4" in text, text[-6000:]
    same_steps(train_rows(run), one_node, range(1, STEPS + 1))


def test_the_trainer_itself_refuses_node_local_disks_without_a_mirror_in_one_line(cluster, tiny_corpus, tmp_path):
    """Started without the job scripts' checks (``srun python -m convbert_ds.train`` on 2 nodes), the trainer
    finds that each node sees only its own files in ``checkpoint.dir`` and stops before building anything."""
    local = cluster.scratch / "no-mirror"
    command = " ".join(["srun", sys.executable, "-u", "-m", "convbert_ds.train", "--config",
                        *(shlex.quote(a) for a in train_args(tiny_corpus["shards"], tmp_path / "run",
                                                             "train.micro_batch_size=4", f"checkpoint.dir={local}"))])
    job = sbatch(cluster, tmp_path, "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                 f"--output={tmp_path}/refused-%j.out", f"--chdir={REPO}", "--wrap", command,
                 env=job_env(cluster, CONVBERT_DS_SHARED_DISK_WAIT="3"))
    info = cluster.wait_job(job, 180)
    text = (tmp_path / f"refused-{job}.out").read_text()
    assert info["JobState"] == "FAILED", text[-4000:]
    assert (f"error: checkpoint.dir={local} is not shared: files written there on n2 are not visible on n1; put "
            "checkpoint.dir on a filesystem every node mounts, or set checkpoint.mirror=s3://BUCKET/PREFIX") in text
    assert "Traceback" not in text and "step 1/" not in text, text[-4000:]


# CONVBERT_DS_TEST_NODE_FAILURE=hang: the lost node hangs instead of dying (its processes stopped, their
# connections left open), as a machine that locks up or drops off the network.
HANG = os.environ.get("CONVBERT_DS_TEST_NODE_FAILURE", "death") == "hang"


def test_a_lost_node_the_run_goes_on_with_the_nodes_left_then_grows_back(cluster, tiny_corpus, tmp_path):
    """2 nodes x 2 ranks with ``--nodes=1-2``; node n2 killed mid-run (every process of it, as a dead machine
    leaves them): the ranks on n1 stop with one line each, Slurm takes n2 out of the job, and the script starts
    the training step again on n1 alone (2 ranks, gradient accumulation 2: the global batch held) from the
    newest complete checkpoint. n2 comes back; a preemption requeues the job, and the next attempt runs on both
    nodes again. No sample is skipped or repeated: step N's consumed count is N x the global batch."""
    run = tmp_path / "run"
    args = train_args(tiny_corpus["shards"], run, "train.steps=24", "train.micro_batch_size=4", "checkpoint.interval=4")
    job = submit(cluster, tmp_path, "pretrain.sbatch", *args,
                 options=("--nodes=1-2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=30"))
    wait_for(lambda: train_rows(run) and train_rows(run)[-1]["step"] >= 10, 240, "training did not reach step 10")
    top, killed = train_rows(run)[-1]["step"], time.time()
    cluster.kill_node("n2", hang=HANG)
    # n2 stays dead until Slurm has taken it out of the job (back sooner, it would be a node that never left):
    # about SlurmdTimeout plus a third of it.
    wait_for(lambda: "node(s) n2 lost; resuming" in job_log(tmp_path, job), 240 + 2 * SLURMD_TIMEOUT,
             "the run did not restart without n2")
    cluster.start_node("n2")
    # A step or two may still be logged after the kill, and the restart removes them: top + 3 is the restart's.
    preempt(cluster, tmp_path, job, top + 3, "--signal=USR1", "--batch")
    info = expect_completed(cluster, job, tmp_path, timeout=400)
    log = job_log(tmp_path, job)
    assert "attempt 1 on 2 node(s) (n[1-2])" in log and "launcher=slurm world_size=4" in log, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    if HANG:  # the ranks on n1 wait in their collective until Slurm takes n2 out; srun then ends the step
        assert "srun: error: Node failure on n2" in log, log[-6000:]
    else:
        assert log.count("lost its connection to another rank") == 2, log[-6000:]  # ranks 0 and 1, a line each
        assert "error: rank 0 lost its connection to another rank" in log, log[-6000:]
        # Exit code 5 makes the script look for a silent node for a whole SlurmdTimeout (with Slurm's default,
        # 300 s, srun may end the step, --wait=60, before Slurm's first missed ping), then wait for Slurm.
        assert ("a trainer lost a peer (exit status 5): looking for a node of the job that stopped answering (up "
                f"to SlurmdTimeout, {SLURMD_TIMEOUT} s)") in log, log[-6000:]
    assert "node(s) n2 lost; resuming on 1 node(s) x 2 process(es) (n1)" in log, log[-6000:]
    assert "launcher=slurm world_size=2" in log and "grad_accum=2" in log
    assert re.search(r"(steps \d+-\d+ were|step \d+ was) trained before this restart and (are|is) trained again", log)
    assert info["Restarts"] == "1" and "attempt 2 on 2 node(s) (n[1-2])" in log, log[-6000:]  # grown back
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 25))
    restart = log[log.index("node(s) n2 lost; resuming"):]
    first = re.search(rf"^\[([\d-]+ [\d:]+)\] step ({'|'.join(str(s) for s in range(top + 1, 25))})/24 ", restart, re.M)
    print(f"node loss: {time.mktime(time.strptime(first[1], '%Y-%m-%d %H:%M:%S')) - killed:.0f} s from the kill "
          f"to step {first[2]} after the restart (the first past the last step logged before the kill)")
    assert [r["consumed_samples"] for r in rows] == [16 * r["step"] for r in rows]
