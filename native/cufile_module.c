/*
 * kvd._native.CuFile: the binding of cufile_io.c (GPUDirect Storage through
 * a libcufile loaded at run time). Argument checking for callers lives in
 * kvd/io/cufile.py; checks here protect memory only.
 */
#include "module.h"

#include <errno.h>

#include "cufile_io.h"

typedef struct {
    PyObject_HEAD
    struct kvd_cufile *cufile;  /* NULL once closed */
} CuFileObject;

static PyObject *cufile_error(int rc, const char *why, kvd_cufile_error error) {
    if (rc == -ENOENT) return PyErr_Format(PyExc_OSError, "cuFile library: %s", why);
    if (rc == -ENODEV) {
        return PyErr_Format(PyExc_OSError, "cuFile's driver did not open: cuFile error %d (CUDA error %d)",
                            error.err, error.cu_err);
    }
    if (rc == -EIO) return PyErr_Format(PyExc_OSError, "cuFile: error %d (CUDA error %d)", error.err, error.cu_err);
    return raise_error(rc);
}

static int cufile_init(CuFileObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"library", NULL};
    const char *library = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|z", keywords, &library)) return -1;
    if (self->cufile != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "CuFile is already open");
        return -1;
    }
    char why[512] = "";
    kvd_cufile_error error = {0, 0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvd_cufile_open(&self->cufile, library, &error, why, sizeof why);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        cufile_error(rc, why, error);
        return -1;
    }
    return 0;
}

static int open_or_raise(CuFileObject *self) {
    if (self->cufile != NULL) return 0;
    PyErr_SetString(PyExc_ValueError, "the cuFile handle is closed");
    return -1;
}

static PyObject *cufile_register_files(CuFileObject *self, PyObject *fds_object) {
    if (open_or_raise(self) < 0) return NULL;
    Py_buffer view;
    Py_ssize_t count = get_array(fds_object, &view, sizeof(int32_t), 0, "fds");
    if (count < 0) return NULL;
    kvd_cufile_error error = {0, 0};
    int rc = kvd_cufile_register_files(self->cufile, view.buf, (uint32_t)count, &error);
    PyBuffer_Release(&view);
    if (rc < 0) return cufile_error(rc, "", error);
    Py_RETURN_NONE;
}

/* run(write, file_index, offset, length, address, results) -> entries that failed */
static PyObject *cufile_run(CuFileObject *self, PyObject *args) {
    int write;
    PyObject *objects[5];
    if (open_or_raise(self) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "pOOOOO", &write, &objects[0], &objects[1], &objects[2], &objects[3], &objects[4])) {
        return NULL;
    }
    static const Py_ssize_t sizes[5] = {4, 8, 4, 8, 8};
    static const char *names[5] = {"file_index", "offset", "length", "address", "results"};
    Py_buffer views[5];
    Py_ssize_t count = -1;
    int got = 0;
    for (; got < 5; got++) {
        Py_ssize_t n = get_array(objects[got], &views[got], sizes[got], got == 4, names[got]);
        if (n < 0 || (count >= 0 && n != count)) {
            if (n >= 0) {
                PyBuffer_Release(&views[got]);
                PyErr_SetString(PyExc_ValueError, "every array must have one entry per I/O");
            }
            break;
        }
        count = n;
    }
    uint32_t failed = 0;
    if (got == 5) {
        Py_BEGIN_ALLOW_THREADS
        failed = kvd_cufile_run(self->cufile, write, views[0].buf, views[1].buf, views[2].buf, views[3].buf,
                                views[4].buf, (uint32_t)count);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return got == 5 ? PyLong_FromUnsignedLong(failed) : NULL;
}

static PyObject *cufile_close(CuFileObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->cufile != NULL) {
        kvd_cufile_close(self->cufile);
        self->cufile = NULL;
    }
    Py_RETURN_NONE;
}

static void cufile_dealloc(CuFileObject *self) {
    Py_XDECREF(cufile_close(self, NULL));
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef cufile_methods[] = {
    {"register_files", (PyCFunction)cufile_register_files, METH_O, "register_files(fds: int32 array) -> None"},
    {"run", (PyCFunction)cufile_run, METH_VARARGS,
     "run(write, file_index, offset, length, address, results) -> entries that failed"},
    {"close", (PyCFunction)cufile_close, METH_NOARGS, "close() -> None; idempotent"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CuFileType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd._native.CuFile",
    .tp_doc = "CuFile(library=None): cuFile's driver, opened (see native/cufile_io.h).",
    .tp_basicsize = sizeof(CuFileObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cufile_init,
    .tp_dealloc = (destructor)cufile_dealloc,
    .tp_methods = cufile_methods,
};

/* cufile_version(library=None) -> int: the library's version, without opening its driver. */
static PyObject *native_cufile_version(PyObject *Py_UNUSED(module), PyObject *args) {
    const char *library = NULL;
    if (!PyArg_ParseTuple(args, "|z", &library)) return NULL;
    char why[512] = "";
    int version = 0;
    int rc = kvd_cufile_library_version(library, &version, why, sizeof why);
    kvd_cufile_error none = {0, 0};
    if (rc < 0) return cufile_error(rc, why, none);
    return PyLong_FromLong(version);
}

static PyMethodDef cufile_functions[] = {
    {"cufile_version", native_cufile_version, METH_VARARGS, "cufile_version(library=None) -> int"},
    {NULL, NULL, 0, NULL},
};

int kvd_add_cufile(PyObject *module) {
    if (PyType_Ready(&CuFileType) < 0) return -1;
    if (PyModule_AddObjectRef(module, "CuFile", (PyObject *)&CuFileType) < 0 ||
        PyModule_AddFunctions(module, cufile_functions) < 0 ||
        PyModule_AddIntConstant(module, "CUFILE_ERROR_BASE", KVD_CUFILE_ERROR_BASE) < 0) {
        return -1;
    }
    return 0;
}
