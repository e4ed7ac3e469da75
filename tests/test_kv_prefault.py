"""The CPU KV pool's pages are made ahead of the blocks in use, in the background, without ever
changing what the engine wrote (minivllm/engine/kv_prefault.py)."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import pytest
import torch

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.engine.kv_prefault import KVPrefaulter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")


class _Cfg:  # 2 layers x 2 KV heads of 64: a block of 16 tokens is 8 KiB per region
    num_key_value_heads, num_hidden_layers, head_dim, hidden_size, num_attention_heads = 2, 2, 64, 128, 2


def _resident(ptr: int, nbytes: int) -> list[bool]:
    """Whether each 4 KiB page of [ptr, ptr + nbytes) is in memory (``mincore``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    lo = ptr // page * page
    n = -(-(ptr + nbytes - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(lo, n * page, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def _pool(num_blocks: int):
    cache, _ = allocate_kv_cache(_Cfg, num_blocks, 16, torch.float32, torch.device("cpu"))
    return cache


@linux_only
def test_pages_are_made_ahead_of_the_highest_block_and_no_further():
    cache = _pool(1024)  # 8 MiB per region, 4 regions
    pf = KVPrefaulter.for_pool(cache, ahead_bytes=1 << 20)
    assert pf is not None and pf.block_bytes == 8192 and pf.num_regions == 4
    region = cache[1, 1]
    assert not any(_resident(region.data_ptr(), region.nbytes))  # nothing made yet
    pf.note(-1)
    assert pf.wait() and pf.error is None, pf.error
    for k in range(2):
        for layer in range(2):
            pages = _resident(cache[k, layer].data_ptr(), cache[k, layer].nbytes)
            assert all(pages[:256]) and not any(pages[1024:])  # the first MiB made; past 4 MiB untouched
    pf.note(300)  # block 300 in use: 301 blocks + 1 MiB, rounded up to a whole huge page: 4 MiB
    assert pf.wait() and pf.done == 4 << 20
    pages = _resident(region.data_ptr(), region.nbytes)
    assert all(pages[:pf.done // 4096]) and not any(pages[-256:])
    pf.note(100)  # lower than before: nothing to do
    assert pf.done == 4 << 20
    pf.close()
    pf.note(900)  # closed: no more work
    assert pf.done == 4 << 20 and pf._thread is None


@linux_only
def test_making_pages_never_changes_what_was_written():
    """The engine may write a block while the thread makes its page: a page that exists is left as
    it is (MADV_POPULATE_WRITE makes missing pages only)."""
    cache = _pool(512)
    gen = torch.Generator().manual_seed(0)
    written = torch.randn(cache[0, 1, 5:9].shape, generator=gen)
    cache[0, 1, 5:9] = written
    cache[1, 0, 300] = 2.5
    pf = KVPrefaulter.for_pool(cache, ahead_bytes=4 << 20)  # the whole pool
    pf.note(511)
    assert pf.wait() and pf.done == cache[0, 0].nbytes
    assert torch.equal(cache[0, 1, 5:9], written) and bool((cache[1, 0, 300] == 2.5).all())
    cache[0, 1, 5:9] = 0
    cache[1, 0, 300] = 0
    assert cache.abs().sum().item() == 0  # everything else still reads zero
    pf.close()


def test_block_manager_calls_the_hook_with_each_new_highest_block():
    from minivllm.engine.sequence import Sequence
    from minivllm.sampling_params import SamplingParams

    seen = []
    bm = BlockManager(8, 4)
    bm.on_fresh_block = seen.append
    a = Sequence("a", None, list(range(1, 11)), SamplingParams())  # 10 tokens: 3 blocks
    bm.admit(a, [], [])
    bm.grow(a, len(a))
    assert a.block_table == [0, 1, 2] and seen == [0, 1, 2] and bm.high_water == 2
    bm.release(a)  # its blocks back in the pool (the partial last one plain, none registered)
    b = Sequence("b", None, list(range(50, 70)), SamplingParams())  # 20 tokens: 5 blocks
    bm.admit(b, [], [])
    bm.grow(b, len(b))
    fresh = [x for x in b.block_table if x > 2]
    assert seen == [0, 1, 2] + fresh and bm.high_water == max(b.block_table)  # reused blocks: no call


def test_switched_off_or_not_a_cpu_pool():
    assert KVPrefaulter.for_pool(None) is None
    assert KVPrefaulter.for_pool(torch.zeros(0, 2, 4)) is None


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv("MINIVLLM_KV_PREFAULT", "off")
    assert KVPrefaulter.for_pool(_pool(64)) is None


@linux_only
def test_the_engine_makes_its_pool_pages_ahead_and_stops_at_shutdown(tiny_ckpt):
    from helpers_engine import greedy, make_llm, prompts_of

    llm = make_llm(tiny_ckpt)
    runner, bm = llm.llm_engine.runner, llm.llm_engine.block_manager
    pf = runner.kv_prefaulter
    assert pf is not None and bm.on_fresh_block == pf.note
    llm.generate(prompts_of([30, 50, 20]), greedy(20), use_tqdm=False)
    assert bm.high_water >= 0
    assert pf.wait() and pf.error is None, pf.error
    want = (bm.high_water + 1) * pf.block_bytes + pf.ahead_bytes
    assert pf.done == min(pf.region_bytes, -(-want // (2 << 20)) * (2 << 20))
    llm.shutdown()
    assert runner.kv_prefaulter is None and pf._thread is None and pf._pool is None


@linux_only
def test_a_thread_that_cannot_start_leaves_the_step_alone(monkeypatch):
    """note() runs inside a step's scheduling: a thread refused by the system must not fail the step."""
    import threading

    pf = KVPrefaulter.for_pool(_pool(64))

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    pf.note(3)  # does not raise
    assert pf.error is not None and "can't start new thread" in pf.error and pf._thread is None
    pf.note(40)  # and stays quiet after


class _SmallBlocks:  # 2 KV heads of 16: a block of 16 tokens is 2 KiB, half a page
    num_key_value_heads, num_hidden_layers, head_dim, hidden_size, num_attention_heads = 2, 2, 16, 32, 2


@linux_only
def test_blocks_and_regions_that_are_not_whole_pages():
    """A block of 2 KiB and a region of 1001 blocks (neither a multiple of the 4 KiB page): every
    madvise start is rounded down to a page, so nothing fails and every region is made to its end."""
    cache, _ = allocate_kv_cache(_SmallBlocks, 1001, 16, torch.float32, torch.device("cpu"))
    pf = KVPrefaulter.for_pool(cache, ahead_bytes=4096)
    assert pf.block_bytes == 2048 and pf.region_bytes % 4096 != 0
    for b in (-1, 0, 1, 7, 1000):
        pf.note(b)
        assert pf.wait() and pf.error is None, pf.error
    assert pf.done == pf.region_bytes
    for k in range(2):
        for layer in range(2):
            assert all(_resident(cache[k, layer].data_ptr(), cache[k, layer].nbytes))
    pf.close()


@linux_only
def test_a_thread_starts_once_per_huge_page_of_growth_not_per_block(monkeypatch):
    """Each new highest block raises the target by a block; the target moves a whole huge page at a
    time, so blocks handed out one by one start a thread only when they cross into a new one."""
    import threading

    cache = _pool(2048)  # 16 MiB per region: 256 blocks of 8 KiB to a huge page
    pf = KVPrefaulter.for_pool(cache, ahead_bytes=2 << 20)
    starts, real_start = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: starts.append(1) or real_start(self))
    for b in range(-1, 1000):
        pf.note(b)
        pf.wait()
    assert pf.error is None and len(starts) <= 1 + 1000 // 256 + 1, len(starts)
    pf.close()


def test_a_tensor_parallel_worker_notes_the_highest_slot_of_each_step():
    """Worker ranks have no block manager: the step message's slot mapping says which blocks the
    step writes, and the worker's prefaulter is told the highest (padding slots are -1)."""
    import types

    from minivllm.executor.worker import unpack_step

    seen = []
    runner = types.SimpleNamespace(device=torch.device("cpu"), block_size=16,
                                   kv_prefaulter=types.SimpleNamespace(note=seen.append),
                                   _metadata=lambda *a: "meta")
    ids, pos, slots = [5, 6, 7], [40, 17, 3], [640, 273, -1]  # three tokens; the last row is padding
    q_lens, ctx_lens, tables, rows = [1, 1, 1], [41, 18, 4], [40, 0, 17, 0, 0, 0], [0, 1, 2]
    payload = torch.tensor(ids + pos + slots + q_lens + ctx_lens + tables + rows, dtype=torch.int64)
    header = torch.tensor([0, 3, 3, 3, 2, payload.numel()], dtype=torch.int64)
    inp = unpack_step(runner, header, payload)
    assert inp.meta == "meta" and seen == [640 // 16]


@linux_only
def test_close_returns_when_a_stopped_thread_holds_the_lock():
    """At interpreter exit a daemon thread stops wherever it is; one stopped inside the prefaulter's lock
    made close() (from an LLM collected at exit) wait for ever: a script that built an LLM and exited
    hung about one time in three. close() now gives up on the lock after its timeout."""
    import threading

    pf = KVPrefaulter.for_pool(_pool(64))
    assert pf is not None
    pf._lock.acquire()  # held for good, as by a thread frozen at exit
    finished = threading.Event()
    threading.Thread(target=lambda: (pf.close(timeout=0.2), finished.set()), daemon=True).start()
    assert finished.wait(10), "close() waited for ever on the lock"
    assert pf._closed and pf._pool is not None  # nothing else touches the pool; it stays referenced


@linux_only
def test_a_script_that_builds_an_llm_and_exits_at_once_exits(tmp_path):
    """The end-to-end case: the LLM is collected at interpreter exit while its prefault thread (stopped by
    the exit) holds the lock; here the lock is held on purpose so that the exit meets it every time."""
    import subprocess

    script = tmp_path / "exit_at_once.py"
    script.write_text(
        "import threading, torch\n"
        "torch.set_num_threads(1)\n"
        "from minivllm import LLM\n"
        "llm = LLM('minivllm-tiny', num_kvcache_blocks=64)\n"
        "pf = llm.llm_engine.runner.kv_prefaulter\n"
        "threading.Thread(target=pf._lock.acquire, daemon=True).start()\n"  # a daemon thread takes the lock
        "import time; time.sleep(0.2)\n"
        "print('built', flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-2000:]
