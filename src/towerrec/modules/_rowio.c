/* towerrec.modules._rowio: batched reads and writes of fixed-size records.
 *
 * The SSD store (ssd_store.py) reads a batch's missing rows and writes back its
 * evicted ones through here, with the GIL released for the whole batch: rows that
 * follow each other in the file are coalesced into one run, and each run is one
 * pread / pwrite (transfer) or one io_uring request (Ring.transfer, many runs per
 * system call). row_io.py holds the pure-Python fallback of the same contract and
 * chooses between them.
 *
 *   transfer(fd, rows, data, record_bytes, base, max_run_rows, write) -> int
 *
 * rows: a buffer of int64 row numbers; data: n * record_bytes bytes, record i at
 * i * record_bytes (written into for a read); row r lives at base + r * record_bytes
 * in the file. Returns -1 when every record moved, else the index in rows of the
 * first row the file ended before (a truncated file). OSError on a failed call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* io_uring where the kernel headers have it (IORING_OP_READ came with 5.6, as did
 * IORING_FEAT_RW_CUR_POS): without them the module builds with the pread loop only. */
#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#if defined(IORING_FEAT_RW_CUR_POS) && defined(IORING_FEAT_SINGLE_MMAP) && \
    defined(__NR_io_uring_setup) && defined(__NR_io_uring_enter)
#define ROWIO_URING 1
#endif
#endif
#endif

typedef struct {
    int64_t first;     /* index in rows of the run's first row */
    int64_t count;     /* rows in the run */
} run_t;

/* The next run starting at rows[i]: consecutive rows, at most max_run rows. */
static int64_t run_length(const int64_t *rows, int64_t n, int64_t i, int64_t max_run) {
    int64_t j = i + 1;
    while (j < n && j - i < max_run && rows[j] == rows[j - 1] + 1) j++;
    return j - i;
}

/* One run, synchronously: loops over partial transfers. Returns 0, 1 at the end of
 * the file (*done = bytes moved), or -1 with errno set. */
static int move_run(int fd, char *buf, size_t len, off_t offset, int write, size_t *done) {
    *done = 0;
    while (*done < len) {
        ssize_t got = write ? pwrite(fd, buf + *done, len - *done, offset + (off_t)*done)
                            : pread(fd, buf + *done, len - *done, offset + (off_t)*done);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) return 1;
        *done += (size_t)got;
    }
    return 0;
}

typedef struct {
    int fd;
    Py_buffer rows, data;
    Py_ssize_t record_bytes;
    long long base;
    Py_ssize_t max_run;
    int write;
    int64_t n;
} job_t;

/* Parse (fd, rows, data, record_bytes, base, max_run_rows, write) and check sizes. */
static int parse_job(PyObject *args, job_t *job) {
    memset(job, 0, sizeof(*job));
    if (!PyArg_ParseTuple(args, "iy*w*nLnp", &job->fd, &job->rows, &job->data,
                          &job->record_bytes, &job->base, &job->max_run, &job->write))
        return -1;
    if (job->record_bytes <= 0 || job->max_run <= 0 || job->base < 0 ||
        job->rows.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "rowio: bad record size, run limit, base or rows");
        goto fail;
    }
    job->n = job->rows.len / (Py_ssize_t)sizeof(int64_t);
    if (job->data.len != job->n * job->record_bytes) {
        PyErr_SetString(PyExc_ValueError, "rowio: data is not rows x record_bytes bytes");
        goto fail;
    }
    const int64_t *rows = (const int64_t *)job->rows.buf;
    for (int64_t i = 0; i < job->n; i++) {
        if (rows[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "rowio: negative row");
            goto fail;
        }
    }
    return 0;
fail:
    PyBuffer_Release(&job->rows);
    PyBuffer_Release(&job->data);
    return -1;
}

static void release_job(job_t *job) {
    PyBuffer_Release(&job->rows);
    PyBuffer_Release(&job->data);
}

