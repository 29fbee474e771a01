/* 4-bit weight products and a whole decode step for tandem/kernels/cpu/q4_kernels.py.

   Not compiled on its own: q4_kernels.py appends it to cpu_kernels' C source (which
   brings <pthread.h>, <math.h>, <stdlib.h>, exp_poly and attend_pair) and builds the
   result with cpu_kernels.build_library. */

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
/* The caller's wait for the workers at the end of a job: spin this many pauses, then
   sleep until the last worker wakes it. A worker that still owes its last chunk after
   that long has been descheduled (the edge, the broker or the client took its core),
   and a caller spinning on the other core left the worker no core to finish on (the
   scheduler moves it over when that core goes idle). */
enum { JOIN_SPIN = 2000 };
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static atomic_int caller_asleep = 0;

/* Per-part timers for bench/engine_step.py --profile (built with -DQ4_PROF only). */
#ifdef Q4_PROF
#include <time.h>
static double q4_prof[32];
static inline double prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
#define PROF_T double prof_t = prof_now()
#define PROF(i) do { const double prof_n = prof_now(); q4_prof[i] += prof_n - prof_t; prof_t = prof_n; } while (0)
int q4_prof_read(double *out) {
    if (out) memcpy(out, q4_prof, sizeof q4_prof);
    else memset(q4_prof, 0, sizeof q4_prof);
    return 0;
}
#else
#define PROF_T
#define PROF(i)
#endif

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Part i of the current job is run by whoever claims it first for its generation: its
   worker when it wakes, else the caller once its own part is done. A worker that the
   scheduler left off its core (the edge, the broker, the worker's IO thread, another
   process) then costs the job nothing unless it had already started its part: the
   caller used to wait at every job's end for each worker to wake and find no work left,
   and a step is ~150 jobs. */
static atomic_long part_gen[64];

static inline int claim_part(long i, long g) {
    long cur = atomic_load(&part_gen[i]);
    return cur < g && atomic_compare_exchange_strong(&part_gen[i], &cur, g);
}

static inline void part_done(void) {
    /* seq_cst here and in join(): the last one sees caller_asleep, or the caller sees 0 */
    if (atomic_fetch_sub(&pool_left, 1) == 1 && atomic_load(&caller_asleep)) {
        pthread_mutex_lock(&pool_mu);
        pthread_cond_signal(&done_cv);
        pthread_mutex_unlock(&pool_mu);
    }
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
        const part_fn fn = pool_fn;
        void *const ctx = pool_ctx;
        const long parts = pool_parts;
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&pool_gen, memory_order_relaxed) != g) continue;  /* a newer job came meanwhile */
        seen = g;
        if (id < parts && claim_part(id, g)) {
            fn(ctx, id, parts);
            part_done();
        }
    }
    return NULL;
}

