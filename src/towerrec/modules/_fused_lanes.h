/* The pairwise dots' kernels and the lookup's row loops for one vector width, included
 * by _fused.c once per width (16, 8 and 4 lanes; the note at `lanes` there) with:
 *
 *   NV       the lanes of a vector
 *   VEC      its type; LOADV, STOREV its unaligned load and store; REDUCEV(q) lane k
 *            the sum of the NV lanes of q[k], in reduce16's order from its level of
 *            NV / 2 lanes on
 *   FN(x)    x's name at this width (x_16, x_8, x_4)
 *
 * Every lane's arithmetic and order is the same at every width, so are the bits: a row
 * of 16 lanes is PARTS vectors, and the forward adds a pair's PARTS products lane by lane
 * in reduce16's first levels (parts p and p + PARTS / 2, then halving) before REDUCEV. */

/* vectors in a row of 16 lanes */
#define PARTS (16 / NV)
/* sample_grad's vectors held in registers per gradient row and block of lanes: 64 lanes
 * at 16 and 8 lanes, 32 at 4 (16 registers at 128 bits) */
#define BLOCK_VECS (NV == 4 ? 8 : 64 / NV)

/* One sample's pairs: each pair's products summed lane by lane over the D / 16 rows of
 * 16 lanes, its PARTS vectors added (reduce16's first levels), then the sums of NV pairs
 * at once (REDUCEV). off: each pair's two vectors' offsets into the sample, the pairs
 * padded to a multiple of 16 with (0, 0) (whose sums are not written). dim: 16 passed as
 * a constant where it is 16, so that the loop over rows folds away. */
static inline __attribute__((always_inline)) void FN(sample_dots)(const float *s,
                                                                  const Py_ssize_t *off,
                                                                  float *o, Py_ssize_t dim,
                                                                  Py_ssize_t pairs) {
    for (Py_ssize_t p0 = 0; p0 < pairs; p0 += NV) {
        VEC q[NV];
#pragma GCC unroll 16
        for (int k = 0; k < NV; k++) {
            const float *u = s + off[2 * (p0 + k)], *v = s + off[2 * (p0 + k) + 1];
            VEC part[PARTS];
#pragma GCC unroll 4
            for (int c = 0; c < PARTS; c++) part[c] = LOADV(u + c * NV) * LOADV(v + c * NV);
            for (Py_ssize_t d = 16; d < dim; d += 16) {
#pragma GCC unroll 4
                for (int c = 0; c < PARTS; c++)
                    part[c] += LOADV(u + d + c * NV) * LOADV(v + d + c * NV);
            }
#pragma GCC unroll 2
            for (int half = PARTS / 2; half >= 1; half /= 2) {
#pragma GCC unroll 2
                for (int c = 0; c < half; c++) part[c] = part[c] + part[c + half];
            }
            q[k] = part[0];
        }
        const VEC sums = REDUCEV(q);
        if (pairs - p0 >= NV) {
            STOREV(o + p0, sums);
        } else {
            for (Py_ssize_t k = 0; k < pairs - p0; k++) o[p0 + k] = sums[k];
        }
    }
}

/* One sample's gradient rows t = S X, S the symmetric [F, F] matrix of the pairs'
 * gradients: S[i, j] = g[pos[i F + j]] for the pair (i, j) or (j, i), where gl is the
 * sample's g with a zero after it (pos = P where no pair holds i and j), a self pair's
 * twice (`selfs`). Each row of t is summed over the F vectors in order, BLOCK_VECS
 * vectors at a time held in registers: one load and one multiply-add a vector and pair,
 * where adding each pair's two products into t took three loads and a store. The pairs
 * must be distinct (dots_backward checks; `sample_grad_pairs` takes any). */
