"""The converter on a full disk (real tmpfs filesystems): one line naming OUT, the space free there and what
OUT still holds; never a part of a model there that ``from_pretrained`` (or the trainer's ``--init``) would
read as whole. The checkpoint is ``checkpoint_v1``'s (a 1-layer, 32-wide model): each conversion takes a
second."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from convbert_ds.convert.__main__ import main

FIXTURE = Path(__file__).parent / "checkpoint_v1"
FROM_CHECKPOINT = ["--checkpoint", str(FIXTURE / "checkpoints"), "--tokenizer", str(FIXTURE / "tokenizer")]
MB_FREE = r"\d+\.\d MB free there"


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


# 64 kB free: model.safetensors is the write that fails (safetensors' own error); 400 kB: a tokenizer file's copy.
@pytest.mark.parametrize("free", [64_000, 400_000])
def test_a_full_disk_is_one_line_and_leaves_no_model(small_disk, capsys, free):
    disk = small_disk(1 << 21, leave=free)
    out = disk / "hf"
    assert main([*FROM_CHECKPOINT, "--out", str(out)]) == 2
    assert re.fullmatch(rf"convert error: {re.escape(str(out))}: no space left on device \({MB_FREE}\); no part "
                        rf"of the output is left in {re.escape(str(out))} \(the partial copy is deleted\); free some "
                        r"space there \(or write elsewhere\) and rerun the same command", _one_line(capsys))
    assert [p.name for p in disk.iterdir()] == ["filler"]  # no OUT, no temporary directory


def test_a_forced_rewrite_that_finds_the_disk_full_keeps_the_previous_output_whole(small_disk, capsys):
    disk = small_disk(1 << 22)
    out = disk / "hf"
    assert main([*FROM_CHECKPOINT, "--out", str(out)]) == 0
    before = _files(out)
    with open(disk / "filler", "wb") as f:  # the rest of the disk, but for too little for a second copy
        f.write(bytes(shutil.disk_usage(disk).free - 200_000))
    capsys.readouterr()
    assert main([*FROM_CHECKPOINT, "--out", str(out), "--force", "--dtype", "fp16"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"convert error: {out}: no space left on device (") and \
        f"; {out} still holds what it held before; " in line, line
    assert _files(out) == before and sorted(p.name for p in disk.iterdir()) == ["filler", "hf"]


def test_from_hf_on_a_full_disk_leaves_no_init_dir(small_disk, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main([*FROM_CHECKPOINT, "--out", str(hf)]) == 0
    disk = small_disk(1 << 20, leave=64_000)
    init = disk / "init"
    capsys.readouterr()
    assert main(["--from-hf", str(hf / "discriminator"), "--from-hf-generator", str(hf / "generator"),
                 "--out", str(init)]) == 2
    assert _one_line(capsys).startswith(f"convert error: {init}: no space left on device (")
    assert [p.name for p in disk.iterdir()] == ["filler"]