static void pool_forget(void) {  /* in a forked child: the workers did not come along */
    pool_workers = 0;
    pool_ready = 0;
    atomic_store(&pool_gen, 0);
    for (int i = 0; i < 64; i++) atomic_store(&part_gen[i], 0);
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    atomic_store(&caller_asleep, 0);
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

static void join(void) {
    for (int spins = 0; atomic_load_explicit(&pool_left, memory_order_acquire) > 0; spins++) {
        if (spins < JOIN_SPIN) { relax(); continue; }
        pthread_mutex_lock(&pool_mu);
        atomic_store(&caller_asleep, 1);
        while (atomic_load(&pool_left) > 0) pthread_cond_wait(&done_cv, &pool_mu);
        atomic_store(&caller_asleep, 0);
        pthread_mutex_unlock(&pool_mu);
        return;
    }
}

static void parallel(part_fn fn, void *ctx, long parts) {
    if (parts > pool_workers + 1) parts = pool_workers + 1;
    if (parts <= 1) { fn(ctx, 0, 1); return; }
    pool_fn = fn; pool_ctx = ctx; pool_parts = parts;
    atomic_store(&pool_left, parts - 1);
    pthread_mutex_lock(&pool_mu);
    const long g = atomic_fetch_add_explicit(&pool_gen, 1, memory_order_release) + 1;
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    PROF_T;
    fn(ctx, 0, parts);
    for (long i = 1; i < parts; i++)  /* parts no worker has started: run them here */
        if (claim_part(i, g)) {
            fn(ctx, i, parts);
            part_done();
        }
    PROF(22);
    join();
    PROF(21);
#ifdef Q4_PROF
    q4_prof[20] += 1;
#endif
}

#ifdef __AVX512F__
/* One job from an exported entry point: callers from several threads take turns. */
static void run_job(part_fn fn, void *ctx, long threads) {
    pthread_mutex_lock(&call_mu);
    pool_init(threads);
    parallel(fn, ctx, threads);
    pthread_mutex_unlock(&call_mu);
}

/* ---- 4-bit rows expanded to fp32, then a 3-row x up-to-8-column register tile ---- */
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

/* The bytes of rows [n, n + count) that expand_row reads: two spans (codes, then the
   table or scales), each contiguous across consecutive rows. */
typedef struct { const char *a, *b; long na, nb, per; } pfspan;

static inline pfspan row_bytes(const q4mat *w, long n, long count) {
    pfspan p = {NULL, NULL, 0, 0, 1};
    if (n + count > w->n) count = w->n - n;
    if (count <= 0) return p;
    if (w->bits == 16) { p.a = (const char *)w->nib + n * w->k * 2; p.na = count * w->k * 2; }
    else if (w->bits == 8) {
        p.a = (const char *)w->nib + n * w->k; p.na = count * w->k;
        p.b = (const char *)(w->dm + n * (w->k / 32) * 2); p.nb = count * (w->k / 4);
    } else {
        p.a = (const char *)w->nib + n * (w->k / 2); p.na = count * (w->k / 2);
        if (w->lut) { p.b = (const char *)(w->lut + n * (w->k / 32) * 16); p.nb = count * w->k; }
        else { p.b = (const char *)(w->dm + n * (w->k / 32) * 2); p.nb = count * (w->k / 4); }
    }
    return p;
}

/* Ask for line `line` of the span (past its end: its last byte again). An asm
   statement, not _mm_prefetch: GCC's loop distribution moved the builtin out of the
   multiply loop into a loop of its own, all prefetches at once again. */
static inline void prefetch_line(const pfspan *p, long line) {
    const long off = line * 64, ob = off - p->na;
    const char *at = off < p->na ? p->a + off : (p->nb > 0 ? p->b + (ob < p->nb ? ob : p->nb - 1) : p->a + p->na - 1);
    __asm__ volatile("prefetcht0 %0" : : "m"(*at));
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

/* out[8 * i + c] = row i . x_c for the R = 3 rows of w (k floats each) and the MC
   columns x_c (rows of x): 24 accumulators, each x vector loaded once for three rows
   (two rows: 16, and 30 layers' products single-threaded took 64 instead of 55 ms,
   the loads of x from L2 being the limit at 1,536 columns). Each step of 16 weights
   also asks for pf->per lines of the next rows' bytes, from line `line`: spread over
   the multiplies, the next expansion finds its bytes in L1 (asked for all at once
   before the expansion, a 16-row product of weights streamed from memory ran ~20%
   slower than on weights in cache). */
enum { R = 3 };  /* the tile below is written for 3 */
static inline __attribute__((always_inline)) void tile(const float *restrict w, const float *restrict x, long k,
                                                        int MC, float *out, const pfspan *pf, long line) {
    __m512 acc[16], acc2[8];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int i = 0; i < 8; i++) acc2[i] = _mm512_setzero_ps();
    for (long t = 0; t < k; t += 16, line += pf->per) {
        for (long p = 0; p < pf->per; p++) prefetch_line(pf, line + p);
        const __m512 u = _mm512_loadu_ps(w + t), v = _mm512_loadu_ps(w + k + t), z = _mm512_loadu_ps(w + 2 * k + t);
#pragma GCC unroll 8
        for (int c = 0; c < MC; c++) {
            __m512 xc = _mm512_loadu_ps(x + c * k + t);
            __asm__("" : "+v"(xc));  /* one load for every row (GCC would fold it into each FMA) */
            acc[c] = _mm512_fmadd_ps(u, xc, acc[c]);
            acc[8 + c] = _mm512_fmadd_ps(v, xc, acc[8 + c]);
            acc2[c] = _mm512_fmadd_ps(z, xc, acc2[c]);
        }
    }
    /* Each sum is the same tree of its 16 lanes whichever way it is taken (sum16 sums each
       vector on its own; _mm512_reduce_add_ps takes the same halves in the same order). */
    if (MC == 8) {
        _mm512_storeu_ps(out, sum16(acc));
        __m512 v2[16];
        for (int c = 0; c < 8; c++) v2[c] = v2[8 + c] = acc2[c];
        _mm512_storeu_ps(out + 16, sum16(v2));  /* out has room for the second copy */
    } else {
        for (int c = 0; c < MC; c++) {
            out[c] = _mm512_reduce_add_ps(acc[c]);
            out[8 + c] = _mm512_reduce_add_ps(acc[8 + c]);
            out[16 + c] = _mm512_reduce_add_ps(acc2[c]);
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

/* ---- one activation row: rows of w straight from their codes into the dot products ----
   At one row nothing is reused, so expanding rows into a buffer first (mm_rows) only
   adds stores and loads, and three rows of one FMA chain each left the kernel waiting
   on the chains' latency (4 cycles a step of 16 weights). GV rows at a time keep enough
   chains in flight for one core to read the codes at its full bandwidth. Each output is
   the same lane-wise FMA chain over k and the same 16-lane sum as in tile(), so a row's
   products are bit-identical whichever path computed them. */
enum { GV = 8 };

/* Values v0, v1 (weights 32b .. 32b+31) of row `row` of w: the fp16 values themselves,
   or the block's 16 values (an fp16 table, or d and m as expand_row computes them)
   looked up by its codes. */
#define GV_HALF(row, b, v0, v1) do { \
        const uint16_t *hv_ = (const uint16_t *)w->nib + (row) * k + 32 * (b); \
        v0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hv_)); \
        v1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hv_ + 16))); } while (0)
#define GV_CODES(row, b, lut, v0, v1) do { \
        const __m512i ix_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->nib + (row) * (k / 2) + 16 * (b)))); \
        v0 = _mm512_permutexvar_ps(ix_, lut); \
        v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(ix_, 4), lut); } while (0)
