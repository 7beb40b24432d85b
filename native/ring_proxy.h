/*
 * ring_proxy: the CPU end of the GPU-initiated I/O ring (gpu/io_ring.h).
 *
 * One thread drains the ring's read descriptors into an io_uring of its own
 * (uring_batch), reads each into a slice of staging memory (pinned, so the
 * copy to a GPU is a DMA; the caller opens the files, with O_DIRECT), checks
 * its crc32c against the descriptor's, copies it to its target, and only
 * then counts it done in its layer (done[layer] + 1, failed[layer] + 1 too
 * when any step failed: the target then holds nothing to trust).
 *
 *   ring ──take──> batch A ──io_uring──> staging half A ──crc, copy──> targets
 *                  batch B ──io_uring──> staging half B ──crc, copy──> targets
 *
 * Two batches alternate over the two halves of staging: while one batch's
 * reads are in the kernel, the other is checked, copied and completed, so
 * the drive keeps working while the CPU verifies and copies.
 *
 * The copy goes through a hook: memcpy when targets are host memory (the
 * CPU device), called per read right after its check while its bytes are
 * still in cache; the CUDA driver's host-to-device copies on one stream
 * when they are device memory (cuda_copy.c), called once per batch with
 * all of its verified reads and one synchronize.
 *
 * The ring's memory is shared with its producers, so nothing in it is
 * trusted: the proxy keeps its own copy of the ring's capacity and layer
 * count, and a read lands only inside the target regions it was started
 * with (an engine's registered pool), never at an arbitrary address of the
 * proxy's process. A descriptor that cannot be read (unknown file, a target
 * outside those regions, a length of 0 or more than half of staging) fails
 * without I/O.
 *
 * Grants: the proxy reads only what its owner (the daemon) granted. Grant
 * `tag` of the proxy's own table names one read (file, offset, length,
 * target, layer, checksum); a descriptor is read only when its tag names an
 * armed grant with exactly its fields, and taking it disarms the grant (one
 * read per grant). Anything else fails without I/O, and leaves the grant
 * armed: a producer that forges a descriptor reads nothing of another
 * tenant's and burns nobody's grant. A grant's stamp (nonzero, never reused
 * by its owner) is how arming, taking and revoking stay exact when they
 * race: each moves the stamp with a compare-and-swap. When the read it was
 * taken for is over, the grant's outcome says so (stamp << 1 | ok).
 *
 * Split pages: where an engine keeps a page's K half and V half apart, a
 * read of a whole layer goes out as two copies, its first `split_at` bytes
 * to the target and the rest `split_to` bytes after it; both must lie in
 * the target regions. One whose layer has no counter cannot be completed at all: it
 * is dropped and counted in stats.dropped. A stopping proxy takes no new descriptors, finishes the
 * reads it holds and fails the one it had taken but not yet placed.
 *
 * Idle: with nothing published the thread sleeps, backing off from 1 us to
 * KVD_PROXY_IDLE_MAX_US, and starts over at the next descriptor it takes.
 */
#ifndef KVD_RING_PROXY_H
#define KVD_RING_PROXY_H

#include <pthread.h>
#include <stdint.h>

#include "gpu/io_ring.h"
#include "uring_batch.h"

#define KVD_PROXY_ALIGN 4096u
#define KVD_PROXY_IDLE_MAX_US 200u
#define KVD_PROXY_MAX_BATCH 4096u

/* One verified read to put at its target. */
struct kvd_copy {
    uint64_t target;
    const void *source;
    uint64_t length;
};

/* Copies every entry; 0, or -errno when any copy failed (all count as failed). */
typedef int (*kvd_copy_fn)(void *context, const struct kvd_copy *copies, uint32_t count);

/* The copy hook for targets in this process's host memory. */
int kvd_copy_host(void *context, const struct kvd_copy *copies, uint32_t count);

/* The copy hook for targets in another process's memory (a CPU engine's own tensors): `context`
 * is a descriptor of its /proc/<pid>/mem opened for writing (cast to a pointer), targets are
 * addresses in that process. */
int kvd_copy_process(void *context, const struct kvd_copy *copies, uint32_t count);

/* One read the owner granted (see "Grants" above). */
struct kvd_grant {
    uint64_t stamp;    /* the arm's own number while armed; 0: free, taken or revoked */
    uint64_t file, offset, length, target, layer, checksum;
    uint64_t outcome;  /* stamp << 1 | ok, once the read it was taken for is over; 0 before */
};

