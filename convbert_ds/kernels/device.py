"""Where a Triton kernel launches."""

from __future__ import annotations

import contextlib

import torch


def on_device_of(tensor: torch.Tensor):
    """Launch on ``tensor``'s GPU: Triton launches on the current device, and a tensor on another one would
    fault there (an error that breaks the CUDA context, which no fallback to the torch path survives)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