#define GV_LUT(row, b, v0, v1) do { \
        const __m512 lt_ = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->lut + ((row) * nb + (b)) * 16))); \
        GV_CODES(row, b, lt_, v0, v1); } while (0)
#define GV_DM(row, b, v0, v1) do { \
        const float *dm_ = w->dm + ((row) * nb + (b)) * 2; \
        __m512 lt_ = _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(dm_[0])); \
        if (w->round16) lt_ = round_half(lt_); \
        __asm__("" : "+v"(lt_)); \
        lt_ = _mm512_add_ps(lt_, _mm512_set1_ps(dm_[1])); \
        if (w->round16) lt_ = round_half(lt_); \
        GV_CODES(row, b, lt_, v0, v1); } while (0)
#define GV_STEP(VAL, row, acc) do { __m512 v0_, v1_; VAL(row, b, v0_, v1_); \
        acc = _mm512_fmadd_ps(v0_, x0, acc); acc = _mm512_fmadd_ps(v1_, x1, acc); } while (0)
#define GV_LOOP8(VAL) \
    for (long b = 0; b < nb; b++) { \
        gv_prefetch(w, p, q, b, nb); \
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16); \
        GV_STEP(VAL, p, a0); GV_STEP(VAL, p + 1, a1); GV_STEP(VAL, p + 2, a2); GV_STEP(VAL, p + 3, a3); \
        GV_STEP(VAL, q, a4); GV_STEP(VAL, q + 1, a5); GV_STEP(VAL, q + 2, a6); GV_STEP(VAL, q + 3, a7); }
#define GV_LOOP1(VAL) \
    for (long b = 0; b < nb; b++) { \
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16); \
        GV_STEP(VAL, p, a0); }

/* The next tile's bytes (rows p+8.., or p+4.. and q+4.. when q is apart), a share of
   them per step of 32 weights. */
static inline __attribute__((always_inline)) void gv_prefetch(const q4mat *w, long p, long q, long b, long nb) {
    const long k = w->k;
    if (w->bits == 16) {
        const long row = 2 * k, per = (8 * row + 64 * nb - 1) / (64 * nb);
        const char *base = (const char *)w->nib + (p + 8) * row;
        for (long i = 0; i < per; i++) __asm__ volatile("prefetcht0 %0" : : "m"(base[(b * per + i) * 64]));
        return;
    }
    const long cb = k / 2, lb = w->lut ? k : 0;  /* bytes a row: codes, table */
    const long nxt = q == p + 4 ? p + 8 : p + 4, nq = q == p + 4 ? 0 : q + 4, rows = q == p + 4 ? 8 : 4;
    const long per = (rows * (cb + lb) + 64 * nb - 1) / (64 * nb);
    for (long i = 0; i < per; i++) {
        long off = (b * per + i) * 64;
        const char *at;
        if (off < rows * cb) at = (const char *)w->nib + nxt * cb + off;
        else at = (const char *)w->lut + nxt * lb + (off - rows * cb);
        __asm__ volatile("prefetcht0 %0" : : "m"(*at));
        if (nq) {
            at = off < rows * cb ? (const char *)w->nib + nq * cb + off : (const char *)w->lut + nq * lb + (off - rows * cb);
            __asm__ volatile("prefetcht0 %0" : : "m"(*at));
        }
    }
}

/* out[0..3] = rows p .. p+3 of w . x, out[4..7] = rows q .. q+3: eight independent FMA
   chains, each of one row (named registers: as arrays, GCC spilled them every step). */
static void gemv8(const q4mat *w, const float *x, long p, long q, float *out) {
    const long k = w->k, nb = k / 32;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    if (w->bits == 16) { GV_LOOP8(GV_HALF) }
    else if (w->lut) { GV_LOOP8(GV_LUT) }
    else { GV_LOOP8(GV_DM) }
    out[0] = _mm512_reduce_add_ps(a0); out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2); out[3] = _mm512_reduce_add_ps(a3);
    out[4] = _mm512_reduce_add_ps(a4); out[5] = _mm512_reduce_add_ps(a5);
    out[6] = _mm512_reduce_add_ps(a6); out[7] = _mm512_reduce_add_ps(a7);
}

/* Row p of w . x alone (tails). */
static float gemv1(const q4mat *w, const float *x, long p) {
    const long k = w->k, nb = k / 32;
    __m512 a0 = _mm512_setzero_ps();
    if (w->bits == 16) { GV_LOOP1(GV_HALF) }
    else if (w->lut) { GV_LOOP1(GV_LUT) }
    else { GV_LOOP1(GV_DM) }
    return _mm512_reduce_add_ps(a0);
}

static inline void gemv_put(const mm_job *j, long r, float s) {
    if (j->bias) s += j->bias[r];
    j->y[r] = j->accumulate ? j->y[r] + s : s;
}

static void gemv_rows(const mm_job *j, long lo, long hi) {
    float out[GV];
    long r = lo;
    for (; r + GV <= hi; r += GV) {
        gemv8(j->w, j->x, r, r + 4, out);
        for (int i = 0; i < GV; i++) gemv_put(j, r + i, out[i]);
    }
    for (; r < hi; r++) gemv_put(j, r, gemv1(j->w, j->x, r));
}

/* One row's gate/up product and SwiGLU in one job: each tile takes GV gate rows and the
   GV up rows that pair with them (w stacks gate rows, then up rows) and writes
   a = silu(gate) * up (as silu_t_part) for them, so a layer's MLP needs no job of its own
   between the two products. */
