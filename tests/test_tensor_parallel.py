"""Tensor parallelism: shard layouts, a real 2-process (gloo, CPU) run against HF, and the
engine at tensor_parallel_size=2: same tokens as tp=1, preemption, prefix caching, two
engines at once, worker failures, no orphan workers, and a torchrun launch.

Engine tests run the workers on CPU with gloo (NCCL needs one GPU per rank).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers_models import PagedRunner, allocate_block_tables, load_hf_model, make_hf_checkpoint
from helpers_engine import greedy, make_llm, prompts_of, run_to_end, token_lists
from minivllm import LLM, SamplingParams
from minivllm.distributed import get_tp_rank, get_tp_size, set_tp, tp_scope
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.prepack import dense


@pytest.fixture
def tp_state():
    yield set_tp
    set_tp(0, 1)


def test_defaults_are_single_rank():
    assert (get_tp_rank(), get_tp_size()) == (0, 1)


def test_set_tp_validates():
    with pytest.raises(ValueError, match="rank"):
        set_tp(2, 2)
    with pytest.raises(ValueError, match="size"):
        set_tp(0, 0)
    assert (get_tp_rank(), get_tp_size()) == (0, 1)


def test_indivisible_heads_refused(tp_state):
    tp_state(0, 3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(48, 16, 4, 2)
    tp_state(0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(48, 16, 4, 2)


def test_shards_concatenate_to_full(tp_state):
    """Each rank's slice of the packed layers, reassembled, is the full checkpoint tensor."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * 4, 8, generator=gen) for n in (4, 2, 2))  # 4 heads, 2 kv, head_dim 4
    gate, up = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    down = torch.randn(8, 6, generator=gen)
    emb = torch.randn(7, 8, generator=gen)  # vocab 7, padded to 8 at tp=2
    parts = {"q": [], "k": [], "v": [], "gate": [], "up": [], "down": [], "emb": []}
    for rank in range(2):
        tp_state(rank, 2)
        qkv = QKVParallelLinear(8, 4, 4, 2)
        for sid, w in zip("qkv", (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, w, sid)
        lq, lk, lv = qkv.weight.split([qkv.q_size, qkv.kv_size, qkv.kv_size])
        parts["q"].append(lq), parts["k"].append(lk), parts["v"].append(lv)
        gu = MergedColumnParallelLinear(8, [6, 6])
        gu.weight.weight_loader(gu.weight, torch.cat([gate, up]))  # packed form
        lg, lu = gu.weight.chunk(2)
        parts["gate"].append(lg), parts["up"].append(lu)
        row = RowParallelLinear(6, 8)
        row.weight.weight_loader(row.weight, down)
        parts["down"].append(row.weight.clone())
        e = VocabParallelEmbedding(7, 8)
        e.weight.weight_loader(e.weight, emb)
        parts["emb"].append(e.weight.clone())
    for name, full, dim in [("q", q, 0), ("k", k, 0), ("v", v, 0), ("gate", gate, 0), ("up", up, 0),
                            ("down", down, 1)]:
        assert torch.equal(torch.cat(parts[name], dim), full), name
    padded = torch.cat(parts["emb"])
    assert padded.shape == (8, 8) and torch.equal(padded[:7], emb) and not padded[7].any()


def _tp_worker(rank: int, world: int, init_file: str, ckpt: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    set_tp(rank, world)
    torch.set_num_threads(1)
    try:
        results = {}
        for label, seed in (("loaded", None), ("random", 11)):
            runner = PagedRunner(ckpt, random_seed=seed)
            assert runner.model.num_kv_heads_per_rank == 1  # 2 kv heads over 2 ranks
            tables = allocate_block_tables([12, 6], runner.BLOCK_SIZE, runner.NUM_BLOCKS)
            a, b = list(range(3, 15)), list(range(40, 46))
            first = runner.step([a[:7], b[:5]], [0, 0], tables)
            second = runner.step([a[7:], b[5:]], [7, 5], tables)
            results[label] = [torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]])]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_match_hf_and_single_rank(tmp_path):
    # vocab 97 is odd: exercises the padded vocab shard; 4 heads / 2 kv heads / 80 intermediate split in 2.
    ckpt = make_hf_checkpoint(tmp_path, seed=5)
    init_file = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_tp_worker, args=(2, init_file, str(ckpt), str(tmp_path)), nprocs=2, join=True)
    hf = load_hf_model(ckpt)
    single = PagedRunner(ckpt, random_seed=11)
    tables = allocate_block_tables([12, 6], single.BLOCK_SIZE, single.NUM_BLOCKS)
    a, b = list(range(3, 15)), list(range(40, 46))
    s1 = single.step([a[:7], b[:5]], [0, 0], tables)
    s2 = single.step([a[7:], b[5:]], [7, 5], tables)
    with torch.no_grad():
        ref = [hf(torch.tensor([a])).logits[0], hf(torch.tensor([b])).logits[0]]
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for got, want in zip(res["loaded"], ref):
            assert got.shape == want.shape  # padded vocab column dropped
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # random weights are drawn at full shape, so tp=2 builds the same model as tp=1
        for got, want in zip(res["random"], [torch.cat([s1[0], s2[0]]), torch.cat([s1[1], s2[1]])]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_tp_scope_is_per_thread_and_nests():
    seen = {}
    with tp_scope(1, 2):
        with tp_scope(0, 4):
            assert (get_tp_rank(), get_tp_size()) == (0, 4)
        assert (get_tp_rank(), get_tp_size()) == (1, 2)
        t = threading.Thread(target=lambda: seen.update(other=(get_tp_rank(), get_tp_size())))
        t.start()
        t.join()
    assert seen["other"] == (0, 1)  # another thread keeps the process-wide state
    assert (get_tp_rank(), get_tp_size()) == (0, 1)


# -- the engine at tensor_parallel_size=2 ---------------------------------------------------------
# Workers are real processes (python -m minivllm.executor.worker) talking gloo over 127.0.0.1.

def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - start < timeout, f"workers {[p for p in pids if _alive(p)]} still running"
        time.sleep(0.05)
    return time.monotonic() - start


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture(scope="module")
def ckpt_1001(tmp_path_factory) -> Path:
    """A random Qwen3 with vocabulary 1001: odd, so at tp=2 the vocab shards are padded to 1002."""
    
    return make_hf_checkpoint(tmp_path_factory.mktemp("v1001"), seed=3, vocab_size=1001)


DEFAULT_ARGS = dict(num_kvcache_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def default_model(request):
    """``(model, prompts)``: ``None`` (what ``LLM()`` loads: the embedded model) with text
    prompts; before the embedded checkpoint exists, the tiny random one with token ids."""
    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

    if (EMBEDDED_MODEL_DIR / "config.json").is_file() and not os.environ.get("MINIVLLM_MODEL"):
        return None, ["def main():", "The built-in function", "Return a new list", "x"]
    return str(request.getfixturevalue("tiny_ckpt")), prompts_of([5, 17, 9, 30], seed=1)


@pytest.fixture(scope="module")
def tp2_default(default_model):
    llm = LLM(default_model[0], tensor_parallel_size=2, **DEFAULT_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp2_1001(ckpt_1001):
    llm = make_llm(ckpt_1001, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_indivisible_heads_refused_at_start(tiny_ckpt):
    # tiny: 4 heads, 2 kv heads, intermediate 80; refused before any worker starts
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        make_llm(tiny_ckpt, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        make_llm(tiny_ckpt, tensor_parallel_size=4)


def test_tp2_greedy_matches_tp1_default_model(default_model, tp2_default):
    """``LLM()`` (the embedded model) at tp=2 generates the same greedy tokens as at tp=1."""
    model, prompts = default_model
    want = token_lists(LLM(model, **DEFAULT_ARGS).generate(prompts, greedy(16), use_tqdm=False))
    assert token_lists(tp2_default.generate(prompts, greedy(16), use_tqdm=False)) == want


def test_tp2_vocab_1001_matches_tp1_and_never_samples_padding(ckpt_1001, tp2_1001):
    prompts = prompts_of([4, 11, 23, 6], seed=2, vocab=1001)
    want = token_lists(make_llm(ckpt_1001).generate(prompts, greedy(12), use_tqdm=False))
    runner = tp2_1001.llm_engine.runner
    assert runner.model.lm_head.num_embeddings_padded == 1002  # this rank's shard: rows 0..500
    layer = runner.model.model.layers[0]  # rank 0 holds half of every sharded weight
    assert runner.model.lm_head.weight.shape == (501, 48)
    # (dense(): on the CPU a weight is held packed, panels [out/16, in, 16] or oneDNN's layout)
    assert dense(layer.self_attn.qkv_proj.weight).shape == ((4 + 2 + 2) * 16 // 2, 48)
    assert dense(layer.mlp.down_proj.weight).shape == (48, 40)
    assert runner.kv_caches[0][0].shape[-2:] == (1, 16)  # one of the two KV heads
    widths = []
    sampler = runner.sampler
    runner.sampler = lambda logits, batch: (widths.append(logits.shape[-1]), sampler(logits, batch))[1]
    try:
        assert token_lists(tp2_1001.generate(prompts, greedy(12), use_tqdm=False)) == want
        # random sampling at a high temperature over many steps: every token is a real one
        hot = SamplingParams(temperature=5.0, max_tokens=24, ignore_eos=True, seed=7)
        tokens = [t for o in tp2_1001.generate(prompts, hot, use_tqdm=False) for t in o.outputs[0].token_ids]
    finally:
        runner.sampler = sampler
    assert set(widths) == {1001}
    assert max(tokens) < 1001 and len(tokens) == 4 * 24


def test_tp2_preemption_matches_tp1(tiny_ckpt, monkeypatch):
    """A pool of 8 blocks forces recompute preemption; the workers see the recomputed tokens.
    (The tp=2 engine also runs with ``compile=True``: the COMPILE message reaches the worker,
    whose torch.compile is made a no-op by TORCHDYNAMO_DISABLE to keep this test fast.)"""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # read by the worker when torch starts
    prompts = prompts_of([7, 7, 7], seed=3)
    args = dict(num_kvcache_blocks=8, max_model_len=32)
    results = []
    for tp in (1, 2):
        llm = make_llm(tiny_ckpt, tensor_parallel_size=tp, compile=tp == 2, **args)
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(10))
        final, records = run_to_end(engine)
        assert any(r.preempted for r in records), f"tp={tp}: the pool of 8 blocks should force a preemption"
        results.append([final[str(i)].outputs[0].token_ids for i in range(3)])
        pids = engine.runner.worker_pids if tp > 1 else []
        llm.shutdown()
        _wait_gone(pids, timeout=10.0)  # no orphan after shutdown()
    assert results[0] == results[1]
    assert all(len(t) == 10 for t in results[1])
    assert compiled  # rank 0 compiled its ops after telling the worker to


def test_tp2_prefix_caching_matches_tp1(default_model, tp2_default):
    prefix = prompts_of([37], seed=4)[0]
    first, second = prefix + [5, 6], prefix + [7, 8, 9]
    ref = LLM(default_model[0], enable_prefix_caching=False, **DEFAULT_ARGS)
    want = [token_lists(ref.generate([p], greedy(6), use_tqdm=False))[0] for p in (first, second)]
    tp2_default.llm_engine.reset_prefix_cache()
    a = tp2_default.generate([first], greedy(6), use_tqdm=False)[0]
    b = tp2_default.generate([second], greedy(6), use_tqdm=False)[0]
    assert b.num_cached_tokens == 32  # two full blocks of 16 of the shared 37-token prefix
    assert [a.outputs[0].token_ids, b.outputs[0].token_ids] == want


def test_two_tp2_engines_alive_at_once(default_model, ckpt_1001, tp2_default, tp2_1001):
    """Two tp=2 engines (and tp=1 ones) in one process, stepped alternately, each still right."""
    r_a, r_b = tp2_default.llm_engine.runner, tp2_1001.llm_engine.runner
    assert r_a.conn.store.port != r_b.conn.store.port
    assert not set(r_a.worker_pids) & set(r_b.worker_pids)
    p_a, p_b = prompts_of([9, 3], seed=5), prompts_of([6, 14], seed=6, vocab=1001)
    want_a = token_lists(LLM(default_model[0], **DEFAULT_ARGS).generate(p_a, greedy(8), use_tqdm=False))
    want_b = token_lists(make_llm(ckpt_1001).generate(p_b, greedy(8), use_tqdm=False))
    engines = [tp2_default.llm_engine, tp2_1001.llm_engine]
    for engine, prompts in zip(engines, (p_a, p_b)):
        for i, p in enumerate(prompts):
            engine.add_request(f"both-{i}", p, greedy(8))
    finals = [{}, {}]
    while any(e.has_unfinished_requests() for e in engines):
        for engine, final in zip(engines, finals):
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out.outputs[0].token_ids
    assert [finals[0][f"both-{i}"] for i in range(2)] == want_a
    assert [finals[1][f"both-{i}"] for i in range(2)] == want_b


@linux_only
def test_killed_worker_makes_generate_raise_within_seconds(tiny_ckpt):
    llm = make_llm(tiny_ckpt, tensor_parallel_size=2)
    engine = llm.llm_engine
    (pid,) = engine.runner.worker_pids
    step, killed_at, failed_at = engine.step, [], []

    def step_then_kill():  # SIGKILL the worker in the middle of a generation, after its 5th step
        try:
            result = step()
        except BaseException:
            failed_at.append(engine.step_index)  # a failed step leaves step_index at the committed count
            raise
        if len(killed_at) == 0 and engine.step_index == 5:
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)
        return result

    engine.step = step_then_kill
    with pytest.raises(RuntimeError, match="signal 9"):
        llm.generate(prompts_of([20, 30], seed=7), greedy(50), use_tqdm=False)
    assert killed_at, "the generation ended before its 5th step"
    # the very next step after the kill is the one that raised: no step completed without the worker
    assert failed_at == [5] and engine.step_index == 5, (failed_at, engine.step_index)
    assert time.monotonic() - killed_at[0] < 30.0  # a hang detector only, not a latency bound
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
    llm.shutdown()
    assert not _alive(pid)


def test_a_worker_dead_while_the_model_group_is_built_is_named(tiny_ckpt, monkeypatch):
    # LLM() waited out MINIVLLM_TP_TIMEOUT and raised DistStoreError "wait timeout ... keys: /model/0/1",
    # naming no worker
    from minivllm.executor import launch

    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "2")
    build, pids = launch.create_model_group, []

    def kill_then_build(conn, backend, device):
        if conn.rank == 0:
            for p in conn.procs:
                pids.append(p.pid)
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        return build(conn, backend, device)

    monkeypatch.setattr(launch, "create_model_group", kill_then_build)
    with pytest.raises(RuntimeError, match=r"worker failed while starting: rank 1 \(pid \d+\) was killed by signal 9"):
        make_llm(tiny_ckpt, tensor_parallel_size=2)
    assert pids and not any(_alive(pid) for pid in pids)


def test_a_worker_stopped_while_idle_fails_the_next_step_within_the_timeout(tiny_ckpt):
    # rank 0's step header to a worker that stopped taking messages (SIGSTOP, or hung) waited on the control
    # group's one-year timeout: generate() blocked for good, MINIVLLM_TP_TIMEOUT unheeded
    import datetime

    llm = make_llm(tiny_ckpt, tensor_parallel_size=2)
    # MINIVLLM_TP_TIMEOUT=2 for the messages alone: set before the start it also bounds building the model
    # group, which a slow machine's worker can take longer than that to reach
    llm.llm_engine.runner._send_timeout = datetime.timedelta(seconds=2)
    (pid,) = llm.llm_engine.runner.worker_pids
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"did not take rank 0's message within 2 s \(MINIVLLM_TP_TIMEOUT\)"):
            llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
        assert time.monotonic() - started < 60.0  # a hang detector only, not a latency bound
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
    llm.shutdown()


def test_exception_in_worker_surfaces_in_caller(tiny_ckpt, monkeypatch):
    from minivllm.executor.worker import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 raises at its 4th step
    llm = make_llm(tiny_ckpt, tensor_parallel_size=2)
    engine = llm.llm_engine
    proc = engine.runner.conn.procs[0]
    step, calls, failed_at = engine.step, [], []

    def counting_step():
        calls.append(engine.step_index)
        try:
            return step()
        except BaseException:
            failed_at.append(engine.step_index)
            raise

    engine.step = counting_step
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(prompts_of([6], seed=8), greedy(10), use_tqdm=False)
    # rank 1's 4th step is the engine's 4th: three steps committed, the 4th raised, no retry after it
    assert calls == [0, 1, 2, 3] and failed_at == [3] and engine.step_index == 3, (calls, failed_at)
    assert time.monotonic() - start < 30.0  # a hang detector only, not a latency bound
    assert proc.wait(timeout=5) == 1  # the worker exited on its own, reporting failure
    llm.shutdown()


def test_an_interrupt_while_waiting_for_a_workers_report_still_stops_the_workers(tiny_ckpt, monkeypatch):
    """Rank 0's own forward raised a RuntimeError; the guard waits up to 3 s for a worker's report before
    stopping the workers, and a KeyboardInterrupt in that wait skipped the stop: the engine was not marked
    failed, its workers stayed mid-step, and the next call (or shutdown) hung until the collective timeout."""
    from minivllm.executor import launch

    llm = make_llm(tiny_ckpt, tensor_parallel_size=2)
    engine = llm.llm_engine
    runner, proc = engine.runner, engine.runner.conn.procs[0]
    layer = runner.model.model.layers[1]
    monkeypatch.setattr(layer, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("rank 0 only")))

    def interrupted_poll(*args, **kwargs):
        raise KeyboardInterrupt("pressed during the wait")

    monkeypatch.setattr(launch, "worker_failure", interrupted_poll)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts_of([6], seed=8), greedy(4), use_tqdm=False)
    monkeypatch.undo()
    assert runner._failure is not None and "rank 0 only" in runner._failure
    assert proc.wait(timeout=30) is not None  # the workers were stopped, not left mid-step
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate(prompts_of([6], seed=8), greedy(4), use_tqdm=False)
    llm.shutdown()


