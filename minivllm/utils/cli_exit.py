"""How a command of the command line ends when the reader of its output goes away (``| head``)."""
from __future__ import annotations

import os
import sys

__all__ = ["SIGPIPE_STATUS", "stdout_gone"]

#: what a shell reports for a command ended by SIGPIPE (128 + 13), as `yes | head -1` shows
SIGPIPE_STATUS = 141


def stdout_gone() -> int:
    """Call on ``BrokenPipeError``: points stdout at the null device, so that Python's flush at exit
    raises nothing more, and returns ``SIGPIPE_STATUS`` for the command to exit with. Where stdout
    has no file descriptor (a notebook's), only the status."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both an OSError and a ValueError
        pass
    return SIGPIPE_STATUS
