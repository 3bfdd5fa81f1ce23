"""``python -m convbert_ds.finetune`` end to end on real text: a tiny ConvBERT exported by the converter,
a custom task made of real docstring sentences, transformers as the oracle for ``best/``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.convert import export_model
from convbert_ds.finetune.__main__ import main as finetune_main
from convbert_ds.finetune.loop import Placement, build_optimizer, load_state, save_state
from convbert_ds.finetune.model_source import initial_model, resolve_model
from convbert_ds.finetune.recipe import Recipe
from convbert_ds.model import ConvBertForSequenceClassification, ElectraForPretraining
from launch import REPO, env, free_port, run_group
from shard_factory import read_text_documents

FAST = ["--epochs", "1", "--batch-size", "8", "--max-seq-length", "32", "--save-steps", "1000"]


@pytest.fixture(scope="module")
def hf_model(tiny_corpus, tmp_path_factory):
    """A tiny ELECTRA, converted to transformers directories by the converter; the discriminator's path."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tiny_corpus["tokenizer"]), local_files_only=True))
    torch.manual_seed(1234)  # not a fine-tuning seed: the "pretrained" body must differ from a random init
    model = ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=vocab))
    out = tmp_path_factory.mktemp("hf") / "tiny"
    export_model(model, out, tiny_corpus["tokenizer"])
    return out / "discriminator"


def _sentences(tiny_corpus, n: int) -> list[str]:
    lines = [line for doc in read_text_documents(tiny_corpus["corpus"]) for line in doc]
    return [" ".join(line.split()[:24]) for line in lines if len(line.split()) >= 6][:n]


@pytest.fixture(scope="module")
def task(tiny_corpus, tmp_path_factory):
    """A learnable custom task on real sentences: does the sentence mention "return"-ish words or not?
    Written as JSONL, as users pass their own tasks."""
    root = tmp_path_factory.mktemp("task")
    sentences = _sentences(tiny_corpus, 120)
    rows = [{"text": s, "label": "returns" if "return" in s.lower() else "other"} for s in sentences]
    for name, part in (("train.jsonl", rows[:96]), ("dev.jsonl", rows[96:])):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return root


def _args(hf_model, task, out, *extra: str) -> list[str]:
    return ["--model", str(hf_model), "--train", str(task / "train.jsonl"), "--validation", str(task / "dev.jsonl"),
            "--text-column", "text", "--label-column", "label", "--out", str(out), *FAST, *extra]


def test_layerwise_decay_groups_follow_parameter_names(hf_model):
    source = resolve_model(hf_model, hf_model.parent)
    model = ConvBertForSequenceClassification(source.config, label_names=["a", "b"])
    recipe = Recipe(learning_rate=1.0, layerwise_lr_decay=0.5, weight_decay=0.01)
    optimizer = build_optimizer(model, recipe)
    layers = source.config.num_hidden_layers
    lr_of, decay_of = {}, {}
    for group in optimizer.param_groups:
        for name in group["names"]:
            lr_of[name], decay_of[name] = group["lr"], group["weight_decay"]
    assert set(lr_of) == {name for name, _ in model.named_parameters()}
    for name, lr in lr_of.items():
        if name.startswith("classifier."):
            want = 1.0
        elif name.startswith("convbert.encoder.layer."):
            want = 0.5 ** (layers + 1 - int(name.split(".")[3]))
        else:
            assert name.startswith(("convbert.embeddings.", "convbert.embeddings_project.")), name
            want = 0.5 ** (layers + 2)
        assert lr == pytest.approx(want), name
        no_decay = name.endswith(".bias") or "LayerNorm" in name
        assert decay_of[name] == (0.0 if no_decay else 0.01), name


def _two_labels(config):
    return ConvBertForSequenceClassification(config, label_names=["a", "b"])


def test_random_init_differs_from_pretrained_only_in_the_body_weights(hf_model):
    source = resolve_model(hf_model, hf_model.parent)
    pretrained = initial_model(source, _two_labels, 0.1, seed=3, random_init=False).state_dict()
    random = initial_model(source, _two_labels, 0.1, seed=3, random_init=True).state_dict()
    assert pretrained.keys() == random.keys()
    body = [k for k in pretrained if k.startswith("convbert.") and "LayerNorm" not in k and k.endswith("weight")]
    assert body and all(not torch.equal(pretrained[k], random[k]) for k in body)
    head = [k for k in pretrained if k.startswith("classifier.")]
    assert head and all(torch.equal(pretrained[k], random[k]) for k in head)
    # The RNG after building is the same too: dropout and data order do not depend on the init.
    initial_model(source, _two_labels, 0.1, seed=3, random_init=False)
    after_pretrained = torch.rand(4)
    initial_model(source, _two_labels, 0.1, seed=3, random_init=True)
    assert torch.equal(after_pretrained, torch.rand(4))


