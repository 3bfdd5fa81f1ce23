"""The slurm/ job scripts on a real one-node Slurm cluster (slurmctld + slurmd on loopback, see
slurm_cluster.py): training through srun and through the deepspeed launcher, preemption with
requeue and exact resume, the up-front checks, and the sharding array job with its merge.

Jobs are submitted from a temporary directory with the scripts' own #SBATCH headers, overriding
only the shape (2 processes, 2 stand-in GPUs) and the time limit."""

import json
import re
import shlex
import sys
import time
from pathlib import Path

import pytest

from launch import REPO, TINY_CONFIG, env as launch_env
from slurm_cluster import SlurmCluster, recording_prefix
from wandb_records import offline_runs

pytestmark = pytest.mark.slow

STEPS = 40
SRUN_SHAPE = ("--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=30")
DEEPSPEED_SHAPE = ("--ntasks-per-node=1", "--gpus-per-node=2", "--cpus-per-task=2", "--time=30")


def job_env(cluster: SlurmCluster, **extra: str) -> dict:
    env = cluster.env(launch_env())
    activate = Path(sys.executable).parent / "activate"
    env["CONVBERT_DS_ENV"] = str(activate) if activate.is_file() else "none"
    env.update(extra)
    return env


def submit(cluster: SlurmCluster, workdir: Path, script: str, *args: str, options=(), env=None) -> str:
    """``sbatch`` of ``slurm/SCRIPT ARGS`` from ``workdir``: the job id."""
    return sbatch(cluster, workdir, *options, str(REPO / "slurm" / script), *args, env=env)


def sbatch(cluster: SlurmCluster, workdir: Path, *sbatch_args: str, env=None) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    out = cluster.run("sbatch", "--parsable", *sbatch_args, cwd=workdir, env=env or job_env(cluster)).stdout
    return out.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"


def train_args(shards: Path, run: Path, *extra: str) -> list[str]:
    return [str(TINY_CONFIG), f"data.sets=[{{path: '{shards}', weight: 1.0}}]",
            f"checkpoint.dir={run / 'checkpoints'}", f"log.dir={run / 'logs'}", "log.interval=1",
            f"train.steps={STEPS}", "train.warmup_steps=5", "eval.interval=0", "checkpoint.interval=100",
            "deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32", *extra]


def job_log(workdir: Path, job_id: str) -> str:
    """The job's batch output (all attempts): the script's lines and every rank's output."""
    return "".join(path.read_text() for path in workdir.glob(f"*-{job_id}.out"))


def train_rows(run: Path) -> list[dict]:
    path = run / "logs" / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written while a running job is polled
            continue
    return [r for r in rows if r["split"] == "train"]


def expect_completed(cluster: SlurmCluster, job_id: str, workdir: Path, timeout: float = 300) -> dict:
    info = cluster.wait_job(job_id, timeout)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_log(workdir, job_id)[-6000:]
    return info


