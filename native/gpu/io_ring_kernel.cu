/* The GPU side of the I/O ring (io_ring.h): a layer's reads published by
 * the GPU's own threads, and a wait for their completion that a stream can
 * order attention behind. Compiled for sm_80 and sm_90 by `make test`; it
 * has never run on a GPU (none of kvd's machines has one). */
#include "io_ring.h"

/* Thread i publishes read i of the layer: file, offset, length, target and
 * expected crc32c come from device arrays the caller filled once per layer. */
extern "C" __global__ void kvd_io_ring_submit_layer(kvd_io_ring *ring, const uint64_t *files, const uint64_t *offsets,
                                                    const uint64_t *lengths, const uint64_t *targets,
                                                    const uint32_t *checksums, uint64_t layer, uint64_t count) {
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    uint64_t ticket = kvd_io_ring_ticket(ring);
    while (!kvd_io_ring_slot_free(ring, ticket)) __nanosleep(1000);
    kvd_io_ring_publish(ring, ticket, files[i], offsets[i], lengths[i], targets[i], layer, i, checksums[i]);
}

/* One thread waits until `until` reads of the layer are done; launched on
 * the engine's stream before the layer's attention. */
extern "C" __global__ void kvd_io_ring_wait_layer(kvd_io_ring *ring, uint64_t layer, uint64_t until) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    while (kvd_io_ring_done(ring, layer) < until) __nanosleep(1000);
}
