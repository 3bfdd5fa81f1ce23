"""Tied parameters: one tensor under several names (ELECTRA's shared embeddings, the tied LM head).

The one place that says which names of a model share a tensor, fills a state dict's missing twins
and gives tied tensors storage of their own for formats (safetensors) that refuse shared storage.
"""

from __future__ import annotations

import torch


def tied_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """Canonical (first) parameter name -> every name of that tensor, in model order."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {names[0]: names for names in groups.values()}


def fill_tied(weights: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``weights`` plus every tied name it lacks, taken from a twin it holds (a file may hold any one name)."""
    out = dict(weights)
    for names in tied_groups(model).values():
        present = next((name for name in names if name in weights), None)
        if present is not None:
            for name in names:
                out.setdefault(name, weights[present])
    return out


def untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tensor seen under a second name is cloned once, so each name owns its storage (no other copy)."""
    seen, out = set(), {}
    for name, tensor in tensors.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out
