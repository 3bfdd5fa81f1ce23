"""``latest`` in a checkpoint directory: the tag it names when that tag is complete, else the newest complete tag,
whatever the file holds (another encoding's bytes, a tag that is gone or half-saved), never a traceback."""

import pytest

from convbert_ds.formats.checkpoint.directory import COMPLETE, LATEST, latest_complete


@pytest.mark.parametrize("latest, expected", [
    (b"step00000002\n", "step00000002"),  # an older complete tag, named by hand: resumed from there
    (b"step00000009\n", "step00000006"),  # gone
    (b"step00000008\n", "step00000006"),  # half-saved: no COMPLETE
    (b"\xff\xfe", "step00000006"),  # not text
    (b"", "step00000006"),
], ids=["older", "gone", "incomplete", "not-text", "empty"])
def test_latest_names_a_complete_tag_or_the_newest_is_taken(tmp_path, latest, expected):
    for tag in ("step00000002", "step00000006", "step00000008"):
        (tmp_path / tag).mkdir()
        if tag != "step00000008":
            (tmp_path / tag / COMPLETE).write_text("")
    (tmp_path / LATEST).write_bytes(latest)
    assert latest_complete(tmp_path) == expected
