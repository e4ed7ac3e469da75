"""The ``flash_attn`` attention backend: flash-attn 2's varlen and paged-KV-cache kernels.

* Decode-only steps: ``flash_attn_with_kvcache(q [B, 1, H, D], k_cache, v_cache,
  cache_seqlens=context_lens, block_table=..., causal=True)``.
* Prefill / mixed steps: ``flash_attn_varlen_func``. When no sequence has cached tokens
  (every ``context_len == q_len``) the new K/V are passed directly; otherwise the query
  attends to the paged cache through ``block_table`` (prefix-cache hits, later chunks,
  decode rows of a mixed step). flash-attn aligns the causal mask to the bottom-right
  corner when ``seqlen_q < seqlen_k``, which is exactly "query ``i`` sits at position
  ``context_len - q_len + i``".

flash-attn's paged KV needs ``page_block_size % 256 == 0`` and fp16/bf16 tensors on CUDA
(flash-attn 2 README, "flash_attn_with_kvcache" / "block_table" docstrings). The package
is imported on first use, so minivllm imports and runs without it. New K/V are stored
with our Triton store kernel (CUDA-graph safe), or with plain indexing on CPU.

Verified on CPU by contract only (``tests/test_flash_attn_contract.py``: a stand-in
module checks the arguments and answers with a reference) until run on a GPU box
with flash-attn installed.
"""
from __future__ import annotations

import importlib

import torch

from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.metadata import AttentionMetadata

PAGE_MULTIPLE = 256
_EXTRAS_KEY = "flash_attn_plan"


class FlashAttnBackend(AttentionBackend):
    """Attention through flash-attn 2 (``pip install flash-attn``), CUDA only.

    Args:
        block_size: KV block size in tokens; must be a multiple of 256.
    """

    name = "flash_attn"
    #: decode-only forward reads only device tensors of fixed shape: CUDA-graph safe
    supports_cuda_graphs = True

    def __init__(self, block_size: int) -> None:
        if block_size <= 0 or block_size % PAGE_MULTIPLE != 0:
            raise ValueError(
                f"the flash_attn backend needs block_size to be a multiple of {PAGE_MULTIPLE} "
                f"(flash-attn's paged KV requirement), got block_size={block_size}; "
                "use attention_backend='triton' or 'torch' for small blocks"
            )
        self.block_size = block_size
        self._fa = None
        self._store = None

    # ------------------------------------------------------------------ helpers
    def _flash_attn(self):
        if self._fa is None:
            try:
                self._fa = importlib.import_module("flash_attn")
            except ImportError as e:
                raise ImportError(
                    "attention_backend='flash_attn' needs the flash-attn package "
                    "(pip install flash-attn --no-build-isolation; see environment.yml)"
                ) from e
        return self._fa

    def _store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if k.device.type == "cuda":
            if self._store is None:
                from minivllm.layers.attention.triton_kernels import store_kvcache

                self._store = store_kvcache
            self._store(k, v, k_cache, v_cache, slot_mapping)
            return
        # CPU (contract tests): boolean indexing syncs, which is fine off the GPU.
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]

    # ------------------------------------------------------------------ interface
    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step plan shared by all layers: the block table with ``-1`` padding clamped
        to 0 (flash-attn reads only the blocks a sequence's length needs, the clamp keeps
        any stray read in bounds) and whether any sequence attends to cached tokens."""
        if meta.block_size % PAGE_MULTIPLE != 0:
            raise ValueError(
                f"flash_attn backend got a step with block_size={meta.block_size}; "
                f"it needs a multiple of {PAGE_MULTIPLE}"
            )
        meta.extras[_EXTRAS_KEY] = {
            "block_table": meta.block_tables.clamp(min=0).to(torch.int32),
            "uses_cache": any(c != q for q, c in zip(meta.q_lens_cpu, meta.context_lens_cpu)),
            "num_real_tokens": sum(meta.q_lens_cpu),
        }

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
        """See ``AttentionBackend.forward``: ``q [T, H, D]``, ``k/v [T, Hk, D]`` -> ``[T, H, D]``.

        Tensors must be fp16 or bf16 (flash-attn's kernels support no other dtype).

        Raises:
            ValueError: tensors neither fp16 nor bf16, or a step whose block size is no multiple of 256.
            ImportError: the flash-attn package is not installed (at the first call).
        """
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flash_attn backend needs fp16 or bf16 tensors, got {q.dtype}")
        fa = self._flash_attn()
        plan = meta.extras.get(_EXTRAS_KEY)
        if plan is None:
            self.prepare(meta)
            plan = meta.extras[_EXTRAS_KEY]
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

        if meta.is_decode_only:
            out = fa.flash_attn_with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.context_lens,
                block_table=plan["block_table"],
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)

        n = plan["num_real_tokens"]
        q_real = q[:n]
        if plan["uses_cache"]:
            out = fa.flash_attn_varlen_func(
                q_real,
                k_cache,
                v_cache,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_k,
                max_seqlen_q=meta.max_seqlen_q,
                max_seqlen_k=meta.max_seqlen_k,
                softmax_scale=scale,
                causal=True,
                block_table=plan["block_table"],
            )
        else:
            # Whole prompts only: K/V of this step are all the keys there are.
            out = fa.flash_attn_varlen_func(
                q_real,
                k[:n],
                v[:n],
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_q,
                max_seqlen_q=meta.max_seqlen_q,
                max_seqlen_k=meta.max_seqlen_q,
                softmax_scale=scale,
                causal=True,
            )
        if n != q.shape[0]:  # trailing padding tokens: zeros
            out = torch.cat([out, out.new_zeros((q.shape[0] - n,) + tuple(out.shape[1:]))])
        return out
