"""The MINIVLLM_* on/off switches: `MINIVLLM_CPU_GEMM="0 "` (a trailing space) or `"disable"` silently left the
C GEMM on (the library switches compared without stripping; none said a value was not understood)."""
from __future__ import annotations

import logging

import pytest

from minivllm.layers.cpu_gemm import _library as LIBRARY
from minivllm.utils.env_switch import switched_off


@pytest.mark.parametrize("value,off", [("0", True), ("0 ", True), (" OFF", True), ("false", True), ("No", True),
                                       ("1", False), ("", False), ("yes", False), ("On ", False)])
def test_switch_values(monkeypatch, value, off):
    monkeypatch.setenv("MINIVLLM_TEST_SWITCH", value)
    assert switched_off("MINIVLLM_TEST_SWITCH") is off
    monkeypatch.setenv(LIBRARY.env_switch, value)  # a C library's switch reads the same way
    assert LIBRARY.switched_off() is off


def test_an_unknown_value_is_left_on_with_a_warning_naming_it(monkeypatch, caplog):
    monkeypatch.setenv("MINIVLLM_TEST_SWITCH", "disable")
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        assert not switched_off("MINIVLLM_TEST_SWITCH")
        assert not switched_off("MINIVLLM_TEST_SWITCH")
    said = [r.getMessage() for r in caplog.records if "MINIVLLM_TEST_SWITCH" in r.getMessage()]
    assert len(said) == 1 and "'disable'" in said[0] and "left on" in said[0], said
