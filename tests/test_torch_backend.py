"""The vectorised torch backend against a naive per-sequence loop written here."""
from __future__ import annotations

import pytest
import torch

from helpers_models import allocate_block_tables, build_metadata
from minivllm.layers.attention.torch_backend import TorchAttentionBackend

MIXED = [(0, 7), (5, 1), (12, 6), (3, 1), (0, 1), (20, 1), (8, 9), (17, 1)]


def naive_attention(q, k, v, k_cache, v_cache, seqs, block_tables, block_size, slots, scale):
    """One sequence and one query at a time, softmax written out in fp32."""
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    for t, s in enumerate(slots):
        if s >= 0:
            kf[s] = k[t]
            vf[s] = v[t]
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    tok = 0
    for (cached, new), table in zip(seqs, block_tables):
        ctx = cached + new
        key_slots = [table[j // block_size] * block_size + j % block_size for j in range(ctx)]
        keys = kf[key_slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, h, d]
        vals = vf[key_slots].float().repeat_interleave(heads // kv_heads, dim=1)
        for i in range(new):
            pos = cached + i
            scores = torch.einsum("hd,khd->hk", q[tok + i].float(), keys[: pos + 1]) * scale
            probs = torch.softmax(scores, dim=-1)
            out[tok + i] = torch.einsum("hk,khd->hd", probs, vals[: pos + 1]).to(q.dtype)
        tok += new
    return out


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run_case(seqs, block_size, dtype, heads=4, kv_heads=2, head_dim=16, num_pad=0, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    tables = allocate_block_tables([c + n for c, n in seqs], block_size, num_blocks, seed=seed)
    meta = build_metadata(seqs, block_size, tables, num_pad_tokens=num_pad)
    t = meta.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    # Random "previously cached" K/V everywhere, so prefix hits read real data.
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    meta.extras["test_original_k_cache"] = k_cache.clone()
    scale = head_dim ** -0.5
    if device != "cpu":  # the naive reference runs on CPU on the same values
        dmeta = build_metadata(seqs, block_size, tables, device=device, num_pad_tokens=num_pad)
        kc, vc = k_cache.to(device), v_cache.to(device)
        out = TorchAttentionBackend().forward(q.to(device), k.to(device), v.to(device), kc, vc, dmeta, scale)
        out, k_cache, v_cache = out.cpu(), kc.cpu(), vc.cpu()
    else:
        out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = naive_attention(q, k, v, k_ref, v_ref, seqs, tables, block_size, meta.slot_mapping.tolist(), scale)
    return out, ref, (k_cache, v_cache), (k_ref, v_ref), meta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
def test_mixed_batch_matches_naive(block_size, dtype, heads, kv_heads, device):
    out, ref, cache, cache_ref, _ = run_case(MIXED, block_size, dtype, heads, kv_heads, device=device)
    assert out.dtype == dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)
    assert torch.equal(cache[0], cache_ref[0]) and torch.equal(cache[1], cache_ref[1])


@pytest.mark.parametrize("seqs", [[(0, 1), (9, 1), (30, 1)], [(0, 13)], [(0, 5), (4, 3)], [(16, 16)]])
def test_single_kind_batches(seqs):
    out, ref, *_ = run_case(seqs, 4, torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_slot_minus_one_writes_nothing():
    seqs = [(0, 5), (6, 1)]
    out, ref, cache, cache_ref, meta = run_case(seqs, 4, torch.float32, num_pad=3)
    # Only the 6 real tokens' slots changed; the padding tokens wrote nowhere.
    original = meta.extras["test_original_k_cache"]
    changed = (cache[0] != original).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert sorted(changed) == sorted(meta.slot_mapping[:6].tolist())
    torch.testing.assert_close(out[:6], ref[:6], atol=1e-5, rtol=0)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))


def test_decodes_not_padded_to_prefill_length():
    backend = TorchAttentionBackend()
    seqs = [(0, 40)] + [(i, 1) for i in range(3, 20)]
    tables = allocate_block_tables([c + n for c, n in seqs], 16, 64)
    meta = build_metadata(seqs, 16, tables)
    backend.prepare(meta)
    plan = meta.extras["torch_backend_plan"]
    shapes = sorted((g.num_seqs, g.max_q) for g in plan.groups)
    assert shapes == [(1, 40), (17, 1)]


def test_prepare_is_computed_once_per_step():
    seqs = [(0, 4), (2, 1)]
    tables = allocate_block_tables([4, 3], 4, 8)
    meta = build_metadata(seqs, 4, tables)
    backend = TorchAttentionBackend()
    q = torch.randn(5, 2, 8)
    k = torch.randn(5, 1, 8)
    kc, vc = torch.zeros(8, 4, 1, 8), torch.zeros(8, 4, 1, 8)
    backend.forward(q, k, k, kc, vc, meta, 1.0)
    plan = meta.extras["torch_backend_plan"]
    backend.forward(q, k, k, kc, vc, meta, 1.0)
    assert meta.extras["torch_backend_plan"] is plan


@pytest.mark.parametrize("seqs,flag", [([(0, 1), (9, 1), (30, 1)], "all_decode"), ([(0, 13)], "single_fresh_prefill")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fast_paths_are_taken_and_match_naive(seqs, flag, dtype):
    out, ref, _, _, meta = run_case(seqs, 4, dtype, 8, 2)
    assert getattr(meta.extras["torch_backend_plan"], flag)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
def test_layers_sharing_the_gather_buffer_each_match_naive(block_size, heads, kv_heads):
    """One backend, one step, two layers with different caches (the gathered K/V buffer is
    reused between them): each layer's output matches the naive loop, and the decode group
    attends through its additive bias, not a mask."""
    seqs = MIXED
    gen = torch.Generator().manual_seed(3)
    tables = allocate_block_tables([c + n for c, n in seqs], block_size, 64, seed=3)
    meta = build_metadata(seqs, block_size, tables)
    backend = TorchAttentionBackend()
    t, d = meta.num_tokens, 16
    outs, refs = [], []
    for _layer in range(2):
        q = torch.randn(t, heads, d, generator=gen)
        k, v = torch.randn(t, kv_heads, d, generator=gen), torch.randn(t, kv_heads, d, generator=gen)
        kc = torch.randn(64, block_size, kv_heads, d, generator=gen)
        vc = torch.randn(64, block_size, kv_heads, d, generator=gen)
        refs.append(naive_attention(q, k, v, kc.clone(), vc.clone(), seqs, tables, block_size,
                                    meta.slot_mapping.tolist(), d ** -0.5))
        outs.append(backend.forward(q, k, v, kc, vc, meta, d ** -0.5))
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    decode = [g for g in meta.extras["torch_backend_plan"].groups if g.max_q == 1]
    assert len(decode) == 1 and decode[0].mask is None and decode[0].bias is not None
