"""The block tables of an eager decode step, kept from one step to the next.

A decode step's block tables hardly change: a sequence's table gets a block every
``block_size`` tokens, so most rows are what they were the step before. Building the
``[num_seqs, width]`` array from the Python lists every step costs a pass over every block
id (~60 us for 256 sequences of 9 blocks); ``DecodeTables`` keeps the array and rewrites
only the rows whose ``Sequence.table_version`` changed (vLLM v1 keeps its block table
across steps in its persistent batch for the same reason). The decode graphs' staging does
the same in their static buffer (``CudaGraphDecodeRunner.stage``).
"""
from __future__ import annotations

from itertools import chain

import numpy as np

__all__ = ["DecodeTables", "block_table_array"]

#: More rows than this to rewrite: one vectorised build of those rows (fixed cost ~20 us)
#: instead of two numpy assignments per row.
_ROW_AT_A_TIME = 8


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    """int32 ``[len(tables), longest]``, -1 past each row's blocks. A few rows go through one
    ``np.array`` call (cheapest for a small batch), more as the padded rows chained into one
    ``np.fromiter`` (measured cheaper than nested ``np.array`` and ``fill_block_tables``)."""
    width = max(map(len, tables))
    neg = [-1] * width
    if len(tables) <= 8:
        return np.array([t + neg[len(t):] for t in tables], dtype=np.int32)
    rows = [t if len(t) == width else t + neg[len(t):] for t in tables]  # full rows are not copied
    flat = np.fromiter(chain.from_iterable(rows), np.int32, len(tables) * width)
    return flat.reshape(len(tables), width)


class DecodeTables:
    """int32 ``[n, width]`` block tables (``width`` = the longest table, -1 after each row's
    blocks), row ``i`` rewritten only when ``versions[i]`` differs from the version last
    written there. The returned array is rewritten in place by the next ``build``: read it
    within the step."""

    def __init__(self) -> None:
        self._arr: np.ndarray | None = None
        self._versions: list[int] = []  # per row of _arr: the table version written (-1: none)

    def build(self, tables: list[list[int]], versions: list[int]) -> np.ndarray:
        """``tables``: each sequence's block ids (non-empty); ``versions``: each one's
        ``Sequence.table_version``. Returns a view ``[len(tables), width]`` of the kept array."""
        n, width = len(tables), max(map(len, tables))
        arr, written = self._arr, self._versions
        # Until every row is written, no row's version is trusted: an interrupt below leaves
        # rows that the next build must write again.
        self._versions = [-1] * len(written)
        if arr is None or arr.shape[1] != width or arr.shape[0] < n:
            rows = max(n, 0 if arr is None else arr.shape[0])
            written = self._versions = [-1] * rows
            arr = self._arr = np.full((rows, width), -1, dtype=np.int32)
        # one list comparison first: most steps no table changed
        stale = [i for i, v, w in zip(range(n), versions, written) if v != w] if versions != written[:n] else ()
        if len(stale) > _ROW_AT_A_TIME:
            sub = block_table_array([tables[i] for i in stale])
            arr[stale, :sub.shape[1]] = sub
            arr[stale, sub.shape[1]:] = -1
        else:
            for i in stale:
                t = tables[i]
                arr[i, :len(t)] = t
                arr[i, len(t):] = -1
        written[:n] = versions
        self._versions = written
        return arr[:n]
