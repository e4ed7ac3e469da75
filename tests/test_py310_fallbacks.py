"""The hand-over of outputs and the heap freeze with Python 3.10's stand-in for ``operator.call`` (the
package supports 3.10): their one-C-call chains then make a Python call, and must still work."""
from __future__ import annotations

import gc
from collections import deque
from types import SimpleNamespace

import pytest

import minivllm.engine.delivery as delivery
import minivllm.utils.gc_heap as gc_heap
from minivllm.utils.c_chain import python_call


def test_the_stand_ins_hand_over_and_freeze(monkeypatch):
    """The hand-over's stand-in took one argument where the chain also calls deque.popleft with none: every
    stream on Python 3.10 would have raised TypeError (found re-reading the change)."""
    monkeypatch.setattr(delivery, "_call", python_call)
    monkeypatch.setattr(gc_heap, "_call", python_call)
    d = delivery.OutputDelivery()
    inbox = deque()
    d.sinks["a"] = inbox.append
    outs = [SimpleNamespace(request_id="a", finished=False), SimpleNamespace(request_id="a", finished=True)]
    d.pending.extend(outs)
    d.deliver_pending()
    assert list(inbox) == outs and not d.sinks and not d.pending
    if gc.get_freeze_count():
        pytest.skip("the heap is frozen by someone else")
    with gc_heap.heap_frozen(True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and not gc_heap._holders
