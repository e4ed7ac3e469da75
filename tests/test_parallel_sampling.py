"""SamplingParams.n > 1: n independent samples of one prompt, seeded deterministically,
prompt blocks shared through the prefix cache, in every output kind."""
from __future__ import annotations

import pytest

from helpers_engine import make_llm, prompts_of
from minivllm import SamplingParams

PROMPT = prompts_of([18], seed=31)[0]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    llm = make_llm(tiny_ckpt, block_size=4)
    yield llm
    llm.shutdown()


def S(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, **kw})


def completions(out) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


def test_n_samples_are_distinct_and_seeded_replay_is_identical(llm):
    out = llm.generate(PROMPT, S(n=3), use_tqdm=False)[0]
    got = completions(out)
    assert len(got) == 3 and len({tuple(t) for t in got}) == 3 and out.finished
    seeded = completions(llm.generate(PROMPT, S(n=3, seed=5), use_tqdm=False)[0])
    assert seeded == completions(llm.generate(PROMPT, S(n=3, seed=5), use_tqdm=False)[0])
    # sample i is the request seeded with seed + i
    singles = [completions(llm.generate(PROMPT, S(seed=5 + i), use_tqdm=False)[0])[0] for i in range(3)]
    assert seeded == singles


def test_siblings_reuse_the_leaders_prompt_blocks(llm):
    llm.llm_engine.reset_prefix_cache()
    prompt = prompts_of([18], seed=32)[0]
    engine = llm.llm_engine
    engine.add_request("p", prompt, S(n=3, seed=1), output_kind="final_only")
    hits = []
    while engine.has_unfinished_requests():
        engine.step()
        hits.append(engine.last_step_record.prefix_cache_hit_tokens)
    # the leader computes 18 prompt tokens; each sibling then hits the 4 full blocks (16 tokens)
    assert sum(hits) == 2 * 16


def test_siblings_waiting_for_their_leader_do_not_hold_back_the_prompts_behind_them(llm):
    """A sibling sample waits for its leader's prompt blocks; the admission loop stopped at it, so with n > 1
    every step admitted one prompt's leader: 8 prompts at n=4 took 8 steps of prefill (32 prompts: 33 of
    40 steps), where n=1 takes one. Now the held siblings are passed over: the leaders go in one step, their
    siblings in the next, and every sample is the one its seed gives alone."""
    llm.llm_engine.reset_prefix_cache()
    prompts = prompts_of([9, 13, 6, 17, 11, 8, 14, 10], seed=33)
    params = S(n=4, seed=7, max_tokens=5)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params, output_kind="final_only")
    prefill_steps, final = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = completions(out)
        prefill_steps += engine.last_step_record.num_prefill_tokens > 0
    assert prefill_steps == 2
    alone = [completions(llm.generate(p, params, use_tqdm=False)[0]) for p in prompts]
    assert [final[f"q{i}"] for i in range(len(prompts))] == alone


def test_step_returns_the_parent(llm):
    """Cumulative outputs (SamplingParams' default), as vLLM streams them: under the parent's id, one
    output per sample that advanced, holding that sample's whole completion so far (it merged every
    sample's into one output per step, repeating finished ones)."""
    engine = llm.llm_engine
    engine.add_request("g", PROMPT, S(max_tokens=4, n=2, seed=3))
    seen, latest = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "g" and len(out.outputs) == 1
            c = out.outputs[0]
            assert c.token_ids[:len(latest.get(c.index, []))] == latest.get(c.index, [])  # cumulative
            latest[c.index] = c.token_ids
            seen.append(out)
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    assert sorted(latest) == [0, 1] and [len(latest[i]) for i in (0, 1)] == [4, 4]
    assert len(seen) == 8  # 4 tokens of each sample, none repeated once finished
    replay = completions(llm.generate(PROMPT, S(max_tokens=4, n=2, seed=3), use_tqdm=False)[0])
    assert replay == [latest[0], latest[1]]


