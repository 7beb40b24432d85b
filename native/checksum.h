/*
 * checksum: crc32c (Castagnoli) of memory, through Intel ISA-L's
 * crc32_iscsi (hardware instructions, several streams in parallel).
 *
 * The value is the standard one, the same as the Python `crc32c`
 * package's crc32c(data): initial register all ones, final inversion.
 * These functions take no locks and touch no Python state, so callers run
 * them with the GIL released.
 */
#ifndef KVD_CHECKSUM_H
#define KVD_CHECKSUM_H

#include <stdint.h>

/* crc32c of `length` bytes at `data` (any length, including 0). */
uint32_t kvd_crc32c(const void *data, uint64_t length);

/* out[j] = crc32c of bytes [j * chunk, (j + 1) * chunk) at `data`, j < count. */
void kvd_crc32c_chunks(const void *data, uint64_t chunk, uint32_t count, uint32_t *out);

#endif
