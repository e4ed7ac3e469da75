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
from itertools import chain

from minivllm.utils.c_chain import call, consume

__all__ = ["caller_froze_heap", "heap_frozen"]

#: one token per ``heap_frozen`` block inside (gc.freeze is process-wide: the first one in freezes,
#: the last one out undoes it)
_holders: dict[object, None] = {}
_FREEZE_IF_FIRST = {1: gc.freeze}  # by the number of holders once a block's token is in
_UNFREEZE_IF_LAST = {0: gc.unfreeze}  # ... once it is out


_call, _consume = call, consume  # (module names: a test swaps in Python 3.10's stand-in)


def _in_one_call(token: object, add: bool) -> chain:
    """A block's entry (``add``: its token in, then ``gc.freeze()`` if it is the only one) or exit (its
    token out, then ``gc.unfreeze()`` if none is left), as one lazy chain of C calls
    (``minivllm/utils/c_chain.py``): made before it is needed, run by one ``_consume`` call, so the count
    and the freeze it decides change together. Done in Python, an interrupt after the count and before
    the freeze or the unfreeze left the heap frozen, with a token no block would remove, for good (an
    LLM-level fuzz). On Python 3.10 (no ``operator.call``) the last step is a Python call."""
    change = map(_holders.__setitem__, (token,), (None,)) if add else map(_holders.pop, (token,), (None,))
    then = _FREEZE_IF_FIRST if add else _UNFREEZE_IF_LAST
    return chain(change, map(_call, map(then.get, map(len, (_holders,)), (tuple,))))


def caller_froze_heap() -> bool:
    """Someone other than :func:`heap_frozen` has frozen the heap (``gc.freeze``). Ask it once per
    stepping loop, not per step: ``gc.get_freeze_count`` walks the frozen objects (19.9 ms for the
    219,198 of a process holding torch, transformers and an embedded-model ``LLM``, one call; 2-core Xeon dev VM, 2026-12-06;
    nothing to walk when nothing is frozen)."""
    return not _holders and gc.get_freeze_count() > 0


@contextlib.contextmanager
def heap_frozen(enabled: bool | None = None):
    """Run the block with the objects that exist when it starts frozen (``gc.freeze``), undone
    when it ends, also by an exception. Threads inside at once share one freeze, made by the first of
    them in and undone when the last is out. ``enabled``: ``None`` asks :func:`caller_froze_heap` (a
    freeze the caller made is then left as it is: neither extended nor undone); ``False`` does nothing;
    ``True`` freezes without asking (a loop that asked once already)."""
    if enabled is None:
        enabled = not caller_froze_heap()
    if not enabled:
        yield
        return
    token = object()
    enter, leave = _in_one_call(token, True), _in_one_call(token, False)  # nothing changed yet
    try:
        _consume(enter)  # gc.freeze is O(1) in CPython's default build: the generations' lists are moved
        yield
    finally:
        _consume(leave)  # (its token may not be in: an interrupt came before the entry)
