/* A stand-in libcuda.so.1 for tests/native/test_cuda_batch.py: the few driver entry points
 * kvd._native.cuda_copy_batch looks up, moving bytes between host addresses (a CPU's "device
 * pointers") and counting which entry point moved them. KVD_FAKE_DRIVER_VERSION sets the version
 * cuDriverGetVersion reports; KVD_FAKE_FAIL_AT makes the copy of that index fail (CUresult 1). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t CUdeviceptr;

static uint64_t calls[3]; /* loop copies, v1 batches, v2 batches */

int cuDriverGetVersion(int *version) {
    const char *text = getenv("KVD_FAKE_DRIVER_VERSION");
    *version = text != NULL ? atoi(text) : 13000;
    return 0;
}

static long fail_at(void) {
    const char *text = getenv("KVD_FAKE_FAIL_AT");
    return text != NULL ? atol(text) : -1;
}

int cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void *stream) {
    (void)stream;
    calls[0]++;
    if ((long)(calls[0] - 1) == fail_at()) return 1;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
    return 0;
}

static int batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, const int *attributes,
                 size_t attribute_count) {
    if (attribute_count != 1 || attributes[0] != 1) return 1; /* stream order, one attribute set */
    for (size_t i = 0; i < count; i++) {
        if ((long)i == fail_at()) return 1;
        memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
    }
    return 0;
}

int cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, const int *attributes,
                       size_t *indexes, size_t attribute_count, size_t *failed, void *stream) {
    (void)indexes, (void)failed, (void)stream;
    calls[1]++;
    return batch(dsts, srcs, sizes, count, attributes, attribute_count);
}

int cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, const int *attributes,
                          size_t *indexes, size_t attribute_count, void *stream) {
    (void)indexes, (void)stream;
    calls[2]++;
    return batch(dsts, srcs, sizes, count, attributes, attribute_count);
}

/* For the test: how many calls each entry point took. */
uint64_t kvd_fake_calls(int which) { return calls[which]; }
