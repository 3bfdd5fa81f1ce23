"""SDConv benchmark: fused Triton kernels vs transformers' unfold + matmul vs our PyTorch reference.

    python benchmarks/sdconv.py                      # CUDA: ConvBERT-base sweep in bf16; CPU: one small fp32 shape
    python benchmarks/sdconv.py --batch 8 --seq 128 --dtype fp32 --threads 1

All implementations run side by side in one process on the same inputs. On CUDA it reports median
forward, backward and forward+backward times (triton.testing.do_bench), the fused kernels' achieved
memory bandwidth against a device-to-device copy measured in the same run, and each op's peak memory
(torch.cuda.max_memory_allocated over one forward+backward). On CPU it compares our reference with the
transformers sequence (wall-clock medians; peak memory from the torch profiler's allocation events);
the Triton figures need CUDA.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.model.sdconv import dynamic_conv, dynamic_conv_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GOALS = {"speedup_fwd_bwd": 5.0, "copy_bandwidth": 0.60, "memory_ratio": 0.25}


def transformers_unfold_conv(kernel_logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The conv branch of transformers' ConvBertSelfAttention.forward, op for op, from the outputs of
    ``conv_kernel_layer`` ([B, T, n*K], here viewed [B, T, n, K]) and ``conv_out_layer`` ([B, T, A])."""
    batch, _, heads, kernel_size = kernel_logits.shape
    head_dim = values.shape[-1]
    all_head_size = heads * head_dim
    kernel = torch.softmax(torch.reshape(kernel_logits, [-1, kernel_size, 1]), dim=1)
    unfolded = torch.reshape(values, [batch, -1, all_head_size]).transpose(1, 2).contiguous().unsqueeze(-1)
    unfolded = F.unfold(unfolded, kernel_size=[kernel_size, 1], dilation=1,
                        padding=[(kernel_size - 1) // 2, 0], stride=1)
    unfolded = unfolded.transpose(1, 2).reshape(batch, -1, all_head_size, kernel_size)
    out = torch.matmul(torch.reshape(unfolded, [-1, head_dim, kernel_size]), kernel)
    out = torch.reshape(out, [-1, all_head_size])
    return torch.reshape(out, [batch, -1, heads, head_dim])


def _impls(on_cuda: bool) -> dict:
    impls = {"transformers unfold": transformers_unfold_conv, "torch reference": dynamic_conv_reference}
    if on_cuda:
        impls["triton fused"] = lambda logits, values: dynamic_conv(logits, values, impl="triton")
    return impls


def _inputs(batch, seq_len, heads, head_dim, kernel_size, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, seq_len, heads, kernel_size, device=device, generator=gen).to(dtype)
    values = torch.randn(batch, seq_len, heads, head_dim, device=device, generator=gen).to(dtype)
    grad_out = torch.randn(batch, seq_len, heads, head_dim, device=device, generator=gen).to(dtype)
    return logits.requires_grad_(), values.requires_grad_(), grad_out


def _max_error(fn, logits, values) -> float:
    with torch.no_grad():
        want = dynamic_conv_reference(logits.float(), values.float())
        return (fn(logits, values).float() - want).abs().max().item()


def _fused_bytes(logits, values) -> tuple[int, int]:
    """Bytes the fused kernels must move: forward reads logits + values, writes out + fp32 lse; backward
    reads logits, values, lse, grad_out and writes grad_logits, grad_values."""
    rows = logits.shape[0] * logits.shape[1] * logits.shape[2]
    lg, val = logits.numel() * logits.element_size(), values.numel() * values.element_size()
    return lg + 2 * val + 4 * rows, 2 * lg + 3 * val + 4 * rows


def _cuda_peak_mib(fn, logits, values, grad_out) -> float:
    logits.grad = values.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(logits, values).backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    logits.grad = values.grad = None
    return peak / 2**20


def _copy_bandwidth(nbytes: int) -> float:
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / ms / 1e6  # GB/s


def _goal(value: float, goal: float, at_least: bool) -> str:
    met = value >= goal if at_least else value <= goal
    return f"goal {'>=' if at_least else '<='} {goal:g}: {'ok' if met else 'MISSED'}"


def _time_cuda(fn, logits, values, grad_out) -> tuple[float, float, float]:
    """Median ms of forward, backward alone (on a retained graph) and forward+backward."""
    from triton.testing import do_bench
    fn(logits, values).backward(grad_out)  # compile and autotune outside the timed region
    logits.grad = values.grad = None
    fwd = do_bench(lambda: fn(logits, values), return_mode="median")
    out = fn(logits, values)
    bwd = do_bench(lambda: torch.autograd.grad(out, (logits, values), grad_out, retain_graph=True),
                   return_mode="median")
    del out
    both = do_bench(lambda: fn(logits, values).backward(grad_out), grad_to_none=[logits, values],
                    return_mode="median")
    return fwd, bwd, both


def run_cuda(args) -> None:
    from convbert_ds.kernels import sdconv_triton

    dtype = DTYPES[args.dtype]
    copy_gbs = _copy_bandwidth(1 << 30)
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | dtype {args.dtype} | "
          f"n={args.heads} d={args.head_dim} K={args.kernel}")
    print(f"device-to-device copy (1 GiB): {copy_gbs:.0f} GB/s")
    header = (f"{'B':>4} {'T':>4}  {'impl':<20} {'fwd ms':>8} {'bwd ms':>8} {'fwd+bwd ms':>10} "
              f"{'peak MiB':>9} {'max err':>8}")
    for seq_len in args.seq:
        for batch in args.batch:
            logits, values, grad_out = _inputs(batch, seq_len, args.heads, args.head_dim, args.kernel, dtype, "cuda")
            print(f"\n{header}")
            stats = {}
            for name, fn in _impls(True).items():
                fwd, bwd, both = _time_cuda(fn, logits, values, grad_out)
                peak = _cuda_peak_mib(fn, logits, values, grad_out)
                stats[name] = (fwd, bwd, both, peak)
                print(f"{batch:>4} {seq_len:>4}  {name:<20} {fwd:>8.3f} {bwd:>8.3f} {both:>10.3f} {peak:>9.1f} "
                      f"{_max_error(fn, logits, values):>8.1e}")
            fwd, bwd, both, peak = stats["triton fused"]
            hf, ref = stats["transformers unfold"], stats["torch reference"]
            fwd_bytes, bwd_bytes = _fused_bytes(logits, values)
            bw_fwd, bw_bwd = fwd_bytes / fwd / 1e6, bwd_bytes / bwd / 1e6
            bw_both = (fwd_bytes + bwd_bytes) / both / 1e6
            print(f"  triton vs transformers: fwd {hf[0] / fwd:.1f}x, fwd+bwd {hf[2] / both:.1f}x "
                  f"[{_goal(hf[2] / both, GOALS['speedup_fwd_bwd'], True)}] | "
                  f"vs torch reference: fwd {ref[0] / fwd:.1f}x, fwd+bwd {ref[2] / both:.1f}x")
            print(f"  triton bandwidth: fwd {bw_fwd:.0f} GB/s ({bw_fwd / copy_gbs:.0%} of copy), "
                  f"bwd {bw_bwd:.0f} GB/s ({bw_bwd / copy_gbs:.0%}), fwd+bwd {bw_both:.0f} GB/s "
                  f"({bw_both / copy_gbs:.0%}) [{_goal(bw_both / copy_gbs, GOALS['copy_bandwidth'], True)}]")
            print(f"  peak memory: triton {peak / hf[3]:.2f} of transformers' "
                  f"[{_goal(peak / hf[3], GOALS['memory_ratio'], False)}], torch reference {ref[3] / hf[3]:.2f}")
            print(f"  autotuned: fwd {sdconv_triton._sdconv_fwd_kernel.best_config}, "
                  f"bwd {sdconv_triton._sdconv_bwd_kernel.best_config}")


def _cpu_medians_ms(fns: dict, reps: int) -> dict:
    """Median wall-clock ms of each callable, timed in interleaved rounds so load drift hits all alike."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _cpu_peak_mib(fn) -> float:
    """Peak of live bytes allocated while ``fn`` runs, from the profiler's allocation/free events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_cpu(args) -> None:
    dtype = DTYPES[args.dtype]
    print(f"device: CPU ({_cpu_name()}), {torch.get_num_threads()} torch threads | torch {torch.__version__} | "
          f"dtype {args.dtype} | n={args.heads} d={args.head_dim} K={args.kernel} | "
          f"medians of {args.reps} interleaved runs")
    print("CUDA not available: the Triton kernels' timings, bandwidth and peak memory need a GPU; "
          "comparing our torch reference with transformers' unfold only.")
    header = f"{'B':>4} {'T':>4}  {'impl':<20} {'fwd ms':>8} {'fwd+bwd ms':>10} {'peak MiB':>9} {'max err':>8}"
    for seq_len in args.seq:
        for batch in args.batch:
            logits, values, grad_out = _inputs(batch, seq_len, args.heads, args.head_dim, args.kernel, dtype, "cpu")
            print(f"\n{header}")
            runs = {}
            for name, fn in _impls(False).items():
                def fwd_bwd(fn=fn):
                    logits.grad = values.grad = None
                    fn(logits, values).backward(grad_out)
                runs[(name, "fwd")] = lambda fn=fn: fn(logits, values)
                runs[(name, "fwd+bwd")] = fwd_bwd
            medians = _cpu_medians_ms(runs, args.reps)
            stats = {}
            for name, fn in _impls(False).items():
                fwd, both = medians[(name, "fwd")], medians[(name, "fwd+bwd")]
                logits.grad = values.grad = None
                peak = _cpu_peak_mib(lambda: fn(logits, values).backward(grad_out))
                err = _max_error(fn, logits, values)
                stats[name] = (fwd, both, peak)
                print(f"{batch:>4} {seq_len:>4}  {name:<20} {fwd:>8.2f} {both:>10.2f} {peak:>9.1f} {err:>8.1e}")
            hf, ref = stats["transformers unfold"], stats["torch reference"]
            print(f"  torch reference vs transformers: fwd {hf[0] / ref[0]:.2f}x, fwd+bwd {hf[1] / ref[1]:.2f}x "
                  f"faster; peak memory {ref[2] / hf[2]:.2f} of transformers'")


def main(argv=None) -> None:
    on_cuda = torch.cuda.is_available()
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=bounded(int, min=1), nargs="+", default=[32, 64, 128, 256] if on_cuda else [8])
    parser.add_argument("--seq", type=bounded(int, min=1), nargs="+", default=[128, 512] if on_cuda else [128])
    parser.add_argument("--heads", type=bounded(int, min=1), default=6)
    parser.add_argument("--head-dim", type=bounded(int, min=1), default=64)
    parser.add_argument("--kernel", type=bounded(int, min=1), default=9)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16" if on_cuda else "fp32")
    parser.add_argument("--reps", type=bounded(int, min=1), default=20, help="timed repetitions per measurement on CPU")
    parser.add_argument("--threads", type=bounded(int, min=1), default=None,
                        help="torch CPU threads (default: torch's); 1 is steadier on a shared machine")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_cuda(args) if on_cuda else run_cpu(args)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
