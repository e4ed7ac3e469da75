"""The CPU graphs' per-step model check: is the model still the one they were recorded from?

Before every replay the decode graphs ask a :class:`ModelWatch` (one per graph runner,
``cuda_graph.py``) whether a step may replay: no forward hook, the same submodules in the same
order, the same tensor (or ``None``) in every parameter and buffer slot, those tensors at the
same addresses. In Python the first three read every module's dicts through a few C-level
``map``s and the fourth calls ``data_ptr`` on every parameter: ~6.6 us a step for the embedded
model (55 modules, 35 parameters; Zen 4, 2026-12-04), a third of the engine's stubbed batch-1
step. Its common answer ("nothing changed") comes from C: ``csrc/model_check.c`` does all four
in one pass, as a builtin function (called like ``len``, not through ``ctypes``). It only
answers "unchanged"; on anything else the Python check runs and decides what changed, so the
two cannot disagree on a change.

On the 2-core Xeon (2026-12-06) the C pass took 5.6-6.1 us a step for the embedded model, 3.6 us
of it the 35 ``data_ptr`` calls. ``csrc/tensor_data.cpp``, built with a C++ compiler against the
installed torch's headers, reads those addresses from the tensors' TensorImpls instead (the pass
then took 2.5 us): the watch gives the C pass a :class:`TensorHold` of its tensors (:func:`hold`);
without that library the C pass calls ``data_ptr``.

``MINIVLLM_C_MODEL_CHECK=0`` (read when each engine starts) keeps the Python check; without a C
compiler or Python's headers the engine keeps it too, and the startup log says which.
"""
from __future__ import annotations

import ctypes
import logging
import sysconfig
from itertools import chain
from operator import getitem, is_
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.modules.module as _module_mod

from minivllm.layers.native_build import NativeLibrary

__all__ = ["ENV_SWITCH", "ModelWatch", "TensorHold", "describe", "hold", "load", "unavailable_reason"]

logger = logging.getLogger("minivllm")

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


def _addresses(params) -> tuple:
    """Each tensor's storage address; an opaque (oneDNN-packed) tensor has none: its id stands in."""
    try:
        return tuple(map(torch.Tensor.data_ptr, params))
    except RuntimeError:
        return tuple(id(p) if p.is_mkldnn else p.data_ptr() for p in params)


class _Weights(NamedTuple):
    """What the parameter slots held when the CPU graphs were (re)recorded: every slot's value
    (None for an empty one; held, so the memory stays valid), the tensors among them and those
    tensors' addresses (``_addresses``)."""
    params: list
    tensors: list
    addresses: tuple


