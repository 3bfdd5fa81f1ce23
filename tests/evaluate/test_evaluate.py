"""``python -m convbert_ds.evaluate glue`` end to end on CPU: a tiny ConvBERT exported by the converter, the 9
GLUE task folders in their official layouts made of real sentences, 2 seeds with the random-init baseline and
--from-mnli, 2 jobs side by side; killed mid-way and run again, then the table checked against the jobs' own
results; and as a Slurm array job on the test cluster."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.convert import export_model
from convbert_ds.model import ElectraForPretraining
from glue_factory import write_glue_download
from launch import REPO, env
from shard_factory import read_text_documents

FAST = ["--epochs", "1", "--batch-size", "8", "--max-seq-length", "32", "--save-steps", "1000"]
GLUE8 = ("mnli", "qnli", "qqp", "rte", "sst2", "mrpc", "cola", "stsb")


@pytest.fixture(scope="module")
def model(tiny_corpus, tmp_path_factory):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tiny_corpus["tokenizer"]), local_files_only=True))
    torch.manual_seed(1234)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    export_model(ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=vocab)), out, tiny_corpus["tokenizer"])
    return out / "discriminator"


@pytest.fixture(scope="module")
def glue(tiny_corpus, tmp_path_factory):
    lines = [line for doc in read_text_documents(tiny_corpus["corpus"]) for line in doc]
    sentences = [" ".join(line.split()[:20]) for line in lines if len(line.split()) >= 6][:200]
    return write_glue_download(tmp_path_factory.mktemp("glue"), sentences)


def evaluate(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "convbert_ds.evaluate", *args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_the_whole_glue_table_survives_a_kill_and_matches_the_jobs(model, glue, tmp_path):
    out = tmp_path / "eval"
    args = ["glue", "--model", str(model), "--glue-dir", str(glue), "--out", str(out), "--seeds", "2",
            "--random-init-baseline", "--from-mnli", "--jobs", "2", *FAST]
    first = evaluate(*args)
    finished = lambda: sorted(out.glob("jobs/*/results.json"))  # noqa: E731
    deadline = time.monotonic() + 300
    while len(finished()) < 6 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, first.stdout.read()[-4000:]
    first.send_signal(signal.SIGKILL)  # the workers end with it
    first.wait()
    kept = {path: path.stat().st_mtime_ns for path in finished()}
    assert 6 <= len(kept) < 36

    second = evaluate(*args)
    said = second.communicate(timeout=600)[0]
    assert second.returncode == 0, said[-4000:]
    assert f"{len(kept)} of 36 job(s) finished before; running the other {36 - len(kept)}" in said, said[-4000:]
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in kept.items())  # not run again
    assert len(finished()) == 36 and "Traceback" not in said

    summary = json.loads((out / "results.json").read_text())
    assert summary["failed"] == [] and summary["paper_size"] is None  # the tiny model: no paper row
    by_hand = {}
    for init in ("pretrained", "random"):
        for task, split, metric in [*((t, "dev", m) for t, m in (("qnli", "accuracy"), ("qqp", "accuracy"),
                                                                     ("rte", "accuracy"), ("sst2", "accuracy"),
                                                                     ("mrpc", "accuracy"), ("cola", "mcc"),
                                                                     ("stsb", "spearman"), ("wnli", "accuracy"))),
                                    ("mnli", "dev_matched", "accuracy")]:
            values = [100 * json.loads((out / "jobs" / f"{task}-{init}-seed{s}" / "results.json").read_text())
                      ["seeds"][0]["final"][split][metric] for s in (0, 1)]
            by_hand[init, task] = statistics.median(values)
            assert summary["rows"][init]["tasks"][task]["median"] == pytest.approx(by_hand[init, task])
        assert summary["rows"][init]["glue_average"] == pytest.approx(statistics.fmean(by_hand[init, t] for t in GLUE8))
    for task in GLUE8:
        assert summary["margin"][task] == pytest.approx(by_hand["pretrained", task] - by_hand["random", task])
    # Leaderboard-style: MRPC's F1 and accuracy averaged, WNLI counted.
    mrpc = [json.loads((out / "jobs" / f"mrpc-pretrained-seed{s}" / "results.json").read_text())["seeds"][0]["final"]
            ["dev"] for s in (0, 1)]
    assert summary["rows"]["pretrained"]["tasks"]["mrpc"]["leaderboard"] == pytest.approx(
        (statistics.median(100 * m["f1"] for m in mrpc) + statistics.median(100 * m["accuracy"] for m in mrpc)) / 2)
    # --from-mnli: RTE, MRPC and STS-B started from the MNLI job's best model of their init and seed (the
    # baseline's MNLI run is a random init, and the jobs that start from it load its fine-tuned body).
    started = {path.parent.name: json.loads(path.read_text()) for path in out.glob("jobs/*/results.json")}
    for name, results in started.items():
        task, init, seed = name.split("-")
        mnli = str(out / "jobs" / f"mnli-{init}-{seed}" / "best")
        assert results["model"] == (mnli if task in ("rte", "mrpc", "stsb") else str(model)), name
        assert results["init"] == (init if task not in ("rte", "mrpc", "stsb") else "pretrained"), name
    table = (out / "results.md").read_text()
    assert "| ours, pretrained init (median) |" in table and "| margin (pretrained - random) |" in table
    assert "no paper row is shown" in table


@pytest.mark.slow  # a process of its own, as a user starts it
def test_a_damaged_task_folder_is_refused_before_any_job_starts(model, glue, tmp_path):
    broken = tmp_path / "glue"
    subprocess.run(["cp", "-r", str(glue), str(broken)], check=True)
    (broken / "RTE" / "dev.tsv").unlink()
    out = tmp_path / "eval"
    result = evaluate("glue", "--model", str(model), "--glue-dir", str(broken), "--out", str(out), *FAST)
    said = result.communicate(timeout=120)[0]
    assert result.returncode == 2, said
    assert said.strip().splitlines()[-1] == (
        f"evaluate error: --data-dir {broken / 'RTE'}: dev.tsv not found; point --data-dir at the GLUE RTE folder "
        "with train.tsv and dev.tsv (from the official GLUE download)"), said
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("args, line", [
    (["glue", "--tasks", "rte,squad"], "evaluate error: --tasks rte,squad: squad is not a task of glue; use some of "
                                       "mnli,qnli,qqp,rte,sst2,mrpc,cola,stsb,wnli"),
    (["squad"], "evaluate error: squad needs --squad-dir: the folder with train-v1.1.json and dev-v1.1.json"),
    (["glue", "--tasks", "rte,mrpc", "--from-mnli"], "evaluate error: --from-mnli starts RTE, MRPC and STS-B from "
                                                    "MNLI's fine-tuned model: keep mnli among the tasks"),
    (["glue", "--tasks", "rte"], "evaluate error: GLUE needs --glue-dir: the folder of the GLUE download, with CoLA/, "
                                 "SST-2/, ... MNLI/ in it"),
])
def test_unknown_tasks_and_missing_folders_are_one_line(args, line, tmp_path, capsys):
    from convbert_ds.evaluate.__main__ import main

    assert main([*args, "--model", str(tmp_path), "--out", str(tmp_path / "eval")]) == 2
    assert capsys.readouterr().err.strip() == line
    assert not (tmp_path / "eval").exists()


def test_a_task_longer_than_the_models_positions_is_refused_before_any_job_starts(model, glue, tmp_path, capsys):
    from convbert_ds.evaluate.__main__ import main

    out = tmp_path / "eval"
    assert main(["glue", "--tasks", "rte", "--model", str(model), "--glue-dir", str(glue), "--out", str(out),
                 "--max-seq-length", "1024"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"evaluate error: --model {model}: max_position_embeddings=512 is shorter than rte's length 1024 "
        "(--max-seq-length); pass --max-seq-length 512 to fine-tune on shorter windows, or a model with longer positions")
    assert not (out / "jobs").exists()


@pytest.mark.slow
def test_an_array_job_shares_the_jobs_and_a_resubmission_writes_the_whole_table(cluster, model, glue, tmp_path):
    """slurm/evaluate.sbatch as an array of 2 on the test cluster: each task runs its share (--shard K/2) of the
    4 jobs; the same command again runs nothing and writes the table of all 4."""
    out = tmp_path / "eval"
    activate = Path(sys.executable).parent / "activate"
    job_env = {**cluster.env(env()), "CONVBERT_DS_ENV": str(activate) if activate.is_file() else "none"}
    args = ["glue", "--tasks", "rte,mrpc,cola,stsb", "--model", str(model), "--glue-dir", str(glue), "--out", str(out),
            "--seeds", "1", *FAST]
    array = cluster.run("sbatch", "--parsable", "--array=0-1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=10",
                        str(REPO / "slurm" / "evaluate.sbatch"), *args, cwd=tmp_path, env=job_env).stdout
    infos = [cluster.wait_job(f"{array.strip().split(';')[0]}_{k}", 300) for k in (0, 1)]
    said = [path.read_text() for path in sorted(tmp_path.glob("convbert-evaluate-*.out"))]
    assert all((i["JobState"], i["ExitCode"]) == ("COMPLETED", "0:0") for i in infos), "\n".join(said)[-6000:]
    assert len(said) == 2 and not any("error" in text for text in said), "\n".join(said)[-6000:]
    assert [sum(" done in " in line for line in text.splitlines()) for text in said] == [2, 2], said
    assert all("2 fine-tuning job(s) (4 task(s) x 1 seed(s), share " in text for text in said), said
    assert len(list(out.glob("jobs/*/results.json"))) == 4

    again = evaluate(*args)
    text = again.communicate(timeout=120)[0]
    assert again.returncode == 0 and "4 of 4 job(s) finished before; running the other 0" in text, text[-4000:]
    summary = json.loads((out / "results.json").read_text())
    assert summary["unfinished_elsewhere"] == [] and set(summary["rows"]["pretrained"]["tasks"]) == \
        {"rte", "mrpc", "cola", "stsb"}



@pytest.mark.parametrize("damaged, content, says", [
    ("evaluation.json", "{\"model\": ", "not valid JSON (Expecting value: line 1 column 11 (char 10)); delete it to go "
                                        "on with this command's settings, or pass --force to start over in --out"),
    ("jobs/rte-pretrained-seed0/results.json", "[1, 2]", "not the record expected there (an object with seeds); "
                                                         "delete it and rerun the same command: job "
                                                         "rte-pretrained-seed0 runs again"),
    ("jobs/rte-pretrained-seed0/results.json", '{"seeds": []}', "its first seed has no final metrics; delete it and "
                                                                "rerun the same command: job rte-pretrained-seed0 "
                                                                "runs again"),
], ids=["evaluation-torn", "results-not-a-record", "results-without-seeds"])
def test_a_damaged_record_in_out_is_one_line_before_any_job_runs(model, glue, tmp_path, capsys, damaged, content,
                                                                   says):
    from convbert_ds.evaluate.__main__ import main

    out = tmp_path / "eval"
    (out / damaged).parent.mkdir(parents=True)
    (out / damaged).write_text(content)
    assert main(["glue", "--tasks", "rte", "--seeds", "1", "--model", str(model), "--glue-dir", str(glue),
                 "--out", str(out), *FAST]) == 2
    assert capsys.readouterr().err.strip() == f"evaluate error: {out / damaged}: {says}"
    assert not (out / "jobs" / "rte-pretrained-seed0" / "log.txt").exists()  # no job started


def test_a_damaged_seed_record_of_a_fine_tuning_is_one_line_and_deleted_it_runs_again(model, glue, tmp_path, capsys):
    """A finished seed's seeds/seedN.json (and run.json) read back on a rerun: damaged, one line naming it."""
    from convbert_ds.finetune.__main__ import main

    out = tmp_path / "rte"
    args = ["--model", str(model), "--glue-task", "rte", "--data-dir", str(glue / "RTE"), "--out", str(out),
            "--seeds", "1", *FAST]
    assert main(args) == 0
    seed = out / "seeds" / "seed0.json"
    final = json.loads(seed.read_text())["final"]
    seed.write_text('{"seed": 0}')
    capsys.readouterr()
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        f"finetune error: {seed}: not the record expected there (an object with seed, final); delete it and rerun "
        "the same command: seed 0 is fine-tuned again")
    (out / "run.json").write_text("\xff")
    assert main(args) == 2 and f"finetune error: {out / 'run.json'}: not valid JSON" in capsys.readouterr().err
    (out / "run.json").unlink()
    seed.unlink()
    assert main(args) == 0 and json.loads(seed.read_text())["final"] == final  # the same seed, trained again
