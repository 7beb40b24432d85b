/*
 * kvd._native: a thin CPython binding of uring_batch (and of prefix.c's walk).
 *
 * It only converts arguments (buffer-protocol arrays, never numpy's C API,
 * so the build needs no numpy headers), releases the GIL around anything
 * that can block, and keeps each batch's results buffer exported until the
 * batch is waited or the ring closed, so completions never land in freed
 * memory. Argument checking for callers lives in kvd/io/uring.py; checks
 * here protect memory only. Errors from the ring become OSError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checksum.h"
#include "module.h"
#include "prefix.h"
#include "uring_batch.h"

#ifdef KVD_CHECK_ADDRESSES
#define KVD_CHECKS_ADDRESSES 1
#else
#define KVD_CHECKS_ADDRESSES 0
#endif

typedef struct {
    PyObject_HEAD
    struct kvd_ring ring;
    /* Set while a call runs with the GIL released: a second thread calling
     * in would race on the ring, so it gets an exception instead. */
    int busy;
    Py_buffer *results;  /* per slot, exported while the slot is in flight */
    char *holding;       /* per slot: results[slot] is exported */
    Py_buffer *checksums;     /* per slot: a read batch's checksum cells, */
    char *holding_checksums;  /* exported likewise when it asked for them */
} RingObject;

PyObject *raise_error(int negative_errno) {
    errno = -negative_errno;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* Claims the ring for one call; fails when closed or used concurrently. */
static int claim(RingObject *self) {
    if (!self->ring.open) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "kvd._native.Ring used from two threads at once");
        return -1;
    }
    self->busy = 1;
    return 0;
}

static void release_results(RingObject *self, uint32_t slot) {
    if (self->holding != NULL && self->holding[slot]) {
        PyBuffer_Release(&self->results[slot]);
        self->holding[slot] = 0;
    }
    if (self->holding_checksums != NULL && self->holding_checksums[slot]) {
        PyBuffer_Release(&self->checksums[slot]);
        self->holding_checksums[slot] = 0;
    }
}

/* A 1-D C-contiguous buffer of `itemsize`-byte items; returns its length or -1. */
Py_ssize_t get_array(PyObject *object, Py_buffer *view, Py_ssize_t itemsize, int writable,
                            const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) return -1;
    if (view->itemsize != itemsize || view->ndim > 1) {
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-D array of %zd-byte items", name, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return view->len / itemsize;
}

static int ring_init(RingObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"queue_depth", "max_batches", "single_issuer", NULL};
    unsigned int queue_depth;
    unsigned int max_batches;
    int single_issuer = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "II|p", keywords, &queue_depth, &max_batches, &single_issuer)) {
        return -1;
    }
    if (self->ring.open || self->results != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Ring.__init__ called twice");
        return -1;
    }
    if (max_batches == 0 || max_batches > KVD_MAX_BATCHES) {
        PyErr_SetString(PyExc_ValueError, "max_batches out of range");
        return -1;
    }
    self->results = PyMem_Calloc(max_batches, sizeof *self->results);
    self->holding = PyMem_Calloc(max_batches, sizeof *self->holding);
    self->checksums = PyMem_Calloc(max_batches, sizeof *self->checksums);
    self->holding_checksums = PyMem_Calloc(max_batches, sizeof *self->holding_checksums);
    if (self->results == NULL || self->holding == NULL || self->checksums == NULL ||
        self->holding_checksums == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t flags = single_issuer ? KVD_SETUP_SINGLE_ISSUER : 0;
    int error = kvd_ring_open(&self->ring, queue_depth, max_batches, flags);
    if (error < 0) {
        raise_error(error);
        return -1;
    }
    return 0;
}

static void ring_release_all(RingObject *self) {
    if (self->holding == NULL) return;
    for (uint32_t slot = 0; slot < self->ring.max_batches; slot++) release_results(self, slot);
}