def test_an_interrupt_during_a_step_waits_for_the_collectives_and_the_engine_goes_on(tiny_ckpt, monkeypatch):
    """A kernel interrupt (SIGINT) that came while rank 0 was inside a step's forward raised there, in the
    middle of the collectives: the ranks were out of step and the engine refused every later step ("create
    a new LLM"), which chapter 10's learners met on Kernel > Interrupt. Now it is held until rank 0's part of
    the step is done: the step rolls back, nothing is lost, and the engine serves the next call."""
    llm = make_llm(tiny_ckpt, tensor_parallel_size=2)
    prompts = prompts_of([6, 9], seed=8)
    expected = token_lists(llm.generate(prompts, greedy(6), use_tqdm=False))
    runner = llm.llm_engine.runner
    layer = runner.model.model.layers[1]
    forward, sent = layer.forward, []

    def interrupted(*args, **kwargs):
        if not sent:  # once, in the middle of rank 0's forward, before this layer's all-reduces
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here: before the fix, the KeyboardInterrupt was raised here
        return forward(*args, **kwargs)

    monkeypatch.setattr(layer, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(6), use_tqdm=False)
    monkeypatch.undo()
    assert sent and runner._failure is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    assert not llm.llm_engine.has_unfinished_requests()
    assert token_lists(llm.generate(prompts, greedy(6), use_tqdm=False)) == expected
    llm.shutdown()


