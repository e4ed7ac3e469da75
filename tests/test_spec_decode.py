"""Speculative decoding (n-gram proposer): exact greedy output, an unchanged distribution
at T > 0, and the engine's bookkeeping through chunking, preemption and prefix caching."""
from __future__ import annotations

import pytest

from helpers_engine import greedy, make_llm, prompts_of
from minivllm import SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import propose_ngram
from minivllm.spec_decode.verify import verify_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _repeating(seed: int, period: int, length: int) -> list[int]:
    base = prompts_of([period], seed=seed)[0]
    return (base * (length // period + 1))[:length]


def test_ngram_proposes_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 1, 4) == [4, 1, 2]
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]  # the latest occurrence wins
    assert propose_ngram([5, 6, 7], 2, 1, 3) == []
    assert propose_ngram([1, 2, 1, 2, 1], 4, 1, 2) == [2, 1, 2, 1]  # runs past the end: repeats with period 2
    assert propose_ngram([3, 1, 2, 3], 0, 1, 2) == []
    assert propose_ngram([4, 8, 4, 9, 8, 4], 3, 2, 2) == [9, 8, 4]  # (8, 4) at positions 1..2
    assert propose_ngram([4, 8, 4, 9, 7, 4], 3, 2, 2) == []         # (7, 4) never occurred before
    assert propose_ngram([4, 8, 4, 9, 7, 4], 3, 1, 2) == [9, 7, 4]  # falls back to n = 1


def test_ngram_continues_a_repeating_pattern_past_the_end():
    # A greedy model stuck on one token: the latest earlier 4-gram ends one token before the
    # end, and its continuation used to be that one token, whatever k (one draft per step).
    assert propose_ngram([3, 9, 7, 7, 7, 7, 7], 4, 1, 4) == [7, 7, 7, 7]
    assert propose_ngram([5, 1, 2, 3, 9, 1, 2, 3], 6, 1, 3) == [9, 1, 2, 3, 9, 1]  # period 4
    assert propose_ngram([5, 1, 2, 3, 9, 1, 2, 3], 2, 1, 3) == [9, 1]  # no more than k
    # drafts are what the context would be if it kept repeating from the match on
    seq = [4, 6, 8, 4, 6, 8, 4]
    assert propose_ngram(seq, 5, 1, 2) == [6, 8, 4, 6, 8]


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_targets_token():
    assert verify_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert verify_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert verify_greedy([5], [4, 2]) == [4]


@pytest.mark.parametrize("bad, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa'"),
    ({"method": "ngram"}, "num_speculative_tokens=None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "> prompt"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None"),
    ({"method": "draft_model", "model": "minivllm-tiny-draft", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "model": "minivllm-tiny-draft", "num_speculative_tokens": 2}, "takes no model"),
    ("ngram", "expected a dict"),
])
def test_bad_speculative_config_is_refused_naming_it(tiny_ckpt, bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(bad)
    with pytest.raises(ValueError, match=match):
        make_llm(tiny_ckpt, speculative_config=bad)


def test_a_config_without_a_method_gets_vllms_inferred_one():
    """{"model": ..., "num_speculative_tokens": k} (older vLLM configs) was refused as method=None; vLLM
    infers "ngram" from model="ngram" / "[ngram]" and "draft_model" from any other model."""
    draft = SpeculativeConfig.from_dict({"model": "minivllm-tiny-draft", "num_speculative_tokens": 2})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "minivllm-tiny-draft", 2)
    for spelled in ({"model": "ngram"}, {"model": "[ngram]"}, {"method": "[ngram]"}, {"method": "ngram", "model": "ngram"}):
        cfg = SpeculativeConfig.from_dict({**spelled, "num_speculative_tokens": 3})
        assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("ngram", None, 3), spelled
    with pytest.raises(ValueError, match="method=None"):  # neither: nothing to infer from
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2})


@pytest.mark.parametrize("given, lookup", [({}, (5, 5)), ({"prompt_lookup_min": 3}, (3, 3)),
                                           ({"prompt_lookup_max": 3}, (3, 3)),
                                           ({"prompt_lookup_max": None, "prompt_lookup_min": 2}, (2, 2)),
                                           ({"prompt_lookup_max": 4, "prompt_lookup_min": 2}, (4, 2))])
def test_ngram_sizes_default_as_in_vllm(given, lookup):
    # vLLM: both absent -> 5 and 5, one given -> both; minivllm took 4 and 1, so prompt_lookup_min=5 alone was
    # refused (5 > 4) and prompt_lookup_max=3 alone ran with min 1
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == lookup


