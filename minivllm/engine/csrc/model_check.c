/* The CPU graphs' per-step model check (ModelWatch.hooked in minivllm/engine/model_check.py), its
 * "nothing changed" answer in one C pass instead of four Python-level passes (~6.6 us a step
 * for the embedded model's 55 modules and 35 parameters, a third of a stubbed batch-1 step).
 *
 * It only ever says "unchanged" when the Python check would: any doubt (a dict grown, an
 * object of another type where a list or dict was, a data_ptr call that raised) returns 0, and
 * the caller then runs the Python check, which decides what changed. The check is a builtin
 * function object (make_model_unchanged below): called as one, not through ctypes, it costs
 * ~50 ns to call instead of ~1 us. It runs with the GIL held; every reference it reads is
 * borrowed, and the one it makes (data_ptr's int) is released before it returns. Where the C++
 * source beside it was built (tensor_data.cpp), the engine passes a hold of the tensors and the
 * addresses are read from their TensorImpls instead of through data_ptr.
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

/* 1 when data_ptr(tensors[i]) == addresses[i] for every i whose address is not None (an
 * opaque oneDNN tensor has no data pointer: its slot's identity, checked above, is its check). */
static int same_addresses(PyObject *data_ptr, PyObject *tensors, PyObject *addresses) {
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    if (PyList_GET_SIZE(addresses) != n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *expected = PyList_GET_ITEM(addresses, i);
        if (expected == Py_None)
            continue;
        PyObject *t = PyList_GET_ITEM(tensors, i);
        PyObject *now = PyObject_Vectorcall(data_ptr, &t, 1, NULL);
        if (now == NULL) {
            PyErr_Clear();
            return 0;
        }
        int same = PyLong_CheckExact(now) && PyLong_CheckExact(expected)
                   && PyLong_AsVoidPtr(now) == PyLong_AsVoidPtr(expected);
        Py_DECREF(now);
        if (PyErr_Occurred()) {  /* an int out of a pointer's range: not ours */
            PyErr_Clear();
            return 0;
        }
        if (!same)
            return 0;
    }
    return 1;
}

/* The address check of tensor_data.cpp (tensor_data_unchanged): 1 when every tensor of a hold is
 * where it was. `check` is (that function's address, the hold's address), two ints; -1 when it is
 * not such a pair. */
typedef int held_check_fn(const void *held);

static int held_unchanged(PyObject *check) {
    if (!PyTuple_Check(check) || PyTuple_GET_SIZE(check) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(check, 0))
        || !PyLong_CheckExact(PyTuple_GET_ITEM(check, 1)))
        return -1;
    held_check_fn *fn = (held_check_fn *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(check, 0));
    const void *held = PyLong_AsVoidPtr(PyTuple_GET_ITEM(check, 1));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return fn && held ? fn(held) : -1;
}

/* self: torch.Tensor.data_ptr. args: (hook_dicts, child_dicts, children, slot_dicts, slot_keys,
 * slot_values, tensors, addresses), eight lists, and optionally a ninth item: a hold of those
 * tensors (tensor_data.cpp, see held_unchanged), which then answers the address part instead of
 * a data_ptr call per tensor. True: no hook dict holds a hook, the child dicts hold `children` in
 * order, every parameter or buffer slot holds what it held, every tensor is where it was; False:
 * something differs (or args are not of that shape). */
static PyObject *model_unchanged(PyObject *self, PyObject *args) {
    if (!PyTuple_Check(args) || (PyTuple_GET_SIZE(args) != 8 && PyTuple_GET_SIZE(args) != 9))
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < 8; i++)
        if (!PyList_Check(PyTuple_GET_ITEM(args, i)))
            Py_RETURN_FALSE;
    if (!all_empty(PyTuple_GET_ITEM(args, 0))
        || !same_values(PyTuple_GET_ITEM(args, 1), PyTuple_GET_ITEM(args, 2))
        || !same_slots(PyTuple_GET_ITEM(args, 3), PyTuple_GET_ITEM(args, 4), PyTuple_GET_ITEM(args, 5)))
        Py_RETURN_FALSE;
    if (PyTuple_GET_SIZE(args) == 9) {
        if (held_unchanged(PyTuple_GET_ITEM(args, 8)) == 1)
            Py_RETURN_TRUE;
        Py_RETURN_FALSE;
    }
    if (same_addresses(self, PyTuple_GET_ITEM(args, 6), PyTuple_GET_ITEM(args, 7)))
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyMethodDef model_unchanged_def = {
    "model_unchanged", model_unchanged, METH_O,
    "model_unchanged(args: tuple of 8 lists [, hold]) -> bool (see minivllm/engine/model_check.py)"};

/* The check as a builtin function whose self is `data_ptr` (torch.Tensor.data_ptr): a new
 * reference, or NULL with an exception set. Called once, through ctypes. */
PyObject *make_model_unchanged(PyObject *data_ptr) {
    return PyCFunction_New(&model_unchanged_def, data_ptr);
}
