"""Where a CUDA decode step's time goes under MLX: per-op floors and a kernel trace.

Prints (and writes ``gpu_probe.json`` under ``--out``):

* ``floor``: the wall time per op of a chain of N dependent ops, evaluated once, for a
  built-in elementwise op, a trivial ``mx.fast.cuda_kernel``, the multirow 4-bit product,
  ``mx.quantized_matmul`` and an fp16 matmul at 1 x 4096 x 4096. A floor far above the
  op's bytes / bandwidth means launches, not memory, bound single-stream decode.
* ``trace``: CUDA kernel records (CUPTI through ``torch.profiler``, which sees every
  kernel the process launches, MLX's included) for a few decode steps of the kernel loop
  of ``bench/gpu_decode.py`` at batch 1 and 64 with a few layers: time per kernel name,
  GPU busy time against the wall time, and the gaps between kernels.
* ``graph-replay``: the captured one-row step (``pipeline/runners/cuda/graph_step.py``) replayed with
  no engine around it, queued back to back and waited for one at a time.

(Other sections: see ``main``.) Needs the GPU machine (MLX on CUDA); ``torch`` only for the trace.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # _common, also where a test loads this file

import tandem  # noqa: F401,E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from tandem.kernels.cuda import quantized_matmul as qm  # noqa: E402
from _common import Patches  # noqa: E402  (bench/ is first on sys.path when this runs as a script)

RESULTS: dict = {}


def log(msg: str) -> None:
    print(msg, flush=True)


def chain_time(fn, x, n: int) -> tuple[float, float]:
    """(graph-building seconds, evaluation seconds) per op of an n-op dependent chain."""
    y = x
    for _ in range(8):
        y = fn(y)
    mx.eval(y)
    mx.synchronize()
    best_b, best_e = 1e9, 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        y = x
        for _ in range(n):
            y = fn(y)
        t1 = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        t2 = time.perf_counter()
        best_b, best_e = min(best_b, (t1 - t0) / n), min(best_e, (t2 - t1) / n)
    return best_b, best_e


_TRIVIAL = None


def trivial_kernel(x):
    global _TRIVIAL
    if _TRIVIAL is None:
        _TRIVIAL = mx.fast.cuda_kernel(
            name="probe_add", input_names=["x"], output_names=["y"],
            source="const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                   "if (i < x_shape[0] * x_shape[1]) y[i] = x[i] + (T)1;")
    (y,) = _TRIVIAL(inputs=[x], template=[("T", x.dtype)], grid=(x.size, 1, 1),
                    threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])
    return y


def section_floor(n: int) -> None:
    K = 4096
    x = mx.random.normal((1, K)).astype(mx.float16)
    w = (mx.random.normal((K, K)) * 0.02).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    mx.eval(x, w, wq, s, b)
    cases = {
        "builtin x + 1": lambda y: y + 1,
        "custom kernel x + 1": trivial_kernel,
        "multirow 4-bit 4096x4096": lambda y: qm.quantized_matmul_cuda(y, wq, s, b, 64, 4) * 0.01,
        "multirow 4-bit, no scaling op": lambda y: qm.quantized_matmul_cuda(y, wq, s, b, 64, 4),
        "mx.quantized_matmul 4096x4096": lambda y: mx.quantized_matmul(y, wq, s, b, transpose=True,
                                                                       group_size=64, bits=4),
        "fp16 matmul 4096x4096": lambda y: y @ w.T,
    }
    RESULTS["floor"] = []
    log(f"\n== per-op floor: chains of {n} dependent ops, best of 3")
    log(f"{'op':34s} {'build us/op':>12s} {'eval us/op':>11s}")
    for name, fn in cases.items():
        bt, et = chain_time(fn, x, n)
        RESULTS["floor"].append({"op": name, "build_us": bt * 1e6, "eval_us": et * 1e6})
        log(f"{name:34s} {bt * 1e6:12.1f} {et * 1e6:11.1f}")


def timed(fn, iters: int = 50) -> float:
    """Seconds per call of ``iters`` independent calls queued and evaluated once."""
    mx.eval(fn())
    mx.synchronize()
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        outs = [fn() for _ in range(iters)]
        mx.eval(outs)
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def gpu_us(fn, match: str, iters: int = 20, serial: bool = False) -> float:
    return gpu_us_by(fn, (match,), iters, serial)[0]


def _profiled_kernels(fn, iters: int, serial: bool) -> list[dict]:
    """CUPTI kernel records of ``iters`` calls of ``fn`` after one warm-up call: one call at
    a time (``serial``; independent calls in one graph may overlap) or all queued at once.
    Raises ImportError without torch."""
    from torch.profiler import ProfilerActivity, profile
    mx.eval(fn())
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if serial:
            for _ in range(iters):
                mx.eval(fn())
        else:
            mx.eval([fn() for _ in range(iters)])
        mx.synchronize()
    path = Path("/tmp/gpu_probe_kernel_trace.json")
    prof.export_chrome_trace(str(path))
    return kernel_records(path)


def gpu_us_by(fn, matches: tuple[str, ...], iters: int = 20, serial: bool = False,
              median: bool = False) -> list[float]:
    """GPU time per call (CUPTI, us): for each of ``matches``, the kernels whose name contains it, summed
    over ``iters`` calls, divided by ``iters`` (``median``: the median kernel); nan without torch. Wall time per queued call includes MLX's per-op
    cost (~7 us for a custom kernel, ``floor``), which hides a small kernel's own time."""
    try:
        recs = _profiled_kernels(fn, iters, serial)
    except ImportError:
        return [float("nan")] * len(matches)
    out = []
    for match in matches:
        durs = [e["dur"] for e in recs if match in e["name"]]
        out.append((float(np.median(durs)) if median else float(sum(durs)) / iters) if durs else float("nan"))
    return out


def one_row_case(n: int, k: int) -> tuple[mx.array, ...]:
    """Random 4-bit (group 64) weights (n, k), their byte count, and one fp16 input row."""
    w = (mx.random.normal((n, k)) / k**0.5).astype(mx.float16)
    wq, sc, bi = mx.quantize(w, group_size=64, bits=4)
    del w
    x = mx.random.normal((1, k)).astype(mx.float16)
    mx.eval(wq, sc, bi, x)
    return wq, sc, bi, x, wq.nbytes + sc.nbytes + bi.nbytes


def section_qgemv() -> None:
    """The one-row 4-bit kernel at the 8B model's products, 1-4 rows per warp, and the rms
    norm staged inside the kernel against ``mx.fast.rms_norm`` first. (Run 19 also
    measured a persistent grid, warps looping over row groups with the next group's
    weights loading while one computes: slower everywhere, 47-68 us for gate/up against
    44 with a warp per group, and removed.)"""
    from tandem.kernels.cuda import qgemv as qg
    RESULTS["qgemv"] = []
    log("\n== one-row 4-bit products (us per call, 50 queued; gpu: CUPTI kernel time)")
    log(f"{'product':34s} {'grid':>18s} {'wall':>8s} {'gpu':>7s} {'TB/s':>6s} {'rel err':>8s}")
    mx.random.seed(0)
    for name, n, k, kind in [("qkv 6144x4096 +norm", 6144, 4096, "norm"),
                             ("o 4096x4096 +res", 4096, 4096, "res"),
                             ("gate/up 28672x4096 +norm swiglu", 28672, 4096, "pair"),
                             ("down 4096x14336 +res", 4096, 14336, "res")]:
        wq, sc, bi, x, nbytes = one_row_case(n, k)
        g = (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)
        n_out = n // 2 if kind == "pair" else n
        res = mx.random.normal((1, n_out)).astype(mx.float16)
        kw = dict(norm_weight=g if kind in ("norm", "pair") else None,
                  residual=res if kind in ("res", "pair") else None)
        want = qg.qgemv_reference(x, wq, sc, bi, 64, pair=kind == "pair", **kw)
        variants = [(f"R{r}", r, False) for r in (1, 2, 4)]
        if kw["norm_weight"] is not None:
            variants.append(("R2 normfirst", 2, True))
        for label, rows, norm_first in variants:
            kv = dict(kw, rows_override=rows)
            if norm_first:
                kv["norm_weight"] = None
                fn = lambda kv=kv: qg.qgemv(mx.fast.rms_norm(x, g, 1e-5), wq, sc, bi, 64,  # noqa: E731
                                            pair=kind == "pair", **kv)
            else:
                fn = lambda kv=kv: qg.qgemv(x, wq, sc, bi, 64, pair=kind == "pair", **kv)  # noqa: E731
            try:
                got = fn()
                err = (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
                       / (mx.abs(want.astype(mx.float32)).max() + 1e-6)).item()
                t = timed(fn)
                gpu = gpu_us(fn, "tandem_qgemv")
            except Exception as e:  # noqa: BLE001 - a failed variant must not cost the rest
                log(f"{name:34s} {label:>18s} failed: {type(e).__name__}: {e}"[:400])
                continue
            RESULTS["qgemv"].append({"product": name, "variant": label, "wall_us": t * 1e6,
                                     "gpu_us": gpu, "bytes": nbytes, "rel_err": err})
            log(f"{name:34s} {label:>18s} {t * 1e6:8.1f} {gpu:7.1f} {nbytes / gpu / 1e6:6.2f} {err:8.1e}")
        del wq, sc, bi
        mx.clear_cache()


