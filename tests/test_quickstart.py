"""The quickstart's checks before its work: a work directory it cannot write is one line, before any of the
corpus, tokenizer or shards are built (the whole run is the README's first command, not a test)."""

import re

import pytest

from convbert_ds.errors import UserError
from convbert_ds.quickstart import main


def test_a_work_dir_it_cannot_write_is_one_line_before_anything_is_built(tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("a file, not a directory")
    work = a_file / "quickstart"  # as root every directory is writable; under a file nothing is
    with pytest.raises(UserError, match=rf"^--work-dir {re.escape(str(work))}: cannot write there \(Not a directory\);"
                                        r" pass --work-dir with a directory you can write") as caught:
        main(["--work-dir", str(work)])
    assert "\n" not in str(caught.value) and sorted(tmp_path.iterdir()) == [a_file]
