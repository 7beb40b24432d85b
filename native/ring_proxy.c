/* ring_proxy: see ring_proxy.h. */
#include "ring_proxy.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "checksum.h"

#define STAT_ADD(proxy, field, value) __atomic_fetch_add(&(proxy)->stats.field, (value), __ATOMIC_RELAXED)

int kvd_copy_host(void *context, const struct kvd_copy *copies, uint32_t count) {
    (void)context;
    for (uint32_t i = 0; i < count; i++) {
        memcpy((void *)(uintptr_t)copies[i].target, copies[i].source, copies[i].length);
    }
    return 0;
}

int kvd_copy_process(void *context, const struct kvd_copy *copies, uint32_t count) {
    int fd = (int)(intptr_t)context;
    for (uint32_t i = 0; i < count; i++) {
        const unsigned char *source = copies[i].source;
        uint64_t done = 0;
        while (done < copies[i].length) {
            ssize_t wrote = pwrite(fd, source + done, copies[i].length - done, (off_t)(copies[i].target + done));
            if (wrote < 0 && errno == EINTR) continue;
            if (wrote <= 0) return wrote < 0 ? -errno : -EIO;
            done += (uint64_t)wrote;
        }
    }
    return 0;
}

int kvd_proxy_check_ring(const kvd_io_ring *ring, uint64_t bytes, uint64_t *capacity_out, uint64_t *layers_out) {
    if (bytes < sizeof(kvd_io_ring)) return -EINVAL;
    /* One read of each field: what is checked is what is used (producers may write the header). */
    uint64_t version = __atomic_load_n(&ring->version, __ATOMIC_ACQUIRE);
    uint64_t capacity = __atomic_load_n(&ring->capacity, __ATOMIC_ACQUIRE);
    uint64_t layers = __atomic_load_n(&ring->layers, __ATOMIC_ACQUIRE);
    if (version != KVD_IO_RING_VERSION || capacity == 0 || (capacity & (capacity - 1)) != 0) return -EINVAL;
    if (capacity > (bytes - sizeof(kvd_io_ring)) / sizeof(kvd_io_desc)) return -EINVAL;
    if (layers == 0 || layers > KVD_IO_RING_MAX_LAYERS) return -EINVAL;
    *capacity_out = capacity;
    *layers_out = layers;
    return 0;
}

static uint64_t half_bytes(const struct kvd_proxy *proxy) { return proxy->config.staging_bytes / 2; }

/* A descriptor's `sequence`, once the proxy took it, holds the stamp of the grant it was taken
 * under (0: none); its outcome goes to that grant before the ring counts the read. */
static void complete(struct kvd_proxy *proxy, const kvd_io_desc *desc, int ok) {
    if (desc->sequence != 0) {
        __atomic_store_n(&proxy->grants[desc->tag].outcome, desc->sequence << 1 | (uint64_t)(ok != 0),
                         __ATOMIC_RELEASE);
    }
    kvd_io_ring_complete(proxy->config.ring, desc->layer, ok);
    STAT_ADD(proxy, reads, 1);
    if (!ok) STAT_ADD(proxy, failed, 1);
}

/* Whether [target, target + length) lies inside one of the target regions (binary search). */
static int inside_targets(const struct kvd_proxy *proxy, uint64_t target, uint64_t length) {
    uint32_t low = 0, high = proxy->config.target_count;
    while (low < high) {
        uint32_t middle = low + (high - low) / 2;
        const struct kvd_region *region = &proxy->targets[middle];
        if (target < region->address) {
            high = middle;
        } else if (target - region->address >= region->length) {
            low = middle + 1;
        } else {
            return length <= region->length - (target - region->address);
        }
    }
    return 0;
}

/* Whether the read's copies land inside the target regions: one, or its two parts of a split page. */
static int lands_inside(const struct kvd_proxy *proxy, const kvd_io_desc *desc) {
    uint64_t at = proxy->config.split_at, to = proxy->config.split_to;
    if (at == 0 || desc->length <= at) return inside_targets(proxy, desc->target, desc->length);
    return inside_targets(proxy, desc->target, at) && desc->target <= UINT64_MAX - to &&
           inside_targets(proxy, desc->target + to, desc->length - at);
}

