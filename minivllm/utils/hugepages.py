"""Ask Linux to back a large CPU tensor with 2 MiB pages (transparent huge pages).

A decode step reads memory the caches no longer hold at scattered places: each sequence's KV
blocks, the embedding rows of its token. With 4 KiB pages nearly every such read starts with a TLB
miss, and in a virtual machine each miss walks two page tables; with 2 MiB pages the KV pool of a
step fits in a few dozen TLB entries. torch backs large allocations with huge pages only when
``THP_MEM_ALLOC_ENABLE=1`` is set before it starts; :func:`advise_huge` asks for the one tensor it
is given, before its pages are first written (``madvise(MADV_HUGEPAGE)``: Linux then fills each
aligned 2 MiB range with one page when it is first touched).

A hint, not a guarantee: where the kernel's setting is ``never``, on other systems, or for a tensor
smaller than 2 MiB, nothing changes. Results never depend on it.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch

from minivllm.utils.libc import libc

__all__ = ["HUGE_PAGE", "advise_huge", "transparent_hugepage_mode"]

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <linux/mman.h>
_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=None)
def transparent_hugepage_mode() -> str | None:
    """The kernel's setting (``"always"``, ``"madvise"`` or ``"never"``), ``None`` off Linux or unreadable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(_SETTING) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


@functools.lru_cache(maxsize=None)
def _madvise():
    fn = libc().madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for 2 MiB pages under the aligned 2 MiB ranges of ``t``'s memory (a CPU tensor; call
    it before the memory is first written: pages already there stay small until the kernel's
    background thread merges them). Returns whether the request was made and accepted."""
    if t.device.type != "cpu" or t.is_mkldnn or transparent_hugepage_mode() not in ("madvise", "always"):
        return False
    storage = t.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    try:
        return _madvise()(lo, hi - lo, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
