"""Decode / prefill throughput on a CUDA GPU: stock mlx-lm vs tandem, one run, one table.

Builds a random-weight Llama-3.1-8B-shape model (32 layers, hidden 4096, FFN 14336,
8 KV heads, vocab 128256) on the GPU in fp16 and a 4-bit g64 copy, then measures:

* ``kernels``: the multirow quantized kernel vs ``mx.quantized_matmul`` vs fp16 matmul at
  the model's shapes, and paged decode attention vs the gather + SDPA path (with
  agreement checks against the pure-mx references on fresh random inputs);
* ``stock``: mlx-lm ``generate_step`` single stream (512-token prompt) and its
  ``BatchGenerator`` aggregate decode at each batch size, 4-bit and fp16;
* ``engine``: tandem's ``pipeline.Engine`` on the same model after
  ``kernels.linear.prepare_model`` (flattened linears; ``dual`` weights);
* ``loop``: a minimal batched decode loop built from the kernels alone (fused QKV and
  gate/up products, fused RoPE + in-place KV write, split-K paged attention) over the
  engine's pool layout: what the engine reaches once its attention dispatches to them.

Prints a table and writes ``gpu_decode.json`` and ``gpu_decode_run.md`` under
``docs/benchmarks/`` (or ``--out``); ``docs/benchmarks/gpu_decode.md`` summarizes the current
result and ``docs/benchmarks/LOG.md`` what was tried. Needs only mlx, mlx-lm and numpy (the GPU machine has no pyzmq etc.).
Each new kernel variant costs seconds of NVRTC on first use, so the kernel loop warms
up before it times anything; ``--section-timeout`` isolates sections from hangs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # _common, also where a test loads this file

import tandem  # noqa: F401,E402  (BLAS choice before mlx)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from tandem.kernels import paged_attention as pa  # noqa: E402
from tandem.kernels.cuda import linear  # noqa: E402
from tandem.kernels.cuda import paged_attention_cuda as pac  # noqa: E402
from tandem.kernels.cuda import kv_write_cuda as kvw  # noqa: E402
from tandem.kernels.cuda import quantized_matmul as qm  # noqa: E402
from tandem.pipeline import budget  # noqa: E402
from _common import Patches  # noqa: E402  (bench/ is first on sys.path when this runs as a script)

LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
RESULTS: dict = {"runs": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def record(section: str, **row) -> None:
    row["section"] = section
    RESULTS["runs"].append(row)
    log("  " + json.dumps(row))


TINY = False  # smoke-test shape (set by --tiny): same code paths, small matrices


def _vocab() -> int:
    return 1000 if TINY else 128000


def model_args(layers: int):
    from mlx_lm.models import llama
    h, f, v = (256, 512, 1000) if TINY else (4096, 14336, 128256)
    return llama.ModelArgs(model_type="llama", hidden_size=h, num_hidden_layers=layers,
                           intermediate_size=f, num_attention_heads=32 if not TINY else 4,
                           num_key_value_heads=8 if not TINY else 2,
                           rms_norm_eps=1e-5, vocab_size=v, rope_theta=500000.0,
                           rope_scaling=LLAMA31_ROPE, max_position_embeddings=131072,
                           tie_word_embeddings=False)


def build_models(layers: int):
    """fp16 model and a 4-bit g64 copy of the same weights (quantized from the fp16 ones)."""
    from mlx_lm.models import llama
    mx.random.seed(0)
    args = model_args(layers)
    fp16 = llama.Model(args)
    fp16.set_dtype(mx.float16)
    for layer in fp16.model.layers:
        mx.eval(layer.parameters())
    mx.eval(fp16.parameters())
    q4 = llama.Model(args)
    q4.update(fp16.parameters())
    nn.quantize(q4, group_size=64, bits=4)
    mx.eval(q4.parameters())
    return fp16, q4


def nbytes(model) -> int:
    from mlx.utils import tree_flatten
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def timeit(fn, warmup=2, iters=10):
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        out = fn()
        mx.eval(out)
    mx.synchronize()
    return (time.perf_counter() - t) / iters


def timeit_async(fn, iters=50):
    """Launch ``iters`` independent calls back to back; time per call (hides launch gaps)."""
    mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    outs = [fn() for _ in range(iters)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t) / iters


# ---------------------------------------------------------------------------------------
def section_kernels(quick: bool, parts: str = "qmv,attention") -> None:
    # Few template variants: each is an NVRTC compile (~5 s) on the GPU machine.
    shapes = [("qkv", 6144, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
              ("lm_head", 128256, 4096)]
    if "qmv" not in parts.split(","):
        shapes = []
    else:
        log("== kernels: multirow quantized matmul (4-bit g64, fp16 activations)")
    for name, n, k in shapes if not quick else shapes[1:3]:
        mx.random.seed(n + k)
        w = (mx.random.normal((n, k)) / k**0.5).astype(mx.float16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        mx.eval(w, wq, s, b)
        qbytes = wq.nbytes + s.nbytes + b.nbytes
        for m in (1, 4, 16):
            x = mx.random.normal((m, k)).astype(mx.float16)
            mx.eval(x)
            got = qm.quantized_matmul_cuda(x, wq, s, b, 64, 4)
            want = qm.quantized_matmul_reference(x, wq, s, b, 64, 4)
            err = (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
                   / mx.abs(want.astype(mx.float32)).max()).item()
            t_k = timeit_async(lambda: qm.quantized_matmul_cuda(x, wq, s, b, 64, 4))
            t_s = timeit_async(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True,
                                                           group_size=64, bits=4))
            t_d = timeit_async(lambda: x @ w.T)
            record("kernels", what="qmv", shape=name, n=n, k=k, rows=m, rel_err=err,
                   tandem_us=t_k * 1e6, stock_q4_us=t_s * 1e6, fp16_us=t_d * 1e6,
                   tandem_GBps=qbytes / t_k / 1e9, fp16_GBps=w.nbytes / t_d / 1e9)
        if name == "down":
            x = mx.random.normal((1, k)).astype(mx.float16)
            t = timeit_async(lambda: qm.quantized_matmul_cuda(x, wq, s, b, 64, 4, half_math=False))
            record("kernels", what="qmv-fp32-math", shape=name, rows=1, us=t * 1e6,
                   GBps=qbytes / t / 1e9)
            wq8, s8, b8 = mx.quantize(w, group_size=64, bits=8)
            got = qm.quantized_matmul_cuda(x, wq8, s8, b8, 64, 8)
            want = qm.quantized_matmul_reference(x, wq8, s8, b8, 64, 8)
            err = (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
                   / mx.abs(want.astype(mx.float32)).max()).item()
            t8 = timeit_async(lambda: qm.quantized_matmul_cuda(x, wq8, s8, b8, 64, 8))
            t8s = timeit_async(lambda: mx.quantized_matmul(x, wq8, s8, b8, transpose=True,
                                                           group_size=64, bits=8))
            q8bytes = wq8.nbytes + s8.nbytes + b8.nbytes
            record("kernels", what="qmv-8bit", shape=name, rows=1, rel_err=err,
                   tandem_us=t8 * 1e6, stock_q8_us=t8s * 1e6, tandem_GBps=q8bytes / t8 / 1e9)
        del w, wq, s, b
        gc.collect()

    if "attention" not in parts.split(","):
        return
    log("== kernels: paged decode attention (32 q heads, 8 KV heads, D 128, block 16)")
    for B, ctx in ([(1, 576), (1, 32768), (16, 576), (64, 576), (128, 576), (64, 4096)]
                   if not quick else [(1, 4096), (64, 576)]):
        H, KVH, D, bs = 32, 8, 128, 16
        nb = -(-ctx // bs)
        mx.random.seed(B + ctx)
        table = (mx.random.permutation(B * nb) + 1).reshape(B, nb).astype(mx.int32)
        kp = mx.random.normal(((B * nb + 1) * bs, KVH, D)).astype(mx.float16)
        vp = mx.random.normal(((B * nb + 1) * bs, KVH, D)).astype(mx.float16)
        q = mx.random.normal((B, H, D)).astype(mx.float16)
        lens = mx.array([ctx - (i % 7) for i in range(B)], dtype=mx.int32)
        mx.eval(table, kp, vp, q, lens)
        got = pac.paged_decode_attention(q, kp, vp, table, lens, D**-0.5, bs, ctx)
        if B * ctx <= 64 * 4096:
            want = pac.paged_decode_attention_reference(q, kp, vp, table, lens, D**-0.5, bs)
            err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        else:
            err = None
        t_k = timeit_async(lambda: pac.paged_decode_attention(q, kp, vp, table, lens, D**-0.5,
                                                              bs, ctx))
        q4 = q[:, :, None, :]
        q0 = lens - 1
        t_g = timeit_async(lambda: pa.paged_attention(q4, kp, vp, table, q0, bs, D**-0.5))
        kv_bytes = int(lens.sum().item()) * KVH * D * 2 * 2
        record("kernels", what="paged-attention", batch=B, ctx=ctx, max_abs_err=err,
               tandem_us=t_k * 1e6, gather_sdpa_us=t_g * 1e6, tandem_GBps=kv_bytes / t_k / 1e9,
               partition=pac.choose_partition(B, KVH, ctx))
        del table, kp, vp, q
        gc.collect()


# ---------------------------------------------------------------------------------------
def stock_single(model, prompt_len: int, gen: int) -> tuple[float, float]:
    from mlx_lm.generate import generate_step
    prompt = mx.array(np.random.randint(0, _vocab(), prompt_len), dtype=mx.uint32)
    t0 = time.perf_counter()
    times = []
    for i, (tok, _) in enumerate(generate_step(prompt, model, max_tokens=gen)):
        times.append(time.perf_counter())
    prefill = prompt_len / (times[0] - t0)
    decode = (len(times) - 5) / (times[-1] - times[4])  # skip the first steps (JIT compiles)
    return prefill, decode


def stock_batch(model, B: int, prompt_len: int, steps: int) -> tuple[float, float]:
    from mlx_lm.generate import BatchGenerator
    gen = BatchGenerator(model, max_tokens=steps + 8, completion_batch_size=max(B, 32),
                         prefill_batch_size=min(B, 8), prefill_step_size=2048)
    prompts = [np.random.randint(0, _vocab(), prompt_len).tolist() for _ in range(B)]
    t0 = time.perf_counter()
    gen.insert(prompts)
    started: set[int] = set()
    while len(started) < B:
        for r in gen.next_generated():
            started.add(r.uid)
    t1 = time.perf_counter()
    for _ in range(2):
        gen.next_generated()
    mx.synchronize()
    t = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += len(gen.next_generated())
    mx.synchronize()
    dt = time.perf_counter() - t
    gen.close()
    del gen
    return B * prompt_len / (t1 - t0), n / dt


def section_stock(models: dict, batches: list[int], prompt_len: int, steps: int,
                  max_batch_q4: int) -> None:
    for fmt, model in models.items():
        log(f"== stock mlx-lm, {fmt}")
        pf, dec = stock_single(model, prompt_len, 48)
        record("stock", fmt=fmt, batch=1, mode="single-stream", prefill_tps=pf, decode_tps=dec)
        for B in batches:
            if fmt == "4bit" and B > max_batch_q4:
                record("stock", fmt=fmt, batch=B, mode="batch", skipped=f"> {max_batch_q4}")
                continue
            pf, dec = stock_batch(model, B, prompt_len, steps if B > 1 else 2 * steps)
            record("stock", fmt=fmt, batch=B, mode="batch", prefill_tps=pf, decode_tps=dec)
            mx.clear_cache()


# ---------------------------------------------------------------------------------------
def prefill_alone(eng, B: int, prompt_len: int, reps: int) -> tuple[list[float], dict | None]:
    """Prefill tok/s of ``reps`` rounds of B fresh prompts, each asking for one token, one
    round at a time (submit to last token). The ``prefill_tps`` column is one such
    measurement taken at the start of the decode run, which moved 20k-39k at batch 1
    between processes of the same code; the median of several says more.

    Also where a round's time goes, medians in ms: ``wake`` (submit to the engine's first
    tick), ``launch`` (that tick: building the graph, with ``encode`` of it in
    ``mx.async_eval``), ``wait`` (the engine thread waiting for the device), ``ticks`` (all
    engine ticks of the round) and ``return`` (last tick to ``generate_many`` returning)."""
    from tandem.kvtypes import SamplingParams

    out, parts = [], []
    ticks = _time_ticks(eng)
    try:
        for _ in range(reps):
            prompts = [(np.random.randint(0, _vocab(), prompt_len).tolist(),
                        SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(B)]
            del ticks[:]
            t = time.perf_counter()
            eng.generate_many(prompts, timeout=300)
            end = time.perf_counter()
            out.append(B * prompt_len / (end - t))
            mine = [tk for tk in ticks if tk[0] - tk[2] >= t and tk[0] <= end]
            if mine:
                first = mine[0]
                parts.append(dict(wake=first[0] - first[2] - t, launch=first[2], encode=first[4],
                                  wait=sum(tk[1] for tk in mine), ticks=sum(tk[2] for tk in mine),
                                  **{"return": end - mine[-1][0]}))
    finally:
        ticks.undo()
    med = {k: round(float(np.median([p[k] for p in parts])) * 1e3, 3) for k in parts[0]} if parts else None
    return out, med


CLOCK_REPS = int(os.environ.get("TANDEM_BENCH_CLOCK_REPS", "3"))


def prefill_clocked(eng, prompt_len: int, reps: int = CLOCK_REPS) -> dict | None:
    """``reps`` more rounds of one prompt, each marked on the GPU's own clock
    (``prefill_clock.py``): medians, in ms from submit, of when the device started, finished
    the embedding and the token, how long it waited on the host, and each layer's device
    time. None without CUDA or with ``TANDEM_BENCH_CLOCK_REPS=0``."""
    if reps <= 0 or not qm.cuda_available():
        return None
    import prefill_clock as pc
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.runners.cuda import runner as cuda_runner

    split = cuda_runner.PREFILL_FIRST_SPLIT and cuda_runner.PREFILL_EVAL_EVERY > 0
    offset, within = pc.calibrate()
    clock = pc.Clock(eng, offset)
    rounds = []
    try:
        for _ in range(reps):
            prompt = [(np.random.randint(0, _vocab(), prompt_len).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))]
            clock.arm()
            t = time.perf_counter()
            eng.generate_many(prompt, timeout=300)
            end = time.perf_counter()
            got = clock.collected()
            clock.disarm()
            if got and clock.rounds:
                host, device = clock.rounds.pop()
                rounds.append(pc.summarize(host, device, t, end, first_split=split))
    finally:
        clock.undo()
    if not rounds:
        return None
    out: dict = {"rounds": len(rounds), "calibration_within_ms": round(within * 1e3, 3)}
    for k, v in rounds[0].items():
        vals = [r.get(k) for r in rounds]
        if isinstance(v, list) and all(isinstance(x, list) and len(x) == len(v) for x in vals):
            out[k] = [round(float(np.median(col)), 3) for col in zip(*vals)]
        elif all(isinstance(x, (int, float)) for x in vals):
            out[k] = round(float(np.median(vals)), 3)
    return out


class _Ticks(list):
    undo = None


def _graph_status(eng) -> dict | None:
    """The captured one-row step's counters (pipeline/runners/cuda/graph_step.py), when it is on; with
    ``TANDEM_GRAPH_TIMING=1`` also each replay's device ms and the device's idle ms before
    it, for the replays timed since the measured window began (it clears them)."""
    g = getattr(eng.runner, "graph_step", None)
    if g is None:
        return None
    out = {"replays": g.replays, "graphs": len(g._graphs), "failed": g.failed,
           "rows_limit": g.rows_limit, "rows_failed": g.rows_failed}
    if g.timings:
        out["timings_busy_idle_ms"] = [(round(b, 4), None if i is None else round(i, 4)) for _, b, i in g.timings]
    return out


def _time_ticks(eng) -> _Ticks:
    """Wrap the engine's tick, read-back, the runner's forward and ``mx.async_eval``: a
    list that fills with (tick end, seconds waiting in read-back, seconds of the whole
    tick, seconds building the step's graph in ``runner.forward``, seconds in
    ``mx.async_eval``: MLX encoding the step's kernels on this thread). Read-back includes
    emitting the step's tokens, a few us against its wait for the device. ``undo()``
    puts the originals back."""
    out = _Ticks()
    patches = Patches()
    spent = [0.0, 0.0, 0.0]  # read-back, forward, async_eval

    def timed(fn, i):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[i] += time.perf_counter() - t
        return wrapper

    def timed_tick(tick):
        def wrapper():
            spent[:] = [0.0, 0.0, 0.0]
            t = time.perf_counter()
            n = tick()
            now = time.perf_counter()
            out.append((now, spent[0], now - t, spent[1], spent[2]))
            return n
        return wrapper

    patches.wrap(eng, "_read_back", lambda fn: timed(fn, 0))
    patches.wrap(eng, "_tick", timed_tick)
    patches.wrap(eng.runner, "forward", lambda fn: timed(fn, 1))
    patches.wrap(mx, "async_eval", lambda fn: timed(fn, 2))
    out.undo = patches.undo
    return out


def section_engine(base_fp16, base_q4, layers: int, batches: list[int], prompt_len: int,
                   steps: int, kernels: str = "cuda", weights: str = "auto", prefill_reps: int = 5) -> None:
    """tandem's Engine on the 8B-shape model. ``kernels``: ``cuda`` = the CUDA runner
    (``pipeline/runners/cuda/runner.py``), ``off`` = the portable PagedRunner (same flattened
    weights): the pair shows what the decode kernels move."""
    import threading

    from mlx_lm.models import llama
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.api import EngineRequest
    from tandem.pipeline.engine import Engine
    from tandem.pipeline.settings import EngineSettings

    name = "engine" if kernels == "cuda" else "engine-" + kernels
    if kernels == "cuda" and not qm.cuda_available():
        kernels = "reference"  # --tiny smoke test on a machine without CUDA
    os.environ["TANDEM_PAGED_KERNELS"] = kernels
    model = llama.Model(model_args(layers))
    nn.quantize(model, group_size=64, bits=4)  # lazy: replaced by the shared arrays below
    model.update(base_q4.parameters())  # shares the arrays; prepare_model adds the dense copy
    mem = budget.device_memory()
    fmt = linear.prepare_model(model, weights, memory_bytes=mem)
    mx.eval(model.parameters())
    # Llama-3 RoPE keeps its frequencies in a private (non-parameter) array built lazily
    # on this thread's stream; the engine thread could not evaluate it.
    mx.eval([l.self_attn.rope._freqs for l in model.model.layers
             if hasattr(l.self_attn.rope, "_freqs")])
    top = max(batches)
    st = EngineSettings(parallel=top, max_batch_size=top, max_batch_prefill=8,
                        max_batch_prefill_tokens=linear.QUANTIZED_MAX_ROWS,
                        prefill_chunk_size=prompt_len,
                        kv_cache_budget="256MiB" if TINY else "24GiB",
                        enable_prefix_caching=False, max_queue_depth=4 * top,
                        cpus=os.environ.get("TANDEM_ENGINE_CPUS"),  # as tandem's config reads them
                        decode_graphs=os.environ.get("TANDEM_ENGINE_DECODE_GRAPHS", "true").lower() not in ("0", "false", "off", "no"))
    eng = Engine(model, st, model_id="bench-8b")
    runner = type(eng.runner).__name__
    log(f"== tandem engine ({name}: {runner}, weights {fmt}, {nbytes(model) / 2**30:.1f} GiB)")
    # As the worker's warm-up does, before the engine thread runs: every decode row class's
    # trace and captured graphs, which a measured batch would otherwise meet inside its steps.
    t = time.perf_counter()
    warm_decode = getattr(eng.runner, "warm_decode", None)
    if warm_decode is not None:
        warm_decode(top)
    warm_decode_s = time.perf_counter() - t
    eng.start()
    try:
        # Warm-up: every kernel variant (row buckets 1/2/4, fusions, dense GEMMs) compiles
        # once per process (NVRTC, seconds each); none of that belongs in the numbers.
        t = time.perf_counter()
        # Prompts of the measured length: prefill shapes (SDPA plans) compile here too.
        for n in (1, 2, 4, 8, 16):
            eng.generate_many([(np.random.randint(0, _vocab(), prompt_len).tolist(),
                                SamplingParams(max_tokens=12, ignore_eos=True))] * n, timeout=300)
        record(name, what="warm-up (compiles)", seconds=time.perf_counter() - t + warm_decode_s, runner=runner)
        for B in batches:
            prefill_runs, prefill_ms = prefill_alone(eng, B, prompt_len, prefill_reps)
            log(f"  prefill alone, B={B}: {[round(x) for x in prefill_runs]} tok/s, ms {prefill_ms}")
            try:
                clocked = prefill_clocked(eng, prompt_len) if B == 1 else None
            except Exception as exc:  # noqa: BLE001 - a diagnostic must not cost the section its rows
                log(f"  prefill clock failed: {traceback.format_exc()}")
                clocked = {"error": f"{type(exc).__name__}: {exc}"}
            if clocked and "rounds" in clocked:
                log(f"  prefill on the device's clock (ms from submit, medians of {clocked['rounds']}): "
                    + " ".join(f"{k}={clocked[k]}" for k in ("tick", "forward", "inputs", "inputs/end", "embed", "embed/end",
                                                             "async_eval", "async_eval/end",
                                                             "device_start", "embed_ms", "device_span_ms",
                                                             "device_idle_first_ms", "device_idle_ms", "head_ms",
                                                             "token_done", "noticed_after_ms", "returned") if k in clocked))
            gen_tokens = (steps if B > 4 else 3 * steps) + 2
            marks: dict[bytes, list] = {}
            done = []
            lock = threading.Lock()
            all_done = threading.Event()

            def on_event(ev, marks=marks, done=done, B=B):
                now = time.perf_counter()
                with lock:
                    marks.setdefault(ev.request_id, []).append((now, len(ev.tokens)))
                    if ev.finish_reason is not None:
                        done.append(ev.request_id)
                        if ev.finish_reason == "error":
                            log(f"  engine error: {ev.error}")
                        if len(done) == B:
                            all_done.set()

            waits = _time_ticks(eng)
            if getattr(eng.runner, "graph_step", None) is not None:
                eng.runner.graph_step.timings.clear()  # the window's replays only
            t0 = time.perf_counter()
            for i in range(B):
                prompt = np.random.randint(0, _vocab(), prompt_len).tolist()
                sp = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
                eng.submit(EngineRequest(os.urandom(16), prompt, sp, on_event))
            if not all_done.wait(300):
                raise RuntimeError("engine bench timed out")
            first = max(ev[0][0] for ev in marks.values())
            last = max(ev[-1][0] for ev in marks.values())
            after = sum(n for evs in marks.values() for (t, n) in evs if t > first)
            dec = after / (last - first) if last > first else None
            # Gaps between one request's token events after every request has started: a
            # stall (a compile, a cache rebuild) shows as a max far above the median.
            gaps = [1e3 * (b[0] - a[0]) for evs in marks.values() for a, b in zip(evs, evs[1:])
                    if a[0] >= first]
            gap = np.percentile(gaps, [50, 90]).tolist() + [max(gaps)] if gaps else None
            # Per engine tick after every request started: how long the thread waited for
            # the device (step N's eval) and how long it worked (the rest of the tick). A
            # wait near zero means the host, not the GPU, sets the step time.
            ticks = [tk[1:] for tk in waits if tk[0] >= first]
            waits.undo()

            def p50(f):
                return float(np.median([f(*tk) for tk in ticks])) * 1e3 if ticks else None
            wait_ms = p50(lambda w, t, f, a: w)
            host_ms = p50(lambda w, t, f, a: t - w)
            # Of the host's share: Python building the step (the runner's forward, the
            # compiled step's replay) and MLX encoding its kernels (async_eval).
            forward_ms, encode_ms = p50(lambda w, t, f, a: f), p50(lambda w, t, f, a: a)
            record(name, fmt=fmt, batch=B, runner=runner, prefill_tps=B * prompt_len / (first - t0),
                   prefill_tps_alone=(float(np.median(prefill_runs)) if prefill_runs else None),
                   prefill_tps_alone_runs=prefill_runs, prefill_ms_p50=prefill_ms, prefill_clock=clocked,
                   decode_tps=dec, step_ms=(1e3 * B / dec) if dec else None,
                   gap_ms_p50_p90_max=gap, tick_wait_ms_p50=wait_ms, tick_host_ms_p50=host_ms,
                   # Every gap and tick at small batches: whether the slow ones recur
                   # (every 16 tokens: a block boundary) or scatter (the host, the clock).
                   gaps_ms=[round(g, 3) for g in gaps] if B <= 4 else None,
                   ticks_wait_total_ms=[(round(w * 1e3, 3), round(t * 1e3, 3)) for w, t, f, a in ticks] if B <= 4 else None,
                   tick_forward_ms_p50=forward_ms, tick_encode_ms_p50=encode_ms,
                   compiled=getattr(eng.runner, "compiled", None),
                   graph_step=_graph_status(eng),
                   token_mailbox=(None if getattr(eng.runner, "mailbox", None) is None else
                                  {k: getattr(eng.runner.mailbox, k) for k in ("posted", "spun", "fell_back")}),
                   # MLX's eval waits for its queued work whenever more than 10 tasks are in
                   # flight or the active memory passes its limit (95% of the device's, in
                   # libmlx.so 0.32.4): near the limit, every async_eval would stall the GPU.
                   mlx_memory_gib={k: round(f() / 2**30, 2) for k, f in (
                       ("active", mx.get_active_memory), ("cache", mx.get_cache_memory),
                       ("peak", mx.get_peak_memory), ("limit", mx.get_memory_limit))},
                   tokens=sum(n for evs in marks.values() for (_, n) in evs),
                   paths=linear.paths_used())
    finally:
        eng.stop()
        os.environ.pop("TANDEM_PAGED_KERNELS", None)
        del eng, model
        gc.collect()
        mx.clear_cache()


# ---------------------------------------------------------------------------------------
class KernelLoop:
    """A batched greedy decode over the engine's pool layout, built from the kernels only.

    Per layer: rms_norm -> fused QKV product -> RoPE + in-place KV write -> split-K paged
    attention (decode) or causal SDPA (prefill) -> o product -> residual -> rms_norm ->
    fused gate/up product -> swiglu -> down product -> residual.
    """

    BS = 16

    def __init__(self, fp16, q4, fmt: str):
        a = fp16.args
        self.H, self.KVH = a.num_attention_heads, a.num_key_value_heads
        self.D = a.hidden_size // a.num_attention_heads
        self.vocab = a.vocab_size
        from mlx_lm.models.activations import swiglu
        self.swiglu = swiglu
        FlatLinear = linear.FlatLinear

        def flat(mf, mq):
            q = dict(qweight=mq.weight, scales=mq.scales, biases=mq.biases,
                     group_size=mq.group_size, bits=mq.bits)
            if fmt == "dense":
                return FlatLinear(weight=mf.weight)
            if fmt == "quantized":
                return FlatLinear(**q)
            # dual serves a quantized checkpoint: its dense copy is the dequantized weights
            dense = mx.dequantize(mq.weight, mq.scales, mq.biases, group_size=mq.group_size,
                                  bits=mq.bits).astype(mx.float16)
            return FlatLinear(weight=dense, **q)

        self.layers = []
        for lf, lq in zip(fp16.model.layers, q4.model.layers):
            af, aq, mf, mq = lf.self_attn, lq.self_attn, lf.mlp, lq.mlp
            qkv = linear.fuse_linears([flat(af.q_proj, aq.q_proj), flat(af.k_proj, aq.k_proj),
                                       flat(af.v_proj, aq.v_proj)])
            gu = linear.fuse_linears([flat(mf.gate_proj, mq.gate_proj), flat(mf.up_proj, mq.up_proj)])
            layer = (lf.input_layernorm.weight, qkv, flat(af.o_proj, aq.o_proj),
                     lf.post_attention_layernorm.weight, gu, flat(mf.down_proj, mq.down_proj))
            mx.eval([m.parameters() for m in layer[1:] if not isinstance(m, mx.array)])
            self.layers.append(layer)
        self.embed = (fp16 if fmt == "dense" else q4).model.embed_tokens
        self.norm = fp16.model.norm.weight
        self.head = flat(fp16.lm_head, q4.lm_head)
        mx.eval(self.head.parameters())
        self.eps = fp16.args.rms_norm_eps
        self.F = fp16.args.intermediate_size
        self.inv_freq = kvw.rope_inv_freq(fp16.model.layers[0].self_attn.rope, self.D)
        self.scale = self.D ** -0.5
        mx.eval(self.inv_freq)
        seen = set()
        total = 0
        for l in self.layers:
            for m in l:
                arrs = [m] if isinstance(m, mx.array) else [v for _, v in _leaves(m)]
                for a in arrs:
                    if id(a) not in seen:
                        seen.add(id(a))
                        total += a.nbytes
        self.weight_bytes = total

    def _forward(self, h, pos, slots, kp, vp, attn):
        H, KVH, D, F = self.H, self.KVH, self.D, self.F
        N = h.shape[0]
        for li, (ln1, qkv, o, ln2, gu, down) in enumerate(self.layers):
            # fused(): one multirow launch each for decode rows, the plain ops otherwise.
            y = qkv.fused(h, norm_weight=ln1, eps=self.eps)
            q, k = kvw.write_kv_rope(y, pos, slots, self.inv_freq, kp[li], vp[li], H, KVH)
            a = attn(li, q, k, y)
            h = o.fused(a.reshape(N, H * D), residual=h)
            g = gu.fused_swiglu(h, norm_weight=ln2, eps=self.eps)
            h = down.fused(g, residual=h)
        return h

    def _logits_argmax(self, h):
        return mx.argmax(self.head.fused(h, norm_weight=self.norm, eps=self.eps), axis=-1).astype(mx.int32)

    def prefill(self, prompts: np.ndarray, table: np.ndarray, kp, vp) -> mx.array:
        B, L = prompts.shape
        per = max(1, linear.QUANTIZED_MAX_ROWS // L)
        firsts = []
        pos_np = np.arange(L, dtype=np.int32)
        for s in range(0, B, per):
            b = min(per, B - s)
            tok = mx.array(prompts[s:s + b].reshape(-1))
            pos = np.tile(pos_np, b)
            rows = np.repeat(np.arange(s, s + b), L)
            slots = table[rows, pos // self.BS] * self.BS + pos % self.BS
            H, KVH, D = self.H, self.KVH, self.D

            def attn(li, q, k, y, b=b):
                qq = q.reshape(b, L, H, D).transpose(0, 2, 1, 3)
                kk = k.reshape(b, L, KVH, D).transpose(0, 2, 1, 3)
                vv = y[:, (H + KVH) * D:].reshape(b, L, KVH, D).transpose(0, 2, 1, 3)
                out = mx.fast.scaled_dot_product_attention(qq, kk, vv, scale=self.scale, mask="causal")
                return out.transpose(0, 2, 1, 3)

            h = self._forward(self.embed(tok), mx.array(pos), mx.array(slots.astype(np.int32)),
                              kp, vp, attn)
            firsts.append(self._logits_argmax(h.reshape(b, L, -1)[:, -1]))
            mx.async_eval(firsts[-1])
        return mx.concatenate(firsts)

    def step(self, tok: mx.array, lens: np.ndarray, table: np.ndarray, table_mx, kp, vp, part):
        """tok: (B,) this step's inputs at positions lens - 1 -> next tokens (B,)."""
        pos = lens - 1
        slots = table[np.arange(len(lens)), pos // self.BS] * self.BS + pos % self.BS
        lens_mx = mx.array(lens.astype(np.int32))
        max_len = int(lens.max())

        def attn(li, q, k, y):
            return pac.paged_decode_attention(q, kp[li], vp[li], table_mx, lens_mx, self.scale,
                                              self.BS, max_len, part)

        h = self._forward(self.embed(tok), mx.array(pos.astype(np.int32)),
                          mx.array(slots.astype(np.int32)), kp, vp, attn)
        return self._logits_argmax(h)

    def pools(self, slots_total: int):
        kp = [mx.zeros((slots_total, self.KVH, self.D), mx.float16) for _ in self.layers]
        vp = [mx.zeros((slots_total, self.KVH, self.D), mx.float16) for _ in self.layers]
        mx.eval(kp, vp)
        return kp, vp

    def generate(self, prompt: list[int], n: int) -> list[int]:
        """Greedy tokens for one prompt (the equivalence check against mlx-lm)."""
        nb = -(-(len(prompt) + n + 1) // self.BS)
        kp, vp = self.pools((nb + 1) * self.BS)
        table = (1 + np.arange(nb, dtype=np.int32)).reshape(1, nb)
        tok = self.prefill(np.array([prompt], dtype=np.int32), table, kp, vp)
        out = [int(tok.item())]
        lens = np.array([len(prompt) + 1])
        for _ in range(n - 1):
            tok = self.step(tok, lens, table, mx.array(table), kp, vp, None)
            out.append(int(tok.item()))
            lens += 1
        return out

    def measure(self, B: int, prompt_len: int, steps: int) -> dict:
        warm = 3
        nb = -(-(prompt_len + steps + warm + 2) // self.BS)
        slots_total = (B * nb + 1) * self.BS
        kp, vp = self.pools(slots_total)
        table = (1 + np.arange(B * nb, dtype=np.int32)).reshape(B, nb)
        table_mx = mx.array(table)
        prompts = np.random.randint(0, self.vocab, (B, prompt_len)).astype(np.int32)
        # Warm the prefill kernels on the same shapes (writes the same KV), then time it.
        mx.eval(self.prefill(prompts, table, kp, vp))
        mx.synchronize()
        t0 = time.perf_counter()
        tok = self.prefill(prompts, table, kp, vp)
        mx.eval(tok)
        t_pf = time.perf_counter() - t0
        lens = np.full(B, prompt_len + 1, dtype=np.int64)
        part = pac.choose_partition(B, self.KVH, prompt_len + steps + warm + 2)
        for _ in range(warm):
            tok = self.step(tok, lens, table, table_mx, kp, vp, part)
            mx.eval(tok)
            lens += 1
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = self.step(tok, lens, table, table_mx, kp, vp, part)
            mx.async_eval(tok)
            lens += 1
        mx.eval(tok)
        dt = time.perf_counter() - t0
        del kp, vp
        return {"prefill_tps": B * prompt_len / t_pf, "decode_tps": B * steps / dt,
                "step_ms": dt / steps * 1e3, "paths": linear.paths_used()}


def _leaves(module):
    from mlx.utils import tree_flatten
    return tree_flatten(module.parameters())


# ---------------------------------------------------------------------------------------
def section_loop(base_fp16, base_q4, batches: list[int], prompt_len: int, steps: int,
                 formats: list[str]) -> None:
    for fmt in formats:
        loop = KernelLoop(base_fp16, base_q4, fmt)
        log(f"== kernel loop ({fmt}, {loop.weight_bytes / 2**30:.1f} GiB of weights)")
        # Equivalence: the loop's greedy tokens against mlx-lm's own generate_step.
        from mlx_lm.generate import generate_step
        ref_model = base_fp16 if fmt == "dense" else _dequantized_copy(base_q4)
        prompt = np.random.randint(0, _vocab(), 64).tolist()
        want = [int(t) for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=16)]
        got = loop.generate(prompt, 16)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        record("loop", fmt=fmt, check="greedy tokens equal mlx-lm generate_step",
               matching_prefix=same, of=len(want))
        del ref_model
        for B in batches:
            r = loop.measure(B, prompt_len, steps)
            record("loop", fmt=fmt, batch=B, **r)
            mx.clear_cache()
        del loop
        gc.collect()
        mx.clear_cache()


def _dequantized_copy(q4):
    """mlx-lm model with the 4-bit weights dequantized to fp16: the oracle for ``dual``.

    (Not the 4-bit model itself: its prefill would JIT-compile MLX's CUTLASS quantized
    GEMM, minutes per tile shape on the GPU machine.)"""
    from mlx_lm.models import llama
    from mlx_lm.utils import dequantize_model
    m = llama.Model(q4.args)
    nn.quantize(m, group_size=64, bits=4)
    m.update(q4.parameters())
    m = dequantize_model(m)
    m.set_dtype(mx.float16)
    mx.eval(m.parameters())
    return m


def floors(layers: int) -> dict:
    """Bandwidth floors per decode step at 4.3 TB/s (the card's measured copy rate)."""
    bw = 4.3e12
    h, f, kvh, d, v = 4096, 14336, 8, 128, 128256
    per_layer = h * (h + 2 * kvh * d) + h * h + 3 * h * f
    params = layers * per_layer + v * h
    kv_per_token = layers * 2 * kvh * d * 2
    out = {}
    for name, bpp in (("fp16", 2.0), ("4bit", 0.5 + 4 / 64)):
        for B in (1, 4, 16, 64, 128):
            step = (params * bpp + B * (prompt_ctx := 576) * kv_per_token) / bw
            out[f"{name}_b{B}"] = B / step
    return out


def write_docs(out_dir: Path, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    RESULTS["meta"] = meta
    (out_dir / "gpu_decode.json").write_text(json.dumps(RESULTS, indent=1))
    lines = [f"# gpu_decode run {meta['date']}", "", f"`{meta['cmd']}`", "",
             f"device: {meta.get('device')}", "", f"environment: `{meta.get('env')}`", ""]
    lines += ["| section | fmt | batch | prefill tok/s | decode tok/s | note |", "|---|---|---|---|---|---|"]
    for r in RESULTS["runs"]:
        if r["section"] in ("stock", "engine", "engine-off", "loop") and "batch" in r:
            pf = r.get("prefill_tps")
            dec = r.get("decode_tps")
            note = r.get("mode", "") or r.get("skipped", "") or r.get("error", "")
            if r.get("prefill_tps_alone"):
                note = f"prefill alone, median of {len(r['prefill_tps_alone_runs'])}: {r['prefill_tps_alone']:,.0f} {note}"
            lines.append(f"| {r['section']} | {r.get('fmt')} | {r.get('batch')} | "
                         f"{pf:,.0f} | {dec:,.0f} | {note} |" if pf and dec else
                         f"| {r['section']} | {r.get('fmt')} | {r.get('batch')} | - | - | {note} {r.get('error', '')} |")
    lines += ["", "Kernel rows (µs):", "", "```"]
    lines += [json.dumps(r) for r in RESULTS["runs"] if r["section"] == "kernels"]
    lines += ["```", "", "Bandwidth floors (tok/s, 4.3 TB/s, 576-token contexts):", "", "```",
              json.dumps(meta.get("floors"), indent=1), "```"]
    (out_dir / "gpu_decode_run.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="kernels,stock,engine,loop")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    ap.add_argument("--kernel-parts", default="qmv,attention",
                    help="which kernel rows: qmv (NVRTC-heavy: row buckets 1/4/16) and/or attention")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,4,16,64,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill-reps", type=int, default=5,
                    help="engine: rounds of prefill alone (one token each) per batch size; the median is reported")
    ap.add_argument("--stock-steps", type=int, default=8)
    ap.add_argument("--stock-max-batch-4bit", type=int, default=64)
    ap.add_argument("--stock-formats", default="4bit,fp16",
                    help="4bit costs minutes of NVRTC compiles of MLX's CUTLASS GEMM per tile shape")
    ap.add_argument("--loop-formats", default="dual,dense")
    ap.add_argument("--engine-weights", default="auto", choices=("auto", *linear.FORMATS),
                    help="weight format the engine sections serve (auto: per backend)")
    ap.add_argument("--section-timeout", type=int, default=0,
                    help="run each section in its own process, killed after this many seconds "
                         "(a hung kernel then costs one section, not the run); 0 = in process")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks"))
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test: a small model; without CUDA only engine/stock run, the "
                         "engine on the kernels' pure-mx references")
    args = ap.parse_args()
    global TINY
    TINY = args.tiny
    if not qm.cuda_available() and not TINY:
        log("no CUDA device: this benchmark measures the CUDA kernels; nothing to do")
        return 2
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    secs = args.sections.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    meta = {"env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "TANDEM_"))},
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cmd": " ".join(sys.argv), "mlx": mx.__version__, "layers": args.layers,
            "prompt": args.prompt, "steps": args.steps, "floors": floors(args.layers)}
    try:
        meta["device"] = str(mx.device_info()) if hasattr(mx, "device_info") else "cuda"
    except Exception as exc:  # noqa: BLE001
        meta["device"] = f"cuda ({exc})"
    out_dir = Path(args.out)
    t_all = time.perf_counter()

    def guarded(name, fn, *a):
        t = time.perf_counter()
        try:
            fn(*a)
        except Exception as exc:  # noqa: BLE001 - keep the other sections' numbers
            traceback.print_exc()
            record(name, error=f"{type(exc).__name__}: {exc}"[:500])
        log(f"-- {name} took {time.perf_counter() - t:.1f} s")
        write_docs(out_dir, meta)

    if args.section_timeout > 0:
        run_isolated(args, secs, out_dir, meta)
        summary(RESULTS)
        return 0

    fp16 = q4 = None
    for sec in secs:  # in the order given: the first sections survive a time limit
        if sec == "kernels":
            guarded("kernels", section_kernels, args.quick, args.kernel_parts)
            continue
        if fp16 is None:
            t = time.perf_counter()
            fp16, q4 = build_models(args.layers)
            log(f"models built in {time.perf_counter() - t:.1f} s: fp16 {nbytes(fp16) / 2**30:.1f} GiB, "
                f"4-bit {nbytes(q4) / 2**30:.1f} GiB")
        if sec == "stock":
            models = {"4bit": q4, "fp16": fp16}
            guarded("stock", section_stock, {f: models[f] for f in args.stock_formats.split(",")},
                    batches, args.prompt, args.stock_steps, args.stock_max_batch_4bit)
        elif sec == "loop":
            guarded("loop", section_loop, fp16, q4, batches, args.prompt, args.steps,
                    args.loop_formats.split(","))
        elif sec in ("engine", "engine-off"):
            guarded(sec, section_engine, fp16, q4, args.layers, batches, args.prompt,
                    args.steps, "cuda" if sec == "engine" else "off", args.engine_weights,
                    args.prefill_reps)
    log(f"total {time.perf_counter() - t_all:.1f} s")
    write_docs(out_dir, meta)
    summary(RESULTS)
    return 0


def run_isolated(args, secs: list[str], out_dir: Path, meta: dict) -> None:
    """Each section in a child process with a deadline; the children's rows are merged."""
    import subprocess
    skip = {"--sections", "--out", "--section-timeout"}
    rest, argv = [], sys.argv[1:]
    i = 0
    while i < len(argv):
        key = argv[i].split("=")[0]
        if key in skip:
            i += 1 if "=" in argv[i] else 2
            continue
        rest.append(argv[i])
        i += 1
    for sec in secs:
        child_out = out_dir / f"part-{sec}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--sections", sec,
               "--out", str(child_out), *rest]
        t = time.perf_counter()
        try:
            subprocess.run(cmd, timeout=args.section_timeout, check=False)
        except subprocess.TimeoutExpired:
            record(sec, error=f"section killed after {args.section_timeout} s (hung kernel or "
                              "NVRTC compile); rows before that are kept")
        log(f"-- {sec} (child) took {time.perf_counter() - t:.1f} s")
        part = child_out / "gpu_decode.json"
        if part.exists():
            RESULTS["runs"].extend(json.loads(part.read_text()).get("runs", []))
        write_docs(out_dir, meta)


def summary(res: dict) -> None:
    log("\n=== summary (tok/s) ===")
    for r in res["runs"]:
        if r["section"] in ("stock", "engine", "engine-off", "loop") and "batch" in r:
            log(f"{r['section']:7s} {str(r.get('fmt')):6s} B={str(r.get('batch')):4s} "
                f"prefill={r.get('prefill_tps') or 0:10.0f} decode={r.get('decode_tps') or 0:9.0f} "
                + (f"prefill alone (median)={r['prefill_tps_alone']:8.0f} " if r.get("prefill_tps_alone") else "")
                + (f"tick: host {r['tick_host_ms_p50']:.2f} ms (forward {r['tick_forward_ms_p50']:.2f}, "
                   f"encode {r['tick_encode_ms_p50']:.2f}), device wait {r['tick_wait_ms_p50']:.2f} ms "
                   if r.get("tick_forward_ms_p50") is not None else "")
                + (f"prefill ms {r['prefill_ms_p50']} " if r.get("prefill_ms_p50") else "")
                + f"{r.get('mode', '')}{r.get('error', '')}")


if __name__ == "__main__":
    sys.exit(main())
