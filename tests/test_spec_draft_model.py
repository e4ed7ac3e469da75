"""Speculative decoding with a draft model: exact greedy output, an unchanged distribution at
T > 0, the draft's real q in rejection sampling, and the draft's own KV cache kept consistent
through chunking, preemption, prefix caching and rolled-back steps."""
from __future__ import annotations

import pytest

from helpers_engine import greedy, make_llm, prompts_of
from minivllm import SamplingParams
from minivllm.spec_decode.draft_cache import DraftCache, DraftEntry


def _draft(path, k=3):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def draft_ckpt(tiny_draft_ckpt):
    return tiny_draft_ckpt


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _prompts():
    return prompts_of([5, 9, 17, 3], seed=21)


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(tiny_ckpt, tmp_path):
    from helpers_models import make_hf_checkpoint

    other = make_hf_checkpoint(tmp_path, vocab_size=101, num_hidden_layers=1)
    with pytest.raises(ValueError, match="101 tokens, the target's 97"):
        make_llm(tiny_ckpt, speculative_config=_draft(other))
    with pytest.raises(FileNotFoundError, match="no such directory") as err:
        make_llm(tiny_ckpt, speculative_config=_draft(tmp_path / "missing"))
    assert "(the draft model)" in str(err.value) and "'minivllm-tiny-draft'" in str(err.value)


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 12, "num_kvcache_blocks": 20, "max_num_seqs": 3},  # chunks, preemption
    {"block_size": 16, "num_kvcache_blocks": 64},
])
def test_greedy_output_is_identical_with_and_without_a_draft_model(tiny_ckpt, draft_ckpt, engine_args):
    prompts = _prompts()
    plain = make_llm(tiny_ckpt, **engine_args)
    spec = make_llm(tiny_ckpt, speculative_config=_draft(draft_ckpt), **engine_args)
    for max_tokens in (1, 6, 30):
        assert _tokens(spec.generate(prompts, greedy(max_tokens), use_tqdm=False)) == \
            _tokens(plain.generate(prompts, greedy(max_tokens), use_tqdm=False))
        spec.llm_engine.check_invariants()
    outs = spec.generate(prompts, greedy(30), use_tqdm=False)
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0
    assert sum(o.metrics.num_draft_tokens - o.metrics.num_accepted_draft_tokens for o in outs) > 0  # and rejected


def test_the_target_as_its_own_draft_is_always_accepted_also_when_sampling(tiny_ckpt):
    """q = p: with the draft's real q, min(1, p/q) = 1 accepts every draft (a one-hot q would
    accept each only with probability p(d))."""
    spec = make_llm(tiny_ckpt, speculative_config=_draft(tiny_ckpt, k=4))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    outs = spec.generate(_prompts(), params, use_tqdm=False)
    assert all(o.metrics.num_draft_tokens > 0 for o in outs)
    assert [o.metrics.draft_acceptance_rate for o in outs] == [1.0] * len(outs)
    outs = spec.generate(_prompts(), greedy(24), use_tqdm=False)
    assert [o.metrics.draft_acceptance_rate for o in outs] == [1.0] * len(outs)


def test_seeded_sampling_with_a_draft_model_is_reproducible(tiny_ckpt, draft_ckpt):
    spec = make_llm(tiny_ckpt, speculative_config=_draft(draft_ckpt))
    prompt = _prompts()[2]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    first = spec.generate([prompt, _prompts()[0]], params, use_tqdm=False)[0]
    again = spec.generate(prompt, params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert first.metrics.num_draft_tokens > 0


def test_a_step_rolled_back_after_the_draft_ran_changes_nothing(tiny_ckpt, draft_ckpt, monkeypatch):
    """The draft's cache entries then hold tokens of a step that never happened; they are cut to
    what the sequence really holds at the next proposal."""
    from helpers_faults import Fault

    params = [greedy(12), SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)]
    ref = make_llm(tiny_ckpt, speculative_config=_draft(draft_ckpt)).generate(_prompts()[:2], params,
                                                                               use_tqdm=False)
    llm = make_llm(tiny_ckpt, speculative_config=_draft(draft_ckpt))
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(_prompts()[:2], params)):
        engine.add_request(str(i), prompt, p)
    final, faults = {}, 0
    with monkeypatch.context() as m:
        fault = Fault(m, "sampling", at=3)
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except KeyboardInterrupt:
                faults += 1
                engine.check_invariants()
                continue
            final.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    assert fault.fired and faults == 1
    assert [final["0"], final["1"]] == _tokens(ref)


