"""A decode step over the same sampled rows as the step before reuses that step's SamplingBatch
(``ModelRunner.sampling_batch``): only when nothing in it can have changed."""
from __future__ import annotations

import pytest

import minivllm.layers.sampler as sampler_mod
from helpers_engine import make_llm, prompts_of
from minivllm import SamplingParams


def _batches_per_step(engine, requests) -> list[list]:
    """Step ``requests`` ((id, prompt, params)) to the end; per step, the SamplingBatch objects
    the runner handed out."""
    runner = engine.runner
    real, seen = runner.sampling_batch, []
    runner.sampling_batch = lambda seqs, *hint: seen[-1].append(real(seqs, *hint)) or seen[-1][-1]
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    try:
        while engine.has_unfinished_requests():
            seen.append([])
            engine.step()
    finally:
        del runner.sampling_batch
    return [b for b in seen if b]


def test_an_unchanged_sampled_batch_reuses_its_settings_and_a_changed_one_does_not(tiny_ckpt):
    llm = make_llm(tiny_ckpt)  # kept: the engine shuts down with its LLM
    engine = llm.llm_engine
    a, b = prompts_of([6, 9], seed=5)
    steps = _batches_per_step(engine, [
        ("a", a, SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)),
        ("b", b, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=7, ignore_eos=True))])
    batches = [s[0] for s in steps]
    rows = [len(x.generators) for x in batches]
    assert rows == [2, 2, 2, 2, 1, 1, 1], rows  # both prefilled in one step; "a" ends after 4 tokens
    assert all(x is batches[0] for x in batches[:4])  # the same two sequences (and a's generator): reused
    assert batches[4] is not batches[3] and all(x is batches[4] for x in batches[4:])


@pytest.mark.parametrize("extra", [{"repetition_penalty": 1.3}, {"logit_bias": {5: 2.0}}],
                         ids=["penalty", "logits processor"])
def test_batches_that_read_per_step_token_lists_are_built_every_step(tiny_ckpt, extra):
    llm = make_llm(tiny_ckpt)  # kept: the engine shuts down with its LLM
    engine = llm.llm_engine
    steps = _batches_per_step(engine, [
        ("a", prompts_of([6], seed=5)[0], SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, **extra))])
    batches = [s[0] for s in steps]
    assert len(batches) == 4 and len({id(x) for x in batches}) == 4


def test_a_rolled_back_first_draw_leaves_no_generator_behind(tiny_ckpt, monkeypatch):
    """The first step of a seeded request makes its generator; interrupted after drawing from it,
    the step is rolled back (the request has no generator again). The step after must not reuse
    the rolled-back step's batch, whose generator has moved on: the tokens are an uninterrupted run's."""
    prompt = prompts_of([8], seed=2)[0]
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    reference = make_llm(tiny_ckpt).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    real, fired = sampler_mod.race_uniforms, []

    def draw_then_interrupt(*args, **kwargs):
        u = real(*args, **kwargs)
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt("injected after the draw")
        return u

    monkeypatch.setattr(sampler_mod, "race_uniforms", draw_then_interrupt)
    llm = make_llm(tiny_ckpt)  # kept: the engine shuts down with its LLM
    engine = llm.llm_engine
    engine.add_request("r", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            engine.check_invariants()
            continue
        final = next((o.outputs[0].token_ids for o in outputs if o.finished), final)
    assert fired and final == reference
