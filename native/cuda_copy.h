/*
 * cuda_copy: the ring proxy's copy hook for targets in GPU memory.
 *
 * The CUDA driver is loaded at run time (dlopen of libcuda.so.1), so
 * kvd._native neither links against CUDA nor needs it to import: on a host
 * without a driver, opening a copier fails with -ENODEV and nothing else
 * changes. A copier holds device `ordinal`'s primary context and one stream;
 * a call makes the context current on the calling thread, issues one
 * cuMemcpyHtoDAsync per read and synchronizes the stream once, so a read is
 * counted done only after its bytes are on the device.
 *
 * Never run on a GPU: none of kvd's machines has had one (docs/GPU.md).
 */
#ifndef KVD_CUDA_COPY_H
#define KVD_CUDA_COPY_H

#include <stdint.h>

#include "ring_proxy.h"

struct kvd_cuda_copier;

/* 0, -ENODEV (no driver or no such device), or -EIO (a driver call failed). */
int kvd_cuda_copier_open(struct kvd_cuda_copier **out, int ordinal);
void kvd_cuda_copier_close(struct kvd_cuda_copier *copier);

/* A kvd_copy_fn: `context` is a kvd_cuda_copier. */
int kvd_cuda_copy(void *context, const struct kvd_copy *copies, uint32_t count);

#endif
