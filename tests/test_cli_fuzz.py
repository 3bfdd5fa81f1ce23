"""Fuzzing every command line: unknown options, missing paths, directories where files are expected and
the reverse, paths beneath a file, empty and non-UTF-8 files. Each case must end in one line on stderr naming the option or
the path, with exit code 2. Anything else (a traceback, another exit code, silence) fails here.

The cases run in this process through each CLI's own entry point (``run_cli`` / ``exit_on_user_error``,
what ``python -m`` calls), so hypothesis can try many; one subprocess per CLI checks the real
``python -m`` start. Every failure the suite found is kept as an ``@example``.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from convbert_ds.cli import exit_on_user_error
from launch import REPO
from preprocessing.errors import run_cli

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

CLIS = {  # module -> how `python -m module` runs it
    "preprocessing.tokenizer": "run_cli", "preprocessing.shard": "run_cli", "preprocessing.merge": "run_cli",
    "preprocessing.inspect": "run_cli", "convbert_ds.convert": "main", "convbert_ds.finetune": "main",
    "convbert_ds.plot": "exit_on_user_error", "convbert_ds.quickstart": "exit_on_user_error",
    "convbert_ds.train": "main", "convbert_ds.evaluate": "main",
}


# Each CLI's required arguments (their values need not exist: argparse reports an unknown option before
# anything is opened, and only once the required ones are there).
REQUIRED = {
    "preprocessing.tokenizer": ["--input", "x", "--out", "y"], "preprocessing.merge": ["--out", "o", "s"],
    "preprocessing.shard": ["--input", "x", "--tokenizer", "t", "--out", "o"], "preprocessing.inspect": ["p"],
    "convbert_ds.convert": ["--checkpoint", "c", "--out", "o"], "convbert_ds.finetune": ["--model", "m", "--out", "o"],
    "convbert_ds.plot": ["d"], "convbert_ds.quickstart": [], "convbert_ds.train": [],
    "convbert_ds.evaluate": ["glue", "--model", "m", "--out", "o"],
}


def call(module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` in this process, as its ``__main__`` block does; the exit code."""
    mod = importlib.import_module(module if module != "convbert_ds.convert" else "convbert_ds.convert.__main__")
    if module in ("convbert_ds.finetune", "convbert_ds.evaluate"):
        mod = importlib.import_module(f"{module}.__main__")
    how = CLIS[module]
    if how == "run_cli":
        return run_cli(mod.main, argv)
    if how == "main":
        return mod.main(argv)
    return exit_on_user_error(lambda: mod.main(argv))


