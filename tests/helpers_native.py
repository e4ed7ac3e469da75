"""Our C code in tests: the loaded object, or a skip naming why it is missing."""
from __future__ import annotations

import os

import pytest


def native_or_skip(module, what: str):
    """``module.load()`` (``cpu_decode``, ``cpu_fused`` or ``cpu_gemm``); where it is ``None``, a skip naming the
    build error, or a failure when ``MINIVLLM_REQUIRE_CPU_KERNEL=1`` (CI sets it: its machine has a
    compiler)."""
    loaded = module.load()
    if loaded is None:
        message = f"{what} unavailable: {module.unavailable_reason()}"
        if os.environ.get("MINIVLLM_REQUIRE_CPU_KERNEL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return loaded