/* Whether the descriptor can be read at all. */
static int readable(const struct kvd_proxy *proxy, const kvd_io_desc *desc) {
    return desc->file < proxy->config.file_count && desc->length > 0 && desc->length <= half_bytes(proxy) &&
           desc->length <= UINT32_MAX && desc->offset <= INT64_MAX && lands_inside(proxy, desc);
}

#define GRANT_LOAD(grant, field) __atomic_load_n(&(grant)->field, __ATOMIC_RELAXED)

/* Takes the armed grant the descriptor names, if its fields are the grant's: the grant's stamp,
 * or 0 (no such grant; it stays as it was). The fields are read between two looks at the stamp
 * (an acquire, then the compare-and-swap that disarms): a grant revoked or armed again meanwhile
 * fails the swap, so fields torn by a re-arm are never acted on. */
static uint64_t take_grant(struct kvd_proxy *proxy, const kvd_io_desc *desc) {
    if (desc->tag >= proxy->config.grant_count) return 0;
    struct kvd_grant *grant = &proxy->grants[desc->tag];
    uint64_t stamp = __atomic_load_n(&grant->stamp, __ATOMIC_ACQUIRE);
    if (stamp == 0) return 0;
    int same = GRANT_LOAD(grant, file) == desc->file && GRANT_LOAD(grant, offset) == desc->offset &&
               GRANT_LOAD(grant, length) == desc->length && GRANT_LOAD(grant, target) == desc->target &&
               GRANT_LOAD(grant, layer) == desc->layer && GRANT_LOAD(grant, checksum) == desc->checksum;
    if (!same || !__atomic_compare_exchange_n(&grant->stamp, &stamp, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        return 0;
    }
    return stamp;
}

int kvd_proxy_grant(struct kvd_proxy *proxy, uint64_t tag, const kvd_io_desc *desc, uint64_t stamp) {
    if (tag >= proxy->config.grant_count || stamp == 0 || stamp >= (1ull << 63)) return -EINVAL;
    struct kvd_grant *grant = &proxy->grants[tag];
    if (__atomic_load_n(&grant->stamp, __ATOMIC_ACQUIRE) != 0) return -EBUSY;
    __atomic_store_n(&grant->outcome, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&grant->file, desc->file, __ATOMIC_RELAXED);
    __atomic_store_n(&grant->offset, desc->offset, __ATOMIC_RELAXED);
    __atomic_store_n(&grant->length, desc->length, __ATOMIC_RELAXED);
    __atomic_store_n(&grant->target, desc->target, __ATOMIC_RELAXED);
    __atomic_store_n(&grant->layer, desc->layer, __ATOMIC_RELAXED);
    __atomic_store_n(&grant->checksum, desc->checksum, __ATOMIC_RELAXED);
    __atomic_store_n(&grant->stamp, stamp, __ATOMIC_RELEASE);
    return 0;
}

int kvd_proxy_revoke(struct kvd_proxy *proxy, uint64_t tag, uint64_t stamp) {
    if (tag >= proxy->config.grant_count) return -EINVAL;
    return __atomic_compare_exchange_n(&proxy->grants[tag].stamp, &stamp, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

uint64_t kvd_proxy_outcome(struct kvd_proxy *proxy, uint64_t tag) {
    return tag < proxy->config.grant_count ? __atomic_load_n(&proxy->grants[tag].outcome, __ATOMIC_ACQUIRE) : 0;
}

/* The next descriptor to place (the carried one first); 0 when none is published. */
static int next_desc(struct kvd_proxy *proxy, kvd_io_desc *out) {
    if (proxy->carrying) {
        *out = proxy->carry;
        proxy->carrying = 0;
        return 1;
    }
    while (kvd_io_ring_take_from(proxy->config.ring, proxy->capacity, out)) {
        if (out->layer >= proxy->layers) {
            STAT_ADD(proxy, dropped, 1);
            continue;
        }
        out->sequence = readable(proxy, out) ? take_grant(proxy, out) : 0;
        if (out->sequence == 0) {
            STAT_ADD(proxy, rejected, 1);
            if (readable(proxy, out)) STAT_ADD(proxy, ungranted, 1);
            complete(proxy, out, 0);
            continue;
        }
        return 1;
    }
    return 0;
}

/* Takes published descriptors into the batch while they fit its half of staging. */
static void fill(struct kvd_proxy *proxy, struct kvd_proxy_batch *batch, uint64_t half_base) {
    uint64_t used = 0;
    kvd_io_desc desc;
    batch->count = 0;
    while (batch->count < proxy->config.batch_entries && next_desc(proxy, &desc)) {
        uint64_t need = (desc.length + KVD_PROXY_ALIGN - 1) / KVD_PROXY_ALIGN * KVD_PROXY_ALIGN;
        if (used + need > half_bytes(proxy)) {
            proxy->carry = desc;
            proxy->carrying = 1;
            break;
        }
        batch->descs[batch->count] = desc;
        batch->staging_offsets[batch->count] = half_base + used;
        used += need;
        batch->count++;
    }
}

/* Hands the batch's reads to io_uring; on failure they all fail at once. */
static void submit(struct kvd_proxy *proxy, struct kvd_proxy_batch *batch) {
    struct kvd_entry *entries = calloc(batch->count, sizeof(*entries));
    int rc = entries == NULL ? -ENOMEM : 0;
    for (uint32_t i = 0; entries != NULL && i < batch->count; i++) {
        const kvd_io_desc *desc = &batch->descs[i];
        entries[i].address = (uint64_t)(uintptr_t)proxy->config.staging + batch->staging_offsets[i];
        entries[i].offset = (int64_t)desc->offset;
        entries[i].length = (uint32_t)desc->length;
        entries[i].file_index = (int32_t)desc->file;
    }
    uint32_t slot;
    if (rc == 0) {
        rc = kvd_ring_submit(&proxy->uring, KVD_OP_READ, entries, batch->results, batch->count, NULL, &batch->id,
                             &slot);
    }
    if (rc < 0) {
        free(entries);
        for (uint32_t i = 0; i < batch->count; i++) complete(proxy, &batch->descs[i], 0);
        batch->count = 0;
        return;
    }
    batch->in_flight = 1;
    STAT_ADD(proxy, batches, 1);
}

/* Whether read i of the batch landed in staging in full with the bytes its descriptor named. */
static int verified(struct kvd_proxy *proxy, struct kvd_proxy_batch *batch, uint32_t i) {
    const kvd_io_desc *desc = &batch->descs[i];
    if (batch->results[i] != (int64_t)desc->length) return 0;
    const unsigned char *source = (const unsigned char *)proxy->config.staging + batch->staging_offsets[i];
    if (kvd_crc32c(source, desc->length) == (uint32_t)desc->checksum) return 1;
    STAT_ADD(proxy, checksum_mismatches, 1);
    batch->results[i] = -EBADMSG;
    return 0;
}

/* Copies proxy->copies[0 .. count); on failure marks those reads failed. */
static void copy_out(struct kvd_proxy *proxy, struct kvd_proxy_batch *batch, const uint32_t *which,
                     uint32_t count) {
    if (count == 0) return;
    STAT_ADD(proxy, copy_calls, 1);
    if (proxy->config.copy(proxy->config.copy_context, proxy->copies, count) < 0) {
        STAT_ADD(proxy, copy_errors, 1);
        for (uint32_t k = 0; k < count; k++) batch->results[which[k]] = -EIO;
        return;
    }
    for (uint32_t k = 0; k < count; k++) STAT_ADD(proxy, bytes, proxy->copies[k].length);
}

/* Waits for the batch's reads, checks them, copies the good ones, completes all. */
static void finish(struct kvd_proxy *proxy, struct kvd_proxy_batch *batch) {
    kvd_ring_wait(&proxy->uring, batch->id);
    uint32_t good = 0;
    for (uint32_t i = 0; i < batch->count; i++) {
        if (!verified(proxy, batch, i)) continue;
        const kvd_io_desc *desc = &batch->descs[i];
        const unsigned char *source = (const unsigned char *)proxy->config.staging + batch->staging_offsets[i];
        uint64_t at = proxy->config.split_at;
        if (at != 0 && desc->length > at) {  /* a split page: its second part goes split_to further on */
            proxy->copies[good] = (struct kvd_copy){desc->target, source, at};
            proxy->copied[good++] = i;
            proxy->copies[good] = (struct kvd_copy){desc->target + proxy->config.split_to, source + at,
                                                    desc->length - at};
        } else {
            proxy->copies[good] = (struct kvd_copy){desc->target, source, desc->length};
        }
        proxy->copied[good++] = i;
        if (proxy->config.copy_each) {
            copy_out(proxy, batch, proxy->copied, good);
            good = 0;
        }
    }
    copy_out(proxy, batch, proxy->copied, good);
    for (uint32_t i = 0; i < batch->count; i++) {
        complete(proxy, &batch->descs[i], batch->results[i] == (int64_t)batch->descs[i].length);
    }
    batch->in_flight = 0;
    batch->count = 0;
}

static void idle(struct kvd_proxy *proxy, uint32_t *sleep_us) {
    struct timespec pause = {0, (long)*sleep_us * 1000L};
    nanosleep(&pause, NULL);
    STAT_ADD(proxy, idle_sleeps, 1);
    if (*sleep_us < KVD_PROXY_IDLE_MAX_US) *sleep_us = *sleep_us * 2 > KVD_PROXY_IDLE_MAX_US ? KVD_PROXY_IDLE_MAX_US
                                                                                            : *sleep_us * 2;
}

/* Invariant at the top of the loop: batches[current] is not in flight. */
static void *proxy_main(void *arg) {
    struct kvd_proxy *proxy = arg;
    unsigned current = 0;
    uint32_t sleep_us = 1;
    for (;;) {
        struct kvd_proxy_batch *filling = &proxy->batches[current];
        struct kvd_proxy_batch *other = &proxy->batches[current ^ 1];
        int stopping = __atomic_load_n(&proxy->stop, __ATOMIC_ACQUIRE);
        if (!stopping) fill(proxy, filling, current * half_bytes(proxy));
        if (filling->count > 0) submit(proxy, filling);
        if (other->in_flight) {
            finish(proxy, other);
        } else if (!filling->in_flight) {
            if (stopping) break;
            idle(proxy, &sleep_us);
            continue;
        }
        sleep_us = 1;
        current ^= 1;
    }
    if (proxy->carrying) complete(proxy, &proxy->carry, 0);
    proxy->carrying = 0;
    return NULL;
}

static int check_config(const struct kvd_proxy_config *config) {
    if (config->ring == NULL || config->copy == NULL || config->staging == NULL) return -EINVAL;
    if ((uintptr_t)config->staging % KVD_PROXY_ALIGN != 0) return -EINVAL;
    if (config->staging_bytes == 0 || config->staging_bytes % (2 * KVD_PROXY_ALIGN) != 0) return -EINVAL;
    if (config->batch_entries == 0 || config->batch_entries > KVD_PROXY_MAX_BATCH) return -EINVAL;
    if (config->grant_count == 0 || config->grant_count > KVD_PROXY_MAX_GRANTS) return -EINVAL;
    if (config->queue_depth == 0 || config->queue_depth > KVD_MAX_QUEUE_DEPTH) return -EINVAL;
    if (config->targets == NULL || config->target_count == 0 || config->target_count > KVD_MAX_BUFFERS) {
        return -EINVAL;
    }
    for (uint32_t i = 0; i < config->target_count; i++) {
        const struct kvd_region *region = &config->targets[i];
        if (region->length == 0 || region->address > UINT64_MAX - region->length) return -EINVAL;
        if (i > 0 && region->address < config->targets[i - 1].address + config->targets[i - 1].length) {
            return -EINVAL;  /* not sorted, or overlapping */
        }
    }
    return 0;
}

static void free_proxy(struct kvd_proxy *proxy) {
    for (int b = 0; b < 2; b++) {
        free(proxy->batches[b].descs);
        free(proxy->batches[b].results);
        free(proxy->batches[b].staging_offsets);
    }
    free(proxy->copies);
    free(proxy->copied);
    free(proxy->grants);
    free(proxy->targets);
    free(proxy);
}

static int allocate(struct kvd_proxy *proxy) {
    uint32_t n = proxy->config.batch_entries;
    for (int b = 0; b < 2; b++) {
        proxy->batches[b].descs = calloc(n, sizeof(kvd_io_desc));
        proxy->batches[b].results = calloc(n, sizeof(int64_t));
        proxy->batches[b].staging_offsets = calloc(n, sizeof(uint64_t));
        if (!proxy->batches[b].descs || !proxy->batches[b].results || !proxy->batches[b].staging_offsets) {
            return -ENOMEM;
        }
    }
    proxy->copies = calloc(2 * (size_t)n, sizeof(struct kvd_copy));
    proxy->copied = calloc(2 * (size_t)n, sizeof(uint32_t));
    proxy->grants = calloc(proxy->config.grant_count, sizeof(struct kvd_grant));
    proxy->targets = calloc(proxy->config.target_count, sizeof(struct kvd_region));
    if (!proxy->copies || !proxy->copied || !proxy->grants || !proxy->targets) return -ENOMEM;
    memcpy(proxy->targets, proxy->config.targets, proxy->config.target_count * sizeof(struct kvd_region));
    proxy->config.targets = proxy->targets;
    return 0;
}

/* The io_uring with the files and staging registered. */
static int open_uring(struct kvd_proxy *proxy) {
    int rc = kvd_ring_open(&proxy->uring, proxy->config.queue_depth, 4, 0);
    if (rc < 0) return rc;
    struct kvd_region staging = {(uint64_t)(uintptr_t)proxy->config.staging, proxy->config.staging_bytes};
    rc = kvd_ring_register_files(&proxy->uring, proxy->config.fds, proxy->config.file_count);
    if (rc == 0) rc = kvd_ring_register_buffers(&proxy->uring, &staging, 1);
    if (rc < 0) kvd_ring_close(&proxy->uring);
    return rc;
}

int kvd_proxy_start(struct kvd_proxy **out, const struct kvd_proxy_config *config) {
    uint64_t capacity = 0, layers = 0;
    int rc = check_config(config);
    if (rc == 0) rc = kvd_proxy_check_ring(config->ring, config->ring_bytes, &capacity, &layers);
    if (rc < 0) return rc;
    struct kvd_proxy *proxy = calloc(1, sizeof(*proxy));
    if (proxy == NULL) return -ENOMEM;
    proxy->config = *config;
    proxy->capacity = capacity;  /* as checked above; never re-read from shared memory */
    proxy->layers = layers;
    rc = allocate(proxy);
    if (rc == 0) rc = open_uring(proxy);
    if (rc < 0) {
        free_proxy(proxy);
        return rc;
    }
    rc = -pthread_create(&proxy->thread, NULL, proxy_main, proxy);
    if (rc < 0) {
        kvd_ring_close(&proxy->uring);
        free_proxy(proxy);
        return rc;
    }
    *out = proxy;
    return 0;
}

void kvd_proxy_stop(struct kvd_proxy *proxy, struct kvd_proxy_stats *final) {
    __atomic_store_n(&proxy->stop, 1, __ATOMIC_RELEASE);
    pthread_join(proxy->thread, NULL);
    if (final != NULL) kvd_proxy_read_stats(proxy, final);
    kvd_ring_close(&proxy->uring);
    free_proxy(proxy);
}

void kvd_proxy_read_stats(struct kvd_proxy *proxy, struct kvd_proxy_stats *out) {
    const uint64_t *from = (const uint64_t *)&proxy->stats;
    uint64_t *to = (uint64_t *)out;
    for (size_t i = 0; i < sizeof(*out) / sizeof(uint64_t); i++) to[i] = __atomic_load_n(&from[i], __ATOMIC_RELAXED);
}
