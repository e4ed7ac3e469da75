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
    pf.note(300)  # block 300 in use: up to 301 blocks + 1 MiB
    assert pf.wait() and pf.done == 301 * 8192 + (1 << 20)
    pages = _resident(region.data_ptr(), region.nbytes)
    assert all(pages[:pf.done // 4096]) and not any(pages[-256:])
    pf.note(100)  # lower than before: nothing to do
    assert pf.done == 301 * 8192 + (1 << 20)
    pf.close()
    pf.note(900)  # closed: no more work
    assert pf.done == 301 * 8192 + (1 << 20) and pf._thread is None


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
    assert pf.done == min(pf.region_bytes, (bm.high_water + 1) * pf.block_bytes + pf.ahead_bytes)
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
