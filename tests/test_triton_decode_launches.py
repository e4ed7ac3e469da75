"""Kernel launches of one decode step replayed through the (emulated) CUDA-graph runner
(issue 15). Expected per step, on the host: one copy (the staged inputs); per layer: one
KV store and one decode-attention launch, plus one merge launch only when the step's
context bucket uses more than one KV split (never under the interpreter, which runs one
split; on a GPU ``decode_context_buckets`` keeps short contexts at few splits)."""
from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

if "minivllm.layers.attention.triton_kernels" in sys.modules:  # imported earlier without it
    importlib.reload(sys.modules["minivllm.layers.attention.triton_kernels"])

from minivllm.engine.cuda_graph import CudaGraphDecodeRunner  # noqa: E402
from minivllm.engine.kv_cache import allocate_kv_cache  # noqa: E402
from minivllm.layers.attention import triton_kernels as tk  # noqa: E402
from minivllm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402


class _Counting:
    """Wraps a Triton kernel: counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel, counts, name):
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.counts[self.name] = self.counts.get(self.name, 0) + 1
            return launch(*args, **kwargs)

        return run


def test_decode_step_launches(monkeypatch):
    from transformers import Qwen3Config

    from minivllm.models.qwen3 import Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      tie_word_embeddings=False)
    from minivllm.utils.loader import init_random_weights

    model = Qwen3ForCausalLM(cfg).float().eval()
    init_random_weights(model, 0)  # the constructor leaves parameters uninitialised (garbage can be inf/NaN)
    _, kv = allocate_kv_cache(cfg, 8, 16, torch.float32, "cpu")
    runner = CudaGraphDecodeRunner(model, kv, TritonAttentionBackend(), 4, 4, cfg.hidden_size, "cpu",
                                   torch.float32, emulate=True)
    runner.capture()
    counts: dict[str, int] = {}
    monkeypatch.setattr(tk, "kernels_interpreted", lambda: True)  # it inspects the kernel objects we wrap
    for name in ("_store_kv_kernel", "_paged_decode_kernel", "_merge_splits_kernel"):
        monkeypatch.setattr(tk, name, _Counting(getattr(tk, name), counts, name))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        n = runner.stage(np.array([5, 6, 7]), np.array([3, 9, 20]), np.array([19, 41, 52]),
                         np.array([4, 10, 21], dtype=np.int32), [[1], [2], [3, 3]])
    assert sum(e.name == "aten::copy_" for e in prof.events()) == 1
    runner.replay(n)
    layers = cfg.num_hidden_layers
    assert counts == {"_store_kv_kernel": layers, "_paged_decode_kernel": layers}