typedef struct { const q4mat *w; const float *x; float *a; long inter; atomic_long next; } gs_job;

static void gs_part(void *arg, long part, long parts) {
    gs_job *j = arg;
    const long I = j->inter, chunk = (I / (parts * CHUNKS_PER_THREAD) + GV) / GV * GV;
    for (;;) {
        const long c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (c * chunk >= I) return;
        const long hi = (c + 1) * chunk < I ? (c + 1) * chunk : I;
        long r = c * chunk;
        for (; r + 4 <= hi; r += 4) {  /* four gate rows and their four up rows */
            float out[GV];
            gemv8(j->w, j->x, r, I + r, out);
            for (int i = 0; i < 4; i++) j->a[r + i] = out[i] * (1.0f / (1.0f + exp_poly(-out[i]))) * out[4 + i];
        }
        for (; r < hi; r++) {
            const float g = gemv1(j->w, j->x, r), u = gemv1(j->w, j->x, I + r);
            j->a[r] = g * (1.0f / (1.0f + exp_poly(-g))) * u;
        }
    }
}

/* The one-row path covers the 4-bit forms and fp16 values; 8-bit codes take mm_rows. */
static inline int gemv_applies(const mm_job *j) { return j->m == 1 && j->w->bits != 8; }

static void mm_part(void *arg, long part, long parts) {
    mm_job *j = arg;
    const long n = j->w->n, k = j->w->k;
    if (gemv_applies(j)) {
        const long chunk = (n / (parts * CHUNKS_PER_THREAD) + GV) / GV * GV;
        for (;;) {
            const long c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
            if (c * chunk >= n) return;
            gemv_rows(j, c * chunk, (c + 1) * chunk < n ? (c + 1) * chunk : n);
        }
    }
    long chunk = (n / (parts * CHUNKS_PER_THREAD) + R) / R * R;
    float *buf = aligned_alloc(64, sizeof(float) * R * k);
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
    float out[8 * R + 8];
    /* Columns in blocks of COLS, so that a block of x stays in the core's L2 while every
       row group passes over it (a prefill's x is megabytes); a row group is expanded once
       per block, which costs little next to COLS columns of multiplies. */
    enum { COLS = 64 };
    for (long cb = 0; cb < j->m; cb += COLS)
    for (long r = lo; r < hi; r += R) {
        const long ce = cb + COLS < j->m ? cb + COLS : j->m;
        /* the next rows' bytes, spread over these rows' steps of 16 weights */
        pfspan pf = row_bytes(w, r + R, R);
        const long steps = (ce - cb + 7) / 8 * (k / 16);
        pf.per = ((pf.na + pf.nb + 63) / 64 + steps - 1) / steps;
        if (r == lo) {  /* the first rows of a chunk were asked for by nobody */
            const pfspan first = row_bytes(w, r, R);
            for (long i = 0; i * 64 < first.na + first.nb; i++) prefetch_line(&first, i);
        }
        for (int i = 0; i < R; i++) expand_row(w, r + i < n ? r + i : n - 1, buf + i * k);
        for (long c0 = cb; c0 < ce; c0 += 8) {
            const int mc = ce - c0 < 8 ? (int)(ce - c0) : 8;
            const float *xc = j->x + c0 * k;
            const long line = (c0 - cb) / 8 * (k / 16) * pf.per;
            switch (mc) {
                case 8: tile(buf, xc, k, 8, out, &pf, line); break;
                case 7: tile(buf, xc, k, 7, out, &pf, line); break;
                case 6: tile(buf, xc, k, 6, out, &pf, line); break;
                case 5: tile(buf, xc, k, 5, out, &pf, line); break;
                case 4: tile(buf, xc, k, 4, out, &pf, line); break;
                case 3: tile(buf, xc, k, 3, out, &pf, line); break;
                case 2: tile(buf, xc, k, 2, out, &pf, line); break;
                default: tile(buf, xc, k, 1, out, &pf, line); break;
            }
            for (int c = 0; c < mc; c++) {
                float *y = j->y + (c0 + c) * j->ldy;
                for (int h = 0; h < R && r + h < n; h++) {
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
    mm_job j = {w, x, NULL, m, w->n, 0, y, 0};
    run_job(mm_part, &j, threads);
    return 0;
}

typedef struct { const q4mat *w; float *out; } ex_job;

static void ex_part(void *arg, long part, long parts) {
    const ex_job *j = arg;
    const long n = j->w->n, r0 = n * part / parts, r1 = n * (part + 1) / parts;
    for (long r = r0; r < r1; r++) expand_row(j->w, r, j->out + r * j->w->k);
}

/* w as the fp32 values the kernel multiplies: (n, k), rows split over the pool's threads */
int q4_expand(const q4mat *w, float *out, long threads) {
    ex_job j = {w, out};
    run_job(ex_part, &j, threads);
    return 0;
}

/* Rows ids[i] of w as fp32 into out (count, k): a decode step's embedding rows from the
   tied vocabulary matrix, on the calling thread. Returns 0, or -1 for an id out of range. */
int q4_rows(const q4mat *w, const int *ids, long count, float *out) {
    for (long i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= w->n) return -1;
        expand_row(w, ids[i], out + i * w->k);
    }
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
    float *qkv;
    float *const *kmir, *const *vmir;
    float *o;
    const int *lens;
    const long *order;  /* pairs, longest rows first */
    long npairs, layer, hq, hkv, d, cap, ld, maxlen;
    float scale;
    const float *cos_t, *sin_t;  /* (B, d/2) */
    atomic_long next;
    const int *kvrow;  /* row b's KV region (NULL: its own, b) */
    int phase;         /* 0: RoPE, append and attend; 1: RoPE and append only; 2: attend only */
} at_job;

/* RoPE of one head (d values) by a row's cos/sin (d/2 each), in place. */
static inline void rope_head(float *v, const float *c, const float *s, long half) {
    for (long i = 0; i < half; i++) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x1 * s[i] + x2 * c[i];
    }
}

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
        const long b = bh / j->hkv, g = bh % j->hkv, n = j->lens[b], half = d / 2;
        const long kvh = (j->kvrow ? j->kvrow[b] * j->hkv + g : bh);
        float *K = j->kmir[j->layer] + kvh * j->cap * d, *V = j->vmir[j->layer] + kvh * j->cap * d;
        float *row = j->qkv + b * j->ld, *Q = row + g * rep * d, *newk = row + (j->hq + g) * d;
        if (j->phase != 2) {
            /* this pair's RoPE and KV append here, in parallel, rather than for every row
               on the caller's thread before the job */
            const float *c = j->cos_t + b * half, *sn = j->sin_t + b * half;
            for (long r = 0; r < rep; r++) rope_head(Q + r * d, c, sn, half);
            rope_head(newk, c, sn, half);
            memcpy(K + (n - 1) * d, newk, sizeof(float) * d);
            memcpy(V + (n - 1) * d, row + (j->hq + j->hkv + g) * d, sizeof(float) * d);
        }
        if (j->phase == 1) continue;
        float *O = j->o + b * j->hq * d + g * rep * d;
        if (d == 64 && rep == 3) attend_pair(Q, K, V, O, n, 3, 64, j->scale, s, s + rep * j->maxlen);
        else if (d == 64) attend_pair(Q, K, V, O, n, rep, 64, j->scale, s, s + rep * j->maxlen);
        else if (d == 128) attend_pair(Q, K, V, O, n, rep, 128, j->scale, s, s + rep * j->maxlen);
        else attend_pair(Q, K, V, O, n, rep, d, j->scale, s, s + rep * j->maxlen);
    }
    free(s);
}

