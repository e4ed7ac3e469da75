"""Small layers against their Hugging Face / textbook definitions."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding


def test_rmsnorm_matches_hf_and_fuses_residual():
    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 24, generator=gen), torch.randn(5, 24, generator=gen)
    w = 1 + 0.3 * torch.randn(24, generator=gen)
    ours, hf = RMSNorm(24, eps=1e-5), Qwen3RMSNorm(24, eps=1e-5)
    ours.weight.data.copy_(w)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=0)
    out, new_res = ours(x, r)
    torch.testing.assert_close(new_res, x + r, atol=0, rtol=0)
    torch.testing.assert_close(out, hf(x + r), atol=1e-6, rtol=0)


def test_rotary_matches_hf_neox_style():
    head_dim, theta = 16, 5000.0
    rope = RotaryEmbedding(head_dim, 64, theta)
    gen = torch.Generator().manual_seed(1)
    pos = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 3, head_dim, generator=gen), torch.randn(4, 1, head_dim, generator=gen)
    qo, ko = rope(pos, q, k)
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)  # HF's cos/sin layout
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    torch.testing.assert_close(qo, qh.transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ko, kh.transpose(0, 1), atol=1e-5, rtol=0)
    # the table stays fp32 and the output keeps the input dtype
    rope.to(torch.bfloat16)
    qb, _ = rope(pos, q.bfloat16(), k.bfloat16())
    assert qb.dtype == torch.bfloat16 and rope.cos_sin_cache(q.device).dtype == torch.float32


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_embedding_and_lm_head_single_rank():
    w = torch.randn(11, 6)
    emb, head = VocabParallelEmbedding(11, 6), ParallelLMHead(11, 6)
    emb.weight.weight_loader(emb.weight, w)
    head.weight.weight_loader(head.weight, w)
    ids = torch.tensor([0, 10, 4])
    torch.testing.assert_close(emb(ids), w[ids])
    h = torch.randn(2, 6)
    torch.testing.assert_close(head.compute_logits(h), h @ w.T)
    logits = head.to(torch.bfloat16).compute_logits(h.bfloat16())  # low-precision model: fp32 logits out
    assert logits.dtype == torch.float32 and logits.shape == (2, 11)
