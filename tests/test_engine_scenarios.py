"""Scenario tests of the engine: prefix caching, chunking, preemption, limits, stops, aborts.

Model: a tiny random Qwen3 (block size 4). Reference: the same engine with a large
pool and neither prefix caching nor chunking.
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers_engine import greedy, make_llm, prompts_of, run_to_end, token_lists
from minivllm import SamplingParams


def reference_tokens(ckpt, prompts, max_tokens, **sp):
    llm = make_llm(ckpt, enable_prefix_caching=False, enable_chunked_prefill=False)
    return token_lists(llm.generate(prompts, greedy(max_tokens, **sp), use_tqdm=False))


def test_same_prompt_twice_hits_cache_but_computes_last_token(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    prompt = prompts_of([8])[0]
    first = llm.generate(prompt, greedy(3), use_tqdm=False)[0]
    engine = llm.llm_engine
    engine.add_request("again", prompt, greedy(3))
    final, records = run_to_end(engine)
    second = final["again"]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens == 4  # one full block hit; the block holding the last token is recomputed
    assert records[0].num_prefill_tokens == 4 and records[0].prefix_cache_hit_tokens == 4


def test_identical_prompts_in_one_step_compute_their_own_blocks(tiny_ckpt):
    prompt = prompts_of([12], seed=1)[0]
    single = make_llm(tiny_ckpt).generate(prompt, greedy(4), use_tqdm=False)[0]
    llm = make_llm(tiny_ckpt)
    outs = llm.generate([prompt] * 3, greedy(4), use_tqdm=False)
    assert token_lists(outs) == [single.outputs[0].token_ids] * 3
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]


def test_chunked_prefill_8_8_5(tiny_ckpt):
    prompt = prompts_of([21], seed=2)[0]
    expected = reference_tokens(tiny_ckpt, [prompt], 5)
    llm = make_llm(tiny_ckpt, max_num_batched_tokens=8)
    engine = llm.llm_engine
    engine.add_request("r", prompt, greedy(5))
    final, records = run_to_end(engine)
    assert final["r"].outputs[0].token_ids == expected[0]
    chunks = [(e.num_tokens, e.sampled) for r in records for e in r.scheduled if e.is_prefill]
    assert chunks == [(8, False), (8, False), (5, True)]


def test_preemption_with_8_blocks_matches_large_pool(tiny_ckpt):
    prompts = prompts_of([7, 7, 7], seed=3)
    expected = reference_tokens(tiny_ckpt, prompts, 10)
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=8, max_model_len=32)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(10))
    final, records = run_to_end(engine)
    got = [final[str(i)].outputs[0].token_ids for i in range(3)]
    assert got == expected
    assert all(len(t) == 10 for t in got)
    assert any(r.preempted for r in records), "the pool of 8 blocks should force a preemption"
    assert engine.block_manager.num_used_blocks == 0


def test_pool_smaller_than_one_sequence_is_refused_at_start(tiny_ckpt):
    with pytest.raises(ValueError, match="max_model_len=32"):
        make_llm(tiny_ckpt, num_kvcache_blocks=4, max_model_len=32)
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=4, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len=16"):
        llm.generate(prompts_of([20])[0], greedy(2), use_tqdm=False)
    out = llm.generate(prompts_of([4])[0], greedy(3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_max_model_len_limits(tiny_ckpt):
    llm = make_llm(tiny_ckpt, max_model_len=16)
    for n in (17, 16):
        with pytest.raises(ValueError, match="max_model_len=16"):
            llm.generate(prompts_of([n])[0], greedy(10), use_tqdm=False)
    out = llm.generate(prompts_of([12])[0], greedy(10), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].finish_reason == "length"


def test_sequential_requests_on_a_tiny_pool_free_every_block(tiny_ckpt):
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=4, max_model_len=16)
    bm = llm.llm_engine.block_manager
    for i in range(10):
        out = llm.generate(prompts_of([5], seed=i)[0], greedy(3), use_tqdm=False)[0]  # 8 tokens = 2 blocks
        assert len(out.outputs[0].token_ids) == 3
        assert bm.num_used_blocks == 0
        assert all(b.ref_count == 0 for b in bm.blocks)


def test_empty_prompt_rejected_and_engine_keeps_serving(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    for bad in ("", [[]], {"prompt_token_ids": []}):
        with pytest.raises(ValueError, match="empty prompt"):
            llm.generate(bad, greedy(2), use_tqdm=False)
    assert len(llm.generate([5, 6, 7], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_bad_prompt_in_a_list_names_its_index_and_nothing_is_scheduled(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    with pytest.raises(ValueError, match=r"prompt 1: token id 500"):
        llm.generate([[1, 2, 3], [4, 500]], greedy(2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_tokens_one(tiny_ckpt):
    out = make_llm(tiny_ckpt).generate([3, 4, 5], greedy(1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_eos_from_generation_config_and_stop_token_ids(tiny_ckpt, tmp_path):
    import shutil

    from helpers_models import set_generation_eos

    prompt = [7, 8, 9, 10]
    first = make_llm(tiny_ckpt).generate(prompt, greedy(1), use_tqdm=False)[0].outputs[0].token_ids[0]
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "eos")
    set_generation_eos(ckpt, first)
    llm = make_llm(ckpt)
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    # the tokenizer's eos is 0: vLLM makes the generation config's other eos a stop token, reported by id
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    ignored = llm.generate(prompt, greedy(5), use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 5 and ignored.finish_reason == "length"
    via_ids = make_llm(tiny_ckpt).generate(prompt, greedy(5, stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert via_ids.token_ids == [first] and via_ids.finish_reason == "stop" and via_ids.stop_reason == first


def test_stop_string_spanning_two_tokens(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    tok = llm.get_tokenizer()
    prompt = [11, 12, 13]
    full = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0]
    # Pick a stop string made of the end of token 3's text and the start of token 4's text.
    pieces = [tok.decode([t]) for t in full.token_ids]
    def spans(i):  # the string's first match in the text is across tokens i and i + 1
        stop, prefix = pieces[i][-1] + pieces[i + 1][0], "".join(pieces[:i]) + pieces[i][:-1]
        return full.text.startswith(prefix) and full.text.find(stop) == len(prefix)

    i = next(i for i in range(2, len(pieces) - 1) if pieces[i] and pieces[i + 1] and spans(i))
    stop = pieces[i][-1] + pieces[i + 1][0]
    out = llm.generate(prompt, greedy(12, stop=[stop]), use_tqdm=False)[0].outputs[0]
    expected = full.text[:full.text.find(stop)]
    assert out.text == expected and out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text


def test_abort_running_request_frees_blocks(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    engine.add_request("a", prompts_of([9])[0], greedy(50))
    engine.add_request("b", prompts_of([6], seed=5)[0], greedy(3))
    engine.step()
    engine.step()
    used_before = engine.block_manager.num_used_blocks
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks < used_before
    engine.check_invariants()
    final, _ = run_to_end(engine)
    assert len(final["b"].outputs[0].token_ids) == 3
    assert engine.abort_request("a") is None


def test_mixed_temperatures_in_one_batch(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    runner = llm.llm_engine.runner
    seen_logits = []
    original = runner.forward_logits

    def spy(inp):
        logits = original(inp)
        seen_logits.append((list(inp.sampling_seqs), logits.clone()))
        return logits

    runner.forward_logits = spy
    temps = [0.0, 0.0, 0.8, 1.0, 1e-5]
    prompts = prompts_of([5, 6, 7, 8, 9], seed=7)
    params = [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True) for t in temps]
    outs = llm.generate(prompts, params, use_tqdm=False)
    positions = {o.request_id: 0 for o in outs}
    for seqs, logits in seen_logits:
        assert torch.isfinite(logits).all()
        for row, seq in enumerate(seqs):
            k = positions[seq.request_id]
            token = seq.output_token_ids[k]
            positions[seq.request_id] += 1
            if seq.params.temperature == 0:
                assert token == int(logits[row].argmax())
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_seeded_request_is_independent_of_the_batch(tiny_ckpt):
    a = SamplingParams(temperature=0.8, seed=42, max_tokens=8, ignore_eos=True)
    alone = make_llm(tiny_ckpt).generate([3, 1, 4, 1, 5], a, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batched = make_llm(tiny_ckpt, seed=123).generate([[9, 2, 6], [3, 1, 4, 1, 5]], [other, a], use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone


def test_tiny_temperature_is_finite_and_greedy(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    g = llm.generate([2, 3, 4], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    t = llm.generate([2, 3, 4], SamplingParams(temperature=1e-5, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert t == g
    # an overflow to inf/NaN logits would show as ids outside the vocabulary (or a short output)
    vocab = llm.llm_engine.source.hf_config.vocab_size
    assert len(t) == 6 and all(type(x) is int and 0 <= x < vocab for x in t), (t, vocab)
    # and the sampled tokens' logprobs are finite: each the argmax (rank 1) of its position
    o = llm.generate([2, 3, 4], SamplingParams(temperature=1e-5, max_tokens=6, ignore_eos=True, logprobs=0),
                     use_tqdm=False)[0].outputs[0]
    assert o.token_ids == g and len(o.logprobs) == 6
    for tok, d in zip(o.token_ids, o.logprobs):
        assert d[tok].rank == 1 and math.isfinite(d[tok].logprob) and d[tok].logprob <= 0, d
    assert math.isfinite(o.cumulative_logprob)


def test_refused_config_frees_the_runner(tiny_ckpt, monkeypatch):
    from minivllm.engine.model_runner import ModelRunner

    shut = []
    original = ModelRunner.shutdown
    monkeypatch.setattr(ModelRunner, "shutdown", lambda self: shut.append(self) or original(self))
    with pytest.raises(ValueError, match="max_model_len=32"):
        make_llm(tiny_ckpt, num_kvcache_blocks=4, max_model_len=32)
    assert len(shut) == 1 and shut[0].kv_cache is None


def test_a_step_without_progress_raises_instead_of_hanging(tiny_ckpt, monkeypatch):
    from minivllm.engine.scheduler import SchedulerOutput

    llm = make_llm(tiny_ckpt)
    monkeypatch.setattr(llm.llm_engine.scheduler, "schedule", lambda: SchedulerOutput())
    with pytest.raises(RuntimeError, match="no progress"):
        llm.generate([1, 2, 3], greedy(2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the call's requests were aborted
