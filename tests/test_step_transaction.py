"""A step is all or nothing: an exception anywhere in it (KeyboardInterrupt included) leaves
every request as it was, and stepping on gives the tokens of an uninterrupted run."""
from __future__ import annotations

import sys

import pytest

from helpers_engine import greedy, make_llm, prompts_of
from helpers_faults import FAULT_NAMES, Fault
from minivllm import SamplingParams
from minivllm.engine.block_manager import BlockManager


def _params(kind: str, n: int) -> SamplingParams:
    if kind == "greedy":
        return greedy(n)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=n, ignore_eos=True)


def _drive(engine, requests, *, check=True) -> dict:
    """Add ``requests`` ((id, prompt, params)), step to the end; swallow injected faults
    (checking the invariants right after each); returns final token ids by request id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final, faults = {}, 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except (KeyboardInterrupt, RuntimeError) as e:
            assert "injected fault" in str(e)
            faults += 1
            engine.check_invariants()
            continue
        if check:
            engine.check_invariants()
        for out in outputs:
            if out.finished:
                final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
    assert faults <= 1
    return final


def test_interrupt_in_block_registration_keeps_the_running_request(tiny_ckpt, monkeypatch):
    """The reported failure: ``bg`` runs, a KeyboardInterrupt from register_computed_blocks
    in a later step used to leave it computed without its token (IndexError ever after)."""
    prompt = prompts_of([10], seed=3)[0]
    reference = make_llm(tiny_ckpt).generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    engine.add_request("bg", prompt, greedy(12), output_kind="final_only")
    engine.step()
    fault = Fault(monkeypatch, "block registration")
    outputs = []
    while engine.has_unfinished_requests():
        try:
            outputs += engine.step()
        except KeyboardInterrupt:
            engine.check_invariants()
    assert fault.fired
    assert [o.outputs[0].token_ids for o in outputs] == [reference]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("point", FAULT_NAMES)
def test_a_fault_anywhere_in_a_step_changes_no_request(tiny_ckpt, monkeypatch, point, kind):
    # Chunked prefill (budget 12), a shared prefix (cache hits), a small pool (preemption).
    prefix = prompts_of([8], seed=11)[0]
    prompts = [prefix + p for p in prompts_of([3, 14, 6], seed=5)] + prompts_of([20], seed=6)
    requests = [(f"r{i}", p, _params(kind, 6 + 2 * i)) for i, p in enumerate(prompts)]
    args = dict(num_kvcache_blocks=14, max_num_batched_tokens=12, max_num_seqs=3)
    llm = make_llm(tiny_ckpt, **args)
    reference = _drive(llm.llm_engine, requests)
    fired = 0
    for at in (0, 3, 7):  # early (admission / prefill) and later (decodes, finishes) calls
        llm.llm_engine.reset_prefix_cache()
        with monkeypatch.context() as m:
            fault = Fault(m, point, at=at)
            got = _drive(llm.llm_engine, [(f"{rid}-{at}", p, sp) for rid, p, sp in requests])
        fired += fault.fired
        assert got == {f"{rid}-{at}": v for rid, v in reference.items()}, f"fault in {point} at call {at}"
    assert fired >= 1


def test_generate_survives_an_interrupt_and_the_engine_serves_on(tiny_ckpt, monkeypatch):
    llm = make_llm(tiny_ckpt)
    prompts = prompts_of([5, 9, 13], seed=2)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
    with monkeypatch.context() as m:
        Fault(m, "sampling", at=4)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, greedy(8), use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert not llm.llm_engine.has_unfinished_requests()  # the interrupted call's requests were aborted
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)] == reference


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_an_interrupt_at_any_line_of_the_llm_wrapper_leaves_nothing_queued(tiny_ckpt, call):
    """A KeyboardInterrupt between _submit's add_request and its bookkeeping, or before generate's or
    _outputs' try blocks, left the call's requests queued: the next generate ran them beside its own,
    and with max_tokens=None up to max_model_len. Every line event of minivllm/llm.py is tried."""
    import sys

    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompts = prompts_of([5, 7], seed=3)
    params = [greedy(4), SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=3)]

    def run():
        if call == "generate":
            return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        got = {}
        for o in llm.stream(prompts, params):
            for c in o.outputs:
                got.setdefault((o.request_id, c.index), []).extend(c.token_ids)
        return sorted(got.values())

    reference = run()
    lines = [0]

    def count(frame, event, arg):
        if event == "line" and frame.f_code.co_filename.endswith("minivllm/llm.py"):
            lines[0] += 1
        return count

    sys.settrace(count)
    try:
        run()
    finally:
        sys.settrace(None)
    assert lines[0] > 50
    for k in range(1, lines[0] + 1):
        seen = [0]

        def interrupt(frame, event, arg):
            if event == "line" and frame.f_code.co_filename.endswith("minivllm/llm.py"):
                seen[0] += 1
                if seen[0] == k:
                    raise KeyboardInterrupt(f"llm.py:{frame.f_lineno}")
            return interrupt

        where = None
        sys.settrace(interrupt)
        try:
            run()
        except KeyboardInterrupt as e:
            where = str(e)
        finally:
            sys.settrace(None)
        assert not engine.has_unfinished_requests(), (where, sorted(engine.requests))
        assert not engine._sinks, (where, engine._sinks)
    engine.check_invariants()
    assert run() == reference


def test_generate_leaves_a_request_queued_by_hand_alone(tiny_ckpt):
    """generate's id "0" clashed with a request a learner had queued as "0" by hand: add_request refused
    it, generate raised, and its clean-up aborted the learner's request (its id was recorded first)."""
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompt = prompts_of([5], seed=6)[0]
    engine.add_request("0", prompt, greedy(20))
    out = llm.generate(prompt, greedy(2), use_tqdm=False)[0]  # takes another id
    assert out.request_id != "0" and len(out.outputs[0].token_ids) == 2
    assert "0" in engine.requests  # still running: 20 tokens, of which generate's steps made 2
    engine.abort_request("0")


