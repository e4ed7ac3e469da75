"""Small helpers that read Hugging Face config fields whose name or place varies by version.

They accept a ``transformers.PretrainedConfig`` or any object with the same attributes.
"""
from __future__ import annotations

import torch

from minivllm.utils.dtypes import MODEL_DTYPES, canonical_dtype_name


def _attr(cfg, name: str):
    # Read through __dict__ first: transformers 5 warns on ``config.torch_dtype`` access.
    d = getattr(cfg, "__dict__", {})
    if name in d:
        return d[name]
    return getattr(cfg, name, None)


def get_rope_theta(cfg) -> float:
    """RoPE base: ``cfg.rope_parameters["rope_theta"]`` (transformers >= 5) or top-level
    ``cfg.rope_theta`` (older configs); 10000.0 (the RoFormer default) when neither is set.

    Raises:
        ValueError: a rope scaling type other than "default" (not implemented).
    """
    params = _attr(cfg, "rope_parameters")
    scaling = _attr(cfg, "rope_scaling")
    for p in (params, scaling):
        if isinstance(p, dict):
            kind = p.get("rope_type", p.get("type", "default"))
            if kind not in (None, "default"):
                raise ValueError(f"rope type {kind!r} is not supported (only 'default' RoPE)")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = _attr(cfg, "rope_theta")
    return float(theta) if theta is not None else 10000.0


def get_head_dim(cfg) -> int:
    """Per-head size: ``cfg.head_dim`` when present (Qwen3-0.6B: 128 while 1024/16 = 64),
    else ``hidden_size // num_attention_heads``."""
    head_dim = _attr(cfg, "head_dim")
    if head_dim is not None:
        return int(head_dim)
    return int(cfg.hidden_size) // int(cfg.num_attention_heads)


def get_config_dtype(cfg) -> torch.dtype | None:
    """The checkpoint's dtype from ``cfg.dtype`` or (older configs) ``cfg.torch_dtype``;
    ``None`` when neither is set.

    Raises:
        ValueError: an unrecognised dtype name.
    """
    value = _attr(cfg, "dtype")
    if value is None:
        value = _attr(cfg, "torch_dtype")
    if value is None or isinstance(value, torch.dtype):
        return value
    name = canonical_dtype_name(str(value))
    if name not in MODEL_DTYPES:
        raise ValueError(f"unrecognised dtype {value!r} in model config")
    return getattr(torch, name)
