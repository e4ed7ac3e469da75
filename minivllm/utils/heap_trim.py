"""Give the memory a shut-down engine freed back to the operating system (glibc's ``malloc_trim``).

Why: on Linux, a CPU engine's weights are many tensors of 1-32 MiB, which glibc serves from its
heap rather than from their own mappings (its mmap threshold rises to 32 MiB once large blocks have
been freed), and a freed heap block stays with the process. After ``LLM.shutdown()`` of a
``random:qwen3-0.6b`` engine (3.7 GiB resident) the process still held 1.5 GiB though no tensor was
left; ``malloc_trim(0)`` brought it to 0.27 GiB (dev EPYC, 2026-12-06).
"""
from __future__ import annotations

import ctypes
import functools

from minivllm.utils.libc import libc

__all__ = ["trim_heap"]


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    fn = getattr(libc(), "malloc_trim", None)  # glibc only (not musl, macOS or Windows)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return the C heap's free memory to the OS where the C library can (glibc); a no-op elsewhere.

    Returns:
        True when ``malloc_trim`` ran (whether or not it released anything).
    """
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
