"""The quickstart's checks before its work: a work directory it cannot write, or on a full disk, is one line,
before any of the corpus, tokenizer or shards are built; a step that finds it full later is its own last line
(the whole run is the README's first command, not a test)."""

import re
import shutil

import pytest

from convbert_ds.disk_full import DiskFull
from convbert_ds.errors import UserError
from convbert_ds.finetune import loop, run, squad, tasks
from convbert_ds.quickstart import KEPT, main


def test_a_work_dir_it_cannot_write_is_one_line_before_anything_is_built(tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("a file, not a directory")
    work = a_file / "quickstart"  # as root every directory is writable; under a file nothing is
    with pytest.raises(UserError, match=rf"^--work-dir {re.escape(str(work))}: cannot write there \(Not a directory\);"
                                        r" pass --work-dir with a directory you can write") as caught:
        main(["--work-dir", str(work)])
    assert "\n" not in str(caught.value) and sorted(tmp_path.iterdir()) == [a_file]


def test_a_full_work_dir_is_one_line_before_anything_is_built(small_disk):
    work = small_disk(1 << 20, leave=0) / "work"
    with pytest.raises(DiskFull) as caught:
        main(["--work-dir", str(work)])
    assert re.fullmatch(rf"{re.escape(str(work))}: no space left on device \(0\.0 MB free there\); {re.escape(KEPT)}; "
                        r"free some space there \(or write elsewhere\) and rerun the same command", str(caught.value))
    assert list(work.iterdir()) == []  # not even the probe


def test_a_step_that_finds_the_work_dir_full_says_so_last(small_disk, capfd):
    """A step the quickstart runs as a command (here the tokenizer, on the corpus a stopped run left) says the
    full disk in its own last line; the quickstart stops with its exit code and adds no traceback after it."""
    disk = small_disk(1 << 20)
    work = disk / "work"
    work.mkdir()
    (work / "corpus.txt").write_text("\n\n".join(m.__doc__ for m in (loop, run, squad, tasks)))  # real prose
    with open(disk / "filler", "wb") as f:  # all but the page the work dir's write check takes, and gives back
        f.write(bytes(shutil.disk_usage(disk).free - 4096))
    with pytest.raises(SystemExit) as stopped:
        main(["--work-dir", str(work), "--vocab-size", "400"])
    assert stopped.value.code == 2
    last = capfd.readouterr().err.rstrip("\n").split("\n")[-1]
    assert "no space left on device" in last and "Traceback" not in last, last
    assert sorted(p.name for p in work.iterdir()) == ["corpus.txt"]  # no half-built tokenizer taken as done

