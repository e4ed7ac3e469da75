"""The CPU graphs' per-step model check, its common answer ("nothing changed") in C.

Before every replay the decode graphs check that the model is the one they recorded
(``CudaGraphDecodeRunner._model_changed`` in ``cuda_graph.py``): no forward hook, the same
submodules in the same order, the same tensor (or ``None``) in every parameter and buffer slot, those tensors
at the same addresses. In Python the first three read every module's dicts through a few C-level
``map``s and the fourth calls ``data_ptr`` on every parameter: ~6.6 us a step for the embedded
model (55 modules, 35 parameters; Zen 4, 2026-12-04), a third of the engine's stubbed batch-1
step. ``csrc/model_check.c`` does all four in one pass, as a builtin function (called like
``len``, not through ``ctypes``). It only answers "unchanged"; on anything else the Python check
runs and decides what changed, so the two cannot disagree on a change.

On the 2-core Xeon (2026-12-06) the C pass took 5.6-6.1 us a step for the embedded model, 3.6 us
of it the 35 ``data_ptr`` calls. ``csrc/tensor_data.cpp``, built with a C++ compiler against the
installed torch's headers, reads those addresses from the tensors' TensorImpls instead (the pass
then took 2.5 us): the engine gives the C pass a :class:`TensorHold` of its tensors (:func:`hold`);
without that library the C pass calls ``data_ptr``.

``MINIVLLM_C_MODEL_CHECK=0`` (read when each engine starts) keeps the Python check; without a C
compiler or Python's headers the engine keeps it too, and the startup log says which.
"""
from __future__ import annotations

import ctypes
import sysconfig
from pathlib import Path
from typing import Callable

import torch

from minivllm.layers.native_build import NativeLibrary

__all__ = ["ENV_SWITCH", "TensorHold", "describe", "hold", "load", "unavailable_reason"]

SOURCE = Path(__file__).with_name("csrc") / "model_check.c"
TENSOR_DATA_SOURCE = Path(__file__).with_name("csrc") / "tensor_data.cpp"
ENV_SWITCH = "MINIVLLM_C_MODEL_CHECK"


def _wrap(lib: ctypes.PyDLL) -> Callable[[tuple], bool]:
    make = lib.make_model_unchanged
    make.argtypes = [ctypes.py_object]
    make.restype = ctypes.py_object
    return make(torch.Tensor.data_ptr)


_library = NativeLibrary(SOURCE, ENV_SWITCH, _wrap, python_api=True)
_FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _wrap_tensor_data(lib: ctypes.PyDLL) -> ctypes.PyDLL:
    p64 = ctypes.POINTER(ctypes.c_int64)
    lib.tensor_data_hold.argtypes = [p64, p64, p64, ctypes.c_int64]
    lib.tensor_data_hold.restype = ctypes.c_void_p
    lib.tensor_data_release.argtypes = [ctypes.c_void_p]
    lib.tensor_data_release.restype = None
    lib.tensor_data_unchanged.argtypes = [ctypes.c_void_p]
    lib.tensor_data_unchanged.restype = ctypes.c_int
    return lib


_tensor_data = NativeLibrary(TENSOR_DATA_SOURCE, ENV_SWITCH, _wrap_tensor_data, torch_api=True)


class TensorHold:
    """A hold of tensors (``csrc/tensor_data.cpp``): a weak reference to each tensor's TensorImpl
    (its memory stays valid while held), taken now and given back when this object is freed, with
    the Python object it belongs to and where its data is. ``check`` is the ninth item of the C
    pass's arguments (see :func:`load`): it then reads the addresses from the TensorImpls. While
    held, ``torch.utils.swap_tensors`` refuses these tensors (it counts the weak references).

    Args:
        tensors: the tensors (not opaque oneDNN ones: those have no data pointer).
        addresses: each one's ``data_ptr()`` when the graphs were recorded.
    """

    def __init__(self, lib: ctypes.PyDLL, tensors: list[torch.Tensor], addresses: list[int]):
        n = len(tensors)
        if len(addresses) != n:
            raise ValueError(f"{n} tensors but {len(addresses)} addresses")
        arrays = [(ctypes.c_int64 * n)(*values)
                  for values in ([t._cdata for t in tensors], list(map(id, tensors)), addresses)]
        self._release = lib.tensor_data_release
        self._held = lib.tensor_data_hold(*arrays, n)
        if not self._held:
            raise MemoryError("tensor_data_hold: out of memory")
        self.check = (ctypes.cast(lib.tensor_data_unchanged, ctypes.c_void_p).value, self._held)

    def __del__(self) -> None:
        held, self._held = getattr(self, "_held", None), None
        if held:
            self._release(held)


def hold(tensors: list[torch.Tensor], addresses: list[int]) -> TensorHold | None:
    """A :class:`TensorHold` of ``tensors``, or ``None`` where ``tensor_data.cpp`` could not be
    built (no C++ compiler, no torch headers) or the C pass is switched off."""
    lib = _tensor_data.load()
    return None if lib is None else TensorHold(lib, tensors, addresses)


def load() -> Callable[[tuple], bool] | None:
    """``model_unchanged(args) -> bool``, ``args`` the eight lists ``(hook_dicts, child_dicts,
    children, slot_dicts, slot_keys, slot_values, tensors, addresses)``: True when every hook dict
    is empty, the child dicts' values in order are ``children`` (by identity),
    ``slot_dicts[i][slot_keys[i]] is slot_values[i]`` for every ``i`` and
    ``tensors[i].data_ptr() == addresses[i]`` for every ``i`` whose address is not ``None`` (an
    opaque oneDNN tensor, whose slot identity is its check); else False. With a ninth item, a
    :class:`TensorHold`'s ``check`` of those tensors, the hold answers the last part instead.
    ``None`` when switched off, unbuildable, or on a free-threaded Python (the C pass reads the
    dicts through borrowed references, safe only while the GIL keeps other threads out)."""
    if _FREE_THREADED:
        return None
    return _library.load()


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it did not)."""
    if _FREE_THREADED and not _library.switched_off():
        return "a free-threaded Python (the C pass needs the GIL)"
    return _library.unavailable_reason()


def describe() -> str:
    """Which check runs before each replay, for the startup log."""
    if _library.switched_off():
        return f"Python (the C pass is switched off: {_library.unavailable_reason()})"
    if load() is None:
        return f"Python (the C pass is unavailable: {unavailable_reason()})"
    if _tensor_data.load() is None:
        return (f"C ({_library.path}), tensor addresses through Tensor.data_ptr (the TensorImpl reader is "
                f"unavailable: {_tensor_data.unavailable_reason()})")
    return f"C ({_library.path}), tensor addresses read from their TensorImpls ({_tensor_data.path})"
