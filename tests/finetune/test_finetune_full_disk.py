"""``python -m convbert_ds.finetune`` on a full disk at each of its writes (real tmpfs filesystems): one line
naming the file, the space free there and what is kept; the user frees space, reruns the same command, and the
run ends exactly as one that never stopped (nothing half-written was read back as whole).

Each write is made to fail alone by mounting a full tmpfs where that file goes (OUT itself, OUT/seeds,
OUT/state/seed0, OUT/predictions/seed0), the rest of OUT on an ordinary disk. The model is 1 layer, 32 wide
(a state file of about 0.5 MB); a run is 2 steps, about a second.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.convert import export_model
from convbert_ds.finetune.__main__ import main
from convbert_ds.finetune.loop import append_log_line
from convbert_ds.fsutil import truncate_jsonl
from convbert_ds.model import ElectraForPretraining

TOKENIZER = Path(__file__).parents[1] / "convert" / "checkpoint_v1" / "tokenizer"  # 400 pieces
RECIPE = ["--epochs", "1", "--batch-size", "8", "--max-seq-length", "32"]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    config = ElectraConfig.from_preset("tiny", vocab_size=400, hidden_size=32, embedding_size=32,
                                       num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    export_model(ElectraForPretraining(config), out, TOKENIZER)
    return out / "discriminator"


def _sentences(module) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.:])\s+", " ".join(module.__doc__.split())) if len(s.split()) >= 5]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """Real sentences (these modules' docstrings), labelled with the module they come from: 16 to train on
    (2 steps of 8), 8 to evaluate."""
    from convbert_ds.finetune import loop, run, squad

    rows = [{"text": s, "label": m.__name__.rsplit(".", 1)[1]} for m in (loop, run, squad) for s in _sentences(m)]
    rows = rows[::2] + rows[1::2]  # the modules mixed in both splits
    root = tmp_path_factory.mktemp("task")
    for name, part in (("train.jsonl", rows[:16]), ("dev.jsonl", rows[16:24])):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return ["--train", str(root / "train.jsonl"), "--validation", str(root / "dev.jsonl"), "--text-column", "text",
            "--label-column", "label"]


def _args(hf_model, task, out: Path, *extra: str) -> list[str]:
    return ["--model", str(hf_model), "--out", str(out), *task, *RECIPE, *extra]


def _outcome(out: Path) -> tuple:
    """What a finished run leaves that a resumed one must leave the same: each seed's history, the log."""
    results = json.loads((out / "results.json").read_text())
    return [s["history"] for s in results["seeds"]], (out / "seeds" / "seed0.jsonl").read_text()


@pytest.fixture(scope="module")
def never_stopped(hf_model, task, tmp_path_factory):
    out = tmp_path_factory.mktemp("never_stopped") / "run"
    assert main(_args(hf_model, task, out, "--save-steps", "1")) == 0
    return _outcome(out)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.rstrip("\n").split("\n")[-1]  # the last line, under the progress bar
    assert err.startswith("finetune error: "), err
    return err.removeprefix("finetune error: ")


def _says(line: str, path: Path, kept: str) -> None:
    assert re.fullmatch(rf"{re.escape(str(path))}: no space left on device \(\d+\.\d MB free there\); "
                        rf"{re.escape(kept)}; free some space there \(or write elsewhere\) and rerun the same "
                        r"command", line), line


STATE = "state/seed0"
LAST_STATE = f"seed 0's state at its last step is kept whole in {{out}}/{STATE}: a rerun finishes it without training"
# where the full disk is mounted in OUT (free bytes left there), the file named, what the line says is kept
SITES = {
    "settings": ("", 0, "run.json", "no part of run.json is left there: a rerun starts a run afresh"),
    "log": ("seeds", 0, "seeds/seed0.jsonl", "seed 0 has no saved state yet: a rerun starts it from its first step"),
    "first state": (STATE, 0, f"{STATE}/state.pt",
                    "seed 0 has no saved state yet: a rerun starts it from its first step"),
    # one state (0.52 MB) fits, the next one's temporary copy beside it does not
    "second state": (STATE, 780_000, f"{STATE}/state.pt",
                     f"seed 0's state of step 1 is kept whole in {{out}}/{STATE}: a rerun resumes there"),
    # the log's page is the last one free
    "seed result": ("seeds", 4096, "seeds/seed0.json", LAST_STATE),
}


@pytest.mark.parametrize("site", SITES)
def test_a_full_disk_is_one_line_and_the_rerun_ends_as_if_never_stopped(hf_model, task, never_stopped, small_disk,
                                                                        tmp_path, capsys, site):
    mount, free, named, kept = SITES[site]
    out = tmp_path / "run"
    disk = small_disk(1 << 21, name=str(Path("run") / mount), leave=free)
    args = _args(hf_model, task, out, "--save-steps", "1")
    assert main(args) == 2
    _says(_one_line(capsys), out / named, kept.format(out=out))
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]  # no half-written file or directory
    (disk / "filler").unlink()  # the user frees some space
    assert main(args) == 0
    assert _outcome(out) == never_stopped


