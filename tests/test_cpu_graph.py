"""CPU graphs (minivllm/layers/cpu_graph.py): recording and replaying a decode forward's C calls.

The engine records a graph per (batch bucket, context bound, thread count) at its first decode step
and replays it after; every test here compares against the same engine with ``enforce_eager=True``.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine import model_check
from minivllm.layers import cpu_graph
from minivllm.layers.attention import cpu_decode
from minivllm.layers.cpu_graph import CpuGraph, GraphPool, NotCapturable

from helpers_engine import prompts_of
from helpers_native import native_or_skip, tensor_data_or_skip

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="the native decode kernel does not build here")


@pytest.fixture(params=["c", "c-data_ptr", "python"])
def check(request, monkeypatch):
    """The model-change tests run with the model check's C pass (minivllm/engine/model_check.py),
    the tensors' addresses read from their TensorImpls (``tensor_data.cpp``) or, without that
    library, through ``Tensor.data_ptr``, and with the Python check alone
    (``MINIVLLM_C_MODEL_CHECK=0``); engines made in the test read the switch when they start."""
    if request.param != "python":
        native_or_skip(model_check, "the C model check")
    if request.param == "c":
        tensor_data_or_skip()
    if request.param == "c-data_ptr":
        monkeypatch.setattr(model_check, "hold", lambda tensors, addresses: None)
    monkeypatch.setenv(model_check.ENV_SWITCH, "0" if request.param == "python" else "1")
    return request.param


def _llm(**kw) -> LLM:
    return LLM("minivllm-tiny", seed=0, **kw)


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _logits_of_steps(llm: LLM, prompts, max_tokens: int):
    """Every decode step's fp32 logits, added one request at a time so batch sizes vary (1..n)."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    seen, original = [], runner.forward_logits

    def spy(inp, *args):
        out = original(inp, *args)
        if inp.meta.is_decode_only:
            seen.append(out.clone())
        return out

    runner.forward_logits = spy
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.forward_logits = original
    return seen


def test_replayed_steps_match_eager_bit_for_bit_and_leave_the_same_kv_cache():
    """Batches of 1..5 sequences (a graph per batch size), prompts of 3..40 tokens: the same
    logits bit for bit, and the same KV cache."""
    prompts = prompts_of([3, 17, 40, 9, 25], seed=1, vocab=4000)
    graph, eager = _llm(), _llm(enforce_eager=True)
    got, want = _logits_of_steps(graph, prompts, 12), _logits_of_steps(eager, prompts, 12)
    g = graph.llm_engine.runner.graph_runner
    assert g.kind == "cpu" and g.not_capturable is None
    assert g.num_recordings == len(g.graph_keys) and {k[0] for k in g.graph_keys} == {1, 2, 3, 4, 5}  # unpadded
    # every layer of every graph uses the pool's one attention scratch (not one per graph)
    assert len({t.data_ptr() for gr in g._graphs.values() for t in gr._keep if isinstance(t, torch.Tensor)}) == 1
    assert g.num_replays + g.num_recordings == len(got)  # every decode step: recorded once, then replayed
    assert eager.llm_engine.runner.graph_runner is None
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    for (kg, vg), (ke, ve) in zip(graph.llm_engine.runner.kv_caches, eager.llm_engine.runner.kv_caches):
        assert torch.equal(kg, ke) and torch.equal(vg, ve)


def test_an_operation_a_graph_cannot_replay_switches_graphs_off_and_the_step_still_runs():
    """A norm taking its torch path (fresh tensors each call) makes the recording fail: the engine
    says why, runs that step and the later ones eagerly, and generates what enforce_eager does."""
    prompts = prompts_of([5, 11, 7], seed=2, vocab=4000)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = _llm()
    llm.llm_engine.runner.model.model.layers[1].input_layernorm.fused = None
    got = _run(llm, prompts, params)
    g = llm.llm_engine.runner.graph_runner
    assert g.not_capturable is not None and "returns a new tensor" in g.not_capturable
    assert not g.captured and g.graph_keys == []
    _assert_weights_not_held(llm)  # nothing checks them any more
    eager = _llm(enforce_eager=True)
    eager.llm_engine.runner.model.model.layers[1].input_layernorm.fused = None
    assert got == _run(eager, prompts, params)