struct kvd_proxy_config {
    kvd_io_ring *ring;          /* initialised: version, capacity (a power of two), layers */
    uint64_t ring_bytes;        /* of the memory holding it */
    const int32_t *fds;         /* registered as files 0 .. file_count - 1 */
    uint32_t file_count;
    void *staging;              /* KVD_PROXY_ALIGN-aligned */
    uint64_t staging_bytes;     /* a multiple of 2 * KVD_PROXY_ALIGN */
    uint32_t batch_entries;     /* most reads per batch, <= KVD_MAX_BATCH */
    uint32_t queue_depth;
    kvd_copy_fn copy;
    void *copy_context;
    const struct kvd_region *targets;  /* where reads may land: sorted by address, disjoint */
    uint32_t target_count;             /* >= 1 */
    int copy_each;              /* call `copy` per read, right after its check (host memory: the
                                   bytes are still in cache); 0: once per batch (a device's DMA) */
    uint32_t grant_count;       /* the grant table's size, 1..KVD_PROXY_MAX_GRANTS */
    uint64_t split_at;          /* 0: a read is one copy; else see "Split pages" above */
    uint64_t split_to;
};

#define KVD_PROXY_MAX_GRANTS (1u << 22)

struct kvd_proxy_stats {
    uint64_t reads;              /* descriptors completed, failed ones included */
    uint64_t failed;             /* ... of which failed */
    uint64_t bytes;              /* bytes delivered to targets */
    uint64_t checksum_mismatches;/* read in full, but not the bytes the descriptor named */
    uint64_t rejected;           /* failed without I/O (bad file, length or target) */
    uint64_t ungranted;          /* ... of which no armed grant matched */
    uint64_t dropped;            /* layer out of range: not completed at all */
    uint64_t batches;
    uint64_t copy_calls;
    uint64_t copy_errors;
    uint64_t idle_sleeps;
};

struct kvd_proxy_batch {
    kvd_io_desc *descs;
    int64_t *results;
    uint64_t *staging_offsets;
    uint32_t count;
    int in_flight;
    uint64_t id;
};

struct kvd_proxy {
    struct kvd_proxy_config config;
    uint64_t capacity;           /* the ring's, as checked at start */
    uint64_t layers;
    struct kvd_region *targets;  /* the proxy's own copy of config.targets */
    struct kvd_ring uring;
    pthread_t thread;
    int stop;                    /* set by kvd_proxy_stop (atomic) */
    struct kvd_proxy_batch batches[2];
    struct kvd_copy *copies;     /* 2 * batch_entries of them (a split read takes two) */
    uint32_t *copied;            /* the read each of `copies` is for */
    struct kvd_grant *grants;    /* config.grant_count of them, the proxy's own memory */
    kvd_io_desc carry;           /* taken, but did not fit the batch being filled */
    int carrying;
    struct kvd_proxy_stats stats;/* written by the thread; read with atomics */
};

/* Checks the ring header against the memory holding it: 0 (with the capacity
 * and layer count it checked) or -EINVAL. */
int kvd_proxy_check_ring(const kvd_io_ring *ring, uint64_t bytes, uint64_t *capacity, uint64_t *layers);

/* Opens the io_uring, registers files and staging, starts the thread. */
int kvd_proxy_start(struct kvd_proxy **out, const struct kvd_proxy_config *config);

/* Stops and joins the thread (see above), copies its last counters into
 * `final` (may be NULL), then frees everything. */
void kvd_proxy_stop(struct kvd_proxy *proxy, struct kvd_proxy_stats *final);

/* Arms grant `tag` for `desc`'s fields (its sequence ignored) under `stamp` (nonzero, unique):
 * 0, or -EINVAL (tag out of range, stamp 0) or -EBUSY (the grant is armed). The owner arms a
 * tag again only once its last grant was revoked or its outcome came. */
int kvd_proxy_grant(struct kvd_proxy *proxy, uint64_t tag, const kvd_io_desc *desc, uint64_t stamp);

/* Disarms grant `tag` if it is still armed under `stamp`: 1 when it was (it will never be read),
 * 0 when a descriptor took it first (its outcome follows), -EINVAL for a tag out of range. */
int kvd_proxy_revoke(struct kvd_proxy *proxy, uint64_t tag, uint64_t stamp);

/* Grant `tag`'s outcome word (0 until a read taken under it is over). */
uint64_t kvd_proxy_outcome(struct kvd_proxy *proxy, uint64_t tag);

/* A consistent-enough snapshot: every counter read atomically. */
void kvd_proxy_read_stats(struct kvd_proxy *proxy, struct kvd_proxy_stats *out);

#endif
