"""logprobs / prompt_logprobs against transformers' logits on the same weights (fp32):
log_softmax within 1e-4, vLLM's shapes (token id -> Logprob with rank and decoded text),
chunked prefill, the prefix cache and sampled (T > 0) requests."""
from __future__ import annotations

import math

import pytest
import torch

from helpers_engine import generate_spying_logits, make_llm, prompts_of
from helpers_models import load_hf_model, make_hf_checkpoint
from minivllm import EngineArgs, Logprob, SamplingParams

ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = make_hf_checkpoint(tmp_path_factory.mktemp("logprobs"), seed=7)
    # A budget of 8 tokens: a 13-token prompt is prefilled in two chunks.
    llm = make_llm(ckpt, block_size=4, max_num_batched_tokens=8, max_logprobs=-1)  # -1: the whole vocabulary below
    yield llm, load_hf_model(ckpt)
    llm.shutdown()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position, fp32 ``[len(ids), V]``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_position(entry: dict, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert token in entry and all(isinstance(v, Logprob) for v in entry.values())
    own = entry[token]
    assert abs(own.logprob - float(ref_row[token])) <= ATOL
    # rank: 1 + tokens strictly more likely (allow ties within the tolerance)
    lo = int((ref_row > ref_row[token] + ATOL).sum()) + 1
    hi = int((ref_row > ref_row[token] - ATOL).sum()) + 1
    assert lo <= own.rank <= hi
    top = ref_row.topk(k).values
    assert len(entry) in (k, k + 1)  # the top k, plus the chosen token when it is not among them
    tops = sorted(entry.values(), key=lambda v: v.rank)[:k]
    for v, ref in zip(tops, top.tolist(), strict=True):
        assert abs(v.logprob - ref) <= ATOL


def test_logprobs_and_prompt_logprobs_match_transformers(setup):
    llm, hf = setup
    prompt = prompts_of([13], seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    c = out.outputs[0]
    ref = reference(hf, prompt + c.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        check_position(out.prompt_logprobs[j], ref[j - 1], prompt[j], 2)
    assert len(c.logprobs) == len(c.token_ids) == 5
    for i, token in enumerate(c.token_ids):
        check_position(c.logprobs[i], ref[len(prompt) - 1 + i], token, 3)
    expected_sum = sum(float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(c.token_ids))
    assert abs(c.cumulative_logprob - expected_sum) <= 5 * ATOL
    assert c.logprobs[0][c.token_ids[0]].decoded_token == llm.tokenizer.decode([c.token_ids[0]])


def test_sampled_tokens_report_raw_logprobs(setup):
    llm, hf = setup
    prompt = prompts_of([6], seed=9)[0]
    params = SamplingParams(temperature=1.7, top_k=5, seed=4, max_tokens=6, ignore_eos=True, logprobs=0)
    c = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    ref = reference(hf, prompt + c.token_ids)
    for i, token in enumerate(c.token_ids):
        assert list(c.logprobs[i]) == [token]  # logprobs=0: the sampled token's own only
        assert abs(c.logprobs[i][token].logprob - float(ref[len(prompt) - 1 + i, token])) <= ATOL


def test_prompt_logprobs_bypass_the_prefix_cache(setup):
    llm, hf = setup
    prompt = prompts_of([14], seed=10)[0]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # cache its blocks
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    ref = reference(hf, prompt)
    for j in range(1, len(prompt)):
        assert list(out.prompt_logprobs[j]) == [prompt[j]]
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - float(ref[j - 1, prompt[j]])) <= ATOL
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_minus_one_is_the_whole_vocabulary(setup):
    """vLLM's logprobs=-1 / prompt_logprobs=-1: every token's (it was refused as < 0)."""
    llm, hf = setup
    prompt = prompts_of([5], seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    c, vocab = out.outputs[0], llm.llm_engine.vocab_size
    ref = reference(hf, prompt + c.token_ids)
    for i, token in enumerate(c.token_ids):
        check_position(c.logprobs[i], ref[len(prompt) - 1 + i], token, vocab)
    for j in range(1, len(prompt)):
        check_position(out.prompt_logprobs[j], ref[j - 1], prompt[j], vocab)
    with pytest.raises(ValueError, match=r"logprobs=-2: .*-1 \(all\)"):
        SamplingParams(logprobs=-2)


def test_max_logprobs_caps_requests_as_vllm(tmp_path):
    """vLLM's max_logprobs (default 20, -1 no cap): a request asking for more sample or prompt
    logprobs is refused when added, naming its value, and the engine serves the others (it was
    accepted and ignored)."""
    ckpt = make_hf_checkpoint(tmp_path, seed=7)
    llm = make_llm(ckpt, block_size=4)
    try:
        vocab = llm.llm_engine.vocab_size
        assert vocab > 20
        for kw, kind, asked in (({"logprobs": 21}, "sample", 21), ({"prompt_logprobs": 21}, "prompt", 21),
                                ({"logprobs": -1}, "sample", vocab), ({"prompt_logprobs": -1}, "prompt", vocab)):
            name, value = next(iter(kw.items()))
            with pytest.raises(ValueError, match=rf"{name}={value}: requested {kind} logprobs of {asked}, more than "
                                                 rf"the engine's max_logprobs=20"):
                llm.generate([1, 2, 3], SamplingParams(max_tokens=1, **kw), use_tqdm=False)
        out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, logprobs=20, prompt_logprobs=20),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].logprobs[0]) in (20, 21) and len(out.prompt_logprobs[1]) in (20, 21)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()
    small = make_llm(ckpt, block_size=4, max_logprobs=0)
    try:
        c = small.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)[0]
        assert len(c.outputs[0].logprobs[0]) == 1  # the sampled token's own: 0 is within any cap
        with pytest.raises(ValueError, match="logprobs=1: .*max_logprobs=0"):
            small.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=1), use_tqdm=False)
    finally:
        small.shutdown()
    for bad in (-2, True, 2.0, "20"):
        with pytest.raises(ValueError, match=rf"max_logprobs={bad!r}: must be an int >= 0, or -1"):
            EngineArgs(max_logprobs=bad)


