"""What the step's dropout draws cost an H200 in issued instructions, by how many draws each Philox call
yields, counted from sm_90 machine code on any machine.

    python benchmarks/random_issue.py                 # base, seq 128, at batch 256
    python benchmarks/random_issue.py --preset small --seq 512 --at 32

Why: every hidden dropout of the ELECTRA step (the embeddings' of each body, two a layer) draws one
uniform an element, 3.3 million a sample for ConvBERT-base at seq 128. Philox4x32-10 gives four 32-bit
numbers a call, and its ten rounds of multiplies are most of a draw's instructions. Torch's dropout and
Bernoulli kernels use all four (curand's ``uniform4``); inductor's ``tl.rand`` (``train.compile_random:
inductor``) takes one of them a call. So a kernel that draws dropout masks can be bound by its
instructions rather than its bytes: a keep mask of one byte an element moves little, but its Philox calls
issue nearly what torch's whole dropout kernel does. Each row is a Triton kernel that draws a block of keep
masks in the row's way (a stand-in for torch's CUDA kernels, which Triton cannot compile: the same
generator, the same draws a call), compiled for ``sm_<arch>``; its instructions a thread (``kernel_issue``)
over the elements it draws give the count an element, and the step's elements at ``--at`` give the time
at one warp instruction a clock on each of an H200's schedulers. The 16-bit row splits each 32-bit number
into two draws: eight a call, keep probabilities to 1/65,536.
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/random_issue.py`

from benchmarks.kernel_issue import (  # noqa: E402
    H200_PEAK_TBPS, compile_for_arch, cuobjdump, instructions_per_thread, issue_ms, refuse_interpreter)
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES, ElectraConfig  # noqa: E402

BLOCK, WARPS = 1024, 4  # calls a program makes, and its warps: a block of 8 calls a thread


@triton.jit
def _one_draw_a_call(seed_ptr, out_ptr, n, keep, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    draw = tl.rand(tl.load(seed_ptr), offsets)  # inductor's: one Philox call, one of its four numbers
    tl.store(out_ptr + offsets, (draw < keep).to(tl.int8), mask=offsets < n)


@triton.jit
def _store_kept(out_ptr, index, kept, n):
    tl.store(out_ptr + index, kept.to(tl.int8), mask=index < n)


@triton.jit
def _four_draws_a_call(seed_ptr, out_ptr, n, keep, BLOCK: tl.constexpr):
    calls = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a, b, c, d = tl.randint4x(tl.load(seed_ptr), calls)  # torch's kernels: all four numbers of a call
    first = calls * 4
    _store_kept(out_ptr, first, tl.uint_to_uniform_float(a) < keep, n)
    _store_kept(out_ptr, first + 1, tl.uint_to_uniform_float(b) < keep, n)
    _store_kept(out_ptr, first + 2, tl.uint_to_uniform_float(c) < keep, n)
    _store_kept(out_ptr, first + 3, tl.uint_to_uniform_float(d) < keep, n)


@triton.jit
def _eight_draws_a_call(seed_ptr, out_ptr, n, keep, BLOCK: tl.constexpr):
    calls = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a, b, c, d = tl.randint4x(tl.load(seed_ptr), calls)
    threshold = (keep * 65536.0).to(tl.uint32)  # each half of a number is a draw of 16 bits
    first = calls * 8
    _store_kept(out_ptr, first, (a & 0xFFFF) < threshold, n)
    _store_kept(out_ptr, first + 1, (a >> 16) < threshold, n)
    _store_kept(out_ptr, first + 2, (b & 0xFFFF) < threshold, n)
    _store_kept(out_ptr, first + 3, (b >> 16) < threshold, n)
    _store_kept(out_ptr, first + 4, (c & 0xFFFF) < threshold, n)
    _store_kept(out_ptr, first + 5, (c >> 16) < threshold, n)
    _store_kept(out_ptr, first + 6, (d & 0xFFFF) < threshold, n)
    _store_kept(out_ptr, first + 7, (d >> 16) < threshold, n)


# (label, kernel, draws a Philox call yields)
DRAWS = (("one of 32 bits a call (inductor's tl.rand)", _one_draw_a_call, 1),
         ("four of 32 bits a call (torch's kernels)", _four_draws_a_call, 4),
         ("eight of 16 bits a call", _eight_draws_a_call, 8))


def instructions_per_draw(kernel, draws_a_call: int, arch: int = 90) -> float:
    """Instructions a thread of ``kernel`` issues, over the keep masks it draws (BLOCK calls a program)."""
    signature = {"seed_ptr": "*i64", "out_ptr": "*i8", "n": "i32", "keep": "fp32", "BLOCK": "constexpr"}
    config = triton.Config({}, num_warps=WARPS, num_stages=1)
    compiled = compile_for_arch(kernel, signature, {"BLOCK": BLOCK}, {}, config, arch)
    per_thread = instructions_per_thread(cuobjdump(compiled.asm["cubin"], "-sass"), 1)
    return per_thread / (BLOCK * draws_a_call / (WARPS * 32))


def dropout_draws_per_sample(config: ElectraConfig, seq: int) -> int:
    """The uniforms one sample's training step draws for its hidden dropouts: each body's embeddings (their
    width), and each layer's two (after attention and after the feed-forward block, the body's width)."""
    bodies = [body for body in (config.generator, config.discriminator) if body and body.hidden_dropout_prob > 0]
    return seq * sum(body.embedding_size + 2 * body.num_hidden_layers * body.hidden_size for body in bodies)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default="base")
    parser.add_argument("--seq", type=bounded(int, min=1), default=128)
    parser.add_argument("--at", type=bounded(int, min=1), default=256, help="the batch the times are given at")
    parser.add_argument("--arch", type=bounded(int, min=70), default=90, help="compute capability x 10 (90: H100)")
    args = parser.parse_args(argv)
    refuse_interpreter("benchmarks/random_issue.py")
    draws = dropout_draws_per_sample(ElectraConfig.from_preset(args.preset), args.seq) * args.at
    mask_ms = draws / (H200_PEAK_TBPS * 1e12) * 1e3  # one byte a keep mask
    print(f"keep masks drawn in Triton kernels compiled for sm_{args.arch} | triton {triton.__version__}")
    print(f"the {args.preset} step's hidden dropouts at seq {args.seq}, batch {args.at}: {draws:,} draws; written as "
          f"one byte each: {draws / 1e9:.2f} GB, {mask_ms:.2f} ms at the HBM's {H200_PEAK_TBPS:g} TB/s")
    print(f"{'draws':<46}{'instructions/draw':>18}{'issue ms':>10}")
    for label, kernel, draws_a_call in DRAWS:
        per_draw = instructions_per_draw(kernel, draws_a_call, args.arch)
        print(f"{label:<46}{per_draw:>18.1f}{issue_ms(draws * per_draw / 32):>10.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
