/* What the parts of kvd._native share (module.c, proxy_module.c). */
#ifndef KVD_MODULE_H
#define KVD_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Sets OSError from -errno; returns NULL. */
PyObject *raise_error(int negative_errno);

/* A 1-D C-contiguous buffer of `itemsize`-byte items; returns its length or -1. */
Py_ssize_t get_array(PyObject *object, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *name);

/* Adds RingProxy, io_ring_init and the ring's constants to the module. */
int kvd_add_ring_proxy(PyObject *module);

/* cuda_batch.c: cuda_copy_batch and cuda_driver_version (kvd.device.cuda). */
int kvd_add_cuda_batch(PyObject *module);

/* planner_module.c: plan_step_latency and plan_search (kvd.planner). */
int kvd_add_planner(PyObject *module);

#endif
