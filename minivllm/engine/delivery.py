"""Handing a step's outputs to the callers waiting for them, so that no interrupt loses or repeats one.

``LLM.generate`` and ``LLM.stream`` register a *sink* per request (``add_request(..., sink=inbox.append)``):
whichever caller's step produces an output, it lands in its own request's inbox. Handed over after
the step's transaction, a learner's KeyboardInterrupt between two hand-overs (or between the commit
and the first) lost the rest: a delta stream then silently missed a token, or a ``generate`` waited for
a final output that never came. So:

* inside the step's transaction the outputs are appended to ``pending`` (one C call), with an undo
  entry that takes them back if the step rolls back;
* after the commit, :meth:`OutputDelivery.deliver_pending` hands them over in one chain of C calls
  (``deque.popleft`` feeding ``operator.call`` feeding each sink, a ``deque.append``;
  ``minivllm/utils/c_chain.py``), so an interrupt lands before the whole hand-over or after it (Python
  3.11+; on 3.10, without ``operator.call``, a Python call per output makes the hand-over
  interruptible between outputs);
* outputs an interrupt left pending are handed over at the start of the engine's next step or abort
  (and by a waiting ``LLM`` call before it concludes that its outputs are lost).

A sink that is a Python function (``add_request``'s ``sink`` may be any callable) runs bytecode, so an
interrupt inside it loses that output for that sink; a hand-over such a sink (or a finalizer a garbage
collection runs) starts from inside another waits for the next one.
"""
from __future__ import annotations

from collections import deque
from itertools import chain, repeat

from minivllm.utils.c_chain import call, consume

__all__ = ["OutputDelivery"]

_call, _consume = call, consume  # (module names: a test swaps in Python 3.10's stand-in)
_drop = deque(maxlen=0).append  # the sink of an output whose request has none


def _truncate(queue: deque, length: int) -> None:
    while len(queue) > length:
        queue.pop()


class OutputDelivery:
    """The sinks of the requests that have one, and the outputs of committed steps not yet handed over."""

    def __init__(self) -> None:
        self.sinks: dict[str, object] = {}  # request id -> callable receiving its outputs
        self.pending: deque = deque()
        self._busy = False  # a hand-over in progress (one made from inside it, by a sink or a finalizer, waits)

    def stage(self, outputs: list, undo) -> None:
        """Inside a transaction: queue ``outputs`` for :meth:`deliver_pending`, undone with the step."""
        if outputs and self.sinks:
            pending = self.pending
            undo.add(_truncate, pending, len(pending))
            pending.extend(outputs)

    def deliver_pending(self) -> None:
        """Hand every pending output to its request's sink, in order, and forget the sinks of the
        requests that finished (call with the engine's lock held)."""
        pending = self.pending
        if not pending or self._busy:
            return
        try:
            self._busy = True  # (no signal check between the test above and here, nor in the finally below)
            sinks = self.sinks
            batch = list(pending)  # what goes where, worked out first (no change made); a sink or a finalizer
            targets = [sinks.get(out.request_id, _drop) for out in batch]  # can only add to the queue meanwhile
            done = [out.request_id for out in batch if out.finished]
            # one C call: these outputs taken from the queue and handed to their sinks, then the finished
            # requests' sinks dropped, nothing in between (no comparison either: an output's __eq__ is Python)
            _consume(chain(map(_call, targets, map(_call, repeat(pending.popleft, len(batch)))),
                           map(sinks.pop, done, repeat(None))))
        finally:
            self._busy = False