static void ring_dealloc(RingObject *self) {
    /* Draining needs no Python state; the GIL stays held (it is short:
     * only I/O the kernel already holds is waited for). */
    kvd_ring_close(&self->ring);
    ring_release_all(self);
    PyMem_Free(self->results);
    PyMem_Free(self->holding);
    PyMem_Free(self->checksums);
    PyMem_Free(self->holding_checksums);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *ring_close(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->ring.open) Py_RETURN_NONE;
    if (claim(self) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    kvd_ring_close(&self->ring); /* keeps max_batches, which sizes the results table */
    Py_END_ALLOW_THREADS
    self->busy = 0;
    ring_release_all(self);
    Py_RETURN_NONE;
}

static PyObject *ring_register_files(RingObject *self, PyObject *fds_object) {
    Py_buffer view;
    Py_ssize_t count = get_array(fds_object, &view, sizeof(int32_t), 0, "fds");
    if (count < 0) return NULL;
    if (claim(self) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int error = kvd_ring_register_files(&self->ring, view.buf, (uint32_t)count);
    self->busy = 0;
    PyBuffer_Release(&view);
    if (error < 0) return raise_error(error);
    Py_RETURN_NONE;
}

static PyObject *ring_register_buffers(RingObject *self, PyObject *args) {
    PyObject *address_object;
    PyObject *length_object;
    if (!PyArg_ParseTuple(args, "OO", &address_object, &length_object)) return NULL;
    Py_buffer addresses;
    Py_buffer lengths;
    Py_ssize_t count = get_array(address_object, &addresses, sizeof(uint64_t), 0, "addresses");
    if (count < 0) return NULL;
    if (get_array(length_object, &lengths, sizeof(uint64_t), 0, "lengths") != count) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "addresses and lengths differ in length");
            PyBuffer_Release(&lengths);
        }
        PyBuffer_Release(&addresses);
        return NULL;
    }
    struct kvd_region *regions = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof *regions);
    if (regions == NULL) {
        PyBuffer_Release(&addresses);
        PyBuffer_Release(&lengths);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        regions[i].address = ((const uint64_t *)addresses.buf)[i];
        regions[i].length = ((const uint64_t *)lengths.buf)[i];
    }
    PyBuffer_Release(&addresses);
    PyBuffer_Release(&lengths);
    if (claim(self) < 0) {
        PyMem_Free(regions);
        return NULL;
    }
    int error = kvd_ring_register_buffers(&self->ring, regions, (uint32_t)count);
    self->busy = 0;
    PyMem_Free(regions);
    if (error < 0) return raise_error(error);
    Py_RETURN_NONE;
}

