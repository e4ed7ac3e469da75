"""Course conventions in code: predictions checked against measurements, claims checked on this run.

Two kinds of sentence in a notebook depend on the machine that runs it: a learner's prediction
("I expect batch 4 to cost 1.2x batch 1") and the author's claim ("decode at batch 4 costs about
the same as at batch 1"). Neither may be typed beside a number that a cell measures, because the
number changes from run to run and machine to machine. These helpers print the comparison from the
measurement itself, and never raise for a machine-dependent outcome: a notebook that runs on a busy
laptop where a claim does not hold says so plainly and carries on (nbval keeps passing).

* :func:`check_prediction` - a learner's numeric prediction against the measured value.
* :func:`check_claim` - an author's claim, evaluated on this run, with what was measured.
* :func:`render` - Markdown built from measured values (``display(Markdown(...))``).

Raises ``TypeError``/``ValueError`` only for programming errors (a non-numeric measurement, a
negative tolerance), never for what the machine measured or what the learner wrote.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["PredictionCheck", "ClaimCheck", "check_prediction", "check_claim", "render"]


@dataclass(frozen=True)
class PredictionCheck:
    """The outcome of :func:`check_prediction`.

    Attributes:
        prediction: what the learner wrote (None when they wrote nothing).
        measured: the value this run measured.
        rel_error: ``|prediction - measured| / |measured|`` (None without a prediction or when
            ``measured`` is 0).
        close: whether the prediction is within the tolerance (False without a prediction).
    """

    prediction: float | None
    measured: float
    rel_error: float | None
    close: bool


def _number(name: str, value) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out):  # a measurement that failed (a timer that read 0 divides into inf)
        raise ValueError(f"{name} is {out}: not a measurement")
    return out


def check_prediction(prediction, measured, *, rel_tol: float = 0.25, unit: str = "",
                     what: str = "the measured value", hint: str = "") -> PredictionCheck:
    """Compare a learner's numeric prediction with a measurement from this run and print the result.

    The comparison is printed only beside a prediction: with the exercise cell left empty it prints
    what to write, not the measured value. (The cells that measure print their figures as they run, so
    a notebook stored with its outputs shows them anyway: the course says to clear the outputs first.)
    What the learner wrote is never an error: an empty cell, a string, a list or True gets a
    sentence saying what to write, not a traceback (a check cell may hold two exercises' checks).

    Args:
        prediction: the learner's number (int/float), or None when the exercise cell was left empty.
        measured: the value the notebook measured just now.
        rel_tol: relative tolerance counted as "close" (0.25 = within 25%).
        unit: printed after the numbers (e.g. ``"ms"``, ``"x"``).
        what: a short name for the quantity, used in the printed sentence.
        hint: printed when the prediction is not close (default: a question about what the estimate
            left out, or, for a guess 10x or more away, about its units).

    Returns:
        A :class:`PredictionCheck`; it is also printed as one or two plain sentences.

    Raises:
        TypeError: ``measured`` is not a number.
        ValueError: ``rel_tol`` is not a number >= 0 (NaN included), or ``measured`` is NaN or
            infinite.
    """
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, numbers.Real) or not rel_tol >= 0:  # NaN fails >= too
        raise ValueError(f"rel_tol must be a number >= 0, got {rel_tol!r}")
    m = _number("measured", measured)
    u = f" {unit}" if unit else ""
    in_unit = f" (in {unit})" if unit else ""
    if prediction is None:
        print(f"No prediction yet: write your guess{in_unit} in the exercise cell above, run it, then run this "
              f"cell again to compare it with {what} on this run.")
        return PredictionCheck(None, m, None, False)
    p = _learner_number(prediction)
    if p is None:
        quoted = isinstance(prediction, str) and _learner_number(prediction.strip(), strings=True) is not None
        print(f"Your prediction should be a number{in_unit}, not {prediction!r}"
              + (": write it without the quotes" if quoted else "") + ". Change the exercise cell and run both again.")
        return PredictionCheck(None, m, None, False)
    rel = abs(p - m) / abs(m) if m != 0 else None
    close = (rel is not None and rel <= rel_tol) or (m == 0 and p == 0)
    verdict = "close" if close else "not close"
    # under 1%: one more digit, so that a near miss of an exact count never reads "0% off: not close"
    detail = ((f"{rel:.0%} off" if rel == 0 or rel >= 0.01 else f"{rel * 100:.2g}% off")
              if rel is not None else "measured 0")
    print(f"You predicted {p:.4g}{u}; {what} on this run is {m:.4g}{u} ({detail}: {verdict}, "
          f"tolerance {rel_tol:.0%}).")
    if not close:
        factor = abs(p / m) if m != 0 and p != 0 else None
        if hint:
            print(hint)
        elif factor is not None and (factor >= 10 or factor <= 0.1):
            print(f"Your guess is {max(factor, 1 / factor):.0f}x {'above' if factor > 1 else 'below'} the "
                  f"measurement: check its unit{f' ({unit})' if unit else ''} and what is counted before opening "
                  "the solution.")
        else:
            print("Before opening the solution, ask what your estimate left out or counted twice.")
    return PredictionCheck(p, m, rel, close)


def _learner_number(value, strings: bool = False) -> float | None:
    """``value`` as a finite float, or None where a learner wrote something else (a bool, a string
    unless ``strings``, a list, NaN, an infinity)."""
    if isinstance(value, bool) or (isinstance(value, (str, bytes)) and not strings):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


@dataclass(frozen=True)
class ClaimCheck:
    """The outcome of :func:`check_claim`: the claim, whether it held on this run, and the evidence."""

    claim: str
    holds: bool
    evidence: str


def check_claim(claim: str, holds, evidence: str, *, why_it_may_not: str = "") -> ClaimCheck:
    """Print whether a claim made in the prose holds on this run, with the measured evidence.

    Args:
        claim: the sentence as the prose states it (phrased so it should hold on any machine).
        holds: the condition, computed from this run's measurements (truthy/falsy).
        evidence: the measured figures behind it, as text (e.g. ``"batch 4: 1.12x batch 1"``).
        why_it_may_not: printed when the claim fails here: what on a machine can break it (load
            from other processes, a GPU's launch overhead, ...).

    Returns:
        A :class:`ClaimCheck` (never raises for a claim that does not hold).
    """
    ok = bool(holds)
    if ok:
        print(f"Holds on this run: {claim} ({evidence}).")
    else:
        print(f"Does NOT hold on this run: {claim} ({evidence})."
              + (f" {why_it_may_not}" if why_it_may_not else ""))
    return ClaimCheck(claim, ok, evidence)


def render(text: str):
    """Display ``text`` as Markdown (a sentence built from measured values) and return the object.

    Use an f-string over the cell's results, so the number in the sentence is the number measured:
    ``render(f"Batch 4 cost **{r4:.2f}x** batch 1 here.")``.
    """
    from IPython.display import Markdown, display

    md = Markdown(text)
    display(md)
    return md
