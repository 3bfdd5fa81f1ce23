"""The DeepSpeed engine on 2 gloo CPU ranks: every ZeRO stage and precision, pipeline parallelism,
exact resume, crash safety, and configs rejected before any rank starts."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from convbert_ds.config import ConfigError
from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import NOT_THE_SUBJECT, REPO, TINY_CONFIG, check, env, run_training, train_metrics

pytestmark = pytest.mark.slow


def _falls(rows, key="loss", window=3, margin=1.0) -> bool:
    first = sum(r[key] for r in rows[:window]) / window
    last = sum(r[key] for r in rows[-window:]) / window
    return last < first - margin


# Every bf16 file trains; each precision runs with a partitioned optimizer (ZeRO-1/3 bf16, ZeRO-2 fp32) and
# without (ZeRO-0: DeepSpeed's bf16 optimizer, and torch's AdamW over fp32 weights with the trainer clipping,
# under autocast; fp32 compute at ZeRO-0 trains in test_elastic.py): the combinations that take different
# optimizer code paths, not all eleven.
@pytest.mark.parametrize(("ds_config", "precision"), [
    ("zero0_autocast_bf16", "bf16"), ("zero0_bf16", "bf16"), ("zero1_bf16", "bf16"), ("zero2_bf16", "fp32"),
    ("zero3_bf16", "bf16"), ("zero3_offload_bf16", "bf16")])
def test_zero_stages_train_with_falling_loss(ds_config, precision, tiny_corpus, tmp_path):
    ds_file = REPO / "ds_configs" / f"{ds_config}.json"
    settings = json.loads(ds_file.read_text())
    if settings["zero_optimization"]["stage"] == 3:
        # Every parameter partitioned, as most are at base scale (the shipped threshold keeps the tiny model's
        # whole): the attention reads its projections' weights without calling them, which ZeRO-3 must gather.
        settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        ds_file = tmp_path / ds_file.name
        ds_file.write_text(json.dumps(settings))
    output = check(run_training(tmp_path, tiny_corpus["shards"], f"deepspeed.config={ds_file}",
                                f"train.precision={precision}", "train.steps=16", "train.warmup_steps=4",
                                "eval.interval=0", "checkpoint.interval=100", launcher=NOT_THE_SUBJECT))
    assert f"precision={precision}" in output
    rows = train_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert _falls(rows), [round(r["loss"], 3) for r in rows]
    assert all(r["grad_norm"] > 0 for r in rows)  # clipped by DeepSpeed, or by the trainer at ZeRO-0 in fp32
    assert (tmp_path / "checkpoints" / "step00000016" / "COMPLETE").is_file()


def test_pipeline_two_stages_zero1_trains(tiny_corpus, tmp_path):
    output = check(run_training(tmp_path, tiny_corpus["shards"], "deepspeed.config=ds_configs/pipeline_zero1_bf16.json",
                                "train.precision=fp32", "pipeline.stages=2", "train.steps=16",
                                "train.warmup_steps=4", "eval.interval=8", "checkpoint.interval=8",
                                "train.micro_batch_size=4", launcher=NOT_THE_SUBJECT))
    assert "pipeline_stages=2" in output and "eval step 8" in output
    rows = train_metrics(tmp_path)
    assert _falls(rows), [round(r["loss"], 3) for r in rows]
    assert all(key in rows[-1] for key in ("mlm_loss", "rtd_loss", "mlm_accuracy", "rtd_accuracy"))
    # The loss-curve command renders this run's logs.
    plotted = subprocess.run([sys.executable, "-m", "convbert_ds.plot", str(tmp_path / "logs")], cwd=REPO,
                             env=env(), capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    png = (tmp_path / "logs" / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_exact_resume_is_bitwise(tiny_corpus, tmp_path):
    """2N steps straight == N steps, resume, N steps: same losses bit for bit, same samples.

    The interrupted run is the straight run cut at its step-N checkpoint (its later checkpoint and
    log lines removed), so both legs share one learning-rate schedule as a real restart would.
    """
    common = ("train.steps=12", "train.warmup_steps=3", "eval.interval=4", "checkpoint.interval=6",
              "data.num_workers=1")
    check(run_training(tmp_path / "straight", tiny_corpus["shards"], *common, launcher=NOT_THE_SUBJECT))
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step00000012")
    (resumed / "checkpoints" / "latest").write_text("step00000006\n")
    output = check(run_training(resumed, tiny_corpus["shards"], *common, launcher=NOT_THE_SUBJECT))
    assert "resumed from" in output and "at step 6 (96 samples consumed)" in output
    assert "data: 192 samples over the run (12 steps x 16):" in output  # and what each set gives, in epochs
    assert re.search(rf"^  {re.escape(str(tiny_corpus['shards']))}: 100\.0% of the samples, 192 of its [\d,]+ = "
                     rf"0\.\d\d epochs; real tokens: (9[5-9]|100)\.\d% of 64 x [\d,]+ samples$", output, re.M), output
    # Log lines carry the wall clock, this process's elapsed time and the ETA; the run ends with a summary.
    stamp, clock = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]", r"\d+:\d\d:\d\d"
    # The resumed process's first interval holds its start-up: its ETA is known from the second log line on.
    assert re.search(rf"^{stamp} step 7/12 \| loss .* \| elapsed {clock} \| ETA estimating$", output, re.M), output
    assert re.search(rf"^{stamp} eval step 8 \| .* \| elapsed {clock} \| ETA {clock}$", output, re.M), output
    assert re.search(rf"^{stamp} summary \| steps 6->12 of 12 \| 192 samples \| 12,288 tokens \| wall {clock} \| "
                     rf"mean samples/s [\d.]+ \| best valid loss [\d.]+$", output, re.M), output
    straight_rows, resumed_rows = train_metrics(tmp_path / "straight"), train_metrics(resumed)
    assert [r["step"] for r in resumed_rows] == list(range(1, 13))
    for a, b in zip(straight_rows[6:], resumed_rows[6:]):
        for key in ("loss", "mlm_loss", "rtd_loss", "mlm_accuracy", "grad_norm", "consumed_samples"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    state = json.loads((resumed / "checkpoints" / "step00000012" / "trainer_state.json").read_text())
    assert state["data"]["consumed_samples"] == 12 * 16


def test_kill_during_save_resumes_from_previous_checkpoint(tiny_corpus, tmp_path):
    common = ("train.steps=12", "train.warmup_steps=3", "eval.interval=0", "checkpoint.interval=4")
    crashed = run_training(tmp_path, tiny_corpus["shards"], *common,
                           faults={"kill_during_save": 8})
    assert crashed.returncode != 0
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step00000004"
    assert (ckpt / "step00000008").is_dir() and not (ckpt / "step00000008" / "COMPLETE").exists()
    # The crash is the deepspeed launcher's (what users see); the resume is the trainer's work (NOT_THE_SUBJECT).
    output = check(run_training(tmp_path, tiny_corpus["shards"], *common, launcher=NOT_THE_SUBJECT))
    assert "removed incomplete checkpoint(s) ['step00000008']" in output
    assert "at step 4" in output
    assert (ckpt / "latest").read_text().strip() == "step00000012"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step")) == ["step00000008", "step00000012"]


@pytest.mark.parametrize("check_interval", [4, 1])
def test_nonfinite_losses_stop_the_run_before_a_checkpoint_holds_them(check_interval, tiny_corpus, tmp_path):
    """A learning rate of 1e30 makes the losses non-finite after the first real update. Read every 4 steps
    (the GPU is not stalled in between), fp32 skips nothing, so the first check stops the run, before the
    save it precedes; read every micro-batch (interval 1), bad micro-batches are dropped (the weights stay
    finite, so checkpoints may be saved) and 3 in a row stop it."""
    result = run_training(tmp_path, tiny_corpus["shards"], "train.precision=fp32", "train.lr=1.0e+30",
                          "train.warmup_steps=0", "train.steps=20", "checkpoint.interval=4", "eval.interval=0",
                          f"train.nonfinite_check_interval={check_interval}", "train.max_nonfinite_in_a_row=3",
                          launcher=NOT_THE_SUBJECT)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    if check_interval == 1:
        assert "3 steps in a row had a non-finite loss" in output, output[-3000:]
    else:
        assert re.search(r"had a non-finite loss in steps 1-4 and fp32 does not skip their updates", output), \
            output[-3000:]
        assert not list((tmp_path / "checkpoints").glob("step*")), "no checkpoint holds non-finite weights"


def test_torchrun_launches_the_same_trainer(tiny_corpus, tmp_path):
    # With a GPU-only switch that a CPU run notes and goes without (the same config runs on the cluster).
    output = check(run_training(tmp_path, tiny_corpus["shards"], "train.steps=3", "eval.interval=0",
                                "train.cuda_graphs=capture", launcher="torchrun"))
    assert "launcher=torch world_size=2" in output
    assert "note: train.cuda_graphs=capture: no CUDA device" in output


@pytest.mark.parametrize("overrides, message", [
    (["pipeline.stages=2", "deepspeed.config=ds_configs/zero2_bf16.json"], "zero_optimization.stage=2 cannot"),
    (["train.global_batch_size=20"], "train.global_batch_size=20 is not a multiple"),
    (["model.overrides={vocab_size: 999}"], "model.overrides.vocab_size=999"),
    (["train.lr_max=1"], "unknown key(s) ['lr_max']"),
    (["train.steps=ten"], "train.steps='ten': expected int"),
    (["train.warmup_steps=-3"], "train.warmup_steps=-3: must be >= 0"),
    (["model.objective=gan"], "model.objective='gan': use one of ['electra', 'mlm']"),
    (["model.init_from_hf=somewhere", "model.overrides={num_hidden_layers: 2}"],
     "model.overrides ['num_hidden_layers'] cannot change a published model"),
    (["deepspeed.config=ds_configs/nope.json"], "deepspeed.config='ds_configs/nope.json': file not found"),
    (["model.overrides={conv_kernel_size: 4}"], "ModelConfig.conv_kernel_size=4"),
    (["train.precision=fp16"], "fp16 needs a GPU"),
    (["model.tie_generator_body=true", "model.objective=mlm"], "model.tie_generator_body=true ties the ELECTRA"),
    (["model.tie_generator_body=true", "model.generator_multiplier=0.5"], "use generator_multiplier 1.0"),
    (["model.tie_generator_body=true", "pipeline.stages=2", "deepspeed.config=ds_configs/pipeline_zero1_bf16.json"],
     "not supported with pipeline.stages > 1"),
    (["train.compile=true", "train.compile_mode=step", "pipeline.stages=2",
      "deepspeed.config=ds_configs/pipeline_zero1_bf16.json"], "train.compile_mode=step with pipeline.stages=2"),
    (["train.compile=true", "train.compile_mode=step", "deepspeed.config=ds_configs/zero3_bf16.json"],
     "train.compile_mode=step with zero_optimization.stage=3"),
    (["train.compile_mode=graph"], "train.compile_mode='graph'"),
    (["train.cuda_graphs=capture", "pipeline.stages=2", "deepspeed.config=ds_configs/pipeline_zero1_bf16.json"],
     "train.cuda_graphs=capture with pipeline.stages=2: the pipeline engine"),
    (["train.cuda_graphs=capture", "deepspeed.config=ds_configs/zero3_bf16.json"],
     "train.cuda_graphs=capture with zero_optimization.stage=3"),
    (["train.cuda_graphs=capture", "train.activation_checkpointing=true"],
     "train.cuda_graphs=capture with train.activation_checkpointing=true"),
    (["train.cuda_graphs=capture", "train.micro_batch_size=4"],
     "train.cuda_graphs=capture with 2 micro-batches per step: with ZeRO-1/2"),
    (["train.cuda_graphs=graphs"], "train.cuda_graphs='graphs': use one of ['inductor', 'capture', 'auto', 'off']"),
    (["pipeline.stages=2", "deepspeed.config=ds_configs/zero0_autocast_bf16.json", "train.precision=bf16"],
     "torch_autocast.enabled=true with pipeline parallelism: not supported"),
    (["data.seed=-1"], "data.seed=-1: must be >= 0"),
    (["eval.downstream.glue_task=sst-2"], "eval.downstream.glue_task='sst-2': use one of [None, 'cola'"),
    (["eval.downstream.task_type=regresion"], "eval.downstream.task_type='regresion': use one of"),
])
def test_invalid_configs_are_rejected_before_any_rank_starts(overrides, message, tiny_corpus):
    with pytest.raises((ConfigError, ValueError), match=__import__("re").escape(message)):
        cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]", *overrides])
        resolve(cfg, world_size=2)


@pytest.mark.parametrize("overrides, cuda, expected", [
    ([], True, ("capture", "")),
    (["train.micro_batch_size=4"], True, ("inductor", "2 micro-batches per step")),
    (["train.micro_batch_size=4", "train.compile=false"], True, ("off", "2 micro-batches per step")),
    (["train.micro_batch_size=4", "deepspeed.config=ds_configs/zero0_autocast_bf16.json"], True, ("capture", "")),
    (["train.activation_checkpointing=true"], True, ("inductor", "train.activation_checkpointing=true")),
    ([], False, ("off", "")),
], ids=["one-micro-batch", "accumulation", "accumulation-eager", "accumulation-zero0", "recompute", "no-gpu"])
def test_cuda_graphs_auto_captures_where_the_run_allows_it(overrides, cuda, expected, tiny_corpus):
    """``train.cuda_graphs=auto`` (the paper configs): a capture by hand, else inductor's trees for a compiled
    step (none for an eager one), with the setting that ruled the capture out; off without a GPU. Several
    micro-batches a step are captured where the backward adds them up itself (ZeRO-0 with fp32 weights,
    as in the autocast file), not under the tiny config's ZeRO-2."""
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]", "train.cuda_graphs=auto",
                                    "train.compile=true", "train.compile_mode=step", *overrides])
    plan = resolve(cfg, world_size=2, cuda=cuda)
    assert (plan.cuda_graphs, plan.cuda_graphs_why) == expected


