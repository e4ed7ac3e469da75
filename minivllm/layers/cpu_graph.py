"""CPU graphs: record one forward's calls once, replay them without the Python around them.

On a CPU our decode forward is a few dozen C calls (GEMMs, norms, rotary, attention) wrapped in
module calls, shape checks and tensor allocations; for a small model that Python costs as much
as the arithmetic (the embedded model's batch-1 decode step: ~1.3 ms of GEMM in ~4-5 ms). A CUDA
graph removes the same cost on a GPU by recording kernel launches (``minivllm/engine/cuda_graph.py``);
a :class:`CpuGraph` records the C calls instead, with the pointers they were given, and
:meth:`CpuGraph.replay` makes those calls again in order, nothing else.

The same rules as a CUDA graph follow: inputs must be copied into static buffers before a replay,
the output is read from a static buffer, and every intermediate must sit at the address it had
at capture. So while capturing:

* our C wrappers hand their call to :func:`launch`, which runs it and records it;
* a ``TorchDispatchMode`` sees every ATen operation: view operations (no data moved) are not
  recorded; allocations (``torch.empty`` and kin) are served from the graph's :class:`GraphPool`,
  whose memory lives as long as the graph (a buffer meant to outlive the step is allocated inside
  :func:`persistent` instead); in-place and ``out=`` operations on tensors that keep
  their addresses are recorded and replayed as they are, and a few operations whose result's
  shape depends only on their inputs' shapes (the embedding lookup) are recorded as their
  ``out=`` form writing into the pool; any other operation raises
  :class:`NotCapturable` naming it (its result would be a fresh tensor at replay, invisible to
  the calls after it), and the caller keeps running that forward eagerly.

Graphs share one pool (allocation restarts at its beginning for each capture), as CUDA graphs
share a memory pool: only one replays at a time and each writes every intermediate before it
reads it.

A graph whose every call came with its C function's packed twin (``launch(..., native=...)``,
``csrc/packed_call.h``) is replayed by one C loop (``csrc/cpu_graph_replay.c``): from Python, each
call paid ctypes' conversion of its arguments, about a microsecond for ten of them. Otherwise (an
ATen operation recorded, a call without a twin, the library unbuilt, or
``MINIVLLM_CPU_GRAPH_C_REPLAY=0``) the Python loop makes the calls.

Within :func:`time_replays` every replay also times each of its calls (``bench --sweep`` reports
where a decode step's time goes from it).
"""
from __future__ import annotations

import contextlib
import ctypes
import time
import weakref
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.layers.native_build import NativeLibrary

__all__ = ["CpuGraph", "GraphPool", "NotCapturable", "ReplayTiming", "capturing", "count_calls", "describe_replay",
           "launch", "packed_address", "packed_memmove", "persistent", "time_replays"]

aten = torch.ops.aten

_current: ContextVar["CpuGraph | None"] = ContextVar("minivllm_cpu_graph", default=None)
_tally: ContextVar["Counter[str] | None"] = ContextVar("minivllm_c_call_tally", default=None)
_timings: ContextVar["list[ReplayTiming] | None"] = ContextVar("minivllm_replay_timings", default=None)

#: allocations served from the pool (their result is fresh memory, no values read)
_FACTORIES = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
              aten.empty_strided.default}
#: operations whose output's shape and dtype follow from their inputs' shapes alone: recorded
#: as their ``out=`` overload writing into a pool tensor (the embedding lookup of the token ids)
_SHAPE_STATIC = {aten.embedding.default: aten.embedding.out, aten.index_select.default: aten.index_select.out}
_ALIGNMENT = 64  # bytes: every pool allocation starts on a cache line


class NotCapturable(RuntimeError):
    """A forward did something a CPU graph cannot replay (names the operation)."""


class _CReplay:
    """``csrc/cpu_graph_replay.c``: the loop over packed calls, and a packed ``memmove``."""

    def __init__(self, lib: ctypes.CDLL):
        self.run = lib.cpu_graph_replay
        self.run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self.run.restype = ctypes.c_int64
        self.run_timed = lib.cpu_graph_replay_timed  # (the same, and each call's ns)
        self.run_timed.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
        self.run_timed.restype = ctypes.c_int64
        #: ``copy_bytes_packed``: ``memmove(dst, src, nbytes)`` as a packed call
        self.copy_address = packed_address(lib, "copy_bytes")


