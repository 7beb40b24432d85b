/*
 * uring_batch.c: the ring, submission of a batch, reaping. See the header
 * for the model; this file keeps two invariants:
 *
 *   in_kernel <= queue_depth       so the SQ never runs out of SQEs and the
 *                                  CQ (2 x SQ entries) can never overflow;
 *   a slot's id != 0 exactly while its batch is in flight, and its
 *   entries/results stay valid until then;
 *   the pending FIFO holds a slot at most once (batch->queued), exactly
 *   while its batch is in flight and has entries not yet prepared: fill()
 *   takes it out when its last entry is prepared, fail_unprepared() when
 *   a failed enter fails the rest, wherever it stands. So a slot is never
 *   freed, nor reused, from the FIFO, and entries reach the kernel in
 *   submission order: an fsync's IO_DRAIN entry is prepared only once
 *   every entry submitted before it is in the kernel or has failed.
 */
#include "uring_batch.h"

#include "checksum.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>

/* Stays on in release builds: a broken invariant here means completions
 * could be written into the wrong caller's memory, so stop at once. */
#define KVD_CHECK(condition)                                                              \
    do {                                                                                  \
        if (!(condition)) kvd_check_failed(#condition, __FILE__, __LINE__);              \
    } while (0)

static void kvd_check_failed(const char *condition, const char *file, int line) {
    fprintf(stderr, "kvd uring_batch: invariant violated: %s (%s:%d)\n", condition, file, line);
    abort();
}

/* io_uring_enter results that mean "call again later", not "the ring is broken". */
static int transient(int error) {
    return error == -EINTR || error == -EAGAIN || error == -EBUSY || error == -ENOMEM;
}

/* One io_uring_enter: submit what is prepared, wait for `wanted`
 * completions. An injected enter failure (tests) returns its errno
 * instead, without entering the kernel. */
static int enter(struct kvd_ring *ring, uint32_t wanted) {
    ring->stats.enter_calls++;
    if (ring->enter_faults > 0) {
        ring->enter_faults--;
        ring->stats.faults_injected++;
        return -ring->enter_fault_errno;
    }
    if (io_uring_sq_ready(&ring->uring) > 0) ring->stats.submit_calls++;
    return io_uring_submit_and_wait(&ring->uring, wanted);
}

/* Sleeps before entering the kernel again after a failed enter: 1 us,
 * doubled each time up to KVD_BACKOFF_MAX_US, so a kernel that says "not
 * now" (EAGAIN, EBUSY) is not spun on. */
static void back_off(uint32_t *delay_us) {
    struct timespec pause = {0, (long)*delay_us * 1000L};
    nanosleep(&pause, NULL);
    *delay_us = *delay_us * 2 > KVD_BACKOFF_MAX_US ? KVD_BACKOFF_MAX_US : *delay_us * 2;
}

int kvd_ring_open(struct kvd_ring *ring, uint32_t queue_depth, uint32_t max_batches, uint32_t flags) {
    memset(ring, 0, sizeof *ring);
    if (queue_depth == 0 || queue_depth > KVD_MAX_QUEUE_DEPTH) return -EINVAL;
    if (flags & ~KVD_SETUP_SINGLE_ISSUER) return -EINVAL;
    if (max_batches == 0 || max_batches > KVD_MAX_BATCHES) return -EINVAL;
    ring->batches = calloc(max_batches, sizeof *ring->batches);
    ring->pending = calloc(max_batches, sizeof *ring->pending);
    ring->to_checksum = calloc(queue_depth, sizeof *ring->to_checksum);
    int error = -ENOMEM;
    if (ring->batches != NULL && ring->pending != NULL && ring->to_checksum != NULL) {
        /* The ring is single-threaded by contract; SINGLE_ISSUER tells the
         * kernel so, and DEFER_TASKRUN runs completion work only when this
         * thread enters it to wait (drive() always does). */
        unsigned setup = (flags & KVD_SETUP_SINGLE_ISSUER) ? IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN : 0;
        error = io_uring_queue_init(queue_depth, &ring->uring, setup);
    }
    if (error < 0) {
        free(ring->batches);
        free(ring->pending);
        free(ring->to_checksum);
        ring->batches = NULL;
        ring->pending = NULL;
        ring->to_checksum = NULL;
        return error;
    }
    ring->open = 1;
    ring->queue_depth = queue_depth;
    ring->max_batches = max_batches;
    ring->next_id = 1;
    return 0;
}

/* ---- completion ------------------------------------------------------ */

/* The one place a result is recorded, for real and injected completions. */
static void complete_entry(struct kvd_ring *ring, struct kvd_batch *batch, uint32_t index, int64_t result) {
    KVD_CHECK(index < batch->count);
    KVD_CHECK(batch->completed < batch->count);
    batch->results[index] = result;
    batch->completed++;
    if (result < 0) {
        ring->stats.errors++;
        return;
    }
    if (batch->op == KVD_OP_READ) ring->stats.bytes_read += (uint64_t)result;
    if (batch->op == KVD_OP_WRITE) ring->stats.bytes_written += (uint64_t)result;
    if (batch->op != KVD_OP_FSYNC && (uint64_t)result < batch->entries[index].length) {
        ring->stats.short_transfers++;
    } else if (batch->checksums.values != NULL) {
        /* Read in full: checksummed by drive() once the queue is refilled.
         * Only reaped entries get here, at most in_kernel <= queue_depth
         * between two drive() passes. */
        KVD_CHECK(ring->to_checksum_count < ring->queue_depth);
        ring->to_checksum[ring->to_checksum_count++] = ((uint64_t)(batch - ring->batches) << 32) | index;
    }
}

/* Checksums of the entries read in full since the last call. */
static void checksum_completed(struct kvd_ring *ring) {
    for (uint32_t k = 0; k < ring->to_checksum_count; k++) {
        uint64_t item = ring->to_checksum[k];
        struct kvd_batch *batch = &ring->batches[item >> 32];
        KVD_CHECK(batch->id != 0 && batch->checksums.values != NULL);
        const struct kvd_entry *entry = &batch->entries[(uint32_t)item];
        uint32_t chunks = entry->length / batch->checksums.chunk;
        kvd_crc32c_chunks((const void *)(uintptr_t)entry->address, batch->checksums.chunk, chunks,
                          batch->checksums.values + entry->checksum_index);
        ring->stats.checksum_chunks += chunks;
    }
    ring->to_checksum_count = 0;
}

/* Consumes every CQE that is ready; never blocks. */
static void reap(struct kvd_ring *ring) {
    struct io_uring_cqe *cqe;
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring->uring, head, cqe) {
        uint64_t user_data = io_uring_cqe_get_data64(cqe);
        uint32_t slot = (uint32_t)(user_data >> 32);
        uint32_t index = (uint32_t)user_data;
        KVD_CHECK(slot < ring->max_batches);
        struct kvd_batch *batch = &ring->batches[slot];
        KVD_CHECK(batch->id != 0);
        complete_entry(ring, batch, index, cqe->res);
        seen++;
    }
    io_uring_cq_advance(&ring->uring, seen);
    KVD_CHECK(seen <= ring->in_kernel);
    ring->in_kernel -= seen;
}