def test_final_output_carries_the_last_finished_samples_metrics(llm, monkeypatch):
    """The merged final-only output took sample 0's metrics and cache hits, though the other samples
    start a step later (after sample 0's prefill) and finish last: e2e understated, hits hidden."""
    from minivllm.engine import parallel_sampling

    children = []
    absorb = parallel_sampling.ParentRequest.absorb

    def spy(self, index, out, undo):
        children.append((index, out))
        return absorb(self, index, out, undo)

    monkeypatch.setattr(parallel_sampling.ParentRequest, "absorb", spy)
    llm.llm_engine.reset_prefix_cache()
    final = llm.generate(prompts_of([18], seed=33)[0], S(n=3, seed=2), use_tqdm=False)[0]
    last_index, last = [(i, o) for i, o in children if o.finished][-1]
    assert last_index != 0 and final.metrics is last.metrics
    assert final.num_cached_tokens == last.num_cached_tokens > 0


def test_progress_bar_counts_samples_as_vllms_does(llm):
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.done = total, 0
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            pass

    llm.generate([PROMPT, PROMPT], [S(n=3), S()], use_tqdm=Bar)
    assert (bars[0].total, bars[0].done) == (4, 4)


def test_greedy_n_above_one_is_refused_as_vllm_does():
    """n identical greedy completions are a mistake vLLM refuses ("n must be 1 when using greedy
    sampling"); minivllm used to return them. Refused at construction and on assignment, where the
    old value is kept."""
    with pytest.raises(ValueError, match=r"SamplingParams\.n=2: must be 1 when temperature=0"):
        SamplingParams(temperature=0, n=2)
    params = SamplingParams(temperature=0.8, n=2)
    with pytest.raises(ValueError, match=r"SamplingParams\.n=2"):
        params.temperature = 0
    assert params.temperature == 0.8 and params.n == 2


def test_streaming_deltas_join_to_the_final_completions(llm):
    params = S(n=3, seed=9, logprobs=1, stop=["e"])
    final = llm.generate(PROMPT, params, use_tqdm=False)[0]
    joined: dict[int, list] = {}
    for d in llm.stream(PROMPT, params):
        assert len(d.outputs) == 1
        c = d.outputs[0]
        j = joined.setdefault(c.index, [[], "", []])
        j[0] += c.token_ids
        j[1] += c.text
        j[2] += c.logprobs
    assert [joined[i] for i in range(3)] == [[c.token_ids, c.text, c.logprobs] for c in final.outputs]


def test_aborting_a_parent_aborts_every_sample(llm):
    stream = llm.stream(PROMPT, S(n=3, max_tokens=50))
    next(stream)
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests() and not llm.llm_engine.parents.parents


def test_n_is_validated():
    with pytest.raises(ValueError, match=r"SamplingParams\.n=0"):
        SamplingParams(n=0)


def test_an_unbounded_n_is_refused_not_made(llm):
    """n=2**63 was accepted, and add_request made child requests until memory ran out (an API fuzz)."""
    from minivllm.sampling_params import MAX_N

    with pytest.raises(ValueError, match=r"SamplingParams\.n=9223372036854775808: must be an int from 1 to 65,536"):
        SamplingParams(n=2**63, temperature=1.0)
    params = S(n=2)
    with pytest.raises(ValueError, match=r"SamplingParams\.n=65537"):
        params.n = MAX_N + 1  # re-checked on assignment, as every field
    assert S(n=MAX_N).n == MAX_N