def test_check_print_and_help_modes_start_nothing(tiny_corpus, tmp_path):
    """--check-config (what the Slurm scripts run), --print-config and --help, from the one typed config."""
    def train_cli(*args):
        return subprocess.run([sys.executable, "-m", "convbert_ds.train", "--config", str(TINY_CONFIG),
                               f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]", f"checkpoint.dir={tmp_path}/ck",
                               *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)

    ok = train_cli("--check-config", "--world-size", "2")
    assert ok.returncode == 0 and f"checkpoint_dir={tmp_path}/ck" in ok.stdout
    assert "grad_accum=1 compile=off cuda_graphs=inductor" in ok.stdout
    once = train_cli("train.compile=true", "train.compile_mode=step", "train.compile_layers_once=true",
                     "train.compile_autotune=kernels", "train.compile_random=inductor",
                     "train.compile_options.combo_kernels=true", "--check-config", "--world-size", "2")
    assert once.returncode == 0, once.stdout + once.stderr
    assert "compile=step+layers_once+autotune_kernels+inductor_random+combo_kernels=true " in once.stdout
    bad = train_cli("--check-config", "--world-size", "3")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("config error (3 processes): train.global_batch_size")
    printed = train_cli("--print-config", "--world-size", "1").stdout
    resolved = json.loads(printed[("\n" + printed).index("\n{"):])  # DeepSpeed may log a line to stdout first
    assert resolved["ds_config"]["train_batch_size"] == resolved["cfg"]["train"]["global_batch_size"]
    assert resolved["grad_accum"] == 2 and resolved["electra"]["discriminator"]["vocab_size"] > 0
    assert not (tmp_path / "ck").exists()
    usage = train_cli("--help").stdout
    assert "train.warmup_steps (int, >= 0) = 10000" in usage and "linear warm-up steps" in usage


