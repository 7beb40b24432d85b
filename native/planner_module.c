/*
 * kvd._native.plan_step_latency and plan_search: planner.c's model and
 * search for kvd.planner. Arrays come as C-contiguous buffers: float64
 * compute seconds per layer and KV bytes per request, int32 distances and
 * options.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "planner.h"

struct views {
    Py_buffer compute, kv, ints;
    int held;
};

static void release(struct views *v) {
    if (v->held > 0) PyBuffer_Release(&v->compute);
    if (v->held > 1) PyBuffer_Release(&v->kv);
    if (v->held > 2) PyBuffer_Release(&v->ints);
}

static int take(PyObject *object, Py_buffer *view, Py_ssize_t itemsize, const char *name, Py_ssize_t limit) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    Py_ssize_t count = view->len / itemsize;
    if (view->len % itemsize != 0 || count > limit) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes are not at most %zd items of %zd bytes", name, view->len,
                     limit, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The batch from (compute, kv, bandwidth) and the int32 array `ints`; -1 with an exception set. */
static int batch_from(PyObject *compute, PyObject *kv, double bandwidth, PyObject *ints, const char *ints_name,
                      Py_ssize_t ints_limit, struct views *v, struct kvd_plan_batch *batch) {
    if (take(compute, &v->compute, 8, "compute_s", KVD_PLAN_MAX_LAYERS) < 0) return -1;
    v->held = 1;
    if (take(kv, &v->kv, 8, "kv_bytes", KVD_PLAN_MAX_REQUESTS) < 0) return -1;
    v->held = 2;
    if (take(ints, &v->ints, 4, ints_name, ints_limit) < 0) return -1;
    v->held = 3;
    batch->layers = (int)(v->compute.len / 8);
    batch->requests = (int)(v->kv.len / 8);
    batch->compute_s = v->compute.buf;
    batch->kv_bytes = v->kv.buf;
    batch->bandwidth_bps = bandwidth;
    if (batch->layers < 1 || !(bandwidth > 0)) {
        PyErr_SetString(PyExc_ValueError, "a batch needs at least one layer and a positive bandwidth");
        return -1;
    }
    return 0;
}

static int check_distances(const struct kvd_plan_batch *batch, const int *distances, Py_ssize_t count) {
    if (count != batch->requests) {
        PyErr_SetString(PyExc_ValueError, "one distance per request");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (distances[i] != KVD_PLAN_NONE && (distances[i] < 1 || distances[i] >= batch->layers)) {
            PyErr_Format(PyExc_ValueError, "distance %d is neither -1 nor in [1, %d)", distances[i], batch->layers);
            return -1;
        }
    }
    return 0;
}

static PyObject *plan_step_latency(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *compute, *kv, *distances;
    double bandwidth;
    if (!PyArg_ParseTuple(args, "OOdO", &compute, &kv, &bandwidth, &distances)) return NULL;
    struct views v = {.held = 0};
    struct kvd_plan_batch batch;
    PyObject *answer = NULL;
    if (batch_from(compute, kv, bandwidth, distances, "distances", KVD_PLAN_MAX_REQUESTS, &v, &batch) == 0 &&
        check_distances(&batch, v.ints.buf, v.ints.len / 4) == 0)
        answer = PyFloat_FromDouble(kvd_plan_step_latency(&batch, v.ints.buf));
    release(&v);
    return answer;
}

static PyObject *result_tuple(const struct kvd_plan_result *result, int requests) {
    if (!result->found) Py_RETURN_NONE;
    PyObject *distances = PyTuple_New(requests);
    if (distances == NULL) return NULL;
    for (int r = 0; r < requests; r++) PyTuple_SET_ITEM(distances, r, PyLong_FromLong(result->distances[r]));
    return Py_BuildValue("(NdddLO)", distances, result->latency_s, result->bound_s, result->gpu_bytes,
                         (long long)result->explored, result->exact ? Py_True : Py_False);
}

static PyObject *plan_search(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *compute, *kv, *options;
    double bandwidth, budget;
    long long max_nodes;
    if (!PyArg_ParseTuple(args, "OOdOdL", &compute, &kv, &bandwidth, &options, &budget, &max_nodes)) return NULL;
    struct views v = {.held = 0};
    struct kvd_plan_batch batch;
    struct kvd_plan_result result;
    PyObject *answer = NULL;
    if (batch_from(compute, kv, bandwidth, options, "options", KVD_PLAN_MAX_OPTIONS, &v, &batch) < 0) goto out;
    const int *option_values = v.ints.buf;
    int option_count = (int)(v.ints.len / 4);
    if (option_count < 1 || option_values[0] != KVD_PLAN_NONE) {
        PyErr_SetString(PyExc_ValueError, "options start with -1 (all on the GPU)");
        goto out;
    }
    for (int o = 1; o < option_count; o++) {
        if (option_values[o] < 1 || option_values[o] >= batch.layers) {
            PyErr_Format(PyExc_ValueError, "option %d is not a distance in [1, %d)", option_values[o], batch.layers);
            goto out;
        }
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = kvd_plan_search(&batch, option_values, option_count, budget, max_nodes < 0 ? 0 : max_nodes, &result);
    Py_END_ALLOW_THREADS
    if (status == -2)
        PyErr_NoMemory();
    else if (status < 0)
        PyErr_SetString(PyExc_ValueError, "batch out of the planner's range");
    else
        answer = result_tuple(&result, batch.requests);
out:
    release(&v);
    return answer;
}

static PyMethodDef planner_functions[] = {
    {"plan_step_latency", plan_step_latency, METH_VARARGS,
     "plan_step_latency(compute_s: float64 array, kv_bytes: float64 array, bandwidth_bps, distances: int32 array)"
     " -> seconds"},
    {"plan_search", plan_search, METH_VARARGS,
     "plan_search(compute_s, kv_bytes, bandwidth_bps, options: int32 array, budget_bytes, max_nodes) -> "
     "(distances, latency_s, bound_s, gpu_bytes, explored, exact) or None when nothing fits"},
    {NULL, NULL, 0, NULL},
};

int kvd_add_planner(PyObject *module) {
    return PyModule_AddFunctions(module, planner_functions);
}