@pytest.fixture(scope="module")
def bad(tiny_corpus, tmp_path_factory):
    """Paths of every bad kind, next to the real artifacts they stand in for."""
    root = tmp_path_factory.mktemp("bad_paths")
    (root / "a_file.txt").write_text("just text\n")
    (root / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    (root / "a_dir").mkdir()
    (root / "a_dir" / "junk.txt").write_text("junk\n")
    rows = "".join(f"sentence number {i} is {'good' if i % 2 else 'bad'},{i % 2}\n" for i in range(40))
    (root / "task.csv").write_text("text,label\n" + rows)
    (root / "glue" / "RTE").mkdir(parents=True)  # GLUE's layout, for the evaluation's other paths
    for split in ("train", "dev"):
        (root / "glue" / "RTE" / f"{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n" + "".join(
            f"{i}\tA cat sat {i}.\tA cat.\t{'not_' * (i % 2)}entailment\n" for i in range(8)))
    return {"task": root / "task.csv", "missing": root / "no" / "such", "file": root / "a_file.txt", "empty": root / "empty.txt",
            "dir": root / "a_dir", "latin1": root / "latin1.txt", "under_file": root / "a_file.txt" / "below",
            "glue": root / "glue",
            "corpus": tiny_corpus["corpus"], "tokenizer": tiny_corpus["tokenizer"], "shards": tiny_corpus["shards"],
            "out": root / "out"}


# (module, argv template, the placeholder the bad path replaces). {X} is the bad path; others are good.
PATH_CASES = [
    ("preprocessing.tokenizer", ["--input", "{X}", "--out", "{out}/tok"]),
    ("preprocessing.tokenizer", ["--input", "{corpus}", "--out", "{X}"]),
    ("preprocessing.shard", ["--input", "{X}", "--tokenizer", "{tokenizer}", "--out", "{out}/sh"]),
    ("preprocessing.shard", ["--input", "{corpus}", "--tokenizer", "{X}", "--out", "{out}/sh"]),
    ("preprocessing.shard", ["--input", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{X}"]),
    ("preprocessing.merge", ["--out", "{out}/merged", "{X}"]),
    ("preprocessing.inspect", ["{X}"]),
    ("preprocessing.inspect", ["{shards}", "--tokenizer", "{X}"]),
    ("convbert_ds.convert", ["--checkpoint", "{X}", "--out", "{out}/hf"]),
    ("convbert_ds.convert", ["--from-hf", "{X}", "--out", "{out}/init"]),
    ("convbert_ds.finetune", ["--model", "{X}", "--out", "{out}/ft", "--train", "{task}", "--validation", "{task}",
                              "--text-column", "text", "--label-column", "label"]),
    ("convbert_ds.finetune", ["--model", "{shards}", "--out", "{out}/ft", "--train", "{X}", "--validation",
                              "{task}", "--text-column", "text", "--label-column", "label"]),
    ("convbert_ds.plot", ["{X}"]),
    ("convbert_ds.evaluate", ["glue", "--model", "{X}", "--out", "{out}/ev", "--glue-dir", "{glue}", "--tasks", "rte"]),
    ("convbert_ds.evaluate", ["glue", "--model", "{shards}", "--out", "{out}/ev", "--glue-dir", "{X}"]),
    ("convbert_ds.train", ["--config", "{X}", "--check-config"]),
    ("convbert_ds.train", ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "data.sets=[{path: '{X}'}]",
                           "--check-config"]),
]
BAD_KINDS = ["missing", "file", "empty", "dir", "latin1", "under_file"]


@pytest.fixture(autouse=True, scope="module")
def _elsewhere(tmp_path_factory):
    """Run from a scratch directory: a fuzzed relative path (a cache or output dir) must not land in the repo."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        yield


def _expand(argv: list[str], paths: dict, bad_path) -> list[str]:
    out = []
    for arg in argv:
        for name, path in {**paths, "X": bad_path}.items():
            arg = arg.replace("{" + name + "}", str(path))
        out.append(arg)
    return out


def _stderr_lines(capsys) -> list[str]:
    """What the user reads on stderr, less DeepSpeed's start-up warning and progress bars (tqdm's lines)."""
    return [line for line in capsys.readouterr().err.splitlines()
            if line.strip() and "[WARNING]" not in line and not re.search(r" \w+/s\]$", line)]


@seed(20261124)
@FUZZ
@given(case=st.sampled_from(PATH_CASES), kind=st.sampled_from(BAD_KINDS))
@example(case=PATH_CASES[1], kind="dir")  # tokenizer --out onto a directory that is not empty
@example(case=PATH_CASES[4], kind="file")  # shard --out onto a file: mkdir's traceback (found by this suite)
def test_bad_paths_are_one_line_naming_them(case, kind, bad, capsys, tmp_path):
    module, template = case
    bad_path = bad[kind]
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"  # hypothesis reuses tmp_path across examples
    argv = _expand(template, {**bad, "out": out}, bad_path)
    code = call(module, argv)
    err = _stderr_lines(capsys)
    if code == 0:  # a bad-looking path that is in fact usable (e.g. a text file as a corpus): fine
        return
    assert code == 2, (module, argv, code, err)
    assert len(err) == 1, (module, argv, err)
    # beneath a file, the line may name the file in the way instead (what mkdir found there)
    named = [str(bad_path), bad_path.name, *([f"{bad_path.parent}: is a file"] if kind == "under_file" else [])]
    assert any(name in err[0] for name in named), (module, argv, err)


@seed(20261124)
@FUZZ
@given(module=st.sampled_from(sorted(CLIS)), option=st.from_regex(r"--zz[a-z][a-z-]{1,12}", fullmatch=True))  # no real option starts --zz
def test_unknown_options_are_one_line_naming_them(module, option, capsys):
    code = call(module, [*REQUIRED[module], option])
    err = _stderr_lines(capsys)
    assert code == 2, (module, option, code, err)
    assert len(err) == 1, (module, option, err)
    assert f"unrecognized arguments: {option}" in err[0], (module, option, err)


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(CLIS))
def test_the_real_command_line_says_it_in_one_line(module):
    """``python -m MODULE --no-such-option``: exit code 2, one line, the option named, no traceback."""
    done = subprocess.run([sys.executable, "-m", module, *REQUIRED[module], "--no-such-option"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    err = [line for line in done.stderr.splitlines() if line.strip() and "[WARNING]" not in line]
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "--no-such-option" in err[0] and f"python -m {module}" in err[0] and "Traceback" not in done.stderr


def test_vocab_size_below_what_the_corpus_needs_names_the_smallest_that_works(bad, tmp_path, capsys):
    """Issue 19: sentencepiece's internal error text became our one line with the size to use."""
    assert call("preprocessing.tokenizer", ["--input", str(bad["corpus"]), "--out", str(tmp_path / "tok"),
                                            "--vocab-size", "3"]) == 2
    (line,) = _stderr_lines(capsys)
    assert "--vocab-size 3 is too small for this corpus: it needs at least" in line
    smallest = int(line.split("use --vocab-size ")[1].split()[0])
    assert call("preprocessing.tokenizer", ["--input", str(bad["corpus"]), "--out", str(tmp_path / "tok"),
                                            "--vocab-size", str(smallest)]) == 0


def test_negative_workers_is_one_line(bad, capsys):
    """Issue 31: ``--workers -2`` ended in the process pool's 27-line traceback. Every other option's bad
    values: test_cli_values.py."""
    assert call("preprocessing.shard", ["--input", str(bad["corpus"]), "--tokenizer", str(bad["tokenizer"]), "--out",
                                        str(bad["out"] / "w"), "--workers", "-2"]) == 2
    (line,) = _stderr_lines(capsys)
    assert "--workers" in line and "'-2': must be an integer >= 0" in line, line


@pytest.mark.parametrize("summary", [True, False], ids=["our-dir", "foreign-dir"])
def test_a_model_file_that_is_not_sentencepiece_is_one_line(summary, bad, tmp_path, capsys):
    """Issue 31: a tokenizer directory whose .model is present but not a sentencepiece model. In a directory
    preprocessing.tokenizer wrote, its recorded digest names the file first; elsewhere, sentencepiece does."""
    import shutil
    damaged = tmp_path / "tok"
    shutil.copytree(bad["tokenizer"], damaged)
    (damaged / "tokenizer.model").write_bytes(b"\x00not a model\xff" * 20)
    if not summary:
        (damaged / "preprocessing_tokenizer.json").unlink()
    assert call("preprocessing.shard", ["--input", str(bad["corpus"]), "--tokenizer", str(damaged), "--out",
                                        str(tmp_path / "sh"), "--workers", "0"]) == 2
    (line,) = _stderr_lines(capsys)
    said = "changed since python -m preprocessing.tokenizer wrote it" if summary else "not a sentencepiece model"
    assert f"{damaged / 'tokenizer.model'}: {said}" in line, line