class ModelWatch:
    """Whether a model is still the one a runner's CPU graphs were recorded from.

    A recorded graph calls kernels on the tensors it saw, so a replay would miss a forward hook,
    a swapped submodule, or a parameter given another tensor or storage. :meth:`hooked` runs
    before every replay; where the modules or the weights changed it calls ``on_change`` (the
    runner drops its graphs, which are recorded again at their next step).

    Args:
        on_change: called with no argument when the graphs no longer match the model.
        use_c: answer "nothing changed" through the C pass where it is built (:func:`load`).
    """

    def __init__(self, on_change: Callable[[], None], use_c: bool = True):
        self._on_change = on_change
        self._modules: list | None = None  # the model's modules, listed at first use
        self._weights: _Weights | None = None  # the parameters the CPU graphs were recorded with
        self._slot_dicts: list = []  # where those parameters are: module._parameters dicts and keys
        self._slot_keys: list = []
        #: the C check's "nothing changed", None: Python only
        self._c_unchanged = load() if use_c else None
        self._c_args: tuple | None = None  # its eight lists, set once the modules and weights are listed
        self._tensor_hold: TensorHold | None = None  # the tensors' ninth item, while it is armed

    def hooked(self, model) -> bool:
        """True when a module of ``model`` has a forward hook or pre-hook (or one is registered for
        all modules): a replay calls no module, so such a step runs eagerly. ``on_change`` is called
        when the graphs may no longer match: since the last call a submodule was swapped, added or
        removed (whatever the answer), or (answering False) a parameter or buffer slot, empty ones
        included, was given another tensor, emptied or removed, or such a tensor new storage, or the
        model is listed for the first time (the first call, or the first after :meth:`forget`).

        Runs before every replay, so it reads little, in C-level ``map``s over lists made once:
        whether any hook dict is non-empty, the submodules (compared as a list: by identity, as
        ``nn.Module`` defines no ``__eq__``), whether the parameter slots hold the tensors (or
        None) they held, and those tensors' data pointers. All four in one C pass when it is
        built, which answers only "unchanged": otherwise the Python check below runs and decides."""
        args = self._c_args
        if args is not None and self._c_unchanged(args):
            return False
        self._c_args = None  # listed again below if anything changed
        if self._modules is not None and list(chain.from_iterable(map(dict.values, self._child_dicts))) != self._children:
            logger.info("CPU graphs: the model's modules changed; recording the graphs again")
            self._modules, self._weights = None, None
            self._on_change()
        if self._modules is None:
            modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
            # registering a hook adds to these dicts in place; an empty dict is falsy
            self._hook_dicts = ([m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]
                                + [_module_mod._global_forward_hooks, _module_mod._global_forward_pre_hooks])
            self._child_dicts = [m._modules for m in modules]
            self._children = list(chain.from_iterable(map(dict.values, self._child_dicts)))
            self._modules = modules  # last: an interrupt above leaves the listing to the next call
        if any(self._hook_dicts):
            return True
        w = self._weights
        if w is not None:
            try:
                same = all(map(is_, map(getitem, self._slot_dicts, self._slot_keys), w.params))
            except KeyError:  # a parameter removed
                same = False
            if same and _addresses(w.tensors) == w.addresses:
                self._arm()
                return False  # the same tensors (held, so no other can take their ids) on the same storage
            logger.info("CPU graphs: the model's parameters changed; recording the graphs again")
        self._on_change()
        # buffers too: an int8 layer's scale (a buffer) is replaced with its int8 panels when it is quantised again
        slots = [(d, k) for m in self._modules for d in (m._parameters, m._buffers) for k in d]
        self._slot_dicts, self._slot_keys = [d for d, _ in slots], [k for _, k in slots]
        params = [d[k] for d, k in slots]
        tensors = [p for p in params if p is not None]
        self._weights = _Weights(params, tensors, _addresses(tensors))
        self._arm()
        return False

    def forget(self) -> None:
        """Drop everything listed, the hold on the weights included: the next :meth:`hooked` lists
        the model again (after the graphs were dropped, or with the model itself)."""
        self.disarm()
        self._modules, self._weights = None, None

    def _arm(self) -> None:
        """After the Python check found the model as recorded: hand the C check its lists (set
        last, so an interrupt while listing leaves the next step to the Python check)."""
        if self._c_unchanged is not None:
            self.disarm()  # first: the lines below replace (and so free) the hold
            w = self._weights
            addresses = [None if t.is_mkldnn else a for t, a in zip(w.tensors, w.addresses)]  # opaque: no data_ptr
            args = (self._hook_dicts, self._child_dicts, self._children, self._slot_dicts, self._slot_keys,
                    w.params, w.tensors, addresses)
            # the addresses read from the TensorImpls where tensor_data.cpp is built (~3.6 us less a step)
            held = [(t, a) for t, a in zip(w.tensors, addresses) if a is not None]
            self._tensor_hold = hold([t for t, _ in held], [a for _, a in held])
            self._c_args = args if self._tensor_hold is None else args + (self._tensor_hold.check,)

    def disarm(self) -> None:
        """Drop the C check's lists, then its hold (a weak reference to each weight's TensorImpl,
        :class:`TensorHold`): in this order no list ever names a freed hold."""
        self._c_args = None
        self._tensor_hold = None
