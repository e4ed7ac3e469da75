"""Our own Triton kernels for paged attention: KV store, paged decode, paged prefill.

Layouts (see ``backend.py``): new tokens ``q [T, H, D]``, ``k/v [T, Hk, D]``; per-layer
caches ``[num_blocks, block_size, Hk, D]``; ``block_tables [S, max_blocks]`` int32 padded
with -1. Sequence ``i`` owns query rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1`` at
absolute positions ``context_lens[i] - q_len_i .. context_lens[i] - 1`` and attends
causally to its ``context_lens[i]`` cached keys.

Both attention kernels use the online softmax of FlashAttention (Dao et al., 2022,
"FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", Alg. 1):
keep a running row max ``m``, a running denominator ``l`` and an unnormalised accumulator,
rescale them by ``exp(m_old - m_new)`` whenever the max grows, divide once at the end.
Exponentials use ``exp2`` with the scale pre-multiplied by ``log2(e)``.

Keys are gathered token by token through the block table (``block = table[t // block_size]``,
``slot = block * block_size + t % block_size``), so a KV tile never has to align with a
cache block and any block size works (16 for the widgets, 256 for flash-attn layouts).

``tl.dot`` always accumulates in fp32. On a GPU its operands stay in the model's dtype:
bf16/fp16 tiles go to the tensor cores at their full rate (twice the TF32 rate on H100/
H200), with the softmax weights ``p`` rounded to that dtype for the second product as in
FlashAttention; fp32 models use IEEE fp32 so they match the torch reference closely. Under
the Triton interpreter every operand is cast to fp32 first (``DOT_F32``): the interpreter
computes low-precision ``tl.dot`` wrongly.

On a machine without a GPU the kernels run under the Triton interpreter, which must be
enabled (``TRITON_INTERPRET=1``) *before* this module is imported.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from minivllm.utils import cdiv

LOG2E = 1.4426950408889634


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def kernels_interpreted() -> bool:
    """True when this module's kernels were decorated in interpreter mode (CPU tensors OK)."""
    return type(_store_kv_kernel).__name__ == "InterpretedFunction"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"Triton kernels got a tensor on {t.device}; on a machine without a GPU set "
            "TRITON_INTERPRET=1 before minivllm.layers.attention.triton_kernels is imported"
        )


def _dot_precision(dtype: torch.dtype) -> str:
    # Only fp32 operands read this (bf16/fp16 dots ignore it): IEEE keeps fp32 models close
    # to the torch reference; the interpreter computes in numpy fp32 whatever we ask.
    if dtype == torch.float32 or kernels_interpreted():
        return "ieee"
    return "tf32"