def test_outputs_an_interrupt_held_back_after_the_commit_reach_their_streams_once(tiny_ckpt, monkeypatch):
    """A step interrupted after its commit, before it handed its outputs over, lost them: a delta stream
    another caller was reading silently missed a token, and one whose request had finished stepped (or,
    since, raised "never arrived"). The outputs are now queued inside the transaction and handed over
    at the next step or wait (an LLM-level fuzz)."""
    from minivllm.engine.delivery import OutputDelivery

    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompts = prompts_of([6, 9], seed=5)
    want = [o.outputs[0] for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
    a, b = llm.stream(prompts[0], greedy(8)), llm.stream(prompts[1], greedy(8))
    got = {0: [next(a)], 1: [next(b)]}
    real, fired = OutputDelivery.deliver_pending, []

    def held_back(self):  # the interrupt lands as each committed step starts handing over
        if self.pending and engine.step_index not in fired:
            fired.append(engine.step_index)
            raise KeyboardInterrupt("after the commit")
        real(self)  # (the next step's start hands them over)

    monkeypatch.setattr(OutputDelivery, "deliver_pending", held_back)
    for _ in range(3):  # someone steps the engine by hand and is interrupted each time, after the commit
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    monkeypatch.setattr(OutputDelivery, "deliver_pending", real)
    got[0] += list(a)
    got[1] += list(b)
    assert len(fired) == 3 and fired == sorted(set(fired))  # three steps ran, each interrupted after its commit
    for i in (0, 1):
        assert [t for o in got[i] for t in o.outputs[0].token_ids] == list(want[i].token_ids)
        assert "".join(o.outputs[0].text for o in got[i]) == want[i].text
    assert not engine._sinks and not engine._delivery.pending
    engine.check_invariants()


def test_the_hand_over_gives_each_output_once_whatever_line_an_interrupt_lands_on():
    """OutputDelivery.deliver_pending interrupted at each of its lines, then run again: every output
    reaches its sink once, in order (its changes are one chain of C calls)."""
    from collections import deque
    from types import SimpleNamespace

    from minivllm.engine.delivery import OutputDelivery
    from minivllm.engine.undo import UndoLog

    class Output(SimpleNamespace):  # a RequestOutput's comparison is Python code, which an interrupt can split
        def __eq__(self, other):
            raise AssertionError("an output compared during the hand-over")

        __hash__ = None

    code = OutputDelivery.deliver_pending.__code__
    outs = [Output(request_id=r, finished=f) for r, f in
            (("a", False), ("b", False), ("a", False), ("c", False), ("b", True), ("a", True))]
    k = 0
    while True:
        d, seen = OutputDelivery(), [0]
        inboxes = {r: deque() for r in "ab"}  # "c" has no sink
        d.sinks.update((r, q.append) for r, q in inboxes.items())
        d.stage(outs, UndoLog())

        def local(frame, event, arg):
            if event == "line":
                seen[0] += 1
                if seen[0] == k + 1:
                    raise KeyboardInterrupt
            return local

        sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
        try:
            d.deliver_pending()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        d.deliver_pending()
        assert list(inboxes["a"]) == [outs[0], outs[2], outs[5]] and list(inboxes["b"]) == [outs[1], outs[4]], k
        assert not d.pending and not d.sinks, k
        if seen[0] <= k:  # no line event left to interrupt
            break
        k += 1
    assert k >= 6


def test_a_sink_that_aborts_another_request_mid_hand_over(tiny_ckpt):
    """A sink (add_request takes any callable) aborting another request while outputs were handed over
    re-entered the hand-over, which emptied the queue under the outer one: step() raised IndexError after
    its commit (a review)."""
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    got = {r: [] for r in "abc"}

    def sink_a(out):
        got["a"].append(out)
        if len(got["a"]) == 2:
            assert engine.abort_request("c").outputs[0].finish_reason == "abort"

    for r, p in zip("abc", prompts_of([5, 6, 7], seed=3)):
        engine.add_request(r, p, greedy(6), output_kind="delta", sink=sink_a if r == "a" else got[r].append)
    while engine.has_unfinished_requests():
        engine.step()
    assert [len(got[r]) for r in "abc"] == [6, 6, 3] and all(got[r][-1].finished for r in "abc")
    assert not engine._sinks and not engine._delivery.pending
    engine.check_invariants()


def test_an_abort_deferred_past_a_rolled_back_step_spares_a_new_request_with_its_id(tiny_ckpt, monkeypatch):
    """An abort asked for from inside a step that then rolled back stayed queued; after the request was
    aborted by hand and its id given to a new request, the next step aborted the new one (a review)."""
    from minivllm.engine.scheduler import Scheduler

    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompts = prompts_of([6, 9, 5], seed=5)
    engine.add_request("keep", prompts[0], greedy(6))
    engine.add_request("drop", prompts[1], greedy(6))
    engine.step()
    real = Scheduler.schedule

    def schedule(self):
        monkeypatch.setattr(Scheduler, "schedule", real)
        assert engine.abort_request("drop") is None  # deferred
        real(self)
        raise KeyboardInterrupt("mid-step")

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert "drop" in engine.requests  # rolled back with the step; the abort waits for the next one
    assert engine.abort_request("drop").outputs[0].finish_reason == "abort"
    engine.add_request("drop", prompts[2], greedy(4))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o.outputs[0].finish_reason) for o in engine.step() if o.finished)
    assert finals == {"keep": "length", "drop": "length"} and not engine._deferred_aborts
    engine.check_invariants()


