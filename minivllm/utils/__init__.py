"""Small helpers shared across the package."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ints, ``b > 0`` (e.g. blocks needed for ``a`` tokens of ``b``
    per block). Exact for any size, unlike ``math.ceil(a / b)`` which goes through a float."""
    return -(-a // b)
