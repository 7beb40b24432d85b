/*
 * kvd._native.cuda_copy_batch and cuda_driver_version: the CUDA device's
 * batched copies (kvd/device/cuda.py), issued from arrays of addresses in
 * one call, so a 32k-token load costs no Python object per address.
 *
 * The driver is loaded at run time (dlopen of libcuda.so.1), so the module
 * imports on machines without one. Which entry point issues a batch
 * depends on the driver, not on the headers kvd was built with:
 *
 *   driver >= 13.0   cuMemcpyBatchAsync_v2 (no failure index)
 *   driver 12.8-12.9 cuMemcpyBatchAsync (the 12.8 signature, with one)
 *   older            one cuMemcpyAsync per copy, in a C loop
 *
 * Addresses are unified virtual addresses: device memory, IPC-opened
 * memory, and host memory registered with cudaHostRegister. The caller
 * makes the device's context current on the calling thread first.
 *
 * Never run on a GPU: none of kvd's machines has had one (docs/GPU.md).
 */
#include "module.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef void *CUstream;
typedef uint64_t CUdeviceptr;

/* CUmemcpyAttributes as cuda.h 12.8+ lays it out: the source access order,
 * two (type, id) location hints, and flags. */
typedef struct {
    int src_access_order;
    int src_location[2];
    int dst_location[2];
    unsigned int flags;
} batch_attributes;

#define SRC_ACCESS_ORDER_STREAM 1
#define BATCH_API_V2 2   /* cuMemcpyBatchAsync_v2 */
#define BATCH_API_V1 1   /* cuMemcpyBatchAsync, 12.8's */
#define BATCH_API_LOOP 0 /* cuMemcpyAsync per copy */

typedef CUresult (*batch_v2_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, batch_attributes *, size_t *,
                                size_t, CUstream);
typedef CUresult (*batch_v1_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, batch_attributes *, size_t *,
                                size_t, size_t *, CUstream);
typedef CUresult (*copy_fn)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*version_fn)(int *);

static struct {
    void *library;
    version_fn driver_version;
    batch_v2_fn batch_v2;
    batch_v1_fn batch_v1;
    copy_fn copy;
} driver;

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;

static void load_driver(void) {
    driver.library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver.library == NULL) return;
    *(void **)&driver.driver_version = dlsym(driver.library, "cuDriverGetVersion");
    *(void **)&driver.batch_v2 = dlsym(driver.library, "cuMemcpyBatchAsync_v2");
    *(void **)&driver.batch_v1 = dlsym(driver.library, "cuMemcpyBatchAsync");
    *(void **)&driver.copy = dlsym(driver.library, "cuMemcpyAsync");
}

/* The driver's CUDA version (12080 for 12.8), or -1 where no driver loads. */
static int driver_version(void) {
    pthread_once(&driver_once, load_driver);
    int version = -1;
    if (driver.driver_version == NULL || driver.driver_version(&version) != 0) return -1;
    return version;
}

/* Which batch entry point this driver gets (BATCH_API_*), -1 without a driver. */
static int batch_api(void) {
    int version = driver_version();
    if (version < 0 || driver.copy == NULL) return -1;
    if (version >= 13000 && driver.batch_v2 != NULL) return BATCH_API_V2;
    if (version >= 12080 && driver.batch_v1 != NULL) return BATCH_API_V1;
    return BATCH_API_LOOP;
}

/* Issue the copies on `stream`; the first failing CUresult, or 0. */
static CUresult copy_batch(int api, CUstream stream, const uint64_t *dsts, const uint64_t *srcs, size_t count,
                           size_t nbytes) {
    if (api == BATCH_API_LOOP || stream == NULL) { /* (the batch calls refuse the legacy stream) */
        for (size_t i = 0; i < count; i++) {
            CUresult rc = driver.copy(dsts[i], srcs[i], nbytes, stream);
            if (rc != 0) return rc;
        }
        return 0;
    }
    size_t *sizes = malloc(count * sizeof(size_t));
    if (sizes == NULL) return -1;
    for (size_t i = 0; i < count; i++) sizes[i] = nbytes;
    batch_attributes attributes = {SRC_ACCESS_ORDER_STREAM, {0, 0}, {0, 0}, 0};
    size_t first = 0;
    size_t failed = 0;
    CUresult rc = api == BATCH_API_V2
        ? driver.batch_v2((CUdeviceptr *)dsts, (CUdeviceptr *)srcs, sizes, count, &attributes, &first, 1, stream)
        : driver.batch_v1((CUdeviceptr *)dsts, (CUdeviceptr *)srcs, sizes, count, &attributes, &first, 1, &failed,
                          stream);
    free(sizes);
    return rc;
}

/* cuda_copy_batch(stream, dst_addresses, src_addresses, nbytes) -> (CUresult, api): see above. */
static PyObject *native_cuda_copy_batch(PyObject *Py_UNUSED(module), PyObject *args) {
    unsigned long long stream;
    PyObject *dst_object;
    PyObject *src_object;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "KOOK", &stream, &dst_object, &src_object, &nbytes)) return NULL;
    int api = batch_api();
    if (api < 0) return PyErr_Format(PyExc_OSError, "the CUDA driver (libcuda.so.1) is not loadable");
    Py_buffer dst_view;
    Py_buffer src_view;
    Py_ssize_t count = get_array(dst_object, &dst_view, sizeof(uint64_t), 0, "dst_addresses");
    if (count < 0) return NULL;
    Py_ssize_t sources = get_array(src_object, &src_view, sizeof(uint64_t), 0, "src_addresses");
    if (sources != count) {
        PyBuffer_Release(&dst_view);
        if (sources >= 0) PyBuffer_Release(&src_view);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "as many source addresses as destinations");
        return NULL;
    }
    CUresult rc = 0;
    if (count > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = copy_batch(api, (CUstream)(uintptr_t)stream, dst_view.buf, src_view.buf, (size_t)count, (size_t)nbytes);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst_view);
    PyBuffer_Release(&src_view);
    if (rc == -1) return PyErr_NoMemory();
    return Py_BuildValue("(ii)", rc, api);
}

static PyObject *native_cuda_driver_version(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLong(driver_version());
}

static PyMethodDef cuda_batch_functions[] = {
    {"cuda_copy_batch", native_cuda_copy_batch, METH_VARARGS,
     "cuda_copy_batch(stream, dst_addresses: uint64 array, src_addresses: uint64 array, nbytes) -> (CUresult, api)"},
    {"cuda_driver_version", native_cuda_driver_version, METH_NOARGS,
     "cuda_driver_version() -> the driver's CUDA version (12080 for 12.8), -1 without a driver"},
    {NULL, NULL, 0, NULL},
};

int kvd_add_cuda_batch(PyObject *module) {
    if (PyModule_AddFunctions(module, cuda_batch_functions) < 0) return -1;
    if (PyModule_AddIntConstant(module, "CUDA_BATCH_API_V2", BATCH_API_V2) < 0) return -1;
    if (PyModule_AddIntConstant(module, "CUDA_BATCH_API_V1", BATCH_API_V1) < 0) return -1;
    return PyModule_AddIntConstant(module, "CUDA_BATCH_API_LOOP", BATCH_API_LOOP);
}
