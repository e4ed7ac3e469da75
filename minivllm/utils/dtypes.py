"""The one table of dtype names minivllm understands, and bytes per element.

Torch-free on purpose: the roofline accounting (``minivllm.telemetry``) reads it without
importing torch. A canonical name is the ``torch`` attribute of that dtype
(``getattr(torch, "bfloat16")``); the other spellings are what users and checkpoint configs
write ("bf16", "half", "torch.float16").
"""
from __future__ import annotations

#: canonical name -> (bytes per element, other accepted spellings)
DTYPES: dict[str, tuple[int, tuple[str, ...]]] = {
    "float32": (4, ("fp32", "float")),
    "float16": (2, ("fp16", "half")),
    "bfloat16": (2, ("bf16",)),
    "float64": (8, ("fp64", "double")),
    "float8_e4m3fn": (1, ("fp8",)),
    "float8_e5m2": (1, ()),
    "int8": (1, ()),
    "uint8": (1, ()),
}

#: the dtypes a model runs in (``EngineArgs.dtype``, a checkpoint config's ``dtype``)
MODEL_DTYPES = ("float32", "bfloat16", "float16")

_CANONICAL = {spelling: name for name, (_, others) in DTYPES.items() for spelling in (name, *others)}


def canonical_dtype_name(name: str) -> str | None:
    """``"bf16"``, ``"BFloat16"``, ``"torch.bfloat16"`` -> ``"bfloat16"``; None for a name not
    in ``DTYPES`` (or not a string)."""
    if not isinstance(name, str):
        return None
    return _CANONICAL.get(name.lower().removeprefix("torch."))


def dtype_spellings(names) -> list[str]:
    """Every accepted spelling of the canonical ``names``, sorted (for error messages)."""
    return sorted(s for s, name in _CANONICAL.items() if name in names)
