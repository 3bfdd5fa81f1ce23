"""The built-in QA task (``python -m convbert_ds.builtin.docstring_questions``): SQuAD's layout over the
transfer task's held-out summaries, every answer a real span at its offset, the splits sharing no text, the same
files on every run."""

import json

from convbert_ds.builtin.docstring_questions import main, write_qa_task
from convbert_ds.finetune.squad import read_squad


def test_the_qa_task_is_valid_squad_disjoint_and_deterministic(tmp_path, capsys):
    main(["--out", str(tmp_path / "a"), "--train-per-class", "30", "--dev-per-class", "10"])
    assert "questions) and validation.json" in capsys.readouterr().out
    train, dev = (read_squad(tmp_path / "a" / f"{split}.json", version_2=False) for split in ("train", "validation"))
    assert len(train) > 150 and len(dev) > 40  # read_squad checked every answer against its context
    for question in train + dev:
        (text, start), = question.answers
        assert question.question.replace("what", text, 1).rstrip("?") in question.context
        assert question.context[start:start + len(text)] == text
    assert not {q.context for q in train} & {q.context for q in dev}
    write_qa_task(tmp_path / "b", 30, 10)
    for split in ("train", "validation"):
        assert json.loads((tmp_path / "a" / f"{split}.json").read_text()) == \
            json.loads((tmp_path / "b" / f"{split}.json").read_text())
