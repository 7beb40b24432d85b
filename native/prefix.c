/*
 * match_chain: PrefixIndex.match for packed keys, without a hash per key.
 *
 * The index is one dict from key to node (kvd/core/radix.py explains why a
 * flat dict is a tree there). Keys 0..m-1 match when node(i) = nodes[key i]
 * exists and is SEALED for each i, and node(i).parent is node(i-1) (the
 * given parent for i = 0). Whether the match reaches m is monotone in m, so
 * the answer is found by probing ONE key and walking parent links back:
 *
 *   the node of key p, if any, matches through p  iff  walking its parents
 *   back to position lo meets keys p-1..lo in order, all SEALED, and the
 *   parent of position lo is the node already matched at lo - 1.
 *
 * The walk compares each ancestor's own key bytes with the requested key at
 * its position; an ancestor is always in the index (its invariants), so
 * that equals a dict probe of the key. The whole prefix is tried first (a
 * full hit: one dict probe and one walk), then a binary search over the
 * matched length, whose walks cover disjoint ranges on success and halve on
 * failure: O(n) pointer steps and O(log n) dict probes in all.
 *
 * No Python code runs during the walk, so nodes are held by borrowed
 * pointers until the result list takes references. kvd's Block keeps its
 * fields in __slots__: their offsets are taken once per call from the
 * type's member descriptors and read directly (what the descriptor itself
 * does); a node of any other type goes through PyObject_GetAttr.
 */
#include "prefix.h"

#include <string.h>

#include <structmember.h>

enum { FIELD_PARENT, FIELD_STATE, FIELD_KEY, FIELDS };

typedef struct {
    PyObject *nodes, *sealed;
    const char *keys;
    Py_ssize_t key_bytes;
    PyObject **path; /* path[i]: node matched (or tried) at position i, borrowed */
    PyTypeObject *slotted; /* the node type whose slot offsets are known, or NULL */
    Py_ssize_t offset[FIELDS];
} Walk;

static PyObject *names[FIELDS];

/* The field of a node as a borrowed pointer (the node holds it). */
static PyObject *field(const Walk *walk, PyObject *node, int which) {
    if (Py_TYPE(node) == walk->slotted) {
        PyObject *value = *(PyObject **)((char *)node + walk->offset[which]);
        if (value != NULL) return value;
    }
    PyObject *value = PyObject_GetAttr(node, names[which]);
    if (value != NULL) Py_DECREF(value);
    return value;
}

/* Learns the slot offsets of `type`'s fields; leaves walk->slotted NULL if
 * any of them is not a plain object slot. */
static void learn_slots(Walk *walk, PyTypeObject *type) {
    for (int which = 0; which < FIELDS; which++) {
        PyObject *descriptor = PyObject_GetAttr((PyObject *)type, names[which]);
        if (descriptor == NULL) {
            PyErr_Clear();
            return;
        }
        int plain = Py_IS_TYPE(descriptor, &PyMemberDescr_Type) &&
                    ((PyMemberDescrObject *)descriptor)->d_member->type == T_OBJECT_EX;
        if (plain) walk->offset[which] = ((PyMemberDescrObject *)descriptor)->d_member->offset;
        Py_DECREF(descriptor);
        if (!plain) return;
    }
    walk->slotted = type;
}

/* The index's node for key `position`, borrowed; NULL with no error if absent. */
static PyObject *probe(const Walk *walk, Py_ssize_t position) {
    PyObject *key = PyBytes_FromStringAndSize(walk->keys + position * walk->key_bytes, walk->key_bytes);
    if (key == NULL) return NULL;
    PyObject *node = PyDict_GetItemWithError(walk->nodes, key);
    Py_DECREF(key);
    return node;
}

/* 1 if `node` (the node of key p) matches through p given the match below lo
 * ends at `anchor`; fills path[lo..p]. 0 if not, -1 on error. */
static int walk_back(Walk *walk, PyObject *node, Py_ssize_t p, Py_ssize_t lo, PyObject *anchor) {
    if (walk->slotted == NULL) learn_slots(walk, Py_TYPE(node));
    for (Py_ssize_t position = p;; position--) {
        PyObject *state = field(walk, node, FIELD_STATE);
        if (state == NULL) return -1;
        if (state != walk->sealed) return 0;
        if (position != p) { /* reached through a parent link: is it key `position`? */
            PyObject *key = field(walk, node, FIELD_KEY);
            if (key == NULL) return -1;
            if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != walk->key_bytes ||
                memcmp(PyBytes_AS_STRING(key), walk->keys + position * walk->key_bytes, walk->key_bytes) != 0) {
                return 0;
            }
        }
        walk->path[position] = node;
        PyObject *up = field(walk, node, FIELD_PARENT);
        if (up == NULL) return -1;
        if (position == lo) return up == anchor;
        if (up == Py_None) return 0;
        node = up;
    }
}

/* 1 if keys lo..m-1 match on top of `anchor`, 0 if not, -1 on error. */
static int reaches(Walk *walk, Py_ssize_t m, Py_ssize_t lo, PyObject *anchor) {
    PyObject *node = probe(walk, m - 1);
    if (node == NULL) return PyErr_Occurred() ? -1 : 0;
    return walk_back(walk, node, m - 1, lo, anchor);
}

/* The matched length, path[0..length-1] its nodes; -1 on error. */
static Py_ssize_t matched_length(Walk *walk, Py_ssize_t count, PyObject *parent) {
    int full = count > 0 ? reaches(walk, count, 0, parent) : 0;
    if (full != 0) return full < 0 ? -1 : count;
    Py_ssize_t lo = 0, hi = count - 1; /* lo keys match; more than hi do not */
    PyObject *anchor = parent;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo + 1) / 2;
        int found = reaches(walk, mid, lo, anchor);
        if (found < 0) return -1;
        if (found) {
            anchor = walk->path[mid - 1];
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

static int intern_names(void) {
    static const char *const spelled[FIELDS] = {"parent", "state", "key"};
    for (int which = 0; which < FIELDS; which++) {
        if (names[which] == NULL && (names[which] = PyUnicode_InternFromString(spelled[which])) == NULL) return -1;
    }
    return 0;
}

PyObject *kvd_match_chain(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *nodes, *parent, *sealed;
    Py_buffer keys;
    Py_ssize_t key_bytes;
    if (!PyArg_ParseTuple(args, "O!y*nOO", &PyDict_Type, &nodes, &keys, &key_bytes, &parent, &sealed)) {
        return NULL;
    }
    PyObject *found = NULL;
    PyObject **path = NULL;
    if (key_bytes <= 0 || keys.len % key_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of keys are not a whole number of %zd-byte keys", keys.len,
                     key_bytes);
        goto done;
    }
    if (intern_names() < 0) goto done;
    Py_ssize_t count = keys.len / key_bytes;
    path = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(PyObject *));
    if (path == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Walk walk = {.nodes = nodes, .sealed = sealed, .keys = keys.buf, .key_bytes = key_bytes, .path = path};
    Py_ssize_t length = matched_length(&walk, count, parent);
    if (length < 0 || (found = PyList_New(length)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < length; i++) {
        PyList_SET_ITEM(found, i, Py_NewRef(path[i]));
    }
done:
    PyMem_Free(path);
    PyBuffer_Release(&keys);
    return found;
}
