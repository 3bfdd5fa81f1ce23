"""One sha256 over a dict of tensors (names, dtypes, shapes and bytes): equal digests, bit-identical tensors."""

from __future__ import annotations

import hashlib

import torch


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensors[name].shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