static inline __attribute__((always_inline)) void FN(sample_grad)(
    const float *s, const float *g, float *t, const int32_t *pos, float *gl, int selfs,
    Py_ssize_t features, Py_ssize_t dim, Py_ssize_t pairs) {
    memcpy(gl, g, (size_t)pairs * sizeof(float));
    gl[pairs] = 0.0f;
    for (Py_ssize_t i = 0; i < features; i++) {
        const int32_t *row = pos + i * features;
        float *out = t + i * dim;
        const float twice = selfs ? gl[row[i]] : 0.0f; /* the self pair's second term */
        const float *xi = s + i * dim;
        Py_ssize_t d = 0;
        for (; d + BLOCK_VECS * NV <= dim; d += BLOCK_VECS * NV) {
            VEC a[BLOCK_VECS];
#pragma GCC unroll 8
            for (int c = 0; c < BLOCK_VECS; c++) a[c] = twice * LOADV(xi + d + c * NV);
            for (Py_ssize_t j = 0; j < features; j++) {
                const float w = gl[row[j]], *x = s + j * dim + d;
#pragma GCC unroll 8
                for (int c = 0; c < BLOCK_VECS; c++) a[c] += w * LOADV(x + c * NV);
            }
#pragma GCC unroll 8
            for (int c = 0; c < BLOCK_VECS; c++) STOREV(out + d + c * NV, a[c]);
        }
        for (; d < dim; d += NV) {
            VEC a = twice * LOADV(xi + d);
            for (Py_ssize_t j = 0; j < features; j++) a += gl[row[j]] * LOADV(s + j * dim + d);
            STOREV(out + d, a);
        }
    }
}

/* One sample's gradient rows t += S X pair by pair (t zeroed by the caller), any pairs,
 * repeated ones too: the first vector's gradient is summed in a register while
 * consecutive pairs share that vector and added when it changes, so the row-major order
 * the interaction lists them in adds it once a row. Faster than sample_grad at dim 16,
 * where a row is one register and building S costs as much as the products. */
static inline __attribute__((always_inline)) void FN(sample_grad_pairs)(
    const float *s, const float *g, float *t, const int32_t *pi, const int32_t *pj,
    Py_ssize_t dim, Py_ssize_t pairs) {
    for (Py_ssize_t d = 0; d < dim; d += NV) {
        Py_ssize_t cur = pi[0] * dim + d;
        VEC a = (VEC){0};
        for (Py_ssize_t p = 0; p < pairs; p++) {
            const Py_ssize_t i = pi[p] * dim + d, j = pj[p] * dim + d;
            if (i != cur) {
                STOREV(t + cur, LOADV(t + cur) + a);
                a = (VEC){0};
                cur = i;
            }
            const float w = g[p];
            a += w * LOADV(s + j);
            STOREV(t + j, LOADV(t + j) + w * LOADV(s + i));
        }
        STOREV(t + cur, LOADV(t + cur) + a);
    }
}

/* sample_grad_pairs's sums at dim 16 for the pairs (0, 1), (0, 2), ..., (0, F-1),
 * (1, 2), ..., (F-2, F-1), the upper triangle in row-major order (DotInteraction's): the
 * rows taken four at a time, so that each later row's vector and gradient are loaded and
 * stored once for the four, and the pairs' positions computed rather than read; a row's
 * PARTS vectors one after the other. Every gradient row gets the same additions in the
 * same order as in sample_grad_pairs (t zeroed by the caller): row i's own sum a_i
 * (pairs (i, j), j ascending) added last, after the terms of the pairs (r, i), r
 * ascending. */
