"""The instructions inductor's Triton kernels issue on a GPU, read from their machine code on any machine.

A kernel's time on a GPU is bound by the bytes it moves or by the instructions its warps issue, whichever
takes longer. ``kernel_plan`` counts the bytes; this counts the instructions. Each kernel that a compiled
function launches (recorded where inductor launches it, ``launches_recorded``) is compiled for ``sm_90``
by Triton's own compiler, with each configuration inductor's heuristics give it, and its SASS (from the
``cuobjdump`` Triton ships) counted: per thread, the instructions from the first to the kernel's last
``EXIT``, an innermost loop's body once per trip (a reduction's runs ``ceil(r0_numel / R0_BLOCK)`` times), times
the threads its grid launches. The configuration that issues the fewest is taken, as inductor's tuner
would time them; a kernel's configurations and grid are inductor's (``GridExpr``). Run it without
``TRITON_INTERPRET``: Triton's interpreter, set before Triton is imported, leaves its library of
functions uncompilable for a GPU.

Why: an H200 issues one warp instruction per clock on each of an SM's four schedulers (132 SMs). A
kernel that issues more than its bytes take at the memory's rate is bound by its instructions, and a
byte count cannot see it: the discriminator's GELU moves 403 MB a layer at batch 256 and took 149 us on
an H200 (2.7 TB/s of its 4.8), where its 38 instructions an element (erf in fp32) take about 115 us at the
full clock, and its bytes 84 us at the full bandwidth.

What this leaves out, each making the time a floor: every instruction is taken to issue in one clock,
where the special-function unit (``MUFU``: exp2, rcp, rsqrt) takes eight a warp; a grid too small to fill
the SMs issues from fewer of them (its latency bounds it); a kernel's bytes and instructions are taken to
overlap perfectly. Code that a branch skips is counted as run: the one way the count can exceed a GPU's.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from convbert_ds.errors import UserError

H200_SMS, SCHEDULERS_PER_SM, H200_CLOCK_GHZ = 132, 4, 1.98  # warp instructions a clock: SMs x schedulers
H200_PEAK_TBPS = 4.8  # its HBM3e, by the data sheet

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


@dataclass(frozen=True)
class Launch:
    """One launch of an inductor kernel: its autotuner (source, configurations, inductor's metadata) and the
    values of its integer arguments (``xnumel``, ``r0_numel``, ...)."""
    kernel: object  # torch._inductor.runtime.triton_heuristics.CachingAutotuner
    sizes: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def fused_name(self) -> str:
        """The name inductor's scheduler gives the kernel (``get_fused_kernel_name``), which its Triton name
        wraps: ``triton_poi_fused_gelu_view_53`` -> ``fused_gelu_view``."""
        return re.sub(r"_\d+$", "", re.sub(r"^triton_[a-z]+_", "", self.name))


@contextlib.contextmanager
def launches_recorded(also_run: bool = False):
    """Inside, every launch of an inductor Triton kernel is appended to the list it yields instead of run
    (inside ``inductor_count.gpu_kernels_on_cpu``, where no kernel runs anyway); ``also_run``: and run (in
    Triton's interpreter, ``interpreted_step.gpu_kernels_interpreted``)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from benchmarks.inductor_count import attributes_set

    launches: list[Launch] = []

    def record(self, *args, **kwargs):
        names = [name for name in self.fn.arg_names if self.triton_meta["signature"].get(name) != "constexpr"]
        launches.append(Launch(self, tuple((name, value) for name, value in zip(names, args)
                                          if isinstance(value, int) and not isinstance(value, bool))))
        return run(self, *args, **kwargs) if also_run else None

    run = CachingAutotuner.run
    with attributes_set(((CachingAutotuner, "run", record),)):
        yield launches


_compiled: dict[tuple, str] = {}  # (source, configuration, arch) -> SASS: a layer's kernels repeat


def kernel_sass(kernel, config, arch: int = 90) -> str:
    """The SASS of ``kernel`` (a ``CachingAutotuner``) with ``config`` (one of its ``configs``), compiled for
    ``sm_<arch>`` as inductor compiles it for a GPU (its signature, constants and argument attributes)."""
    key = (kernel.fn.src, str(config), arch)
    if key not in _compiled:
        _compiled[key] = _compile(kernel, config, arch)
    return _compiled[key]


def _compile(kernel, config, arch: int) -> str:
    meta = kernel.triton_meta
    compiled = compile_for_arch(kernel.fn, dict(meta["signature"]), {**meta.get("constants", {}), **config.kwargs},
                                meta["configs"][0] if meta.get("configs") else {}, config, arch,
                                enable_fp_fusion=meta.get("enable_fp_fusion", True))
    return cuobjdump(compiled.asm["cubin"], "-sass")


def refuse_interpreter(command: str) -> None:
    """A ``UserError`` naming ``command`` when ``TRITON_INTERPRET`` is set: Triton's interpreter, set before Triton
    is imported, replaces the library of functions its compiler needs, so nothing here can compile for a GPU."""
    if os.environ.get("TRITON_INTERPRET"):
        raise UserError("TRITON_INTERPRET is set, and Triton cannot compile kernels for a GPU under its interpreter: "
                        f"run without it (env -u TRITON_INTERPRET python {command})")


def compile_for_arch(fn, signature: dict, constants: dict, attrs: dict, config, arch: int, **options):
    """Triton's ``CompiledKernel`` of the JIT function ``fn`` for ``sm_<arch>``, specialised as ``signature``,
    ``constants`` and argument ``attrs`` say, with ``config``'s warps and stages (and ``options``); no GPU
    needed."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    parsed = make_backend(target).parse_options({"num_warps": config.num_warps, "num_stages": config.num_stages,
                                                 **options})
    return triton_compile(ASTSource(fn, signature, constants, attrs), target=target, options=parsed.__dict__)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What the ``cuobjdump`` that Triton ships prints for ``cubin`` with ``flag`` (``-sass``: the machine
    code; ``--dump-resource-usage``: registers and local memory)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=True).stdout


def instructions_per_thread(sass: str, trips: int) -> int:
    """Instructions one thread issues running ``sass`` (one kernel's), up to its last ``EXIT`` (without the
    self-branch and ``NOP``s that pad the code after it), the body of each innermost loop ``trips`` times.
    A loop around another is taken to run once: inductor's kernels have one loop at most (a reduction's),
    and the SDConv kernels' loop over the head dimension has one trip at ConvBERT's head size."""
    code = [(int(address, 16), opcode, operands) for address, opcode, operands in _INSTRUCTION.findall(sass)]
    if not code:
        raise RuntimeError(f"no SASS instructions found in:\n{sass[:2000]}")
    last_exit = max(i for i, (_, opcode, _) in enumerate(code) if opcode == "EXIT")
    code = code[:last_exit + 1]
    loops = []  # (first, last) address of each loop: a branch back to an earlier instruction
    for address, opcode, operands in code:
        target = re.match(r"\s*0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    def inside(inner, outer) -> bool:
        return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]

    innermost = [loop for loop in loops if not any(inside(other, loop) for other in loops)]
    body = sum(1 for address, _, _ in code for first, last in innermost if first <= address <= last)
    return len(code) + body * (trips - 1)


def warp_instructions(launch: Launch) -> float:
    """Warp instructions ``launch`` issues with the configuration of its kernel that issues the fewest."""
    from torch._inductor.runtime.triton_heuristics import GridExpr

    sizes = {**launch.kernel.triton_meta.get("constants", {}), **dict(launch.sizes)}  # a size of 1 is a constant
    fewest = math.inf
    for config in launch.kernel.configs:
        grid = GridExpr.from_meta(launch.kernel.inductor_meta, config).eval_slow({**sizes, **config.kwargs})
        block = config.kwargs.get("R0_BLOCK")
        trips = -(-sizes["r0_numel"] // block) if block and "r0_numel" in sizes else 1
        per_thread = instructions_per_thread(kernel_sass(launch.kernel, config), trips)
        fewest = min(fewest, math.prod(grid) * config.num_warps * per_thread)
    return fewest


def issue_ms(warp_instructions_total: float, clock_ghz: float = H200_CLOCK_GHZ, sms: int = H200_SMS) -> float:
    """Milliseconds an SM-wide issue of ``warp_instructions_total`` takes, one a clock per scheduler."""
    return warp_instructions_total / (sms * SCHEDULERS_PER_SM * clock_ghz * 1e6)
