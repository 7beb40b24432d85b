/*
 * The longest-prefix walk of kvd.core.radix.PrefixIndex over keys packed
 * back to back in one buffer (a Lookup of thousands of keys).
 */
#ifndef KVD_PREFIX_H
#define KVD_PREFIX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* match_chain(nodes: dict, keys: buffer, key_bytes: int, parent, sealed) -> list */
PyObject *kvd_match_chain(PyObject *module, PyObject *args);

#endif