static inline __attribute__((always_inline)) void FN(sample_grad_triu)(const float *s,
                                                                       const float *g,
                                                                       float *t,
                                                                       Py_ssize_t features) {
    const Py_ssize_t rows = features - 1; /* the rows that lead a pair */
/* row i's lanes from h, and the gradient of the pair (i, j) */
#define PART(base, i) ((base) + (i) * 16 + h)
#define PAIRS_OF(i) (g + (i) * (2 * features - (i) - 1) / 2 - ((i) + 1))
    Py_ssize_t i0 = 0;
    for (; i0 + 4 <= rows; i0 += 4) {
        const float *g0 = PAIRS_OF(i0), *g1 = PAIRS_OF(i0 + 1), *g2 = PAIRS_OF(i0 + 2),
                    *g3 = PAIRS_OF(i0 + 3);
        for (Py_ssize_t h = 0; h < 16; h += NV) {
            const VEC s0 = LOADV(PART(s, i0)), s1 = LOADV(PART(s, i0 + 1)),
                      s2 = LOADV(PART(s, i0 + 2)), s3 = LOADV(PART(s, i0 + 3));
            VEC a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            /* the pairs among the four rows */
            VEC sj = LOADV(PART(s, i0 + 1)), tj = LOADV(PART(t, i0 + 1));
            a0 += g0[i0 + 1] * sj;
            tj += g0[i0 + 1] * s0;
            STOREV(PART(t, i0 + 1), tj);
            sj = LOADV(PART(s, i0 + 2));
            tj = LOADV(PART(t, i0 + 2));
            a0 += g0[i0 + 2] * sj;
            tj += g0[i0 + 2] * s0;
            a1 += g1[i0 + 2] * sj;
            tj += g1[i0 + 2] * s1;
            STOREV(PART(t, i0 + 2), tj);
            sj = LOADV(PART(s, i0 + 3));
            tj = LOADV(PART(t, i0 + 3));
            a0 += g0[i0 + 3] * sj;
            tj += g0[i0 + 3] * s0;
            a1 += g1[i0 + 3] * sj;
            tj += g1[i0 + 3] * s1;
            a2 += g2[i0 + 3] * sj;
            tj += g2[i0 + 3] * s2;
            STOREV(PART(t, i0 + 3), tj);
            /* the later rows */
            for (Py_ssize_t j = i0 + 4; j < features; j++) {
                sj = LOADV(PART(s, j));
                tj = LOADV(PART(t, j));
                a0 += g0[j] * sj;
                tj += g0[j] * s0;
                a1 += g1[j] * sj;
                tj += g1[j] * s1;
                a2 += g2[j] * sj;
                tj += g2[j] * s2;
                a3 += g3[j] * sj;
                tj += g3[j] * s3;
                STOREV(PART(t, j), tj);
            }
            STOREV(PART(t, i0), LOADV(PART(t, i0)) + a0);
            STOREV(PART(t, i0 + 1), LOADV(PART(t, i0 + 1)) + a1);
            STOREV(PART(t, i0 + 2), LOADV(PART(t, i0 + 2)) + a2);
            STOREV(PART(t, i0 + 3), LOADV(PART(t, i0 + 3)) + a3);
        }
    }
    for (; i0 < rows; i0++) {
        const float *gr = PAIRS_OF(i0);
        for (Py_ssize_t h = 0; h < 16; h += NV) {
            const VEC si = LOADV(PART(s, i0));
            VEC a = {0};
            for (Py_ssize_t j = i0 + 1; j < features; j++) {
                a += gr[j] * LOADV(PART(s, j));
                STOREV(PART(t, j), LOADV(PART(t, j)) + gr[j] * si);
            }
            STOREV(PART(t, i0), LOADV(PART(t, i0)) + a);
        }
    }
#undef PART
#undef PAIRS_OF
}

/* o = the sum of the rows weight[ids[k]] (times weights[k] where given), k in [lo, hi),
 * divided by `length` where `mean` and the bag is not empty: bag_sum's vector loop, dim a
 * multiple of 16. */
static inline __attribute__((always_inline)) void FN(bag_rows)(
    const float *weight, const int64_t *ids, const float *weights, int64_t lo, int64_t hi,
    int mean, float length, float *o, Py_ssize_t dim) {
    for (Py_ssize_t d = 0; d < dim; d += NV) {
        VEC acc = (VEC){0};
        for (int64_t k = lo; k < hi; k++) {
            const VEC row = LOADV(weight + ids[k] * dim + d);
            acc += weights == NULL ? row : weights[k] * row;
        }
        STOREV(o + d, mean && hi > lo ? acc / length : acc);
    }
}

/* row += g divided by `length` where `mean`, then times w where `weighted`: add_share's
 * vector loop, dim a multiple of 16. */
static inline __attribute__((always_inline)) void FN(share_rows)(float *row, const float *g,
                                                                 float length, float w,
                                                                 int mean, int weighted,
                                                                 Py_ssize_t dim) {
    for (Py_ssize_t d = 0; d < dim; d += NV) {
        VEC v = LOADV(g + d);
        if (mean) v = v / length;
        if (weighted) v = v * w;
        STOREV(row + d, LOADV(row + d) + v);
    }
}

#undef PARTS
#undef BLOCK_VECS
#undef NV
#undef VEC
#undef LOADV
#undef STOREV
#undef REDUCEV
#undef FN
