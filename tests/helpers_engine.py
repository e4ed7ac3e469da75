"""Helpers for engine-level tests."""
from __future__ import annotations

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **{**GREEDY, **kw})


def make_llm(ckpt, **engine_args) -> LLM:
    engine_args.setdefault("block_size", 4)
    engine_args.setdefault("num_kvcache_blocks", 256)
    return LLM(str(ckpt), **engine_args)


def run_to_end(engine: LLMEngine, max_steps: int = 10_000):
    """Step until idle; returns (final outputs by request id, step records)."""
    final, records = {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final, records
        result = engine.step_with_record()
        records.append(result.record)
        for out in result.outputs:
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def token_lists(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def prompts_of(lengths, seed: int = 0, vocab: int = 97) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def generate_spying_logits(llm, prompt, params):
    """Generate one prompt; returns (its ``CompletionOutput``, the raw fp32 logits row of every
    sampling step, as the runner computed them)."""
    runner = llm.llm_engine.runner
    rows, original = [], runner.forward_logits

    def spy(inp, *args):
        out = original(inp, *args)
        rows.append((out[0] if args else out)[0].clone())
        return out

    runner.forward_logits = spy
    try:
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0], rows
    finally:
        runner.forward_logits = original
