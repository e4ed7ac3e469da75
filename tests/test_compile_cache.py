"""torch.compile of the small fused ops: one Dynamo cache for the whole model, so dozens of
norm layers, batch sizes 1..n and a second engine of another dtype stay within Dynamo's
recompile limit (it silently falls back to eager past it)."""
from __future__ import annotations

import torch

from helpers_engine import greedy, make_llm, prompts_of


def test_norms_share_one_compiled_function_and_do_not_hit_the_recompile_limit(tiny_ckpt):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(tiny_ckpt, dtype=dtype)
        llm.llm_engine.runner.enable_compile(backend="eager")
        assert llm.llm_engine.runner.graph_runner is None  # CPU graphs off: they replay the C ops compile replaced
        norms = [m for m in llm.llm_engine.runner.model.modules() if type(m).__name__ == "RMSNorm"]
        assert len({id(m.norm_fn) for m in norms}) == 1 and len(norms) > 4
        for batch in (1, 2, 3, 7):
            outs[dtype, batch] = [o.outputs[0].token_ids for o in
                                  llm.generate(prompts_of([5] * batch, seed=batch), greedy(3), use_tqdm=False)]
        llm.shutdown()
    limit = torch._dynamo.config.recompile_limit if hasattr(torch._dynamo.config, "recompile_limit") \
        else torch._dynamo.config.cache_size_limit
    assert counters["stats"]["unique_graphs"] > 0  # compiled functions really ran
    assert not any("recompile limit" in k for k in counters["unimplemented"]), list(counters["unimplemented"])
    assert counters["frames"]["total"] == counters["frames"]["ok"]  # no frame fell back to eager
    # four compiled functions (norm, norm + residual, SiLU-and-mul, rotary), each within the limit
    assert counters["stats"]["unique_graphs"] <= 4 * limit
