"""Greedy output does not depend on how the engine ran it: batch composition, prefix-cache
hits, chunk size, preemption, block size."""
from __future__ import annotations

import pytest

from helpers_engine import greedy, make_llm, prompts_of, token_lists

PROMPTS = prompts_of([3, 9, 17, 30, 12, 12], seed=21)
PROMPTS[5] = PROMPTS[4][:8] + PROMPTS[5][8:]  # shares two blocks of 4 with prompt 4
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    llm = make_llm(tiny_ckpt, enable_prefix_caching=False, enable_chunked_prefill=False, num_kvcache_blocks=512)
    return [token_lists(llm.generate(p, greedy(MAX_TOKENS), use_tqdm=False))[0] for p in PROMPTS]


@pytest.mark.parametrize("engine_args", [
    dict(),                                              # all together
    dict(max_num_seqs=2),                                # small batches
    dict(max_num_batched_tokens=8),                      # heavy chunking, mixed steps
    dict(max_num_batched_tokens=13, max_num_seqs=3),
    dict(num_kvcache_blocks=14, max_model_len=40),      # preemption
    dict(num_kvcache_blocks=14, max_model_len=40, max_num_batched_tokens=8),
    dict(block_size=16),
    dict(block_size=256, num_kvcache_blocks=8),
    dict(enable_prefix_caching=False, max_num_batched_tokens=9),
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_greedy_output_is_invariant(tiny_ckpt, reference, engine_args):
    llm = make_llm(tiny_ckpt, **engine_args)
    # Twice: the second pass runs on a warm prefix cache.
    for _ in range(2):
        assert token_lists(llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)) == reference


def test_preemption_actually_happens_in_the_small_pool(tiny_ckpt):
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=14, max_model_len=40)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, greedy(MAX_TOKENS))
    preempted = 0
    while engine.has_unfinished_requests():
        preempted += len(engine.step_with_record().record.preempted)
        engine.check_invariants()
    assert preempted > 0
