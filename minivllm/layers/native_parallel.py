"""Run a C call split into chunks on several threads: ``ctypes`` drops the GIL for the length of
a foreign call, so chunks given to a pool of Python threads run on separate cores. Used by the
causal attention of fresh prompts, the fused CPU ops on large inputs, and the decode attention
where the panel GEMM library is unavailable. The panel GEMM splits inside its C code instead
(handing a chunk to a Python thread cost ~110 us per call, more than most of its calls take),
and so does the decode attention, on the GEMM's threads (``native_parallel_run``).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

__all__ = ["run_chunks"]

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool, grown to ``workers`` threads if smaller (a replaced pool finishes
    its queued work and is collected)."""
    global _pool, _pool_size
    with _lock:
        if _pool_size < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="minivllm-native")
            _pool_size = workers
        return _pool


def run_chunks(run: Callable[[int], None], chunks: int) -> None:
    """``run(c)`` for ``c in range(chunks)``: chunk 0 on the calling thread, the others on the
    pool, returning when all are done.

    Never returns while a worker may still write into memory the caller owns: an interrupt
    (Ctrl-C in a notebook) during the wait is re-raised once every chunk has finished, and a
    worker's exception is re-raised after that.
    """
    if chunks <= 1:
        run(0)
        return
    pool = _thread_pool(chunks - 1)
    futures = [pool.submit(run, c) for c in range(1, chunks)]
    interrupt = None
    try:
        run(0)
    finally:
        while True:
            try:
                wait(futures)
                break
            except KeyboardInterrupt as e:
                interrupt = e
    if interrupt is not None:
        raise interrupt
    for f in futures:
        f.result()
