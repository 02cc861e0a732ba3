/* towerrec.modules._fused: fused CPU kernels of the training step.
 *
 * DLRM's pairwise dot interaction (interaction.py; concat_forward and concat_backward
 * below build the top MLP's whole input around it), and the torch kernel's pooled lookup
 * and row gradients (bag_sum, bag_grad below). For each sample b of X [B, F, D]
 * (float32, contiguous) and each of P pairs (rows[p], cols[p]) (int64):
 *
 *   forward(x, rows, cols, out, B, F, D, P, threads)
 *       out[b, p] = X[b, rows[p]] . X[b, cols[p]]
 *   backward(x, rows, cols, grad, gx, B, F, D, P, threads)
 *       gx[b, i] = the sum, over the pairs holding i, of grad[b, p] times the pair's
 *       other vector (twice the vector on a self pair)
 *
 * D a multiple of 16 (the caller falls back to batched matmuls otherwise). The forward
 * multiplies 16 pairs' vectors lane by lane and sums the 16 products of each pair with
 * one transposing reduction tree (15 adds of two-source shuffles for 16 sums); the
 * backward adds each pair's two products into the sample's gradient rows at dim 16, and
 * above it multiplies the symmetric [F, F] matrix of the pairs' gradients into X, each
 * gradient row's lanes held in registers (1.6-1.8x faster at dim 64). Both
 * replace a batched matmul of tiny [F, D] matrices, a gather of the upper triangle
 * (forward) and a scatter into a symmetric matrix (backward). The GIL is released for
 * the whole batch, which is split among up to `threads` threads (this one included)
 * where it holds enough work; each sample's sums run in the same order on any split.
 * Each function is compiled for AVX-512, AVX2 and the baseline and chosen at load time
 * (GCC's target_clones) where the compiler supports it; the dots' kernels come in rows of
 * 16, 8 and 4 lanes (_fused_lanes.h), the widest the CPU's registers hold chosen at
 * import (the notes at v8 and `lanes`), the same bits at every width.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#define LANES 16
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define DOTS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define CLONED 1
#else
#define DOTS_CLONES
#endif

static inline __attribute__((always_inline)) vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Rows of 8 and 4 lanes. Where the CPU has no 512-bit registers, GCC splits a 16-lane
 * vector into two (AVX2) or four (SSE, NEON) registers, and in a kernel that holds many
 * of them at once it keeps them on the stack, where each scalar times a vector is built
 * lane by lane: the dots' backward took 13.4 ms in the AVX2 clone for the Criteo-Kaggle
 * batch against 0.31 ms in rows of 8 lanes, and 10.3 ms in the baseline (SSE) clone
 * (tools/kernel_clones.py). So the dots' kernels and the lookup's row loops come in three
 * widths (_fused_lanes.h), each lane's arithmetic and order the same in all three, so are
 * the bits; `lanes` picks one. */
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t vi4 __attribute__((vector_size(4 * sizeof(int32_t))));

static inline __attribute__((always_inline)) v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store8(float *p, v8 v) {
    memcpy(p, &v, sizeof v);
}

