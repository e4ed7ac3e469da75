"""The draft model's KV bookkeeping: a pool of blocks and one cache entry per request.

An entry records which token ids the draft's KV cache holds for a request (positions
``0 .. len(tokens) - 1``, in the entry's blocks). It is a cache derived from the request's
committed tokens, never a source of truth: before each use it is cut to the longest common
prefix with the sequence's current tokens (``valid_prefix``). A rejected draft, a rolled-back
step (``LLMEngine.step`` is a transaction), a preemption or an abort can therefore leave an
entry longer than the sequence, never wrong; the step transaction needs to journal nothing of
it. Entries of finished requests are dropped at the next proposal; when the pool runs short,
the least recently used entries of other requests are evicted (they recompute later).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftEntry:
    """One request's draft-cache entry (see the module docstring).

    Attributes:
        seq: the request's ``Sequence`` (read only: its tokens and status).
        tokens: token ids whose KV the draft cache holds, positions 0 .. len - 1.
        blocks: the pool blocks holding them, in position order (may hold spare blocks).
        last_used: the proposal call that last used the entry (for LRU eviction).
    """

    seq: object
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    last_used: int = 0

    def valid_prefix(self, token_ids: list[int], cap: int) -> int:
        """Cut ``tokens`` to its longest common prefix with ``token_ids`` (at most ``cap``
        tokens) and return that length."""
        n = min(len(self.tokens), len(token_ids), cap)
        if self.tokens[:n] != token_ids[:n]:
            diff = np.flatnonzero(np.asarray(self.tokens[:n]) != np.asarray(token_ids[:n]))
            n = int(diff[0])
        del self.tokens[n:]
        return n


class DraftCache:
    """``num_blocks`` blocks of ``block_size`` token slots, and the entries that own them."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.entries: dict[int, DraftEntry] = {}  # id(seq) -> entry

    def entry(self, seq, now: int) -> DraftEntry:
        e = self.entries.get(id(seq))
        if e is not None and e.seq is not seq:  # cannot happen while the entry holds seq; be safe
            self.drop(id(seq))
            e = None
        if e is None:
            e = self.entries[id(seq)] = DraftEntry(seq)
        e.last_used = now
        return e

    def drop(self, key: int) -> None:
        self.free.extend(self.entries.pop(key).blocks)

    def drop_finished(self) -> None:
        for key in [k for k, e in self.entries.items() if e.seq.is_finished]:
            self.drop(key)

    def reserve(self, e: DraftEntry, num_tokens: int, keep: set[int]) -> bool:
        """Give ``e`` blocks for ``num_tokens`` positions, evicting least recently used entries
        not in ``keep`` (ids of sequences) if the pool is short. False if it cannot."""
        need = -(-num_tokens // self.block_size) - len(e.blocks)
        if need <= 0:
            return True
        if need > len(self.free):
            for key, other in sorted(self.entries.items(), key=lambda kv: kv[1].last_used):
                if need <= len(self.free):
                    break
                if key not in keep:
                    self.drop(key)
        if need > len(self.free):
            return False
        e.blocks.extend(self.free.pop() for _ in range(need))
        return True

    def slots(self, e: DraftEntry, start: int, stop: int) -> list[int]:
        """Cache slots of positions ``start .. stop - 1``."""
        bs, table = self.block_size, e.blocks
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` unless every block is free or owned by exactly one entry and
        every entry's blocks hold its tokens."""
        owned = [b for e in self.entries.values() for b in e.blocks]
        every = sorted(owned + self.free)
        if every != list(range(self.num_blocks)):
            raise RuntimeError(f"draft KV pool: {self.num_blocks} blocks, but free + owned = {len(every)} "
                               f"({len(set(every))} distinct)")
        for e in self.entries.values():
            if len(e.tokens) > len(e.blocks) * self.block_size:
                raise RuntimeError(f"draft cache entry of {e.seq.request_id}: {len(e.tokens)} tokens in "
                                   f"{len(e.blocks)} blocks")