/* ---- prefill attention over token columns ---- */
typedef struct {
    const float *q;        /* query head h's value e of token c at q[(h * d + e) * qf + c * qt] */
    const float *k, *v;    /* (B, hkv, K, d) */
    float *o;              /* as q, with strides of and ot */
    const int *starts;     /* (B,): the position of row b's first query (token b * L) */
    long B, L, qf, qt, of, ot, hq, hkv, d, K, maxn, blocks;
    float scale;
    atomic_long next;
} pa_job;

enum { PA_QB = 16 };  /* queries per task: in token columns, 16 share each 64-byte line of q and o */

static void pa_part(void *arg, long part, long parts) {
    pa_job *j = arg;
    const long rep = j->hq / j->hkv, d = j->d;
    float *s = malloc(sizeof(float) * rep * (j->maxn + 3 * d));
    if (!s) return;
    float *qb = s + rep * (j->maxn + d), *ob = qb + rep * d;
    (void)part; (void)parts;
    const long tasks = j->B * j->hkv * j->blocks;
    for (;;) {
        const long at = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (at >= tasks) break;
        /* the last query blocks first: they see the most keys */
        const long blk = j->blocks - 1 - at / (j->B * j->hkv), bg = at % (j->B * j->hkv);
        const long b = bg / j->hkv, g = bg % j->hkv;
        const float *K = j->k + bg * j->K * d, *V = j->v + bg * j->K * d;
        const long i1 = (blk + 1) * PA_QB < j->L ? (blk + 1) * PA_QB : j->L;
        for (long i = blk * PA_QB; i < i1; i++) {
            const long col = b * j->L + i;
            long n = j->starts[b] + i + 1;  /* keys 0 .. its own position (the causal mask) */
            if (n > j->K) n = j->K;
            for (long e = 0; e < rep * d; e++) qb[e] = j->q[(g * rep * d + e) * j->qf + col * j->qt];
            if (d == 64 && rep == 3) attend_pair(qb, K, V, ob, n, 3, 64, j->scale, s, s + rep * j->maxn);
            else if (d == 64) attend_pair(qb, K, V, ob, n, rep, 64, j->scale, s, s + rep * j->maxn);
            else if (d == 128) attend_pair(qb, K, V, ob, n, rep, 128, j->scale, s, s + rep * j->maxn);
            else attend_pair(qb, K, V, ob, n, rep, d, j->scale, s, s + rep * j->maxn);
            for (long e = 0; e < rep * d; e++) j->o[(g * rep * d + e) * j->of + col * j->ot] = ob[e];
        }
    }
    free(s);
}

