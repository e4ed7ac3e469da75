"""Attention backends behind one interface, and how one is chosen.

``torch`` (the reference, any device), ``triton`` (our kernels; CUDA, or CPU under
``TRITON_INTERPRET=1``), ``flash_attn`` (flash-attn 2's paged API; CUDA, block size a
multiple of 256). Nothing here imports triton or flash-attn until a backend is built.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("torch", "triton", "flash_attn")

#: flash-attn's paged KV kernels need this many tokens per block (or a multiple of it)
FLASH_ATTN_BLOCK_MULTIPLE = 256

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKEND_NAMES",
    "default_block_size",
    "flash_attn_available",
    "get_attention_backend",
    "resolve_backend_name",
    "triton_available",
]


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def triton_available() -> bool:
    """True when the ``triton`` package is installed."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def default_block_size(backend_name: str) -> int:
    """Default KV block size in tokens: 256 for flash_attn (its paged API needs it), else 16."""
    if backend_name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {backend_name!r}; choose from {BACKEND_NAMES}")
    return FLASH_ATTN_BLOCK_MULTIPLE if backend_name == "flash_attn" else 16


def resolve_backend_name(
    name: str,
    device: torch.device | str,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """Turn an ``attention_backend`` engine arg into a concrete backend name.

    ``"auto"``: flash_attn when it is importable, the device is CUDA, ``block_size`` is
    a multiple of 256 (or not chosen yet: ``None``) and ``dtype`` is fp16/bf16 (or not
    given); else triton on CUDA; else torch. An explicit name is honoured or refused with
    a clear error.

    Args:
        name: ``"auto"``, ``"torch"``, ``"triton"`` or ``"flash_attn"``.
        device: where the model runs.
        block_size: KV block size in tokens, or ``None`` when the caller will use
            ``default_block_size`` of the result.
        dtype: the model's dtype, when known (flash-attn computes only fp16/bf16).
    """
    device = torch.device(device)
    if name not in ("auto",) + BACKEND_NAMES:
        raise ValueError(
            f"unknown attention_backend {name!r}; choose from {('auto',) + BACKEND_NAMES}"
        )
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    on_cuda = device.type == "cuda"
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if on_cuda and half and flash_attn_available() and (
            block_size is None or block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
        ):
            return "flash_attn"
        if on_cuda and triton_available():
            return "triton"
        return "torch"
    if name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package (pip install triton)")
        if not on_cuda and not _triton_interpret():
            raise ValueError(
                f"attention_backend='triton' on device {device} needs the Triton interpreter: "
                "set TRITON_INTERPRET=1 in the environment before starting Python (slow; for tests)"
            )
    if name == "flash_attn":
        if not on_cuda:
            raise ValueError(f"attention_backend='flash_attn' needs a CUDA device, got {device}")
        if not flash_attn_available():
            raise ValueError(
                "attention_backend='flash_attn' but flash-attn is not installed "
                "(pip install flash-attn --no-build-isolation, see environment.yml)"
            )
        if not half:
            raise ValueError(
                f"attention_backend='flash_attn' computes only float16/bfloat16, got dtype={dtype}"
            )
        if block_size is not None and block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
            raise ValueError(
                f"attention_backend='flash_attn' needs block_size a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}"
            )
    return name


def get_attention_backend(
    name: str, device: torch.device | str, block_size: int, dtype: torch.dtype | None = None,
    heads: tuple[int, int, int] | None = None,
) -> AttentionBackend:
    """Build the backend ``resolve_backend_name(name, device, block_size)`` picks.

    Args:
        name: ``"auto"`` or a backend name (see ``resolve_backend_name``).
        device: where the model runs.
        block_size: KV block size in tokens (flash_attn refuses sizes not a multiple of 256).
        dtype: the model's dtype, when known (see ``resolve_backend_name``).
        heads: (query heads, KV heads, head_dim) of one rank, when known: the CPU startup log line
            then says which loops the C decode kernel runs for them.
    """
    resolved = resolve_backend_name(name, device, block_size, dtype)
    if resolved == "torch":
        from minivllm.layers.attention.torch_backend import TorchAttentionBackend

        # the C decode kernel serves fp32 CPU tensors only: not built for other devices or dtypes
        if torch.device(device).type != "cpu":
            return TorchAttentionBackend(native_decode=False)
        from minivllm.layers.attention import cpu_decode
        from minivllm.logger import init_logger

        init_logger(__name__).info("CPU decode attention: %s", cpu_decode.describe(dtype, heads))
        return TorchAttentionBackend(native_decode=None if dtype in (None, torch.float32) else False)
    if resolved == "triton":
        from minivllm.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from minivllm.layers.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend(block_size=block_size)