static inline __attribute__((always_inline)) v4 load4(const float *p) {
    v4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store4(float *p, v4 v) {
    memcpy(p, &v, sizeof v);
}

/* The width of the dots' kernels, set once at import to the widest vector the running
 * code holds in registers: 16 lanes with AVX-512, 8 with AVX2, 4 elsewhere (x86's
 * baseline, AArch64's NEON and other 128-bit vector units). Where GCC clones the
 * functions per instruction set (DOTS_CLONES), the CPU's flags choose, as they choose the
 * clone; elsewhere the instruction set the file was compiled for. On AVX-512 the 16-lane
 * dots are up to 1.5x faster than rows of 8; the lookup's row loops and the four-row
 * backward take rows of 8 there too (as fast), and of 4 where `lanes` is 4. */
static int lanes = 4;

/* Lane k of the result: the sum of the 16 lanes of a[k] (a is overwritten). */
static inline __attribute__((always_inline)) vf reduce16(vf *a) {
    const vi m8a = {0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi m8b = {8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi m4a = {0, 1, 2, 3, 20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31};
    const vi m4b = {4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27};
    const vi m2a = {0, 1, 18, 19, 4, 5, 22, 23, 8, 9, 26, 27, 12, 13, 30, 31};
    const vi m2b = {2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29};
    const vi m1a = {0, 17, 2, 19, 4, 21, 6, 23, 8, 25, 10, 27, 12, 29, 14, 31};
    const vi m1b = {1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30};
    /* After each level, vector k's lanes hold partial sums of a[k], a[k + half], ...
     * in interleaved blocks, the blocks halving in width. */
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        a[k] = __builtin_shuffle(a[k], a[k + 8], m8a) + __builtin_shuffle(a[k], a[k + 8], m8b);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        a[k] = __builtin_shuffle(a[k], a[k + 4], m4a) + __builtin_shuffle(a[k], a[k + 4], m4b);
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
        a[k] = __builtin_shuffle(a[k], a[k + 2], m2a) + __builtin_shuffle(a[k], a[k + 2], m2b);
    return __builtin_shuffle(a[0], a[1], m1a) + __builtin_shuffle(a[0], a[1], m1b);
}

/* Lane k of the result: the sum of the 8 lanes of q[k] (q is overwritten), the pairs of
 * lanes added in reduce16's order from its second level on. */
static inline __attribute__((always_inline)) v8 reduce8(v8 *q) {
    const vi8 m4a = {0, 1, 2, 3, 12, 13, 14, 15}, m4b = {4, 5, 6, 7, 8, 9, 10, 11};
    const vi8 m2a = {0, 1, 10, 11, 4, 5, 14, 15}, m2b = {2, 3, 8, 9, 6, 7, 12, 13};
    const vi8 m1a = {0, 9, 2, 11, 4, 13, 6, 15}, m1b = {1, 8, 3, 10, 5, 12, 7, 14};
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        q[k] = __builtin_shuffle(q[k], q[k + 4], m4a) + __builtin_shuffle(q[k], q[k + 4], m4b);
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
        q[k] = __builtin_shuffle(q[k], q[k + 2], m2a) + __builtin_shuffle(q[k], q[k + 2], m2b);
    return __builtin_shuffle(q[0], q[1], m1a) + __builtin_shuffle(q[0], q[1], m1b);
}

/* Lane k of the result: the sum of the 4 lanes of q[k] (q is overwritten), in reduce16's
 * order from its third level on. */
static inline __attribute__((always_inline)) v4 reduce4(v4 *q) {
    const vi4 m2a = {0, 1, 6, 7}, m2b = {2, 3, 4, 5};
    const vi4 m1a = {0, 5, 2, 7}, m1b = {1, 4, 3, 6};
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
        q[k] = __builtin_shuffle(q[k], q[k + 2], m2a) + __builtin_shuffle(q[k], q[k + 2], m2b);
    return __builtin_shuffle(q[0], q[1], m1a) + __builtin_shuffle(q[0], q[1], m1b);
}

#define NV 16
#define VEC vf
#define LOADV load
#define STOREV store
#define REDUCEV reduce16
#define FN(name) name##_16
#include "_fused_lanes.h"

#define NV 8
#define VEC v8
#define LOADV load8
#define STOREV store8
#define REDUCEV reduce8
#define FN(name) name##_8
#include "_fused_lanes.h"

#define NV 4
#define VEC v4
#define LOADV load4
#define STOREV store4
#define REDUCEV reduce4
#define FN(name) name##_4
#include "_fused_lanes.h"

/* One sample's dots at the width `lanes` picks. */
static inline __attribute__((always_inline)) void sample_dots_any(const float *s,
                                                                  const Py_ssize_t *off,
                                                                  float *o, Py_ssize_t dim,
                                                                  Py_ssize_t pairs) {
    if (lanes == 16)
        dim == 16 ? sample_dots_16(s, off, o, 16, pairs) : sample_dots_16(s, off, o, dim, pairs);
    else if (lanes == 8)
        dim == 16 ? sample_dots_8(s, off, o, 16, pairs) : sample_dots_8(s, off, o, dim, pairs);
    else
        dim == 16 ? sample_dots_4(s, off, o, 16, pairs) : sample_dots_4(s, off, o, dim, pairs);
}

DOTS_CLONES
static void dots_forward(const float *x, const Py_ssize_t *off, float *out, Py_ssize_t batch,
                         Py_ssize_t features, Py_ssize_t dim, Py_ssize_t pairs) {
    const Py_ssize_t stride = features * dim;
    for (Py_ssize_t b = 0; b < batch; b++)
        sample_dots_any(x + b * stride, off, out + b * pairs, dim, pairs);
}

/* idx: the call's pair tables (pair_tables); gl: this thread's P + 1 floats. */
DOTS_CLONES
static void dots_backward(const float *x, const int32_t *idx, const float *grad, float *gx,
                          float *gl, Py_ssize_t batch, Py_ssize_t features, Py_ssize_t dim,
                          Py_ssize_t pairs) {
    const Py_ssize_t stride = features * dim;
    const int32_t *pos = idx + 2 * pairs + 3, *pi = idx + 3, *pj = idx + 3 + pairs;
    const int distinct = idx[0], selfs = idx[1], triu = idx[2];
    const int width = lanes;
#define SAMPLES(call)                                           \
    for (Py_ssize_t b = 0; b < batch; b++) {                    \
        const float *s = x + b * stride, *g = grad + b * pairs; \
        float *t = gx + b * stride;                             \
        call;                                                   \
    }
/* each sample's rows zeroed just before they are summed into, in the core's cache */
#define ZEROED(call) SAMPLES(memset(t, 0, (size_t)stride * sizeof(float)); call)
    if (dim == 16 && triu) {
        if (width == 4)
            ZEROED(sample_grad_triu_4(s, g, t, features))
        else
            ZEROED(sample_grad_triu_8(s, g, t, features))
    } else if (dim == 16 || !distinct) {
        if (width == 4)
            ZEROED(sample_grad_pairs_4(s, g, t, pi, pj, dim, pairs))
        else if (width == 8)
            ZEROED(sample_grad_pairs_8(s, g, t, pi, pj, dim, pairs))
        else if (dim == 16)
            ZEROED(sample_grad_pairs_16(s, g, t, pi, pj, 16, pairs))
        else
            ZEROED(sample_grad_pairs_16(s, g, t, pi, pj, dim, pairs))
    } else if (width == 4) {
        SAMPLES(sample_grad_4(s, g, t, pos, gl, selfs, features, dim, pairs))
    } else if (width == 8) {
        SAMPLES(sample_grad_8(s, g, t, pos, gl, selfs, features, dim, pairs))
    } else {
        SAMPLES(sample_grad_16(s, g, t, pos, gl, selfs, features, dim, pairs))
    }
#undef ZEROED
#undef SAMPLES
}

/* One thread's share of a call: samples [lo, hi). */
typedef struct {
    const float *x, *grad;
    const void *off; /* forward: the pairs' vector offsets; backward: pair_tables' */
    float *out;
    Py_ssize_t lo, hi, features, dim, pairs;
    int backward;
    float *scratch; /* backward: P + 1 floats a thread, gl_stride apart; `slot`: this one's */
    Py_ssize_t slot;
} Job;

/* Floats between two threads' gl: P + 1 rounded up to whole cache lines, so that no
 * line holds two threads' copies (each thread writes its own every sample). */
static Py_ssize_t gl_stride(Py_ssize_t pairs) { return (pairs + 1 + 15) / 16 * 16; }

static void run_job(Job *j) {
    const Py_ssize_t stride = j->features * j->dim;
    if (j->backward)
        dots_backward(j->x + j->lo * stride, j->off, j->grad + j->lo * j->pairs,
                      j->out + j->lo * stride, j->scratch + j->slot * gl_stride(j->pairs),
                      j->hi - j->lo, j->features, j->dim, j->pairs);
    else
        dots_forward(j->x + j->lo * stride, j->off, j->out + j->lo * j->pairs, j->hi - j->lo,
                     j->features, j->dim, j->pairs);
}

static void *job_thread(void *arg) {
    run_job(arg);
    return NULL;
}

#define MAX_THREADS 64
/* Multiply-adds each thread must have for a split to pay. OpenMP's threads are torch's,
 * already started: a split costs a few microseconds, and on two cores two threads were
 * as fast as one at 23,000 in all and 1.15-1.3x faster from 46,000 (the interaction at
 * dim 16). A POSIX thread's start and join cost about as much as a million. */
#ifdef _OPENMP
#define MIN_WORK_PER_THREAD (1 << 15)
#else
#define MIN_WORK_PER_THREAD (2 << 20)
#endif

/* The batch split among up to `threads` threads (this one included), in equal shares.
 * Built with OpenMP (setup.py adds -fopenmp where the compiler takes it), the threads are
 * OpenMP's: torch's CPU build loads its own libgomp.so.1 first (native.py imports torch
 * before this module), and the loader binds this module to that same library, so the
 * split runs on the threads torch's operators use. Threads of our own would compete with
 * them: after each parallel region an OpenMP worker spins for a while on the other core,
 * which cost the interaction's backward 3x in a training step on two cores. Without
 * OpenMP, POSIX threads: a thread that cannot be started leaves its share to this one. */
static Py_ssize_t dots_threads(Py_ssize_t batch, Py_ssize_t pairs, Py_ssize_t dim,
                               Py_ssize_t threads) {
    Py_ssize_t n = batch * pairs * dim / MIN_WORK_PER_THREAD;
    if (n > threads) n = threads;
    if (n > MAX_THREADS) n = MAX_THREADS;
    return n < 1 ? 1 : n;
}

static void run_split(Job job, Py_ssize_t batch, Py_ssize_t threads) {
    const Py_ssize_t n = dots_threads(batch, job.pairs, job.dim, threads);
#ifdef _OPENMP
    if (n > 1) {
#pragma omp parallel num_threads((int)n)
        {
            const Py_ssize_t k = omp_get_thread_num(), m = omp_get_num_threads();
            Job mine = job;
            mine.lo = batch * k / m;
            mine.hi = batch * (k + 1) / m;
            mine.slot = k;
            run_job(&mine);
        }
        return;
    }
#endif
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (Py_ssize_t k = 0; k < n; k++) {
        jobs[k] = job;
        jobs[k].lo = batch * k / n;
        jobs[k].hi = batch * (k + 1) / n;
        jobs[k].slot = k;
        if (k > 0) started[k] = pthread_create(&ids[k], NULL, job_thread, &jobs[k]) == 0;
    }
    run_job(&jobs[0]);
    for (Py_ssize_t k = 1; k < n; k++) {
        if (started[k])
            pthread_join(ids[k], NULL);
        else
            run_job(&jobs[k]);
    }
}

/* The torch kernel's lookup (kernels/torch_kernel.py), for `features` features of
 * `batch` samples each, bags feature-major (bag j = f * batch + b, the collection's
 * order) and the pooled output sample-major, as the model reads it:
 *
 *   bag_sum   out[b, f] = the sum of weight[ids[k]] (times weights[k] where given) over
 *             bag j's ids in order, divided by their count under mean pooling (0 for an
 *             empty bag)
 *   bag_grad  out[ids[k]] += grad[b, f] (divided by bag j's length under mean pooling,
 *             then times weights[k] where given), k in order: the small tables' summed row
 *             gradients (kernels/base.py: dense_gradient), in the order and with the
 *             arithmetic of the PyTorch path (a gather of each id's bag gradient, then
 *             index_add_), so the sums match it bit for bit
 *
 * The bag_sum writes the output layout directly, where embedding_bag's feature-major
 * bags cost a transposing copy each way. The file is compiled without contracting a
 * multiply and an add into one rounding (-ffp-contract=off), as PyTorch's separate
 * operators round. */
#define FOR_BAGS(features, batch, j, f, b)            \
    for (Py_ssize_t f = 0, j = 0; f < (features); f++) \
        for (Py_ssize_t b = 0; b < (batch); b++, j++)

/* Ids ahead whose rows a gather asks the memory for (a table's rows are far apart). */
#define PREFETCH 16

/* Ask for every cache line of a row of `dim` floats (for writing where `write`). */
static inline __attribute__((always_inline)) void prefetch_row(const float *row, Py_ssize_t dim,
                                                               int write) {
    const char *p = (const char *)row;
    const Py_ssize_t bytes = dim * (Py_ssize_t)sizeof(float);
    for (Py_ssize_t c = 0; c < bytes; c += 64) {
        if (write)
            __builtin_prefetch(p + c, 1);
        else
            __builtin_prefetch(p + c, 0);
    }
    if (write)
        __builtin_prefetch(p + bytes - 1, 1); /* a row that straddles one line more */
    else
        __builtin_prefetch(p + bytes - 1, 0);
}

/* Bags [first, last) of bag_sum (below); `vector`: the lanes of the row loop (8 or 4),
 * 0 for a dim that is not a multiple of 16, a constant in each call. */
static inline __attribute__((always_inline)) void bag_sum_bags(
    const float *weight, const int64_t *ids, const int64_t *offsets, const float *weights,
    int mean, float *out, Py_ssize_t features, Py_ssize_t batch, Py_ssize_t dim,
    Py_ssize_t first, Py_ssize_t last, int vector) {
    const int64_t end = offsets[last];
    for (Py_ssize_t j = first; j < last; j++) {
        const Py_ssize_t f = j / batch, b = j % batch;
        const int64_t lo = offsets[j], hi = offsets[j + 1];
        /* the rows are scattered over the tables: ask for those a few ids ahead now */
        for (int64_t k = lo; k < hi; k++)
            if (k + PREFETCH < end) prefetch_row(weight + ids[k + PREFETCH] * dim, dim, 0);
        float *o = out + (b * features + f) * dim;
        const float length = (float)(hi - lo);
        if (vector == 8) {
            bag_rows_8(weight, ids, weights, lo, hi, mean, length, o, dim);
            continue;
        }
        if (vector == 4) {
            bag_rows_4(weight, ids, weights, lo, hi, mean, length, o, dim);
            continue;
        }
        for (Py_ssize_t d = 0; d < dim; d++) o[d] = 0.0f;
        for (int64_t k = lo; k < hi; k++) {
            const float *row = weight + ids[k] * dim;
            const float w = weights == NULL ? 1.0f : weights[k];
            for (Py_ssize_t d = 0; d < dim; d++) o[d] += weights == NULL ? row[d] : w * row[d];
        }
        if (mean && hi > lo)
            for (Py_ssize_t d = 0; d < dim; d++) o[d] /= length;
    }
}

/* bag_sum_bags in rows of 8 lanes, or of 4 on 128-bit vectors (the note at v8). */
DOTS_CLONES
static void bag_sum_range(const float *weight, const int64_t *ids, const int64_t *offsets,
                          const float *weights, int mean, float *out, Py_ssize_t features,
                          Py_ssize_t batch, Py_ssize_t dim, Py_ssize_t first, Py_ssize_t last) {
#define BAGS(vector)                                                                    \
    bag_sum_bags(weight, ids, offsets, weights, mean, out, features, batch, dim, first, \
                 last, vector)
    if (dim % LANES)
        BAGS(0);
    else if (lanes == 4)
        BAGS(4);
    else
        BAGS(8);
#undef BAGS
}

/* Rows a thread must gather for its start to pay. */
#define MIN_ROWS_PER_THREAD 4096

/* The threads a call over `work` units (MIN_PER_THREAD a thread) takes: OpenMP's
 * current count (torch's intra-op threads, set on this thread by torch.set_num_threads),
 * 1 without OpenMP. */
static int threads_for(Py_ssize_t work, Py_ssize_t min_per_thread) {
#ifdef _OPENMP
    Py_ssize_t n = work / min_per_thread, most = omp_get_max_threads();
    if (n > most) n = most;
    return n < 1 ? 1 : (int)n;
#else
    (void)work;
    (void)min_per_thread;
    return 1;
#endif
}

/* Each bag's sum depends on its own ids alone, in order: the same on any split. */
static void bag_sum(const float *weight, const int64_t *ids, const int64_t *offsets,
                    const float *weights, int mean, float *out, Py_ssize_t features,
                    Py_ssize_t batch, Py_ssize_t dim) {
    const Py_ssize_t bags = features * batch;
    const int n = threads_for(offsets[bags], MIN_ROWS_PER_THREAD);
    if (n == 1) {
        bag_sum_range(weight, ids, offsets, weights, mean, out, features, batch, dim, 0, bags);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    {
        const Py_ssize_t k = omp_get_thread_num(), m = omp_get_num_threads();
        bag_sum_range(weight, ids, offsets, weights, mean, out, features, batch, dim,
                      bags * k / m, bags * (k + 1) / m);
    }
#endif
}

/* row += one id's share of its bag's gradient g: g divided by the bag's length under
 * mean pooling, then times the id's weight where given; `vector`: the lanes of the row
 * loop (8 or 4), 0 for a dim that is not a multiple of 16. */
static inline __attribute__((always_inline)) void add_share(float *row, const float *g,
                                                            float length, float w, int mean,
                                                            int weighted, Py_ssize_t dim,
                                                            int vector) {
    if (vector) { /* rows of `vector` lanes (the note at v8) */
        if (vector == 4)
            share_rows_4(row, g, length, w, mean, weighted, dim);
        else
            share_rows_8(row, g, length, w, mean, weighted, dim);
        return;
    }
    for (Py_ssize_t d = 0; d < dim; d++) {
        float v = mean ? g[d] / length : g[d];
        if (weighted) v = v * w;
        row[d] += v;
    }
}

/* bag_grad's adds into rows [first, last) alone: every id is read, in order, and those
 * outside the range skipped. */
DOTS_CLONES
static void bag_grad_rows(const int64_t *ids, const int64_t *offsets, const float *grad,
                          const float *weights, int mean, float *out, Py_ssize_t features,
                          Py_ssize_t batch, Py_ssize_t dim, int64_t first, int64_t last) {
    const int vector = dim % LANES ? 0 : lanes == 4 ? 4 : 8; /* add_share's row width */
    FOR_BAGS(features, batch, j, f, b) {
        const int64_t lo = offsets[j], hi = offsets[j + 1];
        const float *g = grad + (b * features + f) * dim;
        const float length = (float)(hi - lo > 1 ? hi - lo : 1);
        for (int64_t k = lo; k < hi; k++) {
            const int64_t id = ids[k];
            if (id < first || id >= last) continue;
            add_share(out + id * dim, g, length, weights == NULL ? 1.0f : weights[k], mean,
                      weights != NULL, dim, vector);
        }
    }
}

/* The rows split among OpenMP's threads in equal ranges, each thread reading every id
 * and adding those in its range: a row's adds run on one thread in the ids' order, the
 * same on any split. */
static void bag_grad(const int64_t *ids, const int64_t *offsets, const float *grad,
                     const float *weights, int mean, float *out, Py_ssize_t features,
                     Py_ssize_t batch, Py_ssize_t dim, Py_ssize_t rows) {
    const int n = threads_for(offsets[features * batch], MIN_ROWS_PER_THREAD);
    if (n == 1) {
        bag_grad_rows(ids, offsets, grad, weights, mean, out, features, batch, dim, 0, rows);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    {
        const Py_ssize_t k = omp_get_thread_num(), m = omp_get_num_threads();
        bag_grad_rows(ids, offsets, grad, weights, mean, out, features, batch, dim,
                      rows * k / m, rows * (k + 1) / m);
    }
#endif
}

/* Row-wise Adagrad on the rows a lookup touched (the torch kernel's tables with more
 * rows than the lookup has ids; optim/sparse.py: sparse_update), in two calls around
 * PyTorch's mean of squares:
 *
 *   row_sums       each distinct id of the lookup and its gradient from
 *                  grad[batch, features * dim] (sample-major): its shares (add_share,
 *                  bag_grad's arithmetic) summed in the ids' order from zero, as
 *                  index_add_ sums them; the distinct ids found table by table with an
 *                  open-addressing hash table of at least twice the table's ids, the
 *                  tables split among OpenMP's threads; and, given the statistics, each
 *                  distinct row's copied out as it is found (the gather the caller's
 *                  arithmetic starts from)
 *   adagrad_rows   given each row's new statistic m and step factor f, computed by the
 *                  caller with PyTorch's operators as rowwise_update computes them (the
 *                  mean of squares' order of adds and the square root's rounding are
 *                  PyTorch's to choose):
 *                    momentum[r] = m;  w[r] = w[r] - g * f
 *                  so the two paths agree bit for bit. The rows are split among OpenMP's
 *                  threads (each depends on itself alone: the same on any split). */
typedef struct {
    int64_t id, slot; /* id -1: empty */
} Entry;

/* The hash table's size for `count` ids: a power of two of at least twice as many. */
static int hash_bits(Py_ssize_t count) {
    int bits = 4;
    while (((Py_ssize_t)1 << bits) < 2 * count) bits++;
    return bits;
}

/* One table's distinct ids and their summed gradients (`first`: the table's first
 * feature; `count`: its ids, over every feature of the table), appended at rows[at] and
 * sums[at * dim] with an open-addressing hash table of at least twice as many entries,
 * which stays in the core's caches; with `momentum`, each new row's statistic is copied
 * to state[at] too. Returns the rows appended. */
DOTS_CLONES
static Py_ssize_t table_sums(const int64_t *ids, const int64_t *offsets, const float *grad,
                             const float *weights, const int64_t *tables, int mean,
                             Py_ssize_t features, Py_ssize_t batch, Py_ssize_t dim,
                             Py_ssize_t first, Py_ssize_t count, Entry *hash, int64_t *rows,
                             float *sums, const float *momentum, float *state) {
    const int vector = dim % LANES ? 0 : lanes == 4 ? 4 : 8; /* add_share's row width */
    const int bits = hash_bits(count);
    const size_t mask = ((size_t)1 << bits) - 1;
    Py_ssize_t distinct = 0;
    memset(hash, 0xff, (mask + 1) * sizeof *hash); /* every id -1: empty */
    for (Py_ssize_t f = first; f < features; f++) {
        if (tables[f] != tables[first]) continue;
        const int64_t end = offsets[(f + 1) * batch]; /* the feature's last id, + 1 */
        for (Py_ssize_t b = 0; b < batch; b++) {
            const Py_ssize_t j = f * batch + b;
            const int64_t lo = offsets[j], hi = offsets[j + 1];
            const float *g = grad + (b * features + f) * dim;
            if (b + 8 < batch) __builtin_prefetch(g + 8 * features * dim, 0);
            const float length = (float)(hi - lo > 1 ? hi - lo : 1);
            for (int64_t k = lo; k < hi; k++) {
                /* a new row's statistic is read from far in the table: asked for ahead */
                if (momentum != NULL && k + PREFETCH < end)
                    __builtin_prefetch(momentum + ids[k + PREFETCH], 0);
                const int64_t id = ids[k];
                size_t h = (size_t)(((uint64_t)id * 0x9E3779B97F4A7C15ull) >> (64 - bits));
                while (hash[h].id != -1 && hash[h].id != id) h = (h + 1) & mask;
                if (hash[h].id == -1) {
                    hash[h].id = id;
                    hash[h].slot = distinct;
                    rows[distinct] = id;
                    if (momentum != NULL) state[distinct] = momentum[id];
                    memset(sums + distinct * dim, 0, (size_t)dim * sizeof(float));
                    distinct++;
                }
                add_share(sums + hash[h].slot * dim, g, length,
                          weights == NULL ? 1.0f : weights[k], mean, weights != NULL, dim,
                          vector);
            }
        }
    }
    return distinct;
}

/* Ids a thread must sum for its start to pay. */
#define MIN_SUMS_PER_THREAD 8192

/* row_sums table by table: the tables (`firsts[t]`: table t's first feature, `counts[t]`:
 * its ids, in the order of their first features) split among OpenMP's threads in runs of
 * about equal ids, each run written from the ids before it (an upper bound of its rows'
 * start) with a hash table of its own (`hash`: `threads` tables of `hash_size` entries),
 * then moved down behind the run before it: the same rows, in the same order, with the
 * same sums on any split. Returns the distinct rows. */
static Py_ssize_t distinct_sums(const int64_t *ids, const int64_t *offsets, const float *grad,
                                const float *weights, const int64_t *tables, int mean,
                                Py_ssize_t features, Py_ssize_t batch, Py_ssize_t dim,
                                const Py_ssize_t *firsts, const Py_ssize_t *counts,
                                Py_ssize_t ntables, int threads, Entry *hash, size_t hash_size,
                                int64_t *rows, float *sums, const float *momentum,
                                float *state) {
    Py_ssize_t total = 0;
    for (Py_ssize_t t = 0; t < ntables; t++) total += counts[t];
    /* run k: tables [starts[k], starts[k + 1]), written from the ids before them, at[k],
     * its first table the first whose ids begin at or after total * k / runs */
    Py_ssize_t starts[65], at[65], found[64];
    int runs = threads < 1 ? 1 : (threads > 64 ? 64 : threads);
    if (runs > ntables) runs = (int)(ntables > 0 ? ntables : 1);
    Py_ssize_t before = 0, t = 0;
    for (int k = 0; k < runs; k++) {
        while (t < ntables && before < total * k / runs) before += counts[t++];
        starts[k] = t;
        at[k] = before;
    }
    starts[runs] = ntables;
#ifdef _OPENMP
#pragma omp parallel for num_threads(runs) schedule(static, 1) if (runs > 1)
#endif
    for (int k = 0; k < runs; k++) {
        Py_ssize_t n = 0;
        for (Py_ssize_t u = starts[k]; u < starts[k + 1]; u++) {
            const Py_ssize_t to = at[k] + n;
            n += table_sums(ids, offsets, grad, weights, tables, mean, features, batch, dim,
                            firsts[u], counts[u], hash + (size_t)k * hash_size, rows + to,
                            sums + to * dim, momentum, momentum == NULL ? NULL : state + to);
        }
        found[k] = n;
    }
    Py_ssize_t distinct = 0;
    for (int k = 0; k < runs; k++) {
        if (at[k] != distinct && found[k] > 0) {
            memmove(rows + distinct, rows + at[k], (size_t)found[k] * sizeof *rows);
            memmove(sums + distinct * dim, sums + at[k] * dim,
                    (size_t)(found[k] * dim) * sizeof *sums);
            if (momentum != NULL)
                memmove(state + distinct, state + at[k], (size_t)found[k] * sizeof *state);
        }
        distinct += found[k];
    }
    return distinct;
}

/* Row-wise Adagrad's statistic of a row, as torch's operators compute it on [U] vectors
 * (torch_kernel.py): the mean of the row gradient's squares (the squares summed into
 * eight accumulators, square i into i mod 8 in order, then the eight in order, as
 * ATen's inner-dimension sum adds a row of 16; divided by dim) added to the row's old
 * statistic. The caller checks once per dim that these are torch's bits
 * (native_row_statistics) and takes torch's operators where they are not. */
static inline __attribute__((always_inline)) float row_statistic(const float *g, Py_ssize_t dim,
                                                                 float old) {
    if (dim % 8 == 0) { /* the same adds, eight accumulators as one vector's lanes */
        v8 x = load8(g), sq = x * x;
        for (Py_ssize_t i = 8; i < dim; i += 8) {
            x = load8(g + i);
            sq = sq + x * x;
        }
        float sum = sq[0];
        for (int j = 1; j < 8; j++) sum = sum + sq[j];
        return old + sum / (float)dim;
    }
    float acc[8] = {0};
    const Py_ssize_t k = dim < 8 ? dim : 8;
    for (Py_ssize_t j = 0; j < k; j++) acc[j] = g[j] * g[j];
    for (Py_ssize_t i = 8; i < dim; i++) acc[i % 8] = acc[i % 8] + g[i] * g[i];
    float sum = acc[0];
    for (Py_ssize_t j = 1; j < k; j++) sum = sum + acc[j];
    return old + sum / (float)dim;
}

DOTS_CLONES
static void statistics_range(const float *sums, float *state, Py_ssize_t dim, Py_ssize_t lo,
                             Py_ssize_t hi) {
    for (Py_ssize_t u = lo; u < hi; u++) state[u] = row_statistic(sums + u * dim, dim, state[u]);
}

DOTS_CLONES
static void adagrad_rows(float *weight, float *momentum, const int64_t *rows, const float *sums,
                         const float *state, const float *factor, Py_ssize_t dim, Py_ssize_t lo,
                         Py_ssize_t hi) {
    for (Py_ssize_t u = lo; u < hi; u++) {
        if (u + PREFETCH < hi) {
            prefetch_row(weight + rows[u + PREFETCH] * dim, dim, 1);
            __builtin_prefetch(momentum + rows[u + PREFETCH], 1);
        }
        const float *g = sums + u * dim;
        float *w = weight + rows[u] * dim;
        momentum[rows[u]] = state[u];
        const float f = factor[u];
        for (Py_ssize_t d = 0; d < dim; d++) w[d] = w[d] - g[d] * f;
    }
}

/* Rows a thread must update for its start to pay. */
#define MIN_UPDATES_PER_THREAD 2048

static void adagrad_update(float *weight, float *momentum, const int64_t *rows,
                           const float *sums, const float *state, const float *factor,
                           Py_ssize_t distinct, Py_ssize_t dim) {
    const int n = threads_for(distinct, MIN_UPDATES_PER_THREAD);
    if (n == 1) {
        adagrad_rows(weight, momentum, rows, sums, state, factor, dim, 0, distinct);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    {
        const Py_ssize_t k = omp_get_thread_num(), m = omp_get_num_threads();
        adagrad_rows(weight, momentum, rows, sums, state, factor, dim, distinct * k / m,
                     distinct * (k + 1) / m);
    }
#endif
}

static void statistics_update(const float *sums, float *state, Py_ssize_t distinct,
                              Py_ssize_t dim) {
    const int n = threads_for(distinct, MIN_UPDATES_PER_THREAD);
    if (n == 1) {
        statistics_range(sums, state, dim, 0, distinct);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    {
        const Py_ssize_t k = omp_get_thread_num(), m = omp_get_num_threads();
        statistics_range(sums, state, dim, distinct * k / m, distinct * (k + 1) / m);
    }
#endif
}

/* The lookup's ids in the tables' concatenated rows: out[k] = ids[k] + base[f] for the
 * ids k of feature f (its `batch` bags, offsets[f * batch] to offsets[(f + 1) * batch]). */
static void global_ids(const int64_t *ids, const int64_t *offsets, const int64_t *base,
                       int64_t *out, Py_ssize_t features, Py_ssize_t batch) {
    for (Py_ssize_t f = 0; f < features; f++) {
        const int64_t add = base[f];
        for (int64_t k = offsets[f * batch]; k < offsets[(f + 1) * batch]; k++)
            out[k] = ids[k] + add;
    }
}

/* Whether every id of feature f (ids[starts[f]] to ids[starts[f + 1]]) lies in
 * [0, rows[f]): each feature's smallest and largest id, without a branch per id. */
static int ids_in_range(const int64_t *ids, const int64_t *starts, const int64_t *rows,
                        Py_ssize_t features) {
    for (Py_ssize_t f = 0; f < features; f++) {
        int64_t low = 0, high = -1;
        for (int64_t k = starts[f]; k < starts[f + 1]; k++) {
            low = ids[k] < low ? ids[k] : low;
            high = ids[k] > high ? ids[k] : high;
        }
        if (low < 0 || high >= rows[f]) return 0;
    }
    return 1;
}

/* The gradient through a ReLU of bfloat16 output: dst[i] = out[i] <= 0 ? 0 : grad[i], as
 * ATen's threshold_backward(grad, out, 0) gives it (a selection: the same bits), on the
 * values' 16-bit patterns: a value is > 0, or NaN, where its pattern as a signed integer
 * is > 0 or its magnitude's is above infinity's. (In float32 ATen's is as fast: the
 * caller keeps it there.) Each element depends on itself alone: the same on any split. */
DOTS_CLONES
static void relu_grad16(const uint16_t *grad, const uint16_t *out, uint16_t *dst,
                        Py_ssize_t lo, Py_ssize_t hi) {
    for (Py_ssize_t i = lo; i < hi; i++) {
        const int16_t v = (int16_t)out[i], magnitude = (int16_t)(v & 0x7fff);
        const int16_t keep = (int16_t)((v > 0) | (magnitude > 0x7f80)); /* no branch */
        dst[i] = grad[i] & (uint16_t)-keep;
    }
}

/* Elements a thread must take for its start to pay. */
#define MIN_RELU_PER_THREAD 65536

static void relu_grad(const uint16_t *grad, const uint16_t *out, uint16_t *dst,
                      Py_ssize_t count) {
    const int n = threads_for(count, MIN_RELU_PER_THREAD);
    if (n == 1) {
        relu_grad16(grad, out, dst, 0, count);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    {
        /* splits at multiples of 64 elements: no cache line written by two threads */
        const Py_ssize_t k = omp_get_thread_num(), m = omp_get_num_threads();
        const Py_ssize_t lo = count * k / m / 64 * 64;
        const Py_ssize_t hi = k + 1 == m ? count : count * (k + 1) / m / 64 * 64;
        relu_grad16(grad, out, dst, lo, hi);
    }
#endif
}

/* Buffers and sizes, checked against each other; 0 on success. */
static int check(Py_buffer *buf, Py_ssize_t want, const char *name) {
    if (buf->len != want) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", name, buf->len, want);
        return -1;
    }
    return 0;
}

static int check_pairs(const int64_t *rows, const int64_t *cols, Py_ssize_t pairs,
                       Py_ssize_t features) {
    for (Py_ssize_t p = 0; p < pairs; p++) {
        if (rows[p] < 0 || rows[p] >= features || cols[p] < 0 || cols[p] >= features) {
            PyErr_Format(PyExc_ValueError, "pair %zd names a feature outside [0, %zd)", p,
                         features);
            return -1;
        }
    }
    return 0;
}

static int check_sizes(Py_ssize_t batch, Py_ssize_t features, Py_ssize_t dim,
                       Py_ssize_t pairs) {
    if (batch < 0 || features < 1 || pairs < 1 || pairs >= INT32_MAX || dim < LANES ||
        dim % LANES) {
        PyErr_Format(PyExc_ValueError,
                     "dots need batch >= 0, features >= 1, 1 <= pairs < 2^31 and a dim that "
                     "is a multiple of %d; got %zd, %zd, %zd, %zd",
                     LANES, batch, features, pairs, dim);
        return -1;
    }
    return 0;
}

/* Each pair's two vectors' offsets into a sample (floats), interleaved, the pairs
 * padded to a multiple of LANES with (0, 0); NULL on error. */
static Py_ssize_t *pair_offsets(const int64_t *rows, const int64_t *cols, Py_ssize_t pairs,
                                Py_ssize_t dim) {
    const Py_ssize_t padded = (pairs + LANES - 1) / LANES * LANES;
    Py_ssize_t *off = PyMem_Calloc((size_t)padded * 2, sizeof(Py_ssize_t));
    if (off == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t p = 0; p < pairs; p++) {
        off[2 * p] = (Py_ssize_t)rows[p] * dim;
        off[2 * p + 1] = (Py_ssize_t)cols[p] * dim;
    }
    return off;
}

/* The backward's tables of the pairs (int32): [0] whether they are distinct, [1] whether
 * any is a self pair, [2] whether they are the upper triangle without the diagonal in
 * row-major order (sample_grad_triu), then their rows, their cols, and pos [F, F]: the
 * pair holding i and j (either order), P where none does. */
static int32_t *pair_tables(const int64_t *rows, const int64_t *cols, Py_ssize_t pairs,
                            Py_ssize_t features) {
    int32_t *idx = PyMem_Malloc((size_t)(3 + 2 * pairs + features * features) * sizeof(int32_t));
    if (idx == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    int32_t *pi = idx + 3, *pj = idx + 3 + pairs, *pos = idx + 3 + 2 * pairs;
    idx[0] = 1;
    idx[1] = 0;
    idx[2] = pairs == features * (features - 1) / 2;
    for (Py_ssize_t k = 0; k < features * features; k++) pos[k] = (int32_t)pairs;
    for (Py_ssize_t p = 0, ti = 0, tj = 1; p < pairs; p++) {
        const Py_ssize_t i = rows[p], j = cols[p];
        pi[p] = (int32_t)i;
        pj[p] = (int32_t)j;
        if (pos[i * features + j] != pairs) idx[0] = 0; /* a repeated pair */
        pos[i * features + j] = pos[j * features + i] = (int32_t)p;
        if (i == j) idx[1] = 1;
        if (i != ti || j != tj) idx[2] = 0;
        if (++tj == features) tj = ++ti + 1;
    }
    return idx;
}

/* forward(x, rows, cols, out, ...) and backward(x, rows, cols, grad, gx, ...). */
static PyObject *run_dots(PyObject *args, int backward) {
    Py_buffer x, rows, cols, grad = {0}, out;
    Py_ssize_t batch, features, dim, pairs, threads;
    const int parsed =
        backward ? PyArg_ParseTuple(args, "y*y*y*y*w*nnnnn", &x, &rows, &cols, &grad, &out,
                                    &batch, &features, &dim, &pairs, &threads)
                 : PyArg_ParseTuple(args, "y*y*y*w*nnnnn", &x, &rows, &cols, &out, &batch,
                                    &features, &dim, &pairs, &threads);
    if (!parsed) return NULL;
    PyObject *result = NULL;
    if (check_sizes(batch, features, dim, pairs) ||
        check(&x, batch * features * dim * 4, "x") || check(&rows, pairs * 8, "rows") ||
        check(&cols, pairs * 8, "cols") ||
        (backward && check(&grad, batch * pairs * 4, "grad")) ||
        check(&out, batch * (backward ? features * dim : pairs) * 4, backward ? "gx" : "out") ||
        check_pairs(rows.buf, cols.buf, pairs, features))
        goto done;
    void *off = backward ? (void *)pair_tables(rows.buf, cols.buf, pairs, features)
                         : (void *)pair_offsets(rows.buf, cols.buf, pairs, dim);
    if (off == NULL) goto done;
    float *scratch = NULL;
    if (backward) {
        const Py_ssize_t slots = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
        scratch = PyMem_Malloc((size_t)(slots * gl_stride(pairs) + 16) * sizeof(float));
        if (scratch == NULL) {
            PyMem_Free(off);
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    /* the slots from the first cache line boundary on (16 spare floats allocated) */
    float *lines = scratch == NULL ? NULL
                                   : (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    Job job = {x.buf, backward ? grad.buf : NULL, off, out.buf, 0, 0, features, dim, pairs,
               backward, lines, 0};
    run_split(job, batch, threads);
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    PyMem_Free(off);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&cols);
    PyBuffer_Release(&out);
    if (backward) PyBuffer_Release(&grad);
    return result;
}

static PyObject *py_forward(PyObject *self, PyObject *args) { return run_dots(args, 0); }

static PyObject *py_backward(PyObject *self, PyObject *args) { return run_dots(args, 1); }

/* The DLRM top MLP's input in one call each way (models/dlrm.py, DotInteraction.joined):
 * for each sample b, the F = T + 1 vectors of dim D are x[b] (the bottom MLP's output,
 * [B, D], float32 or, where `half`, bfloat16) and the T rows of e[b] (the pooled
 * embeddings, [B, T * D], float32); with P pairs (rows, cols) over them:
 *
 *   concat_forward(x, e, rows, cols, out, B, T, D, P, W, half, threads)
 *       out[b] = [x[b], the pairs' dots, W - D - P zeros]        ([B, W], x's dtype)
 *   concat_backward(x, e, rows, cols, grad, gx, ge, B, T, D, P, W, half, threads)
 *       ge[b] = the embeddings' gradient rows (float32) and gx[b] = grad[b, :D] + x's
 *       gradient row, given grad [B, W] (x's dtype)
 *
 * Each sample's F vectors are copied into a float32 scratch row and its dots and
 * gradients computed there by sample_dots and the backward's per-sample sums, so the
 * values are those of the stacked path: the stack [B, F, D] in float32, the dots rounded
 * to bfloat16 (to nearest, ties to even, as torch rounds) where half, and x's two
 * gradients added in x's dtype. It replaces the stacking copy, the casts around the dots
 * and the concatenation of the top MLP's input, each a pass over the batch. */

static inline float bf16_in(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_out(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));

/* n floats to bfloat16 (bf16_out's rounding), 16 lanes at a time. */
static inline __attribute__((always_inline)) void bf16_store(uint16_t *o, const float *f,
                                                             Py_ssize_t n) {
    Py_ssize_t k = 0;
    for (; k + LANES <= n; k += LANES) {
        const vf v = load(f + k);
        vu u;
        memcpy(&u, &v, sizeof u);
        const vu nan = (vu)(v != v), r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        const vh h = __builtin_convertvector((r & ~nan) | (0x7FC0u & nan), vh);
        memcpy(o + k, &h, sizeof h);
    }
    for (; k < n; k++) o[k] = bf16_out(f[k]);
}

/* n bfloat16 values to floats, 16 lanes at a time. */
static inline __attribute__((always_inline)) void bf16_load(float *f, const uint16_t *h,
                                                            Py_ssize_t n) {
    Py_ssize_t k = 0;
    for (; k + LANES <= n; k += LANES) {
        vh v;
        memcpy(&v, h + k, sizeof v);
        const vu u = __builtin_convertvector(v, vu) << 16;
        memcpy(f + k, &u, sizeof u);
    }
    for (; k < n; k++) f[k] = bf16_in(h[k]);
}

typedef struct {
    const void *x;
    const float *e;
    const void *grad;
    void *out, *gx;
    float *ge;
    const void *off; /* forward: pair_offsets'; backward: pair_tables' */
    float *scratch;  /* concat_scratch floats a thread */
    Py_ssize_t tables, dim, pairs, width, scratch_stride;
    int half, backward;
} Concat;

/* Floats of one thread's scratch: the F vectors, their gradient rows, the pairs' values
 * and the backward's copy of them (P + 1 each, whole cache lines), and 16 to align it. */
static Py_ssize_t concat_scratch(Py_ssize_t features, Py_ssize_t dim, Py_ssize_t pairs) {
    return (2 * features * dim + 15) / 16 * 16 + 2 * gl_stride(pairs) + 16;
}

/* x[b] and e[b] into the float32 scratch row s [F, D]. */
static inline __attribute__((always_inline)) void concat_gather(const Concat *c, Py_ssize_t b,
                                                                float *s) {
    const Py_ssize_t dim = c->dim, te = c->tables * dim;
    if (c->half) {
        bf16_load(s, (const uint16_t *)c->x + b * dim, dim);
    } else {
        memcpy(s, (const float *)c->x + b * dim, (size_t)dim * sizeof(float));
    }
    memcpy(s + dim, c->e + b * te, (size_t)te * sizeof(float));
}

DOTS_CLONES
static void concat_range(const Concat *c, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t slot) {
    const Py_ssize_t dim = c->dim, features = c->tables + 1, pairs = c->pairs,
                     width = c->width, te = c->tables * dim;
    float *s = (float *)(((uintptr_t)(c->scratch + slot * c->scratch_stride) + 63) &
                         ~(uintptr_t)63);
    float *t = s + features * dim, *gl = s + (2 * features * dim + 15) / 16 * 16,
          *copy = gl + gl_stride(pairs);
    for (Py_ssize_t b = lo; b < hi; b++) {
        concat_gather(c, b, s);
        if (!c->backward) {
            if (c->half) {
                uint16_t *o = (uint16_t *)c->out + b * width;
                memcpy(o, (const uint16_t *)c->x + b * dim, (size_t)dim * sizeof(uint16_t));
                sample_dots_any(s, c->off, gl, dim, pairs);
                bf16_store(o + dim, gl, pairs);
                memset(o + dim + pairs, 0, (size_t)(width - dim - pairs) * sizeof(uint16_t));
            } else {
                float *o = (float *)c->out + b * width;
                memcpy(o, s, (size_t)dim * sizeof(float));
                sample_dots_any(s, c->off, o + dim, dim, pairs);
                memset(o + dim + pairs, 0, (size_t)(width - dim - pairs) * sizeof(float));
            }
            continue;
        }
        const float *g;
        if (c->half) {
            bf16_load(gl, (const uint16_t *)c->grad + b * width + dim, pairs);
            g = gl;
        } else {
            g = (const float *)c->grad + b * width + dim;
        }
        /* dots_backward's sums for one sample (b = 0 of a batch of one) */
        dots_backward(s, c->off, g, t, copy, 1, features, dim, pairs);
        memcpy(c->ge + b * te, t + dim, (size_t)te * sizeof(float));
        if (c->half) {
            const uint16_t *gh = (const uint16_t *)c->grad + b * width;
            uint16_t *gx = (uint16_t *)c->gx + b * dim;
            for (Py_ssize_t d = 0; d < dim; d++)
                gx[d] = bf16_out(bf16_in(bf16_out(t[d])) + bf16_in(gh[d]));
        } else {
            const float *gf = (const float *)c->grad + b * width;
            float *gx = (float *)c->gx + b * dim;
            for (Py_ssize_t d = 0; d < dim; d++) gx[d] = t[d] + gf[d];
        }
    }
}

/* The batch split among threads as run_split splits the dots'. */
static void concat_split(const Concat *c, Py_ssize_t batch, Py_ssize_t threads) {
    const Py_ssize_t n = dots_threads(batch, c->pairs, c->dim, threads);
#ifdef _OPENMP
    if (n > 1) {
#pragma omp parallel num_threads((int)n)
        {
            const Py_ssize_t k = omp_get_thread_num(), m = omp_get_num_threads();
            concat_range(c, batch * k / m, batch * (k + 1) / m, k);
        }
        return;
    }
#endif
    concat_range(c, 0, batch, 0); /* built without OpenMP: on this thread */
}

/* concat_forward(x, e, rows, cols, out, B, T, D, P, W, half, threads) and
 * concat_backward(x, e, rows, cols, grad, gx, ge, B, T, D, P, W, half, threads). */
static PyObject *run_concat(PyObject *args, int backward) {
    Py_buffer x, e, rows, cols, grad = {0}, out, ge = {0};
    Py_ssize_t batch, tables, dim, pairs, width, threads;
    int half;
    const int parsed =
        backward ? PyArg_ParseTuple(args, "y*y*y*y*y*w*w*nnnnnpn", &x, &e, &rows, &cols, &grad,
                                    &out, &ge, &batch, &tables, &dim, &pairs, &width, &half,
                                    &threads)
                 : PyArg_ParseTuple(args, "y*y*y*y*w*nnnnnpn", &x, &e, &rows, &cols, &out,
                                    &batch, &tables, &dim, &pairs, &width, &half, &threads);
    if (!parsed) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t features = tables + 1, item = half ? 2 : 4;
    if (check_sizes(batch, features, dim, pairs)) goto done;
    if (width < dim + pairs) {
        PyErr_Format(PyExc_ValueError, "width %zd is less than dim %zd plus %zd pairs", width,
                     dim, pairs);
        goto done;
    }
    if (check(&x, batch * dim * item, "x") || check(&e, batch * tables * dim * 4, "e") ||
        check(&rows, pairs * 8, "rows") || check(&cols, pairs * 8, "cols") ||
        (backward && (check(&grad, batch * width * item, "grad") ||
                      check(&ge, batch * tables * dim * 4, "ge"))) ||
        check(&out, batch * (backward ? dim : width) * item, backward ? "gx" : "out") ||
        check_pairs(rows.buf, cols.buf, pairs, features))
        goto done;
    void *off = backward ? (void *)pair_tables(rows.buf, cols.buf, pairs, features)
                         : (void *)pair_offsets(rows.buf, cols.buf, pairs, dim);
    if (off == NULL) goto done;
    const Py_ssize_t slots = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads,
                     stride = concat_scratch(features, dim, pairs);
    float *scratch = PyMem_Malloc((size_t)(slots * stride) * sizeof(float));
    if (scratch == NULL) {
        PyMem_Free(off);
        PyErr_NoMemory();
        goto done;
    }
    Concat c = {x.buf, e.buf, backward ? grad.buf : NULL, backward ? NULL : out.buf,
                backward ? out.buf : NULL, backward ? ge.buf : NULL, off, scratch, tables, dim,
                pairs, width, stride, half, backward};
    Py_BEGIN_ALLOW_THREADS
    concat_split(&c, batch, threads);
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    PyMem_Free(off);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&e);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&cols);
    PyBuffer_Release(&out);
    if (backward) {
        PyBuffer_Release(&grad);
        PyBuffer_Release(&ge);
    }
    return result;
}

static PyObject *py_concat_forward(PyObject *self, PyObject *args) { return run_concat(args, 0); }

static PyObject *py_concat_backward(PyObject *self, PyObject *args) {
    return run_concat(args, 1);
}

/* bag_sum and bag_grad's arguments: (table, ids, offsets, bags, weights or None, mean,
 * out, features, batch, dim, rows), `table` read and `bags` written by bag_sum, the other
 * way round by bag_grad. Checks every size (the table's left to the caller with
 * own_table_size) and id; 0 on success. */
typedef struct {
    Py_buffer table, ids, offsets, bags, weights;
    int have_weights, mean;
    Py_ssize_t features, batch, dim, rows;
} BagArgs;

static void release_bags(BagArgs *a) {
    PyBuffer_Release(&a->table);
    PyBuffer_Release(&a->ids);
    PyBuffer_Release(&a->offsets);
    PyBuffer_Release(&a->bags);
    if (a->have_weights) PyBuffer_Release(&a->weights);
}

static int parse_bags(PyObject *args, BagArgs *a, int sum, int own_table_size) {
    PyObject *weights;
    memset(a, 0, sizeof *a);
    const char *format = sum ? "y*y*y*w*Opnnnn" : "w*y*y*y*Opnnnn";
    if (!PyArg_ParseTuple(args, format, &a->table, &a->ids, &a->offsets, &a->bags, &weights,
                          &a->mean, &a->features, &a->batch, &a->dim, &a->rows))
        return -1;
    if (weights != Py_None) {
        if (PyObject_GetBuffer(weights, &a->weights, PyBUF_SIMPLE) < 0) goto fail;
        a->have_weights = 1;
    }
    const Py_ssize_t n = a->ids.len / 8, bags = a->features * a->batch;
    if (a->features < 1 || a->batch < 0 || a->dim < 1 || a->rows < 0 || a->ids.len % 8 ||
        (!own_table_size && check(&a->table, a->rows * a->dim * 4, "table")) ||
        check(&a->offsets, (bags + 1) * 8, "offsets") ||
        check(&a->bags, bags * a->dim * 4, "bags") ||
        (a->have_weights && check(&a->weights, n * 4, "weights")))
        goto fail;
    const int64_t *off = a->offsets.buf, *id = a->ids.buf;
    if (off[0] != 0 || off[bags] != n) {
        PyErr_SetString(PyExc_ValueError, "offsets must run from 0 to the number of ids");
        goto fail;
    }
    for (Py_ssize_t j = 0; j < bags; j++) {
        if (off[j + 1] < off[j]) {
            PyErr_Format(PyExc_ValueError, "offsets decrease at bag %zd", j);
            goto fail;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (id[k] < 0 || id[k] >= a->rows) {
            PyErr_Format(PyExc_ValueError, "id %lld at %zd outside [0, %zd)", (long long)id[k], k,
                         a->rows);
            goto fail;
        }
    }
    return 0;
fail:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad bag arguments");
    release_bags(a);
    return -1;
}

static PyObject *py_bag_sum(PyObject *self, PyObject *args) {
    BagArgs a;
    if (parse_bags(args, &a, 1, 0) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    bag_sum(a.table.buf, a.ids.buf, a.offsets.buf, a.have_weights ? a.weights.buf : NULL, a.mean,
            a.bags.buf, a.features, a.batch, a.dim);
    Py_END_ALLOW_THREADS
    release_bags(&a);
    Py_RETURN_NONE;
}

static PyObject *py_bag_grad(PyObject *self, PyObject *args) {
    BagArgs a;
    if (parse_bags(args, &a, 0, 0) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    bag_grad(a.ids.buf, a.offsets.buf, a.bags.buf, a.have_weights ? a.weights.buf : NULL,
             a.mean, a.table.buf, a.features, a.batch, a.dim, a.rows);
    Py_END_ALLOW_THREADS
    release_bags(&a);
    Py_RETURN_NONE;
}

/* row_sums(ids, offsets, grad, weights or None, mean, features, batch, dim, rows,
 * out_rows, out_sums, tables[, momentum, out_state]) -> the number U of distinct ids;
 * out_rows[:U] and out_sums[:U] hold them and their gradients (out_rows, out_sums and
 * out_state hold room for every id); tables[f]: the table feature f looks up (features of
 * one table share ids); with momentum (a statistic a row), out_state[:U] holds the
 * distinct rows' statistics, as momentum.index_select(0, rows) would. */
static PyObject *py_row_sums(PyObject *self, PyObject *args) {
    const Py_ssize_t nargs = PyTuple_Check(args) ? PyTuple_GET_SIZE(args) : -1;
    if (nargs != 12 && nargs != 14) {
        PyErr_SetString(PyExc_TypeError,
                        "row_sums takes ids, offsets, grad, weights, mean, features, batch, dim, "
                        "rows, out_rows, out_sums, tables[, momentum, out_state]");
        return NULL;
    }
    /* parse_bags's layout (table, ids, offsets, bags, weights, mean, features, batch, dim,
     * rows), out_sums in the table's place (its size is checked below) */
    PyObject *bag_args = Py_BuildValue("(OOOOOOOOOO)", PyTuple_GET_ITEM(args, 10),
                                       PyTuple_GET_ITEM(args, 0), PyTuple_GET_ITEM(args, 1),
                                       PyTuple_GET_ITEM(args, 2), PyTuple_GET_ITEM(args, 3),
                                       PyTuple_GET_ITEM(args, 4), PyTuple_GET_ITEM(args, 5),
                                       PyTuple_GET_ITEM(args, 6), PyTuple_GET_ITEM(args, 7),
                                       PyTuple_GET_ITEM(args, 8));
    if (bag_args == NULL) return NULL;
    BagArgs a;
    const int parsed = parse_bags(bag_args, &a, 0, 1);
    Py_DECREF(bag_args);
    if (parsed < 0) return NULL;
    Py_buffer rows_out, tables, momentum, state_out;
    int have_rows = 0, have_tables = 0, have_momentum = 0, have_state = 0;
    PyObject *result = NULL;
    Entry *hash = NULL;
    Py_ssize_t *groups = NULL;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, 9), &rows_out, PyBUF_WRITABLE) < 0) goto done;
    have_rows = 1;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, 11), &tables, PyBUF_SIMPLE) < 0) goto done;
    have_tables = 1;
    if (nargs == 14) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, 12), &momentum, PyBUF_SIMPLE) < 0)
            goto done;
        have_momentum = 1;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, 13), &state_out, PyBUF_WRITABLE) < 0)
            goto done;
        have_state = 1;
    }
    const Py_ssize_t n = a.ids.len / 8;
    if (check(&rows_out, n * 8, "out_rows") || check(&a.table, n * a.dim * 4, "out_sums") ||
        check(&tables, a.features * 8, "tables") ||
        (have_momentum &&
         (check(&momentum, a.rows * 4, "momentum") || check(&state_out, n * 4, "out_state"))))
        goto done;
    /* the tables in the order of their first features, and each one's ids */
    const int64_t *table_of = tables.buf, *off = a.offsets.buf;
    groups = PyMem_RawMalloc(2 * (size_t)a.features * sizeof *groups);
    if (groups == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t *firsts = groups, *counts = groups + a.features, ntables = 0, largest = 0;
    for (Py_ssize_t first = 0; first < a.features; first++) {
        int seen = 0;
        for (Py_ssize_t e = 0; e < first && !seen; e++) seen = table_of[e] == table_of[first];
        if (seen) continue; /* its table's features were counted with an earlier one's */
        Py_ssize_t count = 0;
        for (Py_ssize_t f = first; f < a.features; f++)
            if (table_of[f] == table_of[first])
                count += off[(f + 1) * a.batch] - off[f * a.batch];
        firsts[ntables] = first;
        counts[ntables++] = count;
        if (count > largest) largest = count;
    }
    const int threads = threads_for(n, MIN_SUMS_PER_THREAD);
    const size_t hash_size = (size_t)1 << hash_bits(largest);
    hash = PyMem_RawMalloc((size_t)threads * hash_size * sizeof *hash);
    if (hash == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t distinct;
    Py_BEGIN_ALLOW_THREADS
    distinct = distinct_sums(a.ids.buf, a.offsets.buf, a.bags.buf,
                             a.have_weights ? a.weights.buf : NULL, table_of, a.mean, a.features,
                             a.batch, a.dim, firsts, counts, ntables, threads, hash, hash_size,
                             rows_out.buf, a.table.buf, have_momentum ? momentum.buf : NULL,
                             have_state ? state_out.buf : NULL);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(distinct);
done:
    PyMem_RawFree(hash);
    PyMem_RawFree(groups);
    if (have_state) PyBuffer_Release(&state_out);
    if (have_momentum) PyBuffer_Release(&momentum);
    if (have_tables) PyBuffer_Release(&tables);
    if (have_rows) PyBuffer_Release(&rows_out);
    release_bags(&a);
    return result;
}

/* adagrad_rows(weight, momentum, rows, sums, state, factor, count, dim). */
static PyObject *py_adagrad_rows(PyObject *self, PyObject *args) {
    Py_buffer weight, momentum, rows, sums, state, factor;
    Py_ssize_t count, dim;
    if (!PyArg_ParseTuple(args, "w*w*y*y*y*y*nn", &weight, &momentum, &rows, &sums, &state,
                          &factor, &count, &dim))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t table_rows = dim > 0 ? weight.len / 4 / dim : 0;
    if (dim < 1 || count < 0 || weight.len % (4 * dim)) {
        PyErr_Format(PyExc_ValueError, "weight holds %zd bytes, not rows of %zd floats",
                     weight.len, dim);
        goto done;
    }
    if (check(&momentum, table_rows * 4, "momentum") || check(&rows, count * 8, "rows") ||
        check(&sums, count * dim * 4, "sums") || check(&state, count * 4, "state") ||
        check(&factor, count * 4, "factor"))
        goto done;
    const int64_t *r = rows.buf;
    for (Py_ssize_t u = 0; u < count; u++) {
        if (r[u] < 0 || r[u] >= table_rows) {
            PyErr_Format(PyExc_ValueError, "row %lld at %zd outside [0, %zd)", (long long)r[u],
                         u, table_rows);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    adagrad_update(weight.buf, momentum.buf, rows.buf, sums.buf, state.buf, factor.buf, count,
                   dim);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&weight);
    PyBuffer_Release(&momentum);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&sums);
    PyBuffer_Release(&state);
    PyBuffer_Release(&factor);
    return result;
}

/* row_statistics(sums, state, count, dim): state[u] += the mean square of sums[u]. */
static PyObject *py_row_statistics(PyObject *self, PyObject *args) {
    Py_buffer sums, state;
    Py_ssize_t count, dim;
    if (!PyArg_ParseTuple(args, "y*w*nn", &sums, &state, &count, &dim)) return NULL;
    PyObject *result = NULL;
    if (dim < 1 || count < 0) {
        PyErr_Format(PyExc_ValueError, "row_statistics needs count >= 0 and dim >= 1, got %zd, %zd",
                     count, dim);
        goto done;
    }
    if (check(&sums, count * dim * 4, "sums") || check(&state, count * 4, "state")) goto done;
    Py_BEGIN_ALLOW_THREADS
    statistics_update(sums.buf, state.buf, count, dim);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sums);
    PyBuffer_Release(&state);
    return result;
}

