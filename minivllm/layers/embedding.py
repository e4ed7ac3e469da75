"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

The vocabulary is padded up to a multiple of the tp size, ``V_pad = ceil(V / tp) * tp``,
and rank r owns rows ``[r * V_pad/tp, (r + 1) * V_pad/tp)`` of the ``[V, hidden]`` table.
Padding rows are zero and are never returned as logits.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.prepack import PackedWeightMixin, dense, is_packed, linear, linear_greedy
from minivllm.quantization.layer import Int8LinearMixin
from minivllm.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_gather, \
    tensor_model_parallel_all_reduce
from minivllm.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    """``input_ids int64 [T] -> [T, embedding_dim]`` (full embeddings on every rank).

    Each rank looks up the ids in its vocab range (others give zeros) and an all-reduce
    sums the parts.

    Args:
        num_embeddings: vocabulary size ``V`` (unpadded, as in the config).
        embedding_dim: hidden size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = cdiv(num_embeddings, self.tp_size) * self.tp_size
        self.shard_size = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = self.vocab_start + self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.full_shape = (num_embeddings, embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full ``[V, hidden]`` table; zero the padding rows."""
        loaded_weight = dense(loaded_weight)
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"{type(self).__name__}: checkpoint tensor has shape "
                             f"{tuple(loaded_weight.shape)}, expected {(self.num_embeddings, self.embedding_dim)}")
        n_real = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        param.data[n_real:].zero_()
        param.data[:n_real].copy_(loaded_weight[self.vocab_start:self.vocab_start + n_real])

    #: CpuFusedOps, set by ModelRunner.enable_cpu_fused_ops: the lookup as one C call on a CPU
    fused = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            if self.fused is not None:
                out = self.fused.embedding(input_ids, self.weight)
                if out is not None:
                    return out
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        y = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(y)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings} (padded {self.num_embeddings_padded}), "
                f"embedding_dim={self.embedding_dim}, tp_size={self.tp_size}")


class ParallelLMHead(Int8LinearMixin, PackedWeightMixin, VocabParallelEmbedding):
    """The output projection ``hidden -> logits``, vocab-sharded like the embedding.

    With tied embeddings the model points ``lm_head.weight`` at ``embed_tokens.weight``
    (same shard layout, so tying works at any tp size). On the CPU the head multiplies by a
    packed weight (panels or oneDNN, ``minivllm.layers.prepack``); when tied, that is a packed copy beside
    the embedding's plain table (the lookup needs the plain one), made after loading:
    reload through ``load_weights``/``init_random_weights`` (which repack), not by writing
    into ``embed_tokens.weight`` directly.

    With ``quantization="int8"`` and ``quantize_lm_head`` the head multiplies by int8 weights
    (``self.int8``, :mod:`minivllm.quantization`); when tied, those are the head's own copy and
    the embedding table stays in the model dtype.
    """

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """As the embedding's; a packed head weight goes back to dense before it is written."""
        if param is self.weight and (is_packed(param) or self.packed_copy is not None):
            self.unpack_weights()
            param = self.weight
        super().weight_loader(param, loaded_weight, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - guard
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits(hidden)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size] -> fp32 logits [N, vocab_size]``.

        Every rank returns the full logits (all-gather over the vocab shards, padding
        columns dropped), so the sampler may run on any rank with identical results.
        """
        if self.int8 is not None:
            logits = self.int8.matmul(hidden)  # [N, V_pad / tp]
        else:
            logits = linear(hidden, self.matmul_weight)  # [N, V_pad / tp]
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def compute_logits_and_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        """``(compute_logits(hidden), ids)``: with ``ids`` int64 numpy ``[N]``, each row's greedy token
        (the first maximum of its logits, -1 for a row holding a NaN or an infinity), found by the
        panel GEMM while it writes the logits (``prepack.linear_greedy``) where the head runs on it
        unsharded in float32, else ``None`` (the sampler then makes its own pass over the logits)."""
        weight = self.matmul_weight
        if getattr(self.compute_logits, "__func__", None) is not _STOCK_COMPUTE_LOGITS:
            return self.compute_logits(hidden), None  # replaced (a tracer): it sees every step
        if self.int8 is None and self.tp_size == 1 and hidden.dim() == 2:
            out = linear_greedy(hidden, weight, self.num_embeddings)
            if out is not None:
                return out[0][:, : self.num_embeddings], out[1]
        return self.compute_logits(hidden), None


_STOCK_COMPUTE_LOGITS = ParallelLMHead.compute_logits  # compute_logits_and_greedy defers to a replacement
