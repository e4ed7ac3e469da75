"""Small helpers shared across the package."""
from __future__ import annotations

import uuid

from minivllm.utils.argparse_utils import FlexibleArgumentParser  # where older vLLM scripts import it from

__all__ = ["FlexibleArgumentParser", "cdiv", "random_uuid"]


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ints, ``b > 0`` (e.g. blocks needed for ``a`` tokens of ``b``
    per block). Exact for any size, unlike ``math.ceil(a / b)`` which goes through a float."""
    return -(-a // b)


def random_uuid() -> str:
    """vLLM's ``random_uuid``: a fresh random id (32 hex characters, ``uuid4``), what engine loops
    use as request ids."""
    return uuid.uuid4().hex