/* Causal attention of a prefill batch: B rows of L queries each (token c = b * L + i;
   strides: token columns qf = B * L, qt = 1; token rows qf = 1, qt = the row length);
   query i of row b sees keys 0 .. starts[b] + i of its row (at most K), as
   cpu_math.attention with additive_mask(starts, L, K). Tasks of a (row, kv head) pair
   and 16 queries go to the pool's threads as they get free (the mlx formulation ran
   on one core). Returns 0. */
int prefill_attention(const float *q, const float *k, const float *v, float *o, const int *starts,
                      long B, long L, long hq, long hkv, long d, long K, float scale,
                      long qf, long qt, long of, long ot, long threads) {
    long maxn = 1;
    for (long b = 0; b < B; b++) {
        const long n = starts[b] + L < K ? starts[b] + L : K;
        maxn = n > maxn ? n : maxn;
    }
    pa_job j = {q, k, v, o, starts, B, L, qf, qt, of, ot, hq, hkv, d, K, maxn, (L + PA_QB - 1) / PA_QB, scale, 0};
    run_job(pa_part, &j, threads);
    return 0;
}

/* ---- a prefill's new keys and values into the paged pool, and each row's keys out of it ---- */
typedef struct {
    const float *kc, *vc;  /* (hkv * d, t): the new keys and values in token columns */
    float *kp, *vp;        /* the pool (S, hkv, d), written in place */
    float *ko, *vo;        /* (B, hkv, K, d) */
    const int *slots, *table, *starts;
    long t, hkv, d, nb, bs, B, L, K;
} kv_job;

static void kv_write_part(void *arg, long part, long parts) {
    const kv_job *j = arg;
    const long w = j->hkv * j->d, blocks = (j->t + 15) / 16;
    for (long cb = blocks * part / parts; cb < blocks * (part + 1) / parts; cb++) {
        const long c0 = cb * 16, c1 = c0 + 16 < j->t ? c0 + 16 : j->t;
        for (long e = 0; e < w; e++)
            for (long c = c0; c < c1; c++) {
                const long at = (long)j->slots[c] * w + e;
                j->kp[at] = j->kc[e * j->t + c];
                j->vp[at] = j->vc[e * j->t + c];
            }
    }
}

static void kv_gather_part(void *arg, long part, long parts) {
    const kv_job *j = arg;
    const long pairs = j->B * j->hkv, w = j->hkv * j->d;
    for (long bg = pairs * part / parts; bg < pairs * (part + 1) / parts; bg++) {
        const long b = bg / j->hkv, g = bg % j->hkv;
        /* keys past a row's last query are never read (the causal limit) */
        const long n = j->starts[b] + j->L < j->K ? j->starts[b] + j->L : j->K;
        float *ko = j->ko + bg * j->K * j->d, *vo = j->vo + bg * j->K * j->d;
        for (long p = 0; p < n; p++) {
            const long at = ((long)j->table[b * j->nb + p / j->bs] * j->bs + p % j->bs) * w + g * j->d;
            memcpy(ko + p * j->d, j->kp + at, sizeof(float) * j->d);
            memcpy(vo + p * j->d, j->vp + at, sizeof(float) * j->d);
        }
    }
}

/* Write the new entries (column c to pool slot slots[c]) into the pool in place, then
   copy each row's keys and values 0 .. min(starts[b] + L, K) out of it into ko, vo
   (B, hkv, K, d) through its block table (B, nb) of pool blocks of bs slots. Returns 0. */
int prefill_kv(const float *kc, const float *vc, long t, float *kp, float *vp, const int *slots, const int *table,
               long nb, long bs, const int *starts, long B, long L, long hkv, long d, long K, float *ko, float *vo,
               long threads) {
    kv_job j = {kc, vc, kp, vp, ko, vo, slots, table, starts, t, hkv, d, nb, bs, B, L, K};
    run_job(kv_write_part, &j, threads);
    run_job(kv_gather_part, &j, threads);
    return 0;
}

/* ---- a decode mirror filled from the paged pool ---- */
typedef struct { float *const *kp, *const *vp, *const *km, *const *vm; const int *table; long nl, B, nb, bs, hkv, d, cap; } mf_job;

static void mf_part(void *arg, long part, long parts) {
    const mf_job *j = arg;
    const long tasks = j->nl * j->B, n = j->nb * j->bs < j->cap ? j->nb * j->bs : j->cap, w = j->hkv * j->d;
    for (long at = tasks * part / parts; at < tasks * (part + 1) / parts; at++) {
        const long layer = at / j->B, b = at % j->B;
        for (long p = 0; p < n; p++) {
            const long src = ((long)j->table[b * j->nb + p / j->bs] * j->bs + p % j->bs) * w;
            for (long h = 0; h < j->hkv; h++) {
                const long dst = ((b * j->hkv + h) * j->cap + p) * j->d;
                memcpy(j->km[layer] + dst, j->kp[layer] + src + h * j->d, sizeof(float) * j->d);
                memcpy(j->vm[layer] + dst, j->vp[layer] + src + h * j->d, sizeof(float) * j->d);
            }
        }
    }
}

/* For each of nl layers: the mirror (B, hkv, cap, d) gets row b's pool entries at
   positions 0 .. min(nb * bs, cap) through its block table (B, nb), from the pool
   (S, hkv, d). Returns 0. */
