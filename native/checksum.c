/* checksum.c: see checksum.h. */
#include "checksum.h"

#include <limits.h>

#include <isa-l/crc.h>

uint32_t kvd_crc32c(const void *data, uint64_t length) {
    /* crc32_iscsi returns the register without the final inversion, so it
     * can be fed back as the initial value of the next piece; its length
     * is an int, hence the pieces. */
    const unsigned char *bytes = data;
    uint32_t crc = 0xFFFFFFFFu;
    while (length > 0) {
        uint64_t piece = length > (uint64_t)INT_MAX ? (uint64_t)1 << 30 : length;
        crc = crc32_iscsi((unsigned char *)bytes, (int)piece, crc);
        bytes += piece;
        length -= piece;
    }
    return crc ^ 0xFFFFFFFFu;
}

void kvd_crc32c_chunks(const void *data, uint64_t chunk, uint32_t count, uint32_t *out) {
    const unsigned char *bytes = data;
    for (uint32_t j = 0; j < count; j++) out[j] = kvd_crc32c(bytes + (uint64_t)j * chunk, chunk);
}