/* global_ids(ids, offsets, base, out, features, batch): out[k] = ids[k] + base[f] for
 * feature f's ids; the offsets checked to rise from 0 to the ids' count. */
static PyObject *py_global_ids(PyObject *self, PyObject *args) {
    Py_buffer ids, offsets, base, out;
    Py_ssize_t features, batch;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nn", &ids, &offsets, &base, &out, &features, &batch))
        return NULL;
    PyObject *result = NULL;
    if (features < 0 || batch < 0) {
        PyErr_Format(PyExc_ValueError, "global_ids needs features >= 0 and batch >= 0, got %zd, %zd",
                     features, batch);
        goto done;
    }
    const Py_ssize_t count = ids.len / 8;
    if (check(&offsets, (features * batch + 1) * 8, "offsets") ||
        check(&base, features * 8, "base") || check(&out, count * 8, "out"))
        goto done;
    const int64_t *off = offsets.buf;
    const Py_ssize_t bags = features * batch;
    if (off[0] != 0 || off[bags] != count) {
        PyErr_Format(PyExc_ValueError,
                     "global_ids: offsets must run from 0 to the %zd ids, got %lld to %lld",
                     count, (long long)off[0], (long long)off[bags]);
        goto done;
    }
    for (Py_ssize_t j = 0; j < bags; j++) {
        if (off[j] > off[j + 1]) {
            PyErr_Format(PyExc_ValueError,
                         "global_ids: offsets must not fall, got %lld then %lld at bag %zd",
                         (long long)off[j], (long long)off[j + 1], j);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    global_ids(ids.buf, off, base.buf, out.buf, features, batch);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    return result;
}

/* ids_in_range(ids, starts, rows, features): whether feature f's ids (ids[starts[f]] to
 * ids[starts[f + 1]]) all lie in [0, rows[f]); the starts checked to rise within the ids. */
static PyObject *py_ids_in_range(PyObject *self, PyObject *args) {
    Py_buffer ids, starts, rows;
    Py_ssize_t features;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &ids, &starts, &rows, &features)) return NULL;
    PyObject *result = NULL;
    if (features < 0) {
        PyErr_Format(PyExc_ValueError, "ids_in_range needs features >= 0, got %zd", features);
        goto done;
    }
    if (check(&starts, (features + 1) * 8, "starts") || check(&rows, features * 8, "rows"))
        goto done;
    const int64_t *at = starts.buf;
    const Py_ssize_t count = ids.len / 8;
    for (Py_ssize_t f = 0; f < features; f++) {
        if (at[f] < 0 || at[f] > at[f + 1] || at[f + 1] > count) {
            PyErr_Format(PyExc_ValueError,
                         "ids_in_range: starts must rise within the %zd ids, got %lld then "
                         "%lld at feature %zd", count, (long long)at[f], (long long)at[f + 1], f);
            goto done;
        }
    }
    int in_range;
    Py_BEGIN_ALLOW_THREADS
    in_range = ids_in_range(ids.buf, at, rows.buf, features);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(in_range);
done:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&rows);
    return result;
}