static void release_views(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

/* A read batch's checksum cells (writable uint32), exported into `view`;
 * 0, or -1 with an exception set and nothing held. */
static int get_checksums(PyObject *object, Py_buffer *view, struct kvd_checksums *checksums) {
    Py_ssize_t cells = get_array(object, view, 4, 1, "checksums");
    if (cells < 0) return -1;
    checksums->values = view->buf;
    checksums->capacity = (uint64_t)cells;
    return 0;
}

/* A batch's five arrays, exported into `views`: file_index int32, offset
 * int64, length uint32, address uint64, results int64 (writable), all of
 * one length. Returns it, or -1 with an exception set and nothing held. */
static Py_ssize_t get_batch_views(PyObject *objects[5], Py_buffer views[5]) {
    static const Py_ssize_t itemsizes[5] = {4, 8, 4, 8, 8};
    static const char *names[5] = {"file_index", "offset", "length", "address", "results"};
    Py_ssize_t count = -1;
    for (int taken = 0; taken < 5; taken++) {
        Py_ssize_t length = get_array(objects[taken], &views[taken], itemsizes[taken], taken == 4, names[taken]);
        if (length >= 0 && taken > 0 && length != count) {
            PyErr_SetString(PyExc_ValueError, "batch arrays differ in length");
            PyBuffer_Release(&views[taken]);
            length = -1;
        }
        if (length < 0) {
            release_views(views, taken);
            return -1;
        }
        count = length;
    }
    if ((size_t)count > KVD_MAX_BATCH_ENTRIES) {
        PyErr_SetString(PyExc_ValueError, "batch too large");
        release_views(views, 5);
        return -1;
    }
    return count;
}

/* Room for `count` entries, then the ring claimed; NULL with an exception
 * set (the ring not claimed) when either fails. */
static struct kvd_entry *claim_with_entries(RingObject *self, Py_ssize_t count) {
    struct kvd_entry *entries = malloc((count > 0 ? (size_t)count : 1) * sizeof *entries);
    if (entries == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (claim(self) < 0) {
        free(entries);
        return NULL;
    }
    return entries;
}

/* Copies the arrays of get_batch_views into entries; runs with the GIL
 * released (the exports keep every array alive and unresized). */
static void copy_entries(struct kvd_entry *entries, const Py_buffer views[5], Py_ssize_t count) {
    const int32_t *file_index = views[0].buf;
    const int64_t *offset = views[1].buf;
    const uint32_t *length = views[2].buf;
    const uint64_t *address = views[3].buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        entries[i].address = address[i];
        entries[i].offset = offset[i];
        entries[i].length = length[i];
        entries[i].file_index = file_index[i];
    }
}

/* Keeps a started batch's results (and checksum cells) exported until
 * wait() or close(). */
static void hold_batch_buffers(RingObject *self, uint32_t slot, const Py_buffer *results,
                               const Py_buffer *checksums) {
    self->results[slot] = *results;
    self->holding[slot] = 1;
    if (checksums != NULL) {
        self->checksums[slot] = *checksums;
        self->holding_checksums[slot] = 1;
    }
}

static PyObject *ring_submit(RingObject *self, PyObject *args) {
    int op;
    PyObject *objects[5];
    PyObject *checksums_object = Py_None;
    unsigned int chunk = 0;
    if (!PyArg_ParseTuple(args, "iOOOOO|OI", &op, &objects[0], &objects[1], &objects[2], &objects[3], &objects[4],
                          &checksums_object, &chunk)) {
        return NULL;
    }
    Py_buffer checksum_view;
    struct kvd_checksums checksums = {NULL, 0, chunk};
    int with_checksums = checksums_object != Py_None;
    if (with_checksums && get_checksums(checksums_object, &checksum_view, &checksums) < 0) return NULL;
    Py_buffer views[5];
    Py_ssize_t count = get_batch_views(objects, views);
    struct kvd_entry *entries = count >= 0 ? claim_with_entries(self, count) : NULL;
    if (entries == NULL) {
        if (count >= 0) release_views(views, 5);
        if (with_checksums) PyBuffer_Release(&checksum_view);
        return NULL;
    }
    uint64_t id = 0;
    uint32_t slot = 0;
    int error;
    Py_BEGIN_ALLOW_THREADS
    copy_entries(entries, views, count);
    error = kvd_ring_submit(&self->ring, op, entries, views[4].buf, (uint32_t)count,
                            with_checksums ? &checksums : NULL, &id, &slot);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    release_views(views, 4);
    if (error < 0) {
        free(entries);
        PyBuffer_Release(&views[4]);
        if (with_checksums) PyBuffer_Release(&checksum_view);
        return raise_error(error);
    }
    hold_batch_buffers(self, slot, &views[4], with_checksums ? &checksum_view : NULL);
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *ring_wait(RingObject *self, PyObject *id_object) {
    unsigned long long id = PyLong_AsUnsignedLongLong(id_object);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (claim(self) < 0) return NULL;
    int slot = kvd_ring_slot_of(&self->ring, id);
    if (slot < 0) {
        self->busy = 0;
        PyErr_Format(PyExc_KeyError, "no batch %llu in flight", id);
        return NULL;
    }
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = kvd_ring_wait(&self->ring, id);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (error < 0) return raise_error(error);
    release_results(self, (uint32_t)slot);
    Py_RETURN_NONE;
}

static PyObject *ring_fsync(RingObject *self, PyObject *args) {
    int file_index;
    int datasync;
    if (!PyArg_ParseTuple(args, "ip", &file_index, &datasync)) return NULL;
    if (claim(self) < 0) return NULL;
    int64_t result = 0;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = kvd_ring_fsync(&self->ring, file_index, datasync, &result);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (error < 0) return raise_error(error);
    return PyLong_FromLongLong(result);
}

static PyObject *ring_add_fault(RingObject *self, PyObject *args) {
    struct kvd_fault fault;
    long long short_bytes;
    long long count;
    memset(&fault, 0, sizeof fault);
    if (!PyArg_ParseTuple(args, "iiLLiLL", &fault.op, &fault.file_index, &fault.offset_begin, &fault.offset_end,
                          &fault.error, &short_bytes, &count)) {
        return NULL;
    }
    if (count <= 0 || count > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "count out of range");
        return NULL;
    }
    fault.short_bytes = short_bytes;
    fault.remaining = (uint32_t)count;
    if (claim(self) < 0) return NULL;
    int error = kvd_ring_add_fault(&self->ring, &fault);
    self->busy = 0;
    if (error < 0) return raise_error(error);
    Py_RETURN_NONE;
}

static PyObject *ring_fail_enters(RingObject *self, PyObject *args) {
    int error;
    unsigned int count;
    if (!PyArg_ParseTuple(args, "iI", &error, &count)) return NULL;
    if (error <= 0) {
        PyErr_SetString(PyExc_ValueError, "error must be a positive errno");
        return NULL;
    }
    if (claim(self) < 0) return NULL;
    kvd_ring_fail_enters(&self->ring, error, count);
    self->busy = 0;
    Py_RETURN_NONE;
}

static PyObject *ring_clear_faults(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (claim(self) < 0) return NULL;
    kvd_ring_clear_faults(&self->ring);
    self->busy = 0;
    Py_RETURN_NONE;
}

static int set_counter(PyObject *dict, const char *key, uint64_t value) {
    PyObject *number = PyLong_FromUnsignedLongLong(value);
    if (number == NULL) return -1;
    int error = PyDict_SetItemString(dict, key, number);
    Py_DECREF(number);
    return error;
}

static PyObject *ring_stats(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    const struct kvd_stats *stats = &self->ring.stats;
    PyObject *dict = PyDict_New();
    if (dict == NULL) return NULL;
    if (set_counter(dict, "entries", stats->entries) < 0 || set_counter(dict, "batches", stats->batches) < 0 ||
        set_counter(dict, "fsyncs", stats->fsyncs) < 0 || set_counter(dict, "enter_calls", stats->enter_calls) < 0 ||
        set_counter(dict, "submit_calls", stats->submit_calls) < 0 ||
        set_counter(dict, "bytes_read", stats->bytes_read) < 0 ||
        set_counter(dict, "bytes_written", stats->bytes_written) < 0 ||
        set_counter(dict, "errors", stats->errors) < 0 ||
        set_counter(dict, "short_transfers", stats->short_transfers) < 0 ||
        set_counter(dict, "faults_injected", stats->faults_injected) < 0 ||
        set_counter(dict, "fixed_buffer_entries", stats->fixed_buffer_entries) < 0 ||
        set_counter(dict, "checksum_chunks", stats->checksum_chunks) < 0 ||
        set_counter(dict, "enter_errors", stats->enter_errors) < 0) {
        Py_DECREF(dict);
        return NULL;
    }
    return dict;
}

static PyObject *ring_get_closed(RingObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(!self->ring.open);
}

static PyObject *ring_get_queue_depth(RingObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLong(self->ring.queue_depth);
}

static PyObject *ring_get_batches_in_flight(RingObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLong(self->ring.open ? self->ring.active_batches : 0);
}

/* Tests: ids of the batches whose entries are not all in the kernel yet, in
 * the order they will be handed over (0 would be a freed slot). */
static PyObject *ring_get_pending_batches(RingObject *self, void *Py_UNUSED(closure)) {
    if (!self->ring.open) return PyTuple_New(0);
    if (claim(self) < 0) return NULL;
    uint32_t count = kvd_ring_pending(&self->ring, NULL, 0);
    uint64_t *ids = PyMem_Calloc(count > 0 ? count : 1, sizeof *ids);
    PyObject *tuple = ids != NULL ? PyTuple_New(count) : PyErr_NoMemory();
    if (tuple != NULL) kvd_ring_pending(&self->ring, ids, count);
    self->busy = 0;
    for (uint32_t k = 0; tuple != NULL && k < count; k++) {
        PyObject *id = PyLong_FromUnsignedLongLong(ids[k]);
        if (id == NULL) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, k, id);
    }
    PyMem_Free(ids);
    return tuple;
}

