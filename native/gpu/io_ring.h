/* The GPU-initiated I/O ring: one submission ring in host-mapped memory that
 * a GPU kernel (nvcc) fills with read descriptors and a CPU proxy thread
 * (gcc) drains into the I/O engine, with completions counted per layer.
 *
 * After Tutti (DESIGN.md): the GPU asks for a layer's blocks itself, so a
 * long restore costs the CPU O(layers) work to start, not O(blocks).
 *
 * Protocol (many producers, one consumer; every field 64-bit aligned):
 * - A producer reserves tickets only for slots that are free of the lap
 *   before: a compare-and-swap moves `reserved` from r to r + n while
 *   r + n - consumed <= capacity. Reserving never leaves a hole: a producer
 *   that gives up at its deadline has taken nothing, and counts its reads
 *   in abandoned[layer] instead (a waiter takes them as failed).
 * - It writes each descriptor, and publishes it last:
 *   slot.sequence = ticket + 1 (release).
 * - The proxy reads slot `consumed % capacity`, takes it once its sequence
 *   is consumed + 1 (acquire), copies the descriptor out, and frees the slot
 *   (consumed + 1, release). Wrap-around is the sequence check: a slot's
 *   sequence names the ticket it holds, never an older lap's.
 * - When a read is done (its crc32c checked, and copied to its target), the
 *   proxy adds one to done[layer] (release); on failure it first adds one
 *   to failed[layer]. A waiter loads done before failed (acquire), so every
 *   failed read it counts as done it also sees as failed.
 *
 * Who writes what: producers write `reserved`, the slots, abandoned[] and
 * the wait records; the proxy writes `consumed`, done[] and failed[]. No
 * word takes read-modify-writes from both sides: a GPU's atomics on mapped
 * host memory are atomic among the GPU's own threads, not against the CPU.
 *
 * Waiting (kvd_io_ring_wait, the same code on the GPU and on the host): a
 * wait for `until` completions of a layer ends OK when they are all done
 * and none failed past `failed_before`, FAILED as soon as one did (the
 * engine may then recompute the layer instead), TIMEOUT when its deadline
 * passes first, INVALID for a layer the ring has no counter for. It writes
 * the outcome into a kvd_io_wait record (state last, release), so a host
 * that reads the record learns it without synchronizing the stream. A wait
 * that ended early leaves reads of its layer in flight: their targets must
 * not be reused until the layer has settled (done reaches `until`, or the
 * proxy is stopped).
 *
 * Clocks: the GPU uses %globaltimer, a nanosecond clock shared by every SM,
 * not clock64, which counts one SM's cycles at a frequency that changes with
 * the GPU's clocks and so is no deadline in nanoseconds. The host uses
 * CLOCK_MONOTONIC.
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
#if !defined(__CUDA_ARCH__)
#include <time.h>
#endif

#define KVD_IO_RING_VERSION 3u
#define KVD_IO_RING_MAX_LAYERS 256u
#define KVD_IO_RING_WAITS 512u /* wait records in the ring: two steps of waits on every layer */

/* States of a wait record (kvd_io_wait.state). */
#define KVD_IO_WAIT_PENDING 0u /* armed by its owner, not yet ended */
#define KVD_IO_WAIT_OK 1u      /* `until` reads of the layer done, none failed past `failed_before` */
#define KVD_IO_WAIT_FAILED 2u  /* a read of the layer failed (or was abandoned by its producer) */
#define KVD_IO_WAIT_TIMEOUT 3u /* the deadline passed first */
#define KVD_IO_WAIT_INVALID 4u /* the layer has no counter in this ring */

#if defined(__CUDACC__)
#include <cuda/atomic>
#define KVD_RING_FN __host__ __device__ static inline
#define KVD_ATOMIC(p) (cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*(p)))
#define KVD_LOAD_ACQUIRE(p) (KVD_ATOMIC(p).load(cuda::memory_order_acquire))
#define KVD_STORE_RELEASE(p, v) (KVD_ATOMIC(p).store((v), cuda::memory_order_release))
#define KVD_FETCH_ADD(p, v) (KVD_ATOMIC(p).fetch_add((v), cuda::memory_order_acq_rel))
#define KVD_CAS(p, expected, v) \
    (KVD_ATOMIC(p).compare_exchange_weak(*(expected), (v), cuda::memory_order_acq_rel, cuda::memory_order_acquire))
