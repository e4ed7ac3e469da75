"""Top-p's kept sets through the C split (minivllm/layers/top_p_native.py, csrc/top_p_f32.c) are the
numpy split's, id for id: ties, equal logits, banned tokens, narrow and wide ranges, flat rows whose
cut bucket is split again in numpy, a row alone or in a batch, and with the C code switched off."""
from __future__ import annotations

import numpy as np
import pytest

from helpers_native import native_or_skip
from minivllm.layers import cpu_sampling, top_p_native
from minivllm.layers.sampler import TOP_P_TOLERANCE


def _row(rng, v: int, kind: int) -> np.ndarray:
    y = rng.standard_normal(v) * [0.01, 0.5, 3.0, 10.0, 100.0][kind % 5]
    if kind == 5:
        y = np.round(y * 4) / 4  # many ties
    elif kind == 6:
        y[:] = 1.5  # every logit equal: sorted whole
    elif kind == 7:
        y[rng.random(v) < 0.5] = -np.inf  # banned tokens
    elif kind == 8:
        y = 1 + rng.standard_normal(v) * 1e-7  # a range fp32 can hardly split
    elif kind == 9:
        y[rng.integers(v)] = 50.0  # one token holds nearly all the mass
    return y.astype(np.float32)


def _numpy_split(y: np.ndarray, thresholds) -> list[list[int]]:
    return [sorted(cpu_sampling._top_p_ids(y[i], float(t)).tolist()) for i, t in enumerate(thresholds)]


@pytest.mark.parametrize("v", [7, 100, 4096, 4099, 30_000])
def test_the_c_split_keeps_the_numpy_splits_ids(v):
    native_or_skip(top_p_native, "the C top-p split")
    rng = np.random.default_rng(v)
    for trial in range(12):
        y = np.stack([_row(rng, v, kind) for kind in range(10)])
        thresholds = rng.choice([1e-9, 0.1, 0.5, 0.9, 0.95, 0.999], size=len(y)) - TOP_P_TOLERANCE
        got = [sorted(ids.tolist()) for ids in cpu_sampling._top_p_rows(y, thresholds)]
        assert got == _numpy_split(y, thresholds), (v, trial)


def test_a_flat_row_is_split_again_in_c_and_a_row_does_not_depend_on_its_batch(monkeypatch):
    """60,000 nearly equal logits and one far below them (the buckets span 30 nats) put all but
    one token in the cut bucket, far more than the sort limit: the C code splits it again, as
    numpy does, and no row goes to numpy. A row's ids are the same alone and in a batch (4,099
    tokens: rows do not start on a vector boundary; 20 rows: two C calls)."""
    native_or_skip(top_p_native, "the C top-p split")
    rng = np.random.default_rng(1)
    flat = np.stack([(rng.standard_normal(60_000) * 1e-3).astype(np.float32), _row(rng, 60_000, 2)])
    flat[0, 0] = -30.0
    thresholds = np.array([0.9, 0.9]) - TOP_P_TOLERANCE
    want = _numpy_split(flat, thresholds)
    calls = []
    real = top_p_native.kept_rows
    monkeypatch.setattr(top_p_native, "kept_rows", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cpu_sampling, "_top_p_ids", lambda *a: pytest.fail("a row went to numpy"))
    got = [sorted(ids.tolist()) for ids in cpu_sampling._top_p_rows(flat, thresholds)]
    assert got == want
    y = np.stack([_row(rng, 4099, kind % 10) for kind in range(20)])  # more than one C call's rows
    thresholds = np.full(20, 0.9 - TOP_P_TOLERANCE)
    calls.clear()
    together = cpu_sampling._top_p_rows(y, thresholds)
    assert len(calls) == 2
    for i in range(20):
        assert np.array_equal(np.sort(cpu_sampling._top_p_rows(y[i:i + 1], thresholds[:1])[0]), np.sort(together[i]))


def test_kept_rows_is_kept_token_ids_row_by_row_with_the_c_code_on_and_off(monkeypatch):
    rng = np.random.default_rng(2)
    y = np.stack([_row(rng, 4096, kind) for kind in range(10)] + [np.full(4096, np.nan, dtype=np.float32)])
    top_k = np.array([0, 0, 0, 5, 50, 0, 0, 4096, 0, 1, 0])
    top_p = np.array([0.9, 0.95, 1.0, 0.9, 1.0, 0.5, 0.999, 0.9, 0.3, 1.0, 0.9], dtype=np.float32)
    want = [None if not np.isfinite(y[i].max()) else
            cpu_sampling.kept_token_ids(y[i], int(top_k[i]), float(top_p[i])) for i in range(len(y))]
    for switch in ("1", "0"):
        monkeypatch.setenv(top_p_native.ENV_SWITCH, switch)
        got = cpu_sampling.kept_rows(y, top_k, top_p)
        assert [g is None for g in got] == [w is None for w in want]
        assert all(g is None or sorted(g.tolist()) == sorted(w.tolist()) for g, w in zip(got, want))
    assert top_p_native.load() is None  # switched off: the numpy path ran


def test_the_c_split_refuses_arrays_it_does_not_take():
    fn = native_or_skip(top_p_native, "the C top-p split")
    y = np.zeros((2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="float64"):
        top_p_native.kept_rows(fn, y.astype(np.float64), y, y, np.ones(2), np.ones(2), 2048)
    with pytest.raises(ValueError, match="fp64 his"):
        top_p_native.kept_rows(fn, y, y, y, np.ones(3), np.ones(2), 2048)
    with pytest.raises(ValueError, match=r"his must be >= 0, got \[nan, 1.0\]"):
        top_p_native.kept_rows(fn, y, y, y, np.array([np.nan, 1.0]), np.ones(2), 2048)
