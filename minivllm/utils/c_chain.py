"""Changes an interrupt cannot split: a lazy chain of C calls (``map``, ``itertools.chain``, bound methods
of built-in containers) run to its end by one C call, :data:`consume`.

CPython raises a learner's KeyboardInterrupt (Jupyter's "interrupt kernel") only between bytecodes, where
it checks for signals (a function's start, a loop's back edge, the end of a call); none runs inside such a
chain, nor can another thread (it holds the GIL throughout). So the changes of a chain happen all or none.
The hand-over of a step's outputs (``minivllm/engine/delivery.py``) and the heap freeze around steps
(``minivllm/utils/gc_heap.py``) are made so. A chain must not compare or hash objects whose ``__eq__`` or
``__hash__`` is Python code (a ``RequestOutput``'s is).
"""
from __future__ import annotations

import operator
from collections import deque

__all__ = ["call", "consume", "python_call"]


def python_call(fn, *args):
    """Python 3.10's stand-in for ``operator.call``: a chain using it runs Python there, so an interrupt
    can split it at that call."""
    return fn(*args)


#: ``fn(*args)`` as a C call (``operator.call``, Python 3.11+)
call = getattr(operator, "call", python_call)
#: runs an iterator to its end in C
consume = deque(maxlen=0).extend
