"""The model card's results: the last validation pass at or before the checkpoint and that step's transfer
probe, read from the run's own metrics log (written here by the trainer's real writer)."""

import yaml

from convbert_ds.config import ElectraConfig
from convbert_ds.convert.model_card import CardFacts, model_card
from convbert_ds.engine.metrics_log import MetricsLog
from convbert_ds.formats.checkpoint.run_state import RunState
from convbert_ds.formats.train_config import load_config
from launch import TINY_CONFIG


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
    assert yaml.safe_load(card.split("---")[1])["datasets"] == ["corpus.txt"]


def test_card_says_when_the_metrics_log_is_not_there(tiny_corpus, tmp_path):
    _, state = _state(tiny_corpus, tmp_path)
    card = model_card(ElectraConfig.from_preset("tiny", vocab_size=2000), CardFacts("a test", "cmd", state), "fp32",
                      None)
    assert f"The run's metrics log ({tmp_path / 'logs' / 'metrics.jsonl'}) was not readable at conversion time." in card
