"""Build our C sources at first use and load them with ``ctypes`` (the CPU attention kernel in
``attention/csrc``, the fused per-layer ops and the panel GEMM in ``csrc``, the CPU graphs' model
check in ``engine/csrc``, which reads Python objects and so is built against Python's headers and
called with the GIL held, and its one C++ source, which reads torch's TensorImpls and so is built
against the installed torch's headers with a C++ compiler: ``$CXX``, Python's, ``c++``, ``g++``,
``clang++``).

A source is compiled (``-O3 -march=native``) with the first compiler that works (``$CC``, the
one Python was built with, ``cc``, ``gcc``, ``clang``) into ``cache_dir()/kernels/`` (else
``minivllm-kernels-<uid>`` in the temp directory; either is used only if it is this user's own and
nobody else can write it, since a library found there is loaded as is), under a hash of the source (with the ``#include "..."``
headers of ours it names), compiler, flags and CPU model and features, so later processes on the
same CPU reuse it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import stat
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Callable, Generic, TypeVar

from minivllm.logger import init_logger
from minivllm.utils.env_switch import switched_off

__all__ = ["FLAGS", "NativeBuildError", "NativeLibrary", "build_and_load"]

T = TypeVar("T")
logger = init_logger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-pthread", "-shared", "-fPIC")
MARCH_ENV = "MINIVLLM_CPU_MARCH"  # another -march than native: test a laptop's instruction set on this CPU


def _flags() -> tuple[str, ...]:
    """:data:`FLAGS`, with ``-march=$MINIVLLM_CPU_MARCH`` for ``-march=native`` where it is set
    (``x86-64-v3``: AVX2 and FMA without AVX-512; ``x86-64``: SSE2 only), so that the C paths of
    CPUs without this one's features can be built and checked here (read at each build)."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march:
        return FLAGS
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not a -march value (e.g. native, x86-64-v3, x86-64, armv8-a)")
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


class NativeBuildError(RuntimeError):
    """No compiler produced a loadable library; the message lists every attempt."""


def _compilers(cxx: bool = False) -> list[list[str]]:
    """Candidate compiler commands, first that runs wins: ``$CC``, the one Python was built with
    (``sysconfig``; conda and standalone Pythons may name one that is not installed), then
    ``cc``, ``gcc``, ``clang``; for C++ (``cxx``) ``$CXX``, Python's, ``c++``, ``g++``, ``clang++``.
    A command keeps its words (``ccache gcc``, ``zig cc``)."""
    found = []
    names = (("CXX", "c++", "g++", "clang++") if cxx else ("CC", "cc", "gcc", "clang"))
    for cc in (os.environ.get(names[0]), sysconfig.get_config_var(names[0]), *names[1:]):
        try:
            cmd = shlex.split(cc) if cc else []
        except ValueError:  # unbalanced quotes in $CC
            continue
        if cmd and shutil.which(cmd[0]) and cmd not in found:
            found.append(cmd)
    return found