def test_detokenize_false_leaves_decoded_tokens_out(setup):
    llm, _ = setup
    c = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, logprobs=1, detokenize=False),
                     use_tqdm=False)[0].outputs[0]
    assert all(v.decoded_token is None for d in c.logprobs for v in d.values())
    assert all(math.isfinite(v.logprob) and v.logprob <= 0 for d in c.logprobs for v in d.values())


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(tiny_ckpt, mode):
    llm = make_llm(tiny_ckpt, logprobs_mode=mode)
    prompt = prompts_of([6], seed=12)[0]
    params = SamplingParams(temperature=2.0, top_k=3, seed=2, max_tokens=4, ignore_eos=True, logprobs=5,
                            logit_bias={7: 1.5})
    c, rows = generate_spying_logits(llm, prompt, params)
    for i, raw in enumerate(rows):
        biased = raw.clone()
        biased[7] += 1.5
        scaled = biased / 2.0
        kept = scaled.topk(3).indices
        processed = torch.full_like(scaled, float("-inf"))
        processed[kept] = scaled[kept]
        expected = {"raw_logits": raw, "processed_logprobs": processed.log_softmax(-1),
                    "processed_logits": processed}[mode]
        got = c.logprobs[i]
        for t, v in got.items():
            assert v.logprob == pytest.approx(float(expected[t]), abs=ATOL) or (
                math.isinf(v.logprob) and math.isinf(float(expected[t]))), (mode, i, t)
        if mode.startswith("processed"):
            assert sum(math.isfinite(v.logprob) for v in got.values()) == 3  # top-k=3 kept
            assert c.token_ids[i] in kept.tolist()
    llm.shutdown()


