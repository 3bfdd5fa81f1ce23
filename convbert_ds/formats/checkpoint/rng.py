"""Every rank's random-number states, as saved in a checkpoint's ``rng_rank{rank:05d}.pt``.

Tensors and plain python values only (numpy's MT19937 keys as a tensor, ``random``'s state as a list),
so ``torch.load(weights_only=True)`` reads them; restoring all four streams (torch CPU and CUDA, numpy,
``random``) makes a resumed run draw what the uninterrupted one would have drawn.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from convbert_ds.formats.safe_pickle import safe_load


def rng_state() -> dict:
    """Tensors and plain values only (numpy's MT19937 keys as a tensor, ``random``'s state as a list)."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": {"version": version, "state": list(internal), "gauss": gauss}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``; the older layout (numpy/random tuples, as older checkpoints pickled them)
    is still accepted."""
    numpy_state, python_state = state["numpy"], state["python"]
    if isinstance(numpy_state, dict):
        numpy_state = ("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    if isinstance(python_state, dict):
        python_state = (python_state["version"], tuple(python_state["state"]), python_state["gauss"])
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_file(path: Path) -> dict:
    """This rank's RNG states, read weights-only (older files pickle numpy arrays: on the allow-list)."""
    return safe_load(path)
