"""The GPU acceptance command (``benchmarks/gpu/acceptance.py``) on a machine without a GPU: it must say so and
write nothing (no record, RESULTS.md untouched), and every part it runs on a GPU must work end to end at toy
sizes on CPU (``--cpu-smoke``), its record short and never written over."""

import os
import subprocess
import sys
import time

import pytest

from launch import REPO

RESULTS = REPO / "benchmarks" / "RESULTS.md"
RUNS = REPO / "benchmarks" / "runs"


def _acceptance(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu.acceptance", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def _runs() -> list:
    return sorted(RUNS.rglob("*")) if RUNS.exists() else []


def test_without_a_gpu_it_says_so_and_writes_nothing():
    before, runs = RESULTS.read_bytes(), _runs()
    result = _acceptance()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no CUDA GPU on this machine; nothing measured, no record written" in result.stdout, result.stdout
    assert RESULTS.read_bytes() == before and _runs() == runs


@pytest.mark.slow
def test_every_part_runs_on_cpu(tmp_path):
    before, runs = RESULTS.read_bytes(), _runs()
    out = tmp_path / "acceptance.md"
    result = _acceptance("--cpu-smoke", str(out), "--logs", str(tmp_path / "logs"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert RESULTS.read_bytes() == before and _runs() == runs
    text = out.read_text()
    assert text.startswith("# GPU acceptance: ") and len(text.splitlines()) <= 150, len(text.splitlines())
    assert "Parts that failed: none." in text and "torch 2." in text and "Commit " in text, text
    assert "passed" in text.split("## Kernel, fallback and parity tests")[1].split("\n## ")[0]
    assert "torch reference vs transformers" in text
    layer_ops = text.split("## One layer's ops")[1].split("\n## ")[0]
    assert "$ python benchmarks/input_projections.py --preset tiny" in layer_ops and "stacked / separate:" in layer_ops
    assert "$ python benchmarks/residual_dtype.py --preset tiny" in layer_ops
    assert "bf16 / fp32 residual stream:" in layer_ops
    # Without CUDA the CUDA-graph test is skipped, saying why, and no run claims a captured graph.
    assert "CUDA graphs need a CUDA GPU" in text.split("## CUDA graphs of the step")[1].split("\n## ")[0]
    rows = [line for line in text.splitlines() if line.startswith("| tiny | 64 x 4 | ")]
    assert [row.split("|")[3:7] for row in rows] == [
        [" zero1_bf16 ", " fp32 ", " torch ", " off "],
        [" zero0_autocast_bf16 ", " bf16, bf16 residual ", " torch ", " off "],
        [" none (transformers' ConvBERT, plain loop) ", " fp32 ", " transformers' ", " off "]], text
    # The two rows start together (--together's default in the smoke run); each times its steps alone.
    assert "Up to 2 rows run at once" in text
    starts = [result.stdout.index(f"=== {name}: ") for name in _pretrain_run_names(result.stdout)]
    first_done = result.stdout.index(f"=== {_pretrain_run_names(result.stdout)[0]}: exit code")
    assert len(starts) == 2 and max(starts) < first_done, result.stdout[-5000:]
    assert "runs alone, 1 other(s) paused" in result.stdout and "runs alone, 0 other(s) paused" in result.stdout
    for row in rows:  # samples/s and tokens/s read from the trainer's own metrics.jsonl
        samples, tokens = (float(cell.replace(",", "")) for cell in row.split("|")[7:9])
        # The table rounds samples/s to a whole number (toy runs: about 35) and tokens/s too: 64 x half a sample.
        assert samples > 0 and abs(tokens - samples * 64) <= 0.5 * 64 + 0.5, row
        assert row.split("|")[12].strip() == "-" and row.split("|")[13].strip() == "-", row  # no CUDA graph, no GPU
    # The reference row (transformers' ConvBERT in a plain loop, timed by train_step.py once warmed up, alone like
    # the others): each of our rows' samples/s over its, from the table's own cells.
    reference = "=== reference_transformers_tiny_fp32_off_seq64_batch4: "
    assert f"{reference}ready to time after" in result.stdout
    started = next(line for line in result.stdout.splitlines() if line.startswith(reference) and "train_step" in line)
    assert "benchmarks/train_step.py --rows transformers --preset tiny --batch 4 --seq 64 --steps 10" in started
    assert "--ready-file " in started and "--go-file " in started, started  # run beside the others: it waits
    theirs = float(rows[2].split("|")[7].replace(",", ""))
    for row in rows[:2]:
        ours = float(row.split("|")[7].replace(",", ""))
        assert row.split("|")[14].strip() == f"{ours / theirs:.2f}x", row
    assert rows[2].split("|")[14].strip() == "-" and float(rows[2].split("|")[11]) > 0, rows[2]
    # The marked row's profile window, as the trainer printed it, after the table (its steps not in the medians).
    profiles = text.split("Profiles of the rows marked for it")[1].split("\n## ")[0]
    assert "`tiny | 64 x 4 | zero1_bf16 | fp32 | torch | off`:" in profiles
    assert "profile summary (rank 0, 3 steps):" in profiles and "no CUDA kernels recorded" in profiles
    assert "host: the ops with the most CPU time of their own" in profiles
    # --logs keeps each part's log and the profiled row's trace, which trace_summary.py reads back, and the
    # record as it is written.
    assert (tmp_path / "logs" / "record.md").read_text() == text
    traces = sorted((tmp_path / "logs").glob("*.pt.trace.json.gz"))
    assert [path.name.split("_")[1] for path in traces] == ["tiny"] and (tmp_path / "logs" / "nccl.log").exists()
    summary = subprocess.run([sys.executable, "benchmarks/analysis/trace_summary.py", str(traces[0]), "--top", "20"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert summary.returncode == 0 and "profile summary (" in summary.stdout, summary.stderr
    assert "(Python between the ops, in the step)" in summary.stdout and len(summary.stdout.splitlines()) == 13
    assert "2 processes on one device (gloo): 5 steps of tiny ran and saved." in text
    # A second run writes a record of its own beside the first, never over it; --parts runs those parts, in
    # that order.
    second_run = _acceptance("--cpu-smoke", str(out), "--budget", "1", "--parts", "nccl,tests")
    assert second_run.returncode == 1 and out.read_text() == text
    second = (tmp_path / "acceptance-2.md").read_text()
    assert second_run.stdout.strip().endswith(f"the record: {tmp_path / 'acceptance-2.md'}"), second_run.stdout
    assert "--parts nccl,tests --budget 1" in second and "no time left" in second
    assert [line for line in second.splitlines() if line.startswith("## ")] == [
        "## Two processes on one GPU", "## Kernel, fallback and parity tests"]


@pytest.mark.slow
def test_a_call_killed_from_outside_leaves_what_finished_in_its_logs(tmp_path):
    """A lease ends a call that outruns it with a kill: then what ``--logs`` kept as the call went is all that
    comes back. Killed once the first pretraining row has ended: the first part's section, that row's figures
    and its log are there, and no run of the call is left running."""
    from benchmarks.gpu.limited_run import _descendants

    logs, out = tmp_path / "logs", tmp_path / "acceptance.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    call = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.acceptance", "--cpu-smoke", str(out), "--parts",
                             "tests,pretrain,nccl", "--logs", str(logs)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (logs / "pretrain.md").exists():  # written after each pretraining row
        assert call.poll() is None and time.monotonic() < deadline, "the call ended before a row was kept"
        time.sleep(0.2)
    runs = _descendants(call.pid)
    call.kill()
    call.wait()
    killed_at = time.monotonic()
    section = (logs / "record.md").read_text()
    assert "As of part 1 of 3: the parts after it had not run yet." in section, section
    assert "passed" in section.split("## Kernel, fallback and parity tests")[1] and "## One-GPU" not in section
    assert (logs / "tests.log").exists() and not out.exists()
    table = [line.split("|") for line in (logs / "pretrain.md").read_text().splitlines() if line.startswith("| tiny |")]
    assert len(table) == 3 and sum(row[7].strip() == "not yet" for row in table) == 2, table
    finished = next(row for row in table if row[7].strip() != "not yet")
    assert float(finished[7].replace(",", "")) > 0, finished  # its samples/s
    row_logs = [path for path in logs.glob("*.log") if path.name.startswith(("pretrain_", "reference_"))]
    assert len(row_logs) == 1 and row_logs[0].read_text().strip(), row_logs  # the finished row's, as it ended
    # The trainers go with the call at once; their data loader's workers see it within seconds (torch's own check).
    left = runs
    while left and time.monotonic() < killed_at + 20:
        left = [pid for pid in left if _alive(pid)]
    assert runs and not left, "a run of the killed call is still running"


def test_the_run_without_graph_partitioning_is_skipped_once_the_partitioned_step_captured():
    from benchmarks.gpu.pretrain_rows import AUTOCAST, GPU_RUNS, PretrainRun, ReferenceRun, partitioning_captured

    # The GPU list's own pair, in this order: the partitioned run is profiled, the other not.
    partitioned = PretrainRun("base", "bf16", "triton", True, "step", ds_config=AUTOCAST, profile=True)
    unpartitioned = PretrainRun("base", "bf16", "triton", True, "step", ds_config=AUTOCAST, graph_partition=False)
    assert GPU_RUNS.index(partitioned) < GPU_RUNS.index(unpartitioned)
    assert partitioning_captured(partitioned, {}) == ""  # a partitioned run always runs
    for cell, why in [("2", "the partitioned step recorded 2 CUDA graphs"),
                      ("2 -> 4", "the partitioned step recorded 2 -> 4 CUDA graphs"),
                      ("0", ""), ("-", ""), ("", "")]:  # none captured, no CUDA, or the run failed: run it
        assert partitioning_captured(unpartitioned, {partitioned: cell}) == why, cell
    assert partitioning_captured(unpartitioned, {}) == ""  # the partitioned run is not in the list
    # The reference rows (transformers' loop) share the list; they are nobody's twin. On the 2026-11-29 lease
    # one of them ended the whole acceptance here with a TypeError, its figures lost with its work directory.
    reference = next(spec for spec in GPU_RUNS if isinstance(spec, ReferenceRun))
    assert partitioning_captured(unpartitioned, {reference: "-", partitioned: "2"}) == (
        "the partitioned step recorded 2 CUDA graphs")


def test_every_gpu_rows_overrides_load_and_name_inductor_options_that_exist(tmp_path):
    """A GPU lease is the scarcest thing the project has: a row whose overrides name a config key, or an
    inductor option (``train.compile_options``), that this torch does not know must fail here, not on the lent
    machine. (The plan's other checks need the row's shards; the lent machine runs an older torch.)"""
    from benchmarks.gpu.acceptance import GPU, GPU_RUNS, Acceptance
    from benchmarks.gpu.pretrain_rows import ReferenceRun
    from benchmarks.train_step import parse_args
    from convbert_ds.engine.compile_options import inductor_options
    from convbert_ds.formats.train_config import load_config

    acceptance = Acceptance(GPU, tmp_path, budget_s=1)
    references = [spec for spec in GPU_RUNS if isinstance(spec, ReferenceRun)]
    for spec in references:  # train_step.py's own parser takes the reference row's arguments
        args = parse_args(spec.command(tmp_path / "shards", 128, 256, 40, tmp_path / "ready", tmp_path / "go",
                                       cpu=False))
        assert (args.rows, args.batch, args.compile_step, args.ready_file, args.go_file) == (
            ["transformers"], 256, spec.compile, tmp_path / "ready", tmp_path / "go")
    # Beside the baseline row: compiled, and eager (the ratio's fallback, seconds to start).
    assert [(acceptance._shape(spec), spec.compile) for spec in references] == [((128, 256), True), ((128, 256), False)]
    for spec in GPU_RUNS:
        if spec in references:
            continue
        args = acceptance._train_args(spec, tmp_path / "shards", tmp_path / "run", steps=10)
        assert args[0] == "--config", args
        cfg = load_config(args[1], args[2:])  # the row's options over those the config sets (combo kernels)
        assert inductor_options(cfg) == {**inductor_options(load_config(args[1], [])), **dict(spec.options)}, \
            spec.compile_label
    assert any(spec.options for spec in GPU_RUNS if spec not in references)


def test_the_tables_name_each_compile_autotune_level_once():
    """A level the model takes but the tables cannot name would fail on the lent machine, as its row starts."""
    import typing

    from benchmarks.gpu.pretrain_rows import AUTOTUNE_LABELS
    from convbert_ds.model.layers import AutotuneLevel

    assert list(AUTOTUNE_LABELS) == list(typing.get_args(AutotuneLevel))
    named = [label for level, label in AUTOTUNE_LABELS.items() if level is not False]
    assert all(named) and len(set(named)) == len(named) and AUTOTUNE_LABELS[False] == "", AUTOTUNE_LABELS


@pytest.mark.slow
def test_a_command_stopped_at_its_limit_says_where_it_was_and_leaves_nothing_running(tmp_path):
    """A row that hangs or compiles past its limit: its log holds the main thread's Python stack (the
    acceptance prints it beside the table), and every process under it goes, also one in a session of its
    own holding the output pipes, as torchrun's ranks are."""
    from benchmarks.gpu.limited_run import STACK_DUMP_S, run_group, where_it_stopped

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
              "                         start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "def capture_the_step():\n"
              "    time.sleep(600)\n"
              "capture_the_step()\n")
    started = time.monotonic()
    code, stdout, stderr = run_group([sys.executable, "-c", script], dict(os.environ), limit_s=5)
    assert code == 124 and time.monotonic() - started < 5 + STACK_DUMP_S, time.monotonic() - started
    stack = where_it_stopped(stdout + stderr)
    assert stack[0].startswith("Current thread") and "in capture_the_step" in stack[1], stderr[-2000:]
    assert not _alive(int(pid_file.read_text()))
    assert where_it_stopped("a command that finished\n") == []


def test_a_stopped_commands_stack_names_files_from_the_package_or_the_project():
    # Results are read on other machines: no directory of the machine that ran the command.
    from benchmarks.gpu.limited_run import where_it_stopped

    output = ("Current thread 0x1 (most recent call first):\n"
              '  File "/any/env/lib/python3.12/site-packages/torch/autograd/graph.py", line 869 in _engine_run_backward\n'
              f'  File "{REPO}/convbert_ds/model/step_capture.py", line 105 in gradients\n'
              '  File "<frozen runpy>", line 88 in _run_code\n\n'
              "Thread 0x2:\n")
    assert where_it_stopped(output) == ["Current thread 0x1 (most recent call first):",
                                        'File "torch/autograd/graph.py", line 869 in _engine_run_backward',
                                        'File "convbert_ds/model/step_capture.py", line 105 in gradients',
                                        'File "<frozen runpy>", line 88 in _run_code']


@pytest.mark.slow
def test_a_finished_command_is_not_held_by_what_it_left_running():
    # It exits 3 at once, leaving a process in a session of its own that holds its output for 15 s.
    from benchmarks.gpu.limited_run import DRAIN_S, run_group

    script = ("import subprocess, sys\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(15)'], start_new_session=True)\n"
              "print('done', flush=True)\n"
              "sys.exit(3)\n")
    started = time.monotonic()
    code, stdout, _ = run_group([sys.executable, "-c", script], dict(os.environ), limit_s=60)
    assert (code, stdout) == (3, "done\n")
    assert time.monotonic() - started < DRAIN_S + 4


def _pretrain_run_names(stdout: str) -> list[str]:
    """The pretraining runs the acceptance started, in the order it started them."""
    return [line.split(":")[0][4:] for line in stdout.splitlines() if line.startswith("=== pretrain_")
            and " -m convbert_ds.train " in line]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    time.sleep(0.5)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_part_that_raises_fails_alone_and_the_others_still_report(tmp_path):
    """On the 2026-11-29 lease a part's exception ended the acceptance before it kept any log or wrote its
    section, and nine minutes of GPU figures were lost. A part that raises now fails with its traceback."""
    from benchmarks.gpu.acceptance import CPU_SMOKE, Acceptance

    class OneBrokenPart(Acceptance):
        def broken(self) -> str:
            raise ValueError("the part's own bug")

        def fine(self) -> str:
            return "figures"

    acceptance = OneBrokenPart(CPU_SMOKE, tmp_path, budget_s=1)
    section = acceptance.part("broken")
    assert section.startswith("```\nTraceback") and "ValueError: the part's own bug" in section
    assert acceptance.part("fine") == "figures"
    assert acceptance.failed == ["broken"]
