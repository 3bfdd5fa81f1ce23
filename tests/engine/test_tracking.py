"""Where a run's metrics go besides the log line: metrics.csv and an offline Weights & Biases run, both
holding exactly what metrics.jsonl holds; and the one-line errors for a bad W&B setup."""

import csv
import importlib.util

import pytest

from convbert_ds.config import ConfigError
from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import NOT_THE_SUBJECT, TINY_CONFIG, check, run_training
from wandb_records import offline_runs


def _jsonl_values(run_dir):
    import json
    values = {}
    for row in map(json.loads, (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()):
        for key, value in row.items():
            if key not in ("step", "split") and isinstance(value, (int, float)) and not isinstance(value, bool):
                values[row["split"], row["step"], key] = value
    return values


@pytest.mark.slow
def test_csv_and_offline_wandb_hold_what_metrics_jsonl_holds(tiny_corpus, tmp_path):
    output = check(run_training(tmp_path, tiny_corpus["shards"], "train.steps=6", "train.warmup_steps=2",
                                "eval.interval=3", "checkpoint.interval=100", "log.wandb.project=convbert-ds-test",
                                "log.wandb.mode=offline", "log.wandb.name=tiny-run", "log.wandb.tags=[ci]",
                                launcher=NOT_THE_SUBJECT))
    expected = _jsonl_values(tmp_path)
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["split"], int(r["step"]), r["metric"]): float(r["value"]) for r in rows} == pytest.approx(expected)
    assert {("train", 6, "loss"), ("valid", 3, "rtd_auc")} <= set(expected)

    (attempt,) = offline_runs(tmp_path / "logs")
    assert (attempt["project"], attempt["name"], attempt["tags"]) == ("convbert-ds-test", "tiny-run", ["ci"])
    assert attempt["run_id"] == (tmp_path / "logs" / "wandb_run_id").read_text().strip()
    logged = {(key.split("/")[0], h["step"], key.split("/", 1)[1]): value
              for h in attempt["history"] for key, value in h.items() if "/" in key}
    assert logged == pytest.approx(expected)
    assert "wandb: " in output  # W&B's own lines (rank 0 only) say where the offline run is, to sync it


def test_wandb_errors_are_one_line_before_any_rank(tiny_corpus, monkeypatch):
    sets = f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]"
    with pytest.raises(ConfigError, match=r"log\.wandb\.tags=\[''\]: tags are non-empty strings"):
        resolve(load_config(TINY_CONFIG, [sets, "log.wandb.project=p", "log.wandb.tags=['']"]), world_size=2)
    with pytest.raises(ConfigError, match=r"log\.wandb\.mode='cloud': use one of \['online', 'offline'\]"):
        load_config(TINY_CONFIG, [sets, "log.wandb.mode=cloud"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb"
                        else real_find_spec(name, *a))  # a machine without the optional package
    with pytest.raises(ConfigError, match=r"log\.wandb\.project='p' needs the wandb package, which is not "
                                          r"installed: pip install wandb \(or set log\.wandb\.project=null\)"):
        resolve(load_config(TINY_CONFIG, [sets, "log.wandb.project=p"]), world_size=2)


@pytest.mark.parametrize("damage", [b"", b"\xff\xfe garbage \x00", b"two words\n"])
def test_a_damaged_wandb_run_id_file_starts_a_new_run_with_a_warning(damage, tiny_corpus, tmp_path, capsys):
    from convbert_ds.engine.metrics_log import RUN_ID_FILE, _start_wandb
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]", "log.wandb.project=p",
                                    "log.wandb.mode=offline"])
    (tmp_path / RUN_ID_FILE).write_bytes(damage)
    run = _start_wandb(cfg.log, tmp_path, {})
    run.finish()
    new_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert run.id == new_id and len(new_id) == 12
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert f"{tmp_path / RUN_ID_FILE} is damaged" in line and "logs to a new W&B run" in line