/* ---- submission ------------------------------------------------------ */

/* Index of the registered region holding [address, address + length), or -1. */
static int find_region(const struct kvd_ring *ring, uint64_t address, uint64_t length) {
    uint32_t low = 0;
    uint32_t high = ring->region_count;
    while (low < high) { /* first region starting after `address` */
        uint32_t middle = low + (high - low) / 2;
        if (ring->regions[middle].address <= address) low = middle + 1;
        else high = middle;
    }
    if (low == 0) return -1;
    const struct kvd_region *region = &ring->regions[low - 1];
    uint64_t offset = address - region->address;
    if (offset > region->length || length > region->length - offset) return -1;
    return (int)(low - 1);
}

static void prepare(struct kvd_ring *ring, struct io_uring_sqe *sqe, uint32_t slot, uint32_t index) {
    struct kvd_batch *batch = &ring->batches[slot];
    struct kvd_entry *entry = &batch->entries[index];
    if (batch->op == KVD_OP_FSYNC) {
        io_uring_prep_fsync(sqe, entry->file_index, batch->fsync_flags);
        sqe->flags |= IOSQE_IO_DRAIN;
    } else {
        void *buffer = (void *)(uintptr_t)entry->address;
        /* Empty entries stay plain: they pin nothing, and a zero-length
         * fixed read at a region's very end is a corner not worth having. */
        int region = entry->transfer_length > 0 ? find_region(ring, entry->address, entry->transfer_length) : -1;
        int write = batch->op == KVD_OP_WRITE;
        if (region >= 0) {
            if (write) io_uring_prep_write_fixed(sqe, entry->file_index, buffer, entry->transfer_length,
                                                 (uint64_t)entry->offset, region);
            else io_uring_prep_read_fixed(sqe, entry->file_index, buffer, entry->transfer_length,
                                          (uint64_t)entry->offset, region);
            ring->stats.fixed_buffer_entries++;
        } else {
            if (write) io_uring_prep_write(sqe, entry->file_index, buffer, entry->transfer_length,
                                           (uint64_t)entry->offset);
            else io_uring_prep_read(sqe, entry->file_index, buffer, entry->transfer_length,
                                    (uint64_t)entry->offset);
        }
    }
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, ((uint64_t)slot << 32) | index);
}

