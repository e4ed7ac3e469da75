"""Tensor-parallel state and collectives (no-ops when running on one rank)."""
from minivllm.distributed.parallel_state import (
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    set_tp,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)

__all__ = [
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "set_tp",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
]
