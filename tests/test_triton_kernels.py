"""Our Triton kernels vs a naive reference (and the torch backend), on CPU under the interpreter.

The cases are pairwise over {fp32, fp16, bf16} x {block 16, 256} x {whole prompt, prefix
hit, chunk, decode} x {GQA 4:2, 8:1} x {head_dim 64, 128}, not the full product: the
interpreter runs every program in Python, so shapes are tiny.
"""
from __future__ import annotations

import importlib
import os
import sys

# The interpreter must be on before the kernels are decorated (at import).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

if "minivllm.layers.attention.triton_kernels" in sys.modules:  # imported earlier without it
    importlib.reload(sys.modules["minivllm.layers.attention.triton_kernels"])

from minivllm.layers.attention import triton_kernels as tk  # noqa: E402
from minivllm.testing import make_case, naive_attention  # noqa: E402
from minivllm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402

# fp32 runs the same maths in a different order; fp16/bf16 differ by output rounding.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def test_kernels_run_in_interpreter():
    assert tk.kernels_interpreted()


# ---------------------------------------------------------------------------- KV store
@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_dim",
    [(torch.float32, 16, 2, 64), (torch.float16, 256, 1, 128), (torch.bfloat16, 16, 3, 80)],
)
def test_store_kvcache_writes_slots_and_skips_padding(dtype, block_size, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(1)
    num_blocks, T = 4, 7
    # k and v as strided views of one fused qkv projection, the way a model produces them
    qkv = torch.randn(T, (2 + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    k = qkv[:, 2 * head_dim: (2 + num_kv_heads) * head_dim].view(T, num_kv_heads, head_dim)
    v = qkv[:, (2 + num_kv_heads) * head_dim:].view(T, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, -7.0)
    n_slots = num_blocks * block_size
    slots = torch.tensor([3, -1, n_slots - 1, block_size, -1, 2 * block_size + 5, 0])
    tk.store_kvcache(k, v, k_cache, v_cache, slots)

    exp_k = torch.full_like(k_cache, 7.0).view(n_slots, num_kv_heads, head_dim)
    exp_v = torch.full_like(v_cache, -7.0).view(n_slots, num_kv_heads, head_dim)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            exp_k[s] = k[t]
            exp_v[s] = v[t]
    assert torch.equal(k_cache.view(n_slots, num_kv_heads, head_dim), exp_k)
    assert torch.equal(v_cache.view(n_slots, num_kv_heads, head_dim), exp_v)


def test_store_kvcache_rejects_dtype_mismatch():
    k = torch.zeros(2, 1, 64)
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        tk.store_kvcache(k, k, cache, cache.clone(), torch.tensor([0, 1]))


# ---------------------------------------------------------------------------- decode
DECODE_CASES = [
    # (context_lens, H, Hk, D, block_size, dtype)
    ([1, 17, 64], 4, 2, 128, 16, torch.float32),
    ([255, 257, 3], 8, 1, 64, 256, torch.float16),
    ([33, 2], 8, 1, 128, 16, torch.bfloat16),
    ([16, 40], 4, 2, 64, 256, torch.float32),
    # head_dim padded to a power of two (80 -> 128) and to tl.dot's minimum (8 -> 16), MHA 1:1
    ([9, 30], 2, 2, 80, 16, torch.float32),
    ([9], 2, 2, 8, 16, torch.float32),
]


@pytest.mark.parametrize("ctx_lens,H,Hk,D,block_size,dtype", DECODE_CASES)
def test_paged_decode_matches_reference(ctx_lens, H, Hk, D, block_size, dtype):
    case = make_case([(c, 1) for c in ctx_lens], H, Hk, D, block_size, dtype, seed=len(ctx_lens))
    tk.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = tk.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.context_lens, case.scale
    )
    assert out.shape == case.q.shape and out.dtype == dtype
    ref = naive_attention(case)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)


def test_paged_decode_wide_table_and_empty_row():
    # Block table wider than needed (CUDA-graph layout) and a 0-key row (padding): zeros.
    case = make_case([(20, 1), (5, 1)], 4, 2, 64, 16, table_width=8, fill=0.0)
    tk.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    ctx = torch.tensor([20, 0], dtype=torch.int32)
    out = tk.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.meta.block_tables, ctx, case.scale
    )
    ref = naive_attention(case)
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("splits,dtype", [(3, torch.float32), (4, torch.float16)])
def test_paged_decode_split_kv_matches_reference(splits, dtype):
    # Flash-decoding path (chosen automatically on a GPU for small batches): contexts
    # long enough for several splits, short ones that leave some splits empty, a 0-key row.
    case = make_case([(150, 1), (2, 1), (70, 1)], 8, 1, 64, 16, dtype, seed=11, table_width=12)
    tk.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    ctx = case.meta.context_lens.clone()
    out = tk.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                    ctx, case.scale, num_splits=splits)
    ref = naive_attention(case)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)
    ctx[1] = 0
    out0 = tk.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                     ctx, case.scale, num_splits=splits)
    assert torch.equal(out0[1], torch.zeros_like(out0[1]))
    torch.testing.assert_close(out0[[0, 2]].float(), ref[[0, 2]], atol=TOL[dtype], rtol=0)


