/*
 * kvd._native.RingProxy: the binding of ring_proxy.c (and cuda_copy.c).
 *
 * A RingProxy holds the exported buffers of its ring and its staging until
 * it is stopped, so the proxy thread never touches freed memory; stop()
 * joins the thread with the GIL released. io_ring_init() lays out a ring
 * in any writable buffer (a memfd mapping shared with a producer process,
 * or host-mapped memory a GPU writes to). io_ring_wait() is the wait
 * kernel's code (kvd_io_ring_wait) run on the host with the GIL released,
 * and io_ring_wait_record() reads a wait record the GPU or it wrote.
 */
#include "module.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>

#include "cuda_copy.h"
#include "ring_proxy.h"

typedef struct {
    PyObject_HEAD
    struct kvd_proxy *proxy;          /* NULL once stopped */
    struct kvd_cuda_copier *copier;   /* device >= 0 only */
    Py_buffer ring_view;
    Py_buffer staging_view;
    int holding;                      /* both views are exported */
    struct kvd_proxy_stats final;     /* what stop() saw last */
} ProxyObject;

static int check_ring_memory(Py_buffer *view) {
    if ((uintptr_t)view->buf % 64 != 0) {
        PyErr_SetString(PyExc_ValueError, "ring: the memory must be 64-byte aligned");
        return -1;
    }
    uint64_t capacity, layers;
    if (kvd_proxy_check_ring(view->buf, (uint64_t)view->len, &capacity, &layers) < 0) {
        PyErr_Format(PyExc_ValueError, "ring: not a kvd_io_ring (version %u, a power-of-two capacity that fits in "
                     "the buffer, 1..%u layers); lay one out with io_ring_init", KVD_IO_RING_VERSION,
                     KVD_IO_RING_MAX_LAYERS);
        return -1;
    }
    return 0;
}

static int check_staging(Py_buffer *view) {
    if ((uintptr_t)view->buf % KVD_PROXY_ALIGN != 0 || view->len == 0 || view->len % (2 * KVD_PROXY_ALIGN) != 0) {
        PyErr_Format(PyExc_ValueError, "staging: the memory must be %u-byte aligned and a non-zero multiple of "
                     "%u bytes", KVD_PROXY_ALIGN, 2 * KVD_PROXY_ALIGN);
        return -1;
    }
    return 0;
}

static int open_copier(ProxyObject *self, int device) {
    int rc = kvd_cuda_copier_open(&self->copier, device);
    if (rc == -ENODEV) {
        PyErr_Format(PyExc_OSError, "CUDA device %d: no driver (libcuda.so.1) or no such device", device);
        return -1;
    }
    if (rc < 0) {
        raise_error(rc);
        return -1;
    }
    return 0;
}

static void release_views(ProxyObject *self) {
    if (self->holding) {
        PyBuffer_Release(&self->ring_view);
        PyBuffer_Release(&self->staging_view);
        self->holding = 0;
    }
    if (self->copier != NULL) {
        kvd_cuda_copier_close(self->copier);
        self->copier = NULL;
    }
}

struct proxy_shape {
    int process_fd;
    unsigned int batch_entries, queue_depth, grants;
    unsigned long long split_at, split_to;
};

static int start(ProxyObject *self, PyObject *fds_object, PyObject *targets_object, const struct proxy_shape *shape) {
    Py_buffer fds_view, targets_view;
    Py_ssize_t files = get_array(fds_object, &fds_view, sizeof(int32_t), 0, "fds");
    if (files < 0) return -1;
    Py_ssize_t words = get_array(targets_object, &targets_view, sizeof(uint64_t), 0, "targets");
    if (words < 0) {
        PyBuffer_Release(&fds_view);
        return -1;
    }
    struct kvd_proxy_config config = {
        .ring = self->ring_view.buf,
        .ring_bytes = (uint64_t)self->ring_view.len,
        .fds = fds_view.buf,
        .file_count = (uint32_t)files,
        .staging = self->staging_view.buf,
        .staging_bytes = (uint64_t)self->staging_view.len,
        .batch_entries = shape->batch_entries,
        .queue_depth = shape->queue_depth,
        .grant_count = shape->grants,
        .split_at = shape->split_at,
        .split_to = shape->split_to,
        .copy = self->copier != NULL ? kvd_cuda_copy : shape->process_fd >= 0 ? kvd_copy_process : kvd_copy_host,
        .copy_context = self->copier != NULL ? (void *)self->copier : (void *)(intptr_t)shape->process_fd,
        .copy_each = self->copier == NULL,
        .targets = targets_view.buf,
        .target_count = (uint32_t)(words / 2),
    };
    int rc = files > KVD_MAX_FILES || words % 2 ? -EINVAL : kvd_proxy_start(&self->proxy, &config);
    PyBuffer_Release(&fds_view);
    PyBuffer_Release(&targets_view);
    if (rc == -EINVAL) {
        PyErr_Format(PyExc_ValueError, "batch_entries must be 1..%u, queue_depth 1..%u, grants 1..%u, fds at "
                     "most %u, and targets 1..%u (address, length) pairs, sorted and disjoint", KVD_PROXY_MAX_BATCH,
                     KVD_MAX_QUEUE_DEPTH, KVD_PROXY_MAX_GRANTS, KVD_MAX_FILES, KVD_MAX_BUFFERS);
        return -1;
    }
    if (rc < 0) {
        raise_error(rc);
        return -1;
    }
    return 0;
}