def test_numpy_integers_are_taken_as_ints():
    import numpy as np

    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": np.int64(3),
                                       "prompt_lookup_max": np.int32(4)})
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max) == (3, 4) and type(cfg.num_speculative_tokens) is int


def test_more_drafts_than_a_sequence_holds_are_refused_naming_the_value(tiny_ckpt):
    # k = 10**6 was taken (ngram: verification steps as wide as the budget; a draft model: a bare OSError
    # "Cannot allocate memory" sizing its KV pool for it)
    for method in ({"method": "ngram"}, {"method": "draft_model", "model": "minivllm-tiny-draft"}):
        with pytest.raises(ValueError, match=r"num_speculative_tokens=1000000: .*max_model_len=64"):
            make_llm(tiny_ckpt, max_model_len=64, speculative_config={**method, "num_speculative_tokens": 10**6})
    make_llm(tiny_ckpt, max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 63})


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 12, "num_kvcache_blocks": 20, "max_num_seqs": 3},  # chunks, preemption
    {"block_size": 16, "num_kvcache_blocks": 64},
])
def test_greedy_output_is_identical_with_and_without_speculation(tiny_ckpt, engine_args):
    prompts = [_repeating(s, p, n) for s, p, n in ((1, 3, 20), (2, 5, 17), (3, 7, 30))] + prompts_of([9], seed=4)
    plain = make_llm(tiny_ckpt, **engine_args)
    spec = make_llm(tiny_ckpt, speculative_config=NGRAM, **engine_args)
    for max_tokens in (1, 5, 24):
        assert _tokens(spec.generate(prompts, greedy(max_tokens), use_tqdm=False)) == \
            _tokens(plain.generate(prompts, greedy(max_tokens), use_tqdm=False))
    # Drafts were proposed and some accepted, and the counts reached the step records.
    outs = spec.generate(prompts, greedy(24), use_tqdm=False)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0


def test_step_records_count_drafts_and_accepted_tokens(tiny_ckpt):
    llm = make_llm(tiny_ckpt, speculative_config=NGRAM)
    engine = llm.llm_engine
    engine.add_request("r", _repeating(5, 4, 24), greedy(16))
    drafts = accepted = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        rec = engine.last_step_record
        drafts += rec.num_draft_tokens
        accepted += rec.num_accepted_draft_tokens
        assert rec.num_accepted_draft_tokens <= rec.num_draft_tokens
    final = outs[0].metrics
    assert (final.num_draft_tokens, final.num_accepted_draft_tokens) == (drafts, accepted) and drafts > 0
    assert final.mean_accepted_length == 1 + accepted / final.num_spec_steps


