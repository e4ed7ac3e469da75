"""``torch.profiler.profile`` without its start and stop lines on stderr.

torch 2.13's profiler (kineto) writes ``USDT: ... SyncActivityProfilerHandler.cpp:52] profiler_start``
and ``... profiler_stop`` from C++ straight to file descriptor 2, which no setting turns off
(``KINETO_LOG_LEVEL`` and ``TORCH_CPP_LOG_LEVEL`` leave them, checked 2026-12-07); in JupyterLab they
show as a red stderr box under every profiled cell, which reads as an error to a learner.
"""
from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def _stderr_fd_to_devnull():
    """File descriptor 2 goes to /dev/null for the block (Python's ``sys.stderr`` flushed first)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def quiet_profile(**kwargs):
    """``with quiet_profile(activities=[...]) as prof:`` as ``torch.profiler.profile(**kwargs)``; only
    the profiler's own start and stop run with stderr silenced, so the block's messages still show."""
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _stderr_fd_to_devnull():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _stderr_fd_to_devnull():
            prof.__exit__(None, None, None)