def _dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether the kernels cast ``tl.dot`` operands to fp32: under the interpreter only
    (a no-op for fp32 inputs)."""
    return kernels_interpreted() or dtype == torch.float32


# --------------------------------------------------------------------------------------
# (1) KV store
# --------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: writes nothing
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    tok64 = tok.to(tl.int64)
    kv = tl.load(k_ptr + tok64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    vv = tl.load(v_ptr + tok64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = blk * stride_cb + off * stride_co + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, kv, mask=mask)
    tl.store(v_cache_ptr + dst, vv, mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K and V to its cache slot (in place).

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype, last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same strides.
        slot_mapping: int ``[num_tokens]``, ``block_id * block_size + offset``; ``-1`` skips.

    Raises:
        RuntimeError: a tensor off the GPU without ``TRITON_INTERPRET=1`` (set before this module is imported).
        ValueError: caches whose strides differ or whose last dim is not contiguous, or K/V
            whose dtype is not the cache's.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_device(k)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype} does not match the cache dtype {k_cache.dtype}")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------------------
# (2) paged decode attention: one query token per sequence, optionally split over the KV
# --------------------------------------------------------------------------------------
# With few sequences the grid (sequences x kv heads) leaves most SMs idle while each
# program walks a long context alone. The kernel can then split each sequence's keys
# into ``num_splits`` equal parts handled by separate programs, each writing an unnormalised
# partial result with its running max and denominator; a second kernel merges them
# (the "Flash-Decoding" scheme, Dao et al., 2023, "Flash-Decoding for long-context
# inference"). The split count depends only on the batch size and the longest possible
# context, never on this step's lengths, so the launch is the same on every CUDA-graph
# replay.
# num_splits is a runtime argument (not specialised), so every split count shares one
# compiled kernel: no JIT compile in the middle of serving when the batch size changes.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr,
    part_acc_ptr, part_ml_ptr,  # [S, H, num_splits, D] fp32 and [S, H, num_splits, 2] fp32
    num_splits,
    qk_scale,  # softmax scale * log2(e)
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_co, stride_ch,
    stride_bt,
    block_size,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    # One program per (sequence, kv head, split): all GROUP query heads that share this
    # kv head are handled together, so each K/V tile is read from memory once (GQA).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(ctx_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(num_tiles, tile_lo + tiles_per_split)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    seq64 = seq.to(tl.int64)
    q = tl.load(
        q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq64 * stride_bt
    for tile in range(tile_lo, tile_hi):
        t = tile * BLOCK_N + n
        t_mask = t < ctx_len
        blk = tl.load(bt_row + t // block_size, mask=t_mask, other=0).to(tl.int64)
        base = blk * stride_cb + (t % block_size) * stride_co + kvh * stride_ch
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        # each tile has at least one valid key, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    gd_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        # A sequence with no keys (context_len 0) yields zeros instead of 0/0.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=gd_mask,
        )
    else:
        # Partial result of this split; an empty split leaves m = -inf, l = 0, acc = 0.
        row = (seq64 * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_os, stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j, M = max_j m_j (log2 domain)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    d_mask = d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_splits + sp
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no keys at all: weights 0
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


#: most KV splits per sequence (the merge kernel reduces over this many lanes)
MAX_SPLITS = 16
_SM_COUNT: dict[int, int] = {}


#: fewest KV tiles a split handles (fewer would cost more in the merge than it saves)
MIN_TILES_PER_SPLIT = 4


def _sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of ``device``; None off CUDA or under the interpreter."""
    if kernels_interpreted() or device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def num_decode_splits(sm_count: int | None, num_seqs: int, num_kv_heads: int, max_seqlen_k: int | None,
                      block_n: int) -> int:
    """KV splits per sequence for the decode kernel: enough programs for about two per SM,
    at most ``MAX_SPLITS``, and at least ``MIN_TILES_PER_SPLIT`` tiles of ``block_n`` keys
    of the longest possible context (``max_seqlen_k``; None: no bound) per split.
    1 when ``sm_count`` is None (CPU, interpreter)."""
    if sm_count is None:
        return 1
    want = cdiv(2 * sm_count, max(1, num_seqs * num_kv_heads))
    if max_seqlen_k is not None:
        want = min(want, max(1, cdiv(int(max_seqlen_k), MIN_TILES_PER_SPLIT * block_n)))
    return int(max(1, min(MAX_SPLITS, want)))


def _num_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_seqlen_k: int | None,
                block_n: int) -> int:
    return num_decode_splits(_sm_count(q.device), num_seqs, num_kv_heads, max_seqlen_k, block_n)


