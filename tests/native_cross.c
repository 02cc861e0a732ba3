/* tests/test_native_aarch64.py: _fused.c's dots and lookup kernels run at one width
 * (argv[1]: 16, 8 or 4 lanes) on fixed inputs, their outputs' bytes written to
 * stdout, so that builds for two CPUs (x86-64 here, AArch64 under qemu) can be compared
 * bit for bit. The extension's Python entry points are linked but never called. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
#include <stdlib.h>
/* the kernels' scratch, without an interpreter */
#define PyMem_Calloc calloc
#define PyMem_Malloc malloc
#define PyMem_Free free
#include "_fused.c"

static uint64_t state = 12345;

static uint32_t next(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(state >> 33);
}

/* in [-1, 1), one in seven scaled by 1000, one in 23 a zero of either sign */
static float draw(void) {
    const uint32_t r = next();
    if (r % 23 == 0) return (r & 1) ? -0.0f : 0.0f;
    return ((float)(r % 2000000) / 1000000.0f - 1.0f) * ((r % 7) ? 1.0f : 1000.0f);
}

static void fill(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = draw();
}

static void emit(const void *p, size_t bytes) { fwrite(p, 1, bytes, stdout); }

/* The dots forward and backward over the upper triangle of `features`, in row-major order
 * (the module's) or shuffled. */
static void dots(Py_ssize_t batch, Py_ssize_t features, Py_ssize_t dim, int shuffled) {
    const Py_ssize_t pairs = features * (features - 1) / 2;
    int64_t *rows = malloc(pairs * sizeof *rows), *cols = malloc(pairs * sizeof *cols);
    Py_ssize_t p = 0;
    for (Py_ssize_t i = 0; i < features; i++)
        for (Py_ssize_t j = i + 1; j < features; j++, p++) rows[p] = i, cols[p] = j;
    if (shuffled)
        for (Py_ssize_t k = pairs - 1; k > 0; k--) {
            const Py_ssize_t m = (Py_ssize_t)(next() % (uint32_t)(k + 1));
            const int64_t r = rows[k], c = cols[k];
            rows[k] = rows[m], cols[k] = cols[m], rows[m] = r, cols[m] = c;
        }
    const size_t xs = (size_t)(batch * features * dim), ps = (size_t)(batch * pairs);
    float *x = malloc(xs * 4), *out = malloc(ps * 4), *grad = malloc(ps * 4);
    float *gx = malloc(xs * 4), *gl = malloc((size_t)(pairs + 16) * 4);
    fill(x, xs);
    fill(grad, ps);
    Py_ssize_t *off = pair_offsets(rows, cols, pairs, dim);
    int32_t *idx = pair_tables(rows, cols, pairs, features);
    dots_forward(x, off, out, batch, features, dim, pairs);
    dots_backward(x, idx, grad, gx, gl, batch, features, dim, pairs);
    emit(out, ps * 4);
    emit(gx, xs * 4);
    free(rows), free(cols), free(x), free(out), free(grad), free(gx), free(gl), free(off);
    free(idx);
}

/* The pooled lookup and the rows' summed gradients, bags of 0 to 3 weighted ids. */
static void lookup(Py_ssize_t batch, Py_ssize_t features, Py_ssize_t dim, int mean) {
    const Py_ssize_t rows = 300, bags = batch * features;
    int64_t *offsets = malloc((size_t)(bags + 1) * 8), *ids = malloc((size_t)bags * 3 * 8);
    offsets[0] = 0;
    for (Py_ssize_t j = 0; j < bags; j++) offsets[j + 1] = offsets[j] + j % 4;
    for (int64_t k = 0; k < offsets[bags]; k++) ids[k] = (k * 7919) % rows;
    float *table = malloc((size_t)(rows * dim) * 4), *w = malloc((size_t)bags * 3 * 4);
    float *out = malloc((size_t)(bags * dim) * 4), *grad = malloc((size_t)(bags * dim) * 4);
    float *summed = calloc((size_t)(rows * dim), 4);
    fill(table, (size_t)(rows * dim));
    fill(w, (size_t)bags * 3);
    fill(grad, (size_t)(bags * dim));
    bag_sum_range(table, ids, offsets, w, mean, out, features, batch, dim, 0, bags);
    bag_grad(ids, offsets, grad, w, mean, summed, features, batch, dim, rows);
    emit(out, (size_t)(bags * dim) * 4);
    emit(summed, (size_t)(rows * dim) * 4);
    free(offsets), free(ids), free(table), free(w), free(out), free(grad), free(summed);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s LANES\n", argv[0]);
        return 2;
    }
    lanes = atoi(argv[1]);
    dots(37, 27, 16, 0);
    dots(37, 27, 16, 1);
    dots(21, 11, 64, 0);
    dots(21, 11, 48, 1);
    lookup(33, 5, 16, 0);
    lookup(33, 5, 32, 1);
    return 0;
}