def test_an_abort_from_inside_a_step_waits_for_its_end(tiny_ckpt, monkeypatch):
    """A stream dropped in a reference cycle is closed by the collector wherever it runs, inside another
    caller's step too: its abort re-entered the engine (its lock is re-entrant) while the scheduler was
    planning the same request, and a KV block leaked (an LLM-level fuzz). It now runs when the step is over."""
    from minivllm.engine.scheduler import Scheduler

    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompts = prompts_of([6, 9], seed=5)
    engine.add_request("keep", prompts[0], greedy(6))
    engine.add_request("drop", prompts[1], greedy(6))
    engine.step()
    real, aborted = Scheduler.schedule, []

    def schedule(self):
        if not aborted:
            aborted.append(engine.abort_request("drop"))  # as a finalizer run mid-step would
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    outs = engine.step()
    monkeypatch.setattr(Scheduler, "schedule", real)
    assert aborted == [None] and "drop" not in engine.requests and "keep" in engine.requests
    # the step that made the abort returns its output (abort_request itself could not)
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "drop"][-1] == "abort"
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_interrupted_stream_delivers_every_delta_once(tiny_ckpt, monkeypatch):
    """A rolled-back step returned nothing, so a consumer that retries sees each delta once."""
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompt = prompts_of([7], seed=4)[0]
    full = llm.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("s", prompt, greedy(10), output_kind="delta")
    got = []
    with monkeypatch.context() as m:
        Fault(m, "output building", at=5)
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except KeyboardInterrupt:
                continue
            for out in outputs:
                got += out.outputs[0].token_ids
    assert got == full


