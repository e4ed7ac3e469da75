"""``LLM.shutdown()`` gives the model's memory back at once (chapter 06: "shutting it down returns its
memory"): a CPU graph's closure referred back to its runner, and each parameter's ``weight_loader`` (its
module's bound method) back to its module, so the weights waited for Python's cycle collector; and
glibc kept the freed blocks (found re-running chapter 12's big-model cell: +3.3 GB resident a run)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from minivllm import LLM
from minivllm.engine import llm_engine
from minivllm.utils.heap_trim import trim_heap


@pytest.mark.parametrize("eager", [False, True])
def test_shutdown_frees_every_module_without_the_cycle_collector(eager):
    llm = LLM(num_kvcache_blocks=32, enforce_eager=eager)
    llm.generate([[5, 6, 7], [8, 9]], use_tqdm=False)  # decode steps: CPU graphs recorded (eager: none)
    if not eager:
        assert llm.llm_engine.runner.graph_runner.num_recordings > 0
    modules = [weakref.ref(m) for m in llm.llm_engine.runner.model.modules()]
    kv = weakref.ref(llm.llm_engine.runner.kv_cache)
    gc.collect()
    gc.disable()  # only reference counts may free them
    try:
        llm.shutdown()
        alive = [type(r()).__name__ for r in modules if r() is not None]
        assert not alive and kv() is None, alive[:5]
    finally:
        gc.enable()


def test_shutdown_returns_the_heap_to_the_os(monkeypatch):
    calls = []
    monkeypatch.setattr(llm_engine, "trim_heap", lambda: calls.append(1))
    LLM(num_kvcache_blocks=32).shutdown()
    assert calls == [1]
    assert trim_heap() in (True, False)  # glibc: malloc_trim ran; elsewhere a no-op


def test_trim_heap_releases_freed_blocks_on_glibc():
    psutil = pytest.importorskip("psutil")
    if not trim_heap():
        pytest.skip("no malloc_trim in this C library")
    proc = psutil.Process()
    big = torch.ones(6 << 20)
    del big  # a 24 MiB mapping freed: glibc's mmap threshold rises to 24 MiB, as once a model was loaded
    blocks = [torch.ones(2 << 20) for _ in range(64)]  # 8 MiB each: now from the heap, not their own mappings
    del blocks[::2]  # every other one freed: holes the heap cannot shrink past
    held = proc.memory_info().rss
    trim_heap()
    assert proc.memory_info().rss < held - (100 << 20)  # most of the 256 MiB freed went back


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_shutdown_frees_the_weights_even_where_the_model_is_still_held(quantization):
    """A Jupyter cell interrupted in the middle of a step keeps its traceback, and the traceback's frames
    hold the model: chapter 05's 0.6B engine, shut down by the cell's finally, kept 3.6 GB resident until
    the next error. shutdown() now gives the tensors' memory back whoever still holds the module."""
    llm = LLM(num_kvcache_blocks=32, quantization=quantization)
    llm.generate([[5, 6, 7]], use_tqdm=False)
    model = llm.llm_engine.runner.model  # what the frames of an interrupted step hold
    tensors = [t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values(),
                                                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor)))
               if t is not None and not t.is_mkldnn]
    assert sum(t.untyped_storage().nbytes() for t in tensors) > 1 << 20
    kept = {k: v for k, v in model.state_dict().items() if not v.is_mkldnn}  # taken before: must stay readable
    llm.shutdown()
    assert sum(t.untyped_storage().nbytes() for t in tensors) == 0
    # (a first version shrank the storage itself: reading a tensor that shared it crashed the process)
    assert all(torch.isfinite(v.float()).all() for v in kept.values())
