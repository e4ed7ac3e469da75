/* The CPU graphs' per-step model check (minivllm/engine/cuda_graph.py, _model_changed), its
 * "nothing changed" answer in one C pass instead of three Python-level passes (~8 us a step for
 * the embedded model's 55 modules; the address check stays in Python: it needs torch).
 *
 * It only ever says "unchanged" when the Python check would: any doubt (a dict grown, an
 * object of another type where a list or dict was) returns 0, and the caller then runs the
 * Python check, which decides what changed. Called through ctypes.PyDLL, so with the GIL held;
 * every reference here is borrowed and nothing is allocated.
 */
#include <Python.h>

/* 1 when every dict in `dicts` (a list) is empty. */
static int all_empty(PyObject *dicts) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dicts); i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i);
        if (!PyDict_Check(d) || PyDict_GET_SIZE(d) != 0)
            return 0;
    }
    return 1;
}

/* 1 when the values of the dicts in `dicts`, in their order, are the objects of `expected`. */
static int same_values(PyObject *dicts, PyObject *expected) {
    Py_ssize_t k = 0, n = PyList_GET_SIZE(expected);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dicts); i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i), *key, *value;
        Py_ssize_t pos = 0;
        if (!PyDict_Check(d))
            return 0;
        while (PyDict_Next(d, &pos, &key, &value)) {
            if (k == n || PyList_GET_ITEM(expected, k) != value)
                return 0;
            k++;
        }
    }
    return k == n;
}

/* 1 when dicts[i][keys[i]] is expected[i] for every i. */
static int same_slots(PyObject *dicts, PyObject *keys, PyObject *expected) {
    Py_ssize_t n = PyList_GET_SIZE(dicts);
    if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(expected) != n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i);
        if (!PyDict_Check(d))
            return 0;
        PyObject *value = PyDict_GetItemWithError(d, PyList_GET_ITEM(keys, i));
        if (value == NULL) {  /* the slot was removed (or its key's hash raised) */
            PyErr_Clear();
            return 0;
        }
        if (value != PyList_GET_ITEM(expected, i))
            return 0;
    }
    return 1;
}

/* args: (hook_dicts, child_dicts, children, slot_dicts, slot_keys, slot_values), six lists.
 * 1: no hook dict holds a hook, the child dicts hold `children` in order, every parameter slot
 * holds what it held; 0: something differs (or args are not six lists). */
int model_unchanged(PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 6)
        return 0;
    for (Py_ssize_t i = 0; i < 6; i++)
        if (!PyList_Check(PyTuple_GET_ITEM(args, i)))
            return 0;
    return all_empty(PyTuple_GET_ITEM(args, 0))
        && same_values(PyTuple_GET_ITEM(args, 1), PyTuple_GET_ITEM(args, 2))
        && same_slots(PyTuple_GET_ITEM(args, 3), PyTuple_GET_ITEM(args, 4), PyTuple_GET_ITEM(args, 5));
}
