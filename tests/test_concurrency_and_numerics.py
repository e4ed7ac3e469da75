"""One LLM shared by threads (a widget in the background, a cell in the foreground), and
requests whose logits go non-finite."""
from __future__ import annotations

import threading

import pytest
import torch

from helpers_engine import greedy, make_llm, prompts_of
from minivllm import SamplingParams
from minivllm.engine.model_runner import ModelRunner


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _in_threads(*calls, timeout=120):
    results, errors = [None] * len(calls), []

    def runner(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=runner, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert not errors, errors
    return results


def test_two_threads_generate_on_one_llm(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    a, b = prompts_of([5 + i for i in range(12)], seed=1), prompts_of([9 + i for i in range(12)], seed=2)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    ref_a = _tokens(llm.generate(a, greedy(12), use_tqdm=False))
    ref_b = _tokens(llm.generate(b, seeded, use_tqdm=False))
    got_a, got_b = _in_threads(lambda: _tokens(llm.generate(a, greedy(12), use_tqdm=False)),
                               lambda: _tokens(llm.generate(b, seeded, use_tqdm=False)))
    assert got_a == ref_a and got_b == ref_b
    llm.llm_engine.check_invariants()


def test_generate_and_stream_in_two_threads(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    a, b = prompts_of([6] * 12, seed=3), prompts_of([11, 4, 8], seed=4)
    ref_a = _tokens(llm.generate(a, greedy(12), use_tqdm=False))
    ref_b = _tokens(llm.generate(b, greedy(12), use_tqdm=False))

    def streamed():
        joined = {}
        for delta in llm.stream(b, greedy(12)):
            joined.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        return [joined[k] for k in sorted(joined, key=int)]

    got_a, got_b = _in_threads(lambda: _tokens(llm.generate(a, greedy(12), use_tqdm=False)), streamed)
    assert got_a == ref_a and got_b == ref_b


def test_a_request_aborted_by_another_caller_ends_the_waiting_call(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    started, aborted = threading.Event(), threading.Event()
    original = llm._step

    def step():  # generate's first step waits for the aborts (outside the engine's lock, which they take)
        started.set()
        aborted.wait(30)
        return original()

    llm._step = step

    def abort_all():
        started.wait(30)
        for rid in list(engine.requests):
            engine.abort_request(rid)
        aborted.set()

    outs, _ = _in_threads(lambda: llm.generate(prompts_of([5, 6], seed=5), greedy(40), use_tqdm=False),
                          abort_all)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort"]


def _waits_for_a_step(engine, call) -> None:
    """``call`` in another thread waits while a step holds the engine's lock, then runs."""
    with engine._lock:  # as a step running in another thread holds it
        caller = threading.Thread(target=call)
        caller.start()
        caller.join(0.5)
        assert caller.is_alive()
    caller.join(30)
    assert not caller.is_alive()


def test_a_prefix_cache_reset_waits_for_a_step_in_another_thread(tiny_ckpt):
    """reset_prefix_cache ran without the engine's lock, in the middle of a widget's step in a
    background thread (whose undo log and block registrations it changed under it)."""
    llm = make_llm(tiny_ckpt)
    _waits_for_a_step(llm.llm_engine, llm.reset_prefix_cache)


def test_a_shutdown_waits_for_a_step_in_another_thread_and_the_next_step_says_so(tiny_ckpt):
    """shutdown() took the model and KV cache away under a step running in another thread: that thread
    failed with AttributeError 'NoneType' has no attribute 'compute_logits' or 'ctx.kv_caches has 0 entries'."""
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    _waits_for_a_step(engine, llm.shutdown)
    assert engine.is_shut_down
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("late", [1, 2], greedy(2))


def test_two_model_builds_at_once_leave_torchs_default_dtype_as_it_was(monkeypatch):
    """build_model sets torch's process-wide default dtype while it builds: two builds in two threads
    (bfloat16, float16) each restored what the other had set, leaving bfloat16 the default for good."""
    from types import SimpleNamespace

    from minivllm.engine import model_runner

    inside, go = {torch.bfloat16: threading.Event(), torch.float16: threading.Event()}, threading.Event()
    go_second = threading.Event()

    class Held(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()
            mine = torch.get_default_dtype()
            inside[mine].set()
            (go if mine == torch.bfloat16 else go_second).wait(5)

    monkeypatch.setattr(model_runner, "get_model_class", lambda cfg: Held)
    monkeypatch.setattr("minivllm.utils.loader.init_random_weights", lambda model, seed: None)
    source = SimpleNamespace(hf_config=None, checkpoint_dir=None)
    build = lambda dtype: model_runner.build_model(source, torch.device("cpu"), dtype, 0)  # noqa: E731
    first = threading.Thread(target=build, args=(torch.bfloat16,))
    second = threading.Thread(target=build, args=(torch.float16,))
    first.start()
    assert inside[torch.bfloat16].wait(5)
    second.start()
    second.join(0.3)  # with builds taking turns, the second waits outside
    go.set()
    first.join(5)
    go_second.set()
    second.join(5)
    left = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the later tests' default, whatever this one finds
    assert left == torch.float32


def _poison_rows(monkeypatch, rows_of, value=float("nan")):
    """Make ``compute_logits`` return ``value`` (one entry) in the rows of the requests ``rows_of`` names."""
    original = ModelRunner.forward_logits

    def forward_logits(self, inp):
        logits = original(self, inp).clone()
        for i, seq in enumerate(inp.sampling_seqs):
            if seq.request_id in rows_of:
                logits[i, 3] = value
        return logits

    monkeypatch.setattr(ModelRunner, "forward_logits", forward_logits)


@pytest.mark.parametrize("params,value", [(greedy(8), float("nan")), (greedy(8), float("inf")),
                                          (greedy(8), float("-inf")),
                                          (SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                                           float("nan"))])
def test_nonfinite_logits_end_that_request_with_an_error_and_spare_the_others(tiny_ckpt, monkeypatch, params, value):
    """One non-finite entry (NaN, +inf or -inf) in a request's raw logits ends that request."""
    llm = make_llm(tiny_ckpt)
    prompts = prompts_of([5, 7, 9], seed=6)
    reference = _tokens(llm.generate(prompts, params, use_tqdm=False))
    _poison_rows(monkeypatch, {"4"}, value)  # the second prompt of the next call (ids 3, 4, 5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = outs[1]
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "'4'" in bad.error and "non-finite" in bad.error and "float32" in bad.error
    assert _tokens([outs[0], outs[2]]) == [reference[0], reference[2]]
    monkeypatch.undo()
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == reference  # nothing cached from it


def test_fp16_overflow_is_reported_not_sampled_as_token_zero(tiny_ckpt, monkeypatch):
    """Logits that overflow (inf in every row) end the request with an error naming the dtype."""
    original = ModelRunner.forward_logits
    monkeypatch.setattr(ModelRunner, "forward_logits",
                        lambda self, inp: torch.full_like(original(self, inp), float("inf")))
    out = make_llm(tiny_ckpt).generate([[1, 2, 3]], greedy(4), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert "dtype=" in out.error


def test_an_idle_step_while_another_thread_queues_a_request_is_no_lost_progress(tiny_ckpt):
    # LLM._step read has_unfinished_requests() after the step had let go of the engine's lock: a request another
    # thread queued in between made a caller whose output a third thread's step had already delivered fail with
    # "the scheduler made no progress ... this is a bug" (three threads sharing one LLM hit it within seconds)
    llm = make_llm(tiny_ckpt)
    engine, step = llm.llm_engine, llm.llm_engine.step_with_record
    other = {}

    def step_with_record():
        if other:
            return step()
        while engine.has_unfinished_requests():  # another thread's steps finish this caller's request
            step()
        record = step()  # this caller's own step then finds nothing to schedule
        other["thread"] = threading.Thread(target=engine.add_request, args=("other", [5, 6, 7], greedy(2)))
        other["thread"].start()
        other["thread"].join(0.5)  # the third thread queues its request now, unless the caller holds the lock
        return record

    engine.step_with_record = step_with_record
    out = llm.generate([[1, 2, 3]], greedy(3), use_tqdm=False)
    other["thread"].join()
    assert len(out[0].outputs[0].token_ids) == 3 and "other" in engine.requests
    del engine.step_with_record
    assert llm.generate([[4, 5]], greedy(2), use_tqdm=False)[0].outputs[0].token_ids  # "other" is served too
    assert not engine.has_unfinished_requests()
