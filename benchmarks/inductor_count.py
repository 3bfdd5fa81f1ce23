"""Inductor's own count of what a compiled function launches (``torch._inductor.metrics``), for the benchmarks
that compare compiled variants on a CPU (``layer_ab.py``, ``document_conv.py``): the kernels its forward and
backward graphs launch, matmuls included; the bytes all of them read and write (``mb``, "MB moved"); and the
bytes of only the kernels inductor fuses itself (``fused_mb``, "MB fused": the elementwise and reduction
work between the matmuls). On a GPU those kernels are bound by the bytes they move, so the count says on a
CPU what a change does to them. It is for the kernels built for the device it runs on (C++ on a CPU, Triton
on a GPU), which group the same work somewhat differently; ``gpu_kernels_on_cpu`` has a CPU build the GPU's.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable

import torch
from torch._inductor.scheduler import ExternKernelSchedulerNode, ForeachKernelSchedulerNode, NopKernelSchedulerNode

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


@contextlib.contextmanager
def gpu_kernels_on_cpu():
    """Inside, inductor builds for CPU tensors the Triton kernels it would build for a GPU
    (``gpu_kernels_built_for_cpu_tensors``), and neither compiles nor runs them: that needs a GPU, Triton's
    CPU backend (not installed) or its interpreter (``benchmarks/interpreted_step.py``, slow). The ops
    inductor leaves to others (matmuls, custom ops) run, on zeros: every buffer inductor allocates is
    zeroed, so an index read from one is valid. What the compiled code computes is meaningless; what it
    launches, and inductor's count of the bytes (``inductor_metrics_counted``), are the GPU's. A function
    compiled inside keeps its zeroed buffers and its kernels that do nothing."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def zeros(size, stride, dtype):
        elements = sum((s - 1) * t for s, t in zip(size, stride)) + 1 if all(size) else 0
        return torch.zeros(elements, dtype=dtype).as_strided(size, stride)

    not_run = ((CachingAutotuner, "precompile", lambda self, *args, **kwargs: None),
               (CachingAutotuner, "run", lambda self, *args, **kwargs: None),
               (torch._C._dynamo.guards, "_empty_strided_cpu", zeros))  # the wrapper's allocator for CPU buffers
    with gpu_kernels_built_for_cpu_tensors("not-compiled", not_run):
        yield


@contextlib.contextmanager
def gpu_kernels_built_for_cpu_tensors(backend_hash: str, patches: tuple = ()):
    """Inside, inductor builds for CPU tensors the Triton kernels it would build for a GPU: its Triton backend
    for CPUs (``cpu_backend="triton"``) runs the GPU's scheduler, fusion rules and code generator, where the
    default C++ backend groups the same work otherwise. The configurations its heuristics give each kernel
    are the GPU's too: they see CUDA as available (a LayerNorm's row then runs on one warp, not eight); and
    so are its combo kernels (``combo_kernels``), which it would otherwise never form from CPU kernels
    (``_combo_groups_as_on_a_gpu``). ``backend_hash`` stands for the Triton backend's, which there is no
    driver to give, in the keys of inductor's caches. ``patches``: more ``(owner, name, value)`` for the
    caller. Three private names of torch are patched, and ``patches``; each is restored on exit."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.runtime.triton_heuristics as heuristics
    import torch.utils._triton as torch_triton

    patches = ((torch_triton, "triton_hash_with_backend", lambda: backend_hash),
               (heuristics, "torch", _TorchWithCuda()),
               (ForeachKernelSchedulerNode, "group_algorithm_for_combo_kernels", _combo_groups_as_on_a_gpu),
               *patches)
    # No on-disk cache: what is compiled here must never be found by a real compile.
    with attributes_set(patches), warnings.catch_warnings(), functorch_config.patch(enable_autograd_cache=False), \
            inductor_config.patch(cpu_backend="triton", compile_threads=1, fx_graph_cache=False):
        warnings.filterwarnings("ignore", message="Could not find an active CPU backend")
        yield


def _combo_groups_as_on_a_gpu(scheduler) -> list[list]:
    """The nodes inductor's scheduler may join into combo kernels, grouped by its own default rule
    (``ForeachKernelSchedulerNode``'s), which leaves out every node on a CPU: here each node is taken to be
    on a GPU while the rule runs. Nothing else of the rule changes (its topological levels, its largest
    group, the nodes it leaves out for other reasons)."""
    gpu = torch.device("cuda")
    nodes = list(scheduler.nodes)
    for node in nodes:  # an attribute of the instance hides its class's method, for this call only
        node.get_device = lambda: gpu
    try:
        return ForeachKernelSchedulerNode._default_group_nodes_for_combo_kernels(scheduler)
    finally:
        for node in nodes:
            del node.get_device


class _TorchWithCuda:
    """``torch`` as inductor's kernel heuristics see it in ``gpu_kernels_built_for_cpu_tensors``: CUDA
    available (they ask only that of it), everything else torch's own."""

    class _Cuda:
        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def is_available() -> bool:
            return True

    cuda = _Cuda()

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def attributes_set(patches):
    """Inside, each ``(owner, name, value)`` of ``patches`` has ``owner.name = value``; on exit, what it was."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
