"""``train.profile``: a window of steps traced by the torch profiler on real DeepSpeed ranks, and the
one-line errors for windows and kinds that cannot work."""

import json
import re

import pytest

from convbert_ds.config import ConfigError
from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import NOT_THE_SUBJECT, TINY_CONFIG, check, run_training


@pytest.mark.slow
def test_a_cpu_run_writes_one_trace_per_rank_for_its_window(tiny_corpus, tmp_path):
    output = check(run_training(tmp_path, tiny_corpus["shards"], "train.steps=5", "train.warmup_steps=1",
                                "eval.interval=0", "checkpoint.interval=100", "train.profile.start_step=2",
                                "train.profile.steps=2", launcher=NOT_THE_SUBJECT))
    profile = tmp_path / "logs" / "profile"
    assert f"profile: steps 2-3 (trace) written to {profile}" in output
    traces = sorted(profile.glob("*.pt.trace.json"))
    assert [path.name.split(".")[0] for path in traces] == ["rank0", "rank1"]
    for path in traces:
        names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
        assert {"train step 2", "train step 3"} <= names  # the window, step by step
        assert not {"train step 1", "train step 4"} & names  # and nothing outside it
        assert {"aten::mm", "aten::scaled_dot_product_attention"} <= names  # the model's ops inside
    # Each rank's summary of its window; rank 0 prints its own. On CPU: the wall time and the host's ops.
    summaries = {rank: (profile / f"summary_rank{rank}.txt").read_text().splitlines() for rank in (0, 1)}
    printed = output.split("profile summary (rank 0, 2 steps):\n")[1].splitlines()
    assert printed[:len(summaries[0])] == [f"  {line}" for line in summaries[0]]
    for lines in summaries.values():
        wall_ms = float(re.fullmatch(r"wall ([\d.]+) ms/step; no CUDA kernels recorded \(a CPU run: the host does "
                                     r"it all\)", lines[0]).group(1))
        assert 0 < wall_ms < 60_000
        assert lines[1] == "  host: the ops with the most CPU time of their own"
        host = [re.fullmatch(r" +([\d.]+) ms/step x(\d+) +(\S.*)", line) for line in lines[2:]]
        assert len(host) == 6 and all(host), lines
        assert all(float(m.group(1)) <= wall_ms for m in host)  # one op's own time within the step's


@pytest.mark.parametrize("overrides, message", [
    (["train.profile.start_step=2", "train.profile.what=[memory]"],
     "train.profile.what=['memory']: ['memory'] need a GPU (CUDA memory snapshots, NVTX ranges); use [trace] on CPU"),
    (["train.profile.start_step=2", "train.profile.what=[trace, flame]"],
     "train.profile.what=['trace', 'flame']: use a non-empty list of ['trace', 'memory', 'nvtx']"),
    (["train.profile.start_step=500", "train.steps=200"],
     "train.profile.start_step=500 is after the last step (train.steps=200)"),
])
def test_profile_windows_that_cannot_work_are_one_line(overrides, message, tiny_corpus):
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(cfg, world_size=2, cuda=False)


