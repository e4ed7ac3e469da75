"""nbval's kernels shut down as a Jupyter front end shuts them down.

nbval stops each notebook's kernel with ``shutdown_kernel(now=True)``, a SIGKILL, so nothing the
kernel registered to run at exit runs: plotly's static-image exporter (kaleido, which the widgets'
saved snapshots use) leaves its headless Chromium profile and page in the temporary directory,
two directories and ~2.7 MB per notebook per run. A graceful shutdown (a shutdown request; SIGTERM,
which skips the exit handlers too, only after half of ``KernelManager.shutdown_wait_time``, then
SIGKILL) lets the kernel clean up, as JupyterLab's "Shut Down Kernel" does. With jupyter_client's
5 s default (SIGTERM after 2.5 s) a full CI run still left one notebook's directories (chapter 11's,
by their time; a run of that notebook alone left none): a kernel slower to exit on a loaded machine.
The wait here is :data:`KERNEL_EXIT_WAIT_S`.
"""
from __future__ import annotations

import functools

#: ``shutdown_wait_time`` for nbval's kernels, seconds: SIGTERM after half of it (a kernel exits in ~1 s)
KERNEL_EXIT_WAIT_S = 60.0


def shut_kernels_down_gracefully() -> bool:
    """Make nbval's kernel stop ask the kernel to exit instead of killing it. Returns False
    (and changes nothing) where nbval is not installed or its kernel class has no ``stop``."""
    try:
        from nbval.kernel import RunningKernel
    except ImportError:
        return False
    stop = getattr(RunningKernel, "stop", None)
    if stop is None or getattr(stop, "_graceful", False):
        return stop is not None

    @functools.wraps(stop)
    def graceful_stop(self):
        km = self.km
        km.shutdown_wait_time = max(km.shutdown_wait_time, KERNEL_EXIT_WAIT_S)
        shutdown = km.shutdown_kernel
        km.shutdown_kernel = lambda now=False, restart=False: shutdown(now=False, restart=restart)
        try:
            stop(self)
        finally:
            km.__dict__.pop("shutdown_kernel", None)

    graceful_stop._graceful = True
    RunningKernel.stop = graceful_stop
    return True
