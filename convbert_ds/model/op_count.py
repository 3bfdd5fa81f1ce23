"""Counting what a training step asks of the device, on any device (a CPU is enough).

A GPU step that is bound by the host is bound by how many kernels it launches and how often the host
waits for the device. Both can be counted without a GPU: every ATen op that reaches the dispatcher is
about one kernel launch, and the ops below are the ones that make the host wait for the device (they
return a number, or a shape that depends on the data). ``OpCounter`` counts them over a block::

    with OpCounter() as ops:
        model(batch).loss.backward()
    ops.total, ops.syncs, ops.sync_sites()

DeepSpeed's explicit ``synchronize()`` calls (its timers) are counted as syncs too, when DeepSpeed is
imported. Used by ``tests/model/test_step_budget.py`` (budgets) and ``benchmarks/train_step.py``.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must read before it can go on: a value (``.item()``, ``bool()``, ``int()``) or
# an output shape that depends on the data.
SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.nonzero", "aten.nonzero_static", "aten._unique2", "aten.unique_dim",
    "aten.unique_consecutive", "aten.masked_select", "aten.repeat_interleave", "aten.is_nonzero",
    "aten.equal", "aten.allclose",
})
# These sync only when indexed by a boolean mask (which becomes ``nonzero`` inside the kernel).
_BOOL_INDEXED = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
# Metadata and views launch nothing.
_FREE = frozenset({"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand",
                   "aten.unsqueeze", "aten.squeeze", "aten.select", "aten.slice", "aten.as_strided",
                   "aten.alias", "aten.detach", "aten.split", "aten.unbind", "aten.reshape",
                   "aten.split_with_sizes", "aten.unfold", "aten.chunk", "aten.lift_fresh", "aten.empty",
                   "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.resize_",
                   "aten.set_", "aten._reshape_alias", "aten.view_as_real", "aten.view_as_complex"})


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()) if i is not None)


class OpCounter(TorchDispatchMode):
    """Counts dispatched compute ops (``total``, by name in ``ops``) and host-device syncs (``syncs``).

    ``where=True`` also records, per sync, the innermost frame of this project's code that caused it
    (``sync_sites()``): slower, for finding them.
    """

    def __init__(self, where: bool = False):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.where = where
        self._unpatch = None

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def sync_sites(self) -> list[tuple[str, int]]:
        return self.sites.most_common()

    def _record_sync(self, name: str) -> None:
        self.sync_ops[name] += 1
        if self.where:
            frames = [f for f in traceback.extract_stack()[:-2]
                      if "convbert_ds" in f.filename or "deepspeed" in f.filename]
            frame = frames[-1] if frames else traceback.extract_stack()[-3]
            self.sites[f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {name}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        name = f"aten.{name}" if func.namespace == "aten" else f"{func.namespace}.{name}"
        if name not in _FREE:
            self.ops[name] += 1
            if name in SYNC_OPS or (name in _BOOL_INDEXED and _has_bool_index(args)):
                self._record_sync(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        deepspeed = sys.modules.get("deepspeed.accelerator")
        if deepspeed is not None:  # DeepSpeed's timers call the accelerator's synchronize() directly
            accelerator = deepspeed.get_accelerator()
            original = accelerator.synchronize

            def counted(*args, **kwargs):
                self._record_sync("accelerator.synchronize")
                return original(*args, **kwargs)

            accelerator.synchronize = counted
            self._unpatch = lambda: vars(accelerator).pop("synchronize", None)
        return super().__enter__()

    def __exit__(self, *exc):
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None
        return super().__exit__(*exc)