def test_the_device_summary_counts_kernels_once_and_not_the_ranges_mirrored_on_the_device():
    """A GPU timeline as torch's profiler reports it: ``train step N`` and the optimizer's range appear on
    the device too, as user annotations spanning the kernels inside them. Counting them made a device
    "busy" 158-195% of the wall time (H100, 2026-11-26): the busy time is the kernels' and copies' alone."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from convbert_ds.engine.profiling import STEP_RANGE, device_time_summary

    def event(n, name, start, end, device=DeviceType.CUDA, annotation=False):
        return FunctionEvent(id=n, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                             use_device="cuda", is_user_annotation=annotation, stack=[])

    events = []
    ms = 1000  # the events' times are in microseconds
    for step in range(2):  # steps of 100 ms: a 30 ms GEMM, a 10 ms copy, and the host op launching them
        t = 100 * ms * step
        events += [event(10 * step + 1, f"{STEP_RANGE}{step + 1}", t, t + 90 * ms, annotation=True),
                   event(10 * step + 2, "Optimizer.step#AdamW.step", t + 60 * ms, t + 90 * ms, annotation=True),
                   event(10 * step + 3, "gemm_kernel", t, t + 30 * ms),
                   event(10 * step + 4, "Memcpy DtoD", t + 60 * ms, t + 70 * ms),
                   event(10 * step + 5, "aten::mm", t, t + 20 * ms, device=DeviceType.CPU)]
    timeline = EventList(events, use_device="cuda")
    timeline._build_tree()
    lines = device_time_summary(timeline, steps=2, wall_s=0.2)
    assert lines[0] == "wall 100.0 ms/step, device busy 40.0 ms/step (40%), 2 kernels and copies/step"
    device_rows = lines[1:lines.index("  by kind of kernel:")]
    assert [row.split()[-1] for row in device_rows] == ["gemm_kernel", "DtoD"]
    assert device_rows[0].split()[:2] == ["75.0%", "30.00"]
    host_at = lines.index("  host: the ops with the most CPU time of their own")
    by_kind = lines[lines.index("  by kind of kernel:") + 1:host_at]
    assert [row.split(None, 4)[1:] for row in by_kind] == [
        ["30.00", "ms/step", "x1", "matmuls (cuBLAS)"], ["10.00", "ms/step", "x1", "copies, casts and fills"],
        ["0.00", "ms/step", "x0", "of those in kernels under 10 us on average"]]


def _trace_event(category, name, start_ms, end_ms, tid):
    """One complete event of a trace as torch's profiler writes it (Chrome's trace format)."""
    return {"ph": "X", "cat": category, "name": name, "ts": start_ms * 1000, "dur": (end_ms - start_ms) * 1000,
            "pid": 0, "tid": tid}


def test_a_trace_file_read_back_gives_the_summary(tmp_path):
    """``trace_file_events`` over a trace as torch's profiler writes it (Chrome's format, gzip-compressed):
    the same timeline as above, its ranges mirrored on the device, the host's ops nested in its steps."""
    import gzip

    from convbert_ds.engine.profiling import STEP_RANGE, device_time_summary, trace_file_events
    from convbert_ds.errors import UserError

    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}]
    for step in range(2):  # steps of 100 ms: a 30 ms GEMM, a 10 ms copy, and the host op launching them
        t = 100 * step
        events += [_trace_event("user_annotation", f"{STEP_RANGE}{step + 1}", t, t + 90, tid=1),
                   _trace_event("gpu_user_annotation", f"{STEP_RANGE}{step + 1}", t, t + 90, tid=7),
                   _trace_event("user_annotation", "Optimizer.step#AdamW.step", t + 60, t + 90, tid=1),
                   _trace_event("kernel", "gemm_kernel", t, t + 30, tid=7),
                   _trace_event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", t + 60, t + 70, tid=7),
                   _trace_event("cpu_op", "aten::mm", t, t + 20, tid=1)]
    trace = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(trace, "wt") as file:
        json.dump({"traceEvents": events}, file)
    timeline, steps, wall_s = trace_file_events(trace)
    assert (steps, wall_s) == (2, pytest.approx(0.19))  # from the first step's start to the last event's end
    lines = device_time_summary(timeline, steps, wall_s)
    assert lines[0] == "wall 95.0 ms/step, device busy 40.0 ms/step (42%), 2 kernels and copies/step"
    assert [row.split()[-1] for row in lines[1:3]] == ["gemm_kernel", "Device)"]
    host = lines[lines.index("  host: the ops with the most CPU time of their own") + 1:]
    assert [row.split(None, 3)[::3] for row in host[:3]] == [  # the step's own time: 90 ms less its two children
        ["40.00", "(Python between the ops, in the step)"], ["30.00", "Optimizer.step#AdamW.step"],
        ["20.00", "aten::mm"]]
    (tmp_path / "other.json").write_text(json.dumps({"traceEvents": events[3:4]}))
    with pytest.raises(UserError, match="no 'train step N' range in it"):
        trace_file_events(tmp_path / "other.json")