/* The synchronous path: one pread / pwrite per run. */
static PyObject *rowio_transfer(PyObject *self, PyObject *args) {
    job_t job;
    if (parse_job(args, &job) < 0) return NULL;
    const int64_t *rows = (const int64_t *)job.rows.buf;
    char *data = (char *)job.data.buf;
    int64_t short_at = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < job.n;) {
        int64_t len = run_length(rows, job.n, i, job.max_run);
        size_t done;
        int rc = move_run(job.fd, data + i * job.record_bytes, (size_t)(len * job.record_bytes),
                          (off_t)(job.base + rows[i] * job.record_bytes), job.write, &done);
        if (rc < 0) {
            err = errno;
            break;
        }
        if (rc > 0) {
            short_at = i + (int64_t)(done / (size_t)job.record_bytes);
            break;
        }
        i += len;
    }
    Py_END_ALLOW_THREADS
    release_job(&job);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(short_at);
}

#ifdef ROWIO_URING
/* ------------------------------------------------------------------ io_uring */

typedef struct {
    PyObject_HEAD
    int ring_fd;
    int busy;
    unsigned sq_entries, cq_entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_size, cq_size, sqes_size;
} Ring;

static void ring_unmap(Ring *r) {
    if (r->sqes) munmap(r->sqes, r->sqes_size);
    if (r->cq_ptr && r->cq_ptr != r->sq_ptr) munmap(r->cq_ptr, r->cq_size);
    if (r->sq_ptr) munmap(r->sq_ptr, r->sq_size);
    if (r->ring_fd >= 0) close(r->ring_fd);
    r->sqes = NULL;
    r->sq_ptr = r->cq_ptr = NULL;
    r->ring_fd = -1;
}

static void Ring_dealloc(Ring *r) {
    ring_unmap(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int Ring_init(Ring *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"entries", NULL};
    unsigned entries = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I", kwlist, &entries)) return -1;
    ring_unmap(r);
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    r->ring_fd = fd;
    r->sq_entries = p.sq_entries;
    r->cq_entries = p.cq_entries;
    r->sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        if (r->cq_size > r->sq_size) r->sq_size = r->cq_size;
        r->cq_size = r->sq_size;
    }
    r->sq_ptr = mmap(NULL, r->sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) goto fail_sq;
    if (single) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                         fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) goto fail_cq;
    }
    r->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail_sqes;
    char *sq = (char *)r->sq_ptr, *cq = (char *)r->cq_ptr;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
fail_sqes:
    r->sqes = NULL;
    goto fail;
fail_cq:
    r->cq_ptr = NULL;
    goto fail;
fail_sq:
    r->sq_ptr = NULL;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    ring_unmap(r);
    return -1;
}

