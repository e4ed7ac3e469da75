"""An undo log: how a step interrupted half-way (an exception, a learner's KeyboardInterrupt)
is rolled back exactly.

While a step runs, the block manager and the scheduler record the inverse of every
mutation they make; ``rollback()`` replays those inverses newest first, which restores
free-list order, reference counts and prefix-cache registrations as they were before
the step. Sequence fields are restored from snapshots (``minivllm/engine/transaction.py``).
"""
from __future__ import annotations

from typing import Any, Callable


class UndoLog:
    """Inverse operations of one step, replayed in reverse order by ``rollback()``."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[Callable[..., Any], tuple]] = []

    def add(self, fn: Callable[..., Any], *args) -> None:
        """Record ``fn(*args)`` as the inverse of a mutation just made (or about to be made)."""
        self.entries.append((fn, args))

    def rollback(self) -> None:
        entries = self.entries
        while entries:
            fn, args = entries.pop()
            fn(*args)