@linux_only
def test_no_orphan_after_garbage_collection(tiny_ckpt):
    llm = make_llm(tiny_ckpt, tensor_parallel_size=2)
    pids = llm.llm_engine.runner.worker_pids
    llm.generate([[3, 4, 5]], greedy(2), use_tqdm=False)
    del llm
    gc.collect()
    _wait_gone(pids, timeout=10.0)


@linux_only
def test_workers_are_outside_the_engines_process_group(tiny_ckpt):
    """A Jupyter kernel asked to shut down signals the children in its process group and waits until none is
    left; the workers it killed stayed zombies until the engine could reap them, after that wait, so a kernel
    holding a tensor-parallel engine took ~30 s to shut down and was then SIGTERMed (its exit handlers skipped).
    Outside the group, the engine's own shutdown at exit stops them (and they exit when it dies: below)."""
    llm = make_llm(tiny_ckpt, tensor_parallel_size=2)
    try:
        pids = llm.llm_engine.runner.worker_pids
        assert pids and all(os.getpgid(p) != os.getpgrp() for p in pids)
    finally:
        llm.shutdown()
    _wait_gone(pids, timeout=10.0)


_PARENT = """
import json, sys, time
sys.path.insert(0, {tests!r})
from helpers_engine import greedy, make_llm
llm = make_llm({ckpt!r}, tensor_parallel_size=2)
llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
print(json.dumps(llm.llm_engine.runner.worker_pids), flush=True)
if {mode!r} == "hang":
    time.sleep(600)
# mode "exit": leave without shutdown(); interpreter exit must stop the workers
"""


