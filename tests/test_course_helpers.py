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


def test_no_prediction_keeps_the_measurement_back(capsys):
    # a notebook is stored run with its exercise cells empty: the check printed each answer there
    res = check_prediction(None, 12.5, unit="ms", what="the decode step")
    assert res.prediction is None and not res.close and res.measured == 12.5
    out = capsys.readouterr().out
    assert "12.5" not in out and "No prediction yet" in out and "(in ms)" in out
    # it promises a comparison, not that the figure stays hidden (the measuring cells print it anyway)
    assert "compare it with the decode step on this run" in out and "shown once" not in out


def test_a_near_miss_of_an_exact_count_does_not_read_zero_percent_off(capsys):
    """Predicting 103.5 steps for 104 with rel_tol=0 printed "(0% off: not close, tolerance 0%)"."""
    res = check_prediction(103.5, 104, rel_tol=0, unit="steps")
    assert not res.close
    out = capsys.readouterr().out
    assert "0.48% off: not close" in out and "(0% off" not in out
    check_prediction(104, 104, rel_tol=0)
    assert "0% off: close" in capsys.readouterr().out


def test_the_quantity_keeps_its_capitals(capsys):
    check_prediction(1, 114688, what="Qwen3-0.6B's KV bytes per token")
    assert "Qwen3-0.6B's KV bytes per token on this run" in capsys.readouterr().out


@pytest.mark.parametrize("written, says", [("about ten", "not 'about ten'."), ("12", "without the quotes"),
                                           ([3], "not [3]"), (True, "not True"), (float("nan"), "not nan"),
                                           (float("inf"), "not inf")])
def test_what_the_learner_wrote_is_answered_not_raised(capsys, written, says):
    # a string or a list raised TypeError (and stopped a second exercise's check in the same cell);
    # "12" and True were taken as numbers
    res = check_prediction(written, 7.0, unit="calls")
    assert res.prediction is None and not res.close
    out = capsys.readouterr().out
    assert "should be a number (in calls)" in out and says in out and "7" not in out


def test_a_guess_ten_times_off_is_asked_about_its_units_and_a_hint_replaces_the_question(capsys):
    check_prediction(82, 0.82, rel_tol=0.1)
    out = capsys.readouterr().out
    assert "100x above the measurement: check its unit" in out and "left out" not in out
    check_prediction(0.5, 0.82, rel_tol=0.1)
    assert "left out or counted twice" in capsys.readouterr().out
    check_prediction(0.5, 0.82, rel_tol=0.1, hint="Count the blocks each prefix fills.")
    out = capsys.readouterr().out
    assert "Count the blocks" in out and "left out" not in out
    check_prediction(0.8, 0.82, rel_tol=0.1, hint="Count the blocks each prefix fills.")
    assert "Count the blocks" not in capsys.readouterr().out  # a close guess gets no hint


def test_bad_input_names_the_value():
    with pytest.raises(TypeError, match="'fast'"):
        check_prediction(1.0, "fast")
    with pytest.raises(ValueError, match="-0.1"):
        check_prediction(1.0, 1.0, rel_tol=-0.1)
    # "a" raised "'<' not supported", and NaN was taken (printed as "tolerance nan%")
    for bad in ("a", float("nan"), None):
        with pytest.raises(ValueError, match=f"rel_tol must be a number >= 0, got {bad!r}"):
            check_prediction(1.0, 1.0, rel_tol=bad)


@pytest.mark.parametrize("measured", [float("inf"), float("-inf"), float("nan")])
def test_a_measurement_that_is_no_number_is_refused_by_name(measured):
    """An infinite measurement printed "nan% off" and then raised ZeroDivisionError."""
    with pytest.raises(ValueError, match=f"measured is {measured}: not a measurement"):
        check_prediction(2.0, measured)


def test_claim_that_fails_does_not_raise(capsys):
    res = check_claim("batch 4 costs about batch 1", 2.7 <= 1.3, "batch 4: 2.70x batch 1",
                      why_it_may_not="Other processes were competing for the cores.")
    assert not res.holds
    out = capsys.readouterr().out
    assert "Does NOT hold" in out and "2.70x" in out and "competing" in out
    assert check_claim("x", True, "y").holds


def test_quiet_profile_drops_the_profilers_start_and_stop_lines_and_keeps_the_blocks_stderr():
    # torch 2.13's profiler wrote "USDT: ... profiler_start" / "profiler_stop" to stderr under every profiled
    # cell of chapter 11 (a red box in JupyterLab, read as an error)
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, torch\nfrom torch.profiler import ProfilerActivity\nfrom widgets import quiet_profile\n"
            "with quiet_profile(activities=[ProfilerActivity.CPU]) as p:\n    torch.ones(3) + 1\n"
            "    print('said in the block', file=sys.stderr)\nprint(any(e.name.startswith('aten::') for e in p.events()))\n")
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
    assert "said in the block" in run.stderr and "profiler_start" not in run.stderr and "profiler_stop" not in run.stderr
