"""Which tensor-parallel rank this process is, and the collectives the layers use.

Megatron-style tensor parallelism (Shoeybi et al., 2019, "Megatron-LM"): column-parallel
layers split their output features across ranks, row-parallel layers split their input
features and sum the partial products with an all-reduce.

The state defaults to rank 0 of 1, in which case every collective returns its input
unchanged, so single-device code never touches ``torch.distributed``.

Two ways to set it:

* :func:`set_tp` sets the process-wide state. A worker process (one model shard per
  process) calls it once, after creating its process group and *before* building the
  model, because layers read the rank and size when they allocate their shards.
* :func:`tp_scope` overrides it for the current thread only, for a block. The engine's own
  process uses this: it may hold several engines at once (a tp=2 engine and a tp=1
  engine, or two tp=2 engines with different groups), so the rank-0 runner enters its
  scope around building its shard and around every forward pass.

``group`` may be ``None`` (the default ``torch.distributed`` group) or any process-group
object, including one created directly (``ProcessGroupGloo(store, rank, size)``) and not
registered with ``torch.distributed``; collectives call the group object's own methods.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist


class TPState(NamedTuple):
    rank: int
    size: int
    group: "dist.ProcessGroup | None"


_GLOBAL = TPState(0, 1, None)
_LOCAL = threading.local()  # .state: a TPState overriding _GLOBAL inside tp_scope


def _validated(rank: int, size: int, group) -> TPState:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor parallel size must be a positive int, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank must be in [0, {size}), got {rank!r}")
    return TPState(rank, size, group)


def set_tp(rank: int, size: int, group: "dist.ProcessGroup | None" = None) -> None:
    """Set this process's tensor-parallel rank and world size (process-wide).

    Args:
        rank: this process's rank, ``0 <= rank < size``.
        size: number of tensor-parallel ranks (>= 1).
        group: the process group the collectives run on; ``None`` means the default
            (world) group. Ignored when ``size == 1``.
    """
    global _GLOBAL
    _GLOBAL = _validated(rank, size, group)


@contextmanager
def tp_scope(rank: int, size: int, group: "dist.ProcessGroup | None" = None) -> Iterator[None]:
    """Use ``(rank, size, group)`` in the current thread for the duration of the block.

    Scopes nest; on exit the previous state (an outer scope, or the process-wide one)
    is back.
    """
    state = _validated(rank, size, group)
    previous = getattr(_LOCAL, "state", None)
    _LOCAL.state = state
    try:
        yield
    finally:
        _LOCAL.state = previous


def _state() -> TPState:
    return getattr(_LOCAL, "state", None) or _GLOBAL


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 when tensor parallelism is not set up)."""
    return _state().rank


def get_tp_size() -> int:
    """Number of tensor-parallel ranks (1 when tensor parallelism is not set up)."""
    return _state().size


def get_tp_group() -> "dist.ProcessGroup | None":
    """The process group used by the collectives (``None``: the default group)."""
    return _state().group


def tensor_model_parallel_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all tensor-parallel ranks, in place; returns ``t``.

    Any shape/dtype; every rank gets the sum. Identity at tp=1.
    """
    st = _state()
    if st.size == 1:
        return t
    if st.group is None:
        dist.all_reduce(t)
    else:
        st.group.allreduce([t]).wait()
    return t


def tensor_model_parallel_all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``t`` over all tensor-parallel ranks, in place; returns ``t``
    (identity at tp=1). Used once per layer at load time (int8 scales of row-parallel layers)."""
    st = _state()
    if st.size == 1:
        return t
    if st.group is None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    else:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        st.group.allreduce([t], opts).wait()
    return t


def tensor_model_parallel_all_gather(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (rank order); every rank gets the result.

    ``t`` must have the same shape on every rank. Identity at tp=1.
    """
    st = _state()
    if st.size == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(st.size)]
    if st.group is None:
        dist.all_gather(parts, t)
    else:
        st.group.allgather([parts], [t]).wait()
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_gather(t: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every rank's ``t`` along ``dim`` on rank ``dst`` only.

    Returns the concatenation on ``dst`` and ``None`` on every other rank. At tp=1 returns ``t``.
    ``dst`` is a rank within the tensor-parallel group.
    """
    st = _state()
    if st.size == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(st.size)] if st.rank == dst else None
    if st.group is None:
        dist.gather(t, parts, dst=dst)
    else:
        opts = dist.GatherOptions()
        opts.rootRank = dst
        st.group.gather([parts] if parts is not None else [], [t], opts).wait()
    return torch.cat(parts, dim=dim) if parts is not None else None


def destroy_model_parallel() -> None:
    """vLLM's cleanup call (``del llm; destroy_model_parallel(); gc.collect()``, in scripts that build
    several engines). Here an engine's worker processes, process group and KV cache are freed by
    ``LLM.shutdown()`` (or when the ``LLM`` is collected); this only resets this process's
    tensor-parallel state to rank 0 of 1, as :func:`set_tp` left it before any engine."""
    global _GLOBAL
    _GLOBAL = TPState(0, 1, None)


destroy_distributed_environment = destroy_model_parallel  # vLLM's second cleanup call: the same here


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's one-call cleanup between engines in a script: :func:`destroy_model_parallel`, a
    garbage collection (an ``LLM`` deleted in the script is freed with its KV cache), and on CUDA
    the allocator's cached blocks handed back. ``shutdown_ray``: vLLM's; there is no Ray here."""
    import gc

    destroy_model_parallel()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
