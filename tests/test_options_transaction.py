"""Steps stay all-or-nothing for requests using vLLM's extra options: a fault anywhere in
a step (the classic points and those only these options reach) changes no request's tokens,
logprobs or samples."""
from __future__ import annotations

import pytest

from helpers_engine import make_llm, prompts_of
from helpers_faults import FAULT_NAMES, OPTION_FAULT_NAMES, Fault
from minivllm import SamplingParams


def _requests(tag: str):
    prefix = prompts_of([8], seed=11)[0]
    prompts = [prefix + p for p in prompts_of([3, 14], seed=5)] + prompts_of([20], seed=6)
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1, min_tokens=2),
        SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True, n=2, presence_penalty=0.4,
                       frequency_penalty=0.2, logprobs=0),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={4: 2.0}, bad_words=["a"]),
    ]
    return [(f"{tag}{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def _drive(engine, requests) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, output_kind="final_only")
    final = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            engine.check_invariants()
            continue
        engine.check_invariants()
        for out in outputs:
            final[out.request_id[1:]] = (
                [(c.token_ids, c.finish_reason, [sorted(d) for d in c.logprobs or []]) for c in out.outputs],
                [None if d is None else sorted(d) for d in out.prompt_logprobs or []])
    return final


@pytest.mark.parametrize("point", FAULT_NAMES + OPTION_FAULT_NAMES)
def test_a_fault_anywhere_leaves_option_requests_unchanged(tiny_ckpt, monkeypatch, point):
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=14, max_num_batched_tokens=12, max_num_seqs=3)
    reference = _drive(llm.llm_engine, _requests("a"))
    fired = 0
    for at in (0, 3):
        llm.llm_engine.reset_prefix_cache()
        with monkeypatch.context() as m:
            fault = Fault(m, point, at=at)
            got = _drive(llm.llm_engine, _requests(f"{at}"))
        fired += fault.fired
        assert got == reference, f"fault in {point} at call {at}"
    assert fired >= 1
    llm.shutdown()