def test_an_interrupt_while_recording_keeps_no_graph_and_the_next_step_records_again(monkeypatch):
    llm = _llm()
    engine = llm.llm_engine
    engine.add_request("a", prompts_of([6], seed=3, vocab=4000)[0],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()  # the prefill (eager: graphs are for decode steps)
    g = engine.runner.graph_runner
    real, calls = cpu_graph.launch, []

    def interrupted(fn, *args, name=None, native=None):
        calls.append(fn)
        if len(calls) == 5 and cpu_graph.capturing() is not None:
            raise KeyboardInterrupt
        real(fn, *args, name=name, native=native)

    for mod in ("minivllm.layers.cpu_fused", "minivllm.layers.cpu_gemm"):
        monkeypatch.setattr(f"{mod}.launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert g.graph_keys == [] and cpu_graph.capturing() is None
    monkeypatch.undo()
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert len(g.graph_keys) == 1 and g.num_replays >= 4
    eager = _llm(enforce_eager=True)
    assert final["a"] == _run(eager, prompts_of([6], seed=3, vocab=4000),
                              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]


def test_a_graph_per_thread_count(monkeypatch):
    llm = _llm()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = prompts_of([8], seed=4, vocab=4000)
    first = _run(llm, prompt, params)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert _run(llm, prompt, params) == first
    finally:
        torch.set_num_threads(threads)
    assert {k[2] for k in llm.llm_engine.runner.graph_runner.graph_keys} == {threads, threads + 1}


def test_a_corrupt_block_table_is_refused_before_a_replay_reads_it():
    llm = _llm()
    engine = llm.llm_engine
    engine.add_request("a", prompts_of([6], seed=5, vocab=4000)[0],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    g = engine.runner.graph_runner
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        g.stage([1], [6], [0], [7], [[engine.runner.num_kv_blocks + 3]])
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        g.stage([1], [20], [0], [21], [[0, -1]])


def test_graph_records_out_and_in_place_operations_and_refuses_fresh_results():
    a, b, c = torch.ones(4), torch.full((4,), 2.0), torch.empty(4)
    graph = CpuGraph()
    with graph.capture():
        torch.add(a, b, out=c)
        c.mul_(3)
        tmp = torch.empty(4)  # from the pool
        torch.mul(c, 2, out=tmp)
        c.add_(tmp)
    assert torch.equal(c, torch.full((4,), 27.0)) and graph.num_calls == 4
    a.fill_(5)
    graph.replay()
    assert torch.equal(c, torch.full((4,), 63.0))
    bad = CpuGraph()
    with pytest.raises(NotCapturable, match="aten.add.Tensor"):
        with bad.capture():
            a + b
    assert not bad.complete
    with pytest.raises(RuntimeError, match="not captured"):
        bad.replay()


def test_launch_records_only_while_capturing():
    seen = []
    cpu_graph.launch(seen.append, 1)
    graph = CpuGraph()
    with graph.capture():
        cpu_graph.launch(seen.append, 2)
    graph.replay()
    graph.replay()
    assert seen == [1, 2, 2, 2] and graph.num_calls == 1
    assert not graph.replays_in_c  # a call without a packed twin: the Python loop makes it


def test_a_capture_stopped_while_its_calls_are_packed_leaves_the_graph_incomplete(monkeypatch):
    """An interrupt after the body (while the packed calls are built, maybe the C loop's library)
    leaves the graph empty and incomplete, as one inside the body does: its replay refuses."""
    def interrupted(natives):
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu_graph._PackedCalls, "build", staticmethod(interrupted))
    graph, seen = CpuGraph(), []
    with pytest.raises(KeyboardInterrupt):
        with graph.capture():
            cpu_graph.launch(seen.append, 1)
    assert not graph.complete and graph.num_calls == 0 and not graph.replays_in_c
    with pytest.raises(RuntimeError, match="not captured"):
        graph.replay()


def _c_replay_or_skip():
    library = cpu_graph._replay_library
    native_or_skip(SimpleNamespace(load=library.load, unavailable_reason=library.unavailable_reason),
                   "the CPU graphs' C replay")


def test_decode_graphs_replay_in_c_bit_for_bit_as_the_python_loop(monkeypatch):
    """Every call of a decode graph has its packed twin, so its replays are one C loop; with
    ``MINIVLLM_CPU_GRAPH_C_REPLAY=0`` (read when a graph is recorded) the Python loop makes the
    same calls: the same logits bit for bit, and the same KV cache."""
    _c_replay_or_skip()
    prompts = prompts_of([3, 17, 40, 9], seed=5, vocab=4000)
    in_c = _llm()
    got = _logits_of_steps(in_c, prompts, 10)
    monkeypatch.setenv("MINIVLLM_CPU_GRAPH_C_REPLAY", "0")
    in_python = _llm()
    want = _logits_of_steps(in_python, prompts, 10)
    graphs_c = in_c.llm_engine.runner.graph_runner._graphs.values()
    graphs_py = in_python.llm_engine.runner.graph_runner._graphs.values()
    assert len(graphs_c) == 4 and all(g.replays_in_c for g in graphs_c)
    assert len(graphs_py) == 4 and not any(g.replays_in_c for g in graphs_py)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    for (kc, vc), (kp, vp) in zip(in_c.llm_engine.runner.kv_caches, in_python.llm_engine.runner.kv_caches):
        assert torch.equal(kc, kp) and torch.equal(vc, vp)


def test_a_replay_in_c_raises_the_error_naming_bad_input_and_makes_no_later_call():
    """A twin that finds bad input (a token id past the table, a position past the rotary table, a
    KV slot past the cache) stops the C loop; the replay then raises what the Python call raises.
    Floats (an epsilon) and ints reach the twins as recorded."""
    _c_replay_or_skip()
    from minivllm.layers import cpu_fused
    from minivllm.layers.rotary import RotaryEmbedding

    ops = native_or_skip(cpu_fused, "the fused CPU ops")
    kernel = native_or_skip(cpu_decode, "the native decode kernel")
    table, ids = torch.randn(50, 8), torch.tensor([3, 7])
    weight, eps = torch.rand(8) + 0.5, 0.25
    rot = RotaryEmbedding(8, 16, 1e4)
    cos_sin, positions = rot.cos_sin_cache(torch.device("cpu")), torch.tensor([1, 2])
    k_cache, v_cache, slots = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), torch.tensor([5, 6])
    graph = CpuGraph()
    with graph.capture():
        x = ops.embedding(ids, table)
        normed = ops.rms_norm(x, weight, eps)
        q = ops.rope(normed.view(2, 1, 8), positions, cos_sin)
        assert kernel.store_kv(q, q, k_cache, v_cache, slots)
    graph.keep_alive(ids, positions, slots)
    assert graph.replays_in_c
    ids.copy_(torch.tensor([9, 4]))
    graph.replay()
    want = rot(positions, torch.nn.functional.rms_norm(table[ids], (8,), weight, eps).view(2, 1, 8),
               torch.zeros(2, 1, 8))[0]
    torch.testing.assert_close(k_cache.view(8, 1, 8)[5:7], want, atol=1e-5, rtol=1e-5)
    for setup, error in ((lambda: ids.copy_(torch.tensor([9, 50])), "id 50 \\(token 1\\)"),
                         (lambda: positions.copy_(torch.tensor([1, 16])), "position 16 \\(token 1\\)"),
                         (lambda: slots.copy_(torch.tensor([5, 8])), "slot 8 ")):
        ids.copy_(torch.tensor([9, 4])), positions.copy_(torch.tensor([1, 2])), slots.copy_(torch.tensor([5, 6]))
        setup()
        k_cache.zero_()
        with pytest.raises(IndexError, match=error):
            graph.replay()
        # the calls after the bad one were not made (here: the store, unless it was the bad one)
        assert error.startswith("slot") or not k_cache.any()


def test_count_calls_counts_launches_by_name_in_its_block_only_and_not_replays():
    seen = []
    cpu_graph.launch(seen.append, 0, name="before")
    graph = CpuGraph()
    with cpu_graph.count_calls() as calls:
        cpu_graph.launch(seen.append, 1, name="c_fn")
        cpu_graph.launch(seen.append, 2, name="c_fn")
        cpu_graph.launch(seen.append, 3)  # no name: the function's
        with graph.capture():
            cpu_graph.launch(seen.append, 4, name="recorded")
        graph.replay()  # a replay issues its calls without launch: not counted
    cpu_graph.launch(seen.append, 5, name="after")
    assert calls == {"c_fn": 2, "append": 1, "recorded": 1}
    assert seen == [0, 1, 2, 3, 4, 4, 5]


def test_time_replays_times_each_call_by_name_in_c_and_in_the_python_loop():
    """Within time_replays a replay times each of its calls (from C where it replays in C) and
    does the same work; outside the block nothing is timed."""
    _c_replay_or_skip()
    from minivllm.layers import cpu_fused

    ops = native_or_skip(cpu_fused, "the fused CPU ops")
    table, ids, weight = torch.randn(50, 8), torch.tensor([3, 7]), torch.rand(8) + 0.5
    in_c = CpuGraph()
    with in_c.capture():
        normed = ops.rms_norm(ops.embedding(ids, table), weight, 1e-6)
    a, b, c, seen = torch.ones(4), torch.full((4,), 2.0), torch.empty(4), []
    in_python = CpuGraph()  # an ATen operation recorded: the Python loop
    with in_python.capture():
        torch.add(a, b, out=c)
        cpu_graph.launch(seen.append, 1, name="note")
    assert in_c.replays_in_c and not in_python.replays_in_c
    ids.copy_(torch.tensor([9, 4]))
    a.fill_(5)
    with cpu_graph.time_replays() as timings:
        in_c.replay()
        in_python.replay()
    in_c.replay()  # outside the block: not timed
    assert [t.from_c for t in timings] == [True, False]
    assert timings[0].names == ("embedding_f32", "rms_norm_f32")
    assert timings[1].names == ("aten.add.out", "note")
    assert all(len(t.seconds) == len(t.names) and all(x >= 0 for x in t.seconds) for t in timings)
    assert timings[0].total_s == pytest.approx(sum(timings[0].seconds), rel=1e-12)
    assert list(timings[1].by_name()) == ["aten.add.out", "note"]
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(table[ids], (8,), weight, 1e-6))
    assert torch.equal(c, torch.full((4,), 7.0)) and seen == [1, 1]