/* ---- the pending FIFO (see the invariants at the top) ----------------- */

static uint32_t *pending_cell(const struct kvd_ring *ring, uint32_t position) {
    return &ring->pending[(ring->pending_head + position) % ring->max_batches];
}

/* Appends a batch just started, with entries to prepare. */
static void pending_push(struct kvd_ring *ring, uint32_t slot) {
    struct kvd_batch *batch = &ring->batches[slot];
    KVD_CHECK(batch->id != 0 && !batch->queued && batch->next < batch->count);
    KVD_CHECK(ring->pending_count < ring->active_batches); /* every other queued slot is in flight too */
    *pending_cell(ring, ring->pending_count) = slot;
    ring->pending_count++;
    batch->queued = 1;
}

/* Takes the slot at `position` out of the FIFO; the others keep their order. */
static void pending_take(struct kvd_ring *ring, uint32_t position) {
    KVD_CHECK(position < ring->pending_count);
    struct kvd_batch *batch = &ring->batches[*pending_cell(ring, position)];
    KVD_CHECK(batch->id != 0 && batch->queued);
    for (; position > 0; position--) *pending_cell(ring, position) = *pending_cell(ring, position - 1);
    batch->queued = 0;
    ring->pending_head = (ring->pending_head + 1) % ring->max_batches;
    ring->pending_count--;
}

/* Takes a batch out of the FIFO wherever it stands (its entries failed). */
static void pending_remove(struct kvd_ring *ring, uint32_t slot) {
    uint32_t position = 0;
    while (position < ring->pending_count && *pending_cell(ring, position) != slot) position++;
    pending_take(ring, position); /* checks that it was there */
}

/* Prepares SQEs from the pending FIFO until the queue depth is reached.
 * Entries with an injected error complete here, without an SQE. */
static void fill(struct kvd_ring *ring) {
    while (ring->pending_count > 0) {
        uint32_t slot = ring->pending[ring->pending_head];
        struct kvd_batch *batch = &ring->batches[slot];
        KVD_CHECK(batch->id != 0 && batch->queued && batch->next < batch->count);
        while (batch->next < batch->count) {
            uint32_t index = batch->next;
            struct kvd_entry *entry = &batch->entries[index];
            if (entry->fault_errno > 0) {
                batch->next++;
                complete_entry(ring, batch, index, -(int64_t)entry->fault_errno);
                continue;
            }
            if (ring->in_kernel == ring->queue_depth) return;
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring->uring);
            KVD_CHECK(sqe != NULL); /* in_kernel < queue_depth <= SQ entries */
            prepare(ring, sqe, slot, index);
            batch->next++;
            ring->in_kernel++;
        }
        pending_take(ring, 0); /* all prepared: the next batch's turn */
    }
}

