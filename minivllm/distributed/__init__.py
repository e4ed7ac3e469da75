"""Tensor parallelism as the layers see it: this process's rank state and the collectives
(no-ops on one rank). Starting and driving the ranks is ``minivllm.executor``'s job; nothing
here imports the engine."""
from minivllm.distributed.parallel_state import (
    cleanup_dist_env_and_memory,
    destroy_distributed_environment,
    destroy_model_parallel,
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
    "cleanup_dist_env_and_memory",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "set_tp",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tp_scope",
]