#else
#define KVD_RING_FN static inline
#define KVD_LOAD_ACQUIRE(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define KVD_STORE_RELEASE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define KVD_FETCH_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL)
#define KVD_CAS(p, expected, v) __atomic_compare_exchange_n((p), (expected), (v), 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
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

/* How one wait ended; one 64-byte line each, so a host polling one record
 * does not share a line with a GPU writing another. */
typedef struct kvd_io_wait {
    uint64_t state;     /* KVD_IO_WAIT_*, written last (release) */
    uint64_t layer;
    uint64_t until;     /* completions it waited for */
    uint64_t done;      /* completions it saw last (abandoned reads included) */
    uint64_t failed;    /* failures it saw last (abandoned reads included) */
    uint64_t waited_ns; /* from its start to its end */
    uint64_t pad[2];
} kvd_io_wait;

/*   0  version capacity layers reserved consumed    (5 words)
 *  40  done[256]          written by the proxy
 *      failed[256]        written by the proxy
 *      abandoned[256]     written by producers that gave up before publishing
 *      pad[3]             the wait records start on a 64-byte line
 *      waits[512]         64 bytes each, written by waiters
 *      slots[capacity]    64 bytes each */
typedef struct kvd_io_ring {
    uint64_t version;
    uint64_t capacity; /* a power of two */
    uint64_t layers;
    uint64_t reserved; /* next ticket to hand out */
    uint64_t consumed; /* next ticket the proxy takes; slots below it are free */
    uint64_t done[KVD_IO_RING_MAX_LAYERS];
    uint64_t failed[KVD_IO_RING_MAX_LAYERS];
    uint64_t abandoned[KVD_IO_RING_MAX_LAYERS];
    uint64_t pad[3];
    kvd_io_wait waits[KVD_IO_RING_WAITS];
    kvd_io_desc slots[]; /* capacity of them */
} kvd_io_ring;

#if defined(__cplusplus)
#define KVD_STATIC_ASSERT static_assert
#else
#define KVD_STATIC_ASSERT _Static_assert
#endif
KVD_STATIC_ASSERT(sizeof(kvd_io_desc) == 64, "a descriptor is one 64-byte line");
KVD_STATIC_ASSERT(sizeof(kvd_io_wait) == 64, "a wait record is one 64-byte line");
KVD_STATIC_ASSERT(__builtin_offsetof(kvd_io_ring, waits) % 64 == 0, "the wait records start on a 64-byte line");
KVD_STATIC_ASSERT(sizeof(kvd_io_ring) % 64 == 0, "the slots start on a 64-byte line");

/* Bytes of a ring of `capacity` slots (the header is a whole number of descriptors). */
KVD_RING_FN uint64_t kvd_io_ring_bytes(uint64_t capacity) {
    return (uint64_t)sizeof(kvd_io_ring) + capacity * (uint64_t)sizeof(kvd_io_desc);
}

/* Nanoseconds on a clock every waiter of one side shares (see "Clocks" above). */
KVD_RING_FN uint64_t kvd_io_ring_now_ns(void) {
#if defined(__CUDA_ARCH__)
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
#else
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
#endif
}

/* `timeout_ns` from now, saturating (UINT64_MAX: no deadline in practice). */
KVD_RING_FN uint64_t kvd_io_ring_deadline(uint64_t timeout_ns) {
    uint64_t now = kvd_io_ring_now_ns();
    return timeout_ns > UINT64_MAX - now ? UINT64_MAX : now + timeout_ns;
}

/* A short pause between looks at shared memory: the GPU's thread yields its
 * issue slots; a host thread (a stand-in for the GPU) leaves the CPU to the
 * proxy it waits for. */
KVD_RING_FN void kvd_io_ring_pause(void) {
#if defined(__CUDA_ARCH__)
    __nanosleep(1000);
#else
    struct timespec pause = {0, 50000};
    nanosleep(&pause, NULL);
#endif
}

