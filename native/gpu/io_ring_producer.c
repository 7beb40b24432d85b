/* A CPU stand-in for the ring's GPU producer, in its own process: threads
 * publish a plan of reads into a ring in shared memory (through the same
 * header the kernels use), then the main thread waits for every layer's
 * reads with kvd_io_ring_wait, the wait kernel's own code, and prints how
 * each wait ended. The proxy on the other side is kvd's (RingProxy).
 *
 * Usage: io_ring_producer SOCKET_FD PLAN_FILE THREADS TIMEOUT_S [WAIT_LAYERS]
 * SOCKET_FD is an inherited Unix socket on which the ring's memory arrives
 * as a descriptor (SCM_RIGHTS: a memfd laid out by io_ring_init; no path
 * names it). PLAN_FILE is an array of records of six uint64 (file, offset,
 * length, target, layer, checksum). Thread t publishes records t,
 * t + THREADS, ... in order. Records whose layer is past WAIT_LAYERS
 * (default: the ring's layer count) are published but not waited for.
 * TIMEOUT_S bounds everything: a read not published by then is abandoned
 * (counted in abandoned[layer]), and a wait still pending then ends TIMEOUT.
 * Each wait's record is the ring's waits[layer]; one line per layer:
 *   layer L state S done D failed F
 * Exit 0: every wait ended OK; 1: some did not; 2: bad input. */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io_ring.h"

typedef struct {
    uint64_t file, offset, length, target, layer, checksum;
} record;

static kvd_io_ring *ring;
static record *plan;
static uint64_t records;
static unsigned threads;
static uint64_t deadline_ns;

static void *produce(void *arg) {
    for (uint64_t n = (uint64_t)(uintptr_t)arg; n < records; n += threads) {
        const record *r = &plan[n];
        uint64_t ticket;
        if (kvd_io_ring_reserve(ring, 1, deadline_ns, &ticket)) {
            kvd_io_ring_publish(ring, ticket, r->file, r->offset, r->length, r->target, r->layer, n, r->checksum);
        } else {
            kvd_io_ring_abandon(ring, r->layer, 1);
        }
    }
    return NULL;
}

/* The descriptor that arrives on `socket` (one byte of payload); -1 on anything else. */
static int receive_fd(int socket) {
    char byte;
    struct iovec payload = {&byte, 1};
    union {
        struct cmsghdr header;
        char space[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr message;
    memset(&message, 0, sizeof(message));
    message.msg_iov = &payload;
    message.msg_iovlen = 1;
    message.msg_control = control.space;
    message.msg_controllen = sizeof(control.space);
    if (recvmsg(socket, &message, MSG_CMSG_CLOEXEC) != 1) return -1;
    struct cmsghdr *header = CMSG_FIRSTHDR(&message);
    if (header == NULL || header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS ||
        header->cmsg_len != CMSG_LEN(sizeof(int))) {
        return -1;
    }
    int fd;
    memcpy(&fd, CMSG_DATA(header), sizeof(fd));
    return fd;
}

/* All of `fd` mapped shared, `protection` PROT_*; the descriptor is closed; NULL on failure. */
static void *map_fd(int fd, int protection, uint64_t *bytes) {
    struct stat st;
    if (fd < 0) return NULL;
    if (fstat(fd, &st) != 0 || st.st_size == 0) {
        close(fd);
        return NULL;
    }
    void *memory = mmap(NULL, (size_t)st.st_size, protection, MAP_SHARED, fd, 0);
    close(fd);
    *bytes = (uint64_t)st.st_size;
    return memory == MAP_FAILED ? NULL : memory;
}

/* Waits for each layer below `wait_layers` until the common deadline; 1 when every wait ended OK. */
static int wait_layers(uint64_t wait_layers) {
    uint64_t expected[KVD_IO_RING_MAX_LAYERS] = {0};
    for (uint64_t n = 0; n < records; n++) {
        if (plan[n].layer < wait_layers) expected[plan[n].layer]++;
    }
    int all_ok = 1;
    for (uint64_t layer = 0; layer < wait_layers; layer++) {
        uint64_t now = kvd_io_ring_now_ns();
        uint64_t timeout_ns = deadline_ns > now ? deadline_ns - now : 0;
        kvd_io_wait *result = &ring->waits[layer];
        all_ok &= kvd_io_ring_wait(ring, layer, expected[layer], 0, timeout_ns, result) == KVD_IO_WAIT_OK;
        printf("layer %llu state %llu done %llu failed %llu\n", (unsigned long long)layer,
               (unsigned long long)result->state, (unsigned long long)result->done,
               (unsigned long long)result->failed);
    }
    return all_ok;
}

int main(int argc, char **argv) {
    uint64_t ring_bytes, plan_bytes;
    if (argc != 5 && argc != 6) return 2;
    ring = (kvd_io_ring *)map_fd(receive_fd(atoi(argv[1])), PROT_READ | PROT_WRITE, &ring_bytes);
    plan = (record *)map_fd(open(argv[2], O_RDONLY | O_CLOEXEC), PROT_READ, &plan_bytes);
    threads = (unsigned)atoi(argv[3]);
    deadline_ns = kvd_io_ring_deadline((uint64_t)(atof(argv[4]) * 1e9));
    if (ring == NULL || plan == NULL || threads == 0 || threads > 64) return 2;
    if (ring_bytes < sizeof(kvd_io_ring) || ring->version != KVD_IO_RING_VERSION) return 2;
    records = plan_bytes / sizeof(record);
    uint64_t wait_layers_count = argc == 6 ? (uint64_t)atoll(argv[5]) : ring->layers;
    if (wait_layers_count > KVD_IO_RING_MAX_LAYERS) return 2;
    pthread_t workers[64];
    for (unsigned t = 0; t < threads; t++) pthread_create(&workers[t], NULL, produce, (void *)(uintptr_t)t);
    for (unsigned t = 0; t < threads; t++) pthread_join(workers[t], NULL);
    return wait_layers(wait_layers_count) ? 0 : 1;
}