def test_resume_state_round_trips_through_the_allow_list(hf_model, tmp_path):
    """What save_state writes, load_state reads weights-only (formats/safe_pickle.py): model, optimizer
    moments, RNG streams, step and history all come back."""
    source = resolve_model(hf_model, hf_model.parent)
    model = initial_model(source, _two_labels, 0.1, seed=3, random_init=False)
    optimizer = build_optimizer(model, Recipe(learning_rate=1e-3))
    ids = torch.ones((2, 6), dtype=torch.long)
    model(ids, torch.ones_like(ids), torch.zeros_like(ids)).sum().backward()
    optimizer.step()  # the state now holds AdamW's moments and step counts
    history = [{"epoch": 1, "step": 5, "metrics": {"validation": {"accuracy": 0.5}}}]
    save_state(tmp_path, 5, model, optimizer, history, Placement(torch.device("cpu")))
    expected_draw = torch.rand(3)
    fresh = initial_model(source, _two_labels, 0.1, seed=4, random_init=True)
    fresh_optimizer = build_optimizer(fresh, Recipe(learning_rate=1e-3))
    assert load_state(tmp_path, 0, fresh, fresh_optimizer) == (5, history)
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())


class _MakesADirectory:
    """A pickle that runs os.mkdir when loaded with full pickle: what a crafted state file could do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_a_state_file_asking_to_run_code_is_refused_in_one_line(hf_model, task, tmp_path, capsys):
    out, witness = tmp_path / "run", tmp_path / "ran"
    state_file = out / "state" / "seed0" / "state.pt"
    state_file.parent.mkdir(parents=True)
    torch.save({"step": 1, "model": _MakesADirectory(witness)}, state_file)
    assert finetune_main(_args(hf_model, task, out, "--max-train-examples", "16")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the datasets library's progress lines
    assert err.startswith("finetune error: seed 0 cannot resume: "), err
    assert str(state_file) in err and "mkdir" in err and f"delete {state_file.parent} to restart" in err, err
    assert not witness.exists()


def _transformers_metric(best: Path, dev: Path) -> float:
    """Accuracy of best/ run by transformers alone, one example at a time (no padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(best), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(best), local_files_only=True)
    rows = [json.loads(line) for line in dev.read_text().splitlines()]
    correct = 0
    with torch.no_grad():
        for row in rows:
            inputs = tokenizer(row["text"], truncation=True, max_length=32, return_tensors="pt")
            predicted = model(**inputs).logits.argmax(-1).item()
            correct += model.config.id2label[predicted] == row["label"]
    return correct / len(rows)


