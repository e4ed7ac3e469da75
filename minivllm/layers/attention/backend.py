"""The interface every attention backend implements (torch, triton, flash_attn)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minivllm.layers.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Stores this step's K/V into the paged cache, then attends over it.

    KV cache layout (per layer, one tensor each for K and V), the layout
    flash-attn's paged API uses: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    #: name reported in the startup log and in every ``StepRecord``
    name: str = "abstract"
    #: True when a decode step's ``prepare`` + ``forward`` read only device tensors of fixed
    #: shape (no host-side planning, no sync), so the engine may capture it in a CUDA graph
    supports_cuda_graphs: bool = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step planning shared by all layers (fills ``meta.extras``). Optional."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention for one layer.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens; written
                to ``k_cache``/``v_cache`` at ``meta.slot_mapping`` before attending.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: the step's ``AttentionMetadata``.
            scale: softmax scale, usually ``head_dim ** -0.5``.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
        """