_replay_library = NativeLibrary(Path(__file__).with_name("csrc") / "cpu_graph_replay.c", "MINIVLLM_CPU_GRAPH_C_REPLAY",
                                _CReplay)


def packed_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of ``name``'s packed twin (``NAME_packed`` in ``lib``, see ``csrc/packed_call.h``),
    for :func:`launch`'s ``native``."""
    return ctypes.cast(getattr(lib, f"{name}_packed"), ctypes.c_void_p).value


def describe_replay() -> str:
    """For the startup log: how this process's CPU graphs make their calls (from one C loop where
    every call of a graph has a packed twin, else the Python loop, and why)."""
    if _replay_library.load() is not None:
        return f"from one C loop where every call has a C twin ({_replay_library.path})"
    return f"in a Python loop ({_replay_library.unavailable_reason()})"


def packed_memmove() -> int | None:
    """The packed twin of ``memmove(dst, src, nbytes)``, or None without the replay library."""
    replay = _replay_library.load()
    return None if replay is None else replay.copy_address


def capturing() -> "CpuGraph | None":
    """The graph being captured on this thread (or context), else ``None``."""
    return _current.get()


@contextlib.contextmanager
def persistent():
    """Allocations inside the block are ordinary tensors even while a graph is recorded: for
    buffers that outlive the step (a kernel's reusable scratch). Without it they would come from
    the graphs' shared pool, where the next graph recorded puts its own tensors."""
    graph = _current.get()
    if graph is None:
        yield
        return
    graph._outside_pool += 1
    try:
        yield
    finally:
        graph._outside_pool -= 1


def launch(fn: Callable[..., object], *args, name: str | None = None,
           native: tuple[int, tuple] | None = None) -> None:
    """Call ``fn(*args)``; while a graph is captured, also record the call for its replays.

    ``args`` are what the call needs again at replay: pointers (ints) into tensors whose memory
    stays put (static inputs, weights, the KV cache, the pool), sizes, scalars. ``fn`` returns
    nothing useful: a check of its result belongs inside ``fn`` so the replay makes it too.
    ``name``: what :func:`count_calls` counts the call as (the C function's name; default
    ``fn.__name__``). ``native``: where ``fn`` makes one C call, that function's packed twin and
    its arguments, ``(packed_address(lib, name), args)`` (ints, None for a null pointer, floats),
    so that a replay can make the call from C; the twin reports bad input that ``fn`` raises for
    (a replay then calls ``fn`` to raise it).
    """
    fn(*args)
    graph = _current.get()
    if graph is not None:
        graph._record(fn, args, native, name)
    tally = _tally.get()
    if tally is not None:
        tally[name or getattr(fn, "__name__", repr(fn))] += 1


@dataclass(frozen=True)
class ReplayTiming:
    """One timed :meth:`CpuGraph.replay`: each call's name (as :func:`count_calls` names it; a recorded
    ATen operation by its overload, ``aten.embedding.out``) and wall time, in order. Timed between the
    calls from C (``clock_gettime``) where the replay runs in C, else with ``time.perf_counter_ns``
    around each call in the Python loop (then with that loop's cost, ~1 us a call). A timed replay
    takes a few microseconds longer than a plain one (~6 us for the embedded model's 43 calls, on
    the dev EPYC, 2026-12-07; the clock reads, and this record)."""

    names: tuple[str, ...]
    ns: np.ndarray  # int64 [len(names)]: each call's wall time in nanoseconds
    from_c: bool

    @property
    def seconds(self) -> tuple[float, ...]:
        return tuple((self.ns / 1e9).tolist())

    @property
    def total_s(self) -> float:
        return int(self.ns.sum()) / 1e9

    def by_name(self) -> dict[str, float]:
        """Seconds summed per call name, in order of first appearance."""
        out: dict[str, float] = {}
        for n, t in zip(self.names, self.seconds):
            out[n] = out.get(n, 0.0) + t
        return out


