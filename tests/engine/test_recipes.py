"""Every config in configs/ and every training command in the README resolves at the world size it names.

A config names its world sizes in a header line (``# World sizes: 1, 8``); a README command names its own
(``deepspeed --num_gpus N``, ``sbatch --nodes=K`` x the script's 8 tasks per node, ``mpirun -np N``,
``torchrun --nproc_per_node N``). Each is resolved as ``--check-config --world-size N`` resolves it, on real
shards (the tests' corpus stands in for the user's ``shards``), before any process group exists.
"""

import re
import shlex

import pytest

from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SLURM_TASKS_PER_NODE = 8  # slurm/pretrain*.sbatch's #SBATCH --ntasks-per-node
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


def _readme_training_commands() -> list[tuple[str, list[str]]]:
    """(command line, its words) for each README line that starts training (continuations joined)."""
    text = "\n".join(re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL))
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split("  #")[0].strip()
        starts_training = "convbert_ds.train" in line or re.search(r"slurm/pretrain\w*\.sbatch", line)
        if starts_training and "--help" not in line and not re.search(r"C\.yaml|\.\.\.|[A-Z]{3,}/", line):
            commands.append((line, shlex.split(line)))
    return commands


def _world_and_config(words: list[str]) -> tuple[int, str, list[str]]:
    def option(name: str, default: int) -> int:
        for i, word in enumerate(words):
            if word == name:
                return int(words[i + 1])
            if word.startswith(name + "="):
                return int(word.split("=", 1)[1])
        return default

    if words[0] == "sbatch":
        script = next(i for i, w in enumerate(words) if w.endswith(".sbatch"))
        world = option("--nodes", 1) * option("--ntasks-per-node", SLURM_TASKS_PER_NODE)
        config, rest = words[script + 1], words[script + 2:]
    else:
        world = option("--num_gpus", 0) or option("-np", 0) or option("--nproc_per_node", 0) or \
            option("--world-size", 1)
        config = words[words.index("--config") + 1]
        rest = words[words.index("--config") + 2:]
    overrides = [w for w in rest if "=" in w and not w.startswith("-")]
    return world, config, overrides


COMMANDS = _readme_training_commands()


def test_the_readme_has_training_commands_to_check():
    assert len(COMMANDS) >= 6, [c for c, _ in COMMANDS]
    assert any(line.startswith("deepspeed --num_gpus 8") for line, _ in COMMANDS)


@pytest.mark.parametrize("line, words", COMMANDS, ids=[c[:60] for c, _ in COMMANDS])
def test_every_readme_training_command_resolves_at_its_world_size(line, words, tiny_corpus, tmp_path):
    world, config, overrides = _world_and_config(words)
    own = [o for o in overrides if not o.startswith(("data.sets=", "checkpoint.dir="))]
    cfg = load_config(REPO / config, own + _on_test_shards(tiny_corpus["shards"], tmp_path)
                      + ["phase.continue_from=null"])
    plan = resolve(cfg, world, cuda=True)
    assert plan.micro_batch_size * plan.grad_accum * (world // cfg.pipeline.stages) == cfg.train.global_batch_size
