"""The per-step description of which KV each query token attends to.

Built once per engine step by the model runner, shared by every layer, read by
every attention backend. One layout covers prefill, chunked prefill, prefix-cache
hits and decode, mixed in one step: sequence ``i`` contributes ``q_lens[i]`` new
query tokens whose absolute positions are
``context_lens[i] - q_lens[i] .. context_lens[i] - 1``; they attend causally to
all ``context_lens[i]`` tokens of that sequence, whose K/V live in the paged cache
(the new tokens' K/V are written there first, through ``slot_mapping``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Tensors describing one step's batch (all on the model's device).

    Attributes:
        cu_seqlens_q: int32 ``[num_seqs + 1]``: prefix sums of query lengths.
        cu_seqlens_k: int32 ``[num_seqs + 1]``: prefix sums of ``context_lens``.
        context_lens: int32 ``[num_seqs]``: KV length of each sequence *after* this
            step's tokens are stored (cached prefix + earlier chunks + new tokens).
        slot_mapping: int64 ``[num_tokens]``: cache slot of each new token,
            ``block_id * block_size + offset``; ``-1`` marks padding (written nowhere).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``: physical block ids
            of each sequence, padded with ``-1`` past its last block.
        max_seqlen_q: longest query length in the step (tokens).
        max_seqlen_k: longest context length in the step (tokens).
        block_size: tokens per KV block.
        is_decode_only: every sequence has exactly one query token (CUDA-graph and
            decode-kernel path).
        q_lens_cpu / context_lens_cpu: the same lengths as Python lists, so
            backends can plan without a device->host sync.
        extras: backend-private per-step data computed once in
            ``AttentionBackend.prepare`` (e.g. gather indices), reused by all layers.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    is_decode_only: bool
    q_lens_cpu: list[int]
    context_lens_cpu: list[int]
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
