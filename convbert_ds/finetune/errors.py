"""The one error type that fine-tuning raises for input a user can fix, and the one way its readers decode a
user's text file (another encoding is that error, naming the line)."""

from __future__ import annotations

from pathlib import Path

from convbert_ds.errors import UserError


class FinetuneError(UserError, ValueError):
    """Bad fine-tuning input; the message is one line naming the file, the field or column, and the fix."""


def utf8_text(path: Path) -> str:
    """The file as text (UTF-8, a byte-order mark allowed); another encoding is one line naming the line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise FinetuneError(f"{path}:{line}: not UTF-8 (byte 0x{data[error.start]:02x}); convert the file first, "
                            f"e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix} (name "
                            "its real encoding)") from None
