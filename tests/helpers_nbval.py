"""nbval's kernels shut down as a Jupyter front end shuts them down.

nbval stops each notebook's kernel with ``shutdown_kernel(now=True)``, a SIGKILL, so nothing the
kernel registered to run at exit runs: plotly's static-image exporter (kaleido, which the widgets'
saved snapshots use) leaves its headless Chromium profile and page in the temporary directory,
two directories and ~2.7 MB per notebook per run. A graceful shutdown (a shutdown request, the
kill only if the kernel has not exited within ``KernelManager.shutdown_wait_time``) lets the
kernel clean up, as JupyterLab's "Shut Down Kernel" does.
"""
from __future__ import annotations

import functools


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
        shutdown = km.shutdown_kernel
        km.shutdown_kernel = lambda now=False, restart=False: shutdown(now=False, restart=restart)
        try:
            stop(self)
        finally:
            km.__dict__.pop("shutdown_kernel", None)

    graceful_stop._graceful = True
    RunningKernel.stop = graceful_stop
    return True
