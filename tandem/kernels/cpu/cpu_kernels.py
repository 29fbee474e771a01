"""Decode attention as one C call per layer, for the CPU backend.

A decode step attends one query per row over its whole context. Written as mlx ops
that is a batched matmul for the scores and another for the values, which mlx runs as
one single-threaded ``cblas_sgemm`` per (row, head): MKL reaches only about 10 GB/s on
those (3 x 64) @ (64 x n) products, with the second core idle, and the softmax between
them is another ten ops. At 16 rows of 300 tokens (the 135M default model) that was
about 38 ms of a 97 ms step.

:func:`decode_attention` does the same work in one pass per (row, kv head) over keys
and values that already lie contiguous in the runner's decode mirror, split over the
machine's cores: 13 ms for the same 30 layers, close to what the memory can deliver
(the keys and values of every layer are read once per step, 220 MB here).

The C source is compiled on first use with the system's C compiler into tandem's cache
directory. Without a compiler (or with ``engine.native_kernels = false``), :func:`available` is
False and the runner keeps the mlx formulation in :func:`cpu_math.attention`. The
flags allow reassociating sums (so the dot products vectorize) but not the rest of
``-ffast-math``: that links a startup file that flushes denormals to zero for the
whole process, mlx's ops included.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from tandem import knobs

log = logging.getLogger("tandem.engine")

_SOURCE = r"""
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef struct {
    const float *q, *k, *v;
    float *o;
    const int *lens;
    long hkv, rep, d, cap;
    float scale;
    long lo, hi;        /* (row, kv head) pairs [lo, hi) */
    long maxlen;
    float *scratch;     /* rep * maxlen scores, then rep * d sums */
} job_t;

/* e**x as cpu_math.exp computes it: x log2(e) split into an integer n and f in
   [-1/2, 1/2], 2**f by its Taylor polynomial, 2**n put in the exponent bits (x below -87
   gives about 1e-38, never a denormal; above 88 the largest power of two). Relative
   error below 1e-6; a plain function so loops over it vectorize (libm's expf is one call
   per element). Attention uses it on scores minus their maximum, the 4-bit decode step
   (q4_kernels) in SiLU. */
static inline float exp_poly(float x) {
    float y = x * 1.4426950408889634f;
    y = y < -126.0f ? -126.0f : (y > 127.0f ? 127.0f : y);
    /* rintf, not the add-and-subtract rounding trick: reassociation may fold that away. */
    const float nf = rintf(y);
    const float f = y - nf;
    float p = 1.5252733804059841e-05f;
    p = p * f + 1.5403530393381609e-04f;
    p = p * f + 1.3333558146428443e-03f;
    p = p * f + 9.6181291076284772e-03f;
    p = p * f + 5.5504108664821580e-02f;
    p = p * f + 2.4022650695910071e-01f;
    p = p * f + 6.9314718055994531e-01f;
    p = p * f + 1.0f;
    union { int i; float f; } scale = {((int)nf + 127) << 23};
    return p * scale.f;
}

/* The largest of s[0 .. n), NaNs passed over (what `m = s[t] > m ? s[t] : m` from
   -FLT_MAX gives: GCC leaves that loop scalar, a compare chained through every score,
   which took a sixth of a decode step's attention). A maximum is exact in any order. */
static inline float row_max(const float *restrict s, long n) {
    float m = -FLT_MAX;
    long t = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        __m512 v = _mm512_set1_ps(-FLT_MAX);
        for (; t + 16 <= n; t += 16) v = _mm512_max_ps(_mm512_loadu_ps(s + t), v);  /* NaN in s: keeps v */
        m = _mm512_reduce_max_ps(v);
    }
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    return m;
}

/* Softmax(q k^T * scale) v for the rep query heads that share one kv head, over the
   first n keys: scores first (each key row read once for all rep queries), then the
   weighted sum of value rows, accumulated in a local block. Inlined with a constant d
   so the compiler can keep q rows and accumulators in registers. */