@pytest.mark.parametrize("use_q", [True, False])
def test_rejection_sampling_with_the_drafts_q_emits_exactly_p(use_q):
    """A draft drawn from q and verified with that q (min(1, p/q), residual max(0, p - q)), or as a
    point mass (acceptance p(d), residual p without d: also exact, accepting less), emits a first
    token distributed as p. Chi-square goodness of fit over 20000 draws; q is far from p, so a
    residual that does not match the acceptance rule (e.g. p without d after min(1, p/q)) puts
    about 0.57 instead of 0.7 on token 0 and fails."""
    import torch
    from scipy.stats import chisquare

    from minivllm.spec_decode.verify import verify_sampled

    p = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.1, 0.7]])
    gen = torch.Generator().manual_seed(0)
    counts = [0] * 4
    accepted = 0
    for _ in range(20000):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        out = verify_sampled([d], p, gen, q if use_q else None)
        counts[out[0]] += 1
        accepted += len(out) == 2
    assert chisquare(counts, [20000 * x for x in p[0].tolist()]).pvalue > 0.001
    # min(1, p/q) accepts sum_x min(p, q) = 0.4; a point mass accepts sum_x q p = 0.16
    assert abs(accepted / 20000 - (0.4 if use_q else 0.16)) < 0.02


def test_draft_cache_entries_keep_only_the_prefix_the_sequence_still_has():
    class Seq:
        request_id, is_finished = "r", False

    e = DraftEntry(Seq(), tokens=[1, 2, 3, 4, 5])
    assert e.valid_prefix([1, 2, 3, 9, 5, 6], cap=5) == 3 and e.tokens == [1, 2, 3]
    e.tokens = [1, 2, 3, 4]
    assert e.valid_prefix([1, 2, 3, 4, 5], cap=4) == 4
    assert e.valid_prefix([1, 2], cap=1) == 1 and e.tokens == [1]


def test_draft_cache_evicts_least_recently_used_entries_of_other_requests():
    class Seq:
        def __init__(self, rid):
            self.request_id, self.is_finished = rid, False

    cache = DraftCache(num_blocks=4, block_size=4)
    a, b, c = Seq("a"), Seq("b"), Seq("c")
    ea = cache.entry(a, now=1)
    assert cache.reserve(ea, 8, keep={id(a)})
    eb = cache.entry(b, now=2)
    assert cache.reserve(eb, 8, keep={id(b)})
    ec = cache.entry(c, now=3)
    assert cache.reserve(ec, 5, keep={id(c), id(b)})  # a, the least recently used, is evicted
    assert id(a) not in cache.entries and len(ec.blocks) == 2
    assert not cache.reserve(ec, 20, keep={id(c), id(b)})  # b is in this batch: no room
    cache.check_invariants()
    b.is_finished = True
    cache.drop_finished()
    assert len(cache.free) == 2
    cache.check_invariants()


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory):
    """A draft with the target's vocabulary and nothing else in common (other random weights):
    its q is far from p, so rejections, and the residual max(0, p - q), matter."""
    from helpers_models import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("unrelated"), seed=1, num_hidden_layers=1)


@pytest.mark.slow
def test_sampling_distribution_is_unchanged_by_a_draft_model(tiny_ckpt, unrelated_draft):
    """Two-sample chi-square over the 2nd and 3rd generated tokens (joint), 2000 seeded runs
    each, with a draft unrelated to the target at T = 1 (the rule itself is checked sharply by
    ``test_rejection_sampling_with_the_drafts_q_emits_exactly_p``)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    prompt = _prompts()[2]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(2000)]
    plain = make_llm(tiny_ckpt, num_kvcache_blocks=4096)
    spec = make_llm(tiny_ckpt, num_kvcache_blocks=4096, speculative_config=_draft(unrelated_draft, k=2))
    a = Counter(tuple(t[1:]) for t in _tokens(plain.generate([prompt] * 2000, params, use_tqdm=False)))
    outs = spec.generate([prompt] * 2000, params, use_tqdm=False)
    b = Counter(tuple(t[1:]) for t in _tokens(outs))
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in outs)
    rejected = sum(o.metrics.num_draft_tokens for o in outs) - accepted
    assert accepted > 200 and rejected > 200  # both branches of rejection sampling ran
    common = [k for k, _ in (a + b).most_common(12)]
    table = [[a[k] for k in common] + [2000 - sum(a[k] for k in common)],
             [b[k] for k in common] + [2000 - sum(b[k] for k in common)]]
    assert chi2_contingency(table)[1] > 0.001


def test_the_embedded_draft_model_works_offline_with_its_default_k():
    """``{"method": "draft_model", "model": "minivllm-tiny-draft"}`` as the issue writes it: k comes
    from the draft's config.json (vLLM's rule), and greedy output is the embedded model's own."""
    from minivllm import LLM

    prompts = ["The list type", "Return the"]
    plain = LLM(num_kvcache_blocks=64, block_size=16)
    spec = LLM(num_kvcache_blocks=64, block_size=16,
               speculative_config={"method": "draft_model", "model": "minivllm-tiny-draft"})
    assert spec.llm_engine.speculative_config.num_speculative_tokens == 4
    outs = spec.generate(prompts, greedy(24), use_tqdm=False)
    assert _tokens(outs) == _tokens(plain.generate(prompts, greedy(24), use_tqdm=False))
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0