static int proxy_init(ProxyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"ring", "fds", "staging", "targets", "batch_entries", "queue_depth", "device",
                               "grants", "split_at", "split_to", "process_fd", NULL};
    PyObject *ring_object, *fds_object, *staging_object, *targets_object;
    struct proxy_shape shape = {.process_fd = -1, .batch_entries = 64, .queue_depth = 64, .grants = 4096};
    int device = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|IIiIKKi", keywords, &ring_object, &fds_object,
                                     &staging_object, &targets_object, &shape.batch_entries, &shape.queue_depth,
                                     &device, &shape.grants, &shape.split_at, &shape.split_to,
                                     &shape.process_fd)) {
        return -1;
    }
    if (self->proxy != NULL || self->holding) {
        PyErr_SetString(PyExc_RuntimeError, "RingProxy is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(ring_object, &self->ring_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(staging_object, &self->staging_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&self->ring_view);
        return -1;
    }
    self->holding = 1;
    if (check_ring_memory(&self->ring_view) < 0 || check_staging(&self->staging_view) < 0 ||
        (device >= 0 && open_copier(self, device) < 0) || start(self, fds_object, targets_object, &shape) < 0) {
        release_views(self);
        return -1;
    }
    return 0;
}

static PyObject *proxy_stop(ProxyObject *self, PyObject *Py_UNUSED(ignored)) {
    struct kvd_proxy *proxy = self->proxy;
    self->proxy = NULL;
    if (proxy != NULL) {
        Py_BEGIN_ALLOW_THREADS
        kvd_proxy_stop(proxy, &self->final);
        Py_END_ALLOW_THREADS
    }
    release_views(self);
    Py_RETURN_NONE;
}

static PyObject *proxy_stats(ProxyObject *self, PyObject *Py_UNUSED(ignored)) {
    struct kvd_proxy_stats s = self->final;
    if (self->proxy != NULL) kvd_proxy_read_stats(self->proxy, &s);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsK}", "reads", s.reads, "failed", s.failed, "bytes", s.bytes,
                         "checksum_mismatches", s.checksum_mismatches, "rejected", s.rejected,
                         "ungranted", s.ungranted, "dropped", s.dropped,
                         "batches", s.batches, "copy_calls", s.copy_calls, "copy_errors", s.copy_errors,
                         "idle_sleeps", s.idle_sleeps);
}

static struct kvd_proxy *running_proxy(ProxyObject *self) {
    if (self->proxy == NULL) PyErr_SetString(PyExc_RuntimeError, "the RingProxy is stopped");
    return self->proxy;
}

/* The arrays a grant table call takes, each a 1-D buffer of `itemsize`-byte items: all of them,
 * with their item counts, or none (those already taken released) and an exception set. */
struct array_arg {
    PyObject *object;
    Py_ssize_t itemsize;
    int writable;
    const char *name;
    Py_buffer view;
    Py_ssize_t count;
};

static int get_arrays(struct array_arg *arrays, int n) {
    for (int i = 0; i < n; i++) {
        arrays[i].count = get_array(arrays[i].object, &arrays[i].view, arrays[i].itemsize, arrays[i].writable,
                                    arrays[i].name);
        if (arrays[i].count < 0) {
            while (i-- > 0) PyBuffer_Release(&arrays[i].view);
            return -1;
        }
    }
    return 0;
}

static void release_arrays(struct array_arg *arrays, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&arrays[i].view);
}