/* Hands prepared SQEs to the kernel without waiting. Failures are left
 * for the next wait, which enters the kernel again and reports them. */
static void flush(struct kvd_ring *ring) {
    if (io_uring_sq_ready(&ring->uring) == 0) return;
    ring->stats.enter_calls++;
    ring->stats.submit_calls++;
    (void)io_uring_submit(&ring->uring);
}

static int rule_matches(const struct kvd_fault *rule, int32_t op, const struct kvd_entry *entry) {
    return rule->remaining > 0 && rule->op == op &&
           (rule->file_index < 0 || rule->file_index == entry->file_index) &&
           entry->offset >= rule->offset_begin && entry->offset < rule->offset_end;
}

/* First matching rule wins; rules are consumed in entry order. */
static void apply_faults(struct kvd_ring *ring, int32_t op, struct kvd_entry *entries, uint32_t count) {
    if (ring->fault_count == 0) return;
    for (uint32_t i = 0; i < count; i++) {
        for (uint32_t r = 0; r < ring->fault_count; r++) {
            struct kvd_fault *rule = &ring->faults[r];
            if (!rule_matches(rule, op, &entries[i])) continue;
            rule->remaining--;
            ring->stats.faults_injected++;
            if (rule->error > 0) entries[i].fault_errno = rule->error;
            else if ((uint64_t)rule->short_bytes < entries[i].transfer_length)
                entries[i].transfer_length = (uint32_t)rule->short_bytes;
            break;
        }
    }
}

/* Starts a batch: fault rules, a slot, the pending FIFO, then as many
 * SQEs as the queue depth allows, handed over in one io_uring_enter. */
static int start_batch(struct kvd_ring *ring, int32_t op, uint32_t fsync_flags, struct kvd_entry *entries,
                       int64_t *results, uint32_t count, const struct kvd_checksums *checksums,
                       uint64_t *id_out, uint32_t *slot_out) {
    if (!ring->open) return -EBADF;
    if (count > KVD_MAX_BATCH_ENTRIES) return -E2BIG;
    if (count > 0 && entries == NULL) return -EINVAL;
    if (ring->active_batches == ring->max_batches) return -EAGAIN;
    for (uint32_t i = 0; i < count; i++) {
        if (entries[i].file_index < 0 || (uint32_t)entries[i].file_index >= ring->file_count) return -EBADF;
        if (entries[i].offset < 0) return -EINVAL;
#ifdef KVD_CHECK_ADDRESSES
        /* Debug builds: with buffers registered, every address from Python
         * must lie inside one of them (a stale or miscomputed offset is
         * refused here, not written over someone else's memory). */
        if (ring->region_count > 0 && entries[i].length > 0 &&
            find_region(ring, entries[i].address, entries[i].length) < 0) {
            return -EFAULT;
        }
#endif
    }
    if (checksums != NULL) {
        if (op != KVD_OP_READ || checksums->values == NULL || checksums->chunk == 0) return -EINVAL;
        uint64_t cells = 0;
        for (uint32_t i = 0; i < count; i++) {
            if (entries[i].length % checksums->chunk != 0) return -EINVAL;
            entries[i].checksum_index = cells;
            cells += entries[i].length / checksums->chunk;
        }
        if (cells > checksums->capacity) return -EINVAL;
    }
    uint32_t slot = 0;
    while (ring->batches[slot].id != 0) slot++; /* a free slot exists: active < max */
    KVD_CHECK(slot < ring->max_batches && !ring->batches[slot].queued);

    for (uint32_t i = 0; i < count; i++) {
        entries[i].transfer_length = entries[i].length;
        entries[i].fault_errno = 0;
    }
    apply_faults(ring, op, entries, count);

    struct kvd_batch *batch = &ring->batches[slot];
    memset(batch, 0, sizeof *batch);
    batch->id = ring->next_id++;
    batch->entries = entries;
    /* The slot's own result cell: valid for as long as the ring is open,
     * even if the caller's frame is gone (fsync after a failed drive). */
    batch->results = results != NULL ? results : &batch->own_result;
    batch->count = count;
    batch->op = op;
    batch->fsync_flags = fsync_flags;
    if (checksums != NULL) batch->checksums = *checksums;
    ring->active_batches++;
    if (op == KVD_OP_FSYNC) {
        ring->stats.fsyncs++;
    } else {
        ring->stats.batches++;
        ring->stats.entries += count;
    }
    if (count > 0) pending_push(ring, slot);
    fill(ring);
    flush(ring);
    *id_out = batch->id;
    *slot_out = slot;
    return 0;
}

