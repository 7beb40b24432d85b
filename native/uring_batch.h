/*
 * uring_batch: whole batches of file I/O through one io_uring.
 *
 * A batch is an array of entries (file index, offset, length, address)
 * that all do the same operation. The caller hands a batch over once
 * (kvd_ring_submit) and later waits for it (kvd_ring_wait); several
 * batches may be in flight and may be waited in any order.
 *
 *   submit(b0) submit(b1)           pending FIFO: b0 -> b1
 *        |                          at most queue_depth entries are in
 *        v                          the kernel; the rest wait their turn
 *   +--------- io_uring (SQ/CQ) ---------+
 *        |                          user_data = slot << 32 | entry index
 *        v
 *   results[i] = bytes done or -errno, written when the CQE is reaped
 *
 * Entries are prepared in FIFO order whenever the engine is called
 * (submit, wait, fsync, close). Reaping in wait() completes entries of
 * any batch, so waiting for b1 before b0 is fine. A batch is in the FIFO
 * once, while it has entries not yet prepared; one whose wait meets a
 * failed enter leaves it at once, wherever it stands (see drive()).
 *
 * Nothing here retries: a short transfer is reported as the byte count
 * the kernel returned, an error as -errno. The caller decides.
 *
 * Files are always registered (IOSQE_FIXED_FILE): file_index is the
 * position in the array given to kvd_ring_register_files. Buffers may be
 * registered; an entry whose bytes lie inside one registered region uses
 * READ_FIXED/WRITE_FIXED (the kernel skips pinning its pages per I/O),
 * any other entry a plain READ/WRITE.
 *
 * Checksums: a read batch may ask for the crc32c of what it read, per
 * `chunk` bytes of each entry (a layer of a block, say). They are computed
 * in wait(), as completions are reaped and after the freed queue entries
 * have been refilled and handed to the kernel, so the drive keeps working
 * while the CPU checksums. Only entries read in full get checksums; the
 * others keep whatever their cells held (their result says why).
 *
 * Fault injection (for tests): rules checked at submit time, in entry
 * order, make matching entries complete with -errno without doing I/O,
 * or transfer fewer bytes than asked. The results still come back through
 * the same completion path as real ones. kvd_ring_fail_enters makes
 * io_uring_enter itself fail, to test what a failed enter leaves behind.
 *
 * Not thread safe: one caller at a time (the Python binding enforces it).
 * All functions return 0 (or a count) on success and -errno on failure.
 */
#ifndef KVD_URING_BATCH_H
#define KVD_URING_BATCH_H

#include <stdint.h>

#include <liburing.h>

enum kvd_op {
    KVD_OP_READ = 0,
    KVD_OP_WRITE = 1,
    KVD_OP_FSYNC = 2,
};

/* Limits: each bounds a table or an allocation made by this file. */
#define KVD_MAX_QUEUE_DEPTH 4096u
#define KVD_MAX_BATCHES 4096u
#define KVD_MAX_BATCH_ENTRIES (1u << 24)
#define KVD_MAX_FAULTS 16u
#define KVD_MAX_FILES 65536u
#define KVD_MAX_BUFFERS 1024u
/* Failed io_uring_enter calls in a row before the process stops (see
 * drive() in uring_batch.c), and the longest back-off between them. */
#define KVD_MAX_ENTER_FAILURES 10000u
#define KVD_BACKOFF_MAX_US 10000u

struct kvd_entry {
    uint64_t address;
    int64_t offset;
    uint32_t length;          /* bytes asked for */
    int32_t file_index;
    /* Set by kvd_ring_submit, from the fault rules: */
    uint32_t transfer_length; /* bytes handed to the kernel (< length under a short fault) */
    int32_t fault_errno;      /* > 0: complete with -fault_errno, no I/O */
    uint64_t checksum_index;  /* its first cell in the batch's checksums */
};

/* Where a read batch's checksums go: entry i, read in full, fills
 * values[k .. k + length_i / chunk) with k = sum of length_j / chunk, j < i. */
struct kvd_checksums {
    uint32_t *values;
    uint64_t capacity;        /* cells at values; must hold every entry's */
    uint32_t chunk;           /* > 0; every entry's length is a multiple */
};

struct kvd_fault {
    int32_t op;               /* enum kvd_op */
    int32_t file_index;       /* -1: any file */
    int64_t offset_begin;     /* matches offset_begin <= offset < offset_end */
    int64_t offset_end;
    int32_t error;            /* errno to report, or 0 for a short transfer */
    int64_t short_bytes;      /* with error == 0: transfer at most this many bytes */
    uint32_t remaining;       /* entries still to hit; 0: rule spent */
};

struct kvd_stats {
    uint64_t entries;              /* read/write entries submitted */
    uint64_t batches;              /* read/write batches submitted */
    uint64_t fsyncs;
    uint64_t enter_calls;          /* io_uring_enter system calls */
    uint64_t submit_calls;         /* ... of which handed over new entries */
    uint64_t bytes_read;
    uint64_t bytes_written;
    uint64_t errors;               /* entries completed with -errno */
    uint64_t short_transfers;      /* entries completed with 0 <= result < length */
    uint64_t faults_injected;
    uint64_t fixed_buffer_entries; /* entries that used a registered buffer */
    uint64_t checksum_chunks;      /* crc32c values computed for reads */
    uint64_t enter_errors;         /* io_uring_enter calls that failed (then retried after a back-off) */
};

