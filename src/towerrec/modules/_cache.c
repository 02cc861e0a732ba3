/* towerrec.modules._cache: the host bookkeeping of a cached table (table_cache.py) for
 * tables of dense ids, one pass over a lookup's ids each, in place of some 25 small
 * tensor operations a lookup. Each function does exactly what its PyTorch path in
 * table_cache.py and cache_maps.py does (tests/test_cache_native.py compares the two
 * state for state); the arrays are the cache's own tensors, passed as buffers:
 *
 *   find(ids, slot_map, unique, inverse, slot, missing) -> (u, m)
 *       the lookup's distinct ids sorted (unique[:u]), each id's place among them
 *       (inverse), their slots (-1: not cached) and the missing ids (missing[:m])
 *   victims(slot, count, filled, last_used, protected, q_slots, q_stamps, head, tail, out)
 *       -> (head, empty)
 *       count slots to reuse into out: the empty slots [filled, ...) first, then the
 *       least recently used from the recency queue's front, never a slot in slot
 *   evicted(slots, id_of, dirty, ids, dirty_slots) -> k
 *       the ids and slots of the dirty rows among slots (write-back)
 *   fill(victims, empty, missing, slot, slot_map, id_of, dirty, uses)
 *       the victims' old ids leave the map (those after the first empty), the missing
 *       ids take the victims, and the lookup's slots (-1 where missed) get them
 *   touch(slot, inverse, out, clock, training, last_used, uses, dirty, q_slots,
 *         q_stamps, tail)
 *       the lookup's recency stamps, uses and dirty bits, its uses queued at tail (when
 *       tail >= 0), and each id's slot into out
 *
 * ids int64, slot_map int32 (-1: not cached), dirty and protected one byte a slot; the
 * GIL is released while a function runs (the read ahead finds its misses in a
 * background thread).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A writable or read-only buffer of `count` items of `size` bytes; count < 0: any. */
static int need(Py_buffer *buf, Py_ssize_t size, Py_ssize_t count, const char *name) {
    if (buf->len % size || (count >= 0 && buf->len / size != count)) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd items of %zd bytes",
                     name, buf->len, count, size);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *bufs, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&bufs[i]);
}

/* Sorts keys[0:n] (each < 2**bits) with their positions pos[0:n] by least significant
 * digit radix sort; tmp_k and tmp_p hold n items each. The result is in keys and pos. */
static void radix_sort(uint64_t *keys, int64_t *pos, uint64_t *tmp_k, int64_t *tmp_p,
                       Py_ssize_t n, int bits) {
    Py_ssize_t count[256];
    for (int shift = 0; shift < bits; shift += 8) {
        memset(count, 0, sizeof count);
        for (Py_ssize_t i = 0; i < n; i++) count[(keys[i] >> shift) & 255]++;
        if (count[(keys[0] >> shift) & 255] == n) continue; /* one digit: nothing moves */
        Py_ssize_t at = 0;
        for (int d = 0; d < 256; d++) {
            Py_ssize_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t to = count[(keys[i] >> shift) & 255]++;
            tmp_k[to] = keys[i];
            tmp_p[to] = pos[i];
        }
        memcpy(keys, tmp_k, n * sizeof *keys);
        memcpy(pos, tmp_p, n * sizeof *pos);
    }
}

static PyObject *py_find(PyObject *self, PyObject *args) {
    Py_buffer b[6];
    memset(b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*w*", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5]))
        return NULL;
    const Py_ssize_t n = b[0].len / 8, rows = b[1].len / 4;
    if (need(&b[0], 8, -1, "ids") || need(&b[1], 4, -1, "slot_map") ||
        need(&b[2], 8, n, "unique") || need(&b[3], 8, n, "inverse") ||
        need(&b[4], 8, n, "slot") || need(&b[5], 8, n, "missing")) {
        release(b, 6);
        return NULL;
    }
    const int64_t *ids = b[0].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= rows) {
            PyErr_Format(PyExc_IndexError, "id %lld at %zd is outside the table's rows [0, %zd)",
                         (long long)ids[i], i, rows);
            release(b, 6);
            return NULL;
        }
    }
    Py_ssize_t u = 0, m = 0;
    void *scratch = n ? malloc(4 * (size_t)n * 8) : NULL;
    if (n && scratch == NULL) {
        release(b, 6);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    if (n) {
        uint64_t *keys = scratch, *tmp_k = keys + n;
        int64_t *pos = (int64_t *)(tmp_k + n), *tmp_p = pos + n;
        for (Py_ssize_t i = 0; i < n; i++) {
            keys[i] = (uint64_t)ids[i];
            pos[i] = i;
        }
        int bits = rows > 1 ? 64 - __builtin_clzll((unsigned long long)(rows - 1)) : 1;
        radix_sort(keys, pos, tmp_k, tmp_p, n, bits);
        const int32_t *map = b[1].buf;
        int64_t *unique = b[2].buf, *inverse = b[3].buf, *slot = b[4].buf, *missing = b[5].buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i == 0 || keys[i] != keys[i - 1]) {
                const int64_t id = (int64_t)keys[i], s = map[id];
                unique[u] = id;
                slot[u] = s;
                if (s < 0) missing[m++] = id;
                u++;
            }
            inverse[pos[i]] = u - 1;
        }
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    release(b, 6);
    return Py_BuildValue("nn", u, m);
}