def test_a_timed_replay_raises_for_bad_input_as_a_plain_one_and_records_no_timing():
    _c_replay_or_skip()
    from minivllm.layers import cpu_fused

    ops = native_or_skip(cpu_fused, "the fused CPU ops")
    table, ids = torch.randn(50, 8), torch.tensor([3, 7])
    graph = CpuGraph()
    with graph.capture():
        ops.embedding(ids, table)
    ids.copy_(torch.tensor([9, 50]))
    with cpu_graph.time_replays() as timings, pytest.raises(IndexError, match="id 50"):
        graph.replay()
    assert timings == []


def test_count_calls_sees_every_c_call_of_an_eager_decode_step():
    llm = _llm(enforce_eager=True, num_kvcache_blocks=64)
    try:
        engine = llm.llm_engine
        engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()  # the prefill
        layers = engine.source.hf_config.num_hidden_layers
        with cpu_graph.count_calls() as calls:
            assert engine.step_with_record().record.phase == "decode"
    finally:
        llm.shutdown()
    # one attention and one KV store per layer, whatever else the build's fused ops and GEMMs take
    assert calls["paged_decode_attention_f32"] == layers and calls["paged_store_kv_f32"] == layers


def test_pool_allocations_are_aligned_and_each_capture_starts_over():
    pool = GraphPool(chunk_bytes=256)
    x = pool.allocate((3, 5), torch.float32)
    y = pool.allocate((100,), torch.float32)  # larger than a chunk: a chunk of its own
    assert x.data_ptr() % 64 == 0 and y.data_ptr() % 64 == 0 and y.shape == (100,)
    assert x.data_ptr() + x.numel() * 4 <= y.data_ptr() or y.data_ptr() + 400 <= x.data_ptr()
    pool.rewind()
    assert pool.allocate((3, 5), torch.float32).data_ptr() == x.data_ptr()


def test_kv_store_skips_padding_and_names_a_slot_outside_the_cache():
    kernel = cpu_decode.load()
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    assert kernel.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k, flat_v = k_cache.view(8, 2, 8), v_cache.view(8, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[0], k[2]) and torch.equal(flat_v[5], v[0])
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 2
    with pytest.raises(IndexError, match="slot 8 "):
        kernel.store_kv(k, v, k_cache, v_cache, torch.tensor([1, 8, 2]))
    assert not kernel.store_kv(k.double(), v.double(), k_cache, v_cache, torch.tensor([1, 2, 3]))