int kvd_ring_submit(struct kvd_ring *ring, int32_t op, struct kvd_entry *entries, int64_t *results,
                    uint32_t count, const struct kvd_checksums *checksums, uint64_t *id_out,
                    uint32_t *slot_out) {
    if (op != KVD_OP_READ && op != KVD_OP_WRITE) return -EINVAL;
    if (count > 0 && results == NULL) return -EINVAL;
    return start_batch(ring, op, 0, entries, results, count, checksums, id_out, slot_out);
}

int kvd_ring_slot_of(const struct kvd_ring *ring, uint64_t id) {
    if (id == 0 || !ring->open) return -ENOENT;
    for (uint32_t slot = 0; slot < ring->max_batches; slot++) {
        if (ring->batches[slot].id == id) return (int)slot;
    }
    return -ENOENT;
}

/* The entries of a batch not yet handed to the kernel complete with
 * `error` now, and its slot leaves the pending FIFO (it may stand behind
 * a batch still partly prepared); those the kernel holds still complete
 * on their own. */
static void fail_unprepared(struct kvd_ring *ring, uint32_t slot, int error) {
    struct kvd_batch *batch = &ring->batches[slot];
    KVD_CHECK(batch->queued == (batch->next < batch->count));
    if (batch->queued) pending_remove(ring, slot);
    while (batch->next < batch->count) {
        complete_entry(ring, batch, batch->next, error);
        batch->next++;
    }
}

/* Reaps (and keeps submitting) until the batch in `slot` is complete; it
 * always completes. A failed io_uring_enter is retried after a back-off;
 * one that is not transient also fails the batch's entries the kernel has
 * not been given (their results carry the errno), while the entries it
 * holds are still waited for: their buffers are the caller's until they
 * are reaped. After KVD_MAX_ENTER_FAILURES failures in a row the kernel
 * holds our buffers and will not give them back: stop the process (the
 * disk format is crash-safe; a buffer written after it was reused is not). */
static void drive(struct kvd_ring *ring, uint32_t slot) {
    struct kvd_batch *batch = &ring->batches[slot];
    uint32_t failures = 0;
    uint32_t delay_us = 1;
    for (;;) {
        reap(ring);
        fill(ring);
        if (ring->to_checksum_count > 0) {
            flush(ring); /* the drive works on the refilled queue meanwhile */
            checksum_completed(ring);
        }
        if (batch->completed == batch->count) {
            flush(ring); /* entries of later batches prepared above */
            return;
        }
        /* Not complete: fill() stopped at a full queue, so the kernel holds
         * entries (of this batch, or of batches ahead of it in the FIFO). */
        KVD_CHECK(ring->in_kernel > 0);
        uint32_t outstanding = batch->next - batch->completed; /* its entries in the kernel */
        KVD_CHECK(outstanding <= ring->in_kernel);
        /* How many completions to sleep for. All of the batch is in the
         * kernel: all of it (one wake-up instead of one per entry; others'
         * completions may wake us early, then we loop). Some of it still
         * waits for room: half the queue, so refills go in chunks while
         * the device keeps at least half the queue depth busy. */
        uint32_t wanted = outstanding;
        if (batch->next < batch->count) wanted = ring->in_kernel / 2 > 0 ? ring->in_kernel / 2 : 1;
        /* A batch with checksums wakes for every completion instead: what
         * has landed is checksummed while the rest is still being read, so
         * only the last entry's checksum follows the last read (waiting
         * for all of a 1 GiB batch first added all its checksums after). */
        if (batch->checksums.values != NULL) wanted = 1;
        int error = enter(ring, wanted);
        if (error >= 0 || error == -EINTR) {
            failures = 0;
            delay_us = 1;
            continue;
        }
        ring->stats.enter_errors++;
        if (!transient(error)) fail_unprepared(ring, slot, error);
        if (++failures > KVD_MAX_ENTER_FAILURES) {
            kvd_check_failed("io_uring_enter keeps failing with entries in the kernel", __FILE__, __LINE__);
        }
        back_off(&delay_us);
    }
}

