"""One prefill forward of the default model, timed part by part and A/B between product paths.

    .venv/bin/python bench/prefill.py --rows 4 --tokens 154 --prefix 16 --repeats 4

Runs :class:`~tandem.pipeline.runners.cpu.fast_llama.FastLlama` on ``--rows`` prompts of ``--tokens``
new tokens each over mlx-lm KV caches that already hold ``--prefix`` tokens (the serving
bench's chat prompts: ~170 tokens of which the first 16-token block is prefix-cached),
alternating between the prefill products through mlx (MKL) and through numpy's OpenBLAS
on the kernels' pool (``q4_kernels.blas_rows``) on the dense fp32 weights (and with
``--packed`` on the packed 4-bit weights auto loads), and reports min and median per path and
how far their logits are apart. ``--gemm`` also times each product shape alone through
both paths (and MKL called directly, without mlx). With ``--out DIR`` writes
``DIR/prefill-<rows>x<tokens>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tandem  # noqa: E402,F401  (BLAS choice before mlx)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from tandem import _blas  # noqa: E402
from tandem.pipeline.runners.cpu import fast_llama  # noqa: E402
from tandem.kernels.cpu import q4_kernels


def _forward(fast, tokens: np.ndarray, prefix: int) -> tuple[np.ndarray, float]:
    B, T = tokens.shape
    caches = [KVCache() for _ in fast.inner.layers]
    if prefix:
        mx.eval(fast(mx.array(tokens[:, :prefix]), caches, None, 0, None))
    x = mx.array(tokens[:, prefix:])
    mx.eval(x)
    t0 = time.perf_counter()
    logits = fast(x, caches, None, 0, mx.full((B,), T - prefix - 1, mx.int32))
    mx.eval(logits)
    return np.array(logits), time.perf_counter() - t0


def _gemm_table(M: int, reps: int) -> list[dict]:
    sg = _blas.openblas_sgemm()
    mkl = ctypes.CDLL(None)
    I, P, F = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    mkl.cblas_sgemm.argtypes = [I, I, I, I, I, I, F, P, I, P, I, F, P, I]
    rows = []
    rng = np.random.default_rng(0)
    for N, K in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        w = rng.standard_normal((N, K), np.float32)
        x = rng.standard_normal((M, K), np.float32)
        out = np.empty((N, M), np.float32)
        wm, xm = mx.array(w), mx.array(x)
        mx.eval(wm, xm)
        paths = {"mlx (MKL)": lambda: mx.eval(wm @ xm.T),
                 "MKL direct": lambda: mkl.cblas_sgemm(101, 111, 112, N, M, K, 1.0, w.ctypes.data, K, x.ctypes.data,
                                                       K, 0.0, out.ctypes.data, M),
                 "OpenBLAS on the pool": lambda: q4_kernels.blas_rows(sg, w, x, True)}
        best = {k: 1e9 for k in paths}
        n = max(3, int(3e8 / (2 * M * N * K)))
        for _ in range(reps):
            for k, fn in paths.items():
                time.sleep(0.25)  # MKL's OpenMP threads spin for 200 ms after a call
                fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                best[k] = min(best[k], (time.perf_counter() - t0) / n)
        row = {"M": M, "N": N, "K": K}
        for k, t in best.items():
            row[k] = {"ms": t * 1e3, "gflops": 2 * M * N * K / t / 1e9}
        rows.append(row)
        print(f"M {M} N {N} K {K}: " + ", ".join(f"{k} {v['ms']:.2f} ms ({v['gflops']:.0f} GFLOP/s)"
                                                  for k, v in row.items() if isinstance(v, dict)), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=154, help="new tokens per row (after the prefix)")
    ap.add_argument("--prefix", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--left-below", type=int, default=None,
                    help="FastLlama.left_below for the OpenBLAS path (the host layers run below it); the mlx path "
                         "keeps the default")
    ap.add_argument("--blocks", default=None, help="comma list: also alternate q4_kernels.BLAS_BLOCKS values")
    ap.add_argument("--gemm", action="store_true", help="also time each product shape alone")
    ap.add_argument("--packed", action="store_true",
                    help="also alternate the model loaded auto (packed 4-bit weights, no dense copy)")
    ap.add_argument("--out", default=None, help="a folder: writes prefill-<rows>x<tokens>.md and .json there")
    args = ap.parse_args()

    from tandem.pipeline import model_store
    from tandem.pipeline.loader import load_model

    path = model_store.resolve_model(args.model)
    lm = load_model(path, "dense")
    fast = fast_llama.FastLlama(lm.model)
    packed = None
    if args.packed:
        packed_lm = load_model(path, "auto")
        packed = fast_llama.FastLlama(packed_lm.model)
        if not packed.packed:
            print(f"--packed: auto loads this model as {packed_lm.weights}, not packed")
            return 1
    sg = fast.prefill_sgemm
    default_left = fast.left_below
    if sg is None:
        print("no OpenBLAS prefill products here (numpy without its bundled OpenBLAS, or no C kernels)")
        return 1
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 40000, (args.rows, args.prefix + args.tokens)).astype(np.int32)
    paths = {"mlx (MKL)": (fast, None, None), "OpenBLAS on the pool": (fast, sg, None)}
    for b in (args.blocks.split(",") if args.blocks else []):
        paths[f"OpenBLAS, {b} blocks per thread"] = (fast, sg, int(b))
    if packed is not None:
        paths["packed 4-bit weights (no dense copy)"] = (packed, packed.prefill_sgemm, None)
    times = {k: [] for k in paths}
    logits = {}
    default_blocks = q4_kernels.BLAS_BLOCKS
    for r in range(args.repeats + 1):
        for name, (f, s, blocks) in paths.items():
            if f is fast:
                fast.prefill_sgemm = s
                fast.left_below = (args.left_below or default_left) if s is not None else default_left
            q4_kernels.BLAS_BLOCKS = blocks or default_blocks
            time.sleep(0.25)
            logits[name], t = _forward(f, tokens, args.prefix)
            if r:  # the first round warms up
                times[name].append(t * 1e3)
    a, b = list(logits.values())[:2]
    diff = float(np.abs(a - b).max())
    same = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    if packed is not None:  # against the dense weights through the same OpenBLAS path
        p = logits["packed 4-bit weights (no dense copy)"]
        packed_diff = float(np.abs(p - b).max())
    M = args.rows * args.tokens
    lines = [f"# Prefill forward, {args.rows} x {args.tokens} new tokens over a {args.prefix}-token prefix "
             f"({M} rows), min / median of {args.repeats} alternating rounds", "",
             "| products | min ms | median ms | vs mlx (MKL), median |", "|---|---:|---:|---:|"]
    base = statistics.median(times["mlx (MKL)"])
    for name, ts in times.items():
        lines.append(f"| {name} | {min(ts):.1f} | {statistics.median(ts):.1f} | {statistics.median(ts) / base:.3f}x |")
    lines += ["", f"Logits: max abs difference {diff:.3g}, same argmax {same:.3f}."]
    if packed is not None:
        ratio = statistics.median(times["packed 4-bit weights (no dense copy)"]) / statistics.median(
            times["OpenBLAS on the pool"])
        lines += [f"Packed against dense through OpenBLAS: {ratio:.3f}x the median time, logits max abs "
                  f"difference {packed_diff:.3g}."]
    result = {"rows": args.rows, "tokens": args.tokens, "prefix": args.prefix, "times_ms": times,
              "logits_max_abs_diff": diff, "same_argmax": same}
    if args.gemm:
        result["gemm"] = _gemm_table(M, 3)
        lines += ["", f"Each product alone at {M} rows (ms, best of 3 alternating; GFLOP/s):", "",
                  "| N x K | " + " | ".join(k for k in result["gemm"][0] if k not in "MNK") + " |",
                  "|---|" + "---:|" * 3]
        for row in result["gemm"]:
            lines.append(f"| {row['N']} x {row['K']} | " + " | ".join(
                f"{v['ms']:.2f} ({v['gflops']:.0f})" for k, v in row.items() if isinstance(v, dict)) + " |")
    md = "\n".join(lines) + "\n"
    if args.out:
        from bench._common import write_results

        write_results(args.out, f"prefill-{args.rows}x{args.tokens}", md, result)
    else:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