def test_steps_run_eagerly_while_a_module_has_a_forward_hook(check):
    """A replay calls no module: with a hook registered, decode steps take the eager forward, so
    the hook sees every step (the course hooks layers to show shapes and activations)."""
    llm = _llm()
    mlp = llm.llm_engine.runner.model.model.layers[0].mlp
    seen = []
    handle = mlp.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = prompts_of([7], seed=6, vocab=4000)
    try:
        first = _run(llm, prompt, params)
    finally:
        handle.remove()
    g = llm.llm_engine.runner.graph_runner
    assert len(seen) == 5 and g.num_replays == 0  # the prefill and four decode steps, all eager
    assert _run(llm, prompt, params) == first and g.num_replays >= 3
    # a hook on a model whose graphs exist: eager while it is there; its removal hands the C pass
    # its lists again (else every later step would pay the Python check)
    handle = mlp.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    replays = g.num_replays
    try:
        assert _run(llm, prompt, params) == first and g.num_replays == replays and len(seen) == 10
    finally:
        handle.remove()
    assert _run(llm, prompt, params) == first and g.num_replays >= replays + 3
    assert (g._watch._c_unchanged is not None, g._watch._c_args is not None) == ((check != "python",) * 2)


def test_graphs_are_recorded_again_after_a_parameter_is_replaced(check):
    """Replacing a weight (a new tensor, or new storage under the same parameter) between steps:
    the next step records the graphs again and generates what an eager engine with the same
    weights does."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = prompts_of([9], seed=7, vocab=4000)
    llm, eager = _llm(), _llm(enforce_eager=True)
    assert _run(llm, prompt, params) == _run(eager, prompt, params)
    for engine in (llm, eager):
        norm = engine.llm_engine.runner.model.model.layers[2].post_attention_layernorm
        norm.weight = torch.nn.Parameter(norm.weight.detach() * 3, requires_grad=False)
        layer = engine.llm_engine.runner.model.model.layers[0].input_layernorm
        layer.weight.data = layer.weight.detach() * -1.5
    g = llm.llm_engine.runner.graph_runner
    assert _run(llm, prompt, params) == _run(eager, prompt, params)
    assert g.num_replays >= 4
    recorded = g.num_recordings
    for engine in (llm, eager):  # set_: the same Parameter and TensorImpl, another storage
        norm = engine.llm_engine.runner.model.model.norm
        with torch.no_grad():
            norm.weight.set_(norm.weight.detach() * 0.5)
    assert _run(llm, prompt, params) == _run(eager, prompt, params)
    assert g.num_recordings > recorded
    if check != "python":  # the C pass answered the steps without a change (9 items: with the hold)
        assert g._watch._c_args is not None and len(g._watch._c_args) == (9 if check == "c" else 8)


def test_reset_drops_the_graphs_and_the_next_steps_record_them_again():
    llm = _llm()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = prompts_of([6], seed=8, vocab=4000)
    first = _run(llm, prompt, params)
    g = llm.llm_engine.runner.graph_runner
    assert g.graph_keys
    g.reset()
    assert g.graph_keys == []
    _assert_weights_not_held(llm)  # until the next step lists them again
    assert _run(llm, prompt, params) == first and len(g.graph_keys) == 1


def _assert_weights_not_held(llm: LLM) -> None:
    """The model check's hold on the weights (model_check.TensorHold) is given back: torch's
    swap_tensors, which refuses a held tensor, goes through (and is undone)."""
    g = llm.llm_engine.runner.graph_runner
    assert g._watch._tensor_hold is None and g._watch._c_args is None
    norm = llm.llm_engine.runner.model.model.norm.weight
    other = torch.nn.Parameter(norm.detach().clone(), requires_grad=False)
    torch.utils.swap_tensors(norm, other)
    torch.utils.swap_tensors(norm, other)


def test_buffers_made_while_recording_that_outlive_the_step_stay_out_of_the_shared_pool():
    """Regression: the attention kernel's per-thread score scratch, first made while a small
    bucket's graph was recorded, came from the graphs' shared pool, where the next bucket's graph
    put its own tensors: replays overwrote each other's data (bench: 25/32 requests matched
    transformers, 32/32 eagerly). The bench's flow then: a 2-request warm-up, then the workload."""
    from minivllm.bench.common import drive
    from minivllm.bench.workload import make_workload

    work = make_workload("cpu", 4096)  # the bench's 32 requests
    tokens = {}
    for eager in (True, False):
        llm = _llm(enforce_eager=eager)
        engine = llm.llm_engine
        drive(engine, make_workload("cpu", 4096, num_requests=2, input_len=(8, 16), output_len=(4, 4), seed=1))
        outs, *_ = drive(engine, work)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
        if not eager:
            scratch = cpu_decode.load()._local.scratch.data_ptr()
            pool = engine.runner.graph_runner._pool._chunks
            assert not any(c.data_ptr() <= scratch < c.data_ptr() + c.numel() for c in pool)
    assert tokens[False] == tokens[True]


def test_a_tensor_made_while_recording_that_outlives_the_step_is_refused():
    graph = CpuGraph()
    with graph.capture():
        kept = torch.empty(8)  # from the pool, and still referenced below
        with cpu_graph.persistent():
            ordinary = torch.empty(8)  # not from the pool
    pool = graph.pool._chunks[0]
    assert pool.data_ptr() <= kept.data_ptr() < pool.data_ptr() + pool.numel()
    assert not pool.data_ptr() <= ordinary.data_ptr() < pool.data_ptr() + pool.numel()
    with pytest.raises(NotCapturable, match=r"1 tensor\(s\) made while recording outlive the step \(first: \(8,\)"):
        graph.check_nothing_outlives()
    del kept
    graph.check_nothing_outlives()


