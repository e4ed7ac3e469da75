"""An undo log: how a step interrupted half-way (an exception, a learner's KeyboardInterrupt)
is rolled back exactly.

While a step runs, the block manager, the scheduler and the output processor record the
inverse of every mutation they make; ``rollback()`` replays those inverses newest first,
which restores free-list order, reference counts, prefix-cache registrations and sequence
fields as they were before the step. Every inverse is recorded *before* its change and
restores a state rather than reversing an operation (set this value, put back these items),
so an interrupt between the record and the change leaves nothing to undo wrongly. A sequence is snapshotted whole (``touch``) right
before the first change a step makes to it outside the usual decode update, which the
scheduler undoes from the step's plan instead (``Scheduler.update_from_output``): a decode
step of a large batch then copies nothing per sequence.
"""
from __future__ import annotations

from typing import Any, Callable

from minivllm.engine.sequence import Sequence, restore_sequence, snapshot_sequence


class UndoLog:
    """Inverse operations of one step, replayed in reverse order by ``rollback()``."""

    __slots__ = ("entries", "touched", "saved")

    def __init__(self) -> None:
        self.entries: list[tuple[Callable[..., Any], tuple]] = []
        self.touched: set[Sequence] = set()
        self.saved: set[int] = set()  # ids of the containers whose contents are recorded

    def add(self, fn: Callable[..., Any], *args) -> None:
        """Record ``fn(*args)`` as the inverse of a mutation about to be made (it must also be
        right if the mutation never happens: restore a state, do not reverse an operation)."""
        self.entries.append((fn, args))

    def touch(self, seq: Sequence) -> None:
        """Call right before changing ``seq``: the first call in a step snapshots it whole
        (restored in its place in the newest-first replay), later calls cost a set lookup."""
        if seq not in self.touched:
            self.touched.add(seq)
            self.entries.append((restore_sequence, (snapshot_sequence(seq),)))

    def save_contents(self, container) -> None:
        """Call right before changing a list or deque (the waiting queue): the first call in a
        step records its items, restored in their order by the rollback. Recording the whole
        queue, not each push or pop, leaves no moment where a change is made but its inverse
        is not yet recorded."""
        if id(container) not in self.saved:
            self.saved.add(id(container))
            self.entries.append((_restore_contents, (container, list(container))))

    def save_dict(self, d: dict) -> None:
        """Call right before removing a key from the middle of an ordered dict (a prefix-cache
        hit on a free cached block): the first call in a step records its items in order,
        later calls cost a set lookup. (One copy per removal made admitting a request with a
        long cached prefix cost O(hits x free cached blocks).)"""
        if id(d) not in self.saved:
            self.saved.add(id(d))
            self.entries.append((_restore_dict, (d, d.copy())))

    def rollback(self) -> None:
        entries = self.entries
        while entries:
            fn, args = entries.pop()
            fn(*args)


def _restore_dict(d: dict, saved: dict) -> None:
    d.clear()
    d.update(saved)


def _restore_contents(container, items: list) -> None:
    container.clear()
    container.extend(items)
