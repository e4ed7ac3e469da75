"""The ``minivllm`` logger, configured as vLLM configures its own.

On import of the package, the ``minivllm`` logger gets a handler that writes to stderr, at the
level named by ``MINIVLLM_LOGGING_LEVEL`` (default ``INFO``: the engine's startup line with the
chosen device, dtype and attention backend, the KV cache size, CUDA graph capture). Lines look
like ``INFO 12-01 11:30:02 [llm_engine.py:95] minivllm engine: ...``.

Once the application configures logging itself (a handler on the root logger, e.g.
``logging.basicConfig`` or pytest's log capture), records go to the application's handlers
instead and this handler stays silent, so nothing is printed twice. A level the application gave
the ``minivllm`` logger before importing the package is kept (``MINIVLLM_LOGGING_LEVEL``, when set,
still wins). ``MINIVLLM_CONFIGURE_LOGGING=0`` leaves the logger entirely alone.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

LOGGER_NAME = "minivllm"
LEVEL_ENV = "MINIVLLM_LOGGING_LEVEL"
FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """stderr at emit time (so a notebook kernel's or a test's redirected stderr is honoured),
    silent while the root logger has handlers of its own."""

    def __init__(self):
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application configured logging: the record propagates to it
        self.stream = sys.stderr
        super().emit(record)


def level_from_env(default: str = "INFO") -> int:
    """The level named by ``MINIVLLM_LOGGING_LEVEL`` (a name such as ``WARNING`` or a number);
    an unknown value warns and gives ``default``."""
    raw = os.environ.get(LEVEL_ENV, "").strip() or default
    if raw.lstrip("-").isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())
    if isinstance(level, int):
        return level
    warnings.warn(f"{LEVEL_ENV}={raw!r} is not a logging level; using {default}", stacklevel=2)
    return logging.getLevelName(default)


def configure() -> logging.Logger:
    """Give the ``minivllm`` logger its stderr handler (once) and its level: ``MINIVLLM_LOGGING_LEVEL``
    when set, else INFO unless the application set one already."""
    logger = logging.getLogger(LOGGER_NAME)
    if os.environ.get("MINIVLLM_CONFIGURE_LOGGING", "1") == "0":
        return logger
    if os.environ.get(LEVEL_ENV, "").strip() or logger.level == logging.NOTSET:
        logger.setLevel(level_from_env())  # a level the application set before importing us is its own to keep
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    return logger


def init_logger(name: str) -> logging.Logger:
    """A logger under ``minivllm`` (``init_logger(__name__)`` in a module of the package)."""
    return logging.getLogger(name)