static PyObject *py_victims(PyObject *self, PyObject *args) {
    Py_buffer b[6];
    Py_ssize_t count, filled, head, tail;
    memset(b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "y*nny*w*y*y*nnw*", &b[0], &count, &filled, &b[1], &b[2], &b[3],
                          &b[4], &head, &tail, &b[5]))
        return NULL;
    const Py_ssize_t u = b[0].len / 8, slots = b[1].len / 8, queued = b[3].len / 8;
    if (need(&b[0], 8, -1, "slot") || need(&b[1], 8, -1, "last_used") ||
        need(&b[2], 1, slots, "protected") || need(&b[3], 8, -1, "q_slots") ||
        need(&b[4], 8, queued, "q_stamps") || need(&b[5], 8, count, "out")) {
        release(b, 6);
        return NULL;
    }
    if (count < 0 || filled < 0 || filled > slots || head < 0 || head > tail || tail > queued) {
        PyErr_SetString(PyExc_ValueError, "victims: count, filled, head or tail out of range");
        release(b, 6);
        return NULL;
    }
    const int64_t *slot = b[0].buf, *last_used = b[1].buf, *q_slots = b[3].buf,
                  *q_stamps = b[4].buf;
    uint8_t *protected = b[2].buf;
    int64_t *out = b[5].buf;
    const Py_ssize_t empty = count < slots - filled ? count : slots - filled;
    Py_ssize_t taken = empty, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < empty; i++) out[i] = filled + i;
    if (taken < count) {
        for (Py_ssize_t i = 0; i < u; i++)
            if (slot[i] >= 0 && slot[i] < slots) protected[slot[i]] = 1;
        Py_ssize_t at = head;
        for (; at < tail && taken < count; at++) {
            const int64_t s = q_slots[at];
            if (s < 0 || s >= slots) {
                bad = at;
                break;
            }
            if (last_used[s] == q_stamps[at] && !protected[s]) out[taken++] = s;
        }
        head = at;
        for (Py_ssize_t i = 0; i < u; i++)
            if (slot[i] >= 0 && slot[i] < slots) protected[slot[i]] = 0;
    }
    Py_END_ALLOW_THREADS
    release(b, 6);
    if (bad >= 0) {
        PyErr_Format(PyExc_AssertionError, "recency queue entry %zd names no slot", bad);
        return NULL;
    }
    if (taken < count) {
        PyErr_SetString(PyExc_AssertionError, "recency queue ran out of slots");
        return NULL;
    }
    return Py_BuildValue("nn", head, empty);
}

static PyObject *py_evicted(PyObject *self, PyObject *args) {
    Py_buffer b[5];
    memset(b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*", &b[0], &b[1], &b[2], &b[3], &b[4])) return NULL;
    const Py_ssize_t k = b[0].len / 8, slots = b[1].len / 8;
    if (need(&b[0], 8, -1, "slots") || need(&b[1], 8, -1, "id_of") ||
        need(&b[2], 1, slots, "dirty") || need(&b[3], 8, k, "ids") ||
        need(&b[4], 8, k, "dirty_slots")) {
        release(b, 5);
        return NULL;
    }
    const int64_t *victims = b[0].buf, *id_of = b[1].buf;
    const uint8_t *dirty = b[2].buf;
    int64_t *ids = b[3].buf, *dirty_slots = b[4].buf;
    Py_ssize_t w = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        const int64_t s = victims[i];
        if (s < 0 || s >= slots) {
            release(b, 5);
            return PyErr_Format(PyExc_IndexError, "victim slot %lld outside [0, %zd)",
                                (long long)s, slots);
        }
        if (dirty[s]) {
            ids[w] = id_of[s];
            dirty_slots[w++] = s;
        }
    }
    release(b, 5);
    return PyLong_FromSsize_t(w);
}