def _cpu_fingerprint() -> str:
    """What ``-march=native`` depends on: the CPU's model and instruction-set flags (Linux), else
    the processor string. A cache shared between machines never loads another CPU's build."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(dict.fromkeys(lines))  # one copy per distinct line (every core repeats them)
    except OSError:
        return platform.processor() or platform.node()


def _python_flags() -> tuple[str, ...]:
    """Compiler flags of a source that uses Python's C API: the running Python's headers (its
    symbols resolve against the interpreter when the library is loaded)."""
    paths = sysconfig.get_paths()
    return tuple(f"-I{d}" for d in dict.fromkeys((paths["include"], paths["platinclude"])))


def _torch_flags() -> tuple[str, ...]:
    """Compiler and linker flags of a C++ source that uses torch's headers: the installed torch's
    include directory, its C++ ABI, and its ``c10`` library (already loaded by ``import torch``;
    found again through the rpath)."""
    import torch  # (not torch.utils.cpp_extension, which needs setuptools)

    root = Path(torch.__file__).parent
    return ("-std=c++17", "-w", f"-I{root / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-L{root / 'lib'}",
            f"-Wl,-rpath,{root / 'lib'}", "-lc10")


def _require_own_dir(out_dir: Path) -> None:
    """Make ``out_dir`` (mode 0700 when new) and check that only this user can write it: a library
    found there is loaded as is, so a directory another user can write (``/tmp/minivllm-kernels-N``
    made in advance by someone else, a symlink, a group-writable folder) could plant code.

    Raises:
        OSError: ``out_dir`` is a symlink, not a directory, owned by another user, or writable by
            its group or others (naming which).
    """
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(out_dir)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{out_dir} is not a plain directory (a symlink?): not loading libraries from it")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise OSError(f"{out_dir} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): not loading "
                      "libraries from it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{out_dir} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}): not "
                      "loading libraries from it")


def _build(source: Path, out_dir: Path, cc: list[str], python_api: bool = False, torch_api: bool = False) -> Path:
    """Compile ``source`` with ``cc`` into ``out_dir`` under a key of the source, compiler,
    flags and CPU (atomic rename: concurrent builders are harmless); ``python_api``: with the
    running Python's headers (:func:`_python_flags`); ``torch_api``: a C++ source with torch's
    (:func:`_torch_flags`; torch's version is part of the key)."""
    extra = (_python_flags() if python_api else ()) + (_torch_flags() if torch_api else ())
    src = source.read_bytes()
    for header in re.findall(rb'#include "([^"]+)"', src):  # our own headers are part of the source's key
        src += (source.parent / header.decode()).read_bytes()
    version = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30).stdout
    flags = _flags()
    key = hashlib.sha256(src + repr((cc, flags + extra, version, platform.machine(), _cpu_fingerprint(),
                                     (sys.version, sysconfig.get_config_var("SOABI")) if python_api else None,
                                     _torch_version() if torch_api else None)).encode())
    lib = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    _require_own_dir(out_dir)  # before trusting a library already there
    if lib.exists():
        return lib
    link_flags = [f for f in extra if f.startswith(("-l", "-L", "-Wl,"))]  # after the source: some linkers drop
    compile_flags = [f for f in extra if f not in link_flags]            # a library nothing before it needs
    # a first run compiles several sources, seconds each: say so before the wait, not after it
    logger.info("compiling %s with %s (first use on this machine; later runs load it from %s)", source.name,
                " ".join(cc), out_dir)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        tries = (flags, tuple(f for f in flags if f != "-march=native")) if "-march=native" in flags else (
            flags,)  # some compilers lack -march=native; a march asked for by name is not dropped
        for attempt in tries:
            proc = subprocess.run(cc + list(attempt) + compile_flags + [str(source), "-o", tmp] + link_flags + ["-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                os.replace(tmp, lib)
                return lib
        raise RuntimeError(f"{' '.join(cc)} failed: {proc.stderr.strip()[-300:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _torch_version() -> str:
    import torch
    return f"{torch.__version__} {torch.__file__}"


def build_and_load(source: Path, python_api: bool = False, torch_api: bool = False) -> tuple[ctypes.CDLL, str]:
    """``source`` compiled (or found already built) and loaded, with a line saying where from.
    ``python_api``: the source uses Python's C API; it is built against the running Python's
    headers and loaded as a ``ctypes.PyDLL`` (its functions are called holding the GIL; a
    ``CDLL`` releases it around each call). ``torch_api``: a C++ source using torch's headers,
    built with a C++ compiler against the installed torch and loaded as a ``PyDLL`` too (what it
    does to a tensor can touch that tensor's Python object).

    Raises:
        NativeBuildError: no compiler found, or every compiler/directory pair failed (the
            message has each error).
    """
    from minivllm.telemetry.peaks import cache_dir
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "")
    dirs = [cache_dir() / "kernels", Path(tempfile.gettempdir()) / f"minivllm-kernels-{user}"]
    errors = []
    for cc in _compilers(cxx=torch_api):
        for out_dir in dirs:
            try:
                path = _build(source, out_dir, cc, python_api, torch_api)
                loader = ctypes.PyDLL if python_api or torch_api else ctypes.CDLL
                return loader(str(path)), f"{path}, built with {' '.join(cc)}"
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                errors.append(f"{' '.join(cc)} into {out_dir}: {type(e).__name__}: {e}")
    raise NativeBuildError("; ".join(errors) if errors else (
        "no C++ compiler found (tried $CXX, Python's CXX, c++, g++, clang++)" if torch_api
        else "no C compiler found (tried $CC, Python's CC, cc, gcc, clang)"))


class NativeLibrary(Generic[T]):
    """One of our C sources as a process-wide object: built and wrapped (``wrap(cdll)``) at the
    first :meth:`load`, at most once per process (thread-safe), or the reason it could not be;
    ``None`` while the environment variable ``env_switch`` is 0 / false / no / off (read at every
    call, so flipping it between engines takes effect). ``python_api``, ``torch_api``: see
    :func:`build_and_load`."""

    def __init__(self, source: Path, env_switch: str, wrap: Callable[[ctypes.CDLL], T], python_api: bool = False,
                 torch_api: bool = False):
        self.source, self.env_switch, self._wrap, self.python_api = source, env_switch, wrap, python_api
        self.torch_api = torch_api
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}  # "obj" and "path", or "reason"

    def switched_off(self) -> bool:
        return switched_off(self.env_switch)

    def load(self) -> T | None:
        if self.switched_off():
            return None
        with self._lock:
            if "obj" not in self._state and "reason" not in self._state:
                try:
                    lib, self._state["path"] = build_and_load(self.source, self.python_api, self.torch_api)
                    self._state["obj"] = self._wrap(lib)
                except (NativeBuildError, AttributeError) as e:  # AttributeError: a symbol missing
                    self._state["reason"] = str(e)
            return self._state.get("obj")  # type: ignore[return-value]

    def loaded(self) -> T | None:
        """The object if an earlier :meth:`load` built it, else ``None``, without the lock or the
        environment switch (for per-call paths whose setup already called :meth:`load`)."""
        return self._state.get("obj")  # type: ignore[return-value]

    def unavailable_reason(self) -> str | None:
        """Why :meth:`load` returned ``None`` (``None`` if it did not)."""
        if self.switched_off():
            return f"{self.env_switch}={os.environ[self.env_switch]}"
        return self._state.get("reason")  # type: ignore[return-value]

    @property
    def path(self) -> str | None:
        """Where the loaded library came from and which compiler built it."""
        return self._state.get("path")  # type: ignore[return-value]
