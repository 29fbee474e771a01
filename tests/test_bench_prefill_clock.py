"""bench/prefill_clock.py on the CPU: its summary of made-up marks, and its wrappers around a
fake engine whose device clock is the host's (the marker kernel itself needs CUDA)."""

import importlib.util
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("prefill_clock",
                                               Path(__file__).resolve().parents[1] / "bench" / "prefill_clock.py")
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


def test_device_seconds_joins_the_two_words():
    ns = 1_733_000_123_456_789_012
    words = np.array([[ns & 0xFFFFFFFF, ns >> 32]], np.uint32)
    assert pc.device_seconds(words)[0] == pytest.approx(ns * 1e-9, abs=1e-6)


def test_summary_places_the_device_against_the_host():
    s = 100.0  # submit, seconds
    host = [("tick", s + 0.0002), ("forward", s + 0.0005), ("async_eval/end", s + 0.0010),
            ("async_eval/end", s + 0.0016), ("async_eval/end", s + 0.0030), ("read_back/end", s + 0.0081)]
    # The device starts at 1.1 ms, embeds until 1.3, layer 0 ends at 4.3; layer 1 was handed
    # over only at 1.6 (fine, the device was busy) and ends at 7.3; the token at 8.0.
    device = [("ids", s + 0.0011), ("embed", s + 0.0013), ("eval0", s + 0.0043), ("eval1", s + 0.0073),
              ("eval2", s + 0.0080)]
    out = pc.summarize(host, device, s, s + 0.0085)
    assert out["tick"] == 0.2 and out["forward"] == 0.5
    assert out["device_start"] == 1.1 and out["lead_in_ms"] == 0.6
    assert out["embed_ms"] == 0.2
    assert out["layer_ms"] == [3.0, 3.0]
    assert out["head_ms"] == 0.7
    assert out["device_span_ms"] == 6.9
    assert out["token_done"] == 8.0 and out["noticed_after_ms"] == 0.1
    assert out["device_idle_ms"] == 0.0
    # Layer 0 was queued at 1.0, before the embedding ended: no wait on the host there either.
    assert out["device_idle_first_ms"] == 0.0


def test_summary_counts_the_device_waiting_for_a_late_layer():
    s = 0.0
    host = [("forward", 0.0001), ("async_eval/end", 0.002), ("async_eval/end", 0.009), ("async_eval/end", 0.0095)]
    device = [("ids", 0.0015), ("embed", 0.0016), ("eval0", 0.004), ("eval1", 0.011), ("eval2", 0.0112)]
    out = pc.summarize(host, device, s, 0.012)
    # Layer 1 was handed over at 9.0 ms, 5.0 after the device had finished layer 0 at 4.0;
    # layer 0 itself at 2.0, 0.4 after the embedding's end.
    assert out["device_idle_ms"] == 5.0
    assert out["device_idle_first_ms"] == 0.4


def test_summary_of_a_split_first_layer_reports_whole_layers():
    """PREFILL_FIRST_SPLIT: layer 0's attention half has a mark of its own before the
    layer's; layer_ms still holds one figure a layer, and the attention half its own."""
    host = [("forward", 0.0001), ("async_eval/end", 0.001), ("async_eval/end", 0.0012),
            ("async_eval/end", 0.0014), ("async_eval/end", 0.0016)]
    device = [("ids", 0.0011), ("embed", 0.0013), ("eval0", 0.0021), ("eval1", 0.0043),
              ("eval2", 0.0073), ("eval3", 0.0080)]
    out = pc.summarize(host, device, 0.0, 0.0085, first_split=True)
    assert out["layer0_attention_ms"] == 0.8
    assert out["layer_ms"] == [3.0, 3.0]
    assert out["head_ms"] == 0.7
    unsplit = pc.summarize(host, device, 0.0, 0.0085)
    assert unsplit["layer_ms"] == [0.8, 2.2, 3.0] and "layer0_attention_ms" not in unsplit


class _Runner:
    def __init__(self):
        self._embed = lambda ids: ids.astype(mx.float32) * 2

    def _prefill_inputs(self, ids):
        return ids + 0

    def forward(self, ids):
        h = self._embed(self._prefill_inputs(ids))
        for _ in range(3):
            h = h + 1
            mx.async_eval(h)
        return h


