"""A rolled-back step leaves every live sequence exactly as it was: every field, every list's
contents, every metric (TTFT and ITL timestamps included), the generator states and the queues,
compared field by field before the step and after its exception. (The outcome tests in
test_step_transaction.py compare tokens; this one catches a field a rollback forgot.)"""
from __future__ import annotations

import pytest

from helpers_engine import make_llm, prompts_of
from helpers_faults import FAULT_NAMES, OPTION_FAULT_NAMES, Fault
from minivllm import SamplingParams


def _plain(value):
    return list(value) if isinstance(value, list) else value


def _fingerprint(engine) -> dict:
    """Everything a step may change about the live sequences and the queues, as plain values."""
    state = {"running": [s.request_id for s in engine.scheduler.running],
             "waiting": [s.request_id for s in engine.scheduler.waiting]}
    for seq in engine.scheduler.live_sequences():
        fields = {k: _plain(v) for k, v in vars(seq).items() if k not in ("metrics", "generator")}
        fields["metrics"] = {k: _plain(v) for k, v in vars(seq.metrics).items()}
        fields["generator"] = None if seq.generator is None else bytes(seq.generator.get_state().numpy())
        state[seq.request_id] = fields
    return state


def _requests(tag: str):
    prefix = prompts_of([8], seed=21)[0]
    prompts = [prefix + p for p in prompts_of([3, 14], seed=7)] + [[5, 6, 7] * 6] + prompts_of([5], seed=8)
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.9, seed=5, max_tokens=9, ignore_eos=True, n=2, presence_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # repeats: n-gram drafts
        SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, stop=["a"], logit_bias={4: 2.0}),  # unseeded
    ]
    return [(f"{tag}{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
@pytest.mark.parametrize("point", FAULT_NAMES + OPTION_FAULT_NAMES)
def test_a_faulted_step_restores_every_sequence_field(tiny_ckpt, monkeypatch, point, spec):
    # Chunked prefill (budget 12), a shared prefix, a small pool (preemption), n = 2; with
    # n-gram speculation, decodes carry drafts (the prompts repeat, so the proposer finds some).
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=14, max_num_batched_tokens=12, max_num_seqs=3,
                   speculative_config=spec)
    engine = llm.llm_engine
    checked = drafts = 0
    for at in (0, 2, 5):
        with monkeypatch.context() as m:
            Fault(m, point, at=at)
            for rid, prompt, params in _requests(f"{at}-"):
                engine.add_request(rid, prompt, params, output_kind="final_only")
            while engine.has_unfinished_requests():
                before = _fingerprint(engine)
                try:
                    engine.step()
                    drafts += engine.last_step_record.num_draft_tokens
                except KeyboardInterrupt:
                    assert _fingerprint(engine) == before, f"fault in {point} at call {at}"
                    engine.check_invariants()
                    checked += 1
        engine.reset_prefix_cache()
    assert checked >= 1, f"no fault fired in {point}"
    assert drafts > 0 or spec is None, "no step carried drafts"
    llm.shutdown()