def test_missing_shards_is_one_clear_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "convbert_ds.train", "--config", str(TINY_CONFIG),
                             f"data.sets=[{{path: '{tmp_path / 'nowhere'}'}}]"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "manifest.json not found" in result.stderr


def test_continue_pretraining_from_a_transformers_model(tiny_corpus, tmp_path):
    """model.init_from_hf: a transformers ConvBERT body (converted with --from-hf) seeds the discriminator."""
    import torch
    import transformers

    from convbert_ds.config import preset
    from convbert_ds.convert import convert_from_hf
    from convbert_ds.data.shards import open_split

    vocab = open_split(tiny_corpus["shards"], "train").vocab_size
    body = preset("tiny", vocab_size=vocab, max_position_embeddings=128)
    torch.manual_seed(3)
    published = transformers.ConvBertModel(transformers.ConvBertConfig(**body.to_hf_dict(["ConvBertModel"])))
    published.save_pretrained(tmp_path / "published")
    convert_from_hf(tmp_path / "published", tmp_path / "init", tokenizer=tiny_corpus["tokenizer"])
    output = check(run_training(tmp_path / "run", tiny_corpus["shards"], f"model.init_from_hf={tmp_path / 'init'}",
                                "train.steps=2", "eval.interval=0", "train.lr=0", launcher=NOT_THE_SUBJECT))
    assert "initialised from" in output
    from convbert_ds.convert import open_checkpoint, read_state_dict

    weights, _ = read_state_dict(open_checkpoint(tmp_path / "run" / "checkpoints"))
    name = "encoder.layer.1.attention.self.conv_kernel_layer.weight"
    assert torch.equal(weights[f"discriminator.convbert.{name}"], published.state_dict()[name])
