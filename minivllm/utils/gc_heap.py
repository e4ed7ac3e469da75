"""Steps run with the process's older objects out of Python's garbage collector (``gc.freeze``).

Why: a full collection walks every tracked object in the process. With torch, transformers and
the embedded model loaded (~220k objects) one took 98 ms in the middle of 60 batch-32 decode
steps of ~6 ms (dev EPYC, 2026-12-03), and 86-103 ms landed in the input preparation of a
4004-token prefill stepped by hand (2026-12-04): a step's timings then show the collector, not the
engine. Frozen objects are skipped by every collection, so a collection triggered inside a step
walks only what the steps made.

vLLM freezes its server's heap once, after start-up (``freeze_gc_heap`` in
``vllm/utils/gc_utils.py``). Here the process is the user's (a notebook, a script), so the freeze
lasts only while steps run: :func:`heap_frozen` around a ``LLM.generate`` call, around each of a
``LLM.stream``'s stepping turns (never across its yields: a freeze then held the consumer's objects,
the stream itself included, out of every collection), the benchmarks' timed runs and the widgets'
and course helpers' stepping loops, once around each loop, never around each bare
``LLMEngine.step()``: ``gc.freeze`` also resets the collector's count of new objects, so in a loop
frozen step by step, steps making fewer objects than the first threshold (700) would never start a
collection and garbage cycles would pile up. A cycle frozen with the rest is collected after the
freeze is undone, as if no freeze had happened.
"""
from __future__ import annotations

import contextlib
import gc
import threading

__all__ = ["caller_froze_heap", "heap_frozen"]

_lock = threading.Lock()
#: one token per ``heap_frozen`` block inside (gc.freeze is process-wide: the last one out undoes it).
#: A block adds its token (one C call) before it freezes and, on the way out, unfreezes before it
#: removes its token, so an interrupt (a learner's KeyboardInterrupt lands between any two
#: bytecodes) anywhere in this bookkeeping never leaves the heap frozen with no block inside, which
#: would keep that moment's objects out of every collection for good (a counter incremented after
#: ``gc.freeze()`` could). The worst it leaves is a stale token: later blocks then run unfrozen.
_holders: list[object] = []


def caller_froze_heap() -> bool:
    """Someone other than :func:`heap_frozen` has frozen the heap (``gc.freeze``). Ask it once per
    stepping loop, not per step: ``gc.get_freeze_count`` walks the frozen objects (19.9 ms for the
    219,198 of a process holding torch, transformers and an embedded-model ``LLM``, one call; 2-core Xeon dev VM, 2026-12-06;
    nothing to walk when nothing is frozen)."""
    with _lock:
        return not _holders and gc.get_freeze_count() > 0


@contextlib.contextmanager
def heap_frozen(enabled: bool | None = None):
    """Run the block with the objects that exist when it starts frozen (``gc.freeze``), undone
    when it ends, also by an exception. Threads inside at once share one freeze, undone when the
    last of them is out. ``enabled``: ``None`` asks :func:`caller_froze_heap` (a freeze the caller
    made is then left as it is: neither extended nor undone); ``False`` does nothing; ``True``
    freezes without asking (a loop that asked once already)."""
    if enabled is None:
        enabled = not caller_froze_heap()
    if not enabled:
        yield
        return
    token = object()
    try:
        with _lock:
            _holders.append(token)  # first: an interrupt after it is undone below
            if len(_holders) == 1:
                gc.freeze()  # O(1) in CPython's default build: the generations' lists are moved, not walked
        yield
    finally:
        with _lock:
            if token in _holders:  # absent only if an interrupt came before the append
                if len(_holders) == 1:
                    gc.unfreeze()  # before the token goes: an interrupt in between leaves a token, not a freeze
                _holders.remove(token)
