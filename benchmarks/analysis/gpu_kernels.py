"""Inductor's GPU kernels on a CPU, for the kernel-analysis tools (``interpreted_step.py``): inductor builds
for CPU tensors the Triton kernels it would build for a GPU (``gpu_kernels_built_for_cpu_tensors``), their
launches can be recorded (``launches_recorded``), and the SDConv picks what it picks on CUDA
(``sdconv_as_on_cuda``). Each works by patching a few attributes for the time of a ``with`` block
(``attributes_set``)."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch._inductor.scheduler import ForeachKernelSchedulerNode


@contextlib.contextmanager
def gpu_kernels_built_for_cpu_tensors(backend_hash: str, patches: tuple = ()):
    """Inside, inductor builds for CPU tensors the Triton kernels it would build for a GPU: its Triton backend
    for CPUs (``cpu_backend="triton"``) runs the GPU's scheduler, fusion rules and code generator, where the
    default C++ backend groups the same work otherwise. The configurations its heuristics give each kernel
    are the GPU's too: they see CUDA as available (a LayerNorm's row then runs on one warp, not eight); and
    so are its combo kernels (``combo_kernels``), which it would otherwise never form from CPU kernels
    (``_combo_groups_as_on_a_gpu``). ``backend_hash`` stands for the Triton backend's, which there is no
    driver to give, in the keys of inductor's caches. ``patches``: more ``(owner, name, value)`` for the
    caller. Three private names of torch are patched, and ``patches``; each is restored on exit. Nothing
    here compiles the kernels for a GPU or runs them: Triton's interpreter can (``interpreted_step.py``)."""
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


@contextlib.contextmanager
def launches_recorded(also_run: bool = False):
    """Inside, the name of every inductor Triton kernel launched is appended to the list it yields, and the
    launch dropped; ``also_run``: and run (in Triton's interpreter, ``interpreted_step.gpu_kernels_interpreted``)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    launches: list[str] = []

    def record(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs) if also_run else None

    run = CachingAutotuner.run
    with attributes_set(((CachingAutotuner, "run", record),)):
        yield launches


def sdconv_as_on_cuda() -> tuple:
    """Patches (for ``attributes_set``) under which ``sdconv_impl: auto`` on CPU tensors picks what it picks on
    CUDA (the dynamic conv's Triton custom ops, the packed conv through inductor when compiled), without
    probing the Triton kernels first."""
    from convbert_ds.model import depthwise, sdconv

    resolve = sdconv.resolve_impl

    def resolve_as_on_cuda(impl, device):
        return resolve(impl, torch.device("cuda"))

    return ((sdconv, "resolve_impl", resolve_as_on_cuda), (depthwise, "resolve_impl", resolve_as_on_cuda),
            (sdconv, "cached_reason", lambda key, probe: None), (depthwise, "cached_reason", lambda key, probe: None))
