"""The reference attention backend: paged KV gathered through the block table, then SDPA.

Plain PyTorch, any device and dtype. Every other backend is tested against this one.

Per step (:meth:`TorchAttentionBackend.prepare`, once, shared by all layers) the batch is
split into two groups, decodes (one query token) and prefills (several query tokens:
whole prompts, chunks, prompts after a prefix-cache hit), so one long prefill does not pad
hundreds of decodes to its length. For each group of ``G`` sequences it builds

* ``block_ids [G * nb]``: the physical blocks of each sequence's block table (``nb`` =
  blocks of the longest context; padding entries read block 0), so key ``j`` of sequence
  ``b`` is row ``j`` of its gathered ``[nb * block_size]`` keys;
* ``q_src [n]`` / ``q_dst [n]``: where the group's ``n`` query tokens are in the step's
  token dimension and where they go in the padded ``[G * max_q]`` layout;
* ``mask [G, 1, max_q, max_k]`` (bool, True = attend; ``max_k = nb * block_size``): query ``i`` of sequence ``b`` sits
  at absolute position ``context_lens[b] - q_lens[b] + i`` and sees keys ``j <= `` that
  position (causal over the cached prefix plus the new tokens). Padded query rows are
  allowed key 0 only, so no row is ever fully masked (a fully masked row gives NaN).

Each layer then: writes the new K/V at ``slot_mapping`` (slot -1 writes nothing), gathers
``K, V [G, kv_heads, max_k, d]`` and pads ``Q [G, heads, max_q, d]``, calls
``torch.nn.functional.scaled_dot_product_attention`` (grouped-query heads through
``enable_gqa``), and scatters the real rows back. Low-precision inputs are upcast so the
softmax runs in fp32; the output is cast back to ``q.dtype``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.utils import cdiv

_EXTRAS_KEY = "torch_backend_plan"


@dataclass
class _GroupPlan:
    """Gather/scatter indices for one group of sequences (see module docstring)."""

    num_seqs: int
    max_q: int
    max_k: int
    q_src: torch.Tensor  # int64 [n]: token index in the step
    q_dst: torch.Tensor  # int64 [n]: row in the padded [G * max_q] layout
    block_ids: torch.Tensor  # int64 [G * nb]: physical blocks to gather, row-major (padding: block 0)
    mask: torch.Tensor  # bool [G, 1, max_q, max_k] with max_k = nb * block_size


@dataclass
class _StepPlan:
    write_tokens: torch.Tensor  # int64 [m]: tokens whose slot is not -1
    write_slots: torch.Tensor  # int64 [m]: their cache slots
    groups: list[_GroupPlan]
    # Fast paths (same results, less copying), decided once per step:
    # every token is a decode of its own sequence, in order: no query scatter/gather
    all_decode: bool = False
    # a single sequence whose whole context is this step's tokens (a fresh prompt):
    # attend over the new K/V directly with a causal mask, no cache gather
    single_fresh_prefill: bool = False


def _plan_group(meta: AttentionMetadata, seq_ids: list[int], device: torch.device) -> _GroupPlan:
    q_lens_l = [meta.q_lens_cpu[i] for i in seq_ids]
    k_lens_l = [meta.context_lens_cpu[i] for i in seq_ids]
    g, max_q, max_k = len(seq_ids), max(q_lens_l), max(k_lens_l)
    seq_t = torch.tensor(seq_ids, dtype=torch.int64, device=device)
    q_lens = torch.tensor(q_lens_l, dtype=torch.int64, device=device)
    k_lens = torch.tensor(k_lens_l, dtype=torch.int64, device=device)
    q_starts = meta.cu_seqlens_q.to(device=device, dtype=torch.int64)[seq_t]  # [G]

    # Query scatter: row i of sequence b is token q_starts[b] + i, padded row b * max_q + i.
    i = torch.arange(max_q, device=device)
    q_valid = i[None, :] < q_lens[:, None]  # [G, max_q]
    q_src = (q_starts[:, None] + i[None, :])[q_valid]
    q_dst = (torch.arange(g, device=device)[:, None] * max_q + i[None, :])[q_valid]

    # Key gather through the block table, whole blocks at a time (contiguous copies are far
    # cheaper than a per-slot gather); keys past a sequence's length are masked out below.
    bs = meta.block_size
    n_blk_cols = cdiv(max_k, bs)
    max_k = n_blk_cols * bs
    j = torch.arange(max_k, device=device)
    k_valid = j[None, :] < k_lens[:, None]  # [G, max_k]
    tables = meta.block_tables.to(device=device, dtype=torch.int64)[seq_t][:, :n_blk_cols]  # [G, nb]
    block_ids = tables.clamp(min=0).flatten()

    # Causal mask over absolute positions.
    q_pos = (k_lens - q_lens)[:, None] + i[None, :]  # [G, max_q]
    mask = (j[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    pad_rows = ~q_valid
    mask[:, :, 0] |= pad_rows  # padded query rows see key 0: never a fully masked row
    return _GroupPlan(g, max_q, max_k, q_src, q_dst, block_ids, mask.unsqueeze(1))


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in plain PyTorch (see module docstring)."""

    name = "torch"
    # supports_cuda_graphs stays False: prepare() reads host-side lengths and syncs once per step

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build the step plan once and store it in ``meta.extras`` (called lazily by
        :meth:`forward` if the model runner did not call it)."""
        device = meta.slot_mapping.device
        slots = meta.slot_mapping.to(torch.int64)
        # One host sync per step (not per layer): which tokens write to the cache.
        write_tokens = torch.nonzero(slots >= 0).flatten()
        decode_ids = [s for s, n in enumerate(meta.q_lens_cpu) if n == 1]
        prefill_ids = [s for s, n in enumerate(meta.q_lens_cpu) if n > 1]
        groups = [_plan_group(meta, ids, device) for ids in (decode_ids, prefill_ids) if ids]
        num_tokens = meta.num_tokens
        all_decode = len(decode_ids) == meta.num_seqs == num_tokens
        single_fresh = (meta.num_seqs == 1 and meta.q_lens_cpu[0] == meta.context_lens_cpu[0] == num_tokens
                        and meta.q_lens_cpu[0] > 1)
        meta.extras[_EXTRAS_KEY] = _StepPlan(write_tokens, slots[write_tokens], groups, all_decode, single_fresh)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        plan: _StepPlan | None = meta.extras.get(_EXTRAS_KEY)
        if plan is None:
            self.prepare(meta)
            plan = meta.extras[_EXTRAS_KEY]
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        k_flat = k_cache.view(num_blocks * block_size, kv_heads, head_dim)
        v_flat = v_cache.view(num_blocks * block_size, kv_heads, head_dim)
        if plan.write_tokens.numel() == k.shape[0]:  # no padding tokens: every row is written
            k_new, v_new = k, v
        else:
            k_new, v_new = k[plan.write_tokens], v[plan.write_tokens]
        k_flat.index_copy_(0, plan.write_slots, k_new.to(k_cache.dtype))
        v_flat.index_copy_(0, plan.write_slots, v_new.to(v_cache.dtype))

        num_heads = q.shape[1]
        compute_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        gqa = num_heads != kv_heads
        if plan.single_fresh_prefill:
            o = F.scaled_dot_product_attention(
                q.to(compute_dtype).transpose(0, 1).unsqueeze(0), k.to(compute_dtype).transpose(0, 1).unsqueeze(0),
                v.to(compute_dtype).transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=gqa)
            return o[0].transpose(0, 1).to(q.dtype)
        def gather(cache: torch.Tensor, gp: _GroupPlan) -> torch.Tensor:  # -> [G, kvh, max_k, d]
            kv = cache.index_select(0, gp.block_ids).view(gp.num_seqs, gp.max_k, kv_heads, head_dim)
            return kv.to(compute_dtype).transpose(1, 2)

        if plan.all_decode:
            gp = plan.groups[0]
            kg, vg = gather(k_cache, gp), gather(v_cache, gp)
            o = F.scaled_dot_product_attention(q.to(compute_dtype).unsqueeze(2), kg, vg, attn_mask=gp.mask,
                                               scale=scale, enable_gqa=gqa)  # [G, h, 1, d]
            return o.squeeze(2).to(q.dtype)
        # Tokens not in any sequence (padding) get zeros.
        out = torch.zeros(q.shape[0], num_heads, head_dim, dtype=q.dtype, device=q.device)
        for gp in plan.groups:  # at most two: decodes, prefills
            qp = q.new_zeros(gp.num_seqs * gp.max_q, num_heads, head_dim, dtype=compute_dtype)
            qp[gp.q_dst] = q[gp.q_src].to(compute_dtype)
            qp = qp.view(gp.num_seqs, gp.max_q, num_heads, head_dim).transpose(1, 2)
            kg, vg = gather(k_cache, gp), gather(v_cache, gp)
            o = F.scaled_dot_product_attention(qp, kg, vg, attn_mask=gp.mask, scale=scale, enable_gqa=gqa)
            o = o.transpose(1, 2).reshape(gp.num_seqs * gp.max_q, num_heads, head_dim)
            out[gp.q_src] = o[gp.q_dst].to(q.dtype)
        return out
