"""heap_frozen under a KeyboardInterrupt at every line of its bookkeeping: the heap is never
left frozen with no block inside (that froze the moment's objects out of every collection for good)."""
from __future__ import annotations

import gc
import linecache
import sys

import pytest

from minivllm.utils import gc_heap
from minivllm.utils.gc_heap import caller_froze_heap, heap_frozen


def _interrupt_at(k: int) -> bool:
    """Run ``with heap_frozen(True): pass`` raising KeyboardInterrupt at the k-th line event inside
    heap_frozen (either side of its ``yield``); False when it has fewer than k + 1 line events.
    ``with _lock:`` lines are left out: CPython reports the end of a ``with`` block as a line event
    of its first line, and an exception raised there skips the lock's ``__exit__`` (a limit of
    ``with`` itself under an interrupt, not of this bookkeeping; the test would deadlock)."""
    code, seen = heap_frozen.__wrapped__.__code__, [0]

    def local(frame, event, arg):
        if event == "line" and not linecache.getline(code.co_filename, frame.f_lineno).strip().startswith("with "):
            if seen[0] == k:
                seen[0] += 1
                raise KeyboardInterrupt
            seen[0] += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        with heap_frozen(True):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return seen[0] > k


def _start_clean() -> None:
    gc_heap._holders = type(gc_heap._holders)()  # no block inside


def test_an_interrupt_anywhere_in_heap_frozen_never_leaves_the_heap_frozen_without_a_holder():
    if gc.get_freeze_count():
        pytest.skip("the heap is frozen by someone else")
    k = 0
    try:
        while _interrupt_at(k):
            assert gc.get_freeze_count() == 0 or gc_heap._holders, f"frozen with no block inside (line event {k})"
            assert not caller_froze_heap(), f"our own freeze taken for the caller's (line event {k})"
            gc.unfreeze()
            _start_clean()  # a stale token is allowed (later blocks then run unfrozen)
            k += 1
    finally:
        gc.unfreeze()
        _start_clean()
    assert k >= 6  # every line of the bookkeeping was hit
    with heap_frozen(True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and not gc_heap._holders
