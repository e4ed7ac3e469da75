"""Linear layers that shard their weights across tensor-parallel ranks.

Weights follow ``torch.nn.functional.linear``: ``weight`` is ``[out_features, in_features]``
and ``y = x @ weight.T + bias``. Every parameter carries

* ``param.weight_loader(param, loaded_weight, shard_id=None)``: takes the FULL checkpoint
  tensor (as stored by Hugging Face, unsharded) and copies this rank's slice into ``param``,
  converting to ``param``'s dtype and device;
* ``param.full_shape``: the shape of the full tensor that loader expects with
  ``shard_id=None`` (used to draw random weights that are identical for every tp size).

On the CPU the loaded weight is packed (``minivllm.layers.prepack``: panels for our GEMM in
float32, else oneDNN): ``weight`` then holds the packed tensor, ``state_dict()`` still returns it dense, and every layer computes
through :func:`minivllm.layers.prepack.linear`.

With ``quantization="int8"`` every layer's weight is replaced after loading by its int8 form
(``self.int8``, see :mod:`minivllm.quantization`; the float ``weight`` becomes ``None``) and
the forward multiplies through ``self.int8.matmul``; a reload turns it back into a float layer.

Layouts (Megatron-LM, Shoeybi et al. 2019):

* :class:`ColumnParallelLinear` splits ``out_features``: rank r owns output rows
  ``[r * out/tp, (r + 1) * out/tp)``; its output stays sharded (no communication).
* :class:`RowParallelLinear` splits ``in_features`` and all-reduces the partial sums.
* :class:`MergedColumnParallelLinear` and :class:`QKVParallelLinear` pack several column
  layers (gate+up, q+k+v) into one matmul; each rank stores its slice of every part,
  one after the other, so the local output splits into the local parts.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from minivllm.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from minivllm.layers.prepack import PackedWeightMixin, dense, is_packed, linear
from minivllm.quantization.layer import Int8LinearMixin


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, expected: Sequence[int], name: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}"
        )


class LinearBase(Int8LinearMixin, PackedWeightMixin, nn.Module):
    """Common parts: parameter allocation and the loader hook.

    Args:
        input_size: local ``in_features`` (already divided by tp where sharded).
        output_size: local ``out_features``.
        bias: whether the layer has a bias.
        full_in / full_out: the unsharded sizes as stored in a checkpoint.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, full_in: int, full_out: int,
                 bias_full_out: int | None = None):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self._load
        self.weight.full_shape = (full_out, full_in)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self._load
            self.bias.full_shape = (bias_full_out if bias_full_out is not None else full_out,)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def _load(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """The ``weight_loader`` attached to the parameters: a packed weight goes back to dense
        before it is written (``param`` may be the packed one, replaced since), and a packed
        source tensor is read dense."""
        if param is self.weight and is_packed(param):
            self.unpack_weights()
            param = self.weight
        self.weight_loader(param, dense(loaded_weight), shard_id)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class ReplicatedLinear(LinearBase):
    """A plain linear layer, identical on every rank. ``x [..., in] -> [..., out]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, input_size, output_size)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        _check_shape(param, loaded_weight, param.shape, type(self).__name__)
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.matmul(x, self.bias)
        return linear(x, self.matmul_weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks. ``x [..., in] -> [..., out / tp]`` (this rank's part).

    Raises:
        ValueError: ``output_size`` not divisible by the tp size.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_size()
        super().__init__(input_size, _divide(output_size, tp, "output_size"), bias, input_size, output_size)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        full = (self.output_size * self.tp_size,) + tuple(param.shape[1:])
        _check_shape(param, loaded_weight, full, type(self).__name__)
        n = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.matmul(x, self.bias)
        return linear(x, self.matmul_weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with the same input packed into one matmul.

    Used for Qwen3's MLP ``gate_proj`` and ``up_proj`` (``output_sizes=[I, I]``). On each
    rank the output is ``[..., sum(output_sizes) / tp]``: this rank's slice of part 0,
    then this rank's slice of part 1, ...

    ``weight_loader(param, w, shard_id)``: ``shard_id`` is the part index (``w`` is that
    part's full tensor), or ``None`` when ``w`` is the full packed tensor (all parts
    concatenated along dim 0, e.g. a checkpoint already saved with packed names).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False):
        tp = get_tp_size()
        self.output_sizes = list(output_sizes)
        for i, size in enumerate(self.output_sizes):
            _divide(size, tp, f"output_sizes[{i}]")
        super().__init__(input_size, sum(self.output_sizes), bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:
            full = (sum(self.output_sizes),) + tuple(param.shape[1:])
            _check_shape(param, loaded_weight, full, type(self).__name__)
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be a part index in [0, {len(self.output_sizes)}), got {shard_id!r}")
        full_size = self.output_sizes[shard_id]
        _check_shape(param, loaded_weight, (full_size,) + tuple(param.shape[1:]),
                     f"{type(self).__name__} part {shard_id}")
        local = full_size // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, local).copy_(loaded_weight.narrow(0, self.tp_rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """The packed q, k, v projection with grouped-query attention, heads split across ranks.

    Full (checkpoint) shapes: q ``[num_heads * head_dim, hidden]``, k and v
    ``[num_kv_heads * head_dim, hidden]``. Each rank owns ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` kv heads; its output is
    ``[..., (num_heads + 2 * num_kv_heads) / tp * head_dim]`` laid out as q | k | v.

    ``weight_loader(param, w, shard_id)`` with ``shard_id`` in ``{"q", "k", "v"}``, or
    ``None`` for the full packed tensor (q, k, v concatenated along dim 0).

    Raises:
        ValueError: ``num_heads`` or ``num_kv_heads`` not divisible by the tp size (kv-head
            replication for tp > num_kv_heads is not implemented).
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        full_out = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, full_out, bias)

    def _full_sizes(self) -> list[int]:
        return [self.q_size * self.tp_size, self.kv_size * self.tp_size, self.kv_size * self.tp_size]

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:
            full = (sum(self._full_sizes()),) + tuple(param.shape[1:])
            _check_shape(param, loaded_weight, full, type(self).__name__)
            for sid, part in zip("qkv", loaded_weight.split(self._full_sizes(), dim=0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        local, offset = {
            "q": (self.q_size, 0),
            "k": (self.kv_size, self.q_size),
            "v": (self.kv_size, self.q_size + self.kv_size),
        }[shard_id]
        _check_shape(param, loaded_weight, (local * self.tp_size,) + tuple(param.shape[1:]),
                     f"{type(self).__name__} {shard_id}")
        param.data.narrow(0, offset, local).copy_(loaded_weight.narrow(0, self.tp_rank * local, local))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products summed with an all-reduce.

    ``x [..., in / tp]`` (this rank's slice, e.g. the output of a column-parallel layer)
    ``-> [..., out]`` (full, identical on every rank). The bias is replicated and added
    once, after the reduction.

    Raises:
        ValueError: ``input_size`` not divisible by the tp size.
    """

    #: each rank holds part of every row: int8 scales are taken over the whole row (all ranks)
    input_is_sharded = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_size()
        super().__init__(_divide(input_size, tp, "input_size"), output_size, bias, input_size, output_size)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if param.dim() == 1:  # bias: replicated
            _check_shape(param, loaded_weight, param.shape, f"{type(self).__name__} bias")
            param.data.copy_(loaded_weight)
            return
        n = param.shape[1]
        _check_shape(param, loaded_weight, (param.shape[0], n * self.tp_size), type(self).__name__)
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.int8.matmul(x) if self.int8 is not None else linear(x, self.matmul_weight)
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
