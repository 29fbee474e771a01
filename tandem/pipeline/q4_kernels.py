"""4-bit weights multiplied straight from their packed form, and a whole decode step in C.

With dense fp32 weights a decode step of the default model (SmolLM2-135M) reads
~430 MB of layer weights plus ~113 MB of vocabulary per step, and between the
projections mlx runs some 30 small ops per layer whose dispatch costs more than their
arithmetic. Here the weights stay as the checkpoint stored them, 4-bit codes ``q`` with
a scale ``d`` and offset ``m`` per 32 weights (GGUF's Q4_1, mlx's affine 4-bit), and
each block is expanded in registers: the 16 values ``d*q + m`` can take form a table,
and one AVX-512 permute per 16 weights looks the codes up in it. The table is computed
the way mlx dequantizes (for fp16 scales: ``d*q`` rounded to fp16, ``+ m`` rounded to
fp16), so every weight the kernel multiplies is bit for bit the dense weight the rest
of tandem (and mlx-lm) uses; :class:`Q4Matrix` checks that against the dense array
before it is used. Only the order of the sums differs from a BLAS product.

:func:`decode_step` runs all layers of one decode step (RMSNorm, QKV, RoPE from
tables, the KV append to the runner's decode mirror, attention as in
:mod:`cpu_kernels`, output projection, SwiGLU MLP) and the vocabulary projection in
one call, on a small persistent thread pool (one thread per core).

Built with :func:`cpu_kernels.build_library`; needs AVX-512F (otherwise
:func:`available` is False and the mlx/MKL path runs). ``TANDEM_Q4_KERNELS=0`` turns
it off (as does ``TANDEM_CPU_KERNELS=0``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess

import numpy as np

from tandem.pipeline import cpu_kernels

log = logging.getLogger("tandem.engine")

_Q4_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <stdatomic.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* bits 4: codes two per byte with, per 32 weights, either a 16-entry fp16 table of the
   values (lut) or a scale and an offset (dm); bits 8: a byte per code with dm; bits 16:
   the values themselves as fp16 (nib holds them). */
typedef struct { const uint8_t *nib; const float *dm; const uint16_t *lut; long n, k, round16, bits; } q4mat;
typedef struct { q4mat qkv, o, gu, down; const float *qkv_bias, *ln1, *ln2; } q4layer;

int q4_supported(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* ---- a persistent pool: the caller runs part 0, workers the others ---- */
typedef void (*part_fn)(void *ctx, long part, long parts);
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;  /* one parallel caller at a time */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static long pool_workers = 0, pool_ready = 0;
static atomic_long pool_gen = 0, pool_left = 0;
static part_fn pool_fn;
static void *pool_ctx;
static long pool_parts;
enum { SPIN = 4000 };  /* ~0.1 ms of pause before sleeping: steps call back to back */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *pool_main(void *arg) {
    const long id = (long)arg;
    long seen = 0;  /* workers start before the first job is posted (pool_init holds call_mu) */
    for (;;) {
        long g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool_gen, memory_order_acquire)) == seen) {
            if (++spins < SPIN) { relax(); continue; }
            pthread_mutex_lock(&pool_mu);
            while ((g = atomic_load(&pool_gen)) == seen) pthread_cond_wait(&pool_cv, &pool_mu);
            pthread_mutex_unlock(&pool_mu);
            break;
        }
        seen = g;
        if (id < pool_parts) pool_fn(pool_ctx, id, pool_parts);
        atomic_fetch_sub_explicit(&pool_left, 1, memory_order_release);
    }
    return NULL;
}

static void pool_forget(void) {  /* in a forked child: the workers did not come along */
    pool_workers = 0;
    pool_ready = 0;
    atomic_store(&pool_gen, 0);
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
}

static void pool_init(long threads) {  /* under call_mu */
    if (pool_ready) return;
    pool_ready = 1;
    pthread_atfork(NULL, NULL, pool_forget);
    if (atomic_load(&pool_gen) != 0) return;
    for (long i = 1; i < threads && i < 64; i++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, pool_main, (void *)i);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool_workers = i;
    }
}

static void parallel(part_fn fn, void *ctx, long parts) {
    if (parts > pool_workers + 1) parts = pool_workers + 1;
    if (parts <= 1) { fn(ctx, 0, 1); return; }
    pool_fn = fn; pool_ctx = ctx; pool_parts = parts;
    atomic_store(&pool_left, pool_workers);
    pthread_mutex_lock(&pool_mu);
    atomic_fetch_add_explicit(&pool_gen, 1, memory_order_release);
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    fn(ctx, 0, parts);
    while (atomic_load_explicit(&pool_left, memory_order_acquire) > 0) relax();
}

#ifdef __AVX512F__
/* ---- 4-bit rows expanded to fp32, then a 2-row x up-to-8-column register tile ---- */
static inline __m512 round_half(__m512 v) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* Row n of w as fp32 into buf (k floats). Block b's byte j holds the codes of weights
   32b+j (low nibble) and 32b+16+j (high); vpermps reads only an index's low 4 bits. */
static inline void expand_row8(const q4mat *w, long n, float *restrict buf) {
    const long nb = w->k / 32;
    const uint8_t *codes = w->nib + n * w->k;
    const float *dm = w->dm + n * nb * 2;
    for (long b = 0; b < nb; b++) {
        const __m512 d = _mm512_set1_ps(dm[2 * b]), m = _mm512_set1_ps(dm[2 * b + 1]);
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 32 * b + 16 * h))));
            v = _mm512_mul_ps(v, d);
            if (w->round16) v = round_half(v);
            __asm__("" : "+v"(v));
            v = _mm512_add_ps(v, m);
            if (w->round16) v = round_half(v);
            _mm512_storeu_ps(buf + 32 * b + 16 * h, v);
        }
    }
}

static inline void expand_row(const q4mat *w, long n, float *restrict buf) {
    if (w->bits == 8) { expand_row8(w, n, buf); return; }
    const long nb = w->k / 32;
    if (w->bits == 16) {
        const uint16_t *v = (const uint16_t *)w->nib + n * w->k;
        for (long t = 0; t < w->k; t += 16)
            _mm512_storeu_ps(buf + t, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + t))));
        return;
    }
    const uint8_t *codes = w->nib + n * (w->k / 2);
    if (w->lut) {
        const uint16_t *lt = w->lut + n * nb * 16;
        for (long b = 0; b < nb; b++) {
            const __m512 lut = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lt + 16 * b)));
            __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * b)));
            _mm512_storeu_ps(buf + 32 * b, _mm512_permutexvar_ps(idx, lut));
            _mm512_storeu_ps(buf + 32 * b + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut));
        }
        return;
    }
    const float *dm = w->dm + n * nb * 2;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (long b = 0; b < nb; b++) {
        __m512 lut = _mm512_mul_ps(iota, _mm512_set1_ps(dm[2 * b]));
        if (w->round16) lut = round_half(lut);
        __asm__("" : "+v"(lut));  /* a multiply, then an add: never contracted into an FMA */
        lut = _mm512_add_ps(lut, _mm512_set1_ps(dm[2 * b + 1]));
        if (w->round16) lut = round_half(lut);
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * b)));
        _mm512_storeu_ps(buf + 32 * b, _mm512_permutexvar_ps(idx, lut));
        _mm512_storeu_ps(buf + 32 * b + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut));
    }
}

/* Ask for row n's bytes ahead of time: rows are expanded between bursts of multiplies,
   so the hardware's stream prefetch alone left the expansion waiting on memory. */
static inline void prefetch_row(const q4mat *w, long n) {
    if (n >= w->n) return;
    const char *a, *b = NULL;
    long na, nb = 0;
    if (w->bits == 16) { a = (const char *)w->nib + n * w->k * 2; na = w->k * 2; }
    else if (w->bits == 8) { a = (const char *)w->nib + n * w->k; na = w->k; b = (const char *)(w->dm + n * (w->k / 32) * 2); nb = w->k / 4; }
    else {
        a = (const char *)w->nib + n * (w->k / 2); na = w->k / 2;
        if (w->lut) { b = (const char *)(w->lut + n * (w->k / 32) * 16); nb = w->k; }
        else { b = (const char *)(w->dm + n * (w->k / 32) * 2); nb = w->k / 4; }
    }
    for (long i = 0; i < na; i += 64) _mm_prefetch(a + i, _MM_HINT_T0);
    for (long i = 0; i < nb; i += 64) _mm_prefetch(b + i, _MM_HINT_T0);
}

/* Sums of 16 vectors, out[i] = sum of v[i]'s lanes, in 15 adds and a few shuffles. */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
    for (int k = 0; k < 2; k++)
        c[k] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * k], b[2 * k + 1]), _mm512_unpackhi_ps(b[2 * k], b[2 * k + 1]));
    __m512 d = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))));
    /* d[4l + e] holds the sum of v[4e + l] */
    const __m512i back = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(back, d);
}

/* out[c] = row0 . x_c and out[8 + c] = row1 . x_c for the MC columns x_c (rows of x). */
static inline __attribute__((always_inline)) void tile(const float *restrict w0, const float *restrict w1,
                                                        const float *restrict x, long k, int MC, float *out) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (long t = 0; t < k; t += 16) {
        const __m512 u = _mm512_loadu_ps(w0 + t), v = _mm512_loadu_ps(w1 + t);
#pragma GCC unroll 8
        for (int c = 0; c < MC; c++) {
            __m512 xc = _mm512_loadu_ps(x + c * k + t);
            __asm__("" : "+v"(xc));  /* one load for both rows (GCC would fold it into each FMA) */
            acc[c] = _mm512_fmadd_ps(u, xc, acc[c]);
            acc[8 + c] = _mm512_fmadd_ps(v, xc, acc[8 + c]);
        }
    }
    if (MC == 8) {
        _mm512_storeu_ps(out, sum16(acc));
    } else {
        for (int c = 0; c < MC; c++) {
            out[c] = _mm512_reduce_add_ps(acc[c]);
            out[8 + c] = _mm512_reduce_add_ps(acc[8 + c]);
        }
    }
}

typedef struct {
    const q4mat *w;
    const float *x, *bias;
    long m, ldy, accumulate;
    float *y;
    atomic_long next;  /* the next chunk of rows to take */
} mm_job;

/* Rows go out in chunks that each thread takes as it gets free, not in one fixed share
   per thread: on a shared 2-core machine the other thread is often descheduled for a
   while (the edge, the broker, MKL's spinning OpenMP threads), and a fixed share left
   the caller waiting for it. */
enum { CHUNKS_PER_THREAD = 8 };

static void mm_rows(const mm_job *j, long lo, long hi, float *buf);

static void mm_part(void *arg, long part, long parts) {
    mm_job *j = arg;
    const long n = j->w->n, k = j->w->k;
    long chunk = (n / (parts * CHUNKS_PER_THREAD) + 1) & ~1L;
    if (chunk < 2) chunk = 2;
    float *buf = aligned_alloc(64, sizeof(float) * 2 * k);
    if (!buf) return;  /* leaves rows unwritten: cannot happen for the sizes used */
    for (;;) {
        const long c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (c * chunk >= n) break;
        mm_rows(j, c * chunk, (c + 1) * chunk < n ? (c + 1) * chunk : n, buf);
    }
    free(buf);
}

static void mm_rows(const mm_job *j, long lo, long hi, float *buf) {
    const q4mat *w = j->w;
    const long n = w->n, k = w->k;
    float out[16];
    /* Columns in blocks of COLS, so that a block of x stays in the core's L2 while every
       row pair passes over it (a prefill's x is megabytes); a row pair is expanded once
       per block, which costs little next to COLS columns of multiplies. */
    enum { COLS = 64 };
    for (long cb = 0; cb < j->m; cb += COLS)
    for (long r = lo; r < hi; r += 2) {
        const long r1 = r + 1 < n ? r + 1 : r;
        const long ce = cb + COLS < j->m ? cb + COLS : j->m;
        prefetch_row(w, r + 2);
        prefetch_row(w, r + 3);
        expand_row(w, r, buf);
        expand_row(w, r1, buf + k);
        for (long c0 = cb; c0 < ce; c0 += 8) {
            const int mc = ce - c0 < 8 ? (int)(ce - c0) : 8;
            const float *xc = j->x + c0 * k;
            switch (mc) {
                case 8: tile(buf, buf + k, xc, k, 8, out); break;
                case 7: tile(buf, buf + k, xc, k, 7, out); break;
                case 6: tile(buf, buf + k, xc, k, 6, out); break;
                case 5: tile(buf, buf + k, xc, k, 5, out); break;
                case 4: tile(buf, buf + k, xc, k, 4, out); break;
                case 3: tile(buf, buf + k, xc, k, 3, out); break;
                case 2: tile(buf, buf + k, xc, k, 2, out); break;
                default: tile(buf, buf + k, xc, k, 1, out); break;
            }
            for (int c = 0; c < mc; c++) {
                float *y = j->y + (c0 + c) * j->ldy;
                for (int h = 0; h < 2 && r + h < n; h++) {
                    float s = out[8 * h + c];
                    if (j->bias) s += j->bias[r + h];
                    y[r + h] = j->accumulate ? y[r + h] + s : s;
                }
            }
        }
    }
}

static void matmul(const q4mat *w, const float *x, long m, float *y, long ldy, long accumulate,
                   const float *bias, long parts) {
    mm_job j = {w, x, bias, m, ldy, accumulate, y, 0};
    parallel(mm_part, &j, parts);
}

/* y (m, w->n) = x (m, w->k) @ w.T */
int q4_matmul(const q4mat *w, const float *x, long m, float *y, long threads) {
    pthread_mutex_lock(&call_mu);
    pool_init(threads);
    mm_job j = {w, x, NULL, m, w->n, 0, y, 0};
    parallel(mm_part, &j, threads);
    pthread_mutex_unlock(&call_mu);
    return 0;
}

/* w as the fp32 values the kernel multiplies: (n, k) */
int q4_expand(const q4mat *w, float *out) {
    for (long r = 0; r < w->n; r++) expand_row(w, r, out + r * w->k);
    return 0;
}

/* ---- the rest of a decode step ---- */
static void rms_norm(const float *x, const float *wt, float *out, long b, long n, float eps) {
    for (long r = 0; r < b; r++) {
        const float *xr = x + r * n;
        float ss = 0.0f;
        for (long i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (long i = 0; i < n; i++) out[r * n + i] = wt[i] * (xr[i] * inv);
    }
}

typedef struct {
    const float *qkv;
    float *const *kmir, *const *vmir;
    float *o;
    const int *lens;
    const long *order;  /* pairs, longest rows first */
    long npairs, layer, hq, hkv, d, cap, ld, maxlen;
    float scale;
    atomic_long next;
} at_job;

static void at_part(void *arg, long part, long parts) {
    at_job *j = arg;
    const long rep = j->hq / j->hkv, d = j->d;
    float *s = malloc(sizeof(float) * rep * (j->maxlen + d));
    if (!s) return;
    (void)part; (void)parts;
    /* (row, kv head) pairs one at a time, longest rows first (they are ordered by the
       caller), to whichever thread is free: see mm_part */
    for (;;) {
        const long at = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (at >= j->npairs) break;
        const long bh = j->order[at];
        const long b = bh / j->hkv, g = bh % j->hkv, n = j->lens[b];
        const float *K = j->kmir[j->layer] + bh * j->cap * d, *V = j->vmir[j->layer] + bh * j->cap * d;
        const float *Q = j->qkv + b * j->ld + g * rep * d;
        float *O = j->o + b * j->hq * d + g * rep * d;
        if (d == 64 && rep == 3) attend_pair(Q, K, V, O, n, 3, 64, j->scale, s, s + rep * j->maxlen);
        else if (d == 64) attend_pair(Q, K, V, O, n, rep, 64, j->scale, s, s + rep * j->maxlen);
        else if (d == 128) attend_pair(Q, K, V, O, n, rep, 128, j->scale, s, s + rep * j->maxlen);
        else attend_pair(Q, K, V, O, n, rep, d, j->scale, s, s + rep * j->maxlen);
    }
    free(s);
}

/* ---- prefill helpers over token columns: x (rows, t) ---- */
typedef struct { float *x; const float *cos_t, *sin_t; const float *gu; float *a; long heads, d, t, inter; } col_job;

static void rope_part(void *arg, long part, long parts) {
    const col_job *j = arg;
    const long half = j->d / 2, pairs = j->heads * half, t = j->t;
    for (long p = pairs * part / parts; p < pairs * (part + 1) / parts; p++) {
        const long h = p / half, i = p % half;
        float *x1 = j->x + (h * j->d + i) * t, *x2 = x1 + half * t;
        const float *c = j->cos_t + i * t, *s = j->sin_t + i * t;
        for (long k = 0; k < t; k++) {
            const float a = x1[k], b = x2[k];
            x1[k] = a * c[k] - b * s[k];
            x2[k] = a * s[k] + b * c[k];
        }
    }
}

/* Rotate rows (h*d + i, h*d + i + d/2) of x (rows, t), heads h < heads, by the cos/sin
   tables (d/2, t) of each column's position, in place. */
int rope_cols(float *x, long heads, long d, long t, const float *cos_t, const float *sin_t, long threads) {
    col_job j = {x, cos_t, sin_t, NULL, NULL, heads, d, t, 0};
    pthread_mutex_lock(&call_mu);
    pool_init(threads);
    parallel(rope_part, &j, threads);
    pthread_mutex_unlock(&call_mu);
    return 0;
}

static void rope_rows_part(void *arg, long part, long parts) {
    const col_job *j = arg;  /* x (t, ld): token rows; cos_t, sin_t (t, d/2) */
    const long half = j->d / 2;
    for (long r = j->t * part / parts; r < j->t * (part + 1) / parts; r++) {
        const float *c = j->cos_t + r * half, *s = j->sin_t + r * half;
        for (long h = 0; h < j->heads; h++) {
            float *v = j->x + r * j->inter + h * j->d;
            for (long i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = a * s[i] + b * c[i];
            }
        }
    }
}

/* The same rotation for x (t, ld) with a token per row: columns h*d + i and h*d + i + d/2;
   cos, sin (t, d/2). */
int rope_rows(float *x, long heads, long d, long t, long ld, const float *cos_t, const float *sin_t, long threads) {
    col_job j = {x, cos_t, sin_t, NULL, NULL, heads, d, t, ld};
    pthread_mutex_lock(&call_mu);
    pool_init(threads);
    parallel(rope_rows_part, &j, threads);
    pthread_mutex_unlock(&call_mu);
    return 0;
}

static void silu_t_part(void *arg, long part, long parts) {
    const col_job *j = arg;  /* gu (t, 2 * inter) -> a (t, inter) */
    const long I = j->inter;
    for (long r = j->t * part / parts; r < j->t * (part + 1) / parts; r++)
        for (long i = 0; i < I; i++) {
            const float g = j->gu[r * 2 * I + i], u = j->gu[r * 2 * I + I + i];
            j->a[r * I + i] = g * (1.0f / (1.0f + exp_poly(-g))) * u;
        }
}

int silu_cols(const float *gu, long inter, long t, float *a, long threads) {
    col_job j = {NULL, NULL, NULL, gu, a, 0, 0, t, inter};
    pthread_mutex_lock(&call_mu);
    pool_init(threads);
    parallel(silu_t_part, &j, threads);
    pthread_mutex_unlock(&call_mu);
    return 0;
}

static void silu_part(void *arg, long part, long parts) {
    const col_job *j = arg;
    const long n = j->inter * j->t;
    for (long e = n * part / parts; e < n * (part + 1) / parts; e++) {
        const float g = j->gu[e], u = j->gu[n + e];
        j->a[e] = g * (1.0f / (1.0f + exp_poly(-g))) * u;
    }
}

/* a (inter, t) = silu(gate) * up for gu (2 * inter, t): gate rows, then up rows. */
int silu_rows(const float *gu, long inter, long t, float *a, long threads) {
    col_job j = {NULL, NULL, NULL, gu, a, 0, 0, t, inter};
    pthread_mutex_lock(&call_mu);
    pool_init(threads);
    parallel(silu_part, &j, threads);
    pthread_mutex_unlock(&call_mu);
    return 0;
}

/* x (B, hidden): the embedded tokens, overwritten; cos, sin (B, d/2); kmir, vmir: per
   layer the decode mirror (B, hkv, cap, d), the new entries go to position lens[b]-1;
   logits (B, vocab). Returns 0, or -1 without memory. */
int q4_decode_step(const q4layer *layers, long nl, const q4mat *head, const float *norm_w,
                   float *x, long B, long hidden, long hq, long hkv, long d, long inter,
                   const float *cos_t, const float *sin_t, float *const *kmir, float *const *vmir,
                   const int *lens, long cap, float eps, float scale, float *logits, long threads) {
    const long F = (hq + 2 * hkv) * d, half = d / 2;
    long maxlen = 1;
    for (long b = 0; b < B; b++) maxlen = lens[b] > maxlen ? lens[b] : maxlen;
    float *h = malloc(sizeof(float) * B * (hidden + F + hq * d + 3 * inter));
    long *order = malloc(sizeof(long) * B * hkv);
    if (!h || !order) { free(h); free(order); return -1; }
    float *qkv = h + B * hidden, *o = qkv + B * F, *gu = o + B * hq * d, *a = gu + 2 * B * inter;
    pthread_mutex_lock(&call_mu);
    pool_init(threads);
    {   /* attention pairs, longest rows first (insertion sort: B is small) */
        long np_ = 0;
        for (long b = 0; b < B; b++) {
            long i = np_;
            while (i > 0 && lens[order[i - 1] / hkv] < lens[b]) i--;
            for (long m = np_ - 1; m >= i; m--) order[m + hkv] = order[m];
            for (long g = 0; g < hkv; g++) order[i + g] = b * hkv + g;
            np_ += hkv;
        }
    }
    for (long l = 0; l < nl; l++) {
        const q4layer *L = layers + l;
        rms_norm(x, L->ln1, h, B, hidden, eps);
        matmul(&L->qkv, h, B, qkv, F, 0, L->qkv_bias, threads);
        for (long b = 0; b < B; b++) {
            const float *c = cos_t + b * half, *s = sin_t + b * half;
            for (long hh = 0; hh < hq + hkv; hh++) {
                float *v = qkv + b * F + hh * d;
                for (long i = 0; i < half; i++) {
                    const float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * c[i] - x2 * s[i];
                    v[i + half] = x1 * s[i] + x2 * c[i];
                }
            }
            const long pos = lens[b] - 1;
            for (long g = 0; g < hkv; g++) {
                memcpy(kmir[l] + ((b * hkv + g) * cap + pos) * d, qkv + b * F + (hq + g) * d, sizeof(float) * d);
                memcpy(vmir[l] + ((b * hkv + g) * cap + pos) * d, qkv + b * F + (hq + hkv + g) * d, sizeof(float) * d);
            }
        }
        at_job aj = {qkv, kmir, vmir, o, lens, order, B * hkv, l, hq, hkv, d, cap, F, maxlen, scale, 0};
        parallel(at_part, &aj, threads);
        matmul(&L->o, o, B, x, hidden, 1, NULL, threads);
        rms_norm(x, L->ln2, h, B, hidden, eps);
        matmul(&L->gu, h, B, gu, 2 * inter, 0, NULL, threads);
        for (long b = 0; b < B; b++)
            for (long i = 0; i < inter; i++) {
                const float g = gu[b * 2 * inter + i], u = gu[b * 2 * inter + inter + i];
                a[b * inter + i] = g * (1.0f / (1.0f + exp_poly(-g))) * u;
            }
        matmul(&L->down, a, B, x, hidden, 1, NULL, threads);
    }
    rms_norm(x, norm_w, h, B, hidden, eps);
    matmul(head, h, B, logits, head->n, 0, NULL, threads);
    pthread_mutex_unlock(&call_mu);
    free(order);
    free(h);
    return 0;
}
#endif
"""


