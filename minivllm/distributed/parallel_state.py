"""Which tensor-parallel rank this process is, and the collectives the layers use.

Megatron-style tensor parallelism (Shoeybi et al., 2019, "Megatron-LM"): column-parallel
layers split their output features across ranks, row-parallel layers split their input
features and sum the partial products with an all-reduce.

The state is process-global and defaults to rank 0 of 1, in which case every collective
returns its input unchanged, so single-device code never touches ``torch.distributed``.
The process launcher (one process per rank) calls :func:`set_tp` after
``torch.distributed.init_process_group`` and *before* building the model, because layers
read the rank and size when they allocate their shards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK: int = 0
_TP_SIZE: int = 1
_TP_GROUP: "dist.ProcessGroup | None" = None


def set_tp(rank: int, size: int, group: "dist.ProcessGroup | None" = None) -> None:
    """Set this process's tensor-parallel rank and world size.

    Args:
        rank: this process's rank, ``0 <= rank < size``.
        size: number of tensor-parallel ranks (>= 1).
        group: the process group the collectives run on; ``None`` means the default
            (world) group. Ignored when ``size == 1``.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor parallel size must be a positive int, got {size!r}")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank must be in [0, {size}), got {rank!r}")
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    _TP_RANK, _TP_SIZE, _TP_GROUP = rank, size, group


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 when tensor parallelism is not set up)."""
    return _TP_RANK


def get_tp_size() -> int:
    """Number of tensor-parallel ranks (1 when tensor parallelism is not set up)."""
    return _TP_SIZE


def get_tp_group() -> "dist.ProcessGroup | None":
    """The process group used by the collectives (``None``: the default group)."""
    return _TP_GROUP


def tensor_model_parallel_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all tensor-parallel ranks, in place; returns ``t``.

    Any shape/dtype; every rank gets the sum. Identity at tp=1.
    """
    if _TP_SIZE == 1:
        return t
    dist.all_reduce(t, group=_TP_GROUP)
    return t


def tensor_model_parallel_all_gather(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (rank order); every rank gets the result.

    ``t`` must have the same shape on every rank. Identity at tp=1.
    """
    if _TP_SIZE == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, t, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_gather(t: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every rank's ``t`` along ``dim`` on rank ``dst`` only.

    Returns the concatenation on ``dst`` and ``None`` on every other rank. At tp=1 returns ``t``.
    ``dst`` is a rank within the tensor-parallel group.
    """
    if _TP_SIZE == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(_TP_SIZE)] if _TP_RANK == dst else None
    global_dst = dist.get_global_rank(_TP_GROUP, dst) if _TP_GROUP is not None else dst
    dist.gather(t, parts, dst=global_dst, group=_TP_GROUP)
    return torch.cat(parts, dim=dim) if parts is not None else None