/* grant(tags, reads, stamps): arms grant tags[i] for reads[i] (7 uint64 each: file, offset, length,
 * target, layer, checksum, tag) under stamps[i]; all or, on the first refusal, an error (the
 * grants armed before it stay armed: the caller revokes them). */
static PyObject *proxy_grant(ProxyObject *self, PyObject *args) {
    struct array_arg a[3] = {{.itemsize = 8, .name = "tags"}, {.itemsize = 8, .name = "reads"},
                             {.itemsize = 8, .name = "stamps"}};
    if (!PyArg_ParseTuple(args, "OOO", &a[0].object, &a[1].object, &a[2].object)) return NULL;
    struct kvd_proxy *proxy = running_proxy(self);
    if (proxy == NULL || get_arrays(a, 3) < 0) return NULL;
    Py_ssize_t count = a[0].count;
    int rc = 0;
    if (a[1].count != 7 * count || a[2].count != count) {
        PyErr_SetString(PyExc_ValueError, "grant: one stamp and 7 words of read per tag");
        rc = -1;
    }
    const uint64_t *tag = a[0].view.buf, *read = a[1].view.buf, *stamp = a[2].view.buf;
    for (Py_ssize_t i = 0; rc == 0 && i < count; i++) {
        const uint64_t *r = read + 7 * i;
        kvd_io_desc desc = {0, r[1], r[2], r[3], r[0], r[4], tag[i], r[5]};
        rc = kvd_proxy_grant(proxy, tag[i], &desc, stamp[i]);
        if (rc < 0) PyErr_Format(PyExc_ValueError, "grant %llu: %s", (unsigned long long)tag[i],
                                 rc == -EBUSY ? "armed already" : "tag out of range or stamp 0");
    }
    release_arrays(a, 3);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* settle(tags, stamps, out, revoke): per grant, into the int8 array out: 2 read and verified, 3 read
 * and failed, 0 not over yet; with revoke, a grant no read took is disarmed (1: it will never be
 * read), and 0 then means taken and still being read. */
static PyObject *proxy_settle(ProxyObject *self, PyObject *args) {
    struct array_arg a[3] = {{.itemsize = 8, .name = "tags"}, {.itemsize = 8, .name = "stamps"},
                             {.itemsize = 1, .writable = 1, .name = "out"}};
    int revoke;
    if (!PyArg_ParseTuple(args, "OOOp", &a[0].object, &a[1].object, &a[2].object, &revoke)) return NULL;
    struct kvd_proxy *proxy = running_proxy(self);
    if (proxy == NULL || get_arrays(a, 3) < 0) return NULL;
    Py_ssize_t count = a[0].count;
    int ok = a[1].count == count && a[2].count == count;
    if (!ok) PyErr_SetString(PyExc_ValueError, "settle: one stamp and one out cell per tag");
    const uint64_t *tag = a[0].view.buf, *stamp = a[1].view.buf;
    int8_t *cell = a[2].view.buf;
    for (Py_ssize_t i = 0; ok && i < count; i++) {
        if (revoke && kvd_proxy_revoke(proxy, tag[i], stamp[i]) == 1) {
            cell[i] = 1;
            continue;
        }
        uint64_t outcome = kvd_proxy_outcome(proxy, tag[i]);
        cell[i] = outcome >> 1 == stamp[i] ? (outcome & 1 ? 2 : 3) : 0;
    }
    release_arrays(a, 3);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *proxy_get_running(ProxyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->proxy != NULL);
}

static void proxy_dealloc(ProxyObject *self) {
    Py_XDECREF(proxy_stop(self, NULL));
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef proxy_methods[] = {
    {"stop", (PyCFunction)proxy_stop, METH_NOARGS,
     "stop() -> None: takes no new descriptors, finishes the reads it holds, joins the thread; idempotent"},
    {"stats", (PyCFunction)proxy_stats, METH_NOARGS, "stats() -> dict of counters"},
    {"grant", (PyCFunction)proxy_grant, METH_VARARGS,
     "grant(tags, reads, stamps) -> None: arms the grants (reads: 7 uint64 each, see ring_proxy.h)"},
    {"settle", (PyCFunction)proxy_settle, METH_VARARGS,
     "settle(tags, stamps, out, revoke) -> None: out[i]: 2 verified, 3 failed, 0 not over; with revoke, "
     "1 for a grant no read took (now disarmed)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef proxy_getset[] = {
    {"running", (getter)proxy_get_running, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ProxyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd._native.RingProxy",
    .tp_doc = "RingProxy(ring, fds, staging, targets, batch_entries=64, queue_depth=64, device=-1): a thread "
              "draining an I/O ring's reads into io_uring (see native/ring_proxy.h); targets: uint64 (address, "
              "length) pairs where reads may land; device >= 0 copies to that CUDA device.",
    .tp_basicsize = sizeof(ProxyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)proxy_init,
    .tp_dealloc = (destructor)proxy_dealloc,
    .tp_methods = proxy_methods,
    .tp_getset = proxy_getset,
};

/* io_ring_init(buffer, capacity, layers) -> bytes the ring takes: zeroes and lays out a ring. */
static PyObject *native_io_ring_init(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *object;
    unsigned long long capacity;
    unsigned int layers;
    if (!PyArg_ParseTuple(args, "OKI", &object, &capacity, &layers)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    uint64_t bytes = kvd_io_ring_bytes(capacity);
    int fits = capacity > 0 && (capacity & (capacity - 1)) == 0 && capacity <= (1ull << 32) &&
               bytes <= (uint64_t)view.len && (uintptr_t)view.buf % 64 == 0;
    if (!fits || layers == 0 || layers > KVD_IO_RING_MAX_LAYERS) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "io_ring_init: capacity must be a power of two up to 2**32 whose ring fits "
                     "the 64-byte aligned buffer, layers 1..%u", KVD_IO_RING_MAX_LAYERS);
        return NULL;
    }
    kvd_io_ring *ring = view.buf;
    memset(ring, 0, bytes);
    ring->version = KVD_IO_RING_VERSION;
    ring->capacity = capacity;
    ring->layers = layers;
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(bytes);
}

/* The ring in `object`, checked as the proxy checks it, and its wait record `slot`; NULL with an
 * exception set otherwise (`name` says whose arguments were wrong). */
static kvd_io_ring *get_ring(PyObject *object, unsigned int slot, Py_buffer *view, const char *name) {
    if (slot >= KVD_IO_RING_WAITS) {
        PyErr_Format(PyExc_ValueError, "%s: slot must be below %u", name, KVD_IO_RING_WAITS);
        return NULL;
    }
    if (PyObject_GetBuffer(object, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (check_ring_memory(view) < 0) {
        PyBuffer_Release(view);
        return NULL;
    }
    return view->buf;
}

/* io_ring_wait(buffer, layer, until, failed_before, timeout_ns, slot) -> state of waits[slot] when it ended. */
static PyObject *native_io_ring_wait(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *object;
    unsigned long long layer, until, failed_before, timeout_ns;
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "OKKKKI", &object, &layer, &until, &failed_before, &timeout_ns, &slot)) return NULL;
    Py_buffer view;
    kvd_io_ring *ring = get_ring(object, slot, &view, "io_ring_wait");
    if (ring == NULL) return NULL;
    uint64_t state;
    Py_BEGIN_ALLOW_THREADS
    state = kvd_io_ring_wait(ring, layer, until, failed_before, timeout_ns, &ring->waits[slot]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(state);
}

/* io_ring_wait_record(buffer, slot) -> (state, layer, until, done, failed, waited_ns) of waits[slot]. */
static PyObject *native_io_ring_wait_record(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *object;
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "OI", &object, &slot)) return NULL;
    Py_buffer view;
    kvd_io_ring *ring = get_ring(object, slot, &view, "io_ring_wait_record");
    if (ring == NULL) return NULL;
    kvd_io_wait *record = &ring->waits[slot];
    uint64_t state = __atomic_load_n(&record->state, __ATOMIC_ACQUIRE);  /* the other fields were written before */
    PyObject *result = Py_BuildValue("(KKKKKK)", state, record->layer, record->until, record->done, record->failed,
                                     record->waited_ns);
    PyBuffer_Release(&view);
    return result;
}

/* io_ring_publish(buffer, reads, timeout_ns) -> published: a producer on the host publishes reads
 * (7 uint64 each: file, offset, length, target, layer, checksum, tag) in order, in chunks of at
 * most the ring's capacity, as the submit kernel does; a chunk whose slots do not free up within
 * timeout_ns is abandoned (counted in its layers' abandoned[]), and so is everything after it. */
static PyObject *native_io_ring_publish(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *object, *reads_object;
    unsigned long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OOK", &object, &reads_object, &timeout_ns)) return NULL;
    Py_buffer view, reads;
    kvd_io_ring *ring = get_ring(object, 0, &view, "io_ring_publish");
    if (ring == NULL) return NULL;
    Py_ssize_t words = get_array(reads_object, &reads, 8, 0, "reads");
    if (words < 0 || words % 7) {
        if (words >= 0) PyBuffer_Release(&reads);
        PyBuffer_Release(&view);
        if (words >= 0) PyErr_SetString(PyExc_ValueError, "io_ring_publish: 7 words per read");
        return NULL;
    }
    uint64_t count = (uint64_t)words / 7, capacity = ring->capacity, published = 0;
    const uint64_t *r = reads.buf;
    Py_BEGIN_ALLOW_THREADS
    uint64_t deadline = kvd_io_ring_deadline(timeout_ns);
    while (published < count) {
        uint64_t need = count - published < capacity ? count - published : capacity, ticket;
        if (!kvd_io_ring_reserve(ring, need, deadline, &ticket)) break;
        for (uint64_t k = 0; k < need; k++) {
            const uint64_t *read = r + 7 * (published + k);
            kvd_io_ring_publish(ring, ticket + k, read[0], read[1], read[2], read[3], read[4], read[6], read[5]);
        }
        published += need;
    }
    for (uint64_t i = published; i < count; i++) kvd_io_ring_abandon(ring, r[7 * i + 4], 1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&reads);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(published);
}

static PyMethodDef proxy_functions[] = {
    {"io_ring_publish", native_io_ring_publish, METH_VARARGS,
     "io_ring_publish(buffer, reads, timeout_ns) -> published: a host producer's submit (7 uint64 per read: "
     "file, offset, length, target, layer, checksum, tag); the rest abandoned at the deadline"},
    {"io_ring_init", native_io_ring_init, METH_VARARGS,
     "io_ring_init(buffer, capacity, layers) -> bytes: lays out an empty I/O ring (native/gpu/io_ring.h)"},
    {"io_ring_wait", native_io_ring_wait, METH_VARARGS,
     "io_ring_wait(buffer, layer, until, failed_before, timeout_ns, slot) -> state: the wait kernel's wait, on "
     "the host with the GIL released; its record is the ring's waits[slot]"},
    {"io_ring_wait_record", native_io_ring_wait_record, METH_VARARGS,
     "io_ring_wait_record(buffer, slot) -> (state, layer, until, done, failed, waited_ns) of waits[slot]"},
    {NULL, NULL, 0, NULL},
};

/* The ring's layout and wait states, for kvd.device.io_ring. */
static int add_ring_constants(PyObject *module) {
    static const struct {
        const char *name;
        long value;
    } constants[] = {
        {"IO_RING_VERSION", KVD_IO_RING_VERSION},
        {"IO_RING_MAX_LAYERS", KVD_IO_RING_MAX_LAYERS},
        {"IO_RING_WAITS", KVD_IO_RING_WAITS},
        {"IO_RING_HEADER_BYTES", (long)sizeof(kvd_io_ring)},
        {"IO_RING_DONE_OFFSET", (long)offsetof(kvd_io_ring, done)},
        {"IO_RING_FAILED_OFFSET", (long)offsetof(kvd_io_ring, failed)},
        {"IO_RING_ABANDONED_OFFSET", (long)offsetof(kvd_io_ring, abandoned)},
        {"IO_RING_WAITS_OFFSET", (long)offsetof(kvd_io_ring, waits)},
        {"IO_WAIT_BYTES", (long)sizeof(kvd_io_wait)},
        {"IO_WAIT_PENDING", KVD_IO_WAIT_PENDING},
        {"IO_WAIT_OK", KVD_IO_WAIT_OK},
        {"IO_WAIT_FAILED", KVD_IO_WAIT_FAILED},
        {"IO_WAIT_TIMEOUT", KVD_IO_WAIT_TIMEOUT},
        {"IO_WAIT_INVALID", KVD_IO_WAIT_INVALID},
        {"PROXY_ALIGN", KVD_PROXY_ALIGN},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        if (PyModule_AddIntConstant(module, constants[i].name, constants[i].value) < 0) return -1;
    }
    return 0;
}

int kvd_add_ring_proxy(PyObject *module) {
    if (PyType_Ready(&ProxyType) < 0) return -1;
    if (PyModule_AddObjectRef(module, "RingProxy", (PyObject *)&ProxyType) < 0 ||
        PyModule_AddFunctions(module, proxy_functions) < 0 || add_ring_constants(module) < 0) {
        return -1;
    }
    return 0;
}
