"""The whole engine on the triton backend (Triton interpreter, CPU, fp32) against the torch
backend: same greedy tokens and logits within 2e-4 through prefill, chunked prefill,
mixed prefill+decode steps, prefix-cache hits and decode."""
from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (see test_triton_kernels)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

if "minivllm.layers.attention.triton_kernels" in sys.modules:
    importlib.reload(sys.modules["minivllm.layers.attention.triton_kernels"])

from helpers_engine import greedy, make_llm, prompts_of  # noqa: E402

ATOL = 2e-4


def _run(llm, batches, steps):
    """Generate each batch of prompts in turn (later batches hit the prefix cache);
    returns the outputs and every sampled row's logits per request."""
    runner = llm.llm_engine.runner
    logits_by_req: dict[str, list[torch.Tensor]] = {}
    original = runner.forward_logits

    def spy(inp):
        logits = original(inp)
        for row, seq in enumerate(inp.sampling_seqs):
            logits_by_req.setdefault(seq.request_id, []).append(logits[row].clone())
        return logits

    runner.forward_logits = spy
    outs = []
    try:
        for prompts in batches:
            outs += llm.generate(prompts, greedy(steps), use_tqdm=False)
    finally:
        runner.forward_logits = original
    return outs, [logits_by_req[o.request_id] for o in outs]


@pytest.mark.slow
def test_engine_on_triton_matches_torch_backend(tiny_ckpt):
    shared = prompts_of([40], seed=3)[0]
    first = [shared + [5, 6, 7]]
    # second batch: two prompts sharing the 40-token prefix (32 tokens = 2 blocks cached),
    # one fresh longer prompt that needs several chunks
    tails = prompts_of([3, 9], seed=4)
    second = [shared + tails[0], shared + tails[1], prompts_of([50], seed=5)[0]]
    results = {}
    for backend in ("torch", "triton"):
        llm = make_llm(tiny_ckpt, attention_backend=backend, block_size=16, device="cpu",
                       max_num_batched_tokens=24, max_num_seqs=4)
        assert llm.llm_engine.config.attention_backend == backend
        results[backend] = _run(llm, [first, second], steps=5)
        cached = [o.num_cached_tokens for o in results[backend][0]]
        assert cached[1] >= 32 and cached[2] >= 32, cached  # prefix hits happened
        llm.shutdown()
    (ref_outs, ref_logits), (tri_outs, tri_logits) = results["torch"], results["triton"]
    for ro, to, rl, tl in zip(ref_outs, tri_outs, ref_logits, tri_logits):
        assert to.outputs[0].token_ids == ro.outputs[0].token_ids
        assert len(rl) == len(tl) == 5
        for a, b in zip(rl, tl):
            assert (a - b).abs().max().item() < ATOL