def same_steps(rows: list[dict], reference: list[dict]) -> None:
    """Bit-identical per-step losses and sample counts: no sample replayed or skipped."""
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for a, b in zip(rows, reference):
        for key in ("loss", "mlm_loss", "rtd_loss", "consumed_samples"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


@pytest.fixture(scope="module")
def reference(cluster, tiny_corpus, tmp_path_factory):
    """An uninterrupted run through slurm/pretrain.sbatch: the baseline the other runs must reproduce."""
    workdir = tmp_path_factory.mktemp("reference")
    prefix, record = recording_prefix(workdir)  # a container launcher's stand-in: transparent, but recorded
    job = submit(cluster, workdir, "pretrain.sbatch", *train_args(tiny_corpus["shards"], workdir / "run"),
                 options=SRUN_SHAPE, env=job_env(cluster, CONVBERT_DS_LAUNCH_PREFIX=prefix))
    info = expect_completed(cluster, job, workdir)
    return {"workdir": workdir, "run": workdir / "run", "job": job, "info": info,
            "rows": train_rows(workdir / "run"), "log": job_log(workdir, job), "prefix_calls": record}


def test_the_launch_prefix_runs_every_process_of_the_job(reference):
    """CONVBERT_DS_LAUNCH_PREFIX ("apptainer exec IMAGE" in real use) starts every process the job runs:
    the python probe, the config check, the node checks and each trainer task."""
    calls = reference["prefix_calls"].read_text().splitlines()
    assert all(call.startswith("image.sif ") for call in calls), calls
    assert sum(call == "image.sif python -c " for call in calls) == 1, calls
    assert sum("-m convbert_ds.train" in call and "--check-config --world-size 2" in call for call in calls) == 1
    assert sum("cbd_node_check" in call for call in calls) == 1, calls  # one node
    trainers = [call for call in calls if "trainer python -u -m convbert_ds.train" in call]
    assert len(trainers) == 2, calls  # one per srun task
    assert "launch prefix: " in reference["log"]


def test_pretrain_sbatch_trains_with_falling_loss(reference):
    log, rows = reference["log"], reference["rows"]
    assert "launcher=slurm world_size=2" in log
    assert "nodes ok: 1 node(s) x 2 process(es)" in log and "training finished" in log
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = (sum(r["loss"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last < first - 5.0, [round(r["loss"], 2) for r in rows]
    checkpoints = reference["run"] / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step{STEPS:08d}"
    assert (checkpoints / f"step{STEPS:08d}" / "COMPLETE").is_file()
    assert reference["info"]["Restarts"] == "0"
    # The per-job log directory holds the same lines as the batch output, and what was run.
    log_dir = reference["workdir"] / "runs" / "slurm" / f"convbert-pretrain-{reference['job']}"
    assert f"step {STEPS}/{STEPS}" in (log_dir / "job.log").read_text()
    commands = (log_dir / "commands.txt").read_text()
    assert "srun" in commands and "convbert_ds.train" in commands


def test_deepspeed_sbatch_preemption_requeues_and_resumes_exactly(cluster, tiny_corpus, reference, tmp_path):
    """slurm/pretrain_deepspeed.sbatch: one deepspeed launcher per node (under the launch prefix), from a
    hostfile of the job's nodes. USR1 to its job: the trainers checkpoint (the launchers ignore the signal),
    the job requeues, resumes, and ends with the srun run's per-step metrics; its offline W&B run is one run
    across both attempts."""
    wandb = ("log.wandb.project=convbert-ds-test", "log.wandb.mode=offline", "log.wandb.tags=[slurm, requeue]")
    prefix, record = recording_prefix(tmp_path)
    job = submit(cluster, tmp_path, "pretrain_deepspeed.sbatch",
                 *train_args(tiny_corpus["shards"], tmp_path / "run", *wandb), options=DEEPSPEED_SHAPE,
                 env=job_env(cluster, CONVBERT_DS_LAUNCH_PREFIX=prefix))
    step = preempt(cluster, tmp_path, job, 2, "--signal=USR1", "--batch")
    info = expect_completed(cluster, job, tmp_path)
    log = job_log(tmp_path, job)
    launchers = [call for call in record.read_text().splitlines() if "exec deepspeed --hostfile" in call]
    assert len(launchers) == 2 and all(call.startswith("image.sif bash -c ") for call in launchers), launchers
    (log_dir,) = (tmp_path / "runs" / "slurm").glob(f"*-{job}")
    assert (log_dir / "hostfile").read_text() == f"{cluster.job(job)['NodeList']} slots=2\n"
    assert "deepspeed.launcher.launch" in log and "--node_rank=0" in log and "launcher=torch world_size=2" in log
    assert info["Restarts"] == "1" and "preempted; requeueing job" in log, log[-4000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/step{step:08d} at step {step}" in log
    rows = train_rows(tmp_path / "run")
    same_steps(rows, reference["rows"])
    # Both attempts wrote their own offline directory, under the one run id kept in the log directory.
    logs = tmp_path / "run" / "logs"
    attempts = offline_runs(logs)
    run_id = (logs / "wandb_run_id").read_text().strip()
    assert len(attempts) == 2 and {a["run_id"] for a in attempts} == {run_id}, attempts
    assert all(a["project"] == "convbert-ds-test" and a["tags"] == ["slurm", "requeue"] for a in attempts)
    first, second = ([h for h in a["history"] if "train/loss" in h] for a in attempts)
    assert [h["step"] for h in first][:step] == list(range(1, step + 1))
    assert [h["step"] for h in second] == list(range(step + 1, STEPS + 1))
    for logged in first[:step] + second:  # what W&B holds is what metrics.jsonl holds
        assert logged["train/loss"] == rows[logged["step"] - 1]["loss"]


def preempt(cluster: SlurmCluster, workdir: Path, job: str, after_step: int, *scancel: str) -> int:
    """Once the run in ``workdir`` passed ``after_step``, signal ``job``; the step it checkpointed at."""
    wait_for(lambda: train_rows(workdir / "run") and train_rows(workdir / "run")[-1]["step"] >= after_step, 240,
             f"training did not reach step {after_step}")

    def saved() -> list[int]:
        return [int(s) for s in re.findall(r"preempted at step (\d+)", job_log(workdir, job))]

    seen = len(saved())
    cluster.run("scancel", *scancel, job)
    return wait_for(lambda: saved()[seen:], 120, f"job {job} did not checkpoint")[0]


def test_preemption_requeue_limit_and_cancel_all_resume_exactly(cluster, tiny_corpus, reference, tmp_path):
    """One training run cut three times, then finished:
    1. USR1 to the batch script -> checkpoint, requeue, the requeued job resumes;
    2. USR1 again, at CONVBERT_DS_MAX_REQUEUES=1 -> checkpoint, no requeue, exit 3;
    3. a new submission, scancel (SIGTERM) -> checkpoint, the job stays cancelled;
    4. a new submission finishes. The metrics equal the uninterrupted run's, step for step."""
    run, args = tmp_path / "run", train_args(tiny_corpus["shards"], tmp_path / "run")
    preempted: list[int] = []

    def interrupt(job: str, after_step: int, *scancel: str) -> None:
        preempted.append(preempt(cluster, tmp_path, job, after_step, *scancel))

    first = submit(cluster, tmp_path, "pretrain.sbatch", *args, options=SRUN_SHAPE,
                   env=job_env(cluster, CONVBERT_DS_MAX_REQUEUES="1"))
    interrupt(first, 2, "--signal=USR1", "--batch")
    wait_for(lambda: "resumed from" in job_log(tmp_path, first), 240, "the requeued job did not resume")
    interrupt(first, preempted[0] + 2, "--signal=USR1", "--batch")
    info = cluster.wait_job(first, 120)
    log = job_log(tmp_path, first)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "3:0", "1"), log[-4000:]
    assert log.count("received SIGUSR1") == 2
    assert "preempted; requeueing job" in log and "attempt 2 on 1 node(s)" in log
    assert f"resumed from {run / 'checkpoints'}/step{preempted[0]:08d} at step {preempted[0]}" in log
    assert "preempted; not requeueing: the job was already requeued 1 time(s) (CONVBERT_DS_MAX_REQUEUES=1)" in log

    cancelled = submit(cluster, tmp_path, "pretrain.sbatch", *args, options=SRUN_SHAPE)
    wait_for(lambda: f"at step {preempted[1]}" in job_log(tmp_path, cancelled), 240, "no resume")
    interrupt(cancelled, preempted[1] + 2)
    wait_for(lambda: "not requeueing" in job_log(tmp_path, cancelled), 60, "the cancelled job did not finish")
    info = cluster.wait_job(cancelled, 60)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), job_log(tmp_path, cancelled)[-4000:]
    assert "preempted by SIGTERM; not requeueing" in job_log(tmp_path, cancelled)

    last = submit(cluster, tmp_path, "pretrain.sbatch", *args, options=SRUN_SHAPE)
    expect_completed(cluster, last, tmp_path)
    assert f"at step {preempted[2]}" in job_log(tmp_path, last)
    assert preempted[0] < preempted[1] < preempted[2] < STEPS, preempted
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == [f"step{preempted[2]:08d}",
                                                                         f"step{STEPS:08d}"]
    same_steps(train_rows(run), reference["rows"])


def test_resubmitted_on_another_shape_the_run_goes_on(cluster, tiny_corpus, reference, tmp_path):
    """Half the run on 2 processes, then the same script resubmitted with 1: the second job converts the
    checkpoint to its layout and goes on with the sample stream where the first stopped."""
    run, half = tmp_path / "run", STEPS // 2
    args = train_args(tiny_corpus["shards"], run)
    first = submit(cluster, tmp_path, "pretrain.sbatch", *args, f"train.steps={half}", options=SRUN_SHAPE)
    expect_completed(cluster, first, tmp_path)
    smaller = ("--ntasks-per-node=1", "--gpus-per-node=1", *SRUN_SHAPE[2:])
    second = submit(cluster, tmp_path, "pretrain.sbatch", *args, options=smaller)
    expect_completed(cluster, second, tmp_path)
    log = job_log(tmp_path, second)
    assert "launcher=slurm world_size=1" in log
    assert f"at step {half}" in log and "layout changed: 2 ranks, ZeRO-2, fp32 -> 1 rank, ZeRO-2, fp32" in log
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in rows] == [r["consumed_samples"] for r in reference["rows"]]


@pytest.mark.parametrize("case", ["config", "gpus", "checkpoint_dir", "unshared_checkpoint_dir"])
def test_bad_jobs_stop_before_training_with_one_clear_error(case, cluster, tiny_corpus, tmp_path):
    run, shape = tmp_path / "run", list(SRUN_SHAPE)
    extra, message = {
        "config": (["train.global_batch_size=20"],
                   "config error (2 processes): train.global_batch_size=20 is not a multiple"),
        "gpus": ([], "node {node} has 1 GPU(s) for 2 processes"),
        "checkpoint_dir": ([f"checkpoint.dir={tmp_path / 'a_file' / 'checkpoints'}"],
                           "node {node} cannot write to the checkpoint directory"),
        # Node-local disks (each node's own scratch) and no mirror to join the checkpoints' parts.
        "unshared_checkpoint_dir": ([f"checkpoint.dir={cluster.scratch / 'checkpoints'}",
                                     "train.micro_batch_size=4"],
                                    f"checkpoint directory {cluster.scratch / 'checkpoints'} is not shared: files "
                                    "written there on node(s) n2 are not visible on n1; put checkpoint.dir on a "
                                    "filesystem all nodes mount, or set checkpoint.mirror=s3://BUCKET/PREFIX"),
    }[case]
    if case == "gpus":
        shape[1] = "--gpus-per-node=1"
    if case == "unshared_checkpoint_dir":
        shape.append("--nodes=2")
    (tmp_path / "a_file").write_text("not a directory")
    # Not ``sbatch --wait``: it polls at growing intervals and returned about 10 s after these jobs had ended.
    job = submit(cluster, tmp_path, "pretrain.sbatch", *train_args(tiny_corpus["shards"], run, *extra), options=shape,
                 env=job_env(cluster, CONVBERT_DS_SHARED_DISK_WAIT="3"))
    info = cluster.wait_job(job, 180)
    (out,) = tmp_path.glob("convbert-pretrain-*.out")
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), text
    assert message.format(node=info["NodeList"]) in text
    assert "nothing was started" in text or "a node failed its checks" in text or "is not shared" in text
    assert "launcher=" not in text and not (run / "logs").exists()


def test_preprocess_array_and_merge_match_a_single_run(cluster, tiny_corpus, tmp_path):
    result = cluster.run("bash", str(REPO / "slurm" / "preprocess_submit.sh"), "3", "--cpus-per-task=1", "--",
                         "--input", str(tiny_corpus["corpus"]), "--tokenizer", str(tiny_corpus["tokenizer"]),
                         "--out", "shards", "--valid-fraction", "0.05", cwd=tmp_path,
                         env=job_env(cluster, CONVBERT_DS_LAUNCH_PREFIX=recording_prefix(tmp_path)[0]))
    ids = dict(item.split("=") for item in result.stdout.split())
    info = cluster.wait_job(ids["merge"], 240)
    outputs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.out")))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), outputs
    assert len(list(tmp_path.glob("convbert-shard-*_*.out"))) == 3
    merged = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    single = json.loads((tiny_corpus["shards"] / "manifest.json").read_text())
    assert [m["slice"]["index"] for m in merged["merged_from"]] == [0, 1, 2]
    for split in ("train", "valid"):
        for key in ("documents", "sequences", "tokens"):
            assert merged["splits"][split][key] == single["splits"][split][key], (split, key)
    assert merged["splits"]["train"]["tokens"] > 50_000
    calls = (tmp_path / "prefix-calls.txt").read_text().splitlines()  # every task ran through the prefix
    assert sorted(call.split()[3] for call in calls) == ["preprocessing.merge"] + ["preprocessing.shard"] * 3, calls


def test_mpirun_inside_a_slurm_job_takes_ranks_from_mpi(cluster, tmp_path):
    """mpiexec in a batch script starts its ranks through srun, so both see SLURM_PROCID=0 and
    SLURM_NTASKS=1: the ranks must come from MPI, not from those."""
    probe = ("import json, os; from convbert_ds.engine import distributed; launcher = distributed.discover(); "
             "print(json.dumps([launcher, os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['SLURM_PROCID']]))")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    command = f"{shlex.quote(str(mpiexec))} -n 2 {shlex.quote(sys.executable)} -c {shlex.quote(probe)}"
    job = sbatch(cluster, tmp_path, "--ntasks=2", "--output=mpi.out", "--wrap", command)
    info = cluster.wait_job(job, 120)  # not ``sbatch --wait``: see the bad jobs' test
    output = (tmp_path / "mpi.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    ranks = sorted(json.loads(found) for found in re.findall(r"\[[^\[\]]*\]", output))  # lines may interleave
    assert ranks == [["mpi", "0", "2", "0"], ["mpi", "1", "2", "0"]], output
