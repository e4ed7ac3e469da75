"""Building our C sources: a header of ours that a source includes is part of its build key, so
editing the header rebuilds the library instead of loading a stale one from the cache."""
from __future__ import annotations

import ctypes

import pytest

from minivllm.layers import native_build


def _compiler():
    found = native_build._compilers()
    if not found:
        pytest.skip("no C compiler found")
    return found[0]


def test_a_changed_header_gives_a_new_library(tmp_path):
    cc = _compiler()
    (tmp_path / "answer.h").write_text("static int answer(void) { return 41; }\n")
    src = tmp_path / "lib.c"
    src.write_text('#include "answer.h"\nint get(void) { return answer(); }\n')
    out = tmp_path / "build"
    first = native_build._build(src, out, cc)
    assert native_build._build(src, out, cc) == first  # unchanged: the cached build
    (tmp_path / "answer.h").write_text("static int answer(void) { return 42; }\n")
    second = native_build._build(src, out, cc)
    assert second != first
    assert ctypes.CDLL(str(second)).get() == 42


def test_the_shipped_sources_find_their_headers():
    """The attention kernel includes the vectorised exp from layers/csrc: the path resolves."""
    from minivllm.layers import cpu_fused
    from minivllm.layers.attention import cpu_decode
    for source in (cpu_decode.SOURCE, cpu_fused.SOURCE):
        text = source.read_text()
        assert '#include "' in text
        for line in text.splitlines():
            if line.startswith('#include "'):
                assert (source.parent / line.split('"')[1]).is_file(), (source, line)