def test_a_collision_on_the_prefix_hash_costs_a_miss_not_wrong_kv(tiny_ckpt, monkeypatch):
    """With every block hashing alike, ``X + X + [t]`` after ``X + [...]`` used to reuse the
    first block twice (8 cached tokens where at most 4 are true)."""
    import minivllm.engine.block_manager as bm_mod

    x = prompts_of([4], seed=9)[0]  # one block (block_size 4)
    probe = x + x + [5]
    no_cache = make_llm(tiny_ckpt, enable_prefix_caching=False).generate(probe, greedy(5), use_tqdm=False)[0]
    monkeypatch.setitem(bm_mod._HASH_FUNCTIONS, "xxhash", lambda parent, tokens: 42)
    llm = make_llm(tiny_ckpt)
    llm.generate(x + [7, 8, 9, 10, 11], greedy(2), use_tqdm=False)
    out = llm.generate(probe, greedy(5), use_tqdm=False)[0]
    assert out.num_cached_tokens == 4
    assert out.outputs[0].token_ids == no_cache.outputs[0].token_ids


def test_a_child_block_is_not_reached_through_a_new_content_of_its_parents_block_id(monkeypatch):
    """B was computed after A in block 0; block 0 is then evicted and re-registered with A2.
    With a hash that collides across parents, ``A2 + B`` must not hit B (its KV follows A)."""
    import minivllm.engine.block_manager as bm_mod
    from minivllm.engine.sequence import Sequence

    monkeypatch.setitem(bm_mod._HASH_FUNCTIONS, "xxhash", lambda parent, tokens: hash(tuple(tokens)))
    bm = BlockManager(2, 4)

    def prefill(tokens, rid):
        seq = Sequence(rid, None, list(tokens), SamplingParams())
        ids, hashes = bm.match_prefix(seq)
        bm.admit(seq, ids, hashes)
        bm.grow(seq, len(seq))
        seq.num_computed_tokens = len(seq)
        bm.register_computed_blocks(seq)
        return seq, ids

    A, A2, B = [1] * 4, [5] * 4, [2] * 4
    a, _ = prefill(A + B, "a")          # block 0: A, block 1: B (parent: block 0)
    bm.release(a)
    bm._free_cached.move_to_end(1)      # B used more recently: A's block is evicted first
    d, _ = prefill(A2, "d")             # block 0 now holds A2
    assert d.block_table == [0]
    bm.release(d)
    q = Sequence("q", None, A2 + B + [3], SamplingParams())
    ids, _ = bm.match_prefix(q)
    assert ids == [0]                   # A2 hits; B (computed after A) does not
    bm.check_invariants([])


def test_sha256_prefix_hashing_hits_like_xxhash(tiny_ckpt):
    prompt = prompts_of([13], seed=8)[0]
    outs = {}
    for algo in ("xxhash", "sha256"):
        llm = make_llm(tiny_ckpt, prefix_caching_hash_algo=algo)
        first = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
        second = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
        assert second.num_cached_tokens == 12 and second.outputs[0].token_ids == first.outputs[0].token_ids
        outs[algo] = first.outputs[0].token_ids
    assert outs["xxhash"] == outs["sha256"]
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='md5'"):
        make_llm(tiny_ckpt, prefix_caching_hash_algo="md5")