def test_recording_does_not_import_torch_dynamo():
    """Regression: torch wraps a dispatch mode's handler in torch._dynamo.disable, which imports
    torch._dynamo at the first recorded operation (4-7 s here): the first decode step of every
    process took seconds (chapter 07's latencies were dominated by it)."""
    import subprocess
    import sys

    code = ("import sys\nfrom minivllm import LLM, SamplingParams\n"
            "llm = LLM('minivllm-tiny')\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
            "assert llm.llm_engine.runner.graph_runner.graph_keys\n"
            "print('loaded' if before else 'dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip().splitlines()[-1] == "loaded":  # transformers 5.20 imports it in AutoConfig.from_pretrained
        import transformers

        pytest.skip(f"transformers {transformers.__version__} imports torch._dynamo while the model loads: the "
                    "first step has nothing left to import")
    assert out.stdout.strip().splitlines()[-1] == "no dynamo"


def test_engines_replaying_in_two_threads_use_their_own_scratch():
    """Regression: a recording baked the recording thread's attention scratch into its calls, so
    two engines whose graphs were recorded on one thread shared a scratch, and stepping them in two
    threads at once gave wrong tokens."""
    import threading

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = {"a": prompts_of([120, 100, 130, 110], seed=11, vocab=4000),
               "b": prompts_of([90, 140, 105, 125], seed=12, vocab=4000)}
    engines = {name: _llm() for name in prompts}
    for name, llm in engines.items():  # graphs for bucket 4, recorded on this thread
        _run(llm, prompts_of([5] * 4, seed=1, vocab=4000), SamplingParams(temperature=0, max_tokens=3))
    # each engine's graphs share one attention scratch, its graph pool's (one per graph, 64 sizes x
    # heads x max_model_len floats, was memory for nothing), and the two engines' are not the same
    kept = {name: {t.data_ptr() for g in llm.llm_engine.runner.graph_runner._graphs.values()
                   for t in g._keep if isinstance(t, torch.Tensor)} for name, llm in engines.items()}
    assert len(kept["a"]) == 1 and len(kept["b"]) == 1 and kept["a"] != kept["b"]
    eager = _llm(enforce_eager=True)
    want = {name: _run(eager, p, params) for name, p in prompts.items()}
    got = {}
    threads = [threading.Thread(target=lambda n=name: got.__setitem__(n, _run(engines[n], prompts[n], params)))
               for name in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_a_swapped_submodule_is_recorded_again(check):
    """Regression: the runner listed the model's modules once, so a module swapped on a live engine
    kept being replayed as the old one (and hooks on the new one went unseen)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = prompts_of([9], seed=14, vocab=4000)
    llm, eager = _llm(), _llm(enforce_eager=True)
    assert _run(llm, prompt, params) == _run(eager, prompt, params)
    for engine in (llm, eager):
        layer = engine.llm_engine.runner.model.model.layers[1]
        old = layer.post_attention_layernorm
        new = type(old)(old.hidden_size, eps=old.eps)
        new.weight.data.copy_(old.weight.detach() * 2.5)
        new.fused = old.fused
        layer.post_attention_layernorm = new
    assert _run(llm, prompt, params) == _run(eager, prompt, params)
    g = llm.llm_engine.runner.graph_runner
    new = llm.llm_engine.runner.model.model.layers[1].post_attention_layernorm
    seen = []
    handle = new.register_forward_hook(lambda *a: seen.append(1))
    try:
        _run(llm, prompt, params)
    finally:
        handle.remove()
    assert len(seen) == 6 and g.num_recordings >= 2


def _graph_and_eager_engines(max_tokens: int):
    """An engine with CPU graphs and an eager one, and the tokens both generate for one prompt
    (asserted equal): ``(llm, eager, prompt, params, first)``."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = prompts_of([9], seed=17, vocab=4000)
    llm, eager = _llm(), _llm(enforce_eager=True)
    first = _run(llm, prompt, params)
    assert first == _run(eager, prompt, params)
    return llm, eager, prompt, params, first


def test_a_removed_layer_and_a_parameter_set_straight_into_its_dict_are_recorded_again(check):
    """Changes no torch hook sees: a layer taken out of the ModuleList's dict (the graphs are
    dropped at once) and put back, and a parameter written straight into ``_parameters`` (as
    ``Module._apply`` does when it overwrites). The graph engine then generates what an eager
    engine with the same change does."""
    llm, eager, prompt, params, first = _graph_and_eager_engines(max_tokens=6)
    g = llm.llm_engine.runner.graph_runner
    recorded = g.num_recordings
    layers = llm.llm_engine.runner.model.model.layers
    layer = layers._modules.pop("3")
    assert g._watch.hooked(g.model) is False and g.graph_keys == []
    layers._modules["3"] = layer
    assert _run(llm, prompt, params) == first and g.num_recordings > recorded
    recorded = g.num_recordings
    for engine in (llm, eager):
        norm = engine.llm_engine.runner.model.model.norm
        norm._parameters["weight"] = torch.nn.Parameter(norm.weight.detach() * -1, requires_grad=False)
    assert _run(llm, prompt, params) == _run(eager, prompt, params) != first
    assert g.num_recordings > recorded


def _swap_first_layers(model):  # straight in the ModuleList's dict: no torch hook sees it
    d = model.layers._modules
    d["0"], d["1"] = d["1"], d["0"]


def _broadcast_embedding(model):  # a new Parameter at the old one's address, another layout
    w = model.embed_tokens.weight
    model.embed_tokens.weight = torch.nn.Parameter(w.detach()[:1].expand_as(w), requires_grad=False)


def _bias_where_there_was_none(model):  # a parameter slot that was empty when the graphs were recorded
    o = model.layers[0].self_attn.o_proj
    assert o.bias is None
    o.bias = torch.nn.Parameter(torch.full((model.norm.weight.shape[0],), 3.0), requires_grad=False)


@pytest.mark.parametrize("change", [_swap_first_layers, _broadcast_embedding, _bias_where_there_was_none])
def test_changes_that_keep_sizes_or_addresses_are_recorded_again(change, check):
    """Regressions a reviewer found in a cheaper per-step check (sizes and addresses only): each
    change here keeps the dicts' sizes or the weights' addresses, and the graph engine must still
    generate what an eager engine with the same change does."""
    llm, eager, prompt, params, first = _graph_and_eager_engines(max_tokens=8)
    for engine in (llm, eager):
        change(engine.llm_engine.runner.model.model)
    assert _run(llm, prompt, params) == _run(eager, prompt, params) != first


def test_modules_made_elsewhere_do_not_record_the_graphs_again(check):
    """Another model built in the same process (a notebook's reference model) moves the
    process-wide registration count; the runner compares its own modules and keeps its graphs."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = prompts_of([9], seed=18, vocab=4000)
    llm = _llm()
    first = _run(llm, prompt, params)
    g = llm.llm_engine.runner.graph_runner
    recorded, replays = g.num_recordings, g.num_replays
    torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert _run(llm, prompt, params) == first
    assert g.num_recordings == recorded and g.num_replays > replays


def test_a_block_table_shorter_than_its_context_is_refused_when_staged():
    llm = _llm()
    _run(llm, prompts_of([5], seed=15, vocab=4000), SamplingParams(temperature=0, max_tokens=3))
    g = llm.llm_engine.runner.graph_runner
    with pytest.raises(RuntimeError, match="covers fewer than its 41 tokens"):
        g.stage([1], [40], [5], [41], [[3]])
    import numpy as np
    with pytest.raises(RuntimeError, match="block manager state is corrupt"):
        g.stage(np.array([1]), np.array([40]), np.array([5]), np.array([41]), np.array([[3, -1, -1]], dtype=np.int32))
    with pytest.raises(RuntimeError, match="block manager state is corrupt"):
        g.stage(np.array([1]), np.array([40]), np.array([5]), np.array([41]), np.array([[3, 4]], dtype=np.int32))


def test_a_staged_row_keeps_its_table_until_its_version_changes(monkeypatch):
    """With table versions, stage() writes only the rows whose version differs from the one
    staged in that row by the last completed call; an interrupt while writing rows makes the next
    call write every row again."""
    llm = _llm()
    _run(llm, prompts_of([5], seed=19, vocab=4000), SamplingParams(temperature=0, max_tokens=3))
    g = llm.llm_engine.runner.graph_runner
    written, real = [], g._write_table_rows

    def spy(rows, tables):
        written.append(list(rows))
        return real(rows, tables)

    monkeypatch.setattr(g, "_write_table_rows", spy)
    g.stage([1, 2, 3], [5, 5, 5], [5, 21, 37], [6, 6, 6], [[0], [1], [2]], [10, 11, 12])
    g.stage([1, 2, 3], [6, 6, 6], [6, 22, 38], [7, 7, 7], [[0], [1], [2]], [10, 11, 12])
    g.stage([1, 2, 3], [6, 6, 6], [6, 22, 38], [7, 7, 7], [[0], [1, 4], [2]], [10, 13, 12])
    assert written[1:] == [[1]]  # the second call wrote no row (the writer is not called), the third row 1
    assert g._host["block_tables"][1, :3].tolist() == [1, 4, -1]

    def interrupted_after(k):  # writes the first k rows asked for, then the interrupt
        def write(rows, tables):
            real(list(rows)[:k], tables)
            raise KeyboardInterrupt
        return write

    monkeypatch.setattr(g, "_write_table_rows", interrupted_after(1))
    with pytest.raises(KeyboardInterrupt):
        g.stage([1, 2, 3], [6, 6, 6], [6, 22, 38], [7, 7, 7], [[5], [6], [7]], [20, 21, 22])
    monkeypatch.setattr(g, "_write_table_rows", spy)
    written.clear()
    g.stage([1, 2, 3], [6, 6, 6], [6, 22, 38], [7, 7, 7], [[0], [1, 4], [2]], [10, 13, 12])
    assert written == [[0, 1, 2]] and g._host["block_tables"][:3, 0].tolist() == [0, 1, 2]
    # Interrupted again; then a smaller step completes before the three rows come back: the row
    # the interrupted call overwrote and the smaller step did not reach is written again too.
    monkeypatch.setattr(g, "_write_table_rows", interrupted_after(2))
    with pytest.raises(KeyboardInterrupt):
        g.stage([1, 2, 3], [6, 6, 6], [6, 22, 38], [7, 7, 7], [[5], [6], [7]], [20, 21, 22])
    monkeypatch.setattr(g, "_write_table_rows", real)
    g.stage([1], [6], [6], [7], [[0]], [10])
    g.stage([1, 2, 3], [6, 6, 6], [6, 22, 38], [7, 7, 7], [[0], [1, 4], [2]], [10, 13, 12])
    assert g._host["block_tables"][:3, :2].tolist() == [[0, -1], [1, 4], [2, -1]]


def test_the_context_check_reads_the_staged_rows_not_the_lists():
    """A table changed without a new version (a broken invariant) keeps its staged row; the check
    that each row covers its context reads that row, which the kernels read, so a context past it
    is refused instead of read through a -1 entry."""
    llm = _llm()
    _run(llm, prompts_of([5], seed=20, vocab=4000), SamplingParams(temperature=0, max_tokens=3))
    g = llm.llm_engine.runner.graph_runner
    bs = g.block_size
    g.stage([1], [bs - 2], [bs - 2], [bs - 1], [[3]], [30])
    with pytest.raises(RuntimeError, match=f"covers fewer than its {bs + 1} tokens"):
        g.stage([1], [bs], [4 * bs], [bs + 1], [[3, 4]], [30])


def test_block_table_versions_change_with_the_table_and_roll_back_with_it(monkeypatch):
    """admit, grow and release give a sequence a new table version; a step interrupted after its
    scheduler grew a table restores the table and the version together."""
    llm = _llm(block_size=16)
    engine = llm.llm_engine
    engine.add_request("v", prompts_of([14], seed=21, vocab=4000)[0],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    seq = engine.requests["v"].seq
    versions = [seq.table_version]
    engine.step()  # admitted: one block for 14 tokens
    versions.append(seq.table_version)
    engine.step()  # token 15 of 16: same block
    assert seq.table_version == versions[-1]
    engine.step()  # token 16 fits; the next needs a second block
    before = (seq.table_version, list(seq.block_table))

    def interrupted(plan):
        assert len(seq.block_table) == 2 and seq.table_version != before[0]
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # the scheduler grew the table, then the forward was interrupted
    assert (seq.table_version, seq.block_table) == before
    monkeypatch.undo()
    engine.step()
    assert len(seq.block_table) == 2 and seq.table_version not in versions + [before[0]]
    engine.abort_request("v")
    assert seq.block_table == [] and seq.table_version > max(versions)


def test_replay_outside_inference_mode():
    llm = _llm()
    _run(llm, prompts_of([5], seed=16, vocab=4000), SamplingParams(temperature=0, max_tokens=3))
    g = llm.llm_engine.runner.graph_runner
    assert not torch.is_inference_mode_enabled()
    hidden = g.replay(g.stage([1], [6], [6], [7], [[0]]))
    assert hidden.shape == (1, llm.llm_engine.runner.hf_config.hidden_size) and bool(torch.isfinite(hidden).all())


def _verification_steps(llm: LLM, prompts, params):
    """Outputs, and for each step that verified drafts: (replayed from a graph, the most tokens a
    sequence scored in it, its logits)."""
    runner, seen = llm.llm_engine.runner, []
    original = runner.forward_logits

    def spy(inp, *args):
        out = original(inp, *args)
        if inp.drafts:
            seen.append((inp.graph_rows is not None, max(len(d[1]) + 1 for d in inp.drafts.values()), out.clone()))
        return out

    runner.forward_logits = spy
    try:
        return _run(llm, prompts, params), seen
    finally:
        runner.forward_logits = original


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("spec", [
    NGRAM,
    {"method": "draft_model", "model": "minivllm-tiny-draft", "num_speculative_tokens": 15},
    # 17 scored tokens per sequence: the eager step attends through gather + SDPA (the kernel takes at
    # most cpu_decode.MAX_QUERY_LEN), so such a step must not replay the kernel's graph
    {"method": "draft_model", "model": "minivllm-tiny-draft", "num_speculative_tokens": 16},
])
def test_draft_verification_steps_replay_a_decode_graph_bit_for_bit(spec):
    """Speculation: a step of decodes and draft verifications is staged one graph row per token (a
    verified token is a decode row seeing the keys up to its position), so it replays the decode
    graphs; its logits and the KV cache match an eager engine bit for bit, and so do the outputs.
    Steps whose queries the eager step does not give the kernel run eagerly."""
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [40], prompts_of([23], seed=3, vocab=4000)[0]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graph, eager = _llm(speculative_config=spec), _llm(speculative_config=spec, enforce_eager=True)
    (got, got_steps), (want, want_steps) = _verification_steps(graph, prompts, params), \
        _verification_steps(eager, prompts, params)
    assert got == want
    assert len(got_steps) == len(want_steps) >= 3
    assert [r for r, _, _ in got_steps] == [q <= cpu_decode.MAX_QUERY_LEN for _, q, _ in got_steps]
    assert any(r for r, _, _ in got_steps) and not any(r for r, _, _ in want_steps)
    if spec["num_speculative_tokens"] + 1 > cpu_decode.MAX_QUERY_LEN:
        assert not all(r for r, _, _ in got_steps)
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(got_steps, want_steps))
    for (kg, vg), (ke, ve) in zip(graph.llm_engine.runner.kv_caches, eager.llm_engine.runner.kv_caches):
        assert torch.equal(kg, ke) and torch.equal(vg, ve)
    if spec["method"] == "draft_model":  # the draft's own forwards replay graphs of the draft's, with the same bits
        g_draft, e_draft = (llm.llm_engine.scheduler.config.propose.runner for llm in (graph, eager))
        assert g_draft.graph_runner.num_replays > 0 and e_draft.graph_runner is None
        for (kg, vg), (ke, ve) in zip(g_draft.kv_caches, e_draft.kv_caches):
            assert torch.equal(kg, ke) and torch.equal(vg, ve)


def test_a_staged_step_builds_its_metadata_only_when_read_and_then_as_the_eager_step_does(monkeypatch):
    """A replayed step's ``ModelInput.meta`` is not built unless someone reads it (the replay reads
    the static buffers); read, it describes the step as the eager runner's metadata does; read
    after a later stage (of the same size or another), it refuses instead of describing that step."""
    from itertools import accumulate

    from minivllm.engine.cuda_graph import CudaGraphDecodeRunner

    built = []
    original = CudaGraphDecodeRunner.staged_meta
    monkeypatch.setattr(CudaGraphDecodeRunner, "staged_meta",
                        lambda self, n, stage=None: built.append(n) or original(self, n, stage))
    llm = _llm()
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    prompts = prompts_of([5, 21, 40], seed=3, vocab=4000)
    for i, p in enumerate(prompts):
        engine.add_request(f"m{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    seen, real_prepare = [], runner.prepare_input
    runner.prepare_input = lambda plan: seen.append((plan, real_prepare(plan))) or seen[-1][1]
    for _ in range(4):
        engine.step()
    staged = [(plan, inp) for plan, inp in seen if inp.graph_rows is not None]
    assert staged and built == []  # four steps, three replayed, no metadata built
    plan, inp = staged[-1]
    meta = inp.meta  # read: built now, from the staged buffers
    assert built == [3] and inp.meta is meta
    positions = [e.start_pos for e in plan.scheduled]
    tables = [e.seq.block_table for e in plan.scheduled]
    bs = meta.block_size
    assert meta.is_decode_only and meta.q_lens_cpu == [1, 1, 1]
    assert meta.context_lens_cpu == [p + 1 for p in positions] == meta.context_lens.tolist()
    assert meta.cu_seqlens_k.tolist() == [0, *accumulate(p + 1 for p in positions)]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3]
    assert meta.max_seqlen_k == max(positions) + 1
    assert meta.slot_mapping.tolist() == [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
    assert [row[:len(t)] for row, t in zip(meta.block_tables.tolist(), tables)] == tables
    same_size = staged[-2][1]  # a step of three rows too, staged before the last one
    with pytest.raises(ValueError, match="a later stage replaced it"):
        same_size.meta
    assert "built when read" in repr(same_size) and same_size != inp and inp == inp
    engine.abort_request("m0")
    engine.step()  # stages a step of two rows
    with pytest.raises(ValueError, match="a later stage replaced it"):
        staged[-3][1].meta


def test_a_staged_input_has_every_field_of_a_model_input_and_a_batch_of_one_stages_as_any_other():
    """StagedModelInput sets its fields itself (not through the dataclass __init__): each one
    ModelInput declares is there. A batch-1 decode stages
    through its own short path: the same static buffers as a step of more sequences would hold."""
    import dataclasses

    llm = _llm()
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    engine.add_request("one", prompts_of([19], seed=5, vocab=4000)[0],
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seen, real_prepare = [], runner.prepare_input
    runner.prepare_input = lambda plan: seen.append((plan, real_prepare(plan))) or seen[-1][1]
    for _ in range(20):  # past a block boundary (prompt 19 tokens, 16-token blocks)
        engine.step()
    staged = [(plan, inp) for plan, inp in seen if inp.graph_rows is not None]
    assert len(staged) >= 18
    plan, inp = staged[-1]
    for f in dataclasses.fields(inp):
        assert hasattr(inp, f.name), f.name
    assert (inp.drafts, inp.host, inp.logits_indices) == ({}, None, None)  # (greedy, greedy_ids: set by run)
    seq, p = plan.scheduled[0].seq, plan.scheduled[0].start_pos
    meta = inp.meta
    bs = meta.block_size
    assert inp.input_ids.tolist() == [seq.token_ids[p]] and inp.positions.tolist() == [p]  # (the token at p)
    assert meta.context_lens_cpu == [p + 1] and meta.block_tables.tolist()[0][:len(seq.block_table)] == seq.block_table
    assert meta.slot_mapping.tolist() == [seq.block_table[p // bs] * bs + p % bs]
    assert inp.meta is meta  # built before: kept (its tensors are views, as every staged step's are)
    runner.prepare_input = real_prepare
    llm.shutdown()


def test_the_startup_log_says_when_enforce_eager_turns_the_graphs_off(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = _llm(enforce_eager=True)
    assert "CPU graphs off: enforce_eager=True" in caplog.text
    assert llm.llm_engine.runner.graph_runner is None
    llm.shutdown()


def test_the_log_names_why_cpu_graphs_are_off(tiny_ckpt, monkeypatch, caplog):
    """With the fused C ops switched off the log listed "attention backend torch, dtype torch.float32,
    quantization None, tensor_parallel_size=1", every one of them a supported value: the cause went unnamed."""
    import logging

    from minivllm import LLM

    monkeypatch.setenv("MINIVLLM_CPU_FUSED_OPS", "0")
    with caplog.at_level(logging.INFO, logger="minivllm"):
        LLM(tiny_ckpt, num_kvcache_blocks=16).shutdown()
    assert "CPU graphs off: the fused C ops are off (MINIVLLM_CPU_FUSED_OPS=0" in caplog.text
    caplog.clear()
    monkeypatch.delenv("MINIVLLM_CPU_FUSED_OPS")
    with caplog.at_level(logging.INFO, logger="minivllm"):
        LLM(tiny_ckpt, num_kvcache_blocks=16, quantization="int8").shutdown()
    assert "CPU graphs off: quantization 'int8'" in caplog.text
    # the decode kernel switched off read "attention backend torch has no CPU graph support" (it has, with its kernel)
    caplog.clear()
    monkeypatch.setenv("MINIVLLM_CPU_DECODE_KERNEL", "0")
    with caplog.at_level(logging.INFO, logger="minivllm"):
        LLM(tiny_ckpt, num_kvcache_blocks=16).shutdown()
    assert "CPU graphs off: the torch backend's C decode kernel is off (MINIVLLM_CPU_DECODE_KERNEL=0)" in caplog.text
    assert "has no CPU graph support" not in caplog.text
    # a bfloat16 model read "the torch backend's C decode kernel is off (None); dtype torch.bfloat16 (...)"
    caplog.clear()
    monkeypatch.delenv("MINIVLLM_CPU_DECODE_KERNEL")
    with caplog.at_level(logging.INFO, logger="minivllm"):
        LLM(tiny_ckpt, num_kvcache_blocks=16, dtype="bfloat16").shutdown()
    said = [r.getMessage() for r in caplog.records if "CPU graphs off" in r.getMessage()]
    assert said == ["CPU graphs off: dtype torch.bfloat16 (CPU graphs need float32)"]
