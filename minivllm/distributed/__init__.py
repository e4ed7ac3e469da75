"""Tensor parallelism: per-process rank state and collectives (no-ops on one rank), the
rank-0 runner (``tp_runner``), the worker loop (``worker``) and process launch (``launch``)."""
from minivllm.distributed.parallel_state import (
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    set_tp,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
    tp_scope,
)

__all__ = [
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "set_tp",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tp_scope",
]