def test_a_full_disk_at_best_keeps_the_last_state_and_the_rerun_trains_no_step_again(hf_model, task,
                                                                                     never_stopped, small_disk,
                                                                                     tmp_path, capsys):
    out = tmp_path / "run"
    disk = small_disk(1 << 21, name="run", leave=64_000)  # OUT: run.json and the log fit, best/ (0.8 MB) not
    small_disk(1 << 21, name="run/state")  # the state on a disk of its own, with room
    args = _args(hf_model, task, out, "--save-steps", "1")
    assert main(args) == 2
    _says(_one_line(capsys), out / "best", LAST_STATE.format(out=out))
    assert not (out / "best").exists() and not [p for p in out.iterdir() if ".tmp-" in p.name]
    log = (out / "seeds" / "seed0.jsonl").read_text()
    (disk / "filler").unlink()
    assert main(args) == 0
    assert (out / "seeds" / "seed0.jsonl").read_text() == log  # finished from the state: no step trained again
    assert _outcome(out) == never_stopped


def test_a_log_line_a_full_disk_cut_short_is_dropped_on_resume(small_disk):
    """The log's line that crosses into a page the disk does not have is written in part (the kernel takes what
    fits): the resumed seed cuts its log back to the state's step, and drops that line with the rest."""
    log = small_disk(1 << 20, leave=4096) / "seed0.jsonl"  # one page free
    step = 0
    with pytest.raises(OSError) as refused:
        while True:
            step += 1
            append_log_line(log, {"step": step, "loss": 0.6931471824645996, "lr": 0.0001})
    assert refused.value.errno == errno.ENOSPC and not log.read_text().endswith("\n")  # a line cut short
    assert truncate_jsonl(log, step) == []  # the resume of a state saved after every whole line: nothing to drop
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, step))
    assert [row["step"] for row in truncate_jsonl(log, 10)] == list(range(11, step))  # a state of step 10


def _squad_v2(path: Path) -> Path:
    """Two one-sentence contexts (from run.py's docstring), a cloze each and a question neither answers."""
    contexts = [("A rerun with other settings is refused.", "refused"),
                ("The best seed's model is written atomically.", "atomically")]
    paragraphs = [{"context": text, "qas": [
        {"id": f"q{i}", "question": text.replace(answer, "what"),
         "answers": [{"text": answer, "answer_start": text.index(answer)}]},
        {"id": f"q{i}-none", "question": "Which seed is the worst?", "answers": [], "is_impossible": True}]}
        for i, (text, answer) in enumerate(contexts)]
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "run", "paragraphs": paragraphs}]}))
    return path


def test_a_full_disk_at_question_answering_predictions(hf_model, small_disk, tmp_path, capsys):
    """The predictions' directory is replaced whole (predictions.json and null_odds.json of one evaluation)."""
    squad = str(_squad_v2(tmp_path / "squad.json"))
    out = tmp_path / "run"
    args = ["--model", str(hf_model), "--out", str(out), "--task", "squad_v2", "--train", squad, "--validation", squad,
            "--epochs", "1", "--max-seq-length", "64", "--doc-stride", "16"]
    disk = small_disk(1 << 20, name="run/predictions/seed0", leave=0)
    assert main(args) == 2
    _says(_one_line(capsys), out / "predictions" / "seed0",
          "seed 0 has no saved state yet: a rerun starts it from its first step")
    (disk / "filler").unlink()
    assert main(args) == 0
    written = disk / "validation"
    assert sorted(p.name for p in written.iterdir()) == ["null_odds.json", "predictions.json"]
    assert set(json.loads((written / "predictions.json").read_text())) == \
        set(json.loads((written / "null_odds.json").read_text())) == {"q0", "q0-none", "q1", "q1-none"}
