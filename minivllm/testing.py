"""Random paged-attention cases and a naive reference: public, for tests, ``scripts/gpu_check.py``
and the course notebooks (``from minivllm.testing import make_case, naive_attention``).

``make_case`` lays out a step the way the model runner would: each sequence owns a
shuffled set of physical blocks, its cached prefix is already in the cache, and the new
tokens' K/V come as ``k``/``v`` with their ``slot_mapping`` (the backend stores them).
``naive_attention`` computes the expected output straight from the logical (unpaged)
K/V with an explicit causal mask, in fp32: nothing in it shares code with the backends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.utils import cdiv


@dataclass
class AttentionCase:
    """One step's inputs plus what the reference needs.

    Attributes:
        q: ``[T, H, D]`` new query tokens.
        k, v: ``[T, Hk, D]`` new tokens' keys/values (not yet in the cache).
        k_cache, v_cache: ``[num_blocks, block_size, Hk, D]`` holding every prefix token.
        meta: the step's metadata (slot_mapping has ``-1`` for padding tokens).
        full_k, full_v: per sequence ``[context_len, Hk, D]``: all keys/values in order.
        scale: softmax scale ``D ** -0.5``.
        q_lens, context_lens: per sequence, new tokens and tokens attended to (host ints).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]
    scale: float
    q_lens: list[int]
    context_lens: list[int]


def make_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 2,
    fill: float = float("nan"),
    pad_tokens: int = 0,
    table_width: int | None = None,
) -> AttentionCase:
    """Build a random paged-attention step.

    Args:
        seqs: ``(context_len, q_len)`` per sequence, ``1 <= q_len <= context_len``;
            ``context_len - q_len`` tokens are a cached prefix (prefix hit or earlier chunks).
        num_heads, num_kv_heads, head_dim: attention shape (GQA when they differ).
        block_size: tokens per KV block.
        dtype, device: of every float tensor.
        seed: RNG seed (CPU generator, so cases are identical on every device).
        spare_blocks: unused blocks added to the pool.
        fill: value of cache slots no sequence owns (NaN catches reads of unowned slots).
        pad_tokens: trailing padding tokens (slot -1, not part of any sequence).
        table_width: block-table columns (default: the widest sequence's block count).

    Returns:
        the ``AttentionCase``; its cache tensors hold the cached prefixes, not the new tokens.

    Raises:
        ValueError: a ``q_len`` outside ``1..context_len``, or ``table_width`` too narrow.
    """
    for i, (ctx, ql) in enumerate(seqs):
        if not 1 <= ql <= ctx:
            raise ValueError(f"seqs[{i}] = {(ctx, ql)}: need 1 <= q_len <= context_len")
    g = torch.Generator().manual_seed(seed)
    nblocks = [cdiv(ctx, block_size) for ctx, _ in seqs]
    total_blocks = sum(nblocks) + spare_blocks
    perm = torch.randperm(total_blocks, generator=g).tolist()
    width = table_width if table_width is not None else max(nblocks)
    if width < max(nblocks):
        raise ValueError(f"table_width={table_width} is narrower than {max(nblocks)} blocks")

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_cache = torch.full((total_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    block_tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    q_parts, k_parts, v_parts, slots, full_k, full_v = [], [], [], [], [], []
    used = 0
    for i, (ctx, ql) in enumerate(seqs):
        blocks = perm[used:used + nblocks[i]]
        used += nblocks[i]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        fk, fv = rnd(ctx, num_kv_heads, head_dim), rnd(ctx, num_kv_heads, head_dim)
        full_k.append(fk)
        full_v.append(fv)
        tok_slots = [blocks[t // block_size] * block_size + t % block_size for t in range(ctx)]
        prefix = ctx - ql
        for t in range(prefix):  # the cached prefix is already in the cache
            b, o = divmod(tok_slots[t], block_size)
            k_cache[b, o] = fk[t]
            v_cache[b, o] = fv[t]
        slots += tok_slots[prefix:]
        q_parts.append(rnd(ql, num_heads, head_dim))
        k_parts.append(fk[prefix:])
        v_parts.append(fv[prefix:])
    if pad_tokens:
        q_parts.append(rnd(pad_tokens, num_heads, head_dim))
        k_parts.append(rnd(pad_tokens, num_kv_heads, head_dim))
        v_parts.append(rnd(pad_tokens, num_kv_heads, head_dim))
        slots += [-1] * pad_tokens

    q_lens = [ql for _, ql in seqs]
    ctx_lens = [ctx for ctx, _ in seqs]
    cu_q = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(_cumsum(ctx_lens)), dtype=torch.int32)
    dev = torch.device(device)
    meta = AttentionMetadata(
        cu_seqlens_q=cu_q.to(dev),
        cu_seqlens_k=cu_k.to(dev),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=block_tables.to(dev),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(ctx_lens),
        block_size=block_size,
        is_decode_only=all(ql == 1 for ql in q_lens) and pad_tokens == 0,
        q_lens_cpu=q_lens,
        context_lens_cpu=ctx_lens,
    )
    return AttentionCase(
        q=torch.cat(q_parts).to(dev),
        k=torch.cat(k_parts).to(dev),
        v=torch.cat(v_parts).to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        meta=meta,
        full_k=[t.to(dev) for t in full_k],
        full_v=[t.to(dev) for t in full_v],
        scale=head_dim ** -0.5,
        q_lens=q_lens,
        context_lens=ctx_lens,
    )


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def naive_attention(case: AttentionCase) -> torch.Tensor:
    """Expected output ``[T, H, D]`` (fp32) for ``case``; padding rows are zero.

    Row ``j`` of sequence ``i`` sits at position ``p = context_len - q_len + j`` and
    attends to keys ``0..p`` (softmax(q k^T * scale) v, computed per sequence in fp32).
    """
    num_heads = case.q.shape[1]
    out = torch.zeros(case.q.shape, dtype=torch.float32, device=case.q.device)
    row = 0
    for ql, ctx, fk, fv in zip(case.q_lens, case.context_lens, case.full_k, case.full_v):
        group = num_heads // fk.shape[1]
        q = case.q[row: row + ql].float().transpose(0, 1)  # [H, ql, D]
        k = fk.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = fv.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * case.scale  # [H, ql, ctx]
        q_pos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[row: row + ql] = (scores.softmax(-1) @ v).transpose(0, 1)
        row += ql
    return out