/* relu_grad(grad, out, dst, count): dst = threshold_backward(grad, out, 0) over `count`
 * bfloat16 elements (their 16-bit patterns); dst may be grad. */
static PyObject *py_relu_grad(PyObject *self, PyObject *args) {
    Py_buffer grad, out, dst;
    Py_ssize_t count;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &grad, &out, &dst, &count)) return NULL;
    PyObject *result = NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "relu_grad needs count >= 0, got %zd", count);
        goto done;
    }
    if (check(&grad, count * 2, "grad") || check(&out, count * 2, "out") ||
        check(&dst, count * 2, "dst"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    relu_grad(grad.buf, out.buf, dst.buf, count);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&grad);
    PyBuffer_Release(&out);
    PyBuffer_Release(&dst);
    return result;
}

/* The calling thread's flush-to-zero and denormals-are-zero modes (x86's MXCSR bits 15
 * and 6, AArch64's FPCR.FZ): subnormal results and operands become zeros. Returns 0
 * where the CPU has no such mode. */
static int set_flush_mode(int on) {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned int bits = 0x8040u;
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(on ? (csr | bits) : (csr & ~bits));
    return 1;
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    fpcr = on ? (fpcr | (UINT64_C(1) << 24)) : (fpcr & ~(UINT64_C(1) << 24));
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
    return 1;
#else
    (void)on;
    return 0;
#endif
}