class _Engine:
    """Ticks as the real engine does: a forward that hands each layer over, the token's
    async_eval, then a read-back on the next tick; on a thread of its own."""

    def __init__(self):
        self.runner = _Runner()
        self._thread = None
        self.tokens = []

    def _tick(self):
        out = self.runner.forward(mx.array([1, 2, 3]))
        tok = out.sum()
        mx.async_eval(tok)
        self._pending = tok
        return 1

    def _read_back(self):
        mx.eval(self._pending)
        self.tokens.append(self._pending.item())
        return 1

    def run_once(self):
        def loop():
            self._tick()
            self._read_back()
        self._thread = threading.Thread(target=loop)
        self._thread.start()
        self._thread.join()


def _host_clock_mark(dep):
    ns = time.perf_counter_ns()
    return mx.array(np.array([ns & 0xFFFFFFFF, ns >> 32], np.uint32))


def test_clock_marks_the_engine_thread_and_undoes_itself(monkeypatch):
    monkeypatch.setattr(pc, "mark", _host_clock_mark)
    eng = _Engine()
    orig_async_eval, orig_embed = mx.async_eval, eng.runner._embed
    clock = pc.Clock(eng, offset=0.0)
    mx.async_eval(mx.zeros(1))  # the main thread's calls are not marked
    clock.arm()
    eng.run_once()
    assert clock.collected(timeout=1.0)
    clock.disarm()
    assert eng.tokens == [(2 + 4 + 6) + 9]  # the wrappers change no result
    assert len(clock.rounds) == 1
    host, device = clock.rounds[0]
    assert [n for n, _ in host] == (["tick", "forward", "inputs", "inputs/end", "embed", "embed/end"]
                                    + ["async_eval", "async_eval/end"] * 4 + ["read_back/end"])
    assert [label for label, _ in device] == ["ids", "embed", "eval0", "eval1", "eval2", "eval3"]
    times = [t for _, t in device]
    assert times == sorted(times)
    clock.undo()
    assert mx.async_eval is orig_async_eval and eng.runner._embed is orig_embed
    assert "_tick" not in vars(eng) and "forward" not in vars(eng.runner)
    assert "_prefill_inputs" not in vars(eng.runner)


def test_prefill_clocked_on_a_real_engine_gives_one_summary_a_round(tiny_model_dir, monkeypatch):
    """gpu_decode.prefill_clocked through the engine's own thread (the reference kernel
    runner on the CPU, the host's clock for the GPU's): every round is collected before
    the next is armed, with the embedding, one mark per layer and the token."""
    import sys

    from mlx_lm import load

    from tandem.pipeline.engine import Engine
    from tandem.pipeline.settings import EngineSettings

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    monkeypatch.syspath_prepend(bench)
    import gpu_decode
    import prefill_clock

    monkeypatch.setattr(prefill_clock, "mark", _host_clock_mark)
    monkeypatch.setattr(prefill_clock, "calibrate", lambda: (0.0, 0.0))
    monkeypatch.setattr(gpu_decode.qm, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu_decode, "_vocab", lambda: 200)
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    model, _ = load(str(tiny_model_dir))
    eng = Engine(model, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny")
    layers = len(eng.runner.blocks)
    eng.start()
    try:
        out = gpu_decode.prefill_clocked(eng, 64, reps=4)
        assert out["rounds"] == 4
        assert len(out["layer_ms"]) == layers
        assert out["forward"] < out["device_start"] < out["token_done"] <= out["read_back/end"] < out["returned"]
        assert out["forward"] < out["embed"] < out["async_eval"] < out["async_eval/end"]
        assert out["device_span_ms"] > 0 and "device_idle_ms" in out
        assert eng.generate_many([(list(range(3, 40)), _one_token())])  # the engine works after undo
        assert "_tick" not in vars(eng)
    finally:
        eng.stop()
        sys.modules.pop("gpu_decode", None)


def _one_token():
    from tandem.kvtypes import SamplingParams

    return SamplingParams(max_tokens=1, ignore_eos=True)