def test_logprobs_mode_is_validated(tiny_ckpt):
    with pytest.raises(ValueError, match="logprobs_mode='processed'"):
        make_llm(tiny_ckpt, logprobs_mode="processed")


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits", "processed_logprobs"])
def test_prompt_logprobs_come_from_the_raw_logits_as_the_mode_says(tiny_ckpt, mode):
    # vLLM 0.34's runner (v1/worker/gpu/sample/prompt_logprob.py) reports a prompt position's raw logits in the
    # *_logits modes and their log-probabilities otherwise (no processing applies to prompt positions); here
    # they were log-probabilities in every mode, as an older vLLM runner computed them
    prompt = prompts_of([9], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    want = make_llm(tiny_ckpt).generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    got = make_llm(tiny_ckpt, logprobs_mode=mode).generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(want) == len(prompt)
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys() and all(g[t].rank == w[t].rank for t in g)
        shift = {t: g[t].logprob - w[t].logprob for t in g}  # logits minus log-probabilities: the log-sum-exp
        if mode.endswith("logits"):
            assert max(shift.values()) - min(shift.values()) < 1e-4 and abs(next(iter(shift.values()))) > 1e-3
        else:
            assert all(abs(s) < 1e-6 for s in shift.values())


def test_tied_tokens_share_the_lower_rank_as_in_vllm():
    # rank was 1 + the tokens strictly more likely, and the chosen token's own entry won over its top-k one:
    # logits [1, 1, 0] choosing token 1 gave {1: rank 1, 0: rank 1}; vLLM counts the tokens at least as likely
    # (rank 2) and lets the top-k entries fill the dict last, {1: rank 2, 0: rank 1}
    from minivllm.engine.output_processor import logprob_dicts
    from minivllm.layers.logprobs import logprob_entries

    logits = torch.tensor([[1.0, 1.0, 0.0], [3.0, 1.0, 2.0]])
    entries = logprob_entries(logits, torch.tensor([1, 2]), [2, 1])
    assert [e[2] for e in entries] == [[2, 1, 2], [2, 1]]  # chosen token's rank first, then top-k 1..k
    d = logprob_dicts(entries, None)
    assert {t: v.rank for t, v in d[0].items()} == {1: 2, 0: 1} and list(d[0]) == [1, 0]
    assert {t: v.rank for t, v in d[1].items()} == {2: 2, 0: 1}


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_logprobs_are_minus_inf_only_where_a_filter_removed_the_token(tiny_ckpt, mode):
    # the mask was `probs == 0`: a token whose fp32 probability only underflowed (a large logit_bias, a low
    # temperature) read -inf, and a greedy request's alternatives changed when a sampled request joined its batch
    llm = make_llm(tiny_ckpt, logprobs_mode=mode, max_logprobs=-1)
    prompt = prompts_of([6], seed=12)[0]
    greedy = SamplingParams(temperature=0, max_tokens=1, logprobs=3, logit_bias={7: 150.0})
    alone = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].logprobs[0]
    beside = llm.generate([prompt, prompt[:3]], [greedy, SamplingParams(temperature=1.0, seed=1, max_tokens=1)],
                          use_tqdm=False)[0].outputs[0].logprobs[0]
    assert {t: v.logprob for t, v in alone.items()} == pytest.approx({t: v.logprob for t, v in beside.items()})
    assert all(math.isfinite(v.logprob) for v in alone.values())
    cold = SamplingParams(temperature=0.01, seed=1, max_tokens=1, logprobs=12)  # no top-k, top-p or min-p
    assert all(math.isfinite(v.logprob) for v in llm.generate([prompt], cold, use_tqdm=False)[0].outputs[0].logprobs[0].values())
    kept = SamplingParams(temperature=1.0, seed=1, max_tokens=1, logprobs=20, top_k=5, min_p=0.01)
    got = llm.generate([prompt], kept, use_tqdm=False)[0].outputs[0].logprobs[0]
    assert sum(math.isfinite(v.logprob) for v in got.values()) <= 5  # what the filters removed is still -inf
    llm.shutdown()