@pytest.mark.parametrize("name,kind", [  # names from H100 profiles of the step (RESULTS.md)
    ("void magma_sgemmEx_kernel<float, __nv_bfloat16, __nv_bfloat16, false, false, 6, 3, 5, 3, 3", "matmuls (cuBLAS)"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "matmuls (cuBLAS)"),
    ("std::enable_if<true, void>::type internal::gemvx::kernel<int, int, __nv_bfloat16, __nv_bfl", "matmuls (cuBLAS)"),
    ("triton_poi_fused__to_copy_bmm_mul_select_unfold_backward_view_27", "inductor's fused kernels"),
    ("triton_red_fused__to_copy_bmm_mul_sum_view_24", "inductor's fused kernels"),
    ("_sdconv_bwd_kernel", "our Triton kernels (SDConv, packed conv)"),
    ("_document_conv_bwd_kernel", "our Triton kernels (SDConv, packed conv)"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso",
     "copies, casts and fills"),
    ("Memcpy DtoD (Device -> Device)", "copies, casts and fills"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, ",
     "eager elementwise, norms, reductions"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std:",
     "eager elementwise, norms, reductions"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor",
     "optimizer and clipping (multi-tensor)"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collectives"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits", "attention"),
    # from the 2026-11-28 H200 profile of the captured base step
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*, void*, unsig",
     "attention"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned int", "attention"),
    ("at::cuda::philox::unpack_cudnn(at::PhiloxCudaState, long*, long*)", "attention"),
    ("void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float, unsigned int, 1, 8, bool>",
     "dropout (torch's kernels)"),
    ("triton_per_fused__to_copy_add_native_dropout_native_layer_norm_view_50", "inductor's fused kernels"),
])
def test_kernels_are_sorted_by_kind(name, kind):
    from convbert_ds.engine.profiling import kernel_kind

    assert kernel_kind(name) == kind


@pytest.mark.parametrize("name,part", [  # inductor's kernel names from the 2026-11-28 H200 profile (RESULTS.md)
    ("triton_red_fused__to_copy_constant_pad_nd_mul_select_slice_sum_unsqueeze_view_68", "the packed conv"),
    ("triton_poi_fused__to_copy_addcmul_constant_pad_nd_mul_select_slice_unsqueeze_55", "the packed conv"),
    ("triton_red_fused__to_copy_add_addcmul_constant_pad_nd_mul_native_dropout_backward_native_layer_norm_"
     "native_layer_norm_backward_select_slice_unsqueeze_", "the packed conv"),  # fused with a LayerNorm's backward
    ("triton_red_fused__to_copy_mul_select_slice_sum_unsqueeze_view_66", "the packed conv"),  # its form before
    ("triton_poi_fused_gelu_gelu_backward_view_55", "GELU and its backward"),
    ("triton_red_fused_gelu_gelu_backward_sum_view_29", "GELU and its backward"),
    ("triton_per_fused__to_copy_add_native_dropout_native_layer_norm_view_50", "LayerNorm, dropout, residual adds"),
    ("triton_red_fused_native_dropout_backward_sum_view_24", "LayerNorm, dropout, residual adds"),
    ("triton_red_fused__to_copy__unsafe_view_add_cat_mul_select_sum_transpose_view_62", "the rest"),
    ("triton_poi_fused__to_copy_39", "the rest"),
])
def test_inductor_kernels_are_split_by_the_part_they_fuse(name, part):
    from convbert_ds.engine.profiling import fused_part, kernel_kind

    assert kernel_kind(name) == "inductor's fused kernels"
    assert fused_part(name) == part


def test_the_summary_splits_inductor_kernels_by_part(tmp_path):
    """Under inductor's fused kernels, the summary says how much of their time each part of the layer took."""
    from convbert_ds.engine.profiling import STEP_RANGE, device_time_summary, trace_file_events

    conv = "triton_poi_fused__to_copy_addcmul_constant_pad_nd_mul_select_slice_unsqueeze_55"
    events = [_trace_event("user_annotation", f"{STEP_RANGE}1", 0, 100, tid=1),
              _trace_event("kernel", "triton_poi_fused_gelu_gelu_backward_view_55", 0, 30, tid=7),
              _trace_event("kernel", conv, 30, 40, tid=7),
              _trace_event("kernel", "triton_poi_fused__to_copy_39", 40, 45, tid=7),
              _trace_event("kernel", "gemm_kernel", 45, 95, tid=7)]
    (tmp_path / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    lines = device_time_summary(*trace_file_events(tmp_path / "rank0.pt.trace.json"))
    fused = lines.index("  by kind of kernel:") + 2  # matmuls first (50 ms), then inductor's (45 ms)
    assert lines[fused].split()[-3:] == ["inductor's", "fused", "kernels"]
    assert [line.split("of which ")[1] for line in lines[fused + 1:fused + 4]] == [
        "GELU and its backward", "the packed conv", "the rest"]
    assert lines[fused + 1].split()[1:3] == ["30.00", "ms/step"]
