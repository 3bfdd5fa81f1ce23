"""``train.compile``: the encoder layers through torch.compile (inductor) inside real DeepSpeed engines on
gloo CPU ranks, against the same runs in eager mode. The whole-step runs take one rank: every rank compiles
the same graphs, so a second one doubles the test's compile time and adds nothing the graph sees (the
gradients' reduction is DeepSpeed's, outside it); the pipeline takes two, one stage each.

Tolerance: in fp32 the compiled run follows the eager one to rounding (inductor reorders reductions;
dropout draws the same masks, see ``compile_layers``). Measured over 20 steps: losses equal to 2e-6,
gradient norms to 4e-6. The tests run 12 (compiling dominates their time) and allow a relative 1e-4.
Under bf16 autocast (the paper configs' lean ZeRO-0 file) inductor also fuses the casts, so results round
differently: measured over the 12 steps, losses to 1e-4 and gradient norms to 3.3e-4; allowed 2e-3.
"""

import re
import shutil

import pytest

from launch import NOT_THE_SUBJECT, check, run_training, train_metrics

pytestmark = pytest.mark.slow

STEPS, HALF = 12, 6  # evaluation and the checkpoint at HALF
COMMON = (f"train.steps={STEPS}", "train.warmup_steps=3", f"eval.interval={HALF}", f"checkpoint.interval={HALF}",
          "data.num_workers=0")
PIPELINE = ("deepspeed.config=ds_configs/pipeline_zero1_bf16.json", "train.precision=fp32", "pipeline.stages=2",
            "train.micro_batch_size=4", "train.activation_checkpointing=true")
LAYOUTS = {"zero2": ("deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32"), "pipeline": PIPELINE,
           "autocast": ("deepspeed.config=ds_configs/zero0_autocast_bf16.json", "train.precision=bf16")}
RANKS = {"zero2": 1, "pipeline": 2, "autocast": 1}


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """Eager and compiled runs of ZeRO-2 in fp32 and of ZeRO-0 under bf16 autocast (the whole step compiled),
    and of a 2-stage pipeline with activation checkpointing (layer by layer: the pipeline's only mode). The
    plain engine's layer-by-layer mode is the pipeline's ``compile_layers`` on the unsplit model; each
    compiled run costs ~100 s on CPU."""
    root = tmp_path_factory.mktemp("compile")
    modes = {"eager": ("train.compile=false",), "compiled": ("train.compile=true",),
             "step": ("train.compile=true", "train.compile_mode=step")}
    done = {}
    for layout, overrides in LAYOUTS.items():
        for mode, switches in modes.items():
            if (layout, mode) in (("pipeline", "step"), ("zero2", "compiled"), ("autocast", "compiled")):
                continue  # step: refused up front for the pipeline; the plain engine layer by layer: see above
            run_dir = root / f"{layout}_{mode}"
            output = check(run_training(run_dir, tiny_corpus["shards"], *COMMON, *overrides, *switches, timeout=600,
                                        launcher=NOT_THE_SUBJECT, nproc=RANKS[layout]))
            done[layout, mode] = (run_dir, output)
    return done


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1.0)


COMPILED = [("pipeline", "compiled"), ("zero2", "step"), ("autocast", "step")]
TOLERANCE = {"pipeline": 1e-4, "zero2": 1e-4, "autocast": 2e-3}


@pytest.mark.parametrize("layout,mode", COMPILED)
def test_compiled_training_follows_eager(runs, layout, mode):
    """``step``: the whole ELECTRA forward and backward as one graph inside the DeepSpeed engine, in fp32 and
    under the lean autocast file (its clipping is the trainer's, on ZeRO-0's fp32 gradients)."""
    eager, compiled = (train_metrics(runs[layout, name][0]) for name in ("eager", mode))
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    for a, b in zip(eager, compiled):
        for key in ("loss", "mlm_loss", "rtd_loss", "grad_norm"):
            assert _close(a[key], b[key], TOLERANCE[layout]), (layout, a["step"], key, a[key], b[key])
    assert "compiled_graphs" not in eager[0]
    # The start line says what compiles, and a note says why the first log line waits.
    said, quiet = runs[layout, mode][1], runs[layout, "eager"][1]
    waits = "the first step compiles" if mode == "step" else "the first step and the first evaluation compile"
    assert f"compile={'step' if mode == 'step' else 'layers'}" in said and f"note: train.compile=true: {waits}" in said
    assert "compile=off" in quiet and "note: train.compile=true" not in quiet
    assert "cuda_graphs" not in compiled[0]  # logged where CUDA graphs are asked for: on GPUs, with ``step``


@pytest.mark.parametrize("layout,mode", COMPILED)
def test_nothing_recompiles_after_warm_up(runs, layout, mode):
    """Graphs are built at step 1 (training), then never: masking and Gumbel sampling draw new positions every
    step without recompiling (with ``step`` they are inside the graph: static shapes). The layers compile
    again at the first evaluation (eval mode, no grad); the whole step does not: evaluation runs eager."""
    counts = [r["compiled_graphs"] for r in train_metrics(runs[layout, mode][0])]
    assert len(set(counts[:HALF])) == 1 and len(set(counts[HALF:])) == 1, counts
    assert 0 < counts[0] < counts[HALF] if mode == "compiled" else 0 < counts[0] == counts[HALF], counts


def test_exact_resume_of_a_compiled_run_is_bitwise(runs, tiny_corpus, tmp_path):
    """The paper configs' path: the whole step compiled, ZeRO-0 under bf16 autocast. The resumed process
    starts with empty inductor caches, as on another node: the run's compile cache (written by the first
    run beside its checkpoints) gives it every graph, and the kernels from it compute the same bits."""
    straight, said = runs["autocast", "step"]
    assert f"compile cache: wrote {straight / 'compile_cache'}" in said
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step{STEPS:08d}")
    (resumed / "checkpoints" / "latest").write_text(f"step{HALF:08d}\n")
    output = check(run_training(resumed, tiny_corpus["shards"], *COMMON, *LAYOUTS["autocast"],
                                "train.compile=true", "train.compile_mode=step", timeout=600, launcher=NOT_THE_SUBJECT,
                                nproc=RANKS["autocast"],
                                extra_env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty_inductor_cache")}))
    assert f"at step {HALF}" in output
    assert f"compile cache: loaded {resumed / 'compile_cache'}" in output
    found = re.search(r"compile: (\d+) graph\(s\) found in inductor's caches, 0 compiled", output)
    assert found and int(found.group(1)) > 0, output[-3000:]
    assert "compile cache: wrote" not in output  # the same graphs: the file is left as it was
    for a, b in zip(train_metrics(straight)[HALF:], train_metrics(resumed)[HALF:]):
        for key in ("loss", "mlm_loss", "rtd_loss", "mlm_accuracy", "grad_norm", "consumed_samples"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
