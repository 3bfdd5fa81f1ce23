"""``python -m convbert_ds.plot``: the curves of a log whose last line a kill tore, or with lines that are not
metrics rows (other bytes, other JSON), are drawn from the rows it can read, with one warning; a log with no
row is one line. (A real run's log is plotted in tests/engine/test_train.py.)"""

import json

import pytest

from convbert_ds.cli import exit_on_user_error
from convbert_ds.plot import main, read_metrics


def _rows(steps: int) -> str:
    return "".join(json.dumps({"split": "train", "step": s, "loss": 9.0 - s, "mlm_loss": 7.0 - s / 2,
                               "rtd_loss": 0.5, "rtd_accuracy": 0.8}) + "\n" for s in range(1, steps + 1))


def test_a_torn_and_damaged_log_is_plotted_from_its_readable_rows(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(_rows(3).encode() + b'{"step": "x"}\n\xff\xfe not json\n' + _rows(5).encode()[-40:])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    warned = f"warning: {log}: skipped 3 line(s) that are not metrics rows (line 4 and others)\n"
    assert capsys.readouterr().err == warned
    assert exit_on_user_error(lambda: main([str(tmp_path)])) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'curves.png'}\n"
    assert (tmp_path / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("content", [b"", b"\n\n", b'["not", "a", "row"]\n'])
def test_a_log_without_a_row_is_one_line(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_bytes(content)
    assert exit_on_user_error(lambda: main([str(tmp_path)])) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert err == [f"error: {tmp_path / 'metrics.jsonl'} holds no metrics rows: pass the log.dir of a run that has "
                   "logged a step"]
