"""What one forward pass needs besides token ids and positions, passed explicitly."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    """Handed by the model runner to ``model.forward`` and down to each attention layer.

    Attributes:
        meta: the step's ``AttentionMetadata``.
        backend: the attention backend in use.
        kv_caches: one ``(k_cache, v_cache)`` pair per decoder layer, each
            ``[num_blocks, block_size, num_kv_heads_per_rank, head_dim]``.
    """

    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
