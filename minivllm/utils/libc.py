"""The C library through ``ctypes``, loaded once for the modules that call into it (``madvise`` for huge
pages and the KV prefault, ``malloc_trim`` after a shutdown)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["libc"]


@functools.lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    """The process's C library (``errno`` kept for ``ctypes.get_errno``), or None where it cannot be loaded.
    Where ``find_library`` finds no name, the process's own symbols (which hold libc's on Linux)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