def test_a_greedy_batch_saves_no_generator_and_one_sampled_request_saves_them(tiny_ckpt):
    """``StepTransaction.protect`` skips its per-entry pass when no request draws random numbers
    (``SamplingParams.draws_random``, refreshed when a field changes); a batch with one sampled
    request saves the engine-wide generator, and a seeded one its own."""
    from minivllm.engine.transaction import StepTransaction

    p = SamplingParams(temperature=0)
    assert not p.draws_random
    p.temperature = 0.7
    assert p.draws_random
    p.temperature, p.seed = 0, 3
    assert p.draws_random
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompts = prompts_of([5, 6], seed=30)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, greedy(max_tokens=4))
    engine.step()
    plan = engine.scheduler.schedule()
    txn = StepTransaction(engine.scheduler, engine.output_processor, engine._engine_generator())
    txn.protect(plan)
    txn.commit()
    assert txn.generators == [] and txn.kv_written
    assert plan.all_plain_greedy  # the sampler builds no per-row settings either
    engine.add_request("s", prompts[0], SamplingParams(temperature=0.8, max_tokens=4))
    engine.step()
    plan = engine.scheduler.schedule()
    txn = StepTransaction(engine.scheduler, engine.output_processor, engine._engine_generator())
    txn.protect(plan)
    txn.commit()
    assert [g for g, _ in txn.generators] == [engine._engine_generator()]
    assert not plan.all_plain_greedy
    assert {s.request_id for s in engine.scheduler.random_seqs} == {"s"}  # listed from its admission
    assert {s.request_id for s in engine.scheduler.non_greedy_seqs} == {"s"}
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert engine.scheduler.random_seqs == engine.scheduler.non_greedy_seqs == set()  # forgotten when it finished
    engine.add_request("g", prompts[0], greedy(max_tokens=2))
    assert engine.scheduler.schedule().all_plain_greedy
    llm.shutdown()


def test_a_rolled_back_preemption_whose_block_was_reused_recomputes_the_victim(tiny_ckpt, monkeypatch):
    """S needs a block, so V is preempted and S takes V's freed block; the forward writes S's KV
    there and the step is interrupted after it. The rollback gave V back that block with
    S's KV in it (V then decoded over it once S was aborted): V must be recomputed instead,
    ending as in a run where S is aborted at that point without the interrupt."""
    from minivllm.engine.scheduler import Scheduler

    args = dict(num_kvcache_blocks=10, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    v_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    llms = []  # an engine lives as long as its LLM

    def start():
        llms.append(make_llm(tiny_ckpt, **args))
        engine = llms[-1].llm_engine
        engine.add_request("S", list(range(11, 19)), greedy(30))
        engine.add_request("V", list(range(41, 55)), v_params)
        return engine

    engine, k = start(), 0
    while True:
        v_blocks = set(engine.requests["V"].seq.block_table)
        engine.step()
        if engine.last_step_record.preempted:
            break
        k += 1
    assert engine.last_step_record.preempted == ["V"]
    assert v_blocks & set(engine.requests["S"].seq.block_table)  # S took (and wrote) a block of V's

    def finish(interrupt: bool):
        engine = start()
        for _ in range(k):
            engine.step()
        if interrupt:
            with monkeypatch.context() as m:
                m.setattr(Scheduler, "update_from_output", _raise_interrupt)
                with pytest.raises(KeyboardInterrupt):
                    engine.step()
            engine.check_invariants()
        engine.abort_request("S")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    v = out.outputs[0]
                    engine.check_invariants()
                    return v.token_ids, [next(iter(d.values())).logprob for d in v.logprobs]

    assert finish(interrupt=True) == finish(interrupt=False)


def _raise_interrupt(*args, **kwargs):
    raise KeyboardInterrupt("after the forward")