def section_qgemv_stream(shapes_spec: str) -> None:
    """The streaming one-row kernel (lane-fixed K chunks, P passes of H rows per block)
    against the staged kernel, at the 8B model's products; its nibble unpackings, a
    loads-only variant (the bandwidth this structure reaches), and for the products after
    a norm, ``mx.fast.rms_norm`` + the kernel (both kernels' times) against the norm fused."""
    from tandem.kernels.cuda import qgemv as qg
    RESULTS["qgemv_stream"] = []
    shapes = [tuple(int(v) for v in spec.split("x")) for spec in shapes_spec.split(",")]
    log("\n== one-row 4-bit products: staged vs streaming (us; gpu: CUPTI kernel time, one call at a time)")
    log(f"{'product':26s} {'variant':>12s} {'wall':>8s} {'gpu':>7s} {'TB/s':>6s} {'rel err':>8s}")
    mx.random.seed(0)
    for name, n, k, kind in [("qkv 6144x4096", 6144, 4096, "plain"),
                             ("o 4096x4096 +res", 4096, 4096, "res"),
                             ("gate/up 28672x4096 swiglu", 28672, 4096, "pair"),
                             ("down 4096x14336 +res", 4096, 14336, "res")]:
        wq, sc, bi, x, nbytes = one_row_case(n, k)
        n_out = n // 2 if kind == "pair" else n
        res = mx.random.normal((1, n_out)).astype(mx.float16) if kind == "res" else None
        pair = kind == "pair"
        want = qg.qgemv_reference(x, wq, sc, bi, 64, pair=pair, residual=res)
        variants = [("staged R2", lambda: qg.qgemv(x, wq, sc, bi, 64, pair=pair, residual=res, rows_override=2))]
        for cpl, h, passes in shapes:
            if (k // 32) % (32 * cpl) or (pair and h < 2):
                continue
            variants.append((f"c{cpl} h{h} p{passes}",
                             lambda shape=(cpl, h, passes): qg.qgemv_stream(x, wq, sc, bi, pair=pair,
                                                                             residual=res, shape=shape)))
        variants += [
            ("default u1", lambda: qg.qgemv_stream(x, wq, sc, bi, pair=pair, residual=res, unpack=1)),
            ("loads only", lambda: qg.qgemv_stream(x, wq, sc, bi, pair=pair, residual=res, loads_only=True)),
        ]
        norm_cases = []
        if kind in ("plain", "pair"):
            g = (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)
            want_n = qg.qgemv_reference(x, wq, sc, bi, 64, pair=pair, norm_weight=g)
            norm_cases = [
                ("norm first", lambda: qg.qgemv_stream(mx.fast.rms_norm(x, g, 1e-5), wq, sc, bi, pair=pair)),
                ("norm fused", lambda: qg.qgemv_stream(x, wq, sc, bi, pair=pair, norm_weight=g)),
                ("norm fused u1", lambda: qg.qgemv_stream(x, wq, sc, bi, pair=pair, norm_weight=g, unpack=1)),
            ]
        for label, fn in variants + norm_cases:
            try:
                got = fn()
                ref = want_n if label.startswith("norm") else want
                err = (mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max()
                       / (mx.abs(ref.astype(mx.float32)).max() + 1e-6)).item()
                t = timed(fn)
                gpu = gpu_us(fn, "", serial=True) if label == "norm first" else gpu_us(fn, "tandem_qgemv", serial=True)
            except Exception as e:  # noqa: BLE001 - a failed variant must not cost the rest
                log(f"{name:26s} {label:>12s} failed: {type(e).__name__}: {e}"[:400])
                continue
            RESULTS["qgemv_stream"].append({"product": name, "variant": label, "wall_us": t * 1e6,
                                            "gpu_us": gpu, "bytes": nbytes, "rel_err": err})
            log(f"{name:26s} {label:>12s} {t * 1e6:8.1f} {gpu:7.1f} {nbytes / gpu / 1e6:6.2f} {err:8.1e}")
        del wq, sc, bi
        mx.clear_cache()


def _product_weights(n: int, k: int):
    """A random (n, k) product's 4-bit g64 weights and their dequantized fp16 copy (what
    the dense GEMM multiplies in ``dual``): (wq, scales, biases, dense)."""
    w = (mx.random.normal((n, k)) / k**0.5).astype(mx.float16)
    wq, sc, bi = mx.quantize(w, group_size=64, bits=4)
    return wq, sc, bi, mx.dequantize(wq, sc, bi, group_size=64, bits=4).astype(mx.float16)


def section_w4mma(rows_list=(8, 16, 32, 64), products: str = "qkv,o,gate/up,down") -> None:
    """The tensor-core 4-bit product against the dense fp16 GEMM it would replace and MLX's
    own 4-bit GEMM, at the 8B model's products and decode batch sizes; and its K split."""
    from tandem.kernels.cuda import w4mma
    RESULTS["w4mma"] = []
    log("\n== 4-bit tensor-core products (us per call, 50 queued; gpu: CUPTI time of all kernels, one call at a time)")
    log(f"{'product':22s} {'rows':>4s} {'variant':>10s} {'wall':>8s} {'gpu':>7s} {'TB/s':>6s} {'rel err':>8s}")
    mx.random.seed(0)
    for name, n, k in [("qkv 6144x4096", 6144, 4096), ("o 4096x4096", 4096, 4096),
                       ("gate/up 28672x4096", 28672, 4096), ("down 4096x14336", 4096, 14336)]:
        if name.split()[0] not in products.split(","):
            continue
        wq, sc, bi, wd = _product_weights(n, k)
        mx.eval(wq, sc, bi, wd)
        qbytes = wq.nbytes + sc.nbytes + bi.nbytes
        for m in rows_list:
            x = mx.random.normal((m, k)).astype(mx.float16)
            mx.eval(x)
            want = w4mma.w4_matmul_reference(x, wq, sc, bi, 64)
            ks = w4mma.k_splits(n, k, next(b for b in (1, 2, 4, 8) if 8 * b >= m))
            variants = [("fp16", lambda x=x: x @ wd.T, wd.nbytes),
                        ("mlx4bit", lambda x=x: mx.quantized_matmul(x, wq, sc, bi, transpose=True,
                                                                   group_size=64, bits=4), qbytes)]
            for split in sorted({1, max(1, ks // 2), ks, ks * 2}):
                variants.append((f"w4 ks{split}", lambda x=x, split=split: w4mma.w4_matmul(
                    x, wq, sc, bi, 64, splits=split), qbytes))
            variants.append((f"loads ks{ks}", lambda x=x: w4mma.w4_matmul(
                x, wq, sc, bi, 64, splits=ks, loads_only=True), qbytes))
            for label, fn, nbytes in variants:
                try:
                    got = fn()
                    err = float("nan") if label.startswith("loads") else (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
                           / (mx.abs(want.astype(mx.float32)).max() + 1e-6)).item()
                    t = timed(fn)
                    gpu = gpu_us(fn, "", serial=True)  # every kernel of a call: fill and cast too
                except Exception as e:  # noqa: BLE001 - a failed variant must not cost the rest
                    log(f"{name:22s} {m:4d} {label:>10s} failed: {type(e).__name__}: {e}"[:600])
                    continue
                RESULTS["w4mma"].append({"product": name, "rows": m, "variant": label, "wall_us": t * 1e6,
                                         "gpu_us": gpu, "bytes": nbytes, "rel_err": err})
                bw = nbytes / gpu / 1e6
                log(f"{name:22s} {m:4d} {label:>10s} {t * 1e6:8.1f} {gpu:7.1f} {bw:6.2f} {err:8.1e}")
        del wq, sc, bi, wd
        mx.clear_cache()


def _cold_gpu_us(fn, flush, flush_names: set[str], iters: int = 10) -> float:
    """GPU time of one call of ``fn`` (CUPTI: every kernel it launches, summed), each call
    after ``flush`` (1 GiB read: the L2 holds none of the call's inputs, as in a decode
    step where every layer's weights are read once). The flush's own kernels are left out."""
    from torch.profiler import ProfilerActivity, profile
    mx.eval(fn())
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            mx.eval(flush())
            mx.eval(fn())
        mx.synchronize()
    path = Path("/tmp/gpu_probe_kernel_trace.json")
    prof.export_chrome_trace(str(path))
    return sum(e["dur"] for e in kernel_records(path) if e["name"] not in flush_names) / iters


HID, FFN, NQKV = 4096, 14336, 6144  # the 8B shape's hidden, FFN and fused QKV widths


def _one_row_layers(layers: int):
    """``layers`` layers of distinct 4-bit one-row tail weights at the 8B shape (o, gate/up,
    down, QKV, the two norms), an attention output and a residual row, evaluated."""
    def q(n, k):
        return one_row_case(n, k)[:3]
    ws = [dict(o=q(HID, HID), gu=q(2 * FFN, HID), down=q(HID, FFN), qkv=q(NQKV, HID),
               ln2=(1 + 0.1 * mx.random.normal((HID,))).astype(mx.float16),
               ln1=(1 + 0.1 * mx.random.normal((HID,))).astype(mx.float16)) for _ in range(layers)]
    a0 = mx.random.normal((1, HID)).astype(mx.float16)
    h0 = (4 * mx.random.normal((1, HID))).astype(mx.float16)
    mx.eval(ws, a0, h0)
    return ws, a0, h0


def _one_row_chain(ws, a0, h0):
    """The separate one-row kernels over the layers: o + residual, norm + gate/up + swiglu,
    down + residual, the next norm + QKV (its first HID columns stand in for attention)."""
    from tandem.kernels.cuda import qgemv as qg
    a, h = a0, h0
    for w in ws:
        h2 = qg.qgemv(a, *w["o"], 64, residual=h)
        g = qg.qgemv(h2, *w["gu"], 64, norm_weight=w["ln2"], pair=True)
        h = qg.qgemv(g, *w["down"], 64, residual=h2)
        a = qg.qgemv(h, *w["qkv"], 64, norm_weight=w["ln1"])[:, :HID]
    return h


def section_decode_block(layers: int = 8) -> None:
    """A one-row layer tail (o + residual, norm, gate/up + swiglu, down + residual, the next
    layer's norm + QKV) at the 8B shape, over ``layers`` layers of distinct weights (1 GB
    for 8: every call reads them from memory): the separate kernels against
    ``decode_block``'s one launch a layer. GPU: CUPTI, every kernel summed, per layer; wall:
    queued calls, per layer (MLX's per-op cost included)."""
    from tandem.kernels.cuda import decode_block as db
    ws, a0, h0 = _one_row_layers(layers)
    bar = db.counter()

    def separate():
        return _one_row_chain(ws, a0, h0)

    def fused(rows=None, stages=None, probe=0):
        a, h = a0, h0
        for w in ws:
            h, y = db.decode_block(a, h, w["o"], w["ln2"], w["gu"], w["down"], w["ln1"], w["qkv"],
                                   eps2=1e-5, bar=bar, rows=rows, stages=stages, probe=probe)
            a = y[:, :HID]
        return h

    want, got = separate().astype(mx.float32), fused().astype(mx.float32)
    err = (mx.abs(want - got).max() / mx.abs(want).max()).item()
    log(f"decode_block: {layers} chained layers, max rel diff against the separate kernels {err:.2e}")
    RESULTS["decode_block"] = rows_out = []
    variants = [("separate kernels", separate), ("block: barriers only", lambda: fused(probe=1))] + [
        (f"decode_block r{r} s{s}", (lambda r=r, s=s: fused(r, s))) for r, s in ((4, 5), (8, 2))]
    # Where a launch's time goes: per block, the global timer at its start and after each
    # phase and barrier (PROBE 3), medians over blocks and 8 layers' launches.
    stamps = []
    a, h = a0, h0
    for w in ws:
        h, ts = db.decode_block(a, h, w["o"], w["ln2"], w["gu"], w["down"], w["ln1"], w["qkv"], eps2=1e-5,
                                bar=bar, probe=3)
        mx.eval(h, ts)
        stamps.append(np.array(ts).reshape(-1, 8).astype(np.int64))
    names = ["A o", "barrier 1", "B gate/up", "barrier 2", "C down", "barrier 3", "D qkv"]
    spans = np.concatenate([np.diff(t - t.min(), axis=1) for t in stamps]) / 1e3
    starts = np.concatenate([(t[:, 0] - t[:, 0].min()) for t in stamps]) / 1e3
    phase = {n: dict(p50_us=float(np.median(spans[:, i])), max_us=float(spans[:, i].max()),
                     min_us=float(spans[:, i].min())) for i, n in enumerate(names)}
    RESULTS["decode_block_phases"] = dict(phases=phase, start_spread_us=float(starts.max()))
    log(f"  phases (us, min / median / max over blocks): start spread {starts.max():.1f}; " + "; ".join(
        f"{n} {v['min_us']:.1f} / {v['p50_us']:.1f} / {v['max_us']:.1f}" for n, v in phase.items()))
    for label, fn in variants:
        try:
            wall = timed(fn, 10) * 1e6 / layers
            gpu = gpu_us_by(fn, ("",), iters=5, serial=True)[0] / layers
        except Exception as e:  # noqa: BLE001 - a variant that fails to launch is a result too
            log(f"  {label}: {type(e).__name__}: {e}")
            continue
        rows_out.append(dict(variant=label, gpu_us_per_layer=gpu, wall_us_per_layer=wall))
        log(f"  {label:24s} GPU {gpu:7.1f} us/layer   wall {wall:7.1f} us/layer")


def _kernel_us_by_label(fn, iters: int = 5) -> dict[str, float]:
    """GPU us per call of ``fn`` for each kernel label (name with template arguments),
    CUPTI, ``iters`` calls one at a time."""
    by: dict[str, float] = {}
    for e in _profiled_kernels(fn, iters, serial=True):
        key = kernel_label(e["name"], 120)
        by[key] = by.get(key, 0.0) + e["dur"] / iters
    return by


QGEMV_CHAIN_VARIANTS = [
    # label, small shape (QKV, o), narrow (gate/up), wide (down): qgemv.SHAPE_*
    ("defaults", (1, 8, 1), (1, 8, 1), (1, 4, 4)),
    ("small 1x8x2", (1, 8, 2), (1, 8, 1), (1, 4, 4)),
    ("small 1x4x2", (1, 4, 2), (1, 8, 1), (1, 4, 4)),
    ("small 1x4x4", (1, 4, 4), (1, 8, 1), (1, 4, 4)),
    ("narrow 1x8x2", (1, 8, 1), (1, 8, 2), (1, 4, 4)),
    ("narrow 1x4x2", (1, 8, 1), (1, 4, 2), (1, 4, 4)),
    ("wide 1x2x8", (1, 8, 1), (1, 8, 1), (1, 2, 8)),
    ("wide 1x8x2", (1, 8, 1), (1, 8, 1), (1, 8, 2)),
    ("wide 1x4x2", (1, 8, 1), (1, 8, 1), (1, 4, 2)),
]
"""(H200 run 97 also timed L2 bulk prefetches, ``cp.async.bulk.prefetch.L2``, of a block's
later passes and of the block a resident wave ahead: slower everywhere, 62.8-72.7 us a
layer against 57.9; removed.)"""


def section_qgemv_chain(layers: int = 8, only: str = "") -> None:
    """The one-row layer products (o + residual, norm + gate/up + swiglu, down + residual,
    norm + QKV) chained over ``layers`` layers of distinct weights (1 GB for 8, so each
    product reads its weights from memory as in a decode step), for block shapes of the
    streaming kernel. GPU us a layer (CUPTI), per product and summed; every variant's
    result against the defaults'."""
    from tandem.kernels.cuda import qgemv as qg
    ws, a0, h0 = _one_row_layers(layers)

    def chain():
        return _one_row_chain(ws, a0, h0)

    saved = (qg.SHAPE_SMALL, qg.SHAPE_NARROW, qg.SHAPE_WIDE, qg.STREAM_SHAPE)
    RESULTS["qgemv_chain"] = rows = []
    log(f"\n== one-row products chained over {layers} layers (GPU us a layer, CUPTI; max rel diff to defaults)")
    want = None
    try:
        qg.STREAM_SHAPE = None
        for label, small, narrow, wide in QGEMV_CHAIN_VARIANTS:
            if only and only not in label:
                continue
            qg.SHAPE_SMALL, qg.SHAPE_NARROW, qg.SHAPE_WIDE = small, narrow, wide
            try:
                got = chain().astype(mx.float32)
                if want is None:
                    want = got
                err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
                by = _kernel_us_by_label(chain)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                log(f"  {label}: {type(e).__name__}: {e}"[:400])
                continue
            total = sum(by.values()) / layers
            parts = {k: v / layers for k, v in sorted(by.items(), key=lambda kv: -kv[1])}
            rows.append(dict(variant=label, small=small, narrow=narrow, wide=wide, gpu_us_per_layer=total,
                             rel_diff=err, kernels=parts))
            log(f"  {label:30s} {total:7.1f} us/layer  diff {err:.1e}  | " + "; ".join(
                f"{k[:70]} {v:.1f}" for k, v in parts.items()))
    finally:
        qg.SHAPE_SMALL, qg.SHAPE_NARROW, qg.SHAPE_WIDE, qg.STREAM_SHAPE = saved


def section_w4gemm(rows_list=(16, 32, 64, 128), products: str = "qkv,o,gate/up,down,head",
                   parts: bool = False) -> None:
    """The fragment-order 4-bit product (``w4gemm``) against the dense fp16 GEMM it would
    replace and ``w4mma``, cold (a 1 GiB read before every call), at the 8B model's products;
    its K split, row tiles and pipeline depth."""
    from torch.profiler import ProfilerActivity, profile
    from tandem.kernels.cuda import w4gemm
    from tandem.kernels.cuda import w4mma
    RESULTS["w4gemm"] = []
    big = mx.ones((1 << 29,), mx.float16)
    flush = lambda: big.max()  # noqa: E731
    mx.eval(flush())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.eval(flush())
        mx.synchronize()
    prof.export_chrome_trace("/tmp/gpu_probe_flush.json")
    flush_names = {e["name"] for e in kernel_records(Path("/tmp/gpu_probe_flush.json"))}
    log(f"\n== w4gemm, cold (us per call, CUPTI, all kernels of a call; flush kernels {sorted(flush_names)})")
    log(f"{'product':22s} {'rows':>4s} {'variant':>16s} {'gpu us':>8s} {'TB/s':>6s} {'TFLOPS':>7s} {'rel err':>8s}")
    mx.random.seed(0)
    for name, n, k in [("qkv 6144x4096", 6144, 4096), ("o 4096x4096", 4096, 4096),
                       ("gate/up 28672x4096", 28672, 4096), ("down 4096x14336", 4096, 14336),
                       ("head 128256x4096", 128256, 4096)]:
        if name.split()[0] not in products.split(","):
            continue
        wq, sc, bi, wd = _product_weights(n, k)
        wpb, sbpb = w4gemm.pack(wq, sc, bi, 64, w4gemm.WARPS * w4gemm.row_tiles(n))
        wp1, sbp1 = w4gemm.pack(wq, sc, bi, 64, w4gemm.WARPS)
        mx.eval(wq, sc, bi, wd, wpb, sbpb, wp1, sbp1)
        qbytes = wq.nbytes + sc.nbytes + bi.nbytes
        for m in rows_list:
            x = mx.random.normal((m, k)).astype(mx.float16)
            mx.eval(x)
            want = w4gemm.w4_gemm_reference(x, wq, sc, bi, 64).astype(mx.float32)
            variants = [("fp16", lambda x=x: x @ wd.T, wd.nbytes, {})]
            if m <= w4mma.MAX_ROWS:
                variants.append(("w4mma", lambda x=x: w4mma.w4_matmul(x, wq, sc, bi, 64), qbytes, {}))
            tb = w4gemm.WARPS * w4gemm.row_tiles(n)
            ks = w4gemm.k_splits(n, k, tb // w4gemm.WARPS)
            for split in sorted({ks, max(1, ks // 2), ks * 2}):
                variants.append((f"w4g blk ks{split}", lambda x=x, split=split: w4gemm.w4_gemm(
                    x, wpb, sbpb, 64, splits=split, block_tiles=tb), qbytes, {}))
            variants.append(("w4g blk rt1", lambda x=x: w4gemm.w4_gemm(x, wp1, sbp1, 64, block_tiles=w4gemm.WARPS),
                             qbytes, {}))
            variants.append(("w4g blk st6", lambda x=x: w4gemm.w4_gemm(x, wpb, sbpb, 64, block_tiles=tb),
                             qbytes, {"STAGES": 6}))
            if tb == 16:
                from tandem.kernels.cuda import w4wgmma
                variants.append(("wgmma split", lambda x=x: w4wgmma.w4_wgmma(x, wpb, sbpb, 64, balanced=False),
                                 qbytes, {}))
                variants.append(("wgmma balanced", lambda x=x: w4wgmma.w4_wgmma(x, wpb, sbpb, 64, balanced=True),
                                 qbytes, {}))
                variants.append(("wgmma bal 2blk", lambda x=x: w4wgmma.w4_wgmma(x, wpb, sbpb, 64, balanced=True,
                                                                              min_blocks=2), qbytes, {}))
                variants.append(("wgmma split 2blk", lambda x=x: w4wgmma.w4_wgmma(x, wpb, sbpb, 64, balanced=False,
                                                                                min_blocks=2), qbytes, {}))
                if ks >= 2:
                    variants.append(("wgmma ks/2", lambda x=x: w4wgmma.w4_wgmma(x, wpb, sbpb, 64, splits=ks // 2,
                                                                          balanced=False),
                                     qbytes, {}))
            for probe, what in ((1, "wg math only"), (4, "wg math no drain"), (2, "wg no dequant"),
                                (3, "wg loads only")) if parts and tb == 16 else ():
                variants.append((what, lambda x=x, probe=probe: w4wgmma.w4_wgmma(x, wpb, sbpb, 64, probe=probe),
                                 qbytes, {}))
            for probe, what in ((1, "math only"), (2, "no dequant"), (3, "loads only")) if parts else ():
                variants.append((what, lambda x=x, probe=probe: w4gemm.w4_gemm(x, wpb, sbpb, 64, block_tiles=tb,
                                                                             probe=probe), qbytes, {}))
            for label, fn, nbytes, patch in variants:
                saved = {a: getattr(w4gemm, a) for a in patch}
                try:
                    for a, v in patch.items():
                        setattr(w4gemm, a, v)
                    got = fn().astype(mx.float32)
                    err = (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()
                    if label.startswith("wg ") or label in ("math only", "no dequant", "loads only"):
                        err = float("nan")
                    gpu = _cold_gpu_us(fn, flush, flush_names)
                except Exception as e:  # noqa: BLE001 - a failed variant must not cost the rest
                    log(f"{name:22s} {m:4d} {label:>16s} failed: {type(e).__name__}: {e}"[:600])
                    continue
                finally:
                    for a, v in saved.items():
                        setattr(w4gemm, a, v)
                RESULTS["w4gemm"].append({"product": name, "rows": m, "variant": label, "gpu_us": gpu,
                                          "bytes": nbytes, "rel_err": err})
                log(f"{name:22s} {m:4d} {label:>16s} {gpu:8.1f} {nbytes / gpu / 1e6:6.2f} "
                    f"{2 * m * n * k / gpu / 1e6:7.1f} {err:8.1e}")
        del wq, sc, bi, wd, wpb, sbpb, wp1, sbp1
        mx.clear_cache()


def _probe_engine(layers: int, top: int, kernels: str = "cuda"):
    """The random-weight 8B-shape model (``layers`` layers, 4-bit with its dense copy) in an
    Engine for ``top`` rows, not started."""
    import os

    import mlx.nn as nn
    import gpu_decode as gd
    from mlx_lm.models import llama
    from tandem.kernels.cuda import linear
    from tandem.pipeline.engine import Engine
    from tandem.pipeline.settings import EngineSettings

    _, q4 = gd.build_models(layers)
    os.environ["TANDEM_PAGED_KERNELS"] = kernels
    model = llama.Model(gd.model_args(layers))
    nn.quantize(model, group_size=64, bits=4)
    model.update(q4.parameters())
    linear.prepare_model(model, "auto", memory_bytes=mx.device_info().get("memory_size"))
    mx.eval(model.parameters())
    mx.eval([l.self_attn.rope._freqs for l in model.model.layers if hasattr(l.self_attn.rope, "_freqs")])
    st = EngineSettings(parallel=top, max_batch_size=top, max_batch_prefill=8,
                        max_batch_prefill_tokens=linear.QUANTIZED_MAX_ROWS, prefill_chunk_size=512,
                        kv_cache_budget="24GiB", enable_prefix_caching=False, max_queue_depth=4 * top)
    return Engine(model, st, model_id="probe")


def section_step_replay(layers: int, batches: list[int], profile_forward: bool = False) -> None:
    """Per decode batch size: how often the engine traces its compiled decode step (once
    per (batch, table width) when replay works) and the engine thread's ``runner.forward``
    time a tick (the replay; a retrace costs milliseconds). Run 74 saw 4 ms forwards at
    batch 32 with ``w4gemm`` on 32 rows against 0.6 without it."""
    import os
    import threading

    import gpu_decode as gd
    from tandem.kernels.cuda import linear
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.runners.cuda import runner as cuda_runner
    from tandem.pipeline.api import EngineRequest

    traces = []
    graph = cuda_runner.KernelRunner._decode_graph

    def counted(self, inputs, *args):
        traces.append(inputs.shape[0])
        return graph(self, inputs, *args)

    cuda_runner.KernelRunner._decode_graph = counted
    # Without CUDA (a smoke test) the reference ops: uncompiled, so every step traces.
    eng = _probe_engine(layers, max(batches), "cuda" if cuda_runner.cuda_available() else "reference")
    forward, spent = eng.runner.forward, []

    def timed_forward(rows, inputs):
        t = time.perf_counter()
        try:
            return forward(rows, inputs)
        finally:
            if inputs.shape[1] == 1:
                spent.append((inputs.shape[0], time.perf_counter() - t))

    profiles: dict[int, object] = {}

    def profiled_forward(rows, inputs):
        # cProfile of the engine thread's forward calls, per batch size: whether the time is
        # tandem's Python or the compiled step's call into MLX.
        import cProfile
        if inputs.shape[1] != 1:  # prefill: not what is measured
            return timed_forward(rows, inputs)
        prof = profiles.setdefault(inputs.shape[0], cProfile.Profile())
        return prof.runcall(timed_forward, rows, inputs)

    eng.runner.forward = profiled_forward if profile_forward else timed_forward
    eng.start()
    vocab = gd._vocab()
    RESULTS.setdefault("step_replay", [])
    log(f"\n== decode step replay, {layers} layers, w4gemm rows {linear.W4G_ROWS}")
    try:
        for B in batches:
            del traces[:], spent[:]
            done = threading.Event()
            left = [B]

            def on_event(ev):
                if ev.finish_reason is not None:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            for _ in range(B):
                eng.submit(EngineRequest(os.urandom(16), np.random.randint(0, vocab, 512).tolist(),
                                         SamplingParams(max_tokens=40, ignore_eos=True), on_event))
            done.wait(240)
            full = [s for b, s in spent if b == B]
            rec = {"batch": B, "traces": len(traces), "traced_batches": sorted(set(traces)),
                   "steps": len(full), "forward_ms_p50": float(np.median(full)) * 1e3 if full else None,
                   "paths": linear.paths_used()}
            RESULTS["step_replay"].append(rec)
            log(f"B={B:3d}: {rec['traces']} traces {rec['traced_batches']}, {rec['steps']} steps at B, "
                f"forward p50 {rec['forward_ms_p50']:.2f} ms; paths {rec['paths']}")
            if B in profiles:
                import io
                import pstats
                text = io.StringIO()
                pstats.Stats(profiles[B], stream=text).sort_stats("tottime").print_stats(12)
                rec["profile"] = text.getvalue()
                log(text.getvalue())
    finally:
        eng.stop()
        cuda_runner.KernelRunner._decode_graph = graph


def _graph_engine(layers: int, key: str):
    """The probe engine for one row with the graph step on, and its GraphStep (None, and
    the reason in ``RESULTS[key + "_failed"]``, where it cannot run)."""
    from tandem.pipeline.runners.cuda import graph_step

    graph_step.ENABLED = True
    eng = _probe_engine(layers, 1)
    gs = eng.runner.graph_step
    if gs is None or gs.failed:
        RESULTS[key + "_failed"] = None if gs is None else gs.failed
        log(f"graph step unavailable: {RESULTS[key + '_failed']}")
        return eng, None
    return eng, gs


def section_graph_replay(layers: int, widths=(4, 48), reps: int = 200) -> None:
    """The captured one-row step (pipeline/runners/cuda/graph_step.py) replayed with no engine around it,
    captured without and with programmatic dependent launch (``TANDEM_GRAPH_PDL``), each
    capture checked against MLX's step as the engine's are: queued back to back (the GPU's
    own step time: the host queues ahead) and waited for one at a time (the latency a token
    would see with no pipelining). The context is 8 tokens short of the width; the table
    points every column at the scratch block (its K/V stay in L2) and, without PDL, also at
    distinct blocks, whose K/V the attention reads from memory as in the engine."""
    from tandem.pipeline.runners.cuda import graph_step

    RESULTS["graph_replay"] = rows = []
    eng, gs = _graph_engine(layers, "graph_replay")
    if gs is None:
        return
    drv, bs = gs.drv, eng.store.block_size
    log(f"\n== graph replay, {layers} layers, {len(gs._graphs)} widths captured at start")

    def replay_ms(g, wait_each: bool) -> float:
        t = time.perf_counter()
        for _ in range(reps):
            drv.call("cuGraphLaunch", g.exec, gs.stream)
            if wait_each:
                drv.call("cuStreamSynchronize", gs.stream)
        drv.call("cuStreamSynchronize", gs.stream)
        return (time.perf_counter() - t) / reps * 1e3

    for nb in widths:
        for pdl in (False, True):
            graph_step.PDL = pdl
            if nb in gs._graphs:
                gs._drop(nb)
            t0 = time.perf_counter()
            try:
                g = gs._graph(nb)
            except Exception as exc:  # a PDL capture that fails its check: say so, go on
                log(f"width {nb} pdl {pdl}: capture failed: {exc}")
                rows.append({"width": nb, "pdl": pdl, "failed": str(exc)})
                continue
            capture_ms = (time.perf_counter() - t0) * 1e3
            pos = nb * bs - 8
            # The scratch block in every column (its K/V stay in L2), then distinct blocks
            # as a sequence has them (the K/V come from memory, as in the engine).
            for blocks in ("scratch", "distinct"):
                if blocks == "distinct" and (pdl or eng.store.capacity <= nb):
                    continue
                if blocks == "distinct":
                    host, _ = eng.runner.decode_state([_sequence_row(nb, pos)])
                else:
                    host = graph_step.scratch_state(nb, pos, bs)
                drv.call("cuMemcpyHtoDAsync_v2", g.state_dev, host.ctypes.data, host.nbytes, gs.stream)
                replay_ms(g, False)  # warm
                queued, waited = replay_ms(g, False), replay_ms(g, True)
                rec = {"width": nb, "pdl": pdl, "blocks": blocks, "context": pos + 1, "capture_ms": capture_ms,
                       "queued_ms": queued, "waited_ms": waited, "queued_tps": 1e3 / queued,
                       "waited_tps": 1e3 / waited}
                rows.append(rec)
                log(f"width {nb:4d} (context {pos + 1:5d}) pdl {int(pdl)} {blocks:8s}: queued {queued:.3f} ms a "
                    f"step ({1e3 / queued:,.0f} tok/s), waited {waited:.3f} ms ({1e3 / waited:,.0f} tok/s); "
                    f"capture {capture_ms:.0f} ms")
            if not pdl:
                # GraphStep.launch as the engine calls it (state upload, replay, token
                # read-back a step behind), with host work between steps.
                for delay in (0, 100, 250):
                    ms = _graph_launch_pattern(gs, nb, bs, delay)
                    rows.append({"width": nb, "pdl": pdl, "pattern": "engine", "host_delay_us": delay,
                                 "step_ms": ms, "tps": 1e3 / ms})
                    log(f"width {nb:4d} launch() as the engine, {delay:3d} us host work a step: "
                        f"{ms:.3f} ms a token ({1e3 / ms:,.0f} tok/s)")


def _sequence_row(nb: int, start: int):
    """A one-row decode row at ``start`` whose sequence holds blocks 0..nb-1 (store blocks
    1..nb), as ``KernelRunner.decode_state`` reads it."""
    from types import SimpleNamespace

    return SimpleNamespace(start=start, n=1, seq=SimpleNamespace(block_ids=list(range(nb))))


def _graph_launch_pattern(gs, nb: int, bs: int, delay_us: float, steps: int = 200) -> float:
    """ms a token when ``GraphStep.launch`` is driven as the pipelined engine drives it:
    step N+1 queued with N's token still on the device, then N read back, then
    ``delay_us`` of host work (the engine's emit and schedule). Equal to the replay time
    at every delay when the GPU never waits for the thread."""
    start = (nb - 1) * bs  # the last column's first token: the table stays nb wide
    prev, last = mx.array(np.array([1], np.int32)), None
    t = None
    for i in range(steps + 10):
        if i == 10:
            t = time.perf_counter()  # after the first upload and the warm steps
        toks = gs.launch([_sequence_row(nb, start + i % 8)], prev)
        if last is not None:
            last.tolist()
        end = time.perf_counter() + delay_us * 1e-6
        while time.perf_counter() < end:
            pass
        last = prev = toks
    last.tolist()
    return (time.perf_counter() - t) / steps * 1e3


def section_graph_warmup(layers: int, nb: int = 48, steps: int = 80, plan_name: str = "causes") -> None:
    """Each captured one-row step's time (width ``nb``, distinct blocks), launched and waited
    for alone (~20 us more than queued), after each entry of a plan has run:

    - ``causes``: idle, GEMM bursts, every weight read, new K/V pools, SDPA, CUPTI and the
      context's limits before and after an engine prefill (H200 runs 113-116: only the
      engine's prefill slows the replays, 2.40 -> 2.47 ms, and for good);
    - ``remedies``: what might undo that afterwards (run 117: none of them);
    - ``components``: a prefill's parts one at a time, the cheapest first (not yet run).
    """
    import ctypes
    import os

    from tandem.pipeline.runners.cuda import graph_step

    RESULTS["graph_warmup"] = rows = []
    eng, gs = _graph_engine(layers, "graph_warmup")
    if gs is None:
        return
    drv, bs = gs.drv, eng.store.block_size
    host, _ = eng.runner.decode_state([_sequence_row(nb, (nb - 1) * bs)])
    cur = [None]

    def use_graph(owner=gs) -> None:
        # ``owner``'s graph of width nb (captured again where the pools changed) with the
        # distinct blocks' state in its buffer: what the timed steps replay from now on.
        cur[0] = owner._graph(nb)
        drv.call("cuMemcpyHtoDAsync_v2", cur[0].state_dev, host.ctypes.data, host.nbytes, gs.stream)
        drv.call("cuStreamSynchronize", gs.stream)

    use_graph()
    # One prefill's GEMM work (~10 ms of fp16 products at 512 rows, the prefill's power draw).
    x = mx.random.normal((512, 4096)).astype(mx.float16)
    w = mx.random.normal((14336, 4096)).astype(mx.float16) * 0.01
    mx.eval(x, w)

    def gemms(n: int = 120) -> None:
        y = x
        for _ in range(n):
            y = (y @ w.T)[:, :4096]
        mx.eval(y)

    def fill_pools(make) -> None:
        # New pool arrays (zeros or random K/V), and the graph captured again on them.
        store = eng.store
        store.keys[:] = [make(a.shape).astype(a.dtype) for a in store.keys]
        store.values[:] = [make(a.shape).astype(a.dtype) for a in store.values]
        mx.eval(store.keys, store.values)
        use_graph()

    def timed_steps() -> list[float]:
        g = cur[0]
        out = []
        for _ in range(steps):
            t = time.perf_counter()
            drv.call("cuGraphLaunch", g.exec, gs.stream)
            drv.call("cuStreamSynchronize", gs.stream)
            out.append((time.perf_counter() - t) * 1e3)
        return out

    from mlx.utils import tree_flatten
    from tandem.kvtypes import SamplingParams

    big = [a for _, a in tree_flatten(eng.model.parameters()) if a.size >= 1 << 22]

    def read_weights() -> None:
        # Every large array once, the prefill's dense fp16 copy included (~20 GB): the
        # decode's 4-bit weights lose whatever the TLB and L2 held of them.
        mx.eval([mx.sum(a.view(mx.uint8).astype(mx.uint32)) for a in big])

    def engine_prefill() -> None:
        # The engine's own prefill path (MLX's launches, its dense products and KV writes),
        # one fresh prompt that asks for one token: nothing of it decodes.
        eng.generate_many([(np.random.randint(0, 1000, 512).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))],
                          timeout=300)
        use_graph()  # the store may have grown: new pools, a new capture

    gemms()
    t = time.perf_counter()
    gemms()
    log(f"\n== graph warm-up, width {nb}, {layers} layers: one step at a time; the GEMM burst takes "
        f"{(time.perf_counter() - t) * 1e3:.1f} ms")
    lib = drv._lib

    def context_state() -> dict:
        # Context-wide settings a library may change for every kernel after it: the
        # limits (stack, heap, persisting L2 set-aside, ...) and the L1 / shared preference.
        out = {}
        for limit, name in ((0, "stack"), (1, "printf"), (2, "heap"), (3, "sync_depth"), (4, "pending_launches"),
                            (5, "max_l2_fetch_granularity"), (6, "persisting_l2")):
            v = ctypes.c_size_t()
            out[name] = v.value if lib.cuCtxGetLimit(ctypes.byref(v), limit) == 0 else None
        c = ctypes.c_int()
        out["cache_config"] = c.value if lib.cuCtxGetCacheConfig(ctypes.byref(c)) == 0 else None
        return out

    def cupti_replays(label: str, n: int = 20) -> None:
        from torch.profiler import ProfilerActivity, profile
        g = cur[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                drv.call("cuGraphLaunch", g.exec, gs.stream)
            drv.call("cuStreamSynchronize", gs.stream)
        path = Path(f"/tmp/graph_warmup_{label.replace(' ', '_')}.json")
        prof.export_chrome_trace(str(path))
        recs = sorted(kernel_records(path), key=lambda e: e["ts"])
        path.unlink()
        by: dict[str, float] = {}
        for e in recs:
            key = e["name"].split("(")[0][:40]
            by[key] = by.get(key, 0.0) + e["dur"] / n
        span = (recs[-1]["ts"] + recs[-1]["dur"] - recs[0]["ts"]) / n if recs else 0.0
        busy = sum(e["dur"] for e in recs) / n
        rows.append({"cupti": label, "span_us": span, "busy_us": busy, "by_name": by})
        log(f"CUPTI {label}: {span:.1f} us a step, {busy:.1f} busy; "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:5]))

    def show_context(label: str) -> None:
        st = context_state()
        rows.append({"context": label, **st})
        log(f"context {label}: {st}")

    def sdpa() -> None:
        q = mx.random.normal((1, 32, 512, 128)).astype(mx.float16)
        k = mx.random.normal((1, 8, 512, 128)).astype(mx.float16)
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.088, mask="causal"))

    def reset_context(target: dict) -> None:
        for limit, name in ((0, "stack"), (2, "heap"), (6, "persisting_l2")):
            if target.get(name) is not None:
                lib.cuCtxSetLimit(limit, ctypes.c_size_t(target[name]))
        if target.get("cache_config") is not None:
            lib.cuCtxSetCacheConfig(target["cache_config"])
        lib.cuCtxResetPersistingL2Cache()

    def new_graph_step() -> None:
        # A GraphStep of its own: another stream, other device buffers, the graph captured again.
        fresh = graph_step.GraphStep(eng.runner, drv)
        gs.stream = fresh.stream
        use_graph(fresh)
        keep.append(fresh)

    keep: list = []
    before_state = context_state()
    if plan_name == "remedies":
        # After an engine prefill the replays' kernel gaps grew by ~57 us a step and stayed
        # (CUPTI: busy 2,411 against 2,414 us, span 2,493 against 2,439; 2026-12-02): which
        # of these undoes it, if any. No CUPTI here: its callbacks stay and slow every step.
        plan = [
            ("hot", lambda: [timed_steps() for _ in range(3)]),
            ("an engine prefill, 512 tokens", engine_prefill),
            ("idle 1 s", lambda: time.sleep(1.0)),
            ("mx.clear_cache()", mx.clear_cache),
            ("gc, mx.synchronize()", lambda: (__import__("gc").collect(), mx.synchronize())),
            ("a new GraphStep (stream, buffers, capture)", new_graph_step),
            ("the engine stopped", eng.stop),
            ("hot again", lambda: [timed_steps() for _ in range(3)]),
        ]
    elif plan_name == "components":
        # The engine's prefill in parts, each alone, the cheapest first: the first part
        # after which the replay stays ~70 us slower is what the prefill leaves behind.
        def host_array() -> None:  # numpy data in managed memory, faulted in by one kernel
            mx.eval(mx.array(np.arange(1 << 20, dtype=np.int32)) + 1)

        def read_back() -> None:  # a host sync on a GPU result
            mx.argmax(mx.random.normal((1, 128256))).item()

        def rope_norm() -> None:  # MLX's built-in kernels a prefill uses: RoPE, norm, gather, casts
            xs = mx.random.normal((1, 512, 32, 128)).astype(mx.float16)
            rows = mx.random.randint(0, 512, (64,))
            mx.eval(mx.fast.rope(xs.transpose(0, 2, 1, 3), 128, traditional=False, base=500000.0, scale=1.0,
                                 offset=0),
                    mx.fast.rms_norm(xs.reshape(512, 4096), mx.ones((4096,), mx.float16), 1e-5),
                    mx.take(xs.reshape(512, 4096), rows, axis=0).astype(mx.float32))

        def compiled() -> None:
            f = mx.compile(lambda a, b: mx.sigmoid(a) * a * b)
            z = mx.random.normal((512, 14336)).astype(mx.float16)
            mx.eval(f(z, z))

        def raw_managed() -> None:  # managed memory outside MLX: written by the GPU, read by the CPU
            ptr, n = ctypes.c_uint64(), 64 << 20
            lib.cuMemAllocManaged(ctypes.byref(ptr), ctypes.c_size_t(n), 1)
            lib.cuMemsetD8_v2(ptr, 1, ctypes.c_size_t(n))
            lib.cuCtxSynchronize()
            ctypes.string_at(ptr.value, n)
            keep.append(ptr)  # not freed: cuMemFree would synchronize the device mid-plan

        def local_memory_kernel() -> None:
            # A kernel with 16 KB of local memory a thread at full occupancy: the context's
            # local-memory reservation grows for it, and stays grown.
            from tandem.kernels.cuda import nvrtc
            src = ('extern "C" __global__ void tandem_probe_lmem(float* out, int n) {\n'
                   '  volatile float buf[4096];\n'
                   '  for (int i = 0; i < 4096; ++i) buf[i] = i * n;\n'
                   '  out[blockIdx.x * blockDim.x + threadIdx.x] = buf[(threadIdx.x * 7) & 4095];\n}\n')
            f = drv.get_function(drv.load_module(nvrtc.compile_cubin(src, drv.arch(), "lmem.cu")), "tandem_probe_lmem")
            out_buf = drv.mem_alloc(132 * 2048 * 4)
            from tandem.kernels.cuda.cuda_driver import KernelParams
            params = KernelParams([out_buf, ("i32", 3)])
            drv.launch(f, (132 * 2, 1, 1), (1024, 1, 1), gs.stream, params.array)
            drv.call("cuStreamSynchronize", gs.stream)
            keep.append((params, out_buf))

        def plain_module() -> None:  # a module of our own loaded and launched once (NVRTC)
            from tandem.kernels.cuda import nvrtc
            src = 'extern "C" __global__ void tandem_probe_nop(int* p) { if (p) *p = 1; }\n'
            f = drv.get_function(drv.load_module(nvrtc.compile_cubin(src, drv.arch(), "nop.cu")), "tandem_probe_nop")
            from tandem.kernels.cuda.cuda_driver import KernelParams
            params = KernelParams([0])
            drv.launch(f, (1, 1, 1), (32, 1, 1), gs.stream, params.array)
            drv.call("cuStreamSynchronize", gs.stream)
            keep.append(params)

        def runner_prefill() -> None:
            # The runner's fresh prefill of one 512-token prompt (its matmuls, tandem's
            # prefill kernels, its host-made positions and slots), with no sampling and no
            # read-back: the engine's prefill without the engine around it.
            from types import SimpleNamespace
            if eng.store.capacity < 40:
                eng.store.ensure_capacity(40)
            row = SimpleNamespace(n=512, start=0, seq=SimpleNamespace(block_ids=list(range(32))))
            mx.eval(eng.runner.forward([row], mx.random.randint(0, 1000, (1, 512)).astype(mx.int32)))
            use_graph()  # a grown store has new pools: a new capture

        rows.append({"concurrent_managed_access": drv.device_attribute(89)})
        log(f"concurrentManagedAccess: {drv.device_attribute(89)}; CUDA_MODULE_LOADING="
            f"{os.environ.get('CUDA_MODULE_LOADING', '(unset: lazy)')}, MLX_USE_CUDA_GRAPHS="
            f"{os.environ.get('MLX_USE_CUDA_GRAPHS', '(unset)')}")
        plan = [
            ("hot", lambda: [timed_steps() for _ in range(3)]),
            ("managed memory outside MLX, GPU then CPU", raw_managed),
            ("a host-made array read on the GPU", host_array),
            ("an argmax read back (.item())", read_back),
            ("a module of our own, one launch", plain_module),
            ("a 16 KB-a-thread local-memory kernel", local_memory_kernel),
            ("MLX's RoPE, rms_norm, gather, cast", rope_norm),
            ("an mx.compile'd swiglu", compiled),
            ("the runner's prefill forward (no sampling, no read-back)", runner_prefill),
            ("an engine prefill, 512 tokens", engine_prefill),
            ("hot again", lambda: [timed_steps() for _ in range(3)]),
        ]
    else:
        plan = [
            ("hot", lambda: [timed_steps() for _ in range(3)]),
            ("idle 2 s", lambda: time.sleep(2.0)),
            ("five GEMM bursts", lambda: [gemms() for _ in range(5)]),
            ("random K/V in the pools", lambda: fill_pools(lambda sh: mx.random.normal(sh))),
            ("CUPTI before", lambda: (cupti_replays("before"), show_context("before"))),
            ("an SDPA of prefill shapes", sdpa),
            ("an engine prefill, 512 tokens", lambda: (engine_prefill(), show_context("after prefill"))),
            ("CUPTI after", lambda: cupti_replays("after")),
            ("context as before, persisting L2 reset", lambda: reset_context(before_state)),
            ("an engine prefill, then reset", lambda: (engine_prefill(), reset_context(before_state))),
            ("hot again", lambda: [timed_steps() for _ in range(3)]),
        ]
    eng.start()
    try:
        for name, fn in plan:
            try:
                fn()
            except Exception as exc:  # one part that cannot run here: say so, time the rest
                log(f"{name}: failed: {type(exc).__name__}: {exc}")
                rows.append({"before": name, "failed": f"{type(exc).__name__}: {exc}"})
                continue
            ms = timed_steps()
            rows.append({"before": name, "step_ms": [round(m, 4) for m in ms]})
            q = [float(np.mean(ms[i:i + 10])) for i in range(0, steps, 10)]
            log(f"{name:38s}: ms a step, means of 10: " + " ".join(f"{v:.3f}" for v in q))
    finally:
        eng.stop()


def section_attention() -> None:
    """Paged decode attention (8B shapes, block 16) at several partition sizes, and the write."""
    from tandem.kernels.cuda import paged_attention_cuda as pac
    from tandem.kernels.cuda import kv_write_cuda as kvw
    RESULTS["attention"] = []
    H, KVH, D, BS = 32, 8, 128, 16
    log(f"\n== paged decode attention and RoPE+write (wall per queued call / CUPTI gpu time)")
    for B, ctx in [(1, 528), (1, 4096), (16, 528), (64, 528), (128, 528)]:
        nb = -(-ctx // BS)
        kp = mx.random.normal((B * nb * BS + BS, KVH, D)).astype(mx.float16)
        vp = mx.random.normal((B * nb * BS + BS, KVH, D)).astype(mx.float16)
        table = mx.array((1 + np.arange(B * nb, dtype=np.int32)).reshape(B, nb))
        lens = mx.full((B,), ctx, mx.int32)
        q = mx.random.normal((B, H, D)).astype(mx.float16)
        mx.eval(kp, vp, table, lens, q)
        want = pac.paged_decode_attention_reference(q, kp, vp, table, lens, D**-0.5, BS) if B <= 16 else None
        kv_bytes = B * ctx * KVH * D * 2 * 2
        line = []
        for ver in ("v2", "v4", "v6"):
            line = []
            for part in (32, 64, 128, 256, 2048):
                if -(-ctx // part) > 512:
                    continue
                fn = lambda: pac.paged_decode_attention(q, kp, vp, table, lens, D**-0.5, BS, ctx, part,  # noqa: E731
                                                        flat=True, kernel=ver)
                got = fn()
                err = (mx.abs(got.reshape(B, H, D).astype(mx.float32) - want.astype(mx.float32)).max().item()
                       if want is not None else float("nan"))
                t = timed(fn)
                g = gpu_us(fn, "tandem_paged")
                RESULTS["attention"].append({"batch": B, "ctx": ctx, "kernel": ver, "partition": part,
                                             "us": t * 1e6, "gpu_us": g, "tb_s": kv_bytes / g / 1e6,
                                             "err": err})
                line.append(f"p{part}: {t * 1e6:.0f}/{g:.0f}us {kv_bytes / g / 1e6:.2f}TB/s")
            log(f"B={B:3d} ctx={ctx:5d} {ver} (default p{pac.choose_partition(B, KVH, ctx)}): " + "  ".join(line))
        # the RoPE + in-place write for this batch
        qkv = mx.random.normal((B, (H + 2 * KVH) * D)).astype(mx.float16)
        pos = mx.full((B,), ctx - 1, mx.int32)
        slots = mx.array((np.arange(B) * nb * BS + BS + ctx - 1).astype(np.int32))
        inv = mx.ones((D // 2,), mx.float32) * 0.01
        mx.eval(qkv, pos, slots, inv)
        for hpt in (1, 8):
            kvw.WRITE_HEADS_PER_THREAD = hpt
            fn = lambda: kvw.write_kv_rope(qkv, pos, slots, inv, kp, vp, H, KVH)[0]  # noqa: E731
            t = timed(fn)
            g = gpu_us(fn, "tandem_write")
            RESULTS["attention"].append({"batch": B, "write_hpt": hpt, "write_us": t * 1e6, "write_gpu_us": g})
            log(f"          write_kv_rope hpt {hpt}: {t * 1e6:.1f} us wall, {g:.1f} us gpu")
        kvw.WRITE_HEADS_PER_THREAD = 1
        del kp, vp
        mx.clear_cache()


def chain(fn, x, n: int):
    for _ in range(n):
        x = fn(x)
    return x


def section_attention_serial(batches: list[int], ctx: int, flush: bool = False) -> None:
    """Decode attention in a chain of 200 dependent calls (CUPTI, median kernel), the split
    kernel and the merge timed apart, per kernel, partition size and merge. The ``attention``
    section queues 20 independent calls in one graph, where small kernels overlap and their
    summed durations say little at batch 1. The pool is engine-sized (32k slots) and the rows'
    blocks sit in its middle. ``flush`` (section ``attention-cold``) streams 1 GiB before
    every call, as a decode step's weights do between two steps of one layer; it also keeps
    the GPU busy. Without it the chain is ~6 ms of small kernels on a GPU coming out of idle,
    and its times jump (runs 43-46: the same kernel 11-12 us in one row, 17-27 us in the
    next; most likely the clocks), so only the cold rows compare kernels.
    """
    import mlx.nn as nn
    from tandem.kernels.cuda import decode_attention_cuda as dac
    from tandem.kernels.cuda import paged_attention_cuda as pac
    RESULTS.setdefault("attention_serial", [])
    H, KVH, D, BS = 32, 8, 128, 16
    slots = 32768
    log(f"\n== decode attention, one call at a time (CUPTI us: split kernel + merge), ctx {ctx}")
    for B in batches:
        nb = -(-ctx // BS)
        kp = mx.random.normal((slots + B * nb * BS, KVH, D)).astype(mx.float16)
        vp = mx.random.normal((slots + B * nb * BS, KVH, D)).astype(mx.float16)
        table = mx.array((slots // BS // 2 + np.arange(B * nb, dtype=np.int32)).reshape(B, nb))
        lens = mx.full((B,), ctx, mx.int32)
        q = mx.random.normal((B, H, D)).astype(mx.float16)
        mx.eval(kp, vp, table, lens, q)
        want = pac.paged_decode_attention_reference(q, kp, vp, table, lens, D**-0.5, BS) if B <= 16 else None
        # Cold: 1 GiB streamed before every call (L2 and TLB flushed of this KV, as a decode
        # step's 4 GB of weights does between a layer's attention in two steps).
        big = mx.ones((1 << 29,), mx.float16) if flush else None
        versions = ("v2", "v4") if B < pac.V4_MIN_BATCH else ("v4", "v6", "tc")
        parts = (16, 64, 128, 2048) if B < pac.V4_MIN_BATCH else (128, 256, 2048)
        for ver in versions:
            for part in (parts if flush else (16, 32, 64, 128, 2048)):
                for merge in (("serial", "parallel") if part < ctx and not flush else ("serial",)):
                    def fn_q(qq, ver=ver, part=part, merge=merge):
                        if big is not None:
                            qq = qq + (big.max() * 0).astype(qq.dtype)  # max: a sum of ones overflows to inf
                        return pac.paged_decode_attention(qq, kp, vp, table, lens, D**-0.5, BS, ctx, part,
                                                          kernel=ver, merge=merge)
                    got = fn_q(q)
                    err = (mx.abs(got.reshape(B, H, D).astype(mx.float32) - want.astype(mx.float32)).max().item()
                           if want is not None else float("nan"))
                    # A chain: each call's query is the last call's output, so the calls
                    # neither overlap nor leave the GPU idle (and clocking down) between them.
                    att, red = gpu_us_by(lambda: chain(fn_q, q, 200), ("tandem_paged_decode", "tandem_paged_reduce"),
                                         iters=1, median=True)
                    red = red if part < ctx else 0.0
                    RESULTS["attention_serial"].append({"batch": B, "ctx": ctx, "kernel": ver, "partition": part,
                                                        "merge": merge, "cold": flush, "att_us": att, "merge_us": red,
                                                        "err": err})
                    log(f"B={B:3d} {'cold' if flush else 'warm'} {ver} p{part:<5d} {merge:8s}: attention {att:6.1f} us + merge {red:5.1f} us"
                        f" = {att + red:6.1f}  (err {err:.1e})")
        if flush and B < dac.MAX_ROWS:
            # The one-launch RoPE + write + attention + merge the engine runs below 16
            # rows, at the engine's padded table width: the engine trace has it at 24.6-33
            # us a layer (runs 50, 53) for ~2 MB of KV.
            from tandem.kernels.cuda import kv_write_cuda as kvw
            from tandem.pipeline.runners.cuda.runner import table_width

            width = table_width(nb)
            ftable = mx.concatenate([table, mx.zeros((B, width - nb), mx.int32)], axis=1)
            pos = mx.full((B,), ctx - 1, mx.int32)
            fslots = ftable[mx.arange(B), pos // BS] * BS + pos % BS
            inv = kvw.rope_inv_freq(nn.RoPE(D, base=500000.0), D)
            kv_tail = mx.random.normal((B, 2 * KVH * D)).astype(mx.float16)
            counters = dac.counters(B, KVH)
            flat = q.reshape(B, H * D)
            mx.eval(ftable, pos, fslots, inv, kv_tail, flat)
            # 64: the engine's partition (a merge by the last block); 2048: one partition,
            # no merge, so the difference is the merge's cost (fence, ticket, partials).
            for part, staged in ((64, False), (64, True), (128, False), (128, True), (2048, False)):
                def fn_f(qq, part=part, staged=staged):
                    qq = qq + (big.max() * 0).astype(qq.dtype)
                    qkv = mx.concatenate([qq, kv_tail], axis=1)
                    return dac.decode_attention(qkv, pos, fslots, inv, kp, vp, ftable, H, KVH, D**-0.5, BS,
                                                width * BS, counters, part, staged_merge=staged)
                fn_f(flat)
                (att,) = gpu_us_by(lambda: chain(fn_f, flat, 200), ("tandem_decode_attention_fused",),
                                   iters=1, median=True)
                RESULTS["attention_serial"].append({"batch": B, "ctx": ctx, "kernel": "fused", "partition": part,
                                                    "staged_merge": staged, "cold": True, "att_us": att,
                                                    "table_width": width})
                log(f"B={B:3d} cold fused p{part:<5d} {'staged merge' if staged else 'merge':12s} "
                    f"(table {width} blocks): {att:6.1f} us")
        del kp, vp
        mx.clear_cache()


_KV_LOAD_SOURCE = r"""
  // Only v6's loads (batch x KV head blocks of 4 warps, 32-token tiles, one partition),
  // no arithmetic but an XOR that keeps them. PAT 0: a lane per token, its K row in 16
  // loads of 16 bytes (v6); 1: K loaded as V is, 16 lanes per row, two rows an
  // instruction; 2: K as in 0, no V; 3: V only (cp.async, as v6). HM: the pools read as
  // [block][KV head][BS][D] (a head's 16 rows of a block contiguous, 4 KB) instead of the
  // store's [slot][KV head][D] (a head's rows 2 KB apart).
  // NSPLIT: the row's tokens split over that many blocks (gridDim.y = KVH * NSPLIT).
  const int h = blockIdx.y % KVH, split = blockIdx.y / KVH, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int NB = table_shape[1];
  const int full = lens[b];
  const int span = ((full + NSPLIT - 1) / NSPLIT + 31) / 32 * 32;
  const int t0 = split * span;
  const int len = min(full, t0 + span);
  __shared__ int sm_tbl[256];
  for (int i = tid; i < (full + BS - 1) / BS; i += blockDim.x) sm_tbl[i] = table[(size_t)b * NB + i];
  __shared__ __align__(16) __half sm_v[4][32][D];
  __syncthreads();
  constexpr int KW = D / 8;
  auto row = [&](int t) -> size_t {
    const size_t blk = (size_t)sm_tbl[t / BS];
    return HM ? ((blk * KVH + h) * BS + t % BS) * D : ((blk * BS + t % BS) * KVH + h) * D;
  };
  unsigned acc = 0;
  for (int tb = t0 + 32 * warp; tb < len; tb += 128) {
    const int nv = min(32, len - tb);
    if constexpr (PAT == 0 || PAT == 2) {
      const int t = tb + lane;
      if (t < len) {
        const uint4* kp = reinterpret_cast<const uint4*>(k_pool + row(t));
        uint4 kr[KW];
#pragma unroll
        for (int c = 0; c < KW; ++c) kr[c] = kp[c];
#pragma unroll
        for (int c = 0; c < KW; ++c) acc ^= kr[c].x ^ kr[c].y ^ kr[c].z ^ kr[c].w;
      }
    } else if constexpr (PAT == 1) {
      uint4 kr[KW];
#pragma unroll
      for (int k = 0; k < KW; ++k) {
        const int ci = lane + 32 * k;
        const int j = ci / KW, w = ci % KW;
        kr[k] = make_uint4(0, 0, 0, 0);
        if (j < nv) {
          const int t = tb + j;
          kr[k] = reinterpret_cast<const uint4*>(k_pool + row(t))[w];
        }
      }
#pragma unroll
      for (int k = 0; k < KW; ++k) acc ^= kr[k].x ^ kr[k].y ^ kr[k].z ^ kr[k].w;
    }
    if constexpr (PAT != 2) {
#pragma unroll
      for (int k = 0; k < KW; ++k) {
        const int ci = lane + 32 * k;
        const int jv = ci / KW, w = ci % KW;
        if (jv < nv) {
          const int ti = tb + jv;
          const __half* vp = v_pool + row(ti) + w * 8;
          const unsigned dst = (unsigned)__cvta_generic_to_shared(&sm_v[warp][jv][w * 8]);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(vp));
        }
      }
      asm volatile("cp.async.commit_group;\n" ::);
      asm volatile("cp.async.wait_group 0;\n" ::);
      __syncwarp();
      acc ^= reinterpret_cast<const unsigned*>(&sm_v[warp][lane][0])[lane % 8];
      __syncwarp();
    }
  }
  out[((size_t)b * gridDim.y + blockIdx.y) * blockDim.x + tid] = acc;
"""


@functools.cache
def _kv_loads_kernel():
    return mx.fast.cuda_kernel(name="tandem_probe_kv_loads", input_names=["k_pool", "v_pool", "table", "lens", "dep"],
                               output_names=["out"], source=_KV_LOAD_SOURCE)


def _kv_case(B: int, ctx: int, H: int = 32, KVH: int = 8, D: int = 128, BS: int = 16):
    """Pools holding B rows of ``ctx`` tokens in shuffled blocks (as a long-running
    engine's are), their table and lengths, and one query a row; evaluated."""
    nb = -(-ctx // BS)
    kp = mx.random.normal((B * nb * BS + BS, KVH, D)).astype(mx.float16)
    vp = mx.random.normal((B * nb * BS + BS, KVH, D)).astype(mx.float16)
    table = mx.array((1 + np.random.default_rng(0).permutation(B * nb).astype(np.int32)).reshape(B, nb))
    lens = mx.full((B,), ctx, mx.int32)
    q = mx.random.normal((B, H, D)).astype(mx.float16)
    mx.eval(kp, vp, table, lens, q)
    return kp, vp, table, lens, q


_FLAT_READ_SOURCE = r"""
  // The floor: the same number of bytes read as one contiguous stream, 16-byte loads,
  // four in flight a thread, a grid-stride loop.
  const size_t n = (size_t)n_words[0];
  const uint4* k = reinterpret_cast<const uint4*>(k_pool);
  const uint4* v = reinterpret_cast<const uint4*>(v_pool);
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned acc = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 2 * stride) {
    const uint4 a = k[i], c = v[i];
    uint4 e = make_uint4(0, 0, 0, 0), f = make_uint4(0, 0, 0, 0);
    if (i + stride < n) { e = k[i + stride]; f = v[i + stride]; }
    acc ^= a.x ^ a.w ^ c.x ^ c.w ^ e.x ^ e.w ^ f.x ^ f.w;
  }
  out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""


def section_kv_floor(batches: list[int], ctx: int) -> None:
    """The KV loads of batch-64 attention, cold and one call at a time (a chain, 1 GiB
    streamed before each call, median kernel): v6 itself, its loads alone with the row's
    tokens split over 1, 2 or 4 blocks, and the same bytes read as one contiguous stream.
    ``kv-loads`` queues 20 independent calls, which MLX's graph may overlap."""
    from tandem.kernels.cuda import paged_attention_cuda as pac
    RESULTS.setdefault("kv_floor", [])
    H, KVH, D, BS = 32, 8, 128, 16
    loads = _kv_loads_kernel()
    flat_read = mx.fast.cuda_kernel(name="tandem_probe_flat_read", input_names=["k_pool", "v_pool", "n_words", "dep"],
                                    output_names=["out"], source=_FLAT_READ_SOURCE)
    big = mx.ones((1 << 29,), mx.float16)
    log(f"\n== KV reads, cold, one call at a time (CUPTI median us), ctx {ctx}")
    for B in batches:
        kp, vp, table, lens, q = _kv_case(B, ctx, H, KVH, D, BS)
        n_words = mx.array([B * ctx * KVH * D // 8] * 4, mx.int32)
        mx.eval(big, n_words)
        kv_bytes = B * ctx * KVH * D * 2 * 2

        def cold(x):
            return x + (big.max() * 0).astype(x.dtype)

        rows = []
        for ver, part in (("v6", 2048), ("v6", 256), ("tc", 2048), ("tc", 256)):
            def fn_a(qq, ver=ver, part=part):
                return pac.paged_decode_attention(cold(qq), kp, vp, table, lens, D**-0.5, BS, ctx, part, kernel=ver)
            (us,) = gpu_us_by(lambda: chain(fn_a, q, 100), ("tandem_paged_decode",), iters=1, median=True)
            rows.append((f"{ver} attention, partition {part}", us))
        dep0 = mx.zeros((16,), mx.uint32)
        for nsplit in (1, 2, 4):
            def fn_l(dep, nsplit=nsplit):
                return loads(inputs=[kp, vp, table, lens, cold(dep[:16])],
                             template=[("D", D), ("KVH", KVH), ("BS", BS), ("PAT", 1), ("HM", False),
                                       ("NSPLIT", nsplit)],
                             grid=(128, KVH * nsplit, B), threadgroup=(128, 1, 1),
                             output_shapes=[(B * KVH * nsplit * 128,)], output_dtypes=[mx.uint32])[0]
            (us,) = gpu_us_by(lambda: chain(fn_l, dep0, 100), ("tandem_probe_kv_loads",), iters=1, median=True)
            rows.append((f"loads (K 16 lanes + V), {nsplit} block(s) a row", us))
        for blocks in (132 * 4, 132 * 8):
            def fn_f(dep, blocks=blocks):
                return flat_read(inputs=[kp, vp, n_words, cold(dep[:16])],
                                 grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                                 output_shapes=[(blocks * 256,)], output_dtypes=[mx.uint32])[0]
            (us,) = gpu_us_by(lambda: chain(fn_f, dep0, 100), ("tandem_probe_flat_read",), iters=1, median=True)
            rows.append((f"contiguous read, {blocks} blocks", us))
        for label, us in rows:
            RESULTS["kv_floor"].append({"batch": B, "ctx": ctx, "variant": label, "gpu_us": us, "bytes": kv_bytes})
            log(f"B={B:3d} {label:44s} {us:7.1f} us  {kv_bytes / us / 1e6:5.2f} TB/s")
        del kp, vp
        mx.clear_cache()


def section_kv_loads(batches: list[int], ctx: int) -> None:
    """How fast v6's access pattern reads the KV alone (``_KV_LOAD_SOURCE``), against v6
    itself, at the engine's shapes (8B: 8 KV heads, D 128, block 16, one partition a row):
    whether batch 64's attention (~2 TB/s of KV in runs 50 and 57) is bound by its loads or
    by its arithmetic. CUPTI, 20 independent calls (the KV is far larger than the L2)."""
    from tandem.kernels.cuda import paged_attention_cuda as pac
    RESULTS.setdefault("kv_loads", [])
    H, KVH, D, BS = 32, 8, 128, 16
    kernel = _kv_loads_kernel()
    log(f"\n== v6's KV loads alone (CUPTI us per call, ctx {ctx}, one partition a row)")
    for B in batches:
        kp, vp, table, lens, q = _kv_case(B, ctx, H, KVH, D, BS)
        kv_bytes = B * ctx * KVH * D * 2 * 2
        rows = []
        fn = lambda: pac.paged_decode_attention(q, kp, vp, table, lens, D**-0.5, BS, ctx, 2048, kernel="v6")  # noqa: E731
        rows.append(("v6 attention", gpu_us(fn, "tandem_paged_decode"), kv_bytes))
        for pat, hm, label, nbytes in (
                (0, False, "loads: K a lane per token + V", kv_bytes), (1, False, "loads: K 16 lanes a row + V", kv_bytes),
                (2, False, "loads: K a lane per token only", kv_bytes // 2), (3, False, "loads: V only", kv_bytes // 2),
                (0, True, "head-major: K a lane/token + V", kv_bytes), (1, True, "head-major: K 16 lanes + V", kv_bytes)):
            def fn_l(pat=pat, hm=hm):
                return kernel(inputs=[kp, vp, table, lens, lens],
                              template=[("D", D), ("KVH", KVH), ("BS", BS), ("PAT", pat), ("HM", hm), ("NSPLIT", 1)],
                              grid=(128, KVH, B), threadgroup=(128, 1, 1), output_shapes=[(B * KVH * 128,)],
                              output_dtypes=[mx.uint32])[0]
            rows.append((label, gpu_us(fn_l, "tandem_probe_kv_loads"), nbytes))
        for label, us, nbytes in rows:
            RESULTS["kv_loads"].append({"batch": B, "ctx": ctx, "variant": label, "gpu_us": us, "bytes": nbytes})
            log(f"B={B:3d} {label:32s} {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s")
        del kp, vp
        mx.clear_cache()


def section_gemm(rows_list: list[int]) -> None:
    """The dense fp16 products of a prefill (or a batched decode step) written four ways,
    one call at a time (CUPTI, every kernel of the call): ``addmm(res, x, W.T)`` (the
    engine's, for o and down), ``x @ W.T``, ``x @ Wt`` with the weight stored transposed,
    and ``W @ x.T``. cuBLAS picks its kernel per layout: run 53's trace had the 512-row o
    product at ~470 TFLOPS (96 tiles of 192 x 128 on 132 SMs) where gate/up ran at ~790."""
    RESULTS.setdefault("gemm", [])
    log("\n== fp16 products, us per call (CUPTI, serial) and TFLOPS")
    for m in rows_list:
        for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate/up", 28672, 4096), ("down", 4096, 14336)):
            w = (mx.random.normal((n, k)) * 0.02).astype(mx.float16)
            wt = mx.contiguous(w.T)
            x = mx.random.normal((m, k)).astype(mx.float16)
            res = mx.random.normal((m, n)).astype(mx.float16)
            mx.eval(w, wt, x, res)
            ways = (("addmm(res, x, W.T)", lambda: mx.addmm(res, x, w.T)), ("x @ W.T", lambda: x @ w.T),
                    ("x @ Wt", lambda: x @ wt), ("W @ x.T", lambda: w @ x.T))
            for label, fn in ways:
                us = gpu_us(fn, "", iters=20, serial=True)
                tflops = 2 * m * n * k / us / 1e6
                RESULTS["gemm"].append({"rows": m, "product": name, "way": label, "gpu_us": us, "tflops": tflops})
                log(f"M={m:4d} {name:8s} {label:20s} {us:8.1f} us  {tflops:6.0f} TFLOPS")
            del w, wt, x, res
            mx.clear_cache()


def section_embed(tokens: int = 512, vocab: int = 128256, dims: int = 4096, rounds: int = 20) -> None:
    """A prefill's embedding lookup of ``tokens`` random ids (8B shapes): the 4-bit table
    (three gathers and a dequantize) and the fp16 table, with the ids a host-made array (as
    the engine makes them: managed memory the CPU wrote), a device-made copy of it, and
    sorted. The engine trace of a 512-token prefill (run 44) showed the three gathers at
    250-295 us each, where a decode step's take 2.5 us. CUPTI, every kernel of a call,
    median over ``rounds`` calls taken round-robin over the variants."""
    import mlx.nn as nn
    RESULTS["embed"] = []
    mx.random.seed(0)
    dense = nn.Embedding(vocab, dims)
    dense.set_dtype(mx.float16)
    mx.eval(dense.parameters())
    q4 = nn.QuantizedEmbedding.from_embedding(dense, group_size=64, bits=4)
    mx.eval(q4.parameters())
    rng = np.random.default_rng(0)
    variants = {
        "q4, host ids": lambda ids: q4(mx.array(ids)),
        "q4, ids copied on device": lambda ids: q4(mx.array(ids) + 0),
        "q4, host ids sorted": lambda ids: q4(mx.array(np.sort(ids))),
        "fp16, host ids": lambda ids: dense(mx.array(ids)),
        "fp16, ids copied on device": lambda ids: dense(mx.array(ids) + 0),
    }
    times = {k: [] for k in variants}
    walls = {k: [] for k in variants}
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        log("embed: needs torch's profiler (CUPTI); skipped")
        return
    for _ in range(rounds):
        for name, fn in variants.items():
            ids = rng.integers(0, vocab, (1, tokens)).astype(np.int32)
            mx.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                mx.eval(fn(ids))
                mx.synchronize()
                walls[name].append(1e6 * (time.perf_counter() - t))
            path = Path("/tmp/gpu_probe_embed_trace.json")
            prof.export_chrome_trace(str(path))
            times[name].append(sum(e["dur"] for e in kernel_records(path)))
    log(f"\n== embedding of {tokens} random ids (CUPTI us, all kernels of a call; wall us), median of {rounds}")
    for name in variants:
        g, w = float(np.median(times[name])), float(np.median(walls[name]))
        RESULTS["embed"].append({"variant": name, "gpu_us": g, "wall_us": w, "tokens": tokens})
        log(f"{name:28s} gpu {g:8.1f} us   wall {w:8.1f} us")


def device_records(events: list[dict]) -> list[dict]:
    """A trace's device records (kernels, copies, memsets), by start."""
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                  key=lambda e: e["ts"])


def kernel_records(trace_path: Path) -> list[dict]:
    return device_records(json.loads(trace_path.read_text()).get("traceEvents", []))


def api_summary(trace_path: Path, label: str, steps: int) -> list[dict]:
    """The host's CUDA calls in a trace (CUPTI runtime and driver records, every thread):
    count and time per step by name, so graph instantiations, updates and node adds show
    next to the kernels they launch."""
    data = json.loads(trace_path.read_text())
    by_name: dict[str, list[float]] = {}
    for e in data.get("traceEvents", []):
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            by_name.setdefault(f"{e['cat'][5:]}:{e['name'][:50]}", []).append(e["dur"])
    if not by_name:
        log(f"{label}: no runtime/driver records in the trace")
        return []
    log(f"\n== {label}: host CUDA calls ({sum(map(len, by_name.values()))} records over {steps} steps)")
    log(f"{'call':60s} {'n/step':>7s} {'us each':>8s} {'us/step':>8s}")
    table = []
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:20]:
        table.append({"call": name, "per_step": len(durs) / steps, "us_each": float(np.mean(durs)),
                      "us_per_step": sum(durs) / steps})
        log(f"{name:60s} {len(durs) / steps:7.1f} {np.mean(durs):8.1f} {sum(durs) / steps:8.1f}")
    return table


def gap_causes(events: list[dict], min_gap_us: float = 10.0, top: int = 12) -> dict:
    """Every idle span of the device in a trace's events (torch profiler's chrome trace)
    of at least ``min_gap_us``, put down to the host or to the device. The work after a gap
    was launched by the host call with its CUPTI correlation id (``cudaGraphLaunch``,
    ``cuLaunchKernel``, ...): when that call returned after the gap began, the device had
    nothing queued and waited for the host (``host``); when it had returned before, the
    work was queued and the device itself idled (``device``: graph uploads, launch
    latency, dependencies). Also the lead-in (the first host call to the first device
    record) and the largest gaps with their neighbours."""
    gpu = device_records(events)
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e and "correlation" in e.get("args", {})}
    out = {"records": len(gpu), "min_gap_us": min_gap_us, "host_us": 0.0, "device_us": 0.0, "unmatched_us": 0.0,
           "host_n": 0, "device_n": 0, "unmatched_n": 0, "small_gaps_us": 0.0, "largest": []}
    if not gpu:
        return out
    first_call = min((c["ts"] for c in calls.values()), default=None)
    out["lead_in_us"] = None if first_call is None else gpu[0]["ts"] - first_call
    out["span_us"] = max(e["ts"] + e["dur"] for e in gpu) - gpu[0]["ts"]
    out["busy_us"] = sum(e["dur"] for e in gpu)
    gaps = []
    end, prev = gpu[0]["ts"] + gpu[0]["dur"], gpu[0]
    for e in gpu[1:]:
        gap = e["ts"] - end
        if gap >= min_gap_us:
            call = calls.get(e.get("args", {}).get("correlation"))
            if call is None:
                kind, lead = "unmatched", None
            else:
                returned = call["ts"] + call["dur"]
                kind, lead = ("host" if returned > end else "device"), end - returned
            out[f"{kind}_us"] += gap
            out[f"{kind}_n"] += 1
            gaps.append({"gap_us": round(gap, 1), "cause": kind, "before": kernel_label(prev["name"], 40),
                         "after": kernel_label(e["name"], 40), "call": None if call is None else call["name"][:40],
                         "queued_us": None if lead is None else round(lead, 1)})
        elif gap > 0:
            out["small_gaps_us"] += gap
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    out["largest"] = sorted(gaps, key=lambda g: -g["gap_us"])[:top]
    for k in ("host_us", "device_us", "unmatched_us", "small_gaps_us"):
        out[k] = round(out[k], 1)
    return out


def kernel_label(name: str, width: int = 70) -> str:
    """A kernel's name with its template arguments (which tell QKV from o from gate/up among
    the streaming products) and without MLX's prefix and the argument list."""
    name = name.replace("mlx::core::cu::custom_kernel_", "").replace("mlx::core::cu::", "")
    name = name.split("(", 1)[0] if not name.startswith("void ") else name[5:].split("(", 1)[0]
    return name[:width]


def summarize(records: list[dict], label: str, steps: int) -> dict:
    if not records:
        log(f"{label}: no kernel records (CUPTI did not see MLX's launches)")
        return {"label": label, "kernels": 0}
    records.sort(key=lambda e: e["ts"])
    start = records[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in records)
    busy = sum(e["dur"] for e in records)
    gaps = [max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(records, records[1:])]
    by_name: dict[str, list[float]] = {}
    for e in records:
        grid = e.get("args", {}).get("grid")
        key = kernel_label(e["name"]) + (f" {grid}" if grid else "")
        by_name.setdefault(key, []).append(e["dur"])
    log(f"\n== {label}: {len(records)} kernels over {steps} steps; span {(end - start) / steps:.0f} us/step, "
        f"busy {busy / steps:.0f} us/step ({busy / (end - start):.0%}), "
        f"gap p50 {np.median(gaps):.1f} us, mean {np.mean(gaps):.1f} us")
    # Copies and idle stretches by their neighbours: what launched them is not in the record.
    seen = 0
    for i, e in enumerate(records):
        if e["name"].startswith("Memcpy") and seen < 6:
            seen += 1
            before = records[i - 1]["name"][:50] if i else "-"
            after = records[i + 1]["name"][:50] if i + 1 < len(records) else "-"
            log(f"  {e['name'][:28]} {e['dur']:.0f} us ({e.get('args', {}).get('bytes', '?')} B) "
                f"after {before} | before {after}")
    idle = sorted(((b["ts"] - (a["ts"] + a["dur"]), a["name"][:50], b["name"][:50])
                   for a, b in zip(records, records[1:])), reverse=True)[:6]
    for gap, a, b in idle:
        log(f"  idle {gap:.0f} us between {a} | {b}")
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    # min / median / max each: one slow instance a step (a page the GPU faults in, say)
    # shows as a max far above the median.
    log(f"{'kernel, grid':90s} {'n/step':>7s} {'us each':>8s} {'min/p50/max':>17s} {'us/step':>8s}")
    table = []
    for name, durs in rows[:25]:
        table.append({"kernel": name, "per_step": len(durs) / steps, "us_each": float(np.mean(durs)),
                      "us_min": float(np.min(durs)), "us_p50": float(np.median(durs)),
                      "us_max": float(np.max(durs)), "us_per_step": sum(durs) / steps})
        spread = f"{np.min(durs):.1f}/{np.median(durs):.1f}/{np.max(durs):.1f}"
        log(f"{name:90s} {len(durs) / steps:7.1f} {np.mean(durs):8.1f} {spread:>17s} {sum(durs) / steps:8.1f}")
    return {"label": label, "kernels": len(records), "span_us_per_step": (end - start) / steps,
            "busy_us_per_step": busy / steps, "gap_p50_us": float(np.median(gaps)),
            "gap_mean_us": float(np.mean(gaps)), "by_kernel": table}


def section_trace(layers: int, batches: list[int], fmt: str, steps: int, out: Path) -> None:
    import torch  # noqa: F401  (CUPTI via torch.profiler)
    from torch.profiler import ProfilerActivity, profile
    import gpu_decode as gd

    fp16, q4 = gd.build_models(layers)
    loop = gd.KernelLoop(fp16, q4, fmt)
    RESULTS.setdefault("trace", [])
    for B in batches:
        prompt_len = 512
        nb = -(-(prompt_len + steps + 8) // loop.BS)
        kp, vp = loop.pools((B * nb + 1) * loop.BS)
        table = (1 + np.arange(B * nb, dtype=np.int32)).reshape(B, nb)
        table_mx = mx.array(table)
        prompts = np.random.randint(0, loop.vocab, (B, prompt_len)).astype(np.int32)
        tok = loop.prefill(prompts, table, kp, vp)
        mx.eval(tok)
        mx.synchronize()
        # The prefill itself (its kernels compiled by the call above).
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            tok = loop.prefill(prompts, table, kp, vp)
            mx.eval(tok)
            mx.synchronize()
            wall = time.perf_counter() - t0
        path = out / f"gpu_probe_trace_prefill_b{B}.json"
        prof.export_chrome_trace(str(path))
        s = summarize(kernel_records(path), f"kernel loop {fmt}, {layers} layers, prefill {B} x {prompt_len}", 1)
        s["wall_us"] = wall * 1e6
        s["tok_per_s"] = B * prompt_len / wall
        log(f"prefill wall {wall * 1e3:.1f} ms = {B * prompt_len / wall:,.0f} tok/s (profiled)")
        RESULTS["trace"].append(s)
        path.unlink()
        lens = np.full(B, prompt_len + 1, dtype=np.int64)
        part = gd.pac.choose_partition(B, loop.KVH, prompt_len + steps + 8)
        for _ in range(3):
            tok = loop.step(tok, lens, table, table_mx, kp, vp, part)
            mx.eval(tok)
            lens += 1
        mx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = loop.step(tok, lens, table, table_mx, kp, vp, part)
                mx.async_eval(tok)
                lens += 1
            mx.eval(tok)
            mx.synchronize()
            wall = time.perf_counter() - t0
        path = out / f"gpu_probe_trace_b{B}.json"
        prof.export_chrome_trace(str(path))
        s = summarize(kernel_records(path), f"kernel loop {fmt}, {layers} layers, batch {B}", steps)
        s["wall_us_per_step"] = wall / steps * 1e6
        log(f"wall {s['wall_us_per_step']:.0f} us/step (profiled)")
        RESULTS["trace"].append(s)
        path.unlink()
        del kp, vp


def section_engine_trace(layers: int, batches: list[int], out: Path) -> None:
    """CUPTI records of tandem's Engine itself (not the kernel loop): one profile around
    B prompts' prefill (max_tokens 1) and one around 16 decode steps of B running
    sequences, so the engine's own gaps and extra kernels show next to the loop's."""
    import os
    import threading

    from torch.profiler import ProfilerActivity, profile
    import gpu_decode as gd
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.api import EngineRequest

    eng = _probe_engine(layers, max(batches))
    eng.start()
    vocab = gd._vocab()
    RESULTS.setdefault("engine_trace", [])
    try:
        for n in (1, 2, 4, 16):
            eng.generate_many([(np.random.randint(0, vocab, 512).tolist(),
                                SamplingParams(max_tokens=8, ignore_eos=True))] * n, timeout=300)
        for B in batches:
            counts: dict[bytes, int] = {}
            lock = threading.Lock()
            done = threading.Event()

            def submit(n_tokens: int) -> None:
                counts.clear()
                done.clear()
                for _ in range(B):
                    def on_event(ev):
                        with lock:
                            counts[ev.request_id] = counts.get(ev.request_id, 0) + len(ev.tokens)
                            if ev.finish_reason is not None:
                                counts[b"done"] = counts.get(b"done", 0) + 1
                                if counts[b"done"] == B:
                                    done.set()
                    eng.submit(EngineRequest(os.urandom(16), np.random.randint(0, vocab, 512).tolist(),
                                             SamplingParams(max_tokens=n_tokens, ignore_eos=True), on_event))

            mx.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                submit(1)
                done.wait(120)
                wall = time.perf_counter() - t0
            path = out / f"gpu_probe_engine_prefill_b{B}.json"
            prof.export_chrome_trace(str(path))
            r = summarize(kernel_records(path), f"engine, {layers} layers, prefill {B} x 512 (submit -> done)", 1)
            r.update(batch=B, phase="prefill", wall_us=wall * 1e6, tok_per_s=B * 512 / wall)
            r["gap_causes"] = g = gap_causes(json.loads(path.read_text()).get("traceEvents", []))
            log(f"engine prefill wall {wall * 1e3:.1f} ms = {B * 512 / wall:,.0f} tok/s (profiled); "
                f"lead-in {g.get('lead_in_us') or 0:.0f} us; gaps >= {g['min_gap_us']:.0f} us: host "
                f"{g['host_us']:.0f} us ({g['host_n']}), device {g['device_us']:.0f} us ({g['device_n']}), "
                f"unmatched {g['unmatched_us']:.0f} us; smaller gaps {g['small_gaps_us']:.0f} us")
            for row in g["largest"]:
                log(f"  {row}")
            RESULTS["engine_trace"].append(r)
            path.unlink()

            submit(64)
            first = lambda: min((v for k, v in counts.items() if k != b"done"), default=0)  # noqa: E731
            while len(counts) < B or first() < 8:
                time.sleep(0.002)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                c0, t0 = first(), time.perf_counter()
                while first() < c0 + 16 and not done.is_set():
                    time.sleep(0.0005)
                steps, wall = first() - c0, time.perf_counter() - t0
            done.wait(120)
            path = out / f"gpu_probe_engine_decode_b{B}.json"
            prof.export_chrome_trace(str(path))
            r = summarize(kernel_records(path), f"engine, {layers} layers, decode batch {B}", max(steps, 1))
            r.update(batch=B, phase="decode", steps=steps, wall_us_per_step=wall / max(steps, 1) * 1e6)
            r["host_calls"] = api_summary(path, f"engine, decode batch {B}", max(steps, 1))
            log(f"engine decode wall {wall / max(steps, 1) * 1e6:.0f} us/step over {steps} steps (profiled)")
            RESULTS["engine_trace"].append(r)
            path.unlink()
    finally:
        eng.stop()
        os.environ.pop("TANDEM_PAGED_KERNELS", None)


def decode_steps(records: list[dict]) -> list[dict]:
    """A trace's GPU records (sorted by start) cut into decode steps, each ending at its
    argmax kernel: per step its span and busy time (us), the idle time since the step
    before ended, its record count and time by kernel name. Records before the first
    argmax (the prefill) belong to no step."""
    ends = [i for i, e in enumerate(records) if "argmax" in e["name"]]
    steps = []
    for a, b in zip(ends, ends[1:]):
        ks = records[a + 1 : b + 1]
        by: dict[str, float] = {}
        for e in ks:
            key = e["name"].split("(")[0][:40]
            by[key] = by.get(key, 0.0) + e["dur"]
        steps.append({"start": ks[0]["ts"], "span_us": ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"],
                      "busy_us": sum(e["dur"] for e in ks), "kernels": len(ks), "by_name": by,
                      "gap_before_us": ks[0]["ts"] - (records[a]["ts"] + records[a]["dur"])})
    return steps


def prefill_timeline(events: list[dict], marks: list[tuple[str, float]], anchor: float) -> dict:
    """One prefill's host marks and device records on one clock, in ms from the anchor.

    ``marks``: (name, ``time.perf_counter()``) pairs from the engine thread (``tick``,
    ``tick/end``, ``forward``, ``forward/end``, ``async_eval/end``, ``read_back``,
    ``read_back/end``, ``returned``); ``anchor``: the perf counter just after the main
    thread's ``cudaDeviceSynchronize`` returned, which the trace holds on the device's
    clock. Says how long the device waited for its first work, how long after the host
    had queued everything it still ran, and how long the host took to notice its end."""
    sync = min((e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaDeviceSynchronize"
                and "dur" in e), key=lambda e: e["ts"], default=None)
    gpu = device_records(events)
    if sync is None or not gpu:
        return {}
    zero_us = sync["ts"] + sync["dur"]  # the anchor on the trace's clock

    def dev(ts_us: float) -> float:
        return round((ts_us - zero_us) / 1e3, 3)

    def host(name: str, last: bool = False) -> float | None:
        hits = [t for n, t in marks if n == name]
        return None if not hits else round(((hits[-1] if last else hits[0]) - anchor) * 1e3, 3)

    out = {"host": {n: host(n) for n in ("tick", "forward", "forward/end", "read_back/end", "returned")},
           "first_async_eval_end": host("async_eval/end"), "last_async_eval_end": host("async_eval/end", True),
           "first_tick_end": host("tick/end"), "device_first": dev(gpu[0]["ts"]),
           "device_last_end": dev(max(e["ts"] + e["dur"] for e in gpu)),
           "device_busy_ms": round(sum(e["dur"] for e in gpu) / 1e3, 3), "records": len(gpu)}
    first_gemm = next((e for e in gpu if "nvjet" in e["name"] or "gemm" in e["name"].lower()), None)
    out["device_first_gemm"] = None if first_gemm is None else dev(first_gemm["ts"])
    queued = out["last_async_eval_end"]
    if queued is not None:
        # What the device still ran after the host had queued the last of the prefill.
        out["device_after_queued_ms"] = round(out["device_last_end"] - queued, 3)
        out["busy_after_queued_ms"] = round(sum(
            min(e["dur"], max(0.0, e["ts"] + e["dur"] - (zero_us + queued * 1e3))) for e in gpu) / 1e3, 3)
    if out["host"]["read_back/end"] is not None:
        out["host_noticed_after_ms"] = round(out["host"]["read_back/end"] - out["device_last_end"], 3)
    return out


def section_prefill_timeline(layers: int, out: Path, reps: int = 3) -> None:
    """A lone 512-token prefill (max_tokens 1) through the started engine, its engine-thread
    marks and its device records on one clock (``prefill_timeline``). H200 run 120: under
    CUPTI the device span was 11.56 ms of a 14.0 ms prefill, with no idle span of 10 us or
    more inside it, so the rest lies before the first kernel or after the last."""
    import threading

    from torch.profiler import ProfilerActivity, profile
    import torch
    import gpu_decode as gd
    from tandem.kvtypes import SamplingParams

    eng = _probe_engine(layers, 1)
    marks: list[tuple[str, float]] = []

    def marked(label: str):
        """Mark the engine thread's calls (not the main thread's)."""
        def wrap(fn):
            def wrapper(*a, **kw):
                mine = threading.current_thread() is getattr(eng, "_thread", None)
                if mine:
                    marks.append((label, time.perf_counter()))
                try:
                    return fn(*a, **kw)
                finally:
                    if mine:
                        marks.append((label + "/end", time.perf_counter()))
            return wrapper
        return wrap

    patches = Patches()
    for obj, name in ((eng, "_tick"), (eng, "_read_back"), (eng.runner, "forward"), (mx, "async_eval")):
        patches.wrap(obj, name, marked(name.lstrip("_")))
    eng.start()
    vocab = gd._vocab()
    RESULTS.setdefault("prefill_timeline", [])
    torch.cuda.synchronize()  # torch's own CUDA start-up, outside the traces
    try:
        for n in (1, 1, 2):
            eng.generate_many([(np.random.randint(0, vocab, 512).tolist(),
                                SamplingParams(max_tokens=4, ignore_eos=True))] * n, timeout=300)
        for rep in range(reps):
            prompt = [(np.random.randint(0, vocab, 512).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))]
            mx.synchronize()
            time.sleep(0.05)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                anchor = time.perf_counter()
                del marks[:]
                eng.generate_many(prompt, timeout=60)
                marks.append(("returned", time.perf_counter()))
            path = out / f"gpu_probe_prefill_timeline_{rep}.json"
            prof.export_chrome_trace(str(path))
            t = prefill_timeline(json.loads(path.read_text()).get("traceEvents", []), list(marks), anchor)
            path.unlink()
            RESULTS["prefill_timeline"].append(t)
            log(f"prefill timeline {rep}: {t}")
    finally:
        patches.undo()
        eng.stop()


def section_engine_ramp(layers: int, out: Path, tokens: int = 80) -> None:
    """One batch-1 request through the started engine under CUPTI, prompt to its last
    token: each decode step's kernels (a step ends at its argmax) by name, the first
    steps against the later ones, and any kernel between the steps that is not a step's.
    The engine's first 10-35 tokens after a prompt take 2.6-2.8 ms against 2.46 later
    (H200, 2026-12-02, gaps of ``gpu_decode.py``), while a replay alone does not slow down
    after idle, GEMM bursts or a prefill (``graph-warmup``): this says which kernels."""
    import os

    from torch.profiler import ProfilerActivity, profile
    import gpu_decode as gd
    from tandem.kvtypes import SamplingParams

    eng = _probe_engine(layers, 1)
    eng.start()
    vocab = gd._vocab()
    try:
        for _ in range(2):  # compiles, captures, the store's growth
            eng.generate_many([(np.random.randint(0, vocab, 512).tolist(),
                                SamplingParams(max_tokens=tokens, ignore_eos=True))], timeout=300)
        mx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.generate_many([(np.random.randint(0, vocab, 512).tolist(),
                                SamplingParams(max_tokens=tokens, ignore_eos=True))], timeout=300)
            wall = time.perf_counter() - t0
        path = out / "gpu_probe_engine_ramp.json"
        prof.export_chrome_trace(str(path))
        recs = sorted(kernel_records(path), key=lambda e: e["ts"])
        path.unlink()
    finally:
        eng.stop()
        os.environ.pop("TANDEM_PAGED_KERNELS", None)
    steps = decode_steps(recs)
    log(f"\n== engine ramp: one request, 512-token prompt, {tokens} tokens, {wall * 1e3:.1f} ms; "
        f"{len(recs)} GPU records, {len(steps)} whole decode steps")
    RESULTS["engine_ramp"] = {"wall_ms": wall * 1e3, "steps": steps}
    if not steps:
        return
    log(f"{'step':>4s} {'span us':>8s} {'busy us':>8s} {'gap us':>7s} {'kernels':>7s}")
    for i, st in enumerate(steps):
        if i < 40 or i % 10 == 0:
            log(f"{i:4d} {st['span_us']:8.1f} {st['busy_us']:8.1f} {st['gap_before_us']:7.1f} {st['kernels']:7d}")
    early, late = steps[1:16], steps[-30:]
    names = sorted({k for st in steps for k in st["by_name"]}, key=lambda k: -late[0]["by_name"].get(k, 0.0))
    log(f"{'kernel':40s} {'steps 1-15 us':>14s} {'last 30 us':>11s}")
    for k in names:
        e = float(np.mean([st["by_name"].get(k, 0.0) for st in early]))
        l_ = float(np.mean([st["by_name"].get(k, 0.0) for st in late]))
        log(f"{k:40s} {e:14.1f} {l_:11.1f}")


def _sample_prefills(eng, vocab: int, seconds: float) -> int:
    """One 512-token prompt at a time (max_tokens 1), each submitted when the last one is
    done, for ``seconds``: the prefills' count. The thread's waits between them are in the
    samples too (as the engine's queue wait)."""
    from tandem.kvtypes import SamplingParams
    t_end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < t_end:
        eng.generate_many([(np.random.randint(0, vocab, 512).tolist(),
                            SamplingParams(max_tokens=1, ignore_eos=True))], timeout=60)
        n += 1
    return n


class _LeadInGate:
    """Opens the sampler's gate when the engine thread starts a tick with nothing in flight
    (a prefill's first tick after its wake) and closes it when that tick's first
    ``mx.async_eval`` returns, or the tick ends: the samples are the lead-in alone."""

    def __init__(self, eng, sampler):
        self.eng, self.sampler, self.open, self.spans = eng, sampler, False, []
        self._t0 = 0.0
        self._patches = Patches()
        self._tick = self._patches.patch(eng, "_tick", self._gated_tick)
        self._async_eval = self._patches.patch(mx, "async_eval", self._gated_async_eval)

    def _close(self) -> None:
        if self.open:
            self.sampler.gate(False)
            self.open = False
            self.spans.append(time.perf_counter() - self._t0)

    def _gated_tick(self):
        if self.eng._inflight is None and self.eng.scheduler.waiting:
            self._t0 = time.perf_counter()
            self.open = True
            self.sampler.gate(True)
        try:
            return self._tick()
        finally:
            self._close()

    def _gated_async_eval(self, *arrays):
        out = self._async_eval(*arrays)
        self._close()
        return out

    def median_ms(self) -> float:
        return float(np.median(self.spans)) * 1e3 if self.spans else float("nan")

    def undo(self) -> None:
        self._patches.undo()


def section_engine_sample(layers: int, batches: list[int], seconds: float, interval_us: int,
                          phase: str = "decode") -> None:
    """Where the engine thread's time goes, by C++ function: a wall-clock stack sampler
    (``native_sampler.py``) on the thread while B sequences decode (``phase`` decode), or
    while 512-token prompts prefill one after another (``prefill``: at one row the GPU idles
    ~2 ms of a 13.3 ms prefill, run 98). The tick split says forward 0.45-0.6 ms + encode
    1.3-1.9 ms a one-row decode step (runs 100-102); this says in what."""
    import os
    import threading

    import gpu_decode as gd
    from native_sampler import Sampler, report
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.api import EngineRequest

    sampler = Sampler()

    def thread_report(stacks):
        return report(stacks, top=40, log=log, focus=("mlx", "cuda", "libcu", "core.cpython", "tandem"),
                      parents=("mlx::core::eval_impl", "mlx::core::gpu::eval", "eval_gpu", "commit",
                               "mlx::core::compile", "libcuda", "libcudart"))

    eng = _probe_engine(layers, max(batches))
    eng.start()
    vocab = gd._vocab()
    RESULTS.setdefault("engine_sample", [])
    try:
        engine_thread = next(t for t in threading.enumerate() if t.name == "tandem-engine")
        for n in sorted({1, *batches}):
            eng.generate_many([(np.random.randint(0, vocab, 512).tolist(),
                                SamplingParams(max_tokens=8, ignore_eos=True))] * n, timeout=300)
        if phase in ("prefill", "prefill-lead"):
            gated = _LeadInGate(eng, sampler) if phase == "prefill-lead" else None
            sampler.start(engine_thread.native_id, interval_us=interval_us)
            if gated is not None:
                sampler.gate(False)
            t0 = time.perf_counter()
            try:
                count = _sample_prefills(eng, vocab, seconds)
            finally:
                elapsed = time.perf_counter() - t0
                stacks = sampler.stop()
                if gated is not None:
                    gated.undo()
            what = "the lead-in (idle tick to its first hand-over's return) of " if gated else ""
            log(f"\n== engine thread, {what}prefill 1 x 512, {layers} layers: {count} prefills in {elapsed:.1f} s "
                f"({count * 512 / elapsed:,.0f} tok/s with the gaps), sampled every {interval_us} us"
                + (f", lead-in median {gated.median_ms():.3f} ms" if gated else ""))
            r = thread_report(stacks)
            r.update(phase=phase, prefills=count, seconds=elapsed, interval_us=interval_us,
                     lead_in_ms=gated.median_ms() if gated else None)
            RESULTS["engine_sample"].append(r)
            return
        for B in batches:
            counts = {"tokens": 0, "finished": 0}
            finished = threading.Event()
            lock = threading.Lock()

            def on_event(ev, B=B):
                with lock:
                    counts["tokens"] += len(ev.tokens)
                    if ev.finish_reason is not None:
                        counts["finished"] += 1
                        if counts["finished"] == B:
                            finished.set()

            tokens = 4096 if B == 1 else 512
            ids = [os.urandom(16) for _ in range(B)]
            for rid in ids:
                eng.submit(EngineRequest(rid, np.random.randint(0, vocab, 512).tolist(),
                                         SamplingParams(max_tokens=tokens, ignore_eos=True), on_event))
            while counts["tokens"] < 16 * B:
                time.sleep(0.002)
            c0, t0 = counts["tokens"], time.perf_counter()
            sampler.start(engine_thread.native_id, interval_us=interval_us)
            time.sleep(seconds)
            stacks = sampler.stop()
            rate = (counts["tokens"] - c0) / (time.perf_counter() - t0)
            log(f"\n== engine thread, decode batch {B}, {layers} layers: {rate:,.0f} tok/s while sampled "
                f"every {interval_us} us for {seconds:.1f} s")
            r = thread_report(stacks)
            r.update(batch=B, tok_per_s=rate, interval_us=interval_us)
            RESULTS["engine_sample"].append(r)
            for rid in ids:
                eng.abort(rid)
            finished.wait(300)
    finally:
        eng.stop()
        os.environ.pop("TANDEM_PAGED_KERNELS", None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="floor,trace")
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--format", default="dual")
    ap.add_argument("--w4-rows", default="8,16,32,64")
    ap.add_argument("--w4-products", default="qkv,o,gate/up,down")
    ap.add_argument("--w4g-rows", default="8,16,32,48,64")
    ap.add_argument("--profile-forward", action="store_true",
                    help="step-replay: cProfile the engine thread's forward calls per batch size")
    ap.add_argument("--w4g-parts", action="store_true",
                    help="w4gemm: also its probe variants (math only, no dequant, loads only)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sample-seconds", type=float, default=3.0, help="engine-sample: seconds sampled a batch")
    ap.add_argument("--sample-interval", type=int, default=250, help="engine-sample: us between samples")
    ap.add_argument("--sample-phase", choices=("decode", "prefill", "prefill-lead"), default="decode",
                    help="engine-sample: sample steady decode at --batches, one-row prefills back to back, "
                         "or only their lead-ins (idle tick to the first hand-over's return)")
    ap.add_argument("--ctx", type=int, default=576, help="attention-serial: context tokens")
    ap.add_argument("--stream-shapes", default="1x8x1,1x8x2,1x16x1,1x4x4,1x8x4,2x8x1,2x4x2,1x4x1",
                    help="qgemv-stream: CPLxHxP block shapes to time")
    ap.add_argument("--warmup-plan", choices=("causes", "remedies", "components"), default="causes",
                    help="graph-warmup: what runs before each timed set of steps")
    ap.add_argument("--only", default="", help="qgemv-chain: only the variants whose label contains this")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    secs = args.sections.split(",")
    if "floor" in secs:
        section_floor(args.chain)
    if "qgemv" in secs:
        section_qgemv()
    if "qgemv-stream" in secs:
        section_qgemv_stream(args.stream_shapes)
    if "attention" in secs:
        section_attention()
    if "embed" in secs:
        section_embed()
    if "gemm" in secs:
        section_gemm([int(b) for b in args.batches.split(",")])
    if "attention-serial" in secs:
        section_attention_serial([int(b) for b in args.batches.split(",")], args.ctx)
    if "kv-loads" in secs:
        section_kv_loads([int(b) for b in args.batches.split(",")], args.ctx)
    if "kv-floor" in secs:
        section_kv_floor([int(b) for b in args.batches.split(",")], args.ctx)
    if "attention-cold" in secs:
        section_attention_serial([int(b) for b in args.batches.split(",")], args.ctx, flush=True)
    if "decode-block" in secs:
        section_decode_block()
    if "qgemv-chain" in secs:
        section_qgemv_chain(only=args.only)
    if "w4mma" in secs:
        section_w4mma(tuple(int(r) for r in args.w4_rows.split(",")), args.w4_products)
    if "w4gemm" in secs:
        section_w4gemm(tuple(int(r) for r in args.w4g_rows.split(",")), args.w4_products + ",head",
                       args.w4g_parts)
    if "graph-replay" in secs:
        section_graph_replay(args.layers)
    if "graph-warmup" in secs:
        section_graph_warmup(args.layers, plan_name=args.warmup_plan)
    if "engine-ramp" in secs:
        section_engine_ramp(args.layers, out)
    if "prefill-timeline" in secs:
        section_prefill_timeline(args.layers, out)
    if "step-replay" in secs:
        section_step_replay(args.layers, [int(b) for b in args.batches.split(",")], args.profile_forward)
    if "engine-sample" in secs:
        section_engine_sample(args.layers, [int(b) for b in args.batches.split(",")], args.sample_seconds,
                              args.sample_interval, args.sample_phase)
    if "engine-trace" in secs:
        section_engine_trace(args.layers, [int(b) for b in args.batches.split(",")], out)
    if "trace" in secs:
        try:
            section_trace(args.layers, [int(b) for b in args.batches.split(",")], args.format,
                          args.steps, out)
        except Exception as e:  # the trace is optional: torch or CUPTI may be missing
            log(f"trace failed: {type(e).__name__}: {e}")
    (out / "gpu_probe.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