def test_custom_task_over_seeds_and_best_reproduced_by_transformers(hf_model, task, tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune_main(_args(hf_model, task, out, "--seeds", "2", "--epochs", "2")) == 0
    results = json.loads((out / "results.json").read_text())
    assert [s["seed"] for s in results["seeds"]] == [0, 1]
    accuracies = [s["final"]["validation"]["accuracy"] for s in results["seeds"]]
    assert results["median"] == pytest.approx(sum(accuracies) / 2)
    assert all(len(s["history"]) == 2 for s in results["seeds"])  # evaluated after each epoch
    assert results["init"] == "pretrained" and results["model"] == str(hf_model)
    assert results["command"].startswith("python -m convbert_ds.finetune --model")
    assert results["recipe"]["learning_rate"] == 3e-4 and results["recipe"]["epochs"] == 2
    assert "| median |" in (out / "results.md").read_text() and "| median |" in capsys.readouterr().out
    config = json.loads((out / "best" / "config.json").read_text())
    assert config["architectures"] == ["ConvBertForSequenceClassification"]
    assert set(config["id2label"].values()) == {"other", "returns"}
    best = results["seeds"][results["best_seed"]]["final"]["validation"]["accuracy"]
    assert best == max(accuracies)
    assert _transformers_metric(out / "best", task / "dev.jsonl") == pytest.approx(best)


def test_fewer_evaluations_leave_training_and_the_final_metrics_unchanged(hf_model, task, tmp_path):
    """--eval-every-epochs only skips dev passes: the evaluated epochs' metrics and the final ones are exactly
    those of a run that evaluates after every epoch."""
    histories = {}
    for every in ("1", "2", "0"):
        out = tmp_path / f"every{every}"
        assert finetune_main(_args(hf_model, task, out, "--epochs", "3", "--eval-every-epochs", every)) == 0
        histories[every] = json.loads((out / "results.json").read_text())["seeds"][0]["history"]
    assert [h["epoch"] for h in histories["1"]] == [1, 2, 3]
    assert histories["2"] == [histories["1"][1], histories["1"][2]]
    assert histories["0"] == [histories["1"][2]]


def test_length_grouped_batches_reach_the_training_loop(hf_model, task, tmp_path):
    """--group-by-length is recorded and changes the batches (tests/finetune/test_batches.py: which ones), not
    how many steps an epoch has."""
    losses = {}
    for group in ("0", "2"):
        out = tmp_path / f"group{group}"
        assert finetune_main(_args(hf_model, task, out, "--group-by-length", group)) == 0
        assert json.loads((out / "results.json").read_text())["recipe"]["group_by_length"] == int(group)
        losses[group] = [json.loads(line)["loss"] for line in (out / "seeds" / "seed0.jsonl").read_text().splitlines()]
    assert len(losses["0"]) == len(losses["2"]) == 12  # 96 examples / batch 8
    assert losses["0"] != losses["2"]


def test_random_init_run_records_the_same_settings(hf_model, task, tmp_path):
    for name, extra in (("pretrained", []), ("random", ["--random-init"])):
        assert finetune_main(_args(hf_model, task, tmp_path / name, "--max-train-examples", "24", *extra)) == 0
    pretrained, random = (json.loads((tmp_path / n / "run.json").read_text()) for n in ("pretrained", "random"))
    assert {k: v for k, v in pretrained.items() if k != "init"} == {k: v for k, v in random.items() if k != "init"}
    assert (pretrained["init"], random["init"]) == ("pretrained", "random")
    logs = [(tmp_path / n / "seeds" / "seed0.jsonl").read_text().splitlines() for n in ("pretrained", "random")]
    assert len(logs[0]) == len(logs[1]) == 3  # 24 examples / batch 8: same number of steps
    assert logs[0] != logs[1]  # different starting weights give different losses


def test_rerun_with_other_settings_is_refused_and_force_restarts(hf_model, task, tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune_main(_args(hf_model, task, out, "--max-train-examples", "16")) == 0
    assert finetune_main(_args(hf_model, task, out, "--max-train-examples", "16", "--learning-rate", "1e-3")) == 2
    assert "holds a run with different recipe" in capsys.readouterr().err
    assert finetune_main(_args(hf_model, task, out, "--max-train-examples", "16", "--learning-rate", "1e-3",
                               "--force")) == 0
    assert json.loads((out / "run.json").read_text())["recipe"]["learning_rate"] == 1e-3


@pytest.mark.parametrize("case", ["not a directory", "not convbert", "no tokenizer", "missing column",
                                  "too long", "no task", "bad lr"])
def test_bad_input_is_one_line_and_exit_code_2(hf_model, task, tmp_path, capsys, case):
    args = _args(hf_model, task, tmp_path / "out")
    if case == "not a directory":
        args[1] = str(tmp_path / "nowhere")
    elif case == "not convbert":
        bert = tmp_path / "bert"
        bert.mkdir()
        (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
        args[1] = str(bert)
    elif case == "no tokenizer":
        bare = tmp_path / "bare"
        bare.mkdir()
        (bare / "config.json").write_text((hf_model / "config.json").read_text())
        args[1] = str(bare)
    elif case == "missing column":
        args[args.index("--label-column") + 1] = "category"
    elif case == "too long":
        args += ["--max-seq-length", "4096"]
    elif case == "no task":
        args = ["--model", str(hf_model), "--out", str(tmp_path / "out")]
    elif case == "bad lr":
        args += ["--learning-rate", "-1"]
    assert finetune_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("finetune error: ") and "\n" not in err, err
    expected = {"not a directory": "no such directory", "not convbert": "model_type='bert'",
                "no tokenizer": "no tokenizer", "missing column": "category", "too long": "max_position_embeddings",
                "no task": "no task", "bad lr": "--learning-rate"}[case]
    assert expected in err, err


def _finetune_process(args: list[str], **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "convbert_ds.finetune", *args], cwd=REPO,
                            env={**env(), **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_killed_run_resumes_exactly(hf_model, task, tmp_path):
    """kill -9 mid-seed, rerun the same command: the per-step losses and dev metrics of an uninterrupted run."""
    common = ["--seeds", "2", "--epochs", "2", "--save-steps", "3", "--dropout", "0.1"]
    whole = _finetune_process(_args(hf_model, task, tmp_path / "whole", *common))
    assert whole.wait(timeout=600) == 0, whole.stdout.read()
    cut = tmp_path / "cut"
    victim = _finetune_process(_args(hf_model, task, cut, *common))
    log = cut / "seeds" / "seed1.jsonl"
    deadline = time.time() + 600
    while not (log.is_file() and len(log.read_text().splitlines()) >= 7):
        assert victim.poll() is None and time.time() < deadline, victim.stdout.read()
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert (cut / "state" / "seed1" / "state.pt").is_file() and not (cut / "results.json").exists()
    resumed = _finetune_process(_args(hf_model, task, cut, *common))
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()
    for seed in (0, 1):
        assert (cut / "seeds" / f"seed{seed}.jsonl").read_text() == (
            tmp_path / "whole" / "seeds" / f"seed{seed}.jsonl").read_text()
    final = [json.loads((d / "results.json").read_text())["seeds"] for d in (tmp_path / "whole", cut)]
    assert final[0] == final[1]
    assert not (cut / "state" / "seed1").exists()


@pytest.mark.slow
def test_two_ranks_match_one_rank(hf_model, task, tmp_path):
    """torchrun with 2 CPU ranks (gloo, data parallel): without dropout, the same losses as one process."""
    args = _args(hf_model, task, tmp_path / "ddp", "--dropout", "0", "--max-train-examples", "32")
    ddp = run_group([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                     free_port(), "-m", "convbert_ds.finetune", *args], 600, cwd=REPO, env=env())
    assert ddp.returncode == 0, (ddp.stdout + ddp.stderr)[-4000:]
    assert finetune_main(_args(hf_model, task, tmp_path / "one", "--dropout", "0", "--max-train-examples", "32")) == 0
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "seeds" / "seed0.jsonl").read_text().splitlines()]
              for d in ("ddp", "one")]
    assert len(losses[0]) == len(losses[1]) == 4
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    accuracy = [json.loads((tmp_path / d / "results.json").read_text())["seeds"][0]["final"]["validation"]["accuracy"]
                for d in ("ddp", "one")]
    assert accuracy[0] == accuracy[1]


def test_glue_pair_task_from_official_files(hf_model, tiny_corpus, tmp_path):
    """RTE in the GLUE download's format (index, sentence1, sentence2, label): [CLS] A [SEP] B [SEP] pairs."""
    data = tmp_path / "RTE"
    data.mkdir()
    sentences = _sentences(tiny_corpus, 80)
    for name, rows in (("train.tsv", range(0, 60, 2)), ("dev.tsv", range(60, 80, 2))):
        lines = ["index\tsentence1\tsentence2\tlabel"] + [
            f"{i}\t{sentences[i]}\t{sentences[i + 1]}\t{'entailment' if i % 4 else 'not_entailment'}" for i in rows]
        (data / name).write_text("\n".join(lines) + "\n")
    out = tmp_path / "rte"
    assert finetune_main(["--model", str(hf_model), "--glue-task", "rte", "--data-dir", str(data), "--out", str(out),
                          "--epochs", "1", "--max-seq-length", "48"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["primary"] == {"split": "dev", "metric": "accuracy"}
    assert results["recipe"]["epochs"] == 1
    config = json.loads((out / "best" / "config.json").read_text())
    assert sorted(config["id2label"].values()) == ["entailment", "not_entailment"]
    # The pair went in as two segments.
    from convbert_ds.finetune.batches import encode
    from convbert_ds.finetune.tasks import read_glue
    from transformers import AutoTokenizer

    encoded = encode(AutoTokenizer.from_pretrained(str(hf_model)), read_glue("rte", data), read_glue("rte", data).train,
                     48)
    assert all(0 in types and 1 in types for types in encoded.token_type_ids)


def test_regression_task_from_save_to_disk_reproduced_by_transformers(hf_model, tiny_corpus, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from convbert_ds.finetune.metrics import pearson

    sentences = _sentences(tiny_corpus, 100)
    rows = {"first": sentences[0::2], "second": sentences[1::2],
            "score": [len(set(a.split()) & set(b.split())) / 2.5 for a, b in zip(sentences[0::2], sentences[1::2])]}
    for name, part in (("train", slice(0, 40)), ("dev", slice(40, 50))):
        Dataset.from_dict({k: v[part] for k, v in rows.items()}).save_to_disk(str(tmp_path / name))
    out = tmp_path / "reg"
    assert finetune_main(["--model", str(hf_model), "--train", str(tmp_path / "train"), "--validation",
                          str(tmp_path / "dev"), "--text-column", "first", "--text-pair-column", "second",
                          "--label-column", "score", "--task-type", "regression", "--out", str(out),
                          "--epochs", "2", "--max-seq-length", "48"]) == 0
    results = json.loads((out / "results.json").read_text())
    final = results["seeds"][0]["final"]["validation"]
    assert {"pearson", "spearman", "mse"} <= set(final) and results["primary"]["metric"] == "pearson"
    model = AutoModelForSequenceClassification.from_pretrained(str(out / "best")).eval()
    assert model.config.problem_type == "regression" and model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(str(out / "best"))
    with torch.no_grad():
        predicted = [model(**tokenizer(a, b, truncation=True, max_length=48, return_tensors="pt")).logits[0, 0].item()
                     for a, b in zip(rows["first"][40:50], rows["second"][40:50])]
    # After 4 steps the predictions spread over about 1e-3, so float noise of 1e-7 in them moves Pearson ~1e-4.
    assert pearson(predicted, rows["score"][40:50]) == pytest.approx(final["pearson"], abs=1e-3)


@pytest.mark.slow
def test_training_checkpoint_is_converted_on_the_fly(tiny_corpus, task, tmp_path):
    from launch import NOT_THE_SUBJECT, check, run_training

    check(run_training(tmp_path / "train", tiny_corpus["shards"], "train.steps=2", "eval.interval=0", nproc=1,
                       launcher=NOT_THE_SUBJECT))
    out = tmp_path / "ft"
    args = ["--model", str(tmp_path / "train" / "checkpoints"), "--train", str(task / "train.jsonl"),
            "--validation", str(task / "dev.jsonl"), "--text-column", "text", "--label-column", "label",
            "--out", str(out), *FAST, "--max-train-examples", "16"]
    assert finetune_main(args) == 0
    converted = out / "converted" / "step00000002" / "discriminator"
    assert (converted / "model.safetensors").is_file()
    results = json.loads((out / "results.json").read_text())
    assert results["model_resolved"].endswith(f"converted to {converted})")
    assert finetune_main(args) == 0  # a rerun reuses the conversion and the finished seed



def test_recipe_defaults_follow_the_paper_and_electra(hf_model):
    from convbert_ds.config import preset
    from convbert_ds.finetune.errors import FinetuneError
    from convbert_ds.model.optim import linear_warmup_decay

    small, base = preset("small"), preset("base")
    assert Recipe().resolve("rte", small, cuda=False).epochs == 10
    assert Recipe().resolve("stsb", small, cuda=False).epochs == 10
    resolved = Recipe().resolve("sst2", small, cuda=False)
    assert (resolved.epochs, resolved.learning_rate, resolved.dropout, resolved.precision) == (3, 3e-4, 0.1, "fp32")
    assert Recipe().resolve("sst2", base, cuda=True).learning_rate == 1e-4
    assert Recipe().resolve("sst2", base, cuda=True).precision == "bf16"
    assert Recipe(learning_rate=2e-5, epochs=1.5).resolve("rte", base, cuda=False).epochs == 1.5
    # ELECTRA's lengths: 128, SQuAD's windows 512 (and 2 epochs), tagging 256; never past the model's positions
    squad = Recipe().resolve("squad", small, cuda=False)
    assert (resolved.max_seq_length, squad.max_seq_length, squad.epochs) == (128, 512, 2)
    assert Recipe().resolve("conll", small, cuda=False).max_seq_length == 256
    short = dataclasses.replace(small, max_position_embeddings=200)
    assert Recipe().resolve("squad_v2", short, cuda=False).max_seq_length == 200
    with pytest.raises(FinetuneError, match="--max-seq-length=512: the model has only max_position_embeddings=200"):
        Recipe(max_seq_length=512).resolve("sst2", short, cuda=False)
    with pytest.raises(FinetuneError, match="--precision=bf16 needs a CUDA GPU"):
        Recipe(precision="bf16").resolve("sst2", small, cuda=False)
    # 10 steps, 2 of warm-up: 0, 0.5, then linear decay to 0 at step 10.
    assert [linear_warmup_decay(s, 2, 10) for s in (0, 1, 2, 6, 10)] == [0.0, 0.5, 1.0, 0.5, 0.0]


def test_a_single_process_run_leaves_the_environment_alone(hf_model, task, tmp_path):
    """Launchers started after an in-process fine-tuning (benchmarks, tests) must not inherit RANK=0 WORLD_SIZE=1."""
    from convbert_ds.engine.distributed import TORCH_VARS

    before = {name: os.environ.get(name) for name in TORCH_VARS}
    assert finetune_main(_args(hf_model, task, tmp_path / "run", "--max-train-examples", "16")) == 0
    assert {name: os.environ.get(name) for name in TORCH_VARS} == before
