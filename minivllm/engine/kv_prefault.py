"""Fault in the CPU KV pool's pages a little ahead of the blocks the block manager hands out.

The CPU pool is an anonymous mapping whose pages the operating system makes when they are first
written (:func:`minivllm.utils.hugepages.zeroed_cpu_tensor`), 2 MiB at a time where huge pages
were granted. A step that writes a block past the pages made so far waits for them, once per
2 MiB of each layer's K and V: on the dev EPYC (a virtual machine whose host backs guest memory
lazily; 2026-12-04, embedded model, one thread) 3 of 745 decode steps of a mixed batch took 40-41 ms
instead of ~5, each with 8 page faults (4 layers x K and V) as the block ids crossed 1024, 1792
and 2304 (256 blocks of 8 KiB to a page), and a 4004-token prefill spent 38 ms of its ~380 ms
writing its K and V. Making one 2 MiB page took 2.9 ms there when the guest's memory was fresh to
the host, 0.17 ms when it was not; 4 KiB pages took 0.7 ms per 2 MiB either way.

Here a background thread asks the kernel to make the pages (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14+) from the start of each layer's K and V region up to ``ahead_bytes`` past the highest
block handed out so far, rounded up to a whole huge page. It makes pages without writing to them: a page that exists (the engine
wrote it first) is left as it is, so the thread never races the engine's KV writes. The thread
runs only while there is work (started again by :meth:`KVPrefaulter.note`) and stops at
:meth:`KVPrefaulter.close`; the pool's memory is still made only as far as blocks are used, plus
``ahead_bytes`` and a huge page per region. Results never depend on it; ``MINIVLLM_KV_PREFAULT=0`` (or false, no,
off; read when an engine starts) leaves every page to be made when first written.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import sys
import threading

import torch

from minivllm.utils.env_switch import switched_off
from minivllm.utils.hugepages import HUGE_PAGE, _madvise  # libc madvise through ctypes, one binding

__all__ = ["KVPrefaulter"]

logger = logging.getLogger("minivllm")

_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
ENV_SWITCH = "MINIVLLM_KV_PREFAULT"
#: how far past the highest block handed out each region's pages are made: two huge pages
AHEAD_BYTES = 2 * HUGE_PAGE
_PAGE = mmap.PAGESIZE


class KVPrefaulter:
    """Makes the pages of a CPU KV pool ``[2, num_layers, num_blocks, ...]`` ahead of use.

    Each ``(K or V, layer)`` slice of the pool is one contiguous region of ``num_blocks`` blocks;
    block ``b`` of every region is written when the block manager hands ``b`` out. ``note(b)``
    (the block manager's ``on_fresh_block`` hook, called with each new highest block id) raises
    the target to ``(b + 1) * block_bytes + ahead_bytes`` bytes into every region (rounded up to a
    whole 2 MiB page, at most the region), and a thread
    makes the pages up to it, one huge page of each region in turn.

    Use :meth:`for_pool`, which returns None where this does not apply (not a CPU tensor, not
    Linux, ``MINIVLLM_KV_PREFAULT=0``); on a kernel without ``MADV_POPULATE_WRITE`` the first call
    fails and the thread stops for good (:attr:`error` says why).
    """

    def __init__(self, pool: torch.Tensor, ahead_bytes: int = AHEAD_BYTES):
        self._pool = pool  # kept alive while a thread may be making its pages
        num_regions = pool.shape[0] * pool.shape[1]
        self._regions = [pool[i, j].data_ptr() for i in range(pool.shape[0]) for j in range(pool.shape[1])]
        self.region_bytes = pool[0, 0].nbytes
        self.block_bytes = self.region_bytes // pool.shape[2] if pool.shape[2] else 0
        self.ahead_bytes = ahead_bytes
        self.num_regions = num_regions
        self._lock = threading.Lock()
        self._target = 0   # bytes of each region the thread is to make
        self.done = 0      # bytes of each region made so far (read without the lock: an int)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.error: str | None = None  # why it stopped early, if it did

    @classmethod
    def for_pool(cls, pool: torch.Tensor | None, ahead_bytes: int = AHEAD_BYTES) -> "KVPrefaulter | None":
        if (pool is None or pool.device.type != "cpu" or not sys.platform.startswith("linux") or pool.dim() < 3
                or pool.numel() == 0 or not pool[0, 0].is_contiguous()
                or switched_off(ENV_SWITCH)):
            return None
        try:
            _madvise()
        except (OSError, AttributeError):
            return None
        return cls(pool, ahead_bytes)

    def note(self, block_id: int) -> None:
        """Block ``block_id`` (the highest handed out so far) is about to be written: make sure the
        pages up to ``ahead_bytes`` past it are being made. The target moves a huge page at a time,
        so most calls return at the first comparison (and a thread starts once per 2 MiB of
        growth, not per block); never raises (it runs inside a step's scheduling)."""
        want = (block_id + 1) * self.block_bytes + self.ahead_bytes
        want = min(self.region_bytes, -(-want // HUGE_PAGE) * HUGE_PAGE)
        if want <= self._target or self._closed or self.error is not None:
            return
        with self._lock:
            if want <= self._target or self._closed or self.error is not None:
                return
            self._target = want
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="minivllm-kv-prefault", daemon=True)
                try:
                    thread.start()
                except RuntimeError as e:  # no thread to be had: the step goes on, its pages made as written
                    self.error = f"no background thread ({e})"
                    return
                self._thread = thread

    def _run(self) -> None:
        fn = _madvise()
        while True:
            with self._lock:
                if self._closed or self.done >= self._target:
                    self._thread = None  # note() starts another when there is more to do
                    return
                lo = self.done
                hi = min(self._target, (lo // HUGE_PAGE + 1) * HUGE_PAGE)  # up to the next huge page boundary
            for base in self._regions:
                if self._closed:
                    break
                start = (base + lo) // _PAGE * _PAGE  # madvise wants a page-aligned start (a region's or
                if fn(start, base + hi - start, _MADV_POPULATE_WRITE) != 0:  # block's bytes need not be)
                    err = ctypes.get_errno()
                    self.error = (f"madvise(MADV_POPULATE_WRITE) failed: "
                                  f"{errno.errorcode.get(err, err)} ({'kernel older than 5.14?' if err == errno.EINVAL else 'stopped'})")
                    logger.debug("CPU KV cache prefault: %s", self.error)
                    with self._lock:
                        self._thread = None
                    return
            with self._lock:
                self.done = max(self.done, hi)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (between two calls of at most one huge page each) and drop the pool.
        Returns within about ``2 x timeout`` seconds whatever the thread does."""
        self._closed = True  # the thread reads it between calls (a bool store needs no lock)
        # At interpreter exit a daemon thread stops for good wherever it is, possibly holding the
        # lock; an LLM collected then closes this, and waiting on that lock hung the exit. Then
        # nothing can run the thread again: there is nothing to wait for.
        if sys.is_finalizing() or not self._lock.acquire(timeout=timeout):
            return  # the pool stays referenced: nothing else touches it now
        try:
            thread = self._thread
        finally:
            self._lock.release()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                return  # still inside one madvise call: it keeps the pool (and its addresses) alive
        self._pool = None

    def wait(self, timeout: float = 10.0) -> bool:
        """Block until the pages up to the current target are made (tests, measurements);
        returns whether they are."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.done >= self._target or self.error is not None
