"""Registers, local memory and occupancy of the SDConv kernels as a GPU would run them, on any machine: each
configuration the tuner may pick, compiled for sm_90 by Triton's own compiler (to a cubin, with the ptxas it
ships) at ConvBERT-base's shapes (bf16, head size 64, K = 9, packed documents), read back with its cuobjdump.

    python benchmarks/kernel_registers.py
    python benchmarks/kernel_registers.py --arch 100 --seq 512

Why: the kernels are bound by memory, whose latency an SM hides with the programs it holds at once, and
the registers each thread needs decide how many that is (an SM has 65,536 registers, allocated 8 per thread
at a time, and runs at most 64 warps and 32 programs). The time each configuration takes is the tuner's
to measure on a GPU; this says what each costs in registers, without one. Local memory is what the
compiler spilled there (and the stack): loads and stores that the source does not have. The instructions
a thread issues, from the machine code (``kernel_issue``), and their time for one call at ``--at`` on an
H200's schedulers say whether a configuration could be bound by them rather than by memory: a
discriminator layer's backward at ConvBERT-base's batch of 256 issues in about 50 us unrolled, 75 us
looped, where the H200's profile gave the 24 calls of a step (generator and discriminator) 2.47 ms.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/kernel_registers.py`

from benchmarks.kernel_issue import (  # noqa: E402
    compile_for_arch, cuobjdump, instructions_per_thread, issue_ms, refuse_interpreter)
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402

REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 64, 32  # sm_90 and sm_100 alike
BASE_HEADS = 6  # ConvBERT-base's conv heads (head_ratio 2): the launches' shape


def compile_for_gpu(kernel, args: tuple, meta: dict, config_index: int = 0, arch: int = 90):
    """``kernel`` (a ``triton.autotune``d JIT function) compiled for ``sm_<arch>`` as the JIT would specialise
    it for ``args`` (tensors only their dtypes and alignment matter for) with ``meta`` and its configuration
    ``config_index``; no GPU needed. Returns Triton's ``CompiledKernel`` (``.asm["cubin"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(GPUTarget("cuda", arch, 32))
    fn = kernel.fn  # the JITFunction under triton.autotune
    config = kernel.configs[config_index]
    constexprs = {**meta, **config.kwargs}
    signature, attrs = {}, {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, args)):
        kind, spec = native_specialize_impl(type(backend), arg, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = spec
        else:
            attrs[(i,)] = backend.parse_attr(spec)
    signature.update({name: "constexpr" for name in fn.arg_names[len(args):]})
    return compile_for_arch(fn, signature, constexprs, attrs, config, arch)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``registers`` per thread and ``local`` bytes per thread of the one kernel in ``cubin``."""
    listing = cuobjdump(cubin, "--dump-resource-usage")
    found = {key: re.search(rf"\b{key}:(\d+)", listing) for key in ("REG", "LOCAL")}
    if not all(found.values()):
        raise RuntimeError(f"cuobjdump printed no REG/LOCAL line for the kernel:\n{listing}")
    return {"registers": int(found["REG"].group(1)), "local": int(found["LOCAL"].group(1))}


def programs_per_sm(registers: int, warps: int) -> int:
    """How many programs of ``warps`` warps, at ``registers`` per thread, one SM holds at once."""
    allocated = -(-max(registers, 1) // 8) * 8
    return min(REGISTERS_PER_SM // (allocated * 32 * warps), MAX_WARPS_PER_SM // warps, MAX_PROGRAMS_PER_SM)


def sdconv_launches(batch: int, seq: int, heads: int = BASE_HEADS, head_dim: int = 64, kernel_size: int = 9,
                    dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, object, tuple, dict]]:
    """``(label, kernel, args, meta)`` of SDConv's forward and backward as the model launches them on packed
    documents (a lse stored, both gradients), on empty tensors of those shapes."""
    from convbert_ds.kernels import sdconv_triton as sd

    logits = torch.empty(batch, seq, heads, kernel_size, dtype=dtype)
    values = torch.empty(batch, seq, heads, head_dim, dtype=dtype)
    segments = torch.empty(batch, seq, dtype=torch.int32)
    lse = torch.empty(batch, heads, seq)
    return [("forward", sd._sdconv_fwd_kernel, *sd.forward_args(logits, values, None, segments, values, lse, True)),
            ("backward", sd._sdconv_bwd_kernel,
             *sd.backward_args(values, logits, values, None, segments, lse, logits, values))]


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=bounded(int, min=70), default=90, help="compute capability x 10 (90: H100)")
    parser.add_argument("--seq", type=bounded(int, min=1), default=128)
    parser.add_argument("--at", type=bounded(int, min=1), default=256,
                        help=f"the batch of the issue time (ConvBERT-base's discriminator: {BASE_HEADS} heads)")
    args = parser.parse_args(argv)
    refuse_interpreter("benchmarks/kernel_registers.py")
    import triton

    print(f"SDConv's kernels compiled for sm_{args.arch} (bf16, head size 64, K = 9, packed documents, seq "
          f"{args.seq}) | triton {triton.__version__}")
    print(f"issue us: the instructions one call issues at batch {args.at} ({BASE_HEADS} heads), at one a clock per "
          f"scheduler of an H200 (benchmarks/kernel_issue.py)")
    print(f"{'kernel':<10}{'BLOCK_T':>8}{'warps':>7}{'taps':>10}{'registers':>11}{'local B':>9}"
          f"{'programs/SM':>13}{'warps/SM':>10}{'instr/thread':>14}{'issue us':>10}")
    for label, kernel, launch_args, meta in sdconv_launches(batch=2, seq=args.seq):
        for index, config in enumerate(kernel.configs):
            cubin = compile_for_gpu(kernel, launch_args, meta, index, args.arch).asm["cubin"]
            usage = resource_usage(cubin)
            programs = programs_per_sm(usage["registers"], config.num_warps)
            unrolled = config.kwargs["UNROLL_TAPS"]
            # Looped, the taps are the innermost loop (K trips); unrolled, the head-size loop is (one trip).
            per_thread = instructions_per_thread(cuobjdump(cubin, "-sass"), 1 if unrolled else meta["KERNEL_SIZE"])
            threads = args.at * BASE_HEADS * math.ceil(args.seq / config.kwargs["BLOCK_T"]) * config.num_warps * 32
            taps = "unrolled" if unrolled else "loop"
            print(f"{label:<10}{config.kwargs['BLOCK_T']:>8}{config.num_warps:>7}{taps:>10}"
                  f"{usage['registers']:>11}{usage['local']:>9}{programs:>13}{programs * config.num_warps:>10}"
                  f"{per_thread:>14,}{issue_ms(threads * per_thread / 32) * 1e3:>10.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
