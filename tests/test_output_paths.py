"""Output paths the disk refuses: a file where a directory goes (the path itself, or one of its parents), a
link to nothing, a read-only mount. The trainer checks every directory it writes in before anything starts;
every other command line says the path in one line, exit code 2, where it was a traceback from ``mkdir``."""

import subprocess

import pytest

from convbert_ds import train
from convbert_ds.cli import exit_on_user_error
from convbert_ds.disk_full import why_no_directory
from launch import TINY_CONFIG
from preprocessing.shard import main as shard_main
from preprocessing.errors import run_cli


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("a file, not a directory\n")
    return path


@pytest.fixture
def read_only(small_disk):
    disk = small_disk(1 << 20, name="ro")
    done = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {done.stderr.strip()}")
    return disk


def test_why_no_directory_names_what_is_in_the_way(tmp_path, a_file, read_only):
    assert why_no_directory(tmp_path) is None and why_no_directory(tmp_path / "new" / "deeper") is None
    assert why_no_directory(a_file) == "is a file, not a directory"
    assert why_no_directory(a_file / "run" / "logs") == f"cannot be made: {a_file} is a file"
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    assert why_no_directory(tmp_path / "gone" / "run") == \
        f"cannot be made: {tmp_path / 'gone'} is a link to nothing ({tmp_path / 'nowhere'})"
    assert why_no_directory(read_only / "run") == f"cannot be written: {read_only} is read-only"


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "real_accelerator" not in line]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("key", ["checkpoint.dir", "log.dir"])
def test_the_trainer_refuses_a_directory_under_a_file_before_anything_starts(key, tiny_corpus, a_file, tmp_path,
                                                                            capsys):
    where = {"checkpoint.dir": tmp_path / "checkpoints", "log.dir": tmp_path / "logs", key: a_file / "run"}
    code = train.main(["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]",
                       *(f"{k}={v}" for k, v in where.items()), "train.steps=1"])
    line = _one_line(capsys)
    assert code == 2 and line == (f"config error: {key}='{a_file / 'run'}' cannot be made: {a_file} is a file; "
                                  f"set {key} to a directory this job can write"), line
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()  # nothing started


def test_the_trainer_refuses_a_read_only_checkpoint_dir(tiny_corpus, read_only, tmp_path, capsys):
    code = train.main(["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]",
                       f"checkpoint.dir={read_only / 'run'}", f"log.dir={tmp_path / 'logs'}", "train.steps=1"])
    line = _one_line(capsys)
    assert code == 2 and f"checkpoint.dir='{read_only / 'run'}' cannot be written: {read_only} is read-only" in line


def test_a_command_whose_output_is_under_a_file_says_so_in_one_line(tiny_corpus, a_file, capsys):
    code = run_cli(shard_main, ["--input", str(tiny_corpus["corpus"]), "--tokenizer", str(tiny_corpus["tokenizer"]),
                                "--out", str(a_file / "shards"), "--no-progress"])
    assert code == 2
    assert _one_line(capsys) == (f"error: {a_file / 'shards'}: cannot be made: {a_file} is a file; use another path "
                                 "(or fix its permissions) and rerun")


@pytest.mark.parametrize("refused", ["a file", "read-only"])
def test_any_mkdir_the_disk_refuses_is_one_line(refused, a_file, request, capsys):
    """What a command prints for a path no check of its own named (each real ``mkdir``'s error)."""
    out = a_file if refused == "a file" else request.getfixturevalue("read_only") / "out"
    assert exit_on_user_error(lambda: out.mkdir(parents=True, exist_ok=True), "finetune error") == 2
    said = "is a file, not a directory" if refused == "a file" else "Read-only file system"
    assert _one_line(capsys) == f"finetune error: {out}: {said}; use another path (or fix its permissions) and rerun"
