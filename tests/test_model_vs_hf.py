"""Our Qwen3 (loaded through load_weights) against Hugging Face transformers on the same
checkpoint, fp32, over the paged KV cache: full prefill, chunked prefill, decode steps,
and several sequences of different phases in one batch."""
from __future__ import annotations

import pytest
import torch

from helpers_models import PagedRunner, allocate_block_tables, load_hf_model, make_hf_checkpoint

ATOL = 1e-4
NUM_BLOCKS = PagedRunner.NUM_BLOCKS
BLOCK_SIZE = PagedRunner.BLOCK_SIZE


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


CONFIGS = {
    "headdim16_gqa4to2_untied": dict(),
    "gqa8to1_tied": dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8, hidden_size=64,
                         tie_word_embeddings=True),
    "mha_tied_headdim_equal": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=12,
                                   tie_word_embeddings=True, rope_theta=1e6),
    "attention_bias": dict(attention_bias=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def setup(request, tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), seed=3, **CONFIGS[request.param])
    return PagedRunner(path), load_hf_model(path)


def _prompt(n, seed, vocab=97):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prefill_matches_hf(setup):
    runner, hf = setup
    prompt = _prompt(19, 0)
    tables = allocate_block_tables([19], BLOCK_SIZE, NUM_BLOCKS)
    (ours,) = runner.step([prompt], [0], tables)
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_decode_steps_match_hf(setup):
    runner, hf = setup
    prompt = _prompt(9, 1)
    cont = _prompt(6, 2)
    tables = allocate_block_tables([len(prompt) + len(cont)], BLOCK_SIZE, NUM_BLOCKS, seed=1)
    runner.step([prompt], [0], tables)
    ref = hf_logits(hf, prompt + cont)
    for i, tok in enumerate(cont):
        (ours,) = runner.step([[tok]], [len(prompt) + i], tables)
        torch.testing.assert_close(ours[0], ref[len(prompt) + i], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_hf(setup):
    runner, hf = setup
    prompt = _prompt(23, 3)
    tables = allocate_block_tables([23], BLOCK_SIZE, NUM_BLOCKS, seed=2)
    (first,) = runner.step([prompt[:10]], [0], tables)
    (rest,) = runner.step([prompt[10:]], [10], tables)
    ref = hf_logits(hf, prompt)
    torch.testing.assert_close(torch.cat([first, rest]), ref, atol=ATOL, rtol=0)


def test_mixed_batch_matches_hf(setup):
    """One step holding a fresh prompt, a second chunk, and a decode, each vs HF alone."""
    runner, hf = setup
    a, b, c = _prompt(11, 4), _prompt(14, 5), _prompt(7, 6)
    tables = allocate_block_tables([11, 14, 7], BLOCK_SIZE, NUM_BLOCKS, seed=3)
    runner.step([b[:6], c[:6]], [0, 0], tables[1:])
    la, lb, lc = runner.step([a, b[6:], c[6:]], [0, 6, 6], tables)
    torch.testing.assert_close(la, hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, hf_logits(hf, b)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(lc, hf_logits(hf, c)[6:], atol=ATOL, rtol=0)


def test_sharded_checkpoint_matches_hf(tmp_path):
    path = make_hf_checkpoint(tmp_path, seed=7, shards=2, tie_word_embeddings=False)
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    runner, hf = PagedRunner(path), load_hf_model(path)
    prompt = _prompt(13, 8)
    tables = allocate_block_tables([13], BLOCK_SIZE, NUM_BLOCKS)
    (ours,) = runner.step([prompt], [0], tables)
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_tied_head_shares_embedding(tmp_path):
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=True)
    runner = PagedRunner(path)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
