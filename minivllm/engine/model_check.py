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

__all__ = ["ENV_SWITCH", "describe", "load", "unavailable_reason"]

SOURCE = Path(__file__).with_name("csrc") / "model_check.c"
ENV_SWITCH = "MINIVLLM_C_MODEL_CHECK"


def _wrap(lib: ctypes.PyDLL) -> Callable[[tuple], bool]:
    make = lib.make_model_unchanged
    make.argtypes = [ctypes.py_object]
    make.restype = ctypes.py_object
    return make(torch.Tensor.data_ptr)


_library = NativeLibrary(SOURCE, ENV_SWITCH, _wrap, python_api=True)
_FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def load() -> Callable[[tuple], bool] | None:
    """``model_unchanged(args) -> bool``, ``args`` the eight lists ``(hook_dicts, child_dicts,
    children, slot_dicts, slot_keys, slot_values, tensors, addresses)``: True when every hook dict
    is empty, the child dicts' values in order are ``children`` (by identity),
    ``slot_dicts[i][slot_keys[i]] is slot_values[i]`` for every ``i`` and
    ``tensors[i].data_ptr() == addresses[i]`` for every ``i`` whose address is not ``None`` (an
    opaque oneDNN tensor, whose slot identity is its check); else False. ``None`` when switched
    off, unbuildable, or on a free-threaded Python (the C pass reads the dicts through borrowed
    references, safe only while the GIL keeps other threads out)."""
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
    return f"C ({_library.path})"
