"""widgets.course: predictions and claims are compared with the measurement, never raise for it."""
from __future__ import annotations

import pytest

from widgets import check_claim, check_prediction


def test_prediction_close_and_far(capsys):
    near = check_prediction(1.1, 1.0, rel_tol=0.25, unit="x")
    assert near.close and near.rel_error == pytest.approx(0.1)
    far = check_prediction(3.0, 1.0, rel_tol=0.25)
    assert not far.close and far.rel_error == pytest.approx(2.0)
    out = capsys.readouterr().out
    assert "1.1 x" in out and "not close" in out


def test_no_prediction_prints_the_measurement(capsys):
    res = check_prediction(None, 12.5, unit="ms", what="the decode step")
    assert res.prediction is None and not res.close
    assert "12.5 ms" in capsys.readouterr().out


def test_the_quantity_keeps_its_capitals(capsys):
    check_prediction(None, 114688, what="Qwen3-0.6B's KV bytes per token")
    assert "Qwen3-0.6B's KV bytes per token on this run" in capsys.readouterr().out


def test_bad_input_names_the_value():
    with pytest.raises(TypeError, match="'fast'"):
        check_prediction("fast", 1.0)
    with pytest.raises(ValueError, match="-0.1"):
        check_prediction(1.0, 1.0, rel_tol=-0.1)
    # "a" raised "'<' not supported", and NaN was taken (printed as "tolerance nan%")
    for bad in ("a", float("nan"), None):
        with pytest.raises(ValueError, match=f"rel_tol must be a number >= 0, got {bad!r}"):
            check_prediction(1.0, 1.0, rel_tol=bad)


def test_claim_that_fails_does_not_raise(capsys):
    res = check_claim("batch 4 costs about batch 1", 2.7 <= 1.3, "batch 4: 2.70x batch 1",
                      why_it_may_not="Other processes were competing for the cores.")
    assert not res.holds
    out = capsys.readouterr().out
    assert "Does NOT hold" in out and "2.70x" in out and "competing" in out
    assert check_claim("x", True, "y").holds
