/* cuda_copy: see cuda_copy.h. The few driver entry points it needs are
 * declared here with the driver's own ABI (handles are pointers, results
 * ints, device pointers 64-bit), so no CUDA header is needed to build. */
#include "cuda_copy.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;

struct driver {
    void *library;
    CUresult (*init)(unsigned int);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*primary_release)(CUdevice);
    CUresult (*set_current)(CUcontext);
    CUresult (*stream_create)(CUstream *, unsigned int);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*copy_to_device)(uint64_t, const void *, size_t, CUstream);
};

struct kvd_cuda_copier {
    struct driver driver;
    CUdevice device;
    CUcontext context;
    CUstream stream;
};

#define CU_STREAM_NON_BLOCKING 0x1u

static int load(struct driver *driver) {
    driver->library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver->library == NULL) return -ENODEV;
    void *l = driver->library;
    *(void **)&driver->init = dlsym(l, "cuInit");
    *(void **)&driver->device_get = dlsym(l, "cuDeviceGet");
    *(void **)&driver->primary_retain = dlsym(l, "cuDevicePrimaryCtxRetain");
    *(void **)&driver->primary_release = dlsym(l, "cuDevicePrimaryCtxRelease_v2");
    *(void **)&driver->set_current = dlsym(l, "cuCtxSetCurrent");
    *(void **)&driver->stream_create = dlsym(l, "cuStreamCreate");
    *(void **)&driver->stream_destroy = dlsym(l, "cuStreamDestroy_v2");
    *(void **)&driver->stream_synchronize = dlsym(l, "cuStreamSynchronize");
    *(void **)&driver->copy_to_device = dlsym(l, "cuMemcpyHtoDAsync_v2");
    void *all[] = {driver->init, driver->device_get, driver->primary_retain, driver->primary_release,
                   driver->set_current, driver->stream_create, driver->stream_destroy, driver->stream_synchronize,
                   driver->copy_to_device};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (all[i] == NULL) {
            dlclose(l);
            driver->library = NULL;
            return -ENODEV;
        }
    }
    return 0;
}

int kvd_cuda_copier_open(struct kvd_cuda_copier **out, int ordinal) {
    struct kvd_cuda_copier *copier = calloc(1, sizeof(*copier));
    if (copier == NULL) return -ENOMEM;
    int rc = load(&copier->driver);
    struct driver *d = &copier->driver;
    if (rc == 0 && (d->init(0) != 0 || d->device_get(&copier->device, ordinal) != 0)) rc = -ENODEV;
    if (rc == 0 && d->primary_retain(&copier->context, copier->device) != 0) rc = -EIO;
    if (rc == 0 && (d->set_current(copier->context) != 0 ||
                    d->stream_create(&copier->stream, CU_STREAM_NON_BLOCKING) != 0)) {
        d->primary_release(copier->device);
        rc = -EIO;
    }
    if (rc < 0) {
        if (d->library != NULL) dlclose(d->library);
        free(copier);
        return rc;
    }
    *out = copier;
    return 0;
}

void kvd_cuda_copier_close(struct kvd_cuda_copier *copier) {
    struct driver *d = &copier->driver;
    d->set_current(copier->context);
    d->stream_destroy(copier->stream);
    d->primary_release(copier->device);
    dlclose(d->library);
    free(copier);
}

int kvd_cuda_copy(void *context, const struct kvd_copy *copies, uint32_t count) {
    struct kvd_cuda_copier *copier = context;
    struct driver *d = &copier->driver;
    if (d->set_current(copier->context) != 0) return -EIO;
    int failed = 0;
    for (uint32_t i = 0; i < count && !failed; i++) {
        failed = d->copy_to_device(copies[i].target, copies[i].source, copies[i].length, copier->stream) != 0;
    }
    /* Synchronize even after a failed issue: earlier copies may still be reading staging. */
    failed |= d->stream_synchronize(copier->stream) != 0;
    return failed ? -EIO : 0;
}
