"""How much of a decode step is its matmuls: the step's time over the time of the same linear
layers (every ``*Linear`` and the LM head: same weights, same rows) run back to back alone.

Used by ``bench --sweep`` (design-brief target: embedded model, batch-32 decode step <= 1.4x
its matmuls alone). The calls are recorded during one real decode step, run eagerly, through
``minivllm.layers.prepack.linear`` (the function every linear layer calls), so the replay
takes the same path (the panel GEMM, oneDNN or ``F.linear``) on inputs of the same shapes.
Int8 layers do not go through it and are not counted.

On a CPU the replay is itself recorded as a CPU graph (``minivllm/layers/cpu_graph.py``) and,
where every call is a panel GEMM with a C twin, timed as one C loop over the kernels: the step's
own graph calls its GEMMs that way, so the matmuls' time carries no Python. (Timed through
``prepack.linear`` from Python instead, the embedded model's 17 batch-32 matmuls took 14-25 us a
call more, 0.25-0.42 ms of a 2.2-2.8 ms pass, and the step's ratio to them read 11-18% lower:
docs/benchmarks.md, 2026-12-06.) Elsewhere (oneDNN, ``F.linear``, a GPU) the calls are made from
Python, as recorded.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

import minivllm.layers.embedding as embedding_mod
import minivllm.layers.linear as linear_mod
from minivllm.layers import prepack
from minivllm.layers.cpu_graph import CpuGraph, NotCapturable

__all__ = ["LinearReplay", "eager_steps", "record_linear_calls", "time_linear_calls"]

_USERS = (linear_mod, embedding_mod)  # modules that call prepack.linear by name


@contextlib.contextmanager
def record_linear_calls():
    """Within the block, every ``prepack.linear`` call made by the layers is appended to the
    yielded list as ``(input shape, dtype, device, weight, bias)``, and so is the LM head's
    ``prepack.linear_greedy`` (a greedy step's head, which also finds each row's token: the
    replay times its matmul alone, through ``prepack.linear``)."""
    calls = []
    real, real_greedy = prepack.linear, prepack.linear_greedy
    saved_greedy = embedding_mod.linear_greedy  # (restored as found: blocks may nest)

    def recording(x, weight, bias=None):
        calls.append((tuple(x.shape), x.dtype, x.device, weight, bias))
        return real(x, weight, bias)

    def recording_greedy(x, weight, cols):
        out = real_greedy(x, weight, cols)
        if out is not None:  # else the head calls linear next, recorded there
            calls.append((tuple(x.shape), x.dtype, x.device, weight, None))
        return out

    saved = [(m, m.linear) for m in _USERS]
    try:
        for m in _USERS:
            m.linear = recording
        embedding_mod.linear_greedy = recording_greedy
        yield calls
    finally:
        for m, fn in saved:
            m.linear = fn
        embedding_mod.linear_greedy = saved_greedy


@contextlib.contextmanager
def eager_steps(engine):
    """Within the block, ``engine``'s steps run their forward eagerly (a decode graph's replay
    calls no layer, so :func:`record_linear_calls` would see only the LM head)."""
    runner = engine.runner
    saved, runner.graph_runner = runner.graph_runner, None
    try:
        yield
    finally:
        runner.graph_runner = saved


class LinearReplay:
    """The calls from :func:`record_linear_calls`, replayable on fresh random inputs of the
    recorded shapes (made once, before any clock starts).

    Attributes:
        from_c: the calls are replayed as a CPU graph from one C loop (see the module docstring),
            not made one by one from Python.
    """

    def __init__(self, calls):
        self.calls = [(torch.randn(shape, dtype=dtype, device=device), weight, bias)
                      for shape, dtype, device, weight, bias in calls]
        self.cuda = any(x.device.type == "cuda" for x, _, _ in self.calls)
        self._graph = None if self.cuda or not self.calls else self._record()

    @property
    def from_c(self) -> bool:
        """Whether the calls replay as a CPU graph from C (else one by one from Python)."""
        return self._graph is not None

    @torch.inference_mode()
    def _record(self) -> CpuGraph | None:
        """The calls as a CPU graph that replays in C (each output in the graph's own pool), or
        None where one of them has no C twin (oneDNN, ``F.linear``) or the replay library is
        not built."""
        graph = CpuGraph()
        try:
            with graph.capture():
                for x, weight, bias in self.calls:
                    prepack.linear(x, weight, bias)
        except NotCapturable:
            return None
        return graph if graph.replays_in_c else None

    @torch.inference_mode()
    def seconds(self) -> float:
        """Wall time of one pass over every call, back to back."""
        if self._graph is not None:
            t0 = time.perf_counter()
            self._graph.replay()
            return time.perf_counter() - t0
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, weight, bias in self.calls:
            prepack.linear(x, weight, bias)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def time_linear_calls(calls, repeats: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``repeats`` passes over ``calls`` (after ``warmup`` passes)."""
    replay = LinearReplay(calls)
    for _ in range(warmup):
        replay.seconds()
    return statistics.median(replay.seconds() for _ in range(repeats)) * 1e3