/* flush_subnormals(on): the mode on this thread and on every thread of OpenMP's pool (the
 * threads torch's operators run on, as many as the machine has processors or as torch
 * now asks for, whichever is more); threads the pool starts later inherit it from this
 * one. torch.set_flush_denormal sets the calling thread's alone. */
static PyObject *py_flush_subnormals(PyObject *self, PyObject *args) {
    int on;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    int supported = set_flush_mode(on);
#ifdef _OPENMP
    int threads = omp_get_num_procs();
    if (omp_get_max_threads() > threads) threads = omp_get_max_threads();
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    set_flush_mode(on);
    Py_END_ALLOW_THREADS
#endif
    return PyBool_FromLong(supported);
}

/* vector_lanes([lanes]): the width of the dots' kernels (the note at `lanes`); given 16,
 * 8 or 4, sets it (so that a test can run every width on one CPU) and returns the width
 * before. */
static PyObject *py_vector_lanes(PyObject *self, PyObject *args) {
    int want = 0;
    if (!PyArg_ParseTuple(args, "|i", &want)) return NULL;
    if (want != 0 && want != 16 && want != 8 && want != 4) {
        PyErr_Format(PyExc_ValueError, "vector_lanes takes 16, 8 or 4, got %d", want);
        return NULL;
    }
    const int was = lanes;
    if (want) lanes = want;
    return PyLong_FromLong(was);
}

