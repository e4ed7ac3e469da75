"""The flash_attn backend's call contract, checked on CPU with a stand-in ``flash_attn``.

flash-attn cannot be installed here, so a stand-in module is put in ``sys.modules``. Its
two functions check the arguments the way flash-attn 2 documents them (shapes, dtypes,
int32 ``cu_seqlens``/``block_table``/``cache_seqlens``, page size a multiple of 256,
``causal=True``, the softmax scale) and answer with a plain-torch implementation of the
documented semantics (causal mask aligned bottom-right). The backend's output must then
equal the torch reference backend's on the same step. This verifies our side of the call
only; flash-attn itself is verified when run on a GPU box with it installed.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from minivllm.layers.attention import get_attention_backend
from minivllm.layers.attention.flash_attn_backend import FlashAttnBackend
from minivllm.testing import make_case
from minivllm.layers.attention.torch_backend import TorchAttentionBackend


def _attend(q, k, v, scale):
    """q [sq, H, D], k/v [sk, Hk, D] -> [sq, H, D], causal aligned bottom-right (fp32)."""
    sq, sk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    s = (qf @ kf.transpose(1, 2)) * scale
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    return (s.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)


def _gather_pages(cache, table_row, n):
    page = cache.shape[1]
    idx = torch.arange(n)
    return cache[table_row[idx // page].long(), idx % page]


class StandIn:
    """Records calls; checks arguments like flash-attn 2 does (or documents)."""

    def __init__(self, scale):
        self.scale = scale
        self.calls = []

    def _common(self, q, k_cache, v_cache, softmax_scale, causal, block_table, batch):
        assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
        assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        assert causal is True
        assert softmax_scale == pytest.approx(self.scale)
        assert q.shape[-2] % k_cache.shape[-2] == 0  # GQA
        if block_table is not None:
            assert block_table.dtype == torch.int32
            assert block_table.dim() == 2 and block_table.shape[0] == batch
            assert k_cache.dim() == 4 and k_cache.shape[1] % 256 == 0, k_cache.shape
            assert int(block_table.min()) >= 0 and int(block_table.max()) < k_cache.shape[0]

    def flash_attn_varlen_func(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
        block_table=None,
    ):
        self.calls.append(("varlen", block_table is not None))
        batch = cu_seqlens_q.shape[0] - 1
        assert q.dim() == 3
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert cu_seqlens_k.shape == cu_seqlens_q.shape
        assert int(cu_seqlens_q[-1]) == q.shape[0]
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        assert max_seqlen_q == max(q_lens) and max_seqlen_k == max(k_lens)
        assert all(kl >= ql for ql, kl in zip(q_lens, k_lens))
        assert dropout_p == 0.0
        self._common(q, k, v, softmax_scale, causal, block_table, batch)
        if block_table is None:
            assert k.dim() == 3 and int(cu_seqlens_k[-1]) == k.shape[0]
        out = torch.empty_like(q)
        for b in range(batch):
            qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            if block_table is None:
                ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
                kb, vb = k[ks:ke], v[ks:ke]
            else:
                kb = _gather_pages(k, block_table[b], k_lens[b])
                vb = _gather_pages(v, block_table[b], k_lens[b])
            out[qs:qe] = _attend(q[qs:qe], kb, vb, softmax_scale)
        return out

    def flash_attn_with_kvcache(
        self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
        cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    ):
        self.calls.append(("kvcache", block_table is not None))
        assert q.dim() == 4 and q.shape[1] == 1  # [batch, seqlen_q=1, heads, dim]
        batch = q.shape[0]
        assert k is None and v is None  # K/V are stored by the backend beforehand
        assert cache_seqlens is not None and cache_seqlens.dtype == torch.int32
        assert cache_seqlens.shape == (batch,)
        assert block_table is not None
        self._common(q, k_cache, v_cache, softmax_scale, causal, block_table, batch)
        out = torch.empty_like(q)
        for b in range(batch):
            n = int(cache_seqlens[b])
            kb = _gather_pages(k_cache, block_table[b], n)
            vb = _gather_pages(v_cache, block_table[b], n)
            out[b] = _attend(q[b], kb, vb, softmax_scale)
        return out


@pytest.fixture
def stand_in(monkeypatch):
    def install(scale):
        impl = StandIn(scale)
        mod = types.ModuleType("flash_attn")
        mod.flash_attn_varlen_func = impl.flash_attn_varlen_func
        mod.flash_attn_with_kvcache = impl.flash_attn_with_kvcache
        monkeypatch.setitem(sys.modules, "flash_attn", mod)
        return impl

    return install


CASES = [
    # (seqs (context_len, q_len), H, Hk, D, dtype, pad, expected call)
    ([(300, 1), (5, 1), (257, 1)], 8, 1, 64, torch.float16, 0, ("kvcache", True)),
    ([(7, 7), (12, 12)], 4, 2, 128, torch.bfloat16, 0, ("varlen", False)),
    ([(270, 14), (40, 8), (100, 1)], 4, 2, 64, torch.float16, 0, ("varlen", True)),
    ([(9, 9), (30, 2)], 8, 1, 128, torch.bfloat16, 3, ("varlen", True)),
    ([(6, 6)], 4, 2, 64, torch.float16, 2, ("varlen", False)),
]


@pytest.mark.parametrize("seqs,H,Hk,D,dtype,pad,expected_call", CASES)
def test_flash_attn_backend_matches_torch_backend(stand_in, seqs, H, Hk, D, dtype, pad, expected_call):
    case_fa = make_case(seqs, H, Hk, D, 256, dtype, seed=5, fill=0.0, pad_tokens=pad)
    case_ref = make_case(seqs, H, Hk, D, 256, dtype, seed=5, fill=0.0, pad_tokens=pad)
    impl = stand_in(case_fa.scale)

    backend = get_attention_backend("torch", "cpu", 256)
    assert isinstance(backend, TorchAttentionBackend)
    backend.prepare(case_ref.meta)
    ref = backend.forward(case_ref.q, case_ref.k, case_ref.v, case_ref.k_cache, case_ref.v_cache,
                          case_ref.meta, case_ref.scale)

    fa = FlashAttnBackend(block_size=256)
    fa.prepare(case_fa.meta)
    out = fa.forward(case_fa.q, case_fa.k, case_fa.v, case_fa.k_cache, case_fa.v_cache,
                     case_fa.meta, case_fa.scale)

    assert impl.calls == [expected_call]
    assert out.shape == case_fa.q.shape and out.dtype == dtype
    n = sum(case_fa.q_lens)
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=2e-2 if dtype == torch.bfloat16 else 2e-3, rtol=0)
    if pad:
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    # K/V were stored exactly where the reference stored them
    assert torch.equal(case_fa.k_cache, case_ref.k_cache)
    assert torch.equal(case_fa.v_cache, case_ref.v_cache)


@pytest.mark.parametrize("block_size", [16, 128, 255, 0])
def test_flash_attn_refuses_block_size_not_multiple_of_256(block_size):
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        FlashAttnBackend(block_size=block_size)


def test_flash_attn_backend_constructs_without_flash_attn_and_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    backend = FlashAttnBackend(block_size=512)
    case = make_case([(4, 4)], 4, 2, 64, 512, torch.float16, fill=0.0)
    with pytest.raises(ImportError, match="flash-attn"):
        backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)


def test_flash_attn_backend_refuses_fp32(stand_in):
    case = make_case([(4, 4)], 4, 2, 64, 256, torch.float32, fill=0.0)
    stand_in(case.scale)
    with pytest.raises(ValueError, match="float32"):
        FlashAttnBackend(256).forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
