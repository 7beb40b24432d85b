/*
 * cufile_io: batches of reads and writes between files and GPU memory
 * through NVIDIA cuFile (GPUDirect Storage): the drive's DMA goes straight
 * to and from device memory where the platform has the nvidia-fs driver
 * (cuFile falls back to its own staging where it has not).
 *
 * libcufile is loaded at run time (dlopen), so kvd._native neither links
 * against it nor needs it to import. Its entry points are declared here with
 * cuFile's ABI (an error is two ints returned by value; a file descriptor
 * is registered in a {type, union {fd, handle}, fs_ops} descriptor).
 *
 * A batch is (file index, offset, length, device address) entries, run in
 * order on the calling thread (cuFileRead / cuFileWrite are synchronous);
 * results[i] is the byte count, or -errno, or -(KVD_CUFILE_ERROR_BASE + the
 * cuFile error) where cuFile reports one of its own.
 *
 * Never run against a GPU: kvd's machines have none. Here the library loads
 * (the nvidia-cufile wheel) and its driver refuses to open without a CUDA
 * driver, which tests/device checks.
 */
#ifndef KVD_CUFILE_IO_H
#define KVD_CUFILE_IO_H

#include <stdint.h>
#include <sys/types.h>

#define KVD_CUFILE_ERROR_BASE 100000
#define KVD_CUFILE_MAX_FILES 4096u

typedef struct {
    int err;     /* CUfileOpError: 0 is success, 5000 and up are cuFile's own */
    int cu_err;  /* the CUDA driver's CUresult behind it, if any */
} kvd_cufile_error;

struct kvd_cufile;

/* Loads `library` (NULL: libcufile.so.0 on the library path) and opens its
 * driver. 0; -ENOENT when the library cannot be loaded (dlerror in `why`);
 * -ENODEV when the driver does not open (its error in *driver_error). */
int kvd_cufile_open(struct kvd_cufile **out, const char *library, kvd_cufile_error *driver_error, char *why,
                    size_t why_bytes);
void kvd_cufile_close(struct kvd_cufile *cufile);

/* cuFile's version (e.g. 1150 for 1.15.0): works without a driver. */
int kvd_cufile_library_version(const char *library, int *version, char *why, size_t why_bytes);

/* Registers files 0 .. count - 1 (replacing any before). */
int kvd_cufile_register_files(struct kvd_cufile *cufile, const int32_t *fds, uint32_t count,
                              kvd_cufile_error *error);

/* Runs a batch; write != 0 writes. Returns the number of entries that failed. */
uint32_t kvd_cufile_run(struct kvd_cufile *cufile, int write, const int32_t *file_index, const int64_t *offset,
                        const uint32_t *length, const uint64_t *address, int64_t *results, uint32_t count);

#endif
