/* The GPU side of the I/O ring (io_ring.h): a layer's reads published by
 * the GPU's own threads, and a bounded wait for their completion that a
 * stream can order attention behind. Compiled for sm_80 and sm_90 by
 * `make test`; run on an NVIDIA H200 by the device check (docs/GPU.md).
 *
 * Neither kernel can hang its stream: both take a timeout in nanoseconds
 * (%globaltimer, see io_ring.h). A submit whose slots do not free up in time
 * (no proxy drains the ring) abandons those reads, which the layer's wait
 * then reports as FAILED; a wait reports TIMEOUT when the layer's reads do
 * not complete in time. Either way the stream goes on, and the engine reads
 * the wait's record to choose between using the layer and recomputing it. */
#include "io_ring.h"

/* Thread i publishes read i of the layer: file, offset, length, target and
 * expected crc32c come from device arrays the caller filled once per layer;
 * its tag is first_tag + i (the daemon's grants for the layer are numbered
 * so: the proxy reads only what a grant names).
 * Thread 0 of each block reserves the block's tickets, in chunks of at most
 * the ring's capacity: one compare-and-swap on host memory per chunk, not an
 * atomic per read. A chunk not reserved by the block's deadline (from the
 * block's start) is counted abandoned and never published. */
extern "C" __global__ void kvd_io_ring_submit_layer(kvd_io_ring *ring, const uint64_t *files, const uint64_t *offsets,
                                                    const uint64_t *lengths, const uint64_t *targets,
                                                    const uint32_t *checksums, uint64_t layer, uint64_t count,
                                                    uint64_t timeout_ns, uint64_t first_tag) {
    __shared__ uint64_t capacity, deadline, first_ticket;
    __shared__ int taken;
    uint64_t first = (uint64_t)blockIdx.x * blockDim.x;
    if (first >= count) return; /* the whole block leaves together */
    uint64_t in_block = count - first < blockDim.x ? count - first : blockDim.x;
    if (threadIdx.x == 0) {
        capacity = ring->capacity;
        deadline = kvd_io_ring_deadline(timeout_ns);
        if (capacity == 0) kvd_io_ring_abandon(ring, layer, in_block);
    }
    __syncthreads();
    for (uint64_t chunk = 0; capacity != 0 && chunk < in_block; chunk += capacity) {
        uint64_t need = in_block - chunk < capacity ? in_block - chunk : capacity;
        if (threadIdx.x == 0) {
            taken = kvd_io_ring_reserve(ring, need, deadline, &first_ticket);
            if (!taken) kvd_io_ring_abandon(ring, layer, need);
        }
        __syncthreads();
        uint64_t k = (uint64_t)threadIdx.x - chunk; /* wraps to a huge value below the chunk */
        if (taken && threadIdx.x >= chunk && k < need) {
            uint64_t i = first + threadIdx.x;
            kvd_io_ring_publish(ring, first_ticket + k, files[i], offsets[i], lengths[i], targets[i], layer,
                                first_tag + i, checksums[i]);
        }
        __syncthreads(); /* the chunk is published before thread 0 reserves the next */
    }
}

/* One thread waits for `until` completions of the layer (see kvd_io_ring_wait)
 * and writes how it ended into `record`: a kvd_io_wait in host-mapped memory
 * (the ring's own waits[], which the host reads without synchronizing the
 * stream) or in device memory (for a kernel that decides on the GPU).
 * Launched on the engine's stream before the layer's attention. */
extern "C" __global__ void kvd_io_ring_wait_layer(kvd_io_ring *ring, uint64_t layer, uint64_t until,
                                                  uint64_t failed_before, uint64_t timeout_ns, kvd_io_wait *record) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    kvd_io_ring_wait(ring, layer, until, failed_before, timeout_ns, record);
}