static inline __attribute__((always_inline)) void attend_pair(
        const float *restrict Q, const float *restrict K, const float *restrict V, float *restrict O,
        long n, long rep, long d, float scale, float *restrict s, float *restrict acc) {
    for (long t = 0; t < n; t++) {
        const float *kr = K + t * d;
        for (long r = 0; r < rep; r++) {
            const float *qr = Q + r * d;
            float dot = 0.0f;
            for (long i = 0; i < d; i++) dot += qr[i] * kr[i];
            s[r * n + t] = dot * scale;
        }
    }
    for (long r = 0; r < rep; r++) {
        float *sr = s + r * n, m = row_max(sr, n), sum = 0.0f;
        for (long t = 0; t < n; t++) { sr[t] = exp_poly(sr[t] - m); sum += sr[t]; }
        const float inv = 1.0f / sum;
        for (long t = 0; t < n; t++) sr[t] *= inv;
    }
    for (long i = 0; i < rep * d; i++) acc[i] = 0.0f;
    for (long t = 0; t < n; t++) {
        const float *vr = V + t * d;
        for (long r = 0; r < rep; r++) {
            const float p = s[r * n + t];
            for (long i = 0; i < d; i++) acc[r * d + i] += p * vr[i];
        }
    }
    for (long i = 0; i < rep * d; i++) O[i] = acc[i];
}

static void run(const job_t *j) {
    const long d = j->d, rep = j->rep, cap = j->cap;
    float *s = j->scratch, *acc = j->scratch + j->rep * j->maxlen;
    for (long bh = j->lo; bh < j->hi; bh++) {
        const long n = j->lens[bh / j->hkv];
        const float *K = j->k + bh * cap * d, *V = j->v + bh * cap * d;
        const float *Q = j->q + bh * rep * d;
        float *O = j->o + bh * rep * d;
        if (d == 64 && rep == 3) attend_pair(Q, K, V, O, n, 3, 64, j->scale, s, acc);
        else if (d == 64 && rep == 4) attend_pair(Q, K, V, O, n, 4, 64, j->scale, s, acc);
        else if (d == 128 && rep == 4) attend_pair(Q, K, V, O, n, 4, 128, j->scale, s, acc);
        else if (d == 64) attend_pair(Q, K, V, O, n, rep, 64, j->scale, s, acc);
        else if (d == 128) attend_pair(Q, K, V, O, n, rep, 128, j->scale, s, acc);
        else attend_pair(Q, K, V, O, n, rep, d, j->scale, s, acc);
    }
}

static void *thread_main(void *arg) { run((const job_t *)arg); return NULL; }

/* q (B, hkv*rep, d); k, v (B, hkv, cap, d); o (B, hkv*rep, d). Returns 0, or -1 if
   scratch memory could not be had. Pairs are split between threads by key count so
   ragged rows still balance. */