def test_an_abort_interrupted_in_the_merge_still_forgets_the_parent(llm, monkeypatch):
    """An abort of an n > 1 request interrupted while merging its second sample's output: before
    the fix the first sample was already gone, the retry never merged it, and the parent stayed
    registered for ever (found by the step fuzz)."""
    from helpers_faults import Fault

    engine = llm.llm_engine
    engine.add_request("p", PROMPT, S(n=2, max_tokens=20))
    engine.step()
    with monkeypatch.context() as m:
        Fault(m, "parallel sampling merge", at=1, exc=KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            engine.abort_request("p")
        engine.check_invariants()
        out = engine.abort_request("p")  # the caller retries, as after Ctrl-C
    assert out is not None and out.finished and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert not engine.requests and "p" not in engine.parents
    engine.add_request("p", PROMPT, S(n=2, max_tokens=2))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()


def test_an_abort_of_the_samples_interrupted_between_them_aborts_none(llm, monkeypatch):
    """Each sample of an n > 1 request was aborted in a transaction of its own: an interrupt between
    them left the first aborted and the second running while abort_request raised (found by an API
    fuzz). Now all go together or none: the request runs on and ends as an uninterrupted one."""
    from helpers_faults import Fault

    engine, params = llm.llm_engine, S(n=2, seed=7, temperature=0.8, max_tokens=6)
    want = completions(llm.generate(PROMPT, params, use_tqdm=False)[0])
    engine.add_request("p", PROMPT, params)
    engine.step()
    with monkeypatch.context() as m:
        Fault(m, "stop checks", at=1, exc=KeyboardInterrupt)  # Scheduler.finish of the second sample
        with pytest.raises(KeyboardInterrupt):
            engine.abort_request("p")
    engine.check_invariants()
    assert sorted(engine.requests) == ["0_p", "1_p"] and "p" in engine.parents
    got = {}
    while engine.has_unfinished_requests():  # (a step's output holds the samples that changed)
        got.update((c.index, c.token_ids) for o in engine.step() for c in o.outputs if c.finish_reason)
    assert [got[i] for i in sorted(got)] == want and not engine.parents.parents


def test_an_abort_interrupted_while_forgetting_the_request_leaves_it_unfinished(llm, monkeypatch):
    """The request table's entry was dropped after the abort's transaction committed: an interrupt
    there left a finished request in the table (invariants broken, its id refused as in use)."""
    from minivllm.engine.output_processor import OutputProcessor

    engine = llm.llm_engine
    engine.add_request("a", PROMPT, S(max_tokens=8))
    engine.step()
    real = OutputProcessor.drop

    def interrupted(self, request_id):
        monkeypatch.setattr(OutputProcessor, "drop", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(OutputProcessor, "drop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.abort_request("a")
    engine.check_invariants()  # the abort undone whole: still running
    assert list(engine.requests) == ["a"] and engine.has_unfinished_requests()
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort" and not engine.requests
    engine.check_invariants()


def test_a_child_seed_of_minus_one_stays_a_seed(llm):
    """seed=-2, n=3: the second completion's seed is -1, which the vLLM spelling rule ("-1: no
    seed") turned into None when the child's parameters were rebuilt, so it did not replay."""
    from minivllm.engine.parallel_sampling import child_params

    params = S(n=3, seed=-2, max_tokens=6)
    assert [child_params(params, i).seed for i in range(3)] == [-2, -1, 0]
    first = completions(llm.generate(PROMPT, params, use_tqdm=False)[0])
    assert first == completions(llm.generate(PROMPT, params, use_tqdm=False)[0])


def test_a_finished_childs_id_stays_taken_while_its_parent_runs(llm):
    """A new request under the id of a finished child was accepted, then merged into the parent
    as that sample (replacing it) and never given an output of its own."""
    engine = llm.llm_engine
    stops = list(range(0, 97, 3))  # a third of the vocabulary: samples end at different steps
    for seed in range(20):
        engine.add_request("x", PROMPT, S(n=2, seed=seed, max_tokens=30, stop_token_ids=stops, ignore_eos=False))
        while "0_x" in engine.requests and "1_x" in engine.requests:
            engine.step()
        if "0_x" not in engine.requests and "1_x" in engine.requests:
            break
        engine.abort_request("x")
    else:
        pytest.fail("no seed in 0..19 ended sample 0 before sample 1")
    with pytest.raises(ValueError, match="'0_x' is already in use"):
        engine.add_request("0_x", PROMPT, S(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("0_x", PROMPT, S(max_tokens=2))  # free again once the parent finished
    engine.abort_request("0_x")


@pytest.mark.parametrize("kind,aggregate", [("delta", True), ("cumulative", False)])
def test_request_output_add_rebuilds_the_final_output_as_vllms_does(llm, kind, aggregate):
    """``RequestOutput.add(next_output, aggregate)`` (vLLM's) was missing: scripts that fold a stream
    of outputs into one raised AttributeError."""
    engine = llm.llm_engine
    params = S(n=2, seed=7, max_tokens=6, logprobs=1)
    engine.add_request("acc", PROMPT, params, output_kind=kind)
    acc = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if acc is None:
                acc = out
            else:
                acc.add(out, aggregate=aggregate)
    final = llm.generate(PROMPT, params, use_tqdm=False)[0]
    acc.outputs.sort(key=lambda c: c.index)
    assert acc.finished and completions(acc) == completions(final)
    assert [c.text for c in acc.outputs] == [c.text for c in final.outputs]
    assert [len(c.logprobs) for c in acc.outputs] == [6, 6]
    assert [c.finish_reason for c in acc.outputs] == ["length", "length"]
    assert [c.cumulative_logprob for c in acc.outputs] == pytest.approx([c.cumulative_logprob for c in final.outputs])


def test_abort_returns_every_sample_though_outputs_stream_one_at_a_time(llm):
    """Cumulative outputs stream one sample at a time, so the abort's last merged output held only the
    last sample: a caller without a sink never saw the others' abort."""
    engine = llm.llm_engine
    engine.add_request("ab", PROMPT, S(n=3, seed=5, max_tokens=20))
    for _ in range(3):
        engine.step()
    out = engine.abort_request("ab")
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) >= 1 for c in out.outputs)


def test_final_output_keeps_a_samples_error():
    """The final-only merged output took the last-finishing sample's error field: None when an earlier
    sample had failed, the explanation of its finish_reason "error" lost."""
    from minivllm.engine import parallel_sampling
    from minivllm.outputs import CompletionOutput, RequestOutput

    parent = parallel_sampling.ParentRequest("e", 2, parallel_sampling.OutputKind.FINAL_ONLY)

    def child(i, reason, error):
        return RequestOutput(f"{i}_e", None, [1], None, [CompletionOutput(0, "", [], finish_reason=reason)], True,
                             error=error)

    assert parent.absorb(0, child(0, "error", "no token could be sampled"), None) is None
    merged = parent.absorb(1, child(1, "length", None), None)
    assert [c.finish_reason for c in merged.outputs] == ["error", "length"]
    assert merged.error == "no token could be sampled"


def test_an_abort_interrupted_while_snapshotting_its_samples_leaves_no_undo_log_attached(llm, monkeypatch):
    """The transaction attached its undo log before snapshotting the samples: an interrupt there (a long
    loop for a large n) left the log attached to the scheduler, recording every later change (a review)."""
    import minivllm.engine.undo as undo_mod

    engine = llm.llm_engine
    engine.add_request("p", PROMPT, S(n=3, max_tokens=6))
    engine.step()
    real, calls = undo_mod.UndoLog.touch, []

    def touch(self, seq):
        calls.append(seq)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, seq)

    monkeypatch.setattr(undo_mod.UndoLog, "touch", touch)
    with pytest.raises(KeyboardInterrupt):
        engine.abort_request("p")
    monkeypatch.setattr(undo_mod.UndoLog, "touch", real)
    bm = engine.scheduler.block_manager
    assert bm.undo is None and engine.scheduler.undo is None and engine.output_processor.undo is None
    engine.check_invariants()
    assert sorted(engine.requests) == ["0_p", "1_p", "2_p"]
    assert engine.abort_request("p").finished and not engine.requests