def test_a_proposal_cut_to_no_drafts_keeps_no_view_of_its_probabilities(tiny_ckpt, draft_ckpt):
    """A 5-token budget: the first decode takes 1 + 3 drafts, the next one's proposal is cut to
    none. Such an entry keeps ``draft_probs=None`` (a step record of plain decodes keeps the
    plan's entries until read, and a ``probs[:0]`` view would keep the whole proposal alive)."""
    spec = make_llm(tiny_ckpt, speculative_config=_draft(draft_ckpt), max_num_batched_tokens=5,
                    enable_chunked_prefill=True)
    engine = spec.llm_engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(_prompts()):
        engine.add_request(f"c{i}", p, params)
    seen, original = [], engine.scheduler.schedule

    def spy():
        plan = original()
        seen.extend(e for e in plan.scheduled if not e.is_prefill)
        return plan

    engine.scheduler.schedule = spy
    while engine.has_unfinished_requests():
        engine.step()
    assert any(e.draft_token_ids for e in seen) and any(not e.draft_token_ids for e in seen)
    assert all(e.draft_probs is None for e in seen if not e.draft_token_ids)


def test_a_draft_with_fewer_positions_than_the_target_stops_drafting_past_them(tiny_ckpt, tmp_path):
    """A draft trained on a shorter context (here 24 positions, the target 256) was taken, then the first
    sequence past 24 tokens failed the whole generate() call (IndexError from the draft's rotary table):
    past its positions a sequence now decodes without drafts, with the same greedy tokens."""
    from helpers_models import make_hf_checkpoint

    short = make_hf_checkpoint(tmp_path, num_hidden_layers=1, max_position_embeddings=24)
    prompts = prompts_of([5, 9, 17, 3], seed=21)
    want = _tokens(make_llm(tiny_ckpt).generate(prompts, greedy(40), use_tqdm=False))
    spec = make_llm(tiny_ckpt, speculative_config=_draft(short, k=4))
    outs = spec.generate(prompts, greedy(40), use_tqdm=False)
    assert _tokens(outs) == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # drafts while the sequences were short


def test_drafts_never_take_the_block_another_request_needs_for_its_next_token():
    """The draft check compared the drafts' blocks with the free blocks as they stood, before the requests
    planned later in the step had their own next token's block: A's three drafts took the pool's last free
    block and B, which fits without speculation, was preempted and recomputed (README: a request never
    preempts another for room to speculate)."""
    from minivllm import LLM

    runs = {}
    for name, spec in (("plain", None), ("draft", {"method": "draft_model", "model": "minivllm-tiny-draft",
                                                   "num_speculative_tokens": 3})):
        llm = LLM(num_kvcache_blocks=5, block_size=4, max_model_len=16, speculative_config=spec)
        try:
            engine = llm.llm_engine
            engine.add_request("A", [5, 6, 5, 6, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            engine.add_request("B", [9, 10, 11, 12] * 2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            preempted, drafts, final = [], 0, {}
            while engine.has_unfinished_requests():
                outs = engine.step()
                record = engine.last_step_record
                preempted += record.preempted
                drafts += record.num_draft_tokens
                final.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
            runs[name] = (preempted, drafts, final)
        finally:
            llm.shutdown()
    assert runs["plain"][0] == [] and runs["draft"][0] == []
    assert runs["draft"][1] > 0  # it still speculated where the pool had room
    assert runs["draft"][2] == runs["plain"][2]
