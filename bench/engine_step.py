"""The C decode step alone: time per call at a batch size and key count, on the default model.

    .venv/bin/python bench/engine_step.py --rows 16 --keys 234 --steps 40 --repeats 5

Builds the model's :class:`~tandem.pipeline.runners.cpu.native_decode.NativeDecode`, fills a decode
mirror of random keys and values (``--keys`` per row, spread +-``--spread``), and times
``NativeDecode.step`` (embedding lookup, RoPE tables, the C call, logits back to mlx)
and the C call alone. Each repeat is ``--steps`` calls; prints min and median over
repeats of the per-call mean, and, with ``--profile``, where the C call's time went
(the kernel built with ``-DQ4_PROF``: wall time per part, summed over the timed calls).
Writes nothing unless ``--out`` is given (then ``<out>.md`` and ``<out>.json``).
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

from tandem.kernels.cpu import cpu_kernels  # noqa: E402
from tandem.pipeline.runners.cpu import fast_llama
from tandem.kernels.cpu import q4_kernels

PARTS = ["rms_norm", "qkv", "attn+rope+kv", "o_proj", "gate_up", "silu", "down", "head", "final norm"]


def _lib_from(path: Path, profile: bool):
    """The kernels built from another C file (and/or with -DQ4_PROF: per-part timers)."""
    src = ("#define Q4_PROF 1\n" if profile else "") + cpu_kernels._SOURCE + path.read_text()
    lib = cpu_kernels.build_library("q4_kernels_prof" if profile else "q4_kernels_ab", src)
    P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    for name in ("q4_decode_step", "q4_rows"):  # the module's own signatures
        if hasattr(lib, name):
            getattr(lib, name).argtypes = getattr(q4_kernels._lib, name).argtypes
            getattr(lib, name).restype = ctypes.c_int
    if profile:
        lib.q4_prof_read.argtypes = [P]
    return lib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--keys", type=int, default=234, help="mean keys per row (170-token prompt + 64 decoded)")
    ap.add_argument("--spread", type=int, default=60)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ab", default=None, metavar="FILE.c",
                    help="also time a variant of q4_kernels.c, alternating with it; compares the logits")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tandem.pipeline import model_store
    from tandem.pipeline.loader import load_model

    path = model_store.resolve_model(args.model)
    lm = load_model(path)
    fast = fast_llama.FastLlama(lm.model)
    nat = fast.native
    if nat is None:
        print(f"no native decode: {fast.native_why}")
        return 1
    if args.profile:
        q4_kernels._lib = _lib_from(q4_kernels._SOURCE_FILE, True)
    libs = {"this": q4_kernels._lib}
    if args.ab:
        libs["variant"] = _lib_from(Path(args.ab), args.profile)
    B = args.rows
    hidden, hq, hkv, d, inter = nat.dims
    rng = np.random.default_rng(0)
    lens = np.clip(args.keys + rng.integers(-args.spread, args.spread + 1, B), 1, None).astype(np.int32)
    cap = int(-(-(lens.max() + 1) // 128) * 128)
    nl = len(lm.model.model.layers)
    kmir = [rng.normal(size=(B, hkv, cap, d)).astype(np.float32) for _ in range(nl)]
    vmir = [rng.normal(size=(B, hkv, cap, d)).astype(np.float32) for _ in range(nl)]
    tokens = mx.array(rng.integers(100, 40000, (B, 1)).astype(np.int32))
    offset = mx.array(lens - 1)
    cos, sin = fast.decode.tables(offset, B)
    x0 = np.array(nat.embed(tokens).reshape(B, -1), np.float32)
    c = np.ascontiguousarray(np.array(cos).reshape(-1, B).T)
    s = np.ascontiguousarray(np.array(sin).reshape(-1, B).T)

    host = q4_kernels.HostMirror(kmir, vmir)

    def c_call():
        return q4_kernels.decode_step(nat.layers, nat.head, nat.norm_w, x0.copy(), nat.dims, c, s, host,
                                      lens, cap, nat.eps, nat.scale)

    out = {}
    for name, lib in libs.items():
        q4_kernels._lib = lib
        for _ in range(3):
            out[name] = c_call()
        if args.profile:
            lib.q4_prof_read(None)  # reset
    if args.ab:
        same = np.array_equal(out["this"], out["variant"])
        diff = float(np.abs(out["this"] - out["variant"]).max())
        top = float(np.mean(out["this"].argmax(1) == out["variant"].argmax(1)))
        print(f"variant logits: bit-identical {same}, max abs diff {diff:.3g}, same argmax {top:.3f}")
    times = {name: [] for name in libs}
    for _ in range(args.repeats):
        for name, lib in libs.items():
            q4_kernels._lib = lib
            t0 = time.perf_counter()
            for _ in range(args.steps):
                c_call()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    if args.ab:
        for name, ts in times.items():
            print(f"{name:>8}: C call min {min(ts):.2f} ms, median {statistics.median(ts):.2f} ms")
    q4_kernels._lib = libs["this"]
    per_call = times["this"]
    full = []
    for _ in range(max(1, args.repeats // 2)):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            mx.eval(nat.step(tokens, (host, lens, cap)))
        full.append((time.perf_counter() - t0) / args.steps * 1e3)
    logits = c_call()
    res = {"rows": B, "keys_mean": float(lens.mean()), "c_call_ms_min": min(per_call),
           "c_call_ms_median": statistics.median(per_call), "step_ms_min": min(full),
           "logits_checksum": float(np.float64(logits).sum())}
    print(f"rows {B}, keys {lens.min()}-{lens.max()} (mean {lens.mean():.0f}): C call min {min(per_call):.2f} ms, "
          f"median {statistics.median(per_call):.2f} ms; whole step min {min(full):.2f} ms; "
          f"logits checksum {res['logits_checksum']:.6f}")
    if args.profile:
        n = args.repeats * args.steps + max(1, args.repeats // 2) * args.steps + 1
        if args.ab:  # the variant's timers: its own calls only
            n = args.repeats * args.steps
            q4_kernels._lib = libs["variant"]
        buf = (ctypes.c_double * 32)()
        q4_kernels._lib.q4_prof_read(buf)
        total = sum(buf[i] for i in range(len(PARTS)))
        res["profile_ms_per_call"] = {}
        print(f"{'part':<14}{'ms/call':>9}{'share':>8}")
        for i, name in enumerate(PARTS):
            ms = buf[i] / n * 1e3
            res["profile_ms_per_call"][name] = ms
            print(f"{name:<14}{ms:9.2f}{buf[i] / total * 100:7.1f}%")
        print(f"{'sum':<14}{total / n * 1e3:9.2f}")
        extra = {"jobs/call": buf[20] / n, "caller wait in join (ms)": buf[21] / n * 1e3,
                 "caller own part (ms)": buf[22] / n * 1e3}
        res["pool"] = extra
        for k, v in extra.items():
            print(f"{k:<28}{v:9.2f}")
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