def decode_context_buckets(sm_count: int | None, num_seqs: int, num_kv_heads: int, head_dim: int,
                           max_seqlen_k: int) -> list[int]:
    """Context-length bounds at which the decode kernel's split count changes, for CUDA-graph
    capture: a graph captured for bound ``L`` launches ``num_decode_splits(.., L, ..)`` splits,
    so a step whose longest context is 129 tokens replays a graph with few splits instead of
    the ``max_model_len`` one (up to ``MAX_SPLITS`` splits and a merge kernel per layer).

    Bounds are ``MIN_TILES_PER_SPLIT * block_n * 2**i`` below ``max_seqlen_k``, keeping the
    largest bound of each split count, then ``max_seqlen_k``; ``[max_seqlen_k]`` when
    ``sm_count`` is None. Any bound is correct for any context (splits only partition the
    keys); the bound only sets the launch shape.
    """
    if max_seqlen_k < 1:
        raise ValueError(f"max_seqlen_k must be >= 1, got {max_seqlen_k}")
    block_n = decode_block_n(max(16, triton.next_power_of_2(head_dim)))
    top = num_decode_splits(sm_count, num_seqs, num_kv_heads, max_seqlen_k, block_n)
    by_splits: dict[int, int] = {}
    bound = MIN_TILES_PER_SPLIT * block_n
    while bound < max_seqlen_k:
        splits = num_decode_splits(sm_count, num_seqs, num_kv_heads, bound, block_n)
        if splits < top:
            by_splits[splits] = bound
        bound *= 2
    return sorted(by_splits.values()) + [int(max_seqlen_k)]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` (fp32/fp16/bf16), last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the query's
            own K/V must already be stored.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]`` (padded with -1; only the
            first ``ceil(context_len / block_size)`` entries of a row are read).
        context_lens: int32 ``[num_seqs]``: keys per sequence, including the new token.
            A row with 0 keys gets an all-zero output.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        out: optional ``[num_seqs, num_heads, head_dim]`` output buffer.
        max_seqlen_k: upper bound on ``context_lens`` (for CUDA graphs: ``max_model_len``),
            used only to choose the number of KV splits; ``None``: no bound.
        num_splits: force the number of KV splits per sequence (default: chosen from the
            batch size and the GPU's SM count; always 1 under the interpreter).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.

    Raises:
        RuntimeError: a tensor off the GPU without ``TRITON_INTERPRET=1`` (set before this module is imported).
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, or ``num_splits`` outside
            ``1..MAX_SPLITS``.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    _check_device(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16
    # tl.dot needs every dimension >= 16; the spare query-head rows are masked out.
    block_g = max(16, triton.next_power_of_2(group))
    block_n = decode_block_n(block_d)
    splits = num_splits or _num_splits(q, num_seqs, num_kv_heads, max_seqlen_k, block_n)
    if splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, context_lens, part_acc, part_ml, splits,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        k_cache.shape[1],
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=splits > 1, PRECISION=_dot_precision(q.dtype), DOT_F32=_dot_in_f32(q.dtype),
    )
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_S=MAX_SPLITS, BLOCK_D=block_d,
        )
    return out


# --------------------------------------------------------------------------------------
# (3) prefill attention over paged KV: causal, variable-length, prefix + new chunk
# --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    tile_map_ptr,  # int32 [num_tiles, 2]: (sequence, tile index within its query rows)
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch,
    stride_bt,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    # One program per (real query tile, kv head). A tile is BLOCK_M // BLOCK_G query tokens
    # of one sequence times the BLOCK_G query heads sharing this kv head, flattened into
    # BLOCK_M rows (row r: token r // BLOCK_G, head r % BLOCK_G), so each K/V tile is read
    # once for the whole query group (GQA), and no program is launched for tiles past a
    # sequence's query length.
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_map_ptr + 2 * tile)
    m_blk = tl.load(tile_map_ptr + 2 * tile + 1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + seq)
    first_pos = ctx_len - q_len  # absolute position of this sequence's first new token

    r = tl.arange(0, BLOCK_M)
    m = m_blk * (BLOCK_M // BLOCK_G) + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    row_mask = (m < q_len) & (g < GROUP)
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q_pos = first_pos + m
    rows = (q_start + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Causality: the tile's last token sees keys up to its own position, no further.
    kv_end = tl.minimum(ctx_len, first_pos + (m_blk + 1) * (BLOCK_M // BLOCK_G))
    for start in range(0, kv_end, BLOCK_N):
        t = start + n
        t_mask = t < ctx_len
        blk = tl.load(bt_row + t // block_size, mask=t_mask, other=0).to(tl.int64)
        base = blk * stride_cb + (t % block_size) * stride_co + kvh * stride_ch
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        keep = t_mask[None, :] & (t[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        # Every valid row sees key 0 in the first tile, so m_new is finite from then on;
        # padding rows (token past q_len) have q_pos >= ctx_len and see every key: no NaN either.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def prefill_launch_config(block_d: int, precision: str) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the prefill kernel on a GPU.

    The accumulator is fp32 (the q tile too for fp32 models); with 128-wide heads, or
    with IEEE fp32 dots (done with FMAs, not tensor cores), 64x64 tiles on 4 warps spill
    registers on sm_90, so those use 32-key tiles on 8 warps (checked by
    ``tests/test_triton_aot_compile.py``, which compiles these configurations for sm_90).
    """
    if block_d >= 128 or precision == "ieee":
        return 64, 32, 8
    return 64, 64, 4


def decode_block_n(block_d: int) -> int:
    """Keys per tile of the decode kernel (64 for heads up to 64 wide, else 32)."""
    return 64 if block_d <= 64 else 32


def prefill_tile_map(q_lens: list[int], tokens_per_tile: int, device: torch.device | str) -> torch.Tensor:
    """The prefill kernel's work list: one ``(sequence, tile)`` int32 row per tile of
    ``tokens_per_tile`` query tokens that holds at least one token, sequence by sequence.

    Args:
        q_lens: query tokens per sequence (host ints, >= 0).
        tokens_per_tile: query tokens per program (>= 1).

    Returns:
        int32 ``[num_tiles, 2]`` on ``device``.
    """
    if tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile must be >= 1, got {tokens_per_tile}")
    tiles = -(-np.asarray(q_lens, dtype=np.int64) // tokens_per_tile)
    starts = np.cumsum(tiles) - tiles
    seq = np.repeat(np.arange(len(tiles), dtype=np.int32), tiles)
    idx = np.arange(int(tiles.sum())) - np.repeat(starts, tiles)
    out = torch.from_numpy(np.stack([seq, idx.astype(np.int32)], axis=1).reshape(-1, 2))
    return out.to(device) if torch.device(device).type == "cuda" else out


def prefill_tiling(num_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M rows, BLOCK_N keys, BLOCK_G heads, tokens per tile, num_warps)`` of the prefill
    kernel for these shapes (interpreter: 16-row, 16-key tiles)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = prefill_launch_config(block_d, _dot_precision(dtype))
    if kernels_interpreted():
        block_m, block_n = 16, 16  # the interpreter's cost grows with tile size
    block_g = triton.next_power_of_2(num_heads // num_kv_heads)
    block_m = max(block_m, block_g)
    return block_m, block_n, block_g, block_m // block_g, num_warps


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    tile_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal variable-length attention of new query tokens over paged KV.

    Covers whole prompts, prompts with a prefix-cache hit, later chunks of a chunked
    prefill and decode rows (``q_len == 1``) mixed in the same call.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` (fp32/fp16/bf16), last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the new
            tokens' K/V must already be stored.
        cu_seqlens_q: int32 ``[num_seqs + 1]``: prefix sums of query lengths.
        context_lens: int32 ``[num_seqs]``: keys per sequence (cached + new); sequence
            ``i``'s queries sit at positions ``context_lens[i] - q_len_i .. context_lens[i]-1``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]`` padded with -1.
        max_seqlen_q: longest query length (unused since the grid follows ``tile_map``;
            kept for callers).
        scale: softmax scale.
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer.
        tile_map: ``prefill_tile_map(q_lens, prefill_tiling(...)[3], device)``; built here
            from ``cu_seqlens_q`` (a device read-back) when None. The backend builds it once
            per step.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

    Raises:
        RuntimeError: a tensor off the GPU without ``TRITON_INTERPRET=1`` (set before this module is imported).
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    _check_device(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16
    precision = _dot_precision(q.dtype)
    block_m, block_n, block_g, tokens_per_tile, num_warps = prefill_tiling(num_heads, num_kv_heads, head_dim,
                                                                           q.dtype)
    if tile_map is None:
        q_lens = torch.diff(cu_seqlens_q.to("cpu", torch.int64)).tolist()
        tile_map = prefill_tile_map(q_lens, tokens_per_tile, q.device)
    if tile_map.shape[0] == 0:
        return out
    grid = (int(tile_map.shape[0]), num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, tile_map,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        k_cache.shape[1],
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_G=block_g,
        PRECISION=precision, DOT_F32=_dot_in_f32(q.dtype),
        num_warps=num_warps,
    )
    return out
