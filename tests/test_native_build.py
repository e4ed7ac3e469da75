"""Building our C sources: a header of ours that a source includes is part of its build key, so
editing the header rebuilds the library instead of loading a stale one from the cache."""
from __future__ import annotations

import ctypes
import logging

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


def test_a_build_says_so_before_the_wait_and_a_cached_one_says_nothing(tmp_path, caplog):
    """A first run compiled for ~15 s with nothing said until the kernels were loaded (a new user's report)."""
    cc = _compiler()
    src = tmp_path / "lib.c"
    src.write_text("int get(void) { return 7; }\n")
    with caplog.at_level(logging.INFO, logger="minivllm"):
        native_build._build(src, tmp_path / "build", cc)
        told = [r.getMessage() for r in caplog.records if "compiling lib.c" in r.getMessage()]
        native_build._build(src, tmp_path / "build", cc)  # cached: nothing to say
    assert len(told) == 1 and "first use" in told[0]
    assert [r.getMessage() for r in caplog.records if "compiling lib.c" in r.getMessage()] == told


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


def test_a_library_is_never_taken_from_a_folder_others_can_write(tmp_path, monkeypatch):
    """A library already in the build folder is loaded as is: /tmp/minivllm-kernels-<uid>, made in
    advance by another user with a planted library under the expected name, ran that user's code in
    ours. A folder that is a symlink, another user's, or group/other-writable is refused."""
    import os

    cc = _compiler()
    src = tmp_path / "lib.c"
    src.write_text("int get(void) { return 7; }\n")
    shared = tmp_path / "shared"
    built = native_build._build(src, shared, cc)  # the expected name, as another user would plant it
    assert ctypes.CDLL(str(built)).get() == 7 and (os.stat(shared).st_mode & 0o777) == 0o700  # made private
    os.chmod(shared, 0o777)
    with pytest.raises(OSError, match=r"writable by its group or others \(mode 777\)"):
        native_build._build(src, shared, cc)
    os.chmod(shared, 0o755)
    link = tmp_path / "link"
    link.symlink_to(shared, target_is_directory=True)
    with pytest.raises(OSError, match="not a plain directory"):
        native_build._build(src, link, cc)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(shared).st_uid + 1)
    with pytest.raises(OSError, match="belongs to uid"):
        native_build._build(src, shared, cc)


def test_another_instruction_set_is_built_apart_and_a_bad_value_named(tmp_path, monkeypatch):
    # MINIVLLM_CPU_MARCH builds a laptop's paths (x86-64-v3: no AVX-512) on this CPU, in a library of its own
    import platform

    cc = _compiler()
    src = tmp_path / "lib.c"
    src.write_text("int avx512(void) {\n#ifdef __AVX512F__\n return 1;\n#else\n return 0;\n#endif\n}\n")
    out = tmp_path / "build"
    monkeypatch.delenv(native_build.MARCH_ENV, raising=False)
    native_lib = native_build._build(src, out, cc)
    if platform.machine() in ("x86_64", "AMD64"):
        monkeypatch.setenv(native_build.MARCH_ENV, " x86-64-v3 ")
        assert native_build._flags().count("-march=x86-64-v3") == 1 and "-march=native" not in native_build._flags()
        v3 = native_build._build(src, out, cc)
        assert v3 != native_lib and ctypes.CDLL(str(v3)).avx512() == 0
    monkeypatch.setenv(native_build.MARCH_ENV, "native; rm -rf ~")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_MARCH='native; rm -rf ~' is not a -march value"):
        native_build._build(src, out, cc)


def test_a_torch_source_is_built_as_cpp_against_torch_and_keyed_by_its_version(tmp_path, monkeypatch):
    """The model check's TensorImpl reader is C++ using torch's headers: built with a C++ compiler,
    linked against torch's c10, and rebuilt when torch's version changes (a stale build would read
    another layout)."""
    found = native_build._compilers(cxx=True)
    if not found:
        pytest.skip("no C++ compiler found")
    src = tmp_path / "numel.cpp"
    src.write_text('#include <c10/core/TensorImpl.h>\n'
                   'extern "C" long long numel_of(const void *impl) {\n'
                   '    return static_cast<const c10::TensorImpl *>(impl)->numel(); }\n')
    out = tmp_path / "build"
    first = native_build._build(src, out, found[0], torch_api=True)
    lib = ctypes.PyDLL(str(first))
    lib.numel_of.argtypes, lib.numel_of.restype = [ctypes.c_void_p], ctypes.c_longlong
    import torch
    t = torch.zeros(3, 5)
    assert lib.numel_of(t._cdata) == 15
    monkeypatch.setattr(native_build, "_torch_version", lambda: "another torch")
    assert native_build._build(src, out, found[0], torch_api=True) != first


def test_cpp_compilers_come_from_cxx_first(monkeypatch):
    monkeypatch.setenv("CXX", "true")  # a command that exists; only the order is checked
    assert native_build._compilers(cxx=True)[0] == ["true"]
    assert ["true"] not in native_build._compilers()


def test_torch_flags_need_no_setuptools(monkeypatch):
    """A venv made by Python 3.12+ has no setuptools, which torch.utils.cpp_extension imports: the
    flags of the TensorImpl reader come from torch's own folder, so an engine still starts there
    (c5deb55 imported cpp_extension for its include paths)."""
    import sys
    monkeypatch.setitem(sys.modules, "setuptools", None)  # import setuptools -> ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension", raising=False)
    flags = native_build._torch_flags()
    import torch
    assert any(f.startswith("-I") and f.endswith("include") and torch.__file__.rsplit("/", 1)[0] in f for f in flags)
    assert "-lc10" in flags
