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
directory. Without a compiler (or with ``TANDEM_CPU_KERNELS=0``), :func:`available` is
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

log = logging.getLogger("tandem.engine")

_SOURCE = r"""
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

typedef struct {
    const float *q, *k, *v;
    float *o;
    const int *lens;
    long hkv, rep, d, cap;
    float scale;
    long lo, hi;        /* (row, kv head) pairs [lo, hi) */
    float *scratch;     /* rep * max(lens) scores */
} job_t;

/* Softmax(q k^T * scale) v for the rep query heads that share one kv head, over the
   first lens[row] keys: scores first (each key row read once for all rep queries),
   then the weighted sum of value rows. */
static void run(const job_t *j) {
    const long d = j->d, rep = j->rep, cap = j->cap;
    float *s = j->scratch;
    for (long bh = j->lo; bh < j->hi; bh++) {
        const long n = j->lens[bh / j->hkv];
        const float *K = j->k + bh * cap * d, *V = j->v + bh * cap * d;
        const float *Q = j->q + bh * rep * d;
        float *O = j->o + bh * rep * d;
        for (long t = 0; t < n; t++) {
            const float *kr = K + t * d;
            for (long r = 0; r < rep; r++) {
                const float *qr = Q + r * d;
                float acc = 0.0f;
                for (long i = 0; i < d; i++) acc += qr[i] * kr[i];
                s[r * n + t] = acc * j->scale;
            }
        }
        for (long r = 0; r < rep; r++) {
            float *sr = s + r * n, m = -FLT_MAX, sum = 0.0f;
            for (long t = 0; t < n; t++) m = sr[t] > m ? sr[t] : m;
            for (long t = 0; t < n; t++) { sr[t] = expf(sr[t] - m); sum += sr[t]; }
            const float inv = 1.0f / sum;
            for (long t = 0; t < n; t++) sr[t] *= inv;
            for (long i = 0; i < d; i++) O[r * d + i] = 0.0f;
        }
        for (long t = 0; t < n; t++) {
            const float *vr = V + t * d;
            for (long r = 0; r < rep; r++) {
                const float p = s[r * n + t];
                float *orow = O + r * d;
                for (long i = 0; i < d; i++) orow[i] += p * vr[i];
            }
        }
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
    float *scratch = malloc(sizeof(float) * rep * maxlen * threads);
    if (!scratch) return -1;
    long at = 0, done = 0;
    for (long t = 0; t < threads; t++) {
        long lo = at, goal = total * (t + 1) / threads;
        while (at < pairs && (t == threads - 1 || done < goal)) done += lens[at++ / hkv];
        jobs[t] = (job_t){q, k, v, o, lens, hkv, rep, d, cap, scale, lo, at,
                          scratch + t * rep * maxlen};
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

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fPIC", "-shared", "-pthread"]

_lib = None
_why: str | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "kernels"


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cc).encode()).hexdigest()[:16]
    out = _cache_dir() / f"decode_attention-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / "decode_attention.c"
            src.write_text(_SOURCE)
            built = Path(tmp) / out.name
            subprocess.run([cc, *_FLAGS, "-o", str(built), str(src), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(built, out)  # atomic: concurrent builders leave one whole file
    lib = ctypes.CDLL(str(out))
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_long]
    return lib


def available() -> bool:
    """Whether the compiled kernel can be used (built on the first call)."""
    global _lib, _why
    if _lib is None and _why is None:
        if os.environ.get("TANDEM_CPU_KERNELS", "1").strip() == "0":
            _why = "TANDEM_CPU_KERNELS=0"
        else:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                _why = f"{e} {detail.decode(errors='replace')[:500]}".strip()
                log.info("decode attention stays on mlx ops (could not build the C kernel: %s)", _why)
    return _lib is not None


def threads() -> int:
    n = os.environ.get("TANDEM_ATTENTION_THREADS", "").strip()
    return int(n) if n else (os.cpu_count() or 1)


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
