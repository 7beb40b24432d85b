/* cufile_io: see cufile_io.h. */
#include "cufile_io.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CU_FILE_HANDLE_TYPE_OPAQUE_FD 1

typedef struct {
    int type;
    union {
        int fd;
        void *handle;
    } handle;
    const void *fs_ops;
} cufile_descr;

typedef void *cufile_handle;

struct kvd_cufile {
    void *library;
    kvd_cufile_error (*driver_open)(void);
    kvd_cufile_error (*driver_close)(void);
    kvd_cufile_error (*handle_register)(cufile_handle *, cufile_descr *);
    void (*handle_deregister)(cufile_handle);
    ssize_t (*read)(cufile_handle, void *, size_t, off_t, off_t);
    ssize_t (*write)(cufile_handle, const void *, size_t, off_t, off_t);
    cufile_handle *handles;
    uint32_t file_count;
};

static void *load(const char *library, char *why, size_t why_bytes) {
    void *handle = dlopen(library != NULL ? library : "libcufile.so.0", RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) snprintf(why, why_bytes, "%s", dlerror());
    return handle;
}

static int bind(struct kvd_cufile *c, char *why, size_t why_bytes) {
    void *l = c->library;
    *(void **)&c->driver_open = dlsym(l, "cuFileDriverOpen");
    *(void **)&c->driver_close = dlsym(l, "cuFileDriverClose_v2");
    if (c->driver_close == NULL) *(void **)&c->driver_close = dlsym(l, "cuFileDriverClose");
    *(void **)&c->handle_register = dlsym(l, "cuFileHandleRegister");
    *(void **)&c->handle_deregister = dlsym(l, "cuFileHandleDeregister");
    *(void **)&c->read = dlsym(l, "cuFileRead");
    *(void **)&c->write = dlsym(l, "cuFileWrite");
    if (!c->driver_open || !c->driver_close || !c->handle_register || !c->handle_deregister || !c->read ||
        !c->write) {
        snprintf(why, why_bytes, "the library lacks a cuFile entry point");
        return -ENOENT;
    }
    return 0;
}

int kvd_cufile_library_version(const char *library, int *version, char *why, size_t why_bytes) {
    void *handle = load(library, why, why_bytes);
    if (handle == NULL) return -ENOENT;
    kvd_cufile_error (*get_version)(int *);
    *(void **)&get_version = dlsym(handle, "cuFileGetVersion");
    int rc = get_version == NULL ? -ENOENT : 0;
    if (rc == 0 && get_version(version).err != 0) rc = -EIO;
    dlclose(handle);
    return rc;
}

int kvd_cufile_open(struct kvd_cufile **out, const char *library, kvd_cufile_error *driver_error, char *why,
                    size_t why_bytes) {
    struct kvd_cufile *c = calloc(1, sizeof(*c));
    if (c == NULL) return -ENOMEM;
    c->library = load(library, why, why_bytes);
    int rc = c->library == NULL ? -ENOENT : bind(c, why, why_bytes);
    if (rc == 0) {
        *driver_error = c->driver_open();
        if (driver_error->err != 0) rc = -ENODEV;
    }
    if (rc < 0) {
        if (c->library != NULL) dlclose(c->library);
        free(c);
        return rc;
    }
    *out = c;
    return 0;
}

static void deregister_all(struct kvd_cufile *c) {
    for (uint32_t i = 0; i < c->file_count; i++) {
        if (c->handles[i] != NULL) c->handle_deregister(c->handles[i]);
    }
    free(c->handles);
    c->handles = NULL;
    c->file_count = 0;
}

void kvd_cufile_close(struct kvd_cufile *c) {
    deregister_all(c);
    c->driver_close();
    dlclose(c->library);
    free(c);
}

int kvd_cufile_register_files(struct kvd_cufile *c, const int32_t *fds, uint32_t count, kvd_cufile_error *error) {
    if (count > KVD_CUFILE_MAX_FILES) return -EINVAL;
    deregister_all(c);
    c->handles = calloc(count ? count : 1, sizeof(cufile_handle));
    if (c->handles == NULL) return -ENOMEM;
    c->file_count = count;
    for (uint32_t i = 0; i < count; i++) {
        cufile_descr descr = {.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD, .handle.fd = fds[i], .fs_ops = NULL};
        *error = c->handle_register(&c->handles[i], &descr);
        if (error->err != 0) {
            c->handles[i] = NULL;
            deregister_all(c);
            return -EIO;
        }
    }
    return 0;
}

uint32_t kvd_cufile_run(struct kvd_cufile *c, int write, const int32_t *file_index, const int64_t *offset,
                        const uint32_t *length, const uint64_t *address, int64_t *results, uint32_t count) {
    uint32_t failed = 0;
    for (uint32_t i = 0; i < count; i++) {
        if (file_index[i] < 0 || (uint32_t)file_index[i] >= c->file_count) {
            results[i] = -EBADF;
        } else {
            void *base = (void *)(uintptr_t)address[i];
            ssize_t done = write ? c->write(c->handles[file_index[i]], base, length[i], (off_t)offset[i], 0)
                                 : c->read(c->handles[file_index[i]], base, length[i], (off_t)offset[i], 0);
            /* cuFile returns -1 with errno set, or -(its own error) for its failures. */
            results[i] = done >= 0 ? done : done == -1 ? -(int64_t)errno : -(KVD_CUFILE_ERROR_BASE - done);
        }
        failed += results[i] != (int64_t)length[i];
    }
    return failed;
}