int mirror_fill(float *const *kp, float *const *vp, float *const *km, float *const *vm, long nl, const int *table,
                long B, long nb, long bs, long hkv, long d, long cap, long threads) {
    mf_job j = {kp, vp, km, vm, table, nl, B, nb, bs, hkv, d, cap};
    run_job(mf_part, &j, threads);
    return 0;
}

/* ---- a decode mirror's appended entries back into the paged pool ---- */
typedef struct { float *const *kp, *const *vp; const float *const *km, *const *vm; const int *slots, *rows; long nl, n, hkv, d; } fl_job;

static void fl_part(void *arg, long part, long parts) {
    const fl_job *j = arg;
    for (long layer = j->nl * part / parts; layer < j->nl * (part + 1) / parts; layer++)
        for (long i = 0; i < j->n; i++)
            for (long h = 0; h < j->hkv; h++) {
                const long dst = ((long)j->slots[i] * j->hkv + h) * j->d, src = (long)j->rows[i * j->hkv + h] * j->d;
                memcpy(j->kp[layer] + dst, j->km[layer] + src, sizeof(float) * j->d);
                memcpy(j->vp[layer] + dst, j->vm[layer] + src, sizeof(float) * j->d);
            }
}

/* For each of nl layers: pool (S, hkv, d) slot slots[i], head h <- mirror row rows[i, h]
   (the mirror flat, (rows, d)), in place. Returns 0. */
int mirror_flush(float *const *kp, float *const *vp, const float *const *km, const float *const *vm, long nl,
                 const int *slots, const int *rows, long n, long hkv, long d, long threads) {
    fl_job j = {kp, vp, km, vm, slots, rows, nl, n, hkv, d};
    run_job(fl_part, &j, threads);
    return 0;
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
    run_job(rope_part, &j, threads);
    return 0;
}

static void rope_rows_part(void *arg, long part, long parts) {
    const col_job *j = arg;  /* x (t, ld): token rows; cos_t, sin_t (t, d/2) */
    const long half = j->d / 2;
    for (long r = j->t * part / parts; r < j->t * (part + 1) / parts; r++) {
        const float *c = j->cos_t + r * half, *s = j->sin_t + r * half;
        for (long h = 0; h < j->heads; h++) rope_head(j->x + r * j->inter + h * j->d, c, s, half);
    }
}

/* The same rotation for x (t, ld) with a token per row: columns h*d + i and h*d + i + d/2;
   cos, sin (t, d/2). */
int rope_rows(float *x, long heads, long d, long t, long ld, const float *cos_t, const float *sin_t, long threads) {
    col_job j = {x, cos_t, sin_t, NULL, NULL, heads, d, t, ld};
    run_job(rope_rows_part, &j, threads);
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
    run_job(silu_t_part, &j, threads);
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
    run_job(silu_part, &j, threads);
    return 0;
}

/* ---- prefill products through an external BLAS, one single-threaded call per pool thread ---- */
/* cblas_sgemm with 64-bit (ILP64, numpy's OpenBLAS) or 32-bit sizes. */
typedef void (*sgemm64_fn)(int, int, int, long, long, long, float, const float *, long, const float *, long,
                           float, float *, long);
typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                           float, float *, int);
typedef struct { void *fn; long ilp64; const float *w, *x; float *y; long n, k, m, xt, chunk; float beta; atomic_long next;
                 const q4mat *q; int failed; } bl_job;

/* Each thread's buffer for the expanded rows of a packed matrix (kept between calls). */
static __thread float *bl_buf;
static __thread long bl_cap;

static void bl_part(void *arg, long part, long parts) {
    bl_job *j = arg;
    (void)part; (void)parts;
    for (;;) {
        const long lo = atomic_fetch_add(&j->next, j->chunk);
        if (lo >= j->n) return;
        const long rows = lo + j->chunk < j->n ? j->chunk : j->n - lo;
        const float *w = j->w + lo * j->k;
        if (j->q) {  /* a packed matrix: these rows expanded into this thread's buffer first */
            if (bl_cap < rows * j->k) {
                free(bl_buf);
                bl_buf = malloc(sizeof(float) * rows * j->k);
                bl_cap = bl_buf ? rows * j->k : 0;
                if (!bl_buf) { j->failed = 1; return; }
            }
            for (long r = 0; r < rows; r++) expand_row(j->q, lo + r, bl_buf + r * j->k);
            w = bl_buf;
        }
        /* row-major, w rows [lo, lo + rows) (k wide) times x: (m, k) transposed or (k, m) */
        if (j->ilp64)
            ((sgemm64_fn)j->fn)(101, 111, j->xt ? 112 : 111, rows, j->m, j->k, 1.0f, w, j->k, j->x,
                                j->xt ? j->k : j->m, j->beta, j->y + lo * j->m, j->m);
        else
            ((sgemm32_fn)j->fn)(101, 111, j->xt ? 112 : 111, (int)rows, (int)j->m, (int)j->k, 1.0f, w,
                                (int)j->k, j->x, (int)(j->xt ? j->k : j->m), j->beta, j->y + lo * j->m, (int)j->m);
    }
}

/* y (n, m) = w (n, k) @ x^T for x (m, k) (xt = 1) or w @ x for x (k, m) (xt = 0), plus
   beta * y (beta 0 or 1: a residual added in place), all row-major: blocks of `chunk` rows of w go to the pool's threads as they get free, each
   one call of `fn` (a cblas_sgemm that must run single-threaded). A BLAS's own threads
   wait for each other at every call's end, and stall for a scheduler tick whenever
   another process takes a core (measured: 2-8x slower calls); the pool's threads take
   the next block instead. */