static PyMethodDef dots_methods[] = {
    {"flush_subnormals", py_flush_subnormals, METH_VARARGS,
     "flush_subnormals(on): flush-to-zero and denormals-are-zero on this thread and on "
     "OpenMP's threads; False where the CPU has no such mode"},
    {"forward", py_forward, METH_VARARGS,
     "forward(x, rows, cols, out, batch, features, dim, pairs, threads): out[b, p] = the "
     "dot of x[b, rows[p]] and x[b, cols[p]]"},
    {"backward", py_backward, METH_VARARGS,
     "backward(x, rows, cols, grad, gx, batch, features, dim, pairs, threads): gx, the "
     "gradient of x given grad, the gradient of out"},
    {"concat_forward", py_concat_forward, METH_VARARGS,
     "concat_forward(x, e, rows, cols, out, batch, tables, dim, pairs, width, half, threads): "
     "out[b] = [x[b], the pairs' dots over x[b] and e[b]'s rows, zeros]"},
    {"concat_backward", py_concat_backward, METH_VARARGS,
     "concat_backward(x, e, rows, cols, grad, gx, ge, batch, tables, dim, pairs, width, half, "
     "threads): gx and ge, the gradients of x and e given grad, that of out"},
    {"bag_sum", py_bag_sum, METH_VARARGS,
     "bag_sum(table, ids, offsets, out, weights or None, mean, features, batch, dim, rows): "
     "the pooled bags (feature-major) into out[batch, features * dim]"},
    {"bag_grad", py_bag_grad, METH_VARARGS,
     "bag_grad(out, ids, offsets, grad, weights or None, mean, features, batch, dim, rows): "
     "add each id's share of its bag's gradient grad[batch, features * dim] into "
     "out[rows, dim]"},
    {"row_sums", py_row_sums, METH_VARARGS,
     "row_sums(ids, offsets, grad, weights or None, mean, features, batch, dim, rows, "
     "out_rows, out_sums, tables): the distinct ids into out_rows and their summed "
     "gradients, given grad[batch, features * dim], into out_sums; returns their count"},
    {"adagrad_rows", py_adagrad_rows, METH_VARARGS,
     "adagrad_rows(weight, momentum, rows, sums, state, factor, count, dim): "
     "momentum[rows[u]] = state[u] and weight[rows[u]] -= sums[u] * factor[u]"},
    {"vector_lanes", py_vector_lanes, METH_VARARGS,
     "vector_lanes([lanes]): the lanes of the dots' vectors (16 with AVX-512, 8 with AVX2, "
     "4 elsewhere); given 16, 8 or 4, sets it and returns the width before"},
    {"row_statistics", py_row_statistics, METH_VARARGS,
     "row_statistics(sums, state, count, dim): state[u] += the mean of sums[u]'s squares"},
    {"global_ids", py_global_ids, METH_VARARGS,
     "global_ids(ids, offsets, base, out, features, batch): out[k] = ids[k] + base[f] for "
     "the ids of feature f"},
    {"ids_in_range", py_ids_in_range, METH_VARARGS,
     "ids_in_range(ids, starts, rows, features): whether feature f's ids, ids[starts[f]] to "
     "ids[starts[f + 1]], all lie in [0, rows[f])"},
    {"relu_grad", py_relu_grad, METH_VARARGS,
     "relu_grad(grad, out, dst, count): dst = threshold_backward(grad, out, 0) over count "
     "bfloat16 elements"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef dots_module = {
    PyModuleDef_HEAD_INIT, "towerrec.modules._fused",
    "Fused CPU kernels of the training step (_fused.c).", -1, dots_methods,
};

PyMODINIT_FUNC PyInit__fused(void) {
#if defined(CLONED)
    __builtin_cpu_init();
    lanes = __builtin_cpu_supports("avx512f") ? 16 : __builtin_cpu_supports("avx2") ? 8 : 4;
#elif defined(__AVX512F__)
    lanes = 16;
#elif defined(__AVX2__)
    lanes = 8;
#endif
    PyObject *m = PyModule_Create(&dots_module);
    if (m != NULL && PyModule_AddIntConstant(m, "LANES", LANES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