static void release_slot(struct kvd_ring *ring, uint32_t slot) {
    struct kvd_batch *batch = &ring->batches[slot];
    KVD_CHECK(batch->id != 0 && batch->completed == batch->count && !batch->queued);
    free(batch->entries);
    memset(batch, 0, sizeof *batch);
    ring->active_batches--;
}

int kvd_ring_wait(struct kvd_ring *ring, uint64_t id) {
    int slot = kvd_ring_slot_of(ring, id);
    if (slot < 0) return slot;
    drive(ring, (uint32_t)slot);
    release_slot(ring, (uint32_t)slot);
    return 0;
}

int kvd_ring_fsync(struct kvd_ring *ring, int32_t file_index, int datasync, int64_t *result) {
    struct kvd_entry *entry = calloc(1, sizeof *entry);
    if (entry == NULL) return -ENOMEM;
    entry->file_index = file_index;
    uint64_t id;
    uint32_t slot;
    uint32_t flags = datasync ? IORING_FSYNC_DATASYNC : 0;
    int error = start_batch(ring, KVD_OP_FSYNC, flags, entry, NULL, 1, NULL, &id, &slot);
    if (error < 0) {
        free(entry);
        return error;
    }
    drive(ring, slot);
    *result = ring->batches[slot].own_result;
    release_slot(ring, slot);
    return 0;
}

uint32_t kvd_ring_pending(const struct kvd_ring *ring, uint64_t *ids, uint32_t capacity) {
    if (!ring->open) return 0;
    for (uint32_t k = 0; k < ring->pending_count && k < capacity; k++) {
        ids[k] = ring->batches[*pending_cell(ring, k)].id;
    }
    return ring->pending_count;
}

void kvd_ring_fail_enters(struct kvd_ring *ring, int32_t error, uint32_t count) {
    ring->enter_fault_errno = error;
    ring->enter_faults = count;
}

/* ---- tables ---------------------------------------------------------- */

int kvd_ring_register_files(struct kvd_ring *ring, const int32_t *fds, uint32_t count) {
    if (!ring->open) return -EBADF;
    if (ring->active_batches > 0) return -EBUSY;
    if (count > KVD_MAX_FILES) return -E2BIG;
    if (ring->file_count > 0) {
        int error = io_uring_unregister_files(&ring->uring);
        if (error < 0) return error;
        ring->file_count = 0;
    }
    if (count == 0) return 0;
    int error = io_uring_register_files(&ring->uring, fds, count);
    if (error < 0) return error;
    ring->file_count = count;
    return 0;
}

static int compare_regions(const void *left, const void *right) {
    const struct kvd_region *a = left;
    const struct kvd_region *b = right;
    return (a->address > b->address) - (a->address < b->address);
}