static PyObject *py_fill(PyObject *self, PyObject *args) {
    Py_buffer b[8];
    Py_ssize_t empty;
    memset(b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "y*ny*w*w*w*w*w*", &b[0], &empty, &b[1], &b[2], &b[3], &b[4],
                          &b[5], &b[6]))
        return NULL;
    const Py_ssize_t m = b[0].len / 8, u = b[2].len / 8, rows = b[3].len / 4,
                     slots = b[4].len / 8;
    if (need(&b[0], 8, -1, "victims") || need(&b[1], 8, m, "missing") ||
        need(&b[2], 8, -1, "slot") || need(&b[3], 4, -1, "slot_map") ||
        need(&b[4], 8, -1, "id_of") || need(&b[5], 1, slots, "dirty") ||
        need(&b[6], 8, slots, "uses")) {
        release(b, 7);
        return NULL;
    }
    const int64_t *victims = b[0].buf, *missing = b[1].buf;
    int64_t *slot = b[2].buf, *id_of = b[4].buf, *uses = b[6].buf;
    int32_t *map = b[3].buf;
    uint8_t *dirty = b[5].buf;
    const char *bad = NULL;
    Py_ssize_t holes = 0;
    for (Py_ssize_t i = 0; i < u; i++) holes += slot[i] < 0;
    if (empty < 0 || empty > m || holes != m) bad = "the lookup's misses and victims disagree";
    for (Py_ssize_t j = 0; j < m && !bad; j++) {
        if (victims[j] < 0 || victims[j] >= slots) bad = "a victim names no slot";
        else if (missing[j] < 0 || missing[j] >= rows) bad = "a missing id is outside the table";
        else if (j >= empty && (id_of[victims[j]] < 0 || id_of[victims[j]] >= rows))
            bad = "a victim holds no row";
    }
    if (bad) {
        release(b, 7);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    for (Py_ssize_t j = empty; j < m; j++) map[id_of[victims[j]]] = -1;
    for (Py_ssize_t j = 0; j < m; j++) {
        const int64_t s = victims[j];
        map[missing[j]] = (int32_t)s;
        id_of[s] = missing[j];
        dirty[s] = 0;
        uses[s] = 0;
    }
    for (Py_ssize_t i = 0, j = 0; i < u; i++)
        if (slot[i] < 0) slot[i] = victims[j++];
    release(b, 7);
    Py_RETURN_NONE;
}

static PyObject *py_touch(PyObject *self, PyObject *args) {
    Py_buffer b[8];
    long long clock;
    int training;
    Py_ssize_t tail;
    memset(b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "y*y*w*Lpw*w*w*w*w*n", &b[0], &b[1], &b[2], &clock, &training,
                          &b[3], &b[4], &b[5], &b[6], &b[7], &tail))
        return NULL;
    const Py_ssize_t u = b[0].len / 8, n = b[1].len / 8, slots = b[3].len / 8,
                     queued = b[6].len / 8;
    if (need(&b[0], 8, -1, "slot") || need(&b[1], 8, -1, "inverse") ||
        need(&b[2], 8, n, "out") || need(&b[3], 8, -1, "last_used") ||
        need(&b[4], 8, slots, "uses") || need(&b[5], 1, slots, "dirty") ||
        need(&b[6], 8, -1, "q_slots") || need(&b[7], 8, queued, "q_stamps")) {
        release(b, 8);
        return NULL;
    }
    const int64_t *slot = b[0].buf, *inverse = b[1].buf;
    const char *bad = NULL;
    if (tail >= 0 && tail + u > queued) bad = "the recency queue has no room";
    for (Py_ssize_t i = 0; i < u && !bad; i++)
        if (slot[i] < 0 || slot[i] >= slots) bad = "a slot is outside the cache";
    for (Py_ssize_t k = 0; k < n && !bad; k++)
        if (inverse[k] < 0 || inverse[k] >= u) bad = "an id's place is outside the lookup";
    if (bad) {
        release(b, 8);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    int64_t *out = b[2].buf, *last_used = b[3].buf, *uses = b[4].buf, *q_slots = b[6].buf,
            *q_stamps = b[7].buf;
    uint8_t *dirty = b[5].buf;
    const int64_t base = (int64_t)((uint64_t)clock << 32);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < u; i++) {
        const int64_t s = slot[i], stamp = base + i;
        last_used[s] = stamp;
        uses[s] += 1;
        if (training) dirty[s] = 1;
        if (tail >= 0) {
            q_slots[tail + i] = s;
            q_stamps[tail + i] = stamp;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) out[k] = slot[inverse[k]];
    Py_END_ALLOW_THREADS
    release(b, 8);
    Py_RETURN_NONE;
}

static PyMethodDef cache_methods[] = {
    {"find", py_find, METH_VARARGS,
     "find(ids, slot_map, unique, inverse, slot, missing) -> (u, m): a lookup's distinct "
     "ids sorted, each id's place among them, their slots and the missing ids"},
    {"victims", py_victims, METH_VARARGS,
     "victims(slot, count, filled, last_used, protected, q_slots, q_stamps, head, tail, "
     "out) -> (head, empty): count slots to reuse, empty ones first, then the least "
     "recently used from the queue, never one in slot"},
    {"evicted", py_evicted, METH_VARARGS,
     "evicted(slots, id_of, dirty, ids, dirty_slots) -> k: the dirty rows among slots"},
    {"fill", py_fill, METH_VARARGS,
     "fill(victims, empty, missing, slot, slot_map, id_of, dirty, uses): the missing ids "
     "take the victims' slots"},
    {"touch", py_touch, METH_VARARGS,
     "touch(slot, inverse, out, clock, training, last_used, uses, dirty, q_slots, "
     "q_stamps, tail): a lookup's stamps, uses, dirty bits and queued uses; out = "
     "slot[inverse]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cache_module = {
    PyModuleDef_HEAD_INIT, "towerrec.modules._cache",
    "The host bookkeeping of a cached table of dense ids (_cache.c).", -1, cache_methods,
};

PyMODINIT_FUNC PyInit__cache(void) { return PyModule_Create(&cache_module); }