struct kvd_batch {
    uint64_t id;              /* 0: the slot is free */
    struct kvd_entry *entries;/* owned by the ring while the slot is used */
    int64_t *results;         /* owned by the caller; kept valid until waited */
    uint32_t count;
    uint32_t next;            /* first entry not yet prepared */
    uint32_t completed;
    uint32_t queued;          /* 1 while the slot is in the pending FIFO */
    int32_t op;
    uint32_t fsync_flags;
    int64_t own_result;       /* results of an fsync batch */
    struct kvd_checksums checksums; /* values == NULL: none asked for */
};

struct kvd_region {
    uint64_t address;
    uint64_t length;
};

struct kvd_ring {
    struct io_uring uring;
    int open;
    uint32_t queue_depth;
    uint32_t in_kernel;       /* SQEs prepared and not yet reaped; <= queue_depth */
    uint32_t max_batches;
    uint32_t active_batches;
    struct kvd_batch *batches;        /* max_batches slots */
    uint32_t *pending;                /* FIFO of slots with unprepared entries (uring_batch.c) */
    uint32_t pending_head;
    uint32_t pending_count;
    uint64_t next_id;
    uint32_t file_count;
    struct kvd_region *regions;       /* sorted by address, disjoint */
    uint32_t region_count;
    uint64_t *to_checksum;            /* reaped entries (slot << 32 | index) awaiting */
    uint32_t to_checksum_count;       /* their checksums; <= queue_depth */
    struct kvd_fault faults[KVD_MAX_FAULTS];
    uint32_t fault_count;
    uint32_t enter_faults;            /* io_uring_enter calls still to fail (tests) */
    int32_t enter_fault_errno;
    struct kvd_stats stats;
};

/* flags: 0, or KVD_SETUP_SINGLE_ISSUER (IORING_SETUP_SINGLE_ISSUER |
 * DEFER_TASKRUN, Linux 6.1+): only the thread that opened the ring may
 * use it from then on. */
#define KVD_SETUP_SINGLE_ISSUER 1u
int kvd_ring_open(struct kvd_ring *ring, uint32_t queue_depth, uint32_t max_batches, uint32_t flags);

/* Drains: entries not yet in the kernel complete with -ECANCELED, entries
 * in the kernel are waited for (their buffers must not be reused while the
 * kernel may still write them). Idempotent. */
void kvd_ring_close(struct kvd_ring *ring);

/* Replaces the file table (count 0 clears it). -EBUSY with batches in flight. */
int kvd_ring_register_files(struct kvd_ring *ring, const int32_t *fds, uint32_t count);

/* Replaces the buffer table (count 0 clears it). -EINVAL when regions
 * overlap, -EBUSY with batches in flight. */
int kvd_ring_register_buffers(struct kvd_ring *ring, const struct kvd_region *regions, uint32_t count);

int kvd_ring_add_fault(struct kvd_ring *ring, const struct kvd_fault *fault);
void kvd_ring_clear_faults(struct kvd_ring *ring);

/* A read or write batch. Takes ownership of `entries` (malloc'd, `count`
 * long) on success only.
 * `results` must stay valid until the batch is waited or the ring closed,
 * and so must checksums->values when `checksums` is given (reads only;
 * NULL: none). -EINVAL when a length is not a multiple of the chunk or the
 * cells are too few.
 * On success *id_out names the batch and *slot_out is its slot. */
int kvd_ring_submit(struct kvd_ring *ring, int32_t op, struct kvd_entry *entries, int64_t *results,
                    uint32_t count, const struct kvd_checksums *checksums, uint64_t *id_out,
                    uint32_t *slot_out);

/* Slot of a batch in flight, or -ENOENT. */
int kvd_ring_slot_of(const struct kvd_ring *ring, uint64_t id);

/* Blocks until every entry of batch `id` has its result; frees its slot.
 * Always completes a batch in flight (-ENOENT only for an unknown id): a
 * failed io_uring_enter is retried after a back-off, and the entries the
 * kernel was not given fail with its errno (see drive() in uring_batch.c). */
int kvd_ring_wait(struct kvd_ring *ring, uint64_t id);

/* fsync (datasync: fdatasync) of one registered file. It is drained
 * (IOSQE_IO_DRAIN): it starts after every entry submitted before it has
 * completed, so it covers all writes submitted so far. Blocks until done;
 * *result is 0 or -errno. */
int kvd_ring_fsync(struct kvd_ring *ring, int32_t file_index, int datasync, int64_t *result);

/* Tests: the ids of the batches in the pending FIFO (entries not yet handed
 * to the kernel), head first; at most `capacity` are written. Returns how
 * many batches the FIFO holds. */
uint32_t kvd_ring_pending(const struct kvd_ring *ring, uint64_t *ids, uint32_t capacity);

/* Tests: the next `count` io_uring_enter calls of wait and fsync fail with
 * -error instead of entering the kernel (close never fails this way). */
void kvd_ring_fail_enters(struct kvd_ring *ring, int32_t error, uint32_t count);

#endif