int kvd_ring_register_buffers(struct kvd_ring *ring, const struct kvd_region *regions, uint32_t count) {
    if (!ring->open) return -EBADF;
    if (ring->active_batches > 0) return -EBUSY;
    if (count > KVD_MAX_BUFFERS) return -E2BIG;
    struct kvd_region *sorted = NULL;
    struct iovec *vectors = NULL;
    if (count > 0) {
        sorted = malloc(count * sizeof *sorted);
        vectors = malloc(count * sizeof *vectors);
        if (sorted == NULL || vectors == NULL) {
            free(sorted);
            free(vectors);
            return -ENOMEM;
        }
        memcpy(sorted, regions, count * sizeof *sorted);
        qsort(sorted, count, sizeof *sorted, compare_regions);
        for (uint32_t i = 0; i < count; i++) {
            int empty = sorted[i].length == 0 || sorted[i].address == 0;
            int wraps = sorted[i].address + sorted[i].length < sorted[i].address;
            int overlaps = i > 0 && sorted[i - 1].address + sorted[i - 1].length > sorted[i].address;
            if (empty || wraps || overlaps) {
                free(sorted);
                free(vectors);
                return -EINVAL;
            }
            vectors[i].iov_base = (void *)(uintptr_t)sorted[i].address;
            vectors[i].iov_len = sorted[i].length;
        }
    }
    if (ring->region_count > 0) {
        int error = io_uring_unregister_buffers(&ring->uring);
        if (error < 0) {
            free(sorted);
            free(vectors);
            return error;
        }
    }
    free(ring->regions);
    ring->regions = NULL;
    ring->region_count = 0;
    if (count == 0) return 0;
    int error = io_uring_register_buffers(&ring->uring, vectors, count);
    free(vectors);
    if (error < 0) {
        free(sorted);
        return error;
    }
    ring->regions = sorted;
    ring->region_count = count;
    return 0;
}

int kvd_ring_add_fault(struct kvd_ring *ring, const struct kvd_fault *fault) {
    if (!ring->open) return -EBADF;
    int op_known = fault->op == KVD_OP_READ || fault->op == KVD_OP_WRITE || fault->op == KVD_OP_FSYNC;
    int one_effect = (fault->error > 0) != (fault->short_bytes >= 0);
    if (!op_known || !one_effect || fault->remaining == 0 || fault->offset_begin > fault->offset_end) {
        return -EINVAL;
    }
    /* Spent rules make room for new ones; order among live rules is kept. */
    uint32_t live = 0;
    for (uint32_t r = 0; r < ring->fault_count; r++) {
        if (ring->faults[r].remaining > 0) ring->faults[live++] = ring->faults[r];
    }
    ring->fault_count = live;
    if (ring->fault_count == KVD_MAX_FAULTS) return -ENOSPC;
    ring->faults[ring->fault_count++] = *fault;
    return 0;
}

void kvd_ring_clear_faults(struct kvd_ring *ring) {
    ring->fault_count = 0;
}

void kvd_ring_close(struct kvd_ring *ring) {
    if (!ring->open) return;
    /* Entries the kernel never saw: cancel them without I/O. */
    while (ring->pending_count > 0) fail_unprepared(ring, ring->pending[ring->pending_head], -ECANCELED);
    /* Entries the kernel holds may still write into caller buffers: wait.
     * Their batches are abandoned, so nothing is checksummed any more. */
    while (ring->in_kernel > 0) {
        reap(ring);
        ring->to_checksum_count = 0;
        if (ring->in_kernel == 0) break;
        ring->stats.enter_calls++;
        int error = io_uring_submit_and_wait(&ring->uring, 1); /* never an injected failure */
        if (error < 0 && !transient(error)) break; /* cannot drain; exiting the ring cancels */
    }
    for (uint32_t slot = 0; slot < ring->max_batches; slot++) {
        free(ring->batches[slot].entries);
    }
    io_uring_queue_exit(&ring->uring);
    free(ring->batches);
    free(ring->pending);
    free(ring->regions);
    free(ring->to_checksum);
    ring->batches = NULL;
    ring->pending = NULL;
    ring->regions = NULL;
    ring->to_checksum = NULL;
    ring->open = 0;
}
