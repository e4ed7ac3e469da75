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
    heap_frozen (either side of its ``yield``) or the helper building its entry and exit; False when
    there are fewer than k + 1 line events. The ``finally``'s one line, ``_consume(leave)``, is left
    out: CPython raises a KeyboardInterrupt only where it checks for signals (a function's start, a
    loop's back edge, the end of a call), and there is none between entering the ``finally`` and the
    end of that call; a tracer raising at its line event models no real interrupt."""
    codes, seen = {heap_frozen.__wrapped__.__code__, gc_heap._in_one_call.__code__}, [0]

    def local(frame, event, arg):
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and not line.startswith("_consume(leave)"):
            if seen[0] == k:
                seen[0] += 1
                raise KeyboardInterrupt
            seen[0] += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code in codes else None

    sys.settrace(tracer)
    try:
        with heap_frozen(True):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return seen[0] > k


def test_an_interrupt_anywhere_in_heap_frozen_leaves_neither_a_freeze_nor_a_token():
    """Done in Python, an interrupt after the holders were counted and before the freeze or the unfreeze
    left the heap frozen, with a token no block removed, for good (an LLM-level fuzz): the entry and
    the exit are each one C call now."""
    if gc.get_freeze_count():
        pytest.skip("the heap is frozen by someone else")
    k = 0
    try:
        while _interrupt_at(k):
            assert gc.get_freeze_count() == 0, f"left frozen (line event {k})"
            assert not gc_heap._holders, f"a token left behind (line event {k})"
            assert not caller_froze_heap(), f"line event {k}"
            k += 1
    finally:
        gc.unfreeze()
        gc_heap._holders.clear()
    assert k >= 6  # every line of the bookkeeping was hit
    with heap_frozen(True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and not gc_heap._holders


def test_a_stream_dropped_in_a_reference_cycle_is_collected_and_unfreezes():
    """A stream froze the heap across its yields, its consumer's objects and itself included: dropped
    inside a cycle (an object holding the stream and a bound method of its own) it was never collected,
    so its requests kept running, its KV blocks stayed taken and the freeze was never undone."""
    import weakref

    from minivllm import LLM, SamplingParams

    llm = LLM(num_kvcache_blocks=32)
    engine = llm.llm_engine
    try:
        class Job:
            def __init__(self):
                self.callbacks = [self.on_delta]  # a cycle through a bound method
                self.it = llm.stream(["hello"] * 2, SamplingParams(max_tokens=500, ignore_eos=True))

            def on_delta(self, out):
                pass

        job = Job()
        next(job.it)
        assert engine.get_num_unfinished_requests() == 2 and gc.get_freeze_count() == 0  # not frozen between yields
        ref = weakref.ref(job)
        del job
        gc.collect()
        assert ref() is None
        assert engine.get_num_unfinished_requests() == 0
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks, (bm.num_free_blocks, bm.num_blocks)
        # read to its last item and kept: nothing is left frozen either
        it = llm.stream(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))
        assert [o.finished for o in (next(it), next(it), next(it))] == [False, False, True]
        assert gc.get_freeze_count() == 0
        del it
    finally:
        llm.shutdown()