/* METH_O / METH_NOARGS functions take two arguments already; METH_VARARGS
 * ones too. The cast through void (*)(void) tells gcc the type pun is meant. */
#define METHOD(function) ((PyCFunction)(void (*)(void))(function))

static PyMethodDef ring_methods[] = {
    {"register_files", METHOD(ring_register_files), METH_O, "register_files(fds: int32 array) -> None"},
    {"register_buffers", METHOD(ring_register_buffers), METH_VARARGS,
     "register_buffers(addresses: uint64 array, lengths: uint64 array) -> None"},
    {"submit", METHOD(ring_submit), METH_VARARGS,
     "submit(op, file_index, offset, length, address, results) -> batch id"},
    {"wait", METHOD(ring_wait), METH_O, "wait(batch_id) -> None; results are in the array given to submit"},
    {"fsync", METHOD(ring_fsync), METH_VARARGS, "fsync(file_index, datasync) -> 0 or -errno"},
    {"add_fault", METHOD(ring_add_fault), METH_VARARGS,
     "add_fault(op, file_index, offset_begin, offset_end, error, short_bytes, count) -> None"},
    {"clear_faults", METHOD(ring_clear_faults), METH_NOARGS, "clear_faults() -> None"},
    {"fail_enters", METHOD(ring_fail_enters), METH_VARARGS,
     "fail_enters(errno, count) -> None; the next count io_uring_enter calls fail (tests)"},
    {"stats", METHOD(ring_stats), METH_NOARGS, "stats() -> dict of counters"},
    {"close", METHOD(ring_close), METH_NOARGS, "close() -> None; drains in-flight I/O; idempotent"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ring_getset[] = {
    {"closed", (getter)ring_get_closed, NULL, NULL, NULL},
    {"queue_depth", (getter)ring_get_queue_depth, NULL, NULL, NULL},
    {"batches_in_flight", (getter)ring_get_batches_in_flight, NULL, NULL, NULL},
    {"pending_batches", (getter)ring_get_pending_batches, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd._native.Ring",
    .tp_doc = "One io_uring and its batches in flight (see native/uring_batch.h).",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};

/* crc32c_chunks(addresses, chunk, chunks, out): for each address i,
 * out[i * chunks + j] = crc32c of `chunk` bytes at addresses[i] + j * chunk.
 * The caller vouches for the memory (kvd/io/checksum.py checks nothing it
 * cannot: the addresses come from the daemon's own arena). */
static PyObject *native_crc32c_chunks(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *addresses_object;
    PyObject *out_object;
    unsigned long long chunk;
    unsigned int chunks;
    if (!PyArg_ParseTuple(args, "OKIO", &addresses_object, &chunk, &chunks, &out_object)) return NULL;
    Py_buffer addresses_view;
    Py_buffer out_view;
    Py_ssize_t count = get_array(addresses_object, &addresses_view, 8, 0, "addresses");
    if (count < 0) return NULL;
    Py_ssize_t cells = get_array(out_object, &out_view, 4, 1, "out");
    if (cells < 0) {
        PyBuffer_Release(&addresses_view);
        return NULL;
    }
    if ((unsigned long long)cells != (unsigned long long)count * chunks) {
        PyBuffer_Release(&addresses_view);
        PyBuffer_Release(&out_view);
        PyErr_SetString(PyExc_ValueError, "out must hold len(addresses) * chunks cells");
        return NULL;
    }
    const uint64_t *addresses = addresses_view.buf;
    uint32_t *out = out_view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        kvd_crc32c_chunks((const void *)(uintptr_t)addresses[i], chunk, chunks, out + (size_t)i * chunks);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addresses_view);
    PyBuffer_Release(&out_view);
    Py_RETURN_NONE;
}

/* Two 1-D arrays of 8-byte items and the same length (their views held:
 * release both after use); the length, or -1 with an exception set and
 * nothing held. */
static Py_ssize_t get_pair(PyObject *first, const char *first_name, PyObject *second, const char *second_name,
                           Py_buffer *first_view, Py_buffer *second_view) {
    Py_ssize_t count = get_array(first, first_view, 8, 0, first_name);
    if (count < 0) return -1;
    Py_ssize_t others = get_array(second, second_view, 8, 0, second_name);
    if (others < 0) {
        PyBuffer_Release(first_view);
        return -1;
    }
    if (others != count) {
        PyBuffer_Release(first_view);
        PyBuffer_Release(second_view);
        PyErr_Format(PyExc_ValueError, "%s and %s must be the same length", first_name, second_name);
        return -1;
    }
    return count;
}

/* copy_chunks(dst_addresses, src_addresses, nbytes): memcpy of `nbytes` from
 * each src_addresses[i] to dst_addresses[i], in order, with the GIL
 * released. The CPU device's batched copies (kvd/device/cpu.py); the caller
 * vouches for the memory, as for crc32c_chunks. */
static PyObject *native_copy_chunks(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *dst_object;
    PyObject *src_object;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "OOK", &dst_object, &src_object, &nbytes)) return NULL;
    Py_buffer dst_view;
    Py_buffer src_view;
    Py_ssize_t count = get_pair(dst_object, "dst_addresses", src_object, "src_addresses", &dst_view, &src_view);
    if (count < 0) return NULL;
    const uint64_t *dst = dst_view.buf;
    const uint64_t *src = src_view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        memmove((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)nbytes);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst_view);
    PyBuffer_Release(&src_view);
    Py_RETURN_NONE;
}

