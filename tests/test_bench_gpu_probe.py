"""bench/gpu_probe.py's trace summary on made-up CUPTI records (the device runs are not
testable here): a kernel whose one slow instance a step hides in its mean shows in its max."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("gpu_probe",
                                               Path(__file__).resolve().parents[1] / "bench" / "gpu_probe.py")
gpu_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_probe)


def _records(durations: list[tuple[str, float]]) -> list[dict]:
    """Kernels back to back with a 1 us gap, in this order."""
    out, t = [], 0.0
    for name, dur in durations:
        out.append({"name": name, "ts": t, "dur": dur, "cat": "kernel", "args": {"grid": [8, 1, 1]}})
        t += dur + 1.0
    return out


def test_summary_keeps_each_kernels_min_median_and_max():
    attention = "mlx::core::cu::custom_kernel_tandem_decode_attention_fused_float16_t_128(float*)"
    step = [(attention, 12.0), ("void mlx::core::cu::copy_v<int>(int*)", 2.0), (attention, 11.0)]
    recs = _records([(attention, 170.0)] + step[1:] + step + step)  # step 1 starts with a slow one
    s = gpu_probe.summarize(recs, "test", steps=3)
    rows = {r["kernel"]: r for r in s["by_kernel"]}
    att = rows["tandem_decode_attention_fused_float16_t_128 [8, 1, 1]"]
    assert att["per_step"] == 2.0
    assert (att["us_min"], att["us_p50"], att["us_max"]) == (11.0, 11.5, 170.0)
    assert att["us_each"] == (170 + 11 + 12 + 11 + 12 + 11) / 6
    assert rows["copy_v<int> [8, 1, 1]"]["us_per_step"] == 2.0
    assert s["busy_us_per_step"] == sum(d for _, d in [(attention, 170.0)] + step[1:] + step + step) / 3


def test_kernel_label_keeps_template_arguments_and_drops_mlx_prefix():
    name = "mlx::core::cu::custom_kernel_tandem_qgemv_stream_4096_1_8_1_t_f_t(const __half*, int)"
    assert gpu_probe.kernel_label(name) == "tandem_qgemv_stream_4096_1_8_1_t_f_t"
    assert gpu_probe.kernel_label("void mlx::core::cu::copy_v<__half, float>(__half*)") == "copy_v<__half, float>"


def test_decode_steps_cut_at_each_argmax_and_keep_the_gaps_between():
    prefill = [("gemm_prefill", 50.0), ("tandem_argmax_rows(int*)", 3.0)]
    step = [("Memcpy HtoD", 1.0), ("tandem_qgemv_stream(x)", 20.0), ("tandem_argmax_rows(int*)", 3.0)]
    recs = _records(prefill + step + step)
    recs[-3]["ts"] += 40.0  # the second step starts 40 us late: its gap, not its span
    for e in recs[-2:]:
        e["ts"] += 40.0
    steps = gpu_probe.decode_steps(recs)
    assert len(steps) == 2  # the prefill's argmax opens the first step; nothing before it is one
    first, second = steps
    assert first["kernels"] == second["kernels"] == 3
    assert first["busy_us"] == second["busy_us"] == 24.0
    assert first["span_us"] == second["span_us"] == 24.0 + 2 * 1.0  # two 1 us gaps inside
    assert (first["gap_before_us"], second["gap_before_us"]) == (1.0, 41.0)
    assert first["by_name"]["tandem_qgemv_stream"] == 20.0
    assert "gemm_prefill" not in first["by_name"]


def _call(corr: int, ts: float, dur: float, name: str = "cudaGraphLaunch") -> dict:
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _kernel(corr: int, name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_gap_causes_tells_a_late_host_from_an_idle_device():
    events = [
        _call(1, 0.0, 5.0),
        _kernel(1, "void gemm_a(float*)", 10.0, 100.0),     # ends at 110
        _call(2, 20.0, 5.0),                                 # queued long before the gap
        _kernel(2, "void norm_b(float*)", 150.0, 10.0),      # 40 us gap: the device's
        _call(3, 190.0, 20.0),                               # returns at 210, after the gap began
        _kernel(3, "void gemm_c(float*)", 215.0, 50.0),      # 55 us gap: the host's
        _kernel(3, "void add_d(float*)", 267.0, 3.0),        # 2 us gap: below the threshold
        _kernel(99, "void stray(float*)", 300.0, 1.0),       # 30 us gap, no launching call
    ]
    g = gpu_probe.gap_causes(events, min_gap_us=10.0)
    assert (g["device_us"], g["device_n"]) == (40.0, 1)
    assert (g["host_us"], g["host_n"]) == (55.0, 1)
    assert (g["unmatched_us"], g["unmatched_n"]) == (30.0, 1)
    assert g["small_gaps_us"] == 2.0
    assert g["lead_in_us"] == 10.0
    assert g["span_us"] == 291.0 and g["busy_us"] == 164.0
    top = g["largest"][0]
    assert (top["gap_us"], top["cause"], top["before"], top["after"]) == (55.0, "host", "norm_b", "gemm_c")
    assert top["queued_us"] == -50.0  # the call returned 50 us after the device ran dry
    assert g["largest"][1]["queued_us"] == 85.0  # queued 85 us before the device ran dry


def test_gap_causes_measures_gaps_from_the_latest_end_of_overlapping_records():
    events = [_kernel(1, "void long_a(float*)", 0.0, 100.0), _kernel(1, "void short_b(float*)", 10.0, 5.0),
              _kernel(1, "void next_c(float*)", 120.0, 5.0), _call(1, -5.0, 2.0)]
    g = gpu_probe.gap_causes(events, min_gap_us=10.0)
    assert g["device_n"] == 1 and g["device_us"] == 20.0
    assert g["largest"][0]["before"] == "long_a"


def test_prefill_timeline_puts_host_marks_and_device_records_on_one_clock():
    # The trace's clock (us) runs 1,000,000 us ahead of the perf counter's (s * 1e6).
    events = [{"cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 1_000_000.0, "dur": 10.0},
              _kernel(1, "void embed(int*)", 1_000_500.0, 100.0),
              _kernel(2, "nvjet_sm90_gemm", 1_000_700.0, 9_000.0),
              _kernel(3, "void argmax(float*)", 1_010_000.0, 20.0)]
    anchor = 0.00001  # the perf counter when the synchronize returned (trace 1,000,010 us)
    marks = [("tick", anchor + 0.0002), ("forward", anchor + 0.0003), ("async_eval/end", anchor + 0.001),
             ("async_eval/end", anchor + 0.006), ("forward/end", anchor + 0.0061), ("tick/end", anchor + 0.0062),
             ("read_back/end", anchor + 0.0105), ("returned", anchor + 0.0106)]
    t = gpu_probe.prefill_timeline(events, marks, anchor)
    assert t["device_first"] == 0.49 and t["device_first_gemm"] == 0.69
    assert t["device_last_end"] == 10.01 and t["device_busy_ms"] == 9.12
    assert t["first_async_eval_end"] == 1.0 and t["last_async_eval_end"] == 6.0
    assert t["device_after_queued_ms"] == 4.01
    assert t["busy_after_queued_ms"] == 3.71  # the GEMM's last 3.69 ms and the argmax
    assert t["host_noticed_after_ms"] == 0.49
    assert t["host"]["tick"] == 0.2 and t["host"]["returned"] == 10.6


def test_prefill_timeline_is_empty_without_the_anchor():
    assert gpu_probe.prefill_timeline([_kernel(1, "void k(int*)", 0.0, 1.0)], [], 0.0) == {}