@contextlib.contextmanager
def time_replays():
    """Within the block, every :meth:`CpuGraph.replay` (in this thread and context) times each of its
    calls and appends a :class:`ReplayTiming` to the yielded list. The calls and their results are
    the same; only the clock reads between them are added."""
    timings: list[ReplayTiming] = []
    token = _timings.set(timings)
    try:
        yield timings
    finally:
        _timings.reset(token)


@contextlib.contextmanager
def count_calls():
    """Within the block, every call into minivllm's compiled CPU code made through :func:`launch`
    (GEMMs, norms, rotary, SiLU, attention, KV stores: each a call from Python through ``ctypes``,
    with its own host cost, as an ATen operation has) is counted by name in the yielded
    ``Counter``. A CPU graph's replay issues its recorded calls without :func:`launch` and is
    not counted; neither are ATen operations (``torch.profiler`` sees those). Counts the calls
    made in this thread (and context) only."""
    tally: Counter[str] = Counter()
    token = _tally.set(tally)
    try:
        yield tally
    finally:
        _tally.reset(token)


class GraphPool:
    """Memory for the tensors allocated while capturing: one growing list of byte buffers,
    handed out in order (each allocation cache-line aligned). :meth:`rewind` starts the next
    capture at the beginning; a buffer is added when a capture needs more than the pool holds.
    Buffers are never freed while the pool lives (graphs hold raw pointers into them)."""

    def __init__(self, chunk_bytes: int = 1 << 20):
        self._chunk_bytes = chunk_bytes
        self._chunks: list[torch.Tensor] = []
        self._chunk, self._offset = 0, 0
        self._scratch: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(c.numel() for c in self._chunks)

    def scratch(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A work buffer of at least ``numel`` elements shared by every call of every graph of this
        pool that asks for one (a kernel's scores, written before they are read within the call):
        the graphs replay one at a time, and a call's use of it ends when the call returns. Unlike
        a pool allocation it is not one per call: a model's layers all get the same buffer. A larger
        request gets a new buffer; graphs recorded with the old one keep it (``keep_alive``)."""
        buf = self._scratch
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            with persistent():  # an ordinary tensor, not a recording's intermediate
                buf = self._scratch = torch.empty(max(numel, 1), dtype=dtype, device="cpu")
        return buf

    def rewind(self) -> None:
        self._chunk, self._offset = 0, 0

    def allocate(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` in the pool."""
        numel = 1
        for s in shape:
            numel *= int(s)
        need = -(-max(numel * dtype.itemsize, 1) // _ALIGNMENT) * _ALIGNMENT
        while True:
            if self._chunk == len(self._chunks):
                buf = torch.empty(max(self._chunk_bytes, need) + _ALIGNMENT, dtype=torch.uint8)
                self._chunks.append(buf)
            buf = self._chunks[self._chunk]
            start = -buf.data_ptr() % _ALIGNMENT + self._offset
            if start + need <= buf.numel():
                self._offset = start - (-buf.data_ptr() % _ALIGNMENT) + need
                return buf[start:start + numel * dtype.itemsize].view(dtype).view(tuple(int(s) for s in shape))
            self._chunk, self._offset = self._chunk + 1, 0


class _Recorder(TorchDispatchMode):
    """Sorts each ATen operation of a capture (see the module docstring)."""

    def __init__(self, graph: "CpuGraph"):
        super().__init__()
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this says no, and
        # that wrapper imports torch._dynamo at the first operation: 4-7 s on the dev machine, paid
        # by the first decode step of every process. A recording never runs under torch.compile
        # (the engine records no graphs with compile=True), so there is nothing to disable.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and self.graph._outside_pool:
            return func(*args, **kwargs)
        if func in _FACTORIES:
            like = args[0] if func in (aten.empty_like.default, aten.new_empty.default) else None
            shape = args[1] if func is aten.new_empty.default else (like.shape if like is not None else args[0])
            dtype = kwargs.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
            device = kwargs.get("device") or (like.device if like is not None else torch.device("cpu"))
            if torch.device(device).type != "cpu":
                raise NotCapturable(f"CPU graph: {func} allocates on {device}")
            return self.graph._made_in_pool(self.graph.pool.allocate(shape, dtype))
        if func.is_view or func in (aten.detach.default, aten.alias.default, aten._unsafe_view.default):
            return func(*args, **kwargs)
        if func in _SHAPE_STATIC:
            ref = func(*args, **kwargs)  # (once, at capture: gives the output's shape and dtype)
            out = self.graph._made_in_pool(self.graph.pool.allocate(ref.shape, ref.dtype))
            out_func = _SHAPE_STATIC[func]
            out_func(*args, **kwargs, out=out)
            self.graph._record(_call_op, (out_func, args, {**kwargs, "out": out}))
            return out
        schema = func._schema
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not mutates:
            raise NotCapturable(f"CPU graph: {func} returns a new tensor; a replay would not see it")
        out = func(*args, **kwargs)
        self.graph._record(_call_op, (func, args, kwargs))
        return out


def _call_op(func, args, kwargs) -> None:
    func(*args, **kwargs)


class CpuGraph:
    """One recorded forward.

    Usage::

        graph = CpuGraph(pool)
        with graph.capture():
            out_static.copy_(model(ids_static, pos_static, ctx))  # runs for real, and records
        ...                                                       # new inputs into the statics
        graph.replay()                                            # out_static holds the new result

    Attributes:
        num_calls: calls a replay makes.
    """

    def __init__(self, pool: GraphPool | None = None):
        self.pool = pool if pool is not None else GraphPool()
        self._calls: list[tuple[Callable[..., object], tuple]] = []
        self._native: list[tuple[int, tuple] | None] = []  # each call's packed twin, if it has one
        self._names: list[str] | tuple[str, ...] = []  # each call's name (time_replays); a tuple once captured
        self._packed: _PackedCalls | None = None  # all of them, when every call has one
        self._keep: list[object] = []
        self._outside_pool = 0  # > 0 inside persistent()
        self._pool_tensors: list[weakref.ref] = []  # what the recording took from the pool
        self.complete = False

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    @property
    def replays_in_c(self) -> bool:
        """Whether :meth:`replay` makes the calls from one C loop (see the module docstring)."""
        return self._packed is not None

    def _record(self, fn: Callable[..., object], args: tuple, native: tuple[int, tuple] | None = None,
                name: str | None = None) -> None:
        self._calls.append((fn, args))
        self._native.append(native)
        self._names.append(name or (str(args[0]) if fn is _call_op else getattr(fn, "__name__", repr(fn))))

    def _made_in_pool(self, t: torch.Tensor) -> torch.Tensor:
        self._pool_tensors.append(weakref.ref(t))
        return t

    def check_nothing_outlives(self) -> None:
        """After the recorded step has returned: every tensor served from the pool is gone, but
        those the recorded ATen calls hold themselves. One still alive (a buffer some code keeps
        for later steps) would share memory with the tensors of graphs recorded later, and replays
        would overwrite it.

        Raises:
            NotCapturable: such a tensor exists (its shape says which).
        """
        own = {id(a) for fn, call in self._calls if fn is _call_op  # tensors the recorded ATen calls hold
               for a in (*call[1], *call[2].values()) if isinstance(a, torch.Tensor)}
        alive = [t for t in (r() for r in self._pool_tensors) if t is not None and id(t) not in own]
        self._pool_tensors = []
        if alive:
            raise NotCapturable(f"CPU graph: {len(alive)} tensor(s) made while recording outlive the step "
                                f"(first: {tuple(alive[0].shape)} {alive[0].dtype}); a buffer kept for later "
                                "must be allocated inside cpu_graph.persistent()")

    def keep_alive(self, *objs: object) -> None:
        """Hold ``objs`` (tensors a recorded call points into that live outside the pool, or what
        holds them) for the graph's lifetime."""
        self._keep.extend(objs)

    @contextlib.contextmanager
    def capture(self):
        """Run the body for real while recording it. On any exception (:class:`NotCapturable`, a
        ``KeyboardInterrupt``) the graph stays empty and incomplete, and the exception propagates."""
        if _current.get() is not None:
            raise RuntimeError("CPU graph: a capture is already in progress")
        self._calls, self._native, self._keep, self._pool_tensors, self.complete = [], [], [], [], False
        self._names = []
        self._packed = None
        self.pool.rewind()
        token = _current.set(self)
        try:
            with _Recorder(self):
                yield self
            self._packed = _PackedCalls.build(self._native)  # (may build the C loop's library)
            self._names = tuple(self._names)
            self.complete = True
        except BaseException:
            self._calls, self._native, self._keep, self._packed, self._names = [], [], [], None, []
            raise
        finally:
            _current.reset(token)

    def replay(self) -> None:
        """Make the recorded calls again, in order.

        Raises:
            RuntimeError: the graph was not captured completely, or a call's packed twin reported bad
                input that the call made again through ctypes did not.
            Exception: what a recorded call raises for bad input (``IndexError`` naming a token id,
                a position or a KV slot outside its table); the calls after it are not made.
        """
        if not self.complete:
            raise RuntimeError("CPU graph: replay of a graph that was not captured")
        timings = _timings.get()
        packed = self._packed
        if timings is not None:
            bad = self._replay_timed(timings)
        elif packed is None:
            for fn, args in self._calls:
                fn(*args)
            return
        else:
            bad = packed.replay()
        if bad >= 0:  # a twin found bad input: the call again through ctypes raises the error naming it
            fn, args = self._calls[bad]
            fn(*args)
            raise RuntimeError(f"CPU graph: recorded call {bad} ({getattr(fn, '__name__', fn)}) reported bad "
                               "input in C but not when made again")

    def _replay_timed(self, timings: list[ReplayTiming]) -> int:
        """The replay, each call timed (:func:`time_replays`); returns what the C loop returns (-1, or
        the call that reported bad input). The timing is appended when every call was made."""
        packed = self._packed
        if packed is not None:
            bad, ns = packed.replay_timed()
        else:
            ns = []
            for fn, args in self._calls:
                t0 = time.perf_counter_ns()
                fn(*args)  # (an exception propagates: no timing)
                ns.append(time.perf_counter_ns() - t0)
            bad = -1
        if bad < 0:
            timings.append(ReplayTiming(self._names, np.array(ns, dtype=np.int64), packed is not None))
        return bad


class _PackedCalls:
    """A graph's calls as arrays for ``cpu_graph_replay``: each twin's address, where its
    arguments start, and the arguments (8 bytes each: int64, or a float's double bits)."""

    def __init__(self, replay: _CReplay, natives: list[tuple[int, tuple]]):
        self._run = replay.run
        self.fns = np.array([address for address, _ in natives], dtype=np.int64)
        self.starts = np.zeros(len(natives), dtype=np.int64)
        slots: list = []
        for i, (_, args) in enumerate(natives):
            self.starts[i] = len(slots)
            slots.extend(args)
        self.args = np.zeros(max(1, len(slots)), dtype=np.int64)
        as_double = self.args.view(np.float64)
        for i, value in enumerate(slots):
            if isinstance(value, float):
                as_double[i] = value
            else:
                self.args[i] = 0 if value is None else value
        self._call = (self.fns.ctypes.data, self.starts.ctypes.data, self.args.ctypes.data, len(natives))
        self._run_timed = replay.run_timed
        self._ns = np.zeros(len(natives), dtype=np.int64)  # each call's time in a timed replay (read at once)

    @classmethod
    def build(cls, natives: list[tuple[int, tuple] | None]) -> "_PackedCalls | None":
        if not natives or any(n is None for n in natives):
            return None
        replay = _replay_library.load()
        return None if replay is None else cls(replay, natives)

    def replay(self) -> int:
        """-1, or the index of the first call that reported bad input (the later ones not made)."""
        return self._run(*self._call)

    def replay_timed(self) -> tuple[int, np.ndarray]:
        """:meth:`replay`'s result, and each call's wall time (int64 ``[num_calls]``, nanoseconds; a buffer
        the next timed replay overwrites)."""
        return self._run_timed(*self._call, self._ns.ctypes.data), self._ns