/* Submit ``submit`` queued entries and wait for at least ``wait`` completions. */
static int ring_enter(Ring *r, unsigned submit, unsigned wait) {
    for (;;) {
        int rc = (int)syscall(__NR_io_uring_enter, r->ring_fd, submit, wait,
                              wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        if (rc >= 0) return rc;
        if (errno != EINTR && errno != EAGAIN && errno != EBUSY) return -1;
        if (errno != EINTR) submit = 0;  /* completions first, then resubmit */
        if (!wait) wait = 1;
    }
}

/* Every run of the job as io_uring requests, up to the ring's size in flight. A run
 * that comes back short is finished synchronously (move_run), which tells the end of
 * the file from a partial transfer. */
static PyObject *Ring_transfer(Ring *r, PyObject *args) {
    job_t job;
    if (r->ring_fd < 0) {
        PyErr_SetString(PyExc_ValueError, "rowio: ring is closed");
        return NULL;
    }
    if (parse_job(args, &job) < 0) return NULL;
    if (r->busy) {
        release_job(&job);
        PyErr_SetString(PyExc_RuntimeError, "rowio: a ring serves one thread at a time");
        return NULL;
    }
    r->busy = 1;
    const int64_t *rows = (const int64_t *)job.rows.buf;
    char *data = (char *)job.data.buf;
    int64_t short_at = -1;
    int err = 0;
    unsigned limit = r->sq_entries < r->cq_entries ? r->sq_entries : r->cq_entries;
    run_t *runs = NULL;
    Py_BEGIN_ALLOW_THREADS
    runs = (run_t *)malloc(sizeof(run_t) * (size_t)(job.n ? job.n : 1));
    if (!runs) err = ENOMEM;
    int64_t nruns = 0;
    for (int64_t i = 0; !err && i < job.n; nruns++) {
        runs[nruns].first = i;
        runs[nruns].count = run_length(rows, job.n, i, job.max_run);
        i += runs[nruns].count;
    }
    int64_t next = 0, inflight = 0;
    int64_t first_short = -1; /* smallest run index that ended the file */
    unsigned queued = 0;
    while (!err && (next < nruns || inflight > 0)) {
        unsigned tail = *r->sq_tail;
        while (next < nruns && inflight + queued < limit) {
            run_t *run = &runs[next];
            unsigned idx = tail & *r->sq_mask;
            struct io_uring_sqe *sqe = &r->sqes[idx];
            memset(sqe, 0, sizeof(*sqe));
            sqe->opcode = job.write ? IORING_OP_WRITE : IORING_OP_READ;
            sqe->fd = job.fd;
            sqe->addr = (uint64_t)(uintptr_t)(data + run->first * job.record_bytes);
            sqe->len = (unsigned)(run->count * job.record_bytes);
            sqe->off = (uint64_t)(job.base + rows[run->first] * job.record_bytes);
            sqe->user_data = (uint64_t)next;
            r->sq_array[idx] = idx;
            tail++;
            queued++;
            next++;
        }
        __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        int submitted = ring_enter(r, queued, inflight + queued > 0 ? 1 : 0);
        if (submitted < 0) {
            err = errno;
            break;
        }
        queued -= (unsigned)submitted;
        inflight += submitted;
        unsigned head = *r->cq_head;
        while (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
            int64_t k = (int64_t)cqe->user_data;
            int res = cqe->res;
            head++;
            inflight--;
            run_t *run = &runs[k];
            size_t len = (size_t)(run->count * job.record_bytes);
            if (res < 0 && res != -EAGAIN && res != -EINTR) {
                if (!err) err = -res;
                continue;
            }
            size_t got = res < 0 ? 0 : (size_t)res;
            if (got < len) {
                size_t done;
                char *buf = data + run->first * job.record_bytes + got;
                off_t offset = (off_t)(job.base + rows[run->first] * job.record_bytes + got);
                int rc = move_run(job.fd, buf, len - got, offset, job.write, &done);
                if (rc < 0) {
                    if (!err) err = errno;
                } else if (rc > 0 && (first_short < 0 || k < first_short)) {
                    first_short = k;
                    short_at = run->first + (int64_t)((got + done) / (size_t)job.record_bytes);
                }
            }
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    /* After an error, drain what is still in flight (its buffers are the caller's). */
    while (inflight > 0) {
        if (ring_enter(r, 0, 1) < 0) break;
        unsigned head = *r->cq_head;
        while (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            head++;
            inflight--;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    free(runs);
    Py_END_ALLOW_THREADS
    r->busy = 0;
    release_job(&job);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(short_at);
}

static PyObject *Ring_close(Ring *r, PyObject *unused) {
    if (r->busy) {
        PyErr_SetString(PyExc_RuntimeError, "rowio: ring in use");
        return NULL;
    }
    ring_unmap(r);
    Py_RETURN_NONE;
}

static PyMethodDef Ring_methods[] = {
    {"transfer", (PyCFunction)Ring_transfer, METH_VARARGS,
     "transfer(fd, rows, data, record_bytes, base, max_run_rows, write) -> int, through "
     "io_uring (module doc)"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "release the ring"},
    {NULL, NULL, 0, NULL},
};

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Ring *r = (Ring *)type->tp_alloc(type, 0);
    if (r) r->ring_fd = -1;
    return (PyObject *)r;
}

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "towerrec.modules._rowio.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An io_uring of `entries` requests for transfer (module doc).",
    .tp_new = Ring_new,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
};
#endif /* ROWIO_URING */

static PyMethodDef rowio_methods[] = {
    {"transfer", rowio_transfer, METH_VARARGS,
     "transfer(fd, rows, data, record_bytes, base, max_run_rows, write) -> int (module doc)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rowio_module = {
    PyModuleDef_HEAD_INIT, "towerrec.modules._rowio",
    "Batched reads and writes of fixed-size records (see the C source's head).", -1,
    rowio_methods,
};

PyMODINIT_FUNC PyInit__rowio(void) {
    PyObject *m = PyModule_Create(&rowio_module);
    if (!m) return NULL;
#ifdef ROWIO_URING
    if (PyType_Ready(&RingType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
