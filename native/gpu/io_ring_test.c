/* The ring's host side under real threads, compiled as C (gcc) and C++ (g++):
 * producers publish reads of a real file over several layers into a small
 * ring (so it wraps many times), one proxy thread takes them, preads each
 * into its target and completes it; the main thread waits per layer and
 * checks every target byte. With FAULTS set, every 97th read asks past the
 * end of the file: it must complete as failed and leave its target zero.
 * The waits are kvd_io_ring_wait, the wait kernel's own code: every layer's
 * must end OK, or FAILED when it had a faulted read; and a wait for a read
 * nobody publishes must end TIMEOUT at its deadline.
 * Usage: io_ring_test FILE PRODUCERS READS_EACH CAPACITY FAULTS */
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io_ring.h"

#define LAYERS 4u
#define READ_BYTES 512u

static kvd_io_ring *ring;
static unsigned char *targets;
static int file;
static unsigned reads_each;
static uint64_t total;
static int faults;
static off_t file_bytes;

static int faulted(uint64_t n) { return faults && n % 97 == 0; }

static uint64_t offset_of(uint64_t n) {
    return faulted(n) ? (uint64_t)file_bytes + n * READ_BYTES : (n * 7919u % 4096u) * READ_BYTES;
}

static void *produce(void *arg) {
    uint64_t producer = (uint64_t)(uintptr_t)arg;
    for (uint64_t i = 0; i < reads_each; i++) {
        uint64_t n = producer * reads_each + i;
        uint64_t ticket;
        if (!kvd_io_ring_reserve(ring, 1, kvd_io_ring_deadline(60000000000ull), &ticket)) {
            kvd_io_ring_abandon(ring, n % LAYERS, 1);
            continue;
        }
        kvd_io_ring_publish(ring, ticket, 0, offset_of(n), READ_BYTES,
                            (uint64_t)(uintptr_t)(targets + n * READ_BYTES), n % LAYERS, n, 0);
    }
    return NULL;
}

static void *proxy(void *arg) {
    (void)arg;
    kvd_io_desc desc;
    for (uint64_t taken = 0; taken < total;) {
        if (!kvd_io_ring_take(ring, &desc)) {
            sched_yield();
            continue;
        }
        ssize_t got = pread(file, (void *)(uintptr_t)desc.target, desc.length, (off_t)desc.offset);
        kvd_io_ring_complete(ring, desc.layer, got == (ssize_t)desc.length);
        taken++;
    }
    return NULL;
}

/* Waits for every layer the way the wait kernel does; 0 when each ended as it should. */
static int wait_layers(void) {
    for (unsigned layer = 0; layer < LAYERS; layer++) {
        uint64_t expected = total / LAYERS + (layer < total % LAYERS), faulted_here = 0;
        for (uint64_t n = layer; n < total; n += LAYERS) faulted_here += faulted(n);
        /* failed_before = every fault of the layer: the wait then ends only when all its reads are done */
        uint64_t state = kvd_io_ring_wait(ring, layer, expected, faulted_here, 60000000000ull, &ring->waits[layer]);
        uint64_t failed = ring->waits[layer].failed;
        if (state != KVD_IO_WAIT_OK || failed != faulted_here || ring->waits[layer].done != expected) {
            fprintf(stderr, "layer %u: wait state %llu, %llu failed\n", layer, (unsigned long long)state,
                    (unsigned long long)failed);
            return 1;
        }
        /* the same wait, knowing of no failure: FAILED exactly when the layer had one */
        state = kvd_io_ring_wait(ring, layer, expected, 0, 0, &ring->waits[LAYERS + layer]);
        if (state != (faulted_here ? KVD_IO_WAIT_FAILED : KVD_IO_WAIT_OK)) return 1;
    }
    return 0;
}

/* A read nobody publishes: TIMEOUT after its deadline, not before; a layer past the ring's: INVALID. */
static int wait_for_nothing(void) {
    uint64_t timeout_ns = 20000000ull, until = kvd_io_ring_done(ring, 0) + 1;
    kvd_io_wait *record = &ring->waits[KVD_IO_RING_WAITS - 1];
    if (kvd_io_ring_wait(ring, 0, until, UINT64_MAX, timeout_ns, record) != KVD_IO_WAIT_TIMEOUT) return 1;
    if (record->waited_ns < timeout_ns || record->state != KVD_IO_WAIT_TIMEOUT) return 1;
    return kvd_io_ring_wait(ring, LAYERS, 0, 0, 0, record) != KVD_IO_WAIT_INVALID;
}

/* Every target holds its bytes, or zeros for a faulted read; 0 when so. */
static int check_targets(uint64_t *faulted_reads) {
    unsigned char *expected = (unsigned char *)malloc(READ_BYTES);
    *faulted_reads = 0;
    for (uint64_t n = 0; n < total; n++) {
        if (faulted(n)) {
            memset(expected, 0, READ_BYTES);
            (*faulted_reads)++;
        } else if (pread(file, expected, READ_BYTES, (off_t)offset_of(n)) != READ_BYTES) {
            free(expected);
            return 3;
        }
        if (memcmp(expected, targets + n * READ_BYTES, READ_BYTES) != 0) {
            fprintf(stderr, "read %llu landed wrong\n", (unsigned long long)n);
            free(expected);
            return 1;
        }
    }
    free(expected);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 6) return 2;
    file = open(argv[1], O_RDONLY);
    file_bytes = lseek(file, 0, SEEK_END);
    faults = atoi(argv[5]);
    unsigned producers = (unsigned)atoi(argv[2]);
    reads_each = (unsigned)atoi(argv[3]);
    uint64_t capacity = (uint64_t)atoi(argv[4]);
    total = (uint64_t)producers * reads_each;
    ring = (kvd_io_ring *)calloc(1, kvd_io_ring_bytes(capacity));
    targets = (unsigned char *)calloc(total, READ_BYTES);
    if (file < 0 || ring == NULL || targets == NULL || producers > 64) return 2;
    ring->version = KVD_IO_RING_VERSION;
    ring->capacity = capacity;
    ring->layers = LAYERS;
    pthread_t threads[65];
    pthread_create(&threads[64], NULL, proxy, NULL);
    for (unsigned p = 0; p < producers; p++) pthread_create(&threads[p], NULL, produce, (void *)(uintptr_t)p);
    if (wait_layers() != 0) return 5;
    for (unsigned p = 0; p < producers; p++) pthread_join(threads[p], NULL);
    pthread_join(threads[64], NULL);
    uint64_t faulted_reads, failed = 0, abandoned = 0;
    int rc = check_targets(&faulted_reads);
    if (rc != 0) return rc;
    for (unsigned layer = 0; layer < LAYERS; layer++) failed += ring->failed[layer];
    for (unsigned layer = 0; layer < LAYERS; layer++) abandoned += ring->abandoned[layer];
    if (failed != faulted_reads || abandoned != 0) {
        fprintf(stderr, "%llu reads failed, %llu were made to\n", (unsigned long long)failed,
                (unsigned long long)faulted_reads);
        return 4;
    }
    if (wait_for_nothing() != 0) return 6;
    printf("ok %llu reads, %llu failed as made to, %llu laps\n", (unsigned long long)total,
           (unsigned long long)failed, (unsigned long long)(total / capacity));
    return 0;
}
