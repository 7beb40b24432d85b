/* The GPU-initiated I/O ring: one submission ring in host-mapped memory that
 * a GPU kernel (nvcc) fills with read descriptors and a CPU proxy thread
 * (gcc) drains into the I/O engine, with completions counted per layer.
 *
 * After Tutti (DESIGN.md): the GPU asks for a layer's blocks itself, so a
 * long restore costs the CPU O(layers) work to start, not O(blocks).
 *
 * Protocol (many producers, one consumer; every field 64-bit aligned):
 * - A producer takes a ticket with an atomic add on `reserved`, waits until
 *   its slot is free (ticket - consumed < capacity), writes the descriptor,
 *   and publishes it last: slot.sequence = ticket + 1 (release).
 * - The proxy reads slot `consumed % capacity`, takes it once its sequence
 *   is consumed + 1 (acquire), copies the descriptor out, and frees the slot
 *   (consumed + 1, release). Wrap-around is the sequence check: a slot's
 *   sequence names the ticket it holds, never an older lap's.
 * - When a read is done (its crc32c checked, and copied to its target), the proxy
 *   adds one to done[layer] (release); on failure it also sets failed[layer].
 *   A waiter reads them with acquire.
 *
 * Atomics: GCC's __atomic builtins on the host (C11 memory model; gcc and
 * g++ alike), cuda::atomic_ref at system scope under nvcc, so the GPU and
 * the CPU see one another's stores through host-mapped memory. Whether a
 * GPU polls host-mapped memory correctly can only be seen on a GPU; this
 * header's host side is tested in tests/device/test_io_ring.py.
 */
#ifndef KVD_IO_RING_H
#define KVD_IO_RING_H

#include <stdint.h>

#define KVD_IO_RING_VERSION 2u
#define KVD_IO_RING_MAX_LAYERS 256u

#if defined(__CUDACC__)
#include <cuda/atomic>
#define KVD_RING_FN __host__ __device__ static inline
#define KVD_LOAD_ACQUIRE(p) (cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*(p)).load(cuda::memory_order_acquire))
#define KVD_STORE_RELEASE(p, v) (cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*(p)).store((v), cuda::memory_order_release))
#define KVD_FETCH_ADD(p, v) (cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*(p)).fetch_add((v), cuda::memory_order_acq_rel))
#else
#define KVD_RING_FN static inline
#define KVD_LOAD_ACQUIRE(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define KVD_STORE_RELEASE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define KVD_FETCH_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL)
#endif

/* One read: `length` bytes of registered file `file` at `offset`, into
 * `target`, where they land only if their crc32c is `checksum`. */
typedef struct kvd_io_desc {
    uint64_t sequence; /* ticket + 1 once published (written last) */
    uint64_t offset;
    uint64_t length;
    uint64_t target;   /* device (peer-to-peer) or staging address */
    uint64_t file;     /* index into the proxy's registered files */
    uint64_t layer;    /* completions are counted per layer */
    uint64_t tag;      /* the producer's own (block index, say) */
    uint64_t checksum; /* crc32c of the bytes (low 32 bits): a read that does not match it fails */
} kvd_io_desc;

typedef struct kvd_io_ring {
    uint64_t version;
    uint64_t capacity; /* a power of two */
    uint64_t layers;
    uint64_t reserved; /* next ticket to hand out */
    uint64_t consumed; /* next ticket the proxy takes; slots below it are free */
    uint64_t done[KVD_IO_RING_MAX_LAYERS];
    uint64_t failed[KVD_IO_RING_MAX_LAYERS];
    uint64_t pad[3];     /* the slots start on a 64-byte line */
    kvd_io_desc slots[]; /* capacity of them */
} kvd_io_ring;

#if defined(__cplusplus)
static_assert(sizeof(kvd_io_desc) == 64, "a descriptor is one 64-byte line");
static_assert(sizeof(kvd_io_ring) % 64 == 0, "the slots start on a 64-byte line");
#else
_Static_assert(sizeof(kvd_io_desc) == 64, "a descriptor is one 64-byte line");
_Static_assert(sizeof(kvd_io_ring) % 64 == 0, "the slots start on a 64-byte line");
#endif

/* Bytes of a ring of `capacity` slots (the header is a whole number of descriptors). */
KVD_RING_FN uint64_t kvd_io_ring_bytes(uint64_t capacity) {
    return (uint64_t)sizeof(kvd_io_ring) + capacity * (uint64_t)sizeof(kvd_io_desc);
}

/* Producer: take a ticket (the caller then fills and publishes its slot). */
KVD_RING_FN uint64_t kvd_io_ring_ticket(kvd_io_ring *ring) {
    return KVD_FETCH_ADD(&ring->reserved, 1);
}

/* Producer: whether the ticket's slot is free of the lap before. */
KVD_RING_FN int kvd_io_ring_slot_free(kvd_io_ring *ring, uint64_t ticket) {
    return ticket - KVD_LOAD_ACQUIRE(&ring->consumed) < ring->capacity;
}

/* Producer: write a descriptor into the ticket's (free) slot and publish it. */
KVD_RING_FN void kvd_io_ring_publish(kvd_io_ring *ring, uint64_t ticket, uint64_t file, uint64_t offset,
                                     uint64_t length, uint64_t target, uint64_t layer, uint64_t tag,
                                     uint64_t checksum) {
    kvd_io_desc *slot = &ring->slots[ticket & (ring->capacity - 1)];
    slot->offset = offset;
    slot->length = length;
    slot->target = target;
    slot->file = file;
    slot->layer = layer;
    slot->tag = tag;
    slot->checksum = checksum;
    KVD_STORE_RELEASE(&slot->sequence, ticket + 1);
}

/* Proxy (the one consumer): copy out the next descriptor; 0 when none is published yet.
 * `capacity` is the consumer's own copy of ring->capacity, taken once when it
 * checked the ring: the header is writable by producers, and a consumer that
 * re-read it could be steered outside the ring. */
KVD_RING_FN int kvd_io_ring_take_from(kvd_io_ring *ring, uint64_t capacity, kvd_io_desc *out) {
    uint64_t ticket = ring->consumed;
    kvd_io_desc *slot = &ring->slots[ticket & (capacity - 1)];
    if (KVD_LOAD_ACQUIRE(&slot->sequence) != ticket + 1) return 0;
    *out = *slot;
    KVD_STORE_RELEASE(&ring->consumed, ticket + 1);
    return 1;
}

/* The same, trusting the header (a consumer in the producers' own process). */
KVD_RING_FN int kvd_io_ring_take(kvd_io_ring *ring, kvd_io_desc *out) {
    return kvd_io_ring_take_from(ring, ring->capacity, out);
}

/* Proxy: one read of `layer` is over (ok = 0: it failed, and its target holds nothing to trust). */
KVD_RING_FN void kvd_io_ring_complete(kvd_io_ring *ring, uint64_t layer, int ok) {
    if (!ok) KVD_FETCH_ADD(&ring->failed[layer], 1);
    KVD_FETCH_ADD(&ring->done[layer], 1);
}

/* Waiter: reads of `layer` completed so far (failed ones included; see failed[layer]). */
KVD_RING_FN uint64_t kvd_io_ring_done(kvd_io_ring *ring, uint64_t layer) {
    return KVD_LOAD_ACQUIRE(&ring->done[layer]);
}

#endif
