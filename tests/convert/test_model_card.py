"""The model card's results: the last validation pass at or before the checkpoint and that step's transfer
probe, read from the run's own metrics log (written here by the trainer's real writer); its front matter as the
Hub reads it (license, Hub dataset ids), from a card the converter writes."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from convbert_ds.config import ElectraConfig
from convbert_ds.convert.__main__ import main as convert_main
from convbert_ds.convert.model_card import CardFacts, CardLicense, model_card
from convbert_ds.engine.metrics_log import MetricsLog
from convbert_ds.formats.checkpoint.run_state import RunState
from convbert_ds.formats.init_dir import ConvertError
from convbert_ds.formats.train_config import load_config
from launch import TINY_CONFIG

CHECKPOINT_V1 = Path(__file__).parent / "checkpoint_v1"
# A file as the Hub's client caches it (hf download, datasets): its path names the dataset.
HUB_PARQUET = ("/home/u/.cache/huggingface/hub/datasets--wikimedia--wikipedia/snapshots/b04c8d1/20231101.en/"
               "train-00000-of-00041.parquet")


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n"), card[:200]
    return yaml.safe_load(card.split("---\n")[1])


def _state(tiny_corpus, tmp_path, *overrides):
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]",
                                    f"log.dir={tmp_path / 'logs'}", *overrides])
    return cfg, RunState.from_dict({"config": cfg.to_dict(), "step": 20, "tokens_seen": 20480, "phase": {"index": 1},
                                    "data": {"consumed_samples": 320}, "electra_config": {},
                                    "data_sets": [{"path": str(tiny_corpus["shards"]), "weight": 1.0}]}, "a test")


def test_card_reports_the_last_validation_and_the_probe_at_the_checkpoints_step(tiny_corpus, tmp_path):
    cfg, state = _state(tiny_corpus, tmp_path, "eval.downstream.glue_task=sst2", "eval.downstream.data_dir=x")
    log = MetricsLog(cfg.log_dir, start_step=0, enabled=True, section=cfg.log)
    for step, loss in ((10, 9.5), (20, 8.25), (30, 7.0)):  # step 30 is after the checkpoint: not reported
        log.write(step, {"loss": loss, "mlm_loss": 3.0, "rtd_loss": 0.4, "rtd_auc": 0.7}, prefix="valid")
    log.write(10, {"score": 0.61, "random_init": 0.55}, prefix="downstream")
    log.write(20, {"score": 0.66, "random_init": 0.55}, prefix="downstream")
    log.close()
    electra = ElectraConfig.from_preset("tiny", vocab_size=2000)
    card = model_card(electra, CardFacts(source="a test", command="python -m convbert_ds.convert ...",
                                         trainer_state=state), "fp32", None)
    assert ("- validation at step 20 (64 held-out samples): loss 8.2500, mlm_loss 3.0000, rtd_loss 0.4000, "
            "rtd_auc 0.7000") in card
    assert ("- transfer probe at this step (fine-tuned on sst2, median over seeds): 0.6600 against 0.5500 "
            "from random init") in card
    assert "- recipe: electra from preset `tiny`, masking `fixed`, sequences of 64 tokens, global batch 16" in card
    # A local file is no Hub dataset id: it is named in the text, where it came from, not under datasets:.
    assert "datasets" not in _front_matter(card)
    source = json.loads((tiny_corpus["shards"] / "manifest.json").read_text())["sources"][0]
    assert f"  - from `{source['path']}` (text, {source['bytes']:,} bytes, {source['documents']:,} documents)" in card


def test_card_lists_hub_datasets_only_and_says_when_the_license_is_missing(tiny_corpus, tmp_path):
    """A source read from the Hub's cache is a dataset id in the front matter; without a license the card has
    no license key (``other`` alone is not valid Hub metadata) and its publishing section asks for one."""
    shards = tmp_path / "shards"
    shards.mkdir()
    manifest = json.loads((tiny_corpus["shards"] / "manifest.json").read_text())
    manifest["sources"].append({"path": HUB_PARQUET, "format": "parquet", "compression": None, "bytes": 5000,
                                "documents": 7})
    (shards / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{shards}'}}]", f"log.dir={tmp_path / 'logs'}",
                                    "train.steps=10", "train.warmup_steps=0"])
    state = RunState.from_dict({"config": cfg.to_dict(), "step": 10, "tokens_seen": 1, "phase": {"index": 1},
                                "data": {"consumed_samples": 1}, "electra_config": {},
                                "data_sets": [{"path": str(shards), "weight": 1.0}]}, "a test")
    card = model_card(ElectraConfig.from_preset("tiny", vocab_size=2000), CardFacts("a test", "cmd", state), "fp32",
                      None)
    meta = _front_matter(card)
    assert meta["datasets"] == ["wikimedia/wikipedia"] and "license" not in meta
    assert (f"  - from `{HUB_PARQUET}` (parquet, 5,000 bytes, 7 documents), the Hub dataset `wikimedia/wikipedia`"
            in card)
    assert "No license was given at conversion (`--license`): add `license:` to the front matter" in card
    assert "0 warm-up steps then linear decay over 10 steps" in card


def test_the_converter_writes_the_license_name_the_hub_needs_for_other(tmp_path, monkeypatch):
    """The real converter on a stored checkpoint, its manifest given a source from the Hub's cache: every card's
    front matter parses, with license_name and license_link beside license other, and the Hub id only."""
    run = tmp_path / "run"
    shutil.copytree(CHECKPOINT_V1, run)
    manifest = json.loads((run / "shards" / "manifest.json").read_text())
    manifest["sources"].append({"path": HUB_PARQUET, "format": "parquet", "compression": None, "bytes": 5000,
                                "documents": 7})
    (run / "shards" / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(run)  # the run recorded its shards as "shards", relative to where it ran
    assert convert_main(["--checkpoint", "checkpoints", "--out", "hf", "--tokenizer", "tokenizer", "--license", "other",
                         "--license-name", "my-license-1.0", "--license-link", "LICENSE"]) == 0
    for card, tag in (("README.md", "feature-extraction"), ("discriminator/README.md", "feature-extraction"),
                      ("generator/README.md", "fill-mask")):
        text = (run / "hf" / card).read_text()
        assert _front_matter(text) == {
            "library_name": "transformers", "license": "other", "license_name": "my-license-1.0",
            "license_link": "LICENSE", "tags": ["convbert", "electra", "convbert_ds", "pretraining"],
            "datasets": ["wikimedia/wikipedia"], "pipeline_tag": tag}, card
        assert "  - from `corpus.txt` (text, 60,290 bytes, 228 documents)" in text
        assert "Upload with `hf upload ORG/NAME" in text


@pytest.mark.parametrize("options, message", [
    (["--license", "other"], "--license other needs --license-name NAME"),
    (["--license-link", "LICENSE"], "--license other needs --license-name NAME"),
    (["--license", "Apache 2.0"], "--license 'Apache 2.0': not a Hub license id"),
    (["--license", "mit", "--license-name", "x"], "--license-name and --license-link go with --license other"),
    (["--license", "other", "--license-name", "My License"], "--license-name 'My License': use an id of"),
])
def test_a_license_the_hub_cannot_read_is_one_line_before_any_work(options, message, tmp_path, capsys):
    assert convert_main(["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "out"), *options]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_card_license_is_checked_for_api_callers_too():
    with pytest.raises(ConvertError, match="--license other needs --license-name"):
        CardLicense("other")
    assert CardLicense("apache-2.0").front_matter() == {"license": "apache-2.0", "license_name": None,
                                                        "license_link": None}


def test_card_says_when_the_metrics_log_is_not_there(tiny_corpus, tmp_path):
    _, state = _state(tiny_corpus, tmp_path)
    card = model_card(ElectraConfig.from_preset("tiny", vocab_size=2000), CardFacts("a test", "cmd", state), "fp32",
                      None)
    assert f"The run's metrics log ({tmp_path / 'logs' / 'metrics.jsonl'}) was not readable at conversion time." in card