int blas_rows(void *fn, long ilp64, const float *w, long n, long k, const float *x, long m, long xt, float *y,
              float beta, long chunk, long threads) {
    bl_job j = {fn, ilp64, w, x, y, n, k, m, xt, chunk, beta, 0, NULL, 0};
    run_job(bl_part, &j, threads);
    return 0;
}

/* blas_rows for a packed w: each block of `chunk` rows is expanded (the values the 4-bit
   kernels multiply) into the thread's own buffer and multiplied from there while it is
   in cache, so no dense copy of w exists. Returns 0, or -1 without memory. */
int q4_blas_rows(void *fn, long ilp64, const q4mat *w, const float *x, long m, long xt, float *y, float beta,
                 long chunk, long threads) {
    bl_job j = {fn, ilp64, NULL, x, y, w->n, w->k, m, xt, chunk, beta, 0, w, 0};
    run_job(bl_part, &j, threads);
    return j.failed ? -1 : 0;
}

/* RMSNorm of each column (token) of x (n, t): out = x * w / sqrt(mean(x^2) + eps), 16
   columns at a time (the mean in one pass down the rows, then the scaling). */
typedef struct { const float *x, *w; float *out; long n, t; float eps; } nc_job;

static void nc_part(void *arg, long part, long parts) {
    const nc_job *j = arg;
    const long nb = (j->t + 15) / 16, t = j->t;
    for (long cb = nb * part / parts; cb < nb * (part + 1) / parts; cb++) {
        const long c0 = cb * 16, cnt = t - c0 < 16 ? t - c0 : 16;
        const __mmask16 mk = (__mmask16)((1u << cnt) - 1);
        __m512 ss = _mm512_setzero_ps();
        for (long r = 0; r < j->n; r++) {
            const __m512 v = _mm512_maskz_loadu_ps(mk, j->x + r * t + c0);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_sqrt_ps(_mm512_add_ps(
            _mm512_div_ps(ss, _mm512_set1_ps((float)j->n)), _mm512_set1_ps(j->eps))));
        for (long r = 0; r < j->n; r++) {
            const __m512 v = _mm512_maskz_loadu_ps(mk, j->x + r * t + c0);
            _mm512_mask_storeu_ps(j->out + r * t + c0, mk, _mm512_mul_ps(_mm512_mul_ps(v, inv), _mm512_set1_ps(j->w[r])));
        }
    }
}

int rms_norm_cols(const float *x, const float *w, float *out, long n, long t, float eps, long threads) {
    nc_job j = {x, w, out, n, t, eps};
    run_job(nc_part, &j, threads);
    return 0;
}

/* x (B, hidden): the embedded tokens, overwritten; cos, sin (B, d/2); kmir, vmir: per
   layer the decode mirror (B, hkv, cap, d), the new entries go to position lens[b]-1;
   logits (B, vocab). Returns 0, or -1 without memory. */
int q4_decode_step(const q4layer *layers, long nl, const q4mat *head, const float *norm_w,
                   float *x, long B, long hidden, long hq, long hkv, long d, long inter,
                   const float *cos_t, const float *sin_t, float *const *kmir, float *const *vmir,
                   const int *lens, const int *kvrow, long cap, float eps, float scale, float *logits,
                   long threads) {
    const long F = (hq + 2 * hkv) * d;
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
        PROF_T;
        rms_norm(x, L->ln1, h, B, hidden, eps);
        PROF(0);
        matmul(&L->qkv, h, B, qkv, F, 0, L->qkv_bias, threads);
        PROF(1);
        at_job aj = {qkv, kmir, vmir, o, lens, order, B * hkv, l, hq, hkv, d, cap, F, maxlen, scale, cos_t, sin_t, 0,
                     kvrow, kvrow ? 1 : 0};
        parallel(at_part, &aj, threads);
        if (kvrow) {  /* rows sharing a region (a verified draft) see each other's new keys */
            atomic_store(&aj.next, 0);
            aj.phase = 2;
            parallel(at_part, &aj, threads);
        }
        PROF(2);
        matmul(&L->o, o, B, x, hidden, 1, NULL, threads);
        PROF(3);
        rms_norm(x, L->ln2, h, B, hidden, eps);
        PROF(0);
        if (B == 1 && L->gu.bits != 8) {
            gs_job gj = {&L->gu, h, a, inter, 0};
            parallel(gs_part, &gj, threads);
            PROF(4);
        } else {
            matmul(&L->gu, h, B, gu, 2 * inter, 0, NULL, threads);
            PROF(4);
            col_job sj = {NULL, NULL, NULL, gu, a, 0, 0, B, inter};
            parallel(silu_t_part, &sj, threads);
            PROF(5);
        }
        matmul(&L->down, a, B, x, hidden, 1, NULL, threads);
        PROF(6);
    }
    {
        PROF_T;
        rms_norm(x, norm_w, h, B, hidden, eps);
        PROF(8);
        matmul(head, h, B, logits, head->n, 0, NULL, threads);
        PROF(7);
    }
    pthread_mutex_unlock(&call_mu);
    free(order);
    free(h);
    return 0;
}
#endif