int decode_attention(const float *q, const float *k, const float *v, float *o,
                     const int *lens, long B, long hkv, long rep, long d, long cap,
                     float scale, long threads) {
    enum { MAX_THREADS = 64 };
    long pairs = B * hkv, total = 0, maxlen = 1;
    for (long b = 0; b < B; b++) {
        total += (long)lens[b] * hkv;
        if (lens[b] > maxlen) maxlen = lens[b];
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > pairs) threads = pairs;
    if (threads < 1) threads = 1;
    job_t jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    const long per = rep * (maxlen + d);
    float *scratch = malloc(sizeof(float) * per * threads);
    if (!scratch) return -1;
    long at = 0, done = 0;
    for (long t = 0; t < threads; t++) {
        long lo = at, goal = total * (t + 1) / threads;
        while (at < pairs && (t == threads - 1 || done < goal)) done += lens[at++ / hkv];
        jobs[t] = (job_t){q, k, v, o, lens, hkv, rep, d, cap, scale, lo, at, maxlen, scratch + t * per};
    }
    long started = 0;
    for (long t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, thread_main, &jobs[t]) != 0) break;
        started = t;
    }
    run(&jobs[0]);
    for (long t = started + 1; t < threads; t++) run(&jobs[t]);  /* threads that failed to start */
    for (long t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    free(scratch);
    return 0;
}
"""

_FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fPIC", "-shared", "-pthread"]
# Tried in order: the machine's own vector width first (512-bit vectors: 9.4 instead of
# 10.3 ms for 30 layers on the 2-core EPYC), then whatever the compiler takes.
_TUNING = (["-march=native", "-mprefer-vector-width=512"], ["-march=native"], [])

_lib = None
_why: str | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "kernels"


def _cpu_identity() -> str:
    """The CPU model and its feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.machine() + platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def build_library(name: str, source: str) -> ctypes.CDLL:
    """Compile ``source`` (C) into a shared library in tandem's cache directory, once per
    source, flags, compiler and CPU, and load it. Raises OSError or SubprocessError."""
    cc = os.environ.get("CC", "cc")
    # The CPU is part of the key: a -march=native build loaded on another CPU that shares
    # this cache (a home directory on several hosts) could stop with SIGILL.
    tag = hashlib.sha256((source + " ".join(_FLAGS) + repr(_TUNING) + cc + _cpu_identity()).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{name}-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            built = Path(tmp) / out.name
            for i, tuning in enumerate(_TUNING):
                try:
                    subprocess.run([cc, *_FLAGS, *tuning, "-o", str(built), str(src), "-lm"], check=True,
                                   capture_output=True, timeout=120)
                    break
                except subprocess.CalledProcessError:
                    if i == len(_TUNING) - 1:
                        raise
            os.replace(built, out)  # atomic: concurrent builders leave one whole file
    return ctypes.CDLL(str(out))


def _build() -> ctypes.CDLL:
    lib = build_library("decode_attention", _SOURCE)
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_long]
    return lib


def available() -> bool:
    """Whether the compiled kernel can be used (built on the first call)."""
    global _lib, _why
    if _lib is None and _why is None:
        try:
            _lib = _build()
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            _why = f"{e} {detail.decode(errors='replace')[:500]}".strip()
            log.info("decode attention stays on mlx ops (could not build the C kernel: %s)", _why)
    return _lib is not None


def threads() -> int:
    """Threads per call: ``TANDEM_ATTENTION_THREADS`` (``tandem.knobs``), else one per core."""
    return knobs.ATTENTION_THREADS or os.cpu_count() or 1


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray, scale: float,
                     num_threads: int | None = None) -> np.ndarray:
    """q (B, Hq, D); k, v (B, Hkv, cap, D), all float32 and C-contiguous; lens (B,) keys
    each row sees (1 <= lens[b] <= cap) -> (B, Hq, D): softmax(q k^T * scale) v over
    each row's first lens[b] keys, query head h reading kv head h // (Hq // Hkv)."""
    assert _lib is not None, "call available() first"
    B, Hq, D = q.shape
    _, Hkv, cap, _ = k.shape
    assert k.shape == v.shape == (B, Hkv, cap, D) and Hq % Hkv == 0
    for a in (q, k, v):
        assert a.dtype == np.float32 and a.flags.c_contiguous
    lens = np.ascontiguousarray(lens, np.int32)
    assert lens.shape == (B,) and lens.min() >= 1 and lens.max() <= cap
    out = np.empty((B, Hq, D), np.float32)
    rc = _lib.decode_attention(q.ctypes.data, k.ctypes.data, v.ctypes.data, out.ctypes.data,
                               lens.ctypes.data, B, Hkv, Hq // Hkv, D, cap, scale,
                               num_threads or threads())
    if rc != 0:
        raise MemoryError("decode attention: no memory for the score scratch")
    return out
