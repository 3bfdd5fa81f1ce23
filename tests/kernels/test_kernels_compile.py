"""The SDConv and packed depthwise conv kernels through Triton's real GPU compiler (to an sm_90 cubin), no GPU
needed.

The interpreter tests in test_kernels.py never run Triton's code generator, so a kernel that only the
compiled path rejects (constexpr scoping, layouts, dtype rules) would pass CI and fail on the first GPU.
This compiles the kernels as the JIT would specialise them for ConvBERT-base tensors (SDConv's with its taps
unrolled and looped; the depthwise conv's forward in every tuned block shape: it has not run on a GPU yet), in a
subprocess because test_kernels.py may already have switched this process to the interpreter.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def compile_for_gpu(kernel, args: tuple, meta: dict, config_index: int = 0, arch: int = 90):
    """``kernel`` (a ``triton.autotune``d JIT function) compiled for ``sm_<arch>`` by Triton's own compiler, as
    the JIT would specialise it for ``args`` (tensors: only their dtypes and alignment matter) with ``meta`` and
    its configuration ``config_index``; no GPU needed. Returns Triton's ``CompiledKernel`` (``.asm["cubin"]``)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import native_specialize_impl

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
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
    options = backend.parse_options({"num_warps": config.num_warps, "num_stages": config.num_stages})
    return triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_kernels(arch: int = 90) -> list[str]:
    """Compile forward and backward for a few dtype/flag combinations; returns a line per compiled kernel."""
    from convbert_ds.kernels import sdconv_triton as sd

    assert not sd.INTERPRET, "compile_kernels must run without TRITON_INTERPRET"

    def build(kernel, args, meta, config_index=0):
        compiled = compile_for_gpu(kernel, args, meta, config_index, arch)
        assert compiled.asm["cubin"], kernel.fn.__name__
        return f"{kernel.fn.__name__} {meta} {kernel.configs[config_index].kwargs}"

    done = []
    batch, seq_len, heads, head_dim = 2, 512, 6, 64
    for dtype, kernel_size, masked in ((torch.bfloat16, 9, True), (torch.float32, 1, False)):
        logits = torch.empty(batch, seq_len, heads, kernel_size, dtype=dtype)
        values = torch.empty(batch, seq_len, heads, head_dim, dtype=dtype)
        mask = torch.empty(batch, seq_len) if masked else None
        segments = torch.empty(batch, seq_len, dtype=torch.int32) if masked else None  # packed documents
        lse = torch.empty(batch, heads, seq_len)
        grads = (logits, values) if masked else (None, values)
        for index in (0, 1):  # one block shape with its taps unrolled, then looped
            done.append(build(sd._sdconv_fwd_kernel,
                              *sd.forward_args(logits, values, mask, segments, values, lse, masked), index))
            done.append(build(sd._sdconv_bwd_kernel,
                              *sd.backward_args(values, logits, values, mask, segments, lse, *grads), index))

    from convbert_ds.kernels import document_conv_triton as dc

    channels, kernel_size = 768, 9
    for dtype in (torch.float32, torch.bfloat16):  # fp32: x under autocast; bf16: DeepSpeed's bf16 weights
        x = torch.empty(batch, seq_len, channels, dtype=dtype)
        weight = torch.empty(channels, 1, kernel_size, dtype=dtype)[:, 0, :]  # the conv's weight, as the model passes it
        taps = torch.empty(batch, seq_len, kernel_size)
        per_sample = torch.empty(batch, channels, kernel_size)
        # Every block shape in fp32 (the paper configs' path); one in bf16, whose loads alone differ.
        for index in range(len(dc._document_conv_fwd_kernel.configs) if dtype == torch.float32 else 1):
            done.append(build(dc._document_conv_fwd_kernel, *dc.forward_args(x, weight, taps, x), index))
        done.append(build(dc._document_conv_bwd_kernel, *dc.backward_args(x, x, weight, taps, x, per_sample)))
    return done


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton build ships no ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    script = ("import sys; sys.path[:0] = sys.argv[1:]; import test_kernels_compile as t; "
              "print('\\n'.join(t.compile_kernels(90)))")
    result = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__), str(REPO)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("_sdconv_") == 8, result.stdout
    assert result.stdout.count("'UNROLL_TAPS': False") == 4, result.stdout
    # Forward: 5 tuned block shapes in fp32, 1 in bf16; backward (one block shape): fp32 and bf16.
    assert result.stdout.count("_document_conv_") == 8, result.stdout
