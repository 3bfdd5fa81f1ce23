"""The one error type that fine-tuning raises for input a user can fix."""

from __future__ import annotations

from convbert_ds.errors import UserError


class FinetuneError(UserError, ValueError):
    """Bad fine-tuning input; the message is one line naming the file, the field or column, and the fix."""
