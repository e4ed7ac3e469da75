"""The engine's optional speed-ups are wired in: torch.compile of the small fused ops, and the
decode CUDA-graph path (emulated on CPU: same static buffers and padding, eager replay)."""
from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # the graph path needs a capturable backend: triton, interpreted here

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers_engine import greedy, make_llm, prompts_of  # noqa: E402

if "minivllm.layers.attention.triton_kernels" in sys.modules:
    importlib.reload(sys.modules["minivllm.layers.attention.triton_kernels"])


def test_compile_wraps_the_small_fused_ops(tiny_ckpt, monkeypatch):
    import minivllm.engine.model_runner as model_runner
    from minivllm.layers.activation import SiluAndMul
    from minivllm.layers.norm import RMSNorm, add_rms_norm, rms_norm
    from minivllm.layers.rotary import RotaryEmbedding

    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(model_runner, "_COMPILED", {})
    llm = make_llm(tiny_ckpt, compile=True)
    model = llm.llm_engine.runner.model
    # the norm functions are compiled once for the whole model, shared by every RMSNorm
    assert compiled.count(rms_norm) == 1 and compiled.count(add_rms_norm) == 1
    assert all(m.norm_fn is rms_norm and m.add_norm_fn is add_rms_norm for m in model.modules()
               if isinstance(m, RMSNorm))
    owners = [fn.__self__ for fn in compiled if hasattr(fn, "__self__")]
    assert {type(m) for m in owners} == {SiluAndMul, RotaryEmbedding}
    assert len(owners) == sum(isinstance(m, (SiluAndMul, RotaryEmbedding)) for m in model.modules())
    compiled.clear()
    make_llm(tiny_ckpt)  # default on CPU: off
    assert compiled == []


@pytest.mark.slow
def test_decode_graph_path_gives_the_eager_tokens(tiny_ckpt):
    prompts = prompts_of([5, 9, 14], seed=31)
    eager = make_llm(tiny_ckpt, attention_backend="triton", block_size=16, device="cpu")
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(5), use_tqdm=False)]
    eager.shutdown()
    llm = make_llm(tiny_ckpt, attention_backend="triton", block_size=16, device="cpu", max_num_seqs=2)
    runner = llm.llm_engine.runner
    runner.enable_cuda_graphs(max_num_seqs=2, max_model_len=llm.llm_engine.config.max_model_len, emulate=True)
    replays = []
    original = runner.graph_runner.replay  # the engine stages host arrays, then replays
    runner.graph_runner.replay = lambda n: replays.append(n) or original(n)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(5), use_tqdm=False)]
    assert got == expected
    assert replays and set(replays) <= {1, 2}  # decode steps of 1 and 2 sequences replayed
