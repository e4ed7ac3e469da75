"""``bench --speculative ngram``: decode latency with and without speculative decoding, same run.

Workload (a context that the continuation repeats): each prompt asks to copy a document
twice, then gives the document twice and the start of a third copy. The documents are
``pydoc_data.topics`` entries (they ship with CPython, and the embedded model was trained on
text like them), sorted by name, one per request. Every request is greedy with
``ignore_eos`` and the same number of new tokens; the two engines alternate rounds so that a
change in machine load hits both. Reported per batch size: median TPOT of each engine, their
ratio, the acceptance rate and mean accepted length, and whether every output is identical
(greedy speculation must not change a token). Speculation pays while verifying k drafts
costs about one memory-bound step; on a compute-bound step (a large batch, or a tiny model
whose steps are dominated by per-operation overhead) it stops paying, and the sweep shows where.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from minivllm.bench.common import ResultMixin, build_llm, device_label, loadavg

__all__ = ["SpeculativeResult", "run_speculative", "print_speculative", "repeat_prompts"]


def repeat_prompts(n: int, chars: int = 600) -> list[str]:
    """``n`` prompts whose continuation repeats their context (see the module docstring)."""
    import pydoc_data.topics

    names = sorted(k for k, v in pydoc_data.topics.topics.items() if len(v) >= chars)
    prompts = []
    for i in range(n):
        doc = pydoc_data.topics.topics[names[i % len(names)]][:chars]
        prompts.append("Copy the text below twice.\n\n" + doc + "\n\n" + doc + "\n\n" + doc[:chars // 3])
    return prompts


@dataclass
class SpeculativeResult(ResultMixin):
    """Rows: one per batch size, with ``tpot_ms`` / ``spec_tpot_ms`` (median over rounds of the
    median request TPOT), ``speedup`` (their ratio), ``acceptance_rate``,
    ``mean_accepted_length`` and ``identical`` (every greedy output equal)."""

    model: str
    device: str
    speculative_config: dict
    decode_tokens: int
    rounds: int
    loadavg_before: list | None
    loadavg_after: list | None
    rows: list[dict] = field(default_factory=list)


def _tpot(llm, prompts, params):
    from statistics import median

    outs = llm.generate(prompts, params, use_tqdm=False)
    return median(o.metrics.tpot_ms for o in outs), outs


def run_speculative(model: str | None = None, *, method: str = "ngram", num_speculative_tokens: int = 4,
                    batch_sizes=(1, 4, 16, 64), decode_tokens: int = 96, rounds: int = 3,
                    log=print, **engine_args) -> SpeculativeResult:
    """Measure greedy decode TPOT with and without ``speculative_config`` (see module docstring).

    Raises:
        ValueError: a bad speculative method or engine argument (from ``LLM``).
    """
    from minivllm import SamplingParams

    spec_config = {"method": method, "num_speculative_tokens": num_speculative_tokens,
                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    before = loadavg()
    base = build_llm(model, **engine_args)
    spec = build_llm(model, speculative_config=spec_config, **engine_args)
    result = SpeculativeResult(model=base.llm_engine.source.name, device=device_label(base.llm_engine.config.device),
                               speculative_config=spec_config, decode_tokens=decode_tokens, rounds=rounds,
                               loadavg_before=before, loadavg_after=None)
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    try:
        for b in batch_sizes:
            prompts = repeat_prompts(b)
            _tpot(base, prompts, params), _tpot(spec, prompts, params)  # warm-up
            base_t, spec_t = [], []
            for _ in range(rounds):
                t, base_outs = _tpot(base, prompts, params)
                base_t.append(t)
                t, spec_outs = _tpot(spec, prompts, params)
                spec_t.append(t)
            drafts = sum(o.metrics.num_draft_tokens for o in spec_outs)
            accepted = sum(o.metrics.num_accepted_draft_tokens for o in spec_outs)
            steps = sum(o.metrics.num_spec_steps for o in spec_outs)
            row = {"batch_size": b, "tpot_ms": statistics.median(base_t), "spec_tpot_ms": statistics.median(spec_t),
                   "acceptance_rate": accepted / drafts if drafts else None,
                   "mean_accepted_length": 1 + accepted / steps if steps else None,
                   "identical": [o.outputs[0].token_ids for o in base_outs] ==
                                [o.outputs[0].token_ids for o in spec_outs]}
            row["speedup"] = row["tpot_ms"] / row["spec_tpot_ms"]
            result.rows.append(row)
            log(f"batch {b}: TPOT {row['tpot_ms']:.2f} ms -> {row['spec_tpot_ms']:.2f} ms with speculation "
                f"({row['speedup']:.2f}x), acceptance {row['acceptance_rate'] or 0:.2f}, identical {row['identical']}")
    finally:
        base.shutdown()
        spec.shutdown()
    result.loadavg_after = loadavg()
    return result


def print_speculative(result: SpeculativeResult, log=print) -> None:
    log(f"\nspeculative decoding ({result.speculative_config['method']}, k="
        f"{result.speculative_config['num_speculative_tokens']}) on {result.model}, {result.device}, greedy, "
        f"{result.decode_tokens} new tokens, median of {result.rounds} alternating rounds; "
        f"load {result.loadavg_before} -> {result.loadavg_after}")
    log(f"{'batch':>6} {'TPOT ms':>9} {'spec ms':>9} {'speedup':>8} {'accept':>7} {'mean len':>9} identical")
    for r in result.rows:
        log(f"{r['batch_size']:>6} {r['tpot_ms']:>9.2f} {r['spec_tpot_ms']:>9.2f} {r['speedup']:>7.2f}x "
            f"{(r['acceptance_rate'] or 0):>7.2f} {(r['mean_accepted_length'] or 0):>9.2f} {r['identical']}")
    paying = [r["batch_size"] for r in result.rows if r["speedup"] > 1]
    losing = [r["batch_size"] for r in result.rows if r["speedup"] <= 1]
    if losing:
        log(f"speculation did not pay at batch {', '.join(map(str, losing))} on this machine")
    elif paying:
        log("speculation paid at every batch size measured")