class _Mat(ctypes.Structure):
    _fields_ = [("nib", ctypes.c_void_p), ("dm", ctypes.c_void_p), ("lut", ctypes.c_void_p), ("n", ctypes.c_long),
                ("k", ctypes.c_long),
                ("round16", ctypes.c_long), ("bits", ctypes.c_long)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Mat), ("o", _Mat), ("gu", _Mat), ("down", _Mat), ("qkv_bias", ctypes.c_void_p),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p)]


_lib = None
_why: str | None = None


def _build() -> ctypes.CDLL:
    lib = cpu_kernels.build_library("q4_kernels", cpu_kernels._SOURCE + _Q4_SOURCE)
    if not lib.q4_supported():
        raise OSError("the CPU or compiler has no AVX-512F")
    P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    lib.q4_matmul.argtypes = [P, P, L, P, L]
    lib.q4_expand.argtypes = [P, P]
    lib.q4_decode_step.argtypes = [P, L, P, P, P, L, L, L, L, L, L, P, P, P, P, P, L, F, F, P, L]
    lib.rope_cols.argtypes = [P, L, L, L, P, P, L]
    lib.silu_rows.argtypes = [P, L, L, P, L]
    lib.rope_rows.argtypes = [P, L, L, L, L, P, P, L]
    lib.silu_cols.argtypes = [P, L, L, P, L]
    for fn in (lib.q4_matmul, lib.q4_expand, lib.q4_decode_step, lib.rope_cols, lib.silu_rows, lib.rope_rows,
               lib.silu_cols):
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the 4-bit kernels can be used (built on the first call)."""
    global _lib, _why
    if _lib is None and _why is None:
        if os.environ.get("TANDEM_Q4_KERNELS", "1").strip() == "0":
            _why = "TANDEM_Q4_KERNELS=0"
        elif not cpu_kernels.available():
            _why = f"no C kernels ({cpu_kernels._why})"
        else:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError, AttributeError) as e:
                detail = getattr(e, "stderr", b"") or b""
                _why = f"{e} {detail.decode(errors='replace')[:500]}".strip()
                log.info("decode stays on the mlx/MKL path (no 4-bit kernels: %s)", _why)
    return _lib is not None


def why_not() -> str | None:
    return _why


class Q4Matrix:
    """One (n, k) weight matrix as 4-bit (or 8-bit) codes plus a scale and an offset per
    32 weights.

    Built from mlx's affine layout (``weight`` uint32 holding 8 (or 4) codes per word, low
    bits first; ``scales`` and ``biases`` per group of 32 or 64 along k): value =
    scale * code + bias, computed in the scales' precision (fp16 scales: rounded to fp16
    after the multiply and after the add, as ``mx.dequantize`` does). 4-bit codes are
    stored two per byte, block by block: byte j of a 32-weight block holds the codes of
    weights j (low nibble) and 16 + j (high nibble)."""

    def __init__(self, codes: np.ndarray, dm: np.ndarray, round16: bool, bits: int = 4, table: bool = True):
        self.nib = np.ascontiguousarray(codes, np.uint8)  # (n, k/2), or (n, k) for 8 bits
        self.dm = np.ascontiguousarray(dm, np.float32)  # (n, k/32, 2)
        self.bits = bits
        self.n, self.k = self.nib.shape[0], self.nib.shape[1] * 8 // bits
        assert bits in (4, 8) and self.dm.shape == (self.n, self.k // 32, 2)
        self.round16 = bool(round16)
        self.lut = self.values16 = None
        if self.round16 and bits == 4 and table:
            # Every value is an fp16 number: a table of the 16 a block can take costs one
            # conversion per 32 weights in the kernel instead of a multiply, an add and
            # four conversions (1.5 bytes per weight instead of 0.75).
            codes16 = np.arange(16, dtype=np.float32)
            t = (self.dm[:, :, :1] * codes16).astype(np.float16).astype(np.float32) + self.dm[:, :, 1:]
            self.lut = np.ascontiguousarray(t.astype(np.float16).view(np.uint16))  # (n, k/32, 16)
        elif self.round16:
            # 8-bit codes take 256 values per block: the fp16 values themselves (2 bytes per weight).
            self.values16 = np.ascontiguousarray(self.reference().astype(np.float16).view(np.uint16))
        data = self.values16 if self.values16 is not None else self.nib
        self.c = _Mat(data.ctypes.data, self.dm.ctypes.data, None if self.lut is None else self.lut.ctypes.data,
                      self.n, self.k, int(round16), 16 if self.values16 is not None else bits)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for one product."""
        if self.values16 is not None:
            return self.values16.nbytes
        return self.nib.nbytes + (self.lut.nbytes if self.lut is not None else self.dm.nbytes)

    @classmethod
    def from_mlx(cls, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int,
                 round16: bool) -> "Q4Matrix":
        n = weight.shape[0]
        k = scales.shape[1] * group_size
        bits = weight.shape[1] * 32 // k
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit weights: only 4 and 8 bits have kernels")
        if group_size % 32 or k % group_size:
            raise ValueError(f"group size {group_size} for {k} columns: need groups of a multiple of 32")
        raw = np.ascontiguousarray(weight).view(np.uint8).reshape(n, k * bits // 8)
        rep = group_size // 32
        d = np.repeat(np.asarray(scales, np.float32), rep, axis=1)
        m = np.repeat(np.asarray(biases, np.float32), rep, axis=1)
        if bits == 8:
            return cls(raw, np.stack([d, m], axis=-1), round16, 8)
        codes = np.empty((n, k), np.uint8)
        codes[:, 0::2] = raw & 15
        codes[:, 1::2] = raw >> 4
        blocks = codes.reshape(n, k // 32, 2, 16)
        nib = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)
        return cls(nib, np.stack([d, m], axis=-1), round16)

    @classmethod
    def stack(cls, parts: list["Q4Matrix"]) -> "Q4Matrix":
        assert len({(p.round16, p.bits) for p in parts}) == 1
        return cls(np.concatenate([p.nib for p in parts]), np.concatenate([p.dm for p in parts]), parts[0].round16,
                   parts[0].bits)

    def expand(self) -> np.ndarray:
        """The (n, k) float32 values the kernel multiplies."""
        out = np.empty((self.n, self.k), np.float32)
        _lib.q4_expand(ctypes.byref(self.c), out.ctypes.data)
        return out

    def reference(self) -> np.ndarray:
        """The same values in numpy (what mx.dequantize computes)."""
        if self.bits == 8:
            codes = self.nib.reshape(self.n, self.k // 32, 32).astype(np.float32)
        else:
            nib = self.nib.reshape(self.n, self.k // 32, 16)
            codes = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.float32)  # (n, k/32, 32)
        w = codes * self.dm[:, :, :1]
        if self.round16:
            w = w.astype(np.float16).astype(np.float32)
        w = w + self.dm[:, :, 1:]
        if self.round16:
            w = w.astype(np.float16).astype(np.float32)
        return w.reshape(self.n, self.k)

    def matmul(self, x: np.ndarray, num_threads: int | None = None) -> np.ndarray:
        """x (m, k) float32 -> x @ W.T (m, n)."""
        x = np.ascontiguousarray(x, np.float32)
        assert x.ndim == 2 and x.shape[1] == self.k
        y = np.empty((x.shape[0], self.n), np.float32)
        _lib.q4_matmul(ctypes.byref(self.c), x.ctypes.data, x.shape[0], y.ctypes.data,
                       num_threads or cpu_kernels.threads())
        return y


def layer_struct(qkv: Q4Matrix, o: Q4Matrix, gu: Q4Matrix, down: Q4Matrix, qkv_bias: np.ndarray | None,
                 ln1: np.ndarray, ln2: np.ndarray) -> _Layer:
    return _Layer(qkv.c, o.c, gu.c, down.c, None if qkv_bias is None else qkv_bias.ctypes.data,
                  ln1.ctypes.data, ln2.ctypes.data)


def layers_array(layers: list[_Layer]):
    return (_Layer * len(layers))(*layers)


def decode_step(layers, head: Q4Matrix, norm_w: np.ndarray, x: np.ndarray, dims: tuple, cos: np.ndarray,
                sin: np.ndarray, kmir: list[np.ndarray], vmir: list[np.ndarray], lens: np.ndarray, cap: int,
                eps: float, scale: float) -> np.ndarray:
    """One decode step, every layer and the vocabulary projection -> logits (B, vocab).

    x (B, hidden) float32 (overwritten); dims = (hidden, Hq, Hkv, D, intermediate);
    cos, sin (B, D/2); kmir/vmir: per layer a C-contiguous float32 buffer of
    (B, Hkv, cap, D) into which each row's new key and value are written at position
    lens[b] - 1 before the attention reads the first lens[b] positions."""
    hidden, hq, hkv, d, inter = dims
    B = x.shape[0]
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.shape == (B, hidden)
    assert cos.shape == sin.shape == (B, d // 2) and cos.flags.c_contiguous and sin.flags.c_contiguous
    lens = np.ascontiguousarray(lens, np.int32)
    assert lens.shape == (B,) and lens.min() >= 1 and lens.max() <= cap
    for m in (*kmir, *vmir):
        assert m.dtype == np.float32 and m.flags.c_contiguous and m.size == B * hkv * cap * d
    nl = len(kmir)
    kp = (ctypes.c_void_p * nl)(*[m.ctypes.data for m in kmir])
    vp = (ctypes.c_void_p * nl)(*[m.ctypes.data for m in vmir])
    logits = np.empty((B, head.n), np.float32)
    rc = _lib.q4_decode_step(layers, nl, ctypes.byref(head.c), norm_w.ctypes.data, x.ctypes.data, B, hidden,
                             hq, hkv, d, inter, cos.ctypes.data, sin.ctypes.data, kp, vp, lens.ctypes.data, cap,
                             eps, scale, logits.ctypes.data, cpu_kernels.threads())
    if rc != 0:
        raise MemoryError("4-bit decode step: no memory for its buffers")
    return logits


def rope_cols(x: np.ndarray, heads: int, d: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (rows, t) float32, C-contiguous: rows h*d + i and h*d + i + d/2 (h < heads)
    rotated in place by cos, sin (d/2, t) -> x. What mlx's non-traditional RoPE computes
    for a head laid out along rows, with the position tables of each column."""
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable and x.shape[0] >= heads * d
    t = x.shape[1]
    assert cos.shape == sin.shape == (d // 2, t) and cos.flags.c_contiguous and sin.flags.c_contiguous
    _lib.rope_cols(x.ctypes.data, heads, d, t, cos.ctypes.data, sin.ctypes.data, cpu_kernels.threads())
    return x


def silu_rows(gu: np.ndarray) -> np.ndarray:
    """gu (2 * inter, t) float32: gate rows then up rows -> silu(gate) * up (inter, t)."""
    assert gu.dtype == np.float32 and gu.flags.c_contiguous and gu.shape[0] % 2 == 0
    inter, t = gu.shape[0] // 2, gu.shape[1]
    a = np.empty((inter, t), np.float32)
    _lib.silu_rows(gu.ctypes.data, inter, t, a.ctypes.data, cpu_kernels.threads())
    return a


def rope_rows(x: np.ndarray, heads: int, d: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """:func:`rope_cols` for x (t, features) with a token per row; cos, sin (t, d/2)."""
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable and x.shape[1] >= heads * d
    t = x.shape[0]
    assert cos.shape == sin.shape == (t, d // 2) and cos.flags.c_contiguous and sin.flags.c_contiguous
    _lib.rope_rows(x.ctypes.data, heads, d, t, x.shape[1], cos.ctypes.data, sin.ctypes.data, cpu_kernels.threads())
    return x


def silu_cols(gu: np.ndarray) -> np.ndarray:
    """gu (t, 2 * inter) float32: gate columns then up columns -> silu(gate) * up (t, inter)."""
    assert gu.dtype == np.float32 and gu.flags.c_contiguous and gu.shape[1] % 2 == 0
    t, inter = gu.shape[0], gu.shape[1] // 2
    a = np.empty((t, inter), np.float32)
    _lib.silu_cols(gu.ctypes.data, inter, t, a.ctypes.data, cpu_kernels.threads())
    return a
