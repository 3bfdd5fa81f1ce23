"""``convbert_ds.disk_full``: what counts as a full disk (real writes on a real full tmpfs: an ``OSError``, and the
errors ``torch.save`` and safetensors raise over it) and the one line a command prints for one that no write
site named."""

import errno

import pytest
import torch
from safetensors.torch import save_file

from convbert_ds.cli import exit_on_user_error
from convbert_ds.disk_full import is_disk_full


def _raised(write) -> BaseException:
    with pytest.raises(Exception) as caught:
        write()
    return caught.value


def test_every_writer_s_full_disk_is_recognised_and_nothing_else(small_disk):
    full = small_disk(1 << 20, leave=0)
    tensors = {"w": torch.zeros(50_000)}
    for write in (lambda: (full / "a.bin").write_bytes(bytes(10_000)), lambda: torch.save(tensors, full / "b.pt"),
                  lambda: save_file(tensors, str(full / "c.safetensors"))):
        error = _raised(write)
        assert is_disk_full(error), repr(error)
    assert not is_disk_full(_raised(lambda: (full / "missing" / "x").write_bytes(b"")))
    assert not is_disk_full(RuntimeError("a shape mismatch")) and not is_disk_full(ValueError("unexpected pos"))


@pytest.mark.parametrize("filename", [None, "out/weights.bin"])
def test_a_full_disk_no_write_site_named_is_one_line(filename, tmp_path, capsys):
    def main():
        raise OSError(errno.ENOSPC, "No space left on device", *([str(tmp_path / filename)] if filename else []))

    assert exit_on_user_error(main, "convert error") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convert error: ") and "no space left on device" in err, err
    assert (" free there)" in err) == bool(filename), err  # the space free where the write went, when it is known
