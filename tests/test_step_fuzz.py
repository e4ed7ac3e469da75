"""Randomised: an exception at a random point of a random step of a random workload
(chunked prefill, preemption, prefix hits, aborts, greedy and seeded sampling) changes
no request's tokens, and the block bookkeeping holds after every step."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_engine import make_llm, prompts_of
from helpers_faults import FAULT_NAMES, Fault
from minivllm import SamplingParams

PREFIXES = [prompts_of([8], seed=100 + i)[0] for i in range(2)] + [[7, 8, 9] * 4]  # the last repeats

request = st.tuples(
    st.integers(-1, 2),                 # shared prefix (two blocks, or a loop the n-gram proposer extends) or none
    st.integers(1, 14),                 # own tokens
    st.integers(1, 9),                  # max_tokens
    st.one_of(st.none(), st.integers(0, 2**16)),  # None: greedy, else the seed
    st.sampled_from(["final_only", "delta"]),
)
workload = st.lists(request, min_size=1, max_size=5)
fault = st.tuples(st.sampled_from(FAULT_NAMES), st.integers(0, 12),
                  st.sampled_from([KeyboardInterrupt, RuntimeError]))
aborts = st.lists(st.tuples(st.integers(0, 15), st.integers(0, 4)), max_size=2)


def _requests(spec, tag):
    out = []
    for i, (prefix, own, max_tokens, seed, kind) in enumerate(spec):
        prompt = (PREFIXES[prefix] if prefix >= 0 else []) + prompts_of([own], seed=1000 + i)[0]
        params = (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) if seed is None else
                  SamplingParams(temperature=0.9, top_k=20, seed=seed, max_tokens=max_tokens, ignore_eos=True))
        out.append((f"{tag}{i}", prompt, params, kind))
    return out


def _run(engine, requests, abort_at):
    """Step to the end; injected faults are swallowed; ``abort_at``: (after k committed
    steps, request index). Returns final (tokens, finish_reason) and joined deltas by index."""
    for rid, prompt, params, kind in requests:
        engine.add_request(rid, prompt, params, output_kind=kind)
    index = {rid: i for i, (rid, *_rest) in enumerate(requests)}
    final, deltas, committed = {}, {}, 0
    while engine.has_unfinished_requests():
        for k, which in abort_at:
            if k == committed and which < len(requests):
                while True:  # an abort is all or nothing too: retry after a fault
                    try:
                        engine.abort_request(requests[which][0])
                        break
                    except (KeyboardInterrupt, RuntimeError) as e:
                        assert "injected fault" in str(e), e
                        engine.check_invariants()
        try:
            outputs = engine.step()
        except (KeyboardInterrupt, RuntimeError) as e:
            assert "injected fault" in str(e), e
            engine.check_invariants()
            continue
        committed += 1
        engine.check_invariants()
        for out in outputs:
            i = index[out.request_id]
            deltas.setdefault(i, []).extend(out.outputs[0].token_ids)
            if out.finished:
                final[i] = out.outputs[0].finish_reason
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    return final, {i: deltas.get(i, []) for i in final}


@pytest.fixture(scope="module")
def fuzz_llm(tiny_ckpt):
    # A 14-block pool (preemption), a 12-token budget (chunked prefill), at most 3 sequences.
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=14, max_num_batched_tokens=12, max_num_seqs=3)
    yield llm
    llm.shutdown()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=workload, fault=fault, abort_at=aborts)
def test_a_random_fault_in_a_random_step_changes_nothing(fuzz_llm, monkeypatch, spec, fault, abort_at):
    engine = fuzz_llm.llm_engine
    for rid in list(engine.requests):  # left over by a failing example (hypothesis shrinks by rerunning)
        engine.abort_request(rid)
    engine.reset_prefix_cache()
    reference = _run(engine, _requests(spec, "ref"), abort_at)
    engine.reset_prefix_cache()
    name, at, exc = fault
    with monkeypatch.context() as m:
        Fault(m, name, at=at, exc=exc)
        got = _run(engine, _requests(spec, "got"), abort_at)
    assert got == reference


@pytest.fixture(scope="module")
def fuzz_spec_llm(tiny_ckpt):
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=14, max_num_batched_tokens=12, max_num_seqs=3,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    yield llm
    llm.shutdown()


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=workload, fault=fault, abort_at=aborts)
def test_a_random_fault_with_speculative_decoding_changes_nothing(fuzz_spec_llm, monkeypatch, spec, fault, abort_at):
    test_a_random_fault_in_a_random_step_changes_nothing.hypothesis.inner_test(
        fuzz_spec_llm, monkeypatch, spec, fault, abort_at)