/* Producer: reserves `count` (1..capacity) consecutive tickets whose slots are
 * free; 1 with the first in *ticket, or 0 when `deadline_ns` passed first, and
 * then nothing was taken. */
KVD_RING_FN int kvd_io_ring_reserve(kvd_io_ring *ring, uint64_t count, uint64_t deadline_ns, uint64_t *ticket) {
    for (;;) {
        /* consumed first: both only grow, so first >= consumed, and the difference is what is in use. */
        uint64_t consumed = KVD_LOAD_ACQUIRE(&ring->consumed);
        uint64_t first = KVD_LOAD_ACQUIRE(&ring->reserved);
        if (first + count - consumed <= ring->capacity) {
            if (KVD_CAS(&ring->reserved, &first, first + count)) {
                *ticket = first;
                return 1;
            }
            continue; /* another producer took tickets meanwhile: look again */
        }
        if (kvd_io_ring_now_ns() >= deadline_ns) return 0;
        kvd_io_ring_pause();
    }
}

/* Producer: `count` reads of `layer` that it gave up on before publishing them. */
KVD_RING_FN void kvd_io_ring_abandon(kvd_io_ring *ring, uint64_t layer, uint64_t count) {
    if (layer < KVD_IO_RING_MAX_LAYERS) KVD_FETCH_ADD(&ring->abandoned[layer], count);
}

/* Producer: write a descriptor into the ticket's (reserved) slot and publish it. */
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

/* Waiter: reads of `layer` the proxy completed so far (failed ones included; see failed[layer]). */
KVD_RING_FN uint64_t kvd_io_ring_done(kvd_io_ring *ring, uint64_t layer) {
    return KVD_LOAD_ACQUIRE(&ring->done[layer]);
}

/* Waiter: one look at `layer` (below KVD_IO_RING_MAX_LAYERS): OK, FAILED, or
 * PENDING while it should look again; *done and *failed count abandoned reads
 * too. done is loaded before failed: see the protocol above. */
KVD_RING_FN uint64_t kvd_io_ring_look(kvd_io_ring *ring, uint64_t layer, uint64_t until, uint64_t failed_before,
                                      uint64_t *done, uint64_t *failed) {
    uint64_t abandoned = KVD_LOAD_ACQUIRE(&ring->abandoned[layer]);
    *done = KVD_LOAD_ACQUIRE(&ring->done[layer]) + abandoned;
    *failed = KVD_LOAD_ACQUIRE(&ring->failed[layer]) + abandoned;
    if (*failed > failed_before) return KVD_IO_WAIT_FAILED;
    return *done >= until ? KVD_IO_WAIT_OK : KVD_IO_WAIT_PENDING;
}

/* Waiter: waits until `until` reads of `layer` are done, one of them fails
 * (past `failed_before` failures the caller already knew of), or `timeout_ns`
 * passes (0: one look); writes how it ended into `record` (state last) and
 * returns that state. Used by the wait kernel and, on the host, by the CPU
 * stand-ins for the GPU and kvd._native.io_ring_wait. */
KVD_RING_FN uint64_t kvd_io_ring_wait(kvd_io_ring *ring, uint64_t layer, uint64_t until, uint64_t failed_before,
                                      uint64_t timeout_ns, kvd_io_wait *record) {
    uint64_t start = kvd_io_ring_now_ns();
    uint64_t deadline = kvd_io_ring_deadline(timeout_ns);
    uint64_t state = KVD_IO_WAIT_INVALID, done = 0, failed = 0;
    if (layer < KVD_IO_RING_MAX_LAYERS && layer < KVD_LOAD_ACQUIRE(&ring->layers)) {
        while ((state = kvd_io_ring_look(ring, layer, until, failed_before, &done, &failed)) == KVD_IO_WAIT_PENDING) {
            if (kvd_io_ring_now_ns() >= deadline) {
                state = KVD_IO_WAIT_TIMEOUT;
                break;
            }
            kvd_io_ring_pause();
        }
    }
    record->layer = layer;
    record->until = until;
    record->done = done;
    record->failed = failed;
    record->waited_ns = kvd_io_ring_now_ns() - start;
    KVD_STORE_RELEASE(&record->state, state);
    return state;
}

#endif
