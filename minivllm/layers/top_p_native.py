"""Top-p's kept sets of rows of logits by one C call (``csrc/top_p_f32.c``, built at first use), for
:mod:`minivllm.layers.cpu_sampling`: each row's bucket splits and the sort of its cut bucket.

Why: the numpy splits of a row are some twenty numpy calls, and over a small vocabulary each costs
about its call overhead: ~66 us a row of 4,096 tokens (one thread, Zen 4 EPYC, 2026-12-04), about
half of the sampler's time at 8 rows with ``top_p``. The C function makes the same operations in
the same order (fp32 differences, products and clip, fp64 sums), so it keeps the same ids;
``tests/test_top_p_native.py`` checks that against the numpy path. The rows' softmax stays in
torch and numpy, computed as before, for the same reason. ``MINIVLLM_CPU_TOP_P=0`` switches it off
(read at every call); without a C compiler the numpy path runs.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from minivllm.layers.native_build import NativeLibrary

__all__ = ["describe", "kept_rows", "load", "unavailable_reason"]

SOURCE = Path(__file__).with_name("csrc") / "top_p_f32.c"
ENV_SWITCH = "MINIVLLM_CPU_TOP_P"


def _wrap(lib: ctypes.CDLL):
    fn = lib.top_p_rows_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, i64, i64, p, p, i64, p, p]
    fn.restype = ctypes.c_int
    return fn


_library = NativeLibrary(SOURCE, ENV_SWITCH, _wrap)


def load():
    """The compiled function, built on first use; ``None`` when switched off or unbuildable."""
    return _library.load()


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it did not)."""
    return _library.unavailable_reason()


def describe() -> str:
    """One line for the startup log: which path top-p's bucket splits take on a CPU."""
    if _library.switched_off():
        return f"numpy, row by row (switched off: {unavailable_reason()})"
    if load() is None:
        return f"numpy, row by row (the C split unavailable: {unavailable_reason()})"
    return f"C, one call for up to 65,536 logits of a batch's rows ({_library.path})"


def kept_rows(fn, y: np.ndarray, key: np.ndarray, probs: np.ndarray, his: np.ndarray,
              thresholds: np.ndarray, sort_at_most: int) -> list[np.ndarray]:
    """The ids top-p keeps in each row (int64, in no particular order), one C call for the rows.

    Args:
        fn: :func:`load`'s result.
        y, key, probs: fp32 ``[R, V]`` C-contiguous: the rows' logits, ``max(y) - y`` and their
            softmax (no NaN).
        his: fp64 ``[R]``, the top of each row's range of keys split into buckets (the largest
            key, at most the span), >= 0.
        thresholds: fp64 ``[R]``, top_p less the slack.
        sort_at_most: a bucket holding the cut is split again while it has more tokens than this.

    Raises:
        ValueError: arrays of other dtypes, shapes or layouts, or a ``his`` entry NaN or negative.
        MemoryError: the C code's working memory (up to ~34 bytes a logit of one row) could not be had.
    """
    r, v = y.shape
    for a in (y, key, probs):
        if a.dtype != np.float32 or a.shape != (r, v) or not (a.flags.c_contiguous and a.flags.aligned):
            raise ValueError(f"top_p_native.kept_rows: aligned fp32 C-contiguous [{r}, {v}] arrays expected, "
                             f"got {a.dtype} {a.shape}")
    if his.dtype != np.float64 or thresholds.dtype != np.float64 or his.shape != (r,) or thresholds.shape != (r,):
        raise ValueError(f"top_p_native.kept_rows: fp64 his and thresholds of {r} rows expected, got "
                         f"{his.dtype} {his.shape} and {thresholds.dtype} {thresholds.shape}")
    if not (his >= 0).all():
        raise ValueError(f"top_p_native.kept_rows: his must be >= 0, got {his.tolist()}")
    his, thresholds = np.ascontiguousarray(his), np.ascontiguousarray(thresholds)
    out = np.empty((r, v), dtype=np.int64)
    counts = np.empty(r, dtype=np.int64)
    if fn(y.ctypes.data, key.ctypes.data, probs.ctypes.data, r, v, his.ctypes.data, thresholds.ctypes.data,
          sort_at_most, out.ctypes.data, counts.ctypes.data):
        raise MemoryError(f"top_p_native.kept_rows: the C split ran out of memory ({r} rows of {v} logits)")
    return [out[i, :n] for i, n in enumerate(counts.tolist())]
