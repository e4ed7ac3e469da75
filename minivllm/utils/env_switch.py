"""The ``MINIVLLM_*`` on/off switches (``MINIVLLM_CPU_GEMM``, ``MINIVLLM_KV_PREFAULT``, ...), read one way.

A switch is on unless set to 0 / false / no / off (any case, surrounding spaces ignored); 1 / true /
yes / on or an empty value leave it on. Any other value leaves it on with a warning naming the switch
and the value, once per value: ``MINIVLLM_CPU_GEMM="disable"`` or ``"0 "`` silently left it on before.
"""
from __future__ import annotations

import functools
import logging
import os

__all__ = ["switched_off"]

OFF = ("0", "false", "no", "off")
ON = ("", "1", "true", "yes", "on")

logger = logging.getLogger(__name__)


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns its feature off (read at every call, so
    flipping it between engines takes effect)."""
    raw = os.environ.get(name, "1")
    value = raw.strip().lower()
    if value in OFF:
        return True
    if value not in ON:
        _warn_unknown(name, raw)
    return False


@functools.lru_cache(maxsize=None)
def _warn_unknown(name: str, raw: str) -> None:
    logger.warning("%s=%r is not an on/off value (0/false/no/off turn it off; 1/true/yes/on keep it on): "
                   "left on", name, raw)
