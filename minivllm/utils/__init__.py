"""Small helpers shared across the package."""
from __future__ import annotations

from minivllm.utils.argparse_utils import FlexibleArgumentParser  # where older vLLM scripts import it from

__all__ = ["FlexibleArgumentParser", "cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ints, ``b > 0`` (e.g. blocks needed for ``a`` tokens of ``b``
    per block). Exact for any size, unlike ``math.ceil(a / b)`` which goes through a float."""
    return -(-a // b)