def test_max_tokens_and_stop_tokens_hold_within_accepted_drafts(tiny_ckpt):
    prompt = _repeating(6, 3, 21)
    plain = make_llm(tiny_ckpt).generate(prompt, greedy(40), use_tqdm=False)[0].outputs[0].token_ids
    spec = make_llm(tiny_ckpt, speculative_config=NGRAM)
    for n in (1, 2, 3, 7):
        assert spec.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0].token_ids == plain[:n]
    stop = plain[5]
    out = spec.generate(prompt, greedy(40, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain[:plain.index(stop) + 1] and out.outputs[0].stop_reason == stop


def test_stop_strings_end_at_the_same_token_within_accepted_drafts():
    """A stop string completing in the text of a token followed, in the same step, by accepted drafts: the
    text was cut there but token_ids kept the drafts after it (here 4 extra tokens against the engine without
    speculation). The embedded model, whose code-like text repeats itself (drafts accepted), and stop strings
    taken from the plain run's own text at many places."""
    prompt = "value import cache the model for class data print"
    plain_llm, spec = make_llm("minivllm-tiny"), make_llm("minivllm-tiny", speculative_config=NGRAM)
    tok = plain_llm.get_tokenizer()
    ids = plain_llm.generate(prompt, greedy(60), use_tqdm=False)[0].outputs[0].token_ids
    stops = ["*, *, *, *, *, *"] + [s for k in range(2, 50, 4) if (s := tok.decode(ids[k:k + 2])).strip()]
    for stop in stops:
        for incl in (False, True):
            params = greedy(60, stop=[stop], include_stop_str_in_output=incl)
            want = plain_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            out = spec.generate(prompt, params, use_tqdm=False)[0]
            got, m = out.outputs[0], out.metrics
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                want.token_ids, want.text, want.finish_reason, want.stop_reason), (stop, incl)
            assert m.num_spec_steps + m.num_accepted_draft_tokens <= len(got.token_ids), (stop, m)
            streamed = list(spec.stream(prompt, params))
            assert [t for o in streamed for t in o.outputs[0].token_ids] == want.token_ids
    bm = spec.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # The metrics count the drafts kept: a streamed delta is one step's tokens, 1 + the drafts it accepted
    # (they counted the 4 accepted in a step the stop cut to 3 tokens). A prompt ending in the start of its
    # own continuation speculates at once.
    tok_base = tok.encode("The module provides")
    cont = plain_llm.generate([tok_base], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    for stop in (None, [" Base"], [" object."]):
        deltas = list(spec.stream([tok_base + cont + tok_base], greedy(30, stop=stop)))
        m = deltas[-1].metrics
        assert m.num_accepted_draft_tokens == sum(len(d.outputs[0].token_ids) - 1 for d in deltas), (stop, m)
    for llm in (plain_llm, spec):
        llm.shutdown()


def test_drafts_after_a_stop_token_or_the_length_are_not_counted_as_accepted():
    """A stop token id (or the eos, or max_tokens) met inside a step's accepted drafts ends the request
    there: the drafts after it are not emitted, and the metrics and the step record counted them (one
    accepted for a step that appended a single token, mean_accepted_length 2.0); stop strings already
    counted the kept ones."""
    spec = make_llm("minivllm-tiny", speculative_config=NGRAM)
    engine = spec.llm_engine
    tok = spec.get_tokenizer()
    base = tok.encode("The module provides")
    cont = make_llm("minivllm-tiny").generate([base], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    prompt = base + cont + base  # its own continuation follows: drafts accepted from the first step
    cases = [greedy(30, stop_token_ids=[t]) for t in dict.fromkeys(cont[1:12])] + [greedy(n) for n in (2, 3, 5)]
    total = 0
    for params in cases:
        engine.add_request("r", prompt, params)
        recorded = 0
        while engine.has_unfinished_requests():
            out = engine.step()[0]
            recorded += engine.last_step_record.num_accepted_draft_tokens
        deltas = list(spec.stream([prompt], params))  # every step emits 1 + the drafts it kept
        assert [t for d in deltas for t in d.outputs[0].token_ids] == out.outputs[0].token_ids
        kept = sum(len(d.outputs[0].token_ids) - 1 for d in deltas)
        assert deltas[-1].metrics.num_accepted_draft_tokens == kept == recorded, (params, deltas[-1].metrics)
        assert out.metrics.num_accepted_draft_tokens == recorded
        total += kept
    assert total > 0  # drafts were accepted at all
    spec.shutdown()


def test_seeded_sampling_with_speculation_is_reproducible(tiny_ckpt):
    spec = make_llm(tiny_ckpt, speculative_config=NGRAM)
    prompt = _repeating(7, 3, 18)
    params = SamplingParams(temperature=0.7, top_k=20, seed=11, max_tokens=20, ignore_eos=True)
    first = spec.generate([prompt, prompts_of([5], seed=8)[0]], params, use_tqdm=False)[0]
    again = spec.generate(prompt, params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


@pytest.mark.slow
def test_sampling_distribution_is_unchanged_by_speculation(tiny_ckpt):
    """Two-sample chi-square over the tokens of the speculative steps (the 2nd and 3rd
    generated tokens, joint), 2000 seeded runs each; T = 0.1 concentrates the random model's mass
    so that drafts are accepted often enough to matter."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    greedy_run = make_llm(tiny_ckpt).generate(_repeating(9, 3, 15), greedy(6), use_tqdm=False)[0]
    prompt = _repeating(9, 3, 15) + greedy_run.outputs[0].token_ids[:3]  # a context the model continues
    params = [SamplingParams(temperature=0.1, seed=s, max_tokens=3, ignore_eos=True) for s in range(2000)]
    plain = make_llm(tiny_ckpt, num_kvcache_blocks=4096)
    spec = make_llm(tiny_ckpt, num_kvcache_blocks=4096, speculative_config=NGRAM)
    a = Counter(tuple(t[1:]) for t in _tokens(plain.generate([prompt] * 2000, params, use_tqdm=False)))
    outs = spec.generate([prompt] * 2000, params, use_tqdm=False)
    b = Counter(tuple(t[1:]) for t in _tokens(outs))
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 50  # speculation really ran
    common = [k for k, _ in (a + b).most_common(12)]
    table = [[a[k] for k in common] + [2000 - sum(a[k] for k in common)],
             [b[k] for k in common] + [2000 - sum(b[k] for k in common)]]
    assert chi2_contingency(table)[1] > 0.001
