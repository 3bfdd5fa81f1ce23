"""Inductor's own count of what a compiled function launches (``torch._inductor.metrics``), for the benchmarks
that compare compiled variants on a CPU (``layer_ab.py``, ``document_conv.py``): the kernels its forward and
backward graphs launch, matmuls included; the bytes all of them read and write (``mb``, "MB moved"); and the
bytes of only the kernels inductor fuses itself (``fused_mb``, "MB fused": the elementwise and reduction
work between the matmuls). On a GPU those kernels are bound by the bytes they move, so the count says on a
CPU what a change does to them. It is for the kernels built for the device it runs on (C++ on a CPU, Triton
on a GPU), which group the same work somewhat differently.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

# The logger inductor checks before it counts a graph's bytes (torch._inductor.compile_fx's artifact logger).
_INDUCTOR_METRICS_LOGGER = "torch._inductor.compile_fx.__inductor_metrics"


@contextlib.contextmanager
def inductor_metrics_counted():
    """Inside: inductor adds each graph it compiles to ``torch._inductor.metrics`` (reset on entry): the bytes
    (``num_bytes_accessed``) and the kernels they are of (``nodes_num_elem``). It counts only when its metrics
    logger is enabled (the logger's records are dropped here), and a graph from its on-disk caches brings
    the total back but not the kernels, so the caches are off inside."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics

    logger = logging.getLogger(_INDUCTOR_METRICS_LOGGER)
    saved = logger.level, logger.propagate, list(logger.handlers)
    logger.setLevel(logging.INFO)
    logger.propagate, logger.handlers = False, [logging.NullHandler()]
    metrics.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            yield metrics
    finally:
        logger.level, logger.propagate, logger.handlers = saved[0], saved[1], saved[2]


def compiled_counts(name: str, first_call: Callable[[], object]) -> dict[str, float]:
    """``kernels``, ``mb`` and ``fused_mb`` of what ``first_call`` compiles: the first forward and backward of a
    ``torch.compile``d function (``name`` says which, in the error when nothing was counted)."""
    with inductor_metrics_counted() as metrics:
        first_call()
    counts = {"kernels": sum(not isinstance(node, NopKernelSchedulerNode) for node, _ in metrics.nodes_num_elem),
              "mb": metrics.num_bytes_accessed / 1e6,
              "fused_mb": 4 * sum(quarter for node, quarter in metrics.nodes_num_elem  # (bytes // 4) per kernel
                                  if not isinstance(node, ExternKernelSchedulerNode)) / 1e6}
    if not counts["kernels"]:
        raise RuntimeError(f"inductor counted no kernel for {name!r}: this torch ({torch.__version__}) does not "
                           f"count through the logger {_INDUCTOR_METRICS_LOGGER!r} or compiled from a cache; run "
                           "without --compile, or update benchmarks/inductor_count.py")
    return counts
