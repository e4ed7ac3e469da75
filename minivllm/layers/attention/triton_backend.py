"""The ``triton`` attention backend: our own kernels (see ``triton_kernels.py``).

Each layer: store the new tokens' K/V through ``slot_mapping``, then the paged decode
kernel when every sequence has one query token, else the paged prefill kernel (which
also serves the one-token rows of a mixed prefill+decode step).

The forward reads only device tensors (no per-step Python planning), so it can be
captured in a CUDA graph for decode.
"""
from __future__ import annotations

import torch

from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with our Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    #: forward depends only on device tensors of fixed shape: safe to capture in a CUDA graph
    supports_cuda_graphs = True

    def __init__(self) -> None:
        # Imported here so that importing the package never imports triton.
        from minivllm.layers.attention import triton_kernels

        self._kernels = triton_kernels

    def decode_context_buckets(self, num_seqs: int, max_seqlen_k: int, k_cache: torch.Tensor) -> list[int]:
        """Context bounds to capture one decode CUDA graph each for (see
        ``triton_kernels.decode_context_buckets``); ``k_cache [blocks, block_size, Hk, D]``."""
        kern = self._kernels
        return kern.decode_context_buckets(kern._sm_count(k_cache.device), num_seqs, int(k_cache.shape[2]),
                                           int(k_cache.shape[3]), max_seqlen_k)

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
        """See ``AttentionBackend.forward``: ``q [T, H, D]``, ``k/v [T, Hk, D]`` -> ``[T, H, D]``."""
        kern = self._kernels
        kern.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return kern.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                max_seqlen_k=meta.max_seqlen_k,
            )
        out = None
        if sum(meta.q_lens_cpu) != q.shape[0]:
            # trailing padding tokens belong to no sequence: give them zeros, not garbage
            out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return kern.paged_prefill_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
            meta.block_tables, meta.max_seqlen_q, scale, out=out,
            tile_map=self._tile_map(meta, q, k_cache),
        )

    def _tile_map(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """The prefill work list, built once per step from the host query lengths (every
        layer has the same head shapes) and kept in ``meta.extras``."""
        kern = self._kernels
        tokens = kern.prefill_tiling(q.shape[1], k_cache.shape[2], q.shape[2], q.dtype)[3]
        key = f"triton_prefill_tiles_{tokens}"
        if key not in meta.extras:
            meta.extras[key] = kern.prefill_tile_map(meta.q_lens_cpu, tokens, q.device)
        return meta.extras[key]
