"""Checks of arguments that the library's entry points and the widgets share."""
from __future__ import annotations

import numbers

import numpy as np


def is_count(value, least: int = 0) -> bool:
    """``value`` is an integer (Python's or numpy's; not a bool) of at least ``least``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) and value >= least