/* Move `nbytes` between each local address and the same-index offset of an
 * open file (pread when reading, pwrite when writing), retrying short
 * transfers. The file is another process's memory (/proc/<pid>/mem, opened
 * by that process and passed over a unix socket): the CPU device's stand-in
 * for a copy into an engine's IPC-mapped pool. Returns 0, or the errno of
 * the first transfer that failed (0 bytes moved counts as EIO). */
static int copy_file_chunks(int fd, const uint64_t *offsets, const uint64_t *addresses, Py_ssize_t count,
                            size_t nbytes, int write) {
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t done = 0;
        while (done < nbytes) {
            char *local = (char *)(uintptr_t)addresses[i] + done;
            off_t at = (off_t)(offsets[i] + done);
            ssize_t moved = write ? pwrite(fd, local, nbytes - done, at) : pread(fd, local, nbytes - done, at);
            if (moved < 0 && errno == EINTR) continue;
            if (moved <= 0) return moved < 0 ? errno : EIO;
            done += (size_t)moved;
        }
    }
    return 0;
}

/* copy_file_chunks(fd, file_offsets, addresses, nbytes, write): see above;
 * OSError on a failed transfer, the GIL released meanwhile. */
static PyObject *native_copy_file_chunks(PyObject *Py_UNUSED(module), PyObject *args) {
    int fd;
    PyObject *offsets_object;
    PyObject *addresses_object;
    unsigned long long nbytes;
    int write;
    if (!PyArg_ParseTuple(args, "iOOKp", &fd, &offsets_object, &addresses_object, &nbytes, &write)) return NULL;
    Py_buffer offsets_view;
    Py_buffer addresses_view;
    Py_ssize_t count = get_pair(offsets_object, "file_offsets", addresses_object, "addresses", &offsets_view,
                                &addresses_view);
    if (count < 0) return NULL;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = copy_file_chunks(fd, offsets_view.buf, addresses_view.buf, count, (size_t)nbytes, write);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&offsets_view);
    PyBuffer_Release(&addresses_view);
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef native_functions[] = {
    {"copy_chunks", native_copy_chunks, METH_VARARGS,
     "copy_chunks(dst_addresses: uint64 array, src_addresses: uint64 array, nbytes) -> None"},
    {"copy_file_chunks", native_copy_file_chunks, METH_VARARGS,
     "copy_file_chunks(fd, file_offsets: uint64 array, addresses: uint64 array, nbytes, write) -> None"},
    {"crc32c_chunks", native_crc32c_chunks, METH_VARARGS,
     "crc32c_chunks(addresses: uint64 array, chunk, chunks, out: uint32 array) -> None"},
    {"match_chain", kvd_match_chain, METH_VARARGS,
     "match_chain(nodes: dict, keys: bytes, key_bytes, parent, sealed) -> list of the matched nodes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvd._native",
    .m_doc = "Batched io_uring I/O and crc32c for kvd (see native/README.md).",
    .m_size = -1,
    .m_methods = native_functions,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&RingType) < 0) return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Ring", (PyObject *)&RingType) < 0 || kvd_add_ring_proxy(module) < 0 || kvd_add_planner(module) < 0 ||
        kvd_add_cuda_batch(module) < 0 ||
        PyModule_AddIntConstant(module, "OP_READ", KVD_OP_READ) < 0 ||
        PyModule_AddIntConstant(module, "OP_WRITE", KVD_OP_WRITE) < 0 ||
        PyModule_AddIntConstant(module, "OP_FSYNC", KVD_OP_FSYNC) < 0 ||
        PyModule_AddIntConstant(module, "MAX_QUEUE_DEPTH", KVD_MAX_QUEUE_DEPTH) < 0 ||
        PyModule_AddIntConstant(module, "MAX_BATCHES", KVD_MAX_BATCHES) < 0 ||
        PyModule_AddIntConstant(module, "MAX_BATCH_ENTRIES", KVD_MAX_BATCH_ENTRIES) < 0 ||
        PyModule_AddIntConstant(module, "MAX_FAULTS", KVD_MAX_FAULTS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_FILES", KVD_MAX_FILES) < 0 ||
        PyModule_AddIntConstant(module, "MAX_BUFFERS", KVD_MAX_BUFFERS) < 0 ||
        PyModule_AddIntConstant(module, "CHECKS_ADDRESSES", KVD_CHECKS_ADDRESSES) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
