/* A CPU stand-in for the ring's GPU producer, in its own process: threads
 * publish a plan of reads into a ring in shared memory (through the same
 * header the kernel uses), then the main thread waits for every layer's
 * reads the way kvd_io_ring_wait_layer does, and prints each layer's done
 * and failed counts. The proxy on the other side is kvd's (RingProxy).
 *
 * Usage: io_ring_producer RING_FILE PLAN_FILE THREADS TIMEOUT_S [WAIT_LAYERS]
 * RING_FILE holds a ring laid out by io_ring_init; PLAN_FILE is an array of
 * records of six uint64 (file, offset, length, target, layer, checksum).
 * Thread t publishes records t, t + THREADS, ... in order. Records whose
 * layer is past WAIT_LAYERS (default: the ring's layer count) are published
 * but not waited for.
 * Exit 0: all waited reads done; 3: TIMEOUT_S passed first; 2: bad input. */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "io_ring.h"

typedef struct {
    uint64_t file, offset, length, target, layer, checksum;
} record;

static kvd_io_ring *ring;
static record *plan;
static uint64_t records;
static unsigned threads;

/* Waits sleep rather than spin: the producer stands in for a GPU, and must
 * not take the CPU the proxy runs on (the kernel's waits are __nanosleep). */
static void pause_briefly(void) {
    struct timespec pause = {0, 200000};
    nanosleep(&pause, NULL);
}

static void *produce(void *arg) {
    for (uint64_t n = (uint64_t)(uintptr_t)arg; n < records; n += threads) {
        const record *r = &plan[n];
        uint64_t ticket = kvd_io_ring_ticket(ring);
        while (!kvd_io_ring_slot_free(ring, ticket)) pause_briefly();
        kvd_io_ring_publish(ring, ticket, r->file, r->offset, r->length, r->target, r->layer, n, r->checksum);
    }
    return NULL;
}

static void *map_file(const char *path, uint64_t *bytes) {
    int fd = open(path, O_RDWR);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) return NULL;
    void *memory = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    *bytes = (uint64_t)st.st_size;
    return memory == MAP_FAILED ? NULL : memory;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    uint64_t ring_bytes, plan_bytes;
    if (argc != 5 && argc != 6) return 2;
    ring = (kvd_io_ring *)map_file(argv[1], &ring_bytes);
    plan = (record *)map_file(argv[2], &plan_bytes);
    threads = (unsigned)atoi(argv[3]);
    double deadline = now() + atof(argv[4]);
    if (ring == NULL || plan == NULL || threads == 0 || threads > 64 || ring->version != KVD_IO_RING_VERSION) return 2;
    records = plan_bytes / sizeof(record);
    uint64_t wait_layers = argc == 6 ? (uint64_t)atoll(argv[5]) : ring->layers;
    if (wait_layers > KVD_IO_RING_MAX_LAYERS) return 2;
    uint64_t expected[KVD_IO_RING_MAX_LAYERS] = {0};
    for (uint64_t n = 0; n < records; n++) {
        if (plan[n].layer < wait_layers) expected[plan[n].layer]++;
    }
    pthread_t workers[64];
    for (unsigned t = 0; t < threads; t++) pthread_create(&workers[t], NULL, produce, (void *)(uintptr_t)t);
    int late = 0;
    for (uint64_t layer = 0; layer < wait_layers && !late; layer++) {
        while (kvd_io_ring_done(ring, layer) < expected[layer] && !(late = now() > deadline)) pause_briefly();
    }
    for (unsigned t = 0; t < threads && !late; t++) pthread_join(workers[t], NULL);
    for (uint64_t layer = 0; layer < wait_layers; layer++) {
        printf("layer %llu done %llu failed %llu\n", (unsigned long long)layer,
               (unsigned long long)kvd_io_ring_done(ring, layer), (unsigned long long)ring->failed[layer]);
    }
    return late ? 3 : 0;
}
