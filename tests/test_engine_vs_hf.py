"""The engine against Hugging Face transformers on the same weights, fp32.

Logits within 1e-4 (absolute) at prefill and at every decode step; greedy tokens
identical up to the first step where the reference's top-2 margin is below 1e-4
(a near-tie, where either choice is right).
"""
from __future__ import annotations

import pytest
import torch

from helpers_engine import greedy, make_llm, prompts_of
from helpers_models import load_hf_model, make_hf_checkpoint
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

ATOL = 1e-4
NEAR_TIE = 1e-4


def hf_greedy(model, prompt: list[int], steps: int):
    """Reference: full re-forward every step. Returns (tokens, logits per step, top-2 margins)."""
    ids = list(prompt)
    tokens, logits_list, margins = [], [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top2 = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            logits_list.append(logits)
            margins.append(float(top2[0] - top2[1]))
            ids.append(tokens[-1])
    return tokens, logits_list, margins


def engine_greedy_with_logits(llm, prompts, steps):
    runner = llm.llm_engine.runner
    captured: dict[str, list[torch.Tensor]] = {}
    original = runner.forward_logits

    def spy(inp):
        logits = original(inp)
        for row, seq in enumerate(inp.sampling_seqs):
            captured.setdefault(seq.request_id, []).append(logits[row].clone())
        return logits

    runner.forward_logits = spy
    try:
        outs = llm.generate(prompts, greedy(steps), use_tqdm=False)
    finally:
        runner.forward_logits = original
    return outs, [captured[o.request_id] for o in outs]


def compare(llm, hf_model, prompts, steps):
    outs, logits = engine_greedy_with_logits(llm, prompts, steps)
    assert len(outs) == len(logits) == len(prompts)
    for out, ours in zip(outs, logits):
        # one sampled row per generated token, every step: zip below would check fewer silently
        assert len(ours) == steps and len(out.outputs[0].token_ids) == steps, (len(ours), out.outputs[0].token_ids)
        ref_tokens, ref_logits, margins = hf_greedy(hf_model, out.prompt_token_ids, steps)
        for step, (mine, ref, margin) in enumerate(zip(ours, ref_logits, margins)):
            err = (mine - ref).abs().max().item()
            assert err <= ATOL, f"step {step}: max |logit diff| {err:.2e} > {ATOL}"
            if margin < NEAR_TIE:
                break  # a near-tie: later tokens may legitimately differ
            assert out.outputs[0].token_ids[step] == ref_tokens[step], f"step {step}: token differs"


CONFIGS = {
    "head_dim_differs_gqa_4_2_untied": dict(),
    "gqa_8_1_tied": dict(num_attention_heads=8, num_key_value_heads=1, hidden_size=64, head_dim=8,
                         tie_word_embeddings=True),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=64, head_dim=16,
                     tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_models_match_transformers(name, tmp_path):
    ckpt = make_hf_checkpoint(tmp_path, seed=3, **CONFIGS[name])
    hf = load_hf_model(ckpt)
    llm = make_llm(ckpt, block_size=4)
    compare(llm, hf, prompts_of([5, 11, 17], seed=4), steps=6)


def test_chunked_and_prefix_cached_runs_match_transformers(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path, seed=5)
    hf = load_hf_model(ckpt)
    llm = make_llm(ckpt, block_size=4, max_num_batched_tokens=8)
    shared = prompts_of([12], seed=6)[0]
    llm.generate(shared + [1], greedy(1), use_tqdm=False)  # warm the prefix cache
    compare(llm, hf, [shared + [2, 3], shared + [4, 5, 6, 7, 8, 9, 10]], steps=5)


@pytest.mark.skipif(not (EMBEDDED_MODEL_DIR / "model.safetensors").exists(), reason="embedded model not built")
def test_embedded_model_matches_transformers():
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, dtype=torch.float32).eval()
    llm = make_llm(EMBEDDED_MODEL_DIR, block_size=16)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The list type", "Return the number of", "def ")]
    compare(llm, hf, prompts, steps=8)
