"""Ask Linux to back a large CPU tensor with 2 MiB pages (transparent huge pages).

A decode step reads memory the caches no longer hold: every weight, streamed (the panel GEMM's
panels, :func:`minivllm.layers.cpu_gemm.pack_panels`: the hardware prefetcher stops at each
page's end), and at scattered places each sequence's KV blocks, the embedding rows of its token.
With 4 KiB pages nearly every scattered read starts with a TLB miss, and in a virtual machine each
miss walks two page tables; with 2 MiB pages the KV pool of a step fits in a few dozen TLB entries.
torch backs large allocations with huge pages only when ``THP_MEM_ALLOC_ENABLE=1`` is set before it
starts; :func:`advise_huge` asks for the one tensor it is given, before its pages are first written
(``madvise(MADV_HUGEPAGE)``: Linux then fills each aligned 2 MiB range with one page when it is
first touched).

A hint, not a guarantee: where the kernel's setting is ``never``, on other systems, or for a tensor
smaller than 2 MiB, nothing changes. Results never depend on it.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import torch

from minivllm.utils.libc import libc

__all__ = ["HUGE_PAGE", "advise_huge", "transparent_hugepage_mode", "zeroed_cpu_tensor"]

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
    if not t.numel():
        return False
    # the bytes t's elements span, not its whole storage: a tensor from zeroed_cpu_tensor sits inside a
    # mapping with up to 2 MiB to spare, which a 2 MiB page over its end would fill for nothing
    start = t.data_ptr()
    end = start + (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))) * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    try:
        return _madvise()(lo, hi - lo, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zero-filled CPU tensor of ``shape`` backed by an anonymous memory mapping (``mmap``), its
    start on a 2 MiB boundary, 2 MiB pages asked for before any is made; returns it and whether
    the request for 2 MiB pages was accepted. An anonymous mapping reads as zeros by the operating
    system's contract (Linux, macOS, Windows), page by page as it is first touched: nothing is
    written here. The tensor keeps the mapping alive (``torch.frombuffer``); it is unmapped when
    the last view of it goes."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()  # + HUGE_PAGE below: room to align
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), False
    if hasattr(mmap, "MAP_PRIVATE"):  # POSIX: private (a shared one is shmem: no 2 MiB pages, shared by a fork)
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows: an anonymous mapping is the process's own
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[skip:skip + nbytes].view(dtype).view(shape)
    return tensor, advise_huge(tensor)