@linux_only
@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_no_orphan_when_parent_is_killed_or_exits(tiny_ckpt, mode):
    script = _PARENT.format(tests=str(Path(__file__).parent), ckpt=str(tiny_ckpt), mode=mode)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line, "the parent process did not start its engine"
        pids = json.loads(line)
        assert pids and all(_alive(p) for p in pids) or mode == "exit"
        if mode == "hang":
            parent.send_signal(signal.SIGKILL)  # what a Jupyter kernel restart does
        parent.wait(timeout=60)
        _wait_gone(pids, timeout=10.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TORCHRUN_SCRIPT = """
import json, sys
from minivllm import LLM, SamplingParams
ckpt, out, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
# every rank runs this; on rank 1 LLM(...) serves as the worker and then exits the process
llm = LLM(ckpt, tensor_parallel_size=2, block_size=4, num_kvcache_blocks=256)
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
with open(out, "w") as f:
    json.dump([o.outputs[0].token_ids for o in outs], f)
llm.shutdown()
"""


def test_torchrun_two_processes_match_tp1(tiny_ckpt, tmp_path):
    prompts = prompts_of([8, 19], seed=9)
    want = token_lists(make_llm(tiny_ckpt).generate(prompts, greedy(10), use_tqdm=False))
    script, out = tmp_path / "run.py", tmp_path / "tokens.json"
    script.write_text(_TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(script), str(tiny_ckpt), str(out), json.dumps(prompts)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text()) == want
    # a vLLM script expects every rank to return from LLM(...) (external_launcher): rank 1 says it will not
    assert "rank 1 of 2: this LLM(...) call serves as the rank's worker and does not return" in done.stderr


def test_init_method_with_the_worker_entry_point(tiny_ckpt):
    """The multi-machine recipe on one machine: rank 1 started by hand with
    ``python -m minivllm.executor.worker --init-method tcp://...``, the engine given the
    same ``init_method`` (it needs no model arguments: rank 0 sends them)."""
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine

    prompts = prompts_of([10, 4], seed=10)
    want = token_lists(make_llm(tiny_ckpt).generate(prompts, greedy(8), use_tqdm=False))
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    worker = subprocess.Popen([sys.executable, "-m", "minivllm.executor.worker", "--init-method", init,
                               "--rank", "1", "--world-size", "2"], env=env)
    try:
        args = EngineArgs(model=str(tiny_ckpt), tensor_parallel_size=2, block_size=4, num_kvcache_blocks=256)
        args.init_method = init  # an EngineArgs field (set as an attribute so this also runs before it exists)
        engine = LLMEngine(args)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(8))
        final, _ = run_to_end(engine)
        assert [final[str(i)].outputs[0].token_ids for i in range(2)] == want
        engine.shutdown()
        assert worker.wait(timeout=30) == 0
        assert not dist.is_initialized()  # the engine created the default group, and destroyed it
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.parametrize("env,init_method,message", [
    ({"MINIVLLM_TP_TIMEOUT": "inf"}, None, "MINIVLLM_TP_TIMEOUT='inf': must be a positive number of seconds"),
    ({"MINIVLLM_TP_TIMEOUT": "nan"}, None, "MINIVLLM_TP_TIMEOUT='nan'"),
    ({"MINIVLLM_TP_TIMEOUT": "1e300"}, None, "MINIVLLM_TP_TIMEOUT='1e300'"),
    ({"WORLD_SIZE": "two"}, None, "WORLD_SIZE='two': expected a whole number"),
    ({}, "bogus", "init_method='bogus': expected a URL starting with one of"),
    ({}, "tcp//host:1", "init_method='tcp//host:1'"),
])
def test_bad_launch_settings_are_named_before_any_worker_starts(tiny_ckpt, monkeypatch, env, init_method, message):
    """inf / nan / 1e300 failed inside gloo ("cannot convert float infinity to integer") after the workers
    had started; "bogus" with "No rendezvous handler for ://"; WORLD_SIZE=two with int()'s message."""
    import minivllm.executor.launch as launch

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = []
    monkeypatch.setattr(launch, "start_local", lambda *a: started.append(a))
    kwargs = {} if init_method is None else {"init_method": init_method}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        LLM(tiny_ckpt, tensor_parallel_size=2, num_kvcache_blocks=16, **kwargs)
    assert not started


def test_init_method_without_tensor_parallelism_is_refused(tiny_ckpt):
    """LLM(init_method=...) with one process ignored it silently."""
    with pytest.raises(ValueError, match="init_method='env://': only tensor parallelism"):
        LLM(tiny_ckpt, init_method="env://", num_kvcache_blocks=16)
