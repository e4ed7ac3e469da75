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


def tensor_data_or_skip():
    """The model check's C++ TensorImpl reader (``minivllm/engine/csrc/tensor_data.cpp``), as
    :func:`native_or_skip`, but a machine without a C++ compiler skips even under
    ``MINIVLLM_REQUIRE_CPU_KERNEL=1`` (which ``.ci/run`` sets when it finds a C compiler)."""
    from minivllm.engine import model_check

    lib = model_check._tensor_data.load()
    reason = model_check._tensor_data.unavailable_reason() or ""
    if lib is None and reason.startswith("no C++ compiler found"):
        pytest.skip(f"the TensorImpl reader unavailable: {reason}")
    return native_or_skip(model_check._tensor_data, "the TensorImpl reader (torch's headers)")
