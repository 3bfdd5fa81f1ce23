"""Every config in configs/ resolves at the world sizes it names, and the paper configs are the paper's.

A config names its world sizes in a header line (``# World sizes: 1, 8``); each is resolved as
``--check-config --world-size N`` resolves it, on real shards (the tests' corpus stands in for the user's
``shards``), before any process group exists. The training commands of the README and docs/ are resolved the
same way, at the world size each names, by ``tests/test_docs.py``.
"""

import re

import pytest

from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
TABLE5 = {  # the paper's Table 5: peak learning rate, batch size; 1M steps at 128 tokens, 10k warm-up
    "small": (3e-4, 128), "medium-small": (5e-4, 128), "base": (2e-4, 256)}


def world_sizes(path) -> list[int]:
    found = re.search(r"^# World sizes: ([\d, ]*\d)", path.read_text(), re.MULTILINE)
    assert found, f"{path.name} names no world size ('# World sizes: 1, 8' in its header)"
    return [int(n) for n in found.group(1).split(",")]


def _on_test_shards(shards, tmp_path) -> list[str]:
    return [f"data.sets=[{{path: '{shards}', weight: 1.0}}]", f"checkpoint.dir={tmp_path / 'checkpoints'}"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_resolves_at_the_world_sizes_it_names(path, tiny_corpus, tmp_path):
    # A phase 2 starts from its phase 1's checkpoints, which exist only after that run: its pairing is
    # checked below, here everything else.
    cfg = load_config(path, _on_test_shards(tiny_corpus["shards"], tmp_path) + ["phase.continue_from=null"])
    for world in world_sizes(path):
        plan = resolve(cfg, world, cuda=True)
        assert plan.micro_batch_size * plan.grad_accum * world == cfg.train.global_batch_size
        assert plan.electra.discriminator.max_position_embeddings == 512, "exports take 512 tokens"
        if cfg.train.cuda_graphs == "auto":  # the paper configs: a capture by hand wherever the run allows it
            expected = ("capture", "") if plan.grad_accum == 1 or plan.whole_fp32_grads else \
                ("inductor", f"{plan.grad_accum} micro-batches per step")
            assert (plan.cuda_graphs, plan.cuda_graphs_why) == expected, (path.name, world)
            assert resolve(cfg, world, cuda=False).cuda_graphs == "off"  # nothing to capture, nothing said


def test_the_paper_configs_ask_for_cuda_graphs_where_the_run_allows_them():
    assert {path.stem for path in CONFIGS if "cuda_graphs: auto" in path.read_text()} == \
        {f"{name}{phase}" for name in TABLE5 for phase in ("", "_phase2")}


@pytest.mark.parametrize("name", list(TABLE5))
def test_paper_presets_have_table5_hyperparameters_and_a_phase_2(name, tiny_corpus, tmp_path):
    overrides = _on_test_shards(tiny_corpus["shards"], tmp_path) + ["phase.continue_from=null"]
    one = load_config(REPO / "configs" / f"{name}.yaml", overrides)
    two = load_config(REPO / "configs" / f"{name}_phase2.yaml", overrides)
    lr, batch = TABLE5[name]
    t = one.train
    assert (t.lr, t.global_batch_size, t.steps, t.warmup_steps, one.data.seq_len) == (lr, batch, 10**6, 10**4, 128)
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.grad_clip) == (0.9, 0.999, 1e-6, 0.01, 1.0)
    m = one.model
    assert (m.preset, m.objective, m.mask_prob, m.masking, m.rtd_weight) == (name, "electra", 0.15, "fixed", 50.0)
    assert "Table 5" in (REPO / "configs" / f"{name}.yaml").read_text()
    # Phase 2: the same model at 512 tokens, 10% more steps, continuing phase 1's checkpoints.
    assert two.model == one.model and two.data.seq_len == 512 and two.train.steps == one.train.steps // 10
    raw = load_config(REPO / "configs" / f"{name}_phase2.yaml")
    assert raw.phase.continue_from == load_config(REPO / "configs" / f"{name}.yaml").checkpoint.dir
    assert raw.checkpoint.dir != raw.phase.continue_from