# ---------------------------------------------------------------------------- prefill
PREFILL_CASES = [
    # (seqs as (context_len, q_len), H, Hk, D, block_size, dtype, pad_tokens)
    # whole prompt + chunk over a cached prefix + a decode row in the same step
    ([(5, 5), (37, 3), (20, 1)], 4, 2, 64, 16, torch.float32, 0),
    # prefix hit that ends mid-block in a 256-token block, plus a whole prompt
    ([(270, 14), (6, 6)], 8, 1, 128, 256, torch.float16, 0),
    # block-aligned prefix hit (32 cached) and a chunk, 8:1 GQA, head_dim 64
    ([(48, 16), (23, 7)], 8, 1, 64, 16, torch.float16, 0),
    # second chunk with trailing padding tokens, big block, 4:2, head_dim 128
    ([(40, 8), (3, 3)], 4, 2, 128, 256, torch.float32, 2),
    # bf16: a query longer than one kernel tile with a prefix
    ([(40, 20), (1, 1)], 4, 2, 64, 16, torch.bfloat16, 0),
    # head_dim 80 (masked up to 128), prefix + chunk
    ([(20, 6), (3, 3)], 2, 1, 80, 16, torch.float32, 0),
]


@pytest.mark.parametrize("seqs,H,Hk,D,block_size,dtype,pad", PREFILL_CASES)
def test_paged_prefill_matches_reference(seqs, H, Hk, D, block_size, dtype, pad):
    case = make_case(seqs, H, Hk, D, block_size, dtype, seed=len(seqs) + pad, pad_tokens=pad)
    out = TritonAttentionBackend().forward(
        case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale
    )
    assert out.shape == case.q.shape and out.dtype == dtype
    ref = naive_attention(case)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)
    if pad:
        assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))


def test_prefill_kernel_agrees_with_decode_kernel_on_one_token_rows():
    case = make_case([(9, 1), (30, 1)], 8, 1, 64, 16)
    tk.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    m = case.meta
    dec = tk.paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.context_lens, case.scale)
    pre = tk.paged_prefill_attention(
        case.q, case.k_cache, case.v_cache, m.cu_seqlens_q, m.context_lens, m.block_tables, 1, case.scale
    )
    torch.testing.assert_close(dec, pre, atol=2e-6, rtol=0)


def test_backend_decode_path_stores_kv_then_attends():
    case = make_case([(17, 1), (3, 1)], 4, 2, 64, 16)
    assert case.meta.is_decode_only
    out = TritonAttentionBackend().forward(
        case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale
    )
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=0)
    slots = case.meta.slot_mapping
    flat_k = case.k_cache.view(-1, *case.k_cache.shape[2:])
    assert torch.equal(flat_k[slots], case.k)


def test_kernels_reject_bad_gqa_ratio():
    q = torch.zeros(1, 3, 64)
    cache = torch.zeros(1, 16, 2, 64)
    with pytest.raises(ValueError, match="num_heads=3"):
        tk.paged_decode_attention(
            q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0
        )


def test_decode_rejects_bad_split_count():
    q = torch.zeros(1, 2, 64)
    cache = torch.zeros(1, 16, 2, 64)
    for bad in (0, tk.MAX_SPLITS + 1):
        with pytest.raises(ValueError, match=f"got {bad}"):
            tk.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), 1.0, num_splits=bad)


# ---------------------------------------------------------------------------- vs torch backend
def _torch_backend():
    mod = pytest.importorskip("minivllm.layers.attention.torch_backend")
    return mod.TorchAttentionBackend()


@pytest.mark.parametrize(
    "seqs,H,Hk,D,block_size,dtype",
    [
        ([(5, 5), (37, 3), (20, 1)], 4, 2, 64, 16, torch.float32),
        ([(260, 6), (9, 9)], 8, 1, 128, 256, torch.float16),
        ([(33, 1), (7, 1), (64, 1)], 8, 1, 64, 16, torch.float32),
    ],
)
def test_triton_backend_matches_torch_backend(seqs, H, Hk, D, block_size, dtype):
    ref_backend = _torch_backend()
    # fill=0: the reference may gather whole blocks, including slots no sequence owns
    case_a = make_case(seqs, H, Hk, D, block_size, dtype, seed=3, fill=0.0)
    case_b = make_case(seqs, H, Hk, D, block_size, dtype, seed=3, fill=0.0)
    ref_backend.prepare(case_a.meta)
    ref = ref_backend.forward(case_a.q, case_a.k, case_a.v, case_a.k_cache, case_a.v_cache, case_a.meta, case_a.scale)
    tri = TritonAttentionBackend()
    tri.prepare(case_b.meta)
    out = tri.forward(case_b.q, case_b.k, case_b.v, case_b.k_cache, case_b.v_cache, case_b.meta, case_b.scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)
    # both stored the same K/V
    assert torch.equal(case_a.k_cache, case_b.k_cache)
    assert torch.equal(case_a.v_cache, case_b.v_cache)
