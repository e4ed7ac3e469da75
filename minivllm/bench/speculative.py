"""``bench --speculative ngram|draft``: decode latency with and without speculative decoding, same run.

Workload (a context that the continuation repeats): each prompt asks to copy a document
twice, then gives the document twice and the start of a third copy. The documents are
``pydoc_data.topics`` entries (they ship with CPython, and the embedded model was trained on
text like them), sorted by name, one per request. Every request is greedy with
``ignore_eos`` and the same number of new tokens; the two engines alternate rounds so that a
change in machine load hits both. Reported per batch size: median TPOT of each engine, their
ratio, the acceptance rate and mean accepted length, and whether every output is identical
(greedy speculation must not change a token). Speculation pays while verifying k drafts
costs about one memory-bound step; on a compute-bound step (a large batch, or a tiny model
whose steps are dominated by per-operation overhead) it stops paying, and the sweep over batch
sizes shows where, for each method (the counter-case). ``draft`` also pays for k forwards of
the draft model per step, which the TPOT includes.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from minivllm.bench.common import ResultMixin, build_llm, check_batch_sizes, device_label, format_load, loadavg

__all__ = ["SpeculativeResult", "run_speculative", "print_speculative", "repeat_prompts", "speculative_config"]


def repeat_prompts(n: int, chars: int = 600) -> list[str]:
    """``n`` prompts whose continuation repeats their context (see the module docstring)."""
    import pydoc_data.topics

    names = sorted(k for k, v in pydoc_data.topics.topics.items() if len(v) >= chars)
    prompts = []
    for i in range(n):
        doc = pydoc_data.topics.topics[names[i % len(names)]][:chars]
        prompts.append("Copy the text below twice.\n\n" + doc + "\n\n" + doc + "\n\n" + doc[:chars // 3])
    return prompts


#: ``--speculative`` names -> vLLM's method names.
METHODS = {"ngram": "ngram", "draft": "draft_model"}
DEFAULT_DRAFT_MODEL = "minivllm-tiny-draft"


def speculative_config(method: str, k: int, draft_model: str | None = None) -> dict:
    """The ``speculative_config`` the bench uses for ``method`` ("ngram" or "draft"), with ``k``
    drafts a step.

    Raises:
        ValueError: another ``method`` (naming it)."""
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r}: choose from {sorted(METHODS)}")
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return {"method": "draft_model", "model": draft_model or DEFAULT_DRAFT_MODEL, "num_speculative_tokens": k}


@dataclass
class SpeculativeResult(ResultMixin):
    """Rows: one per (method, batch size), with ``method``, ``tpot_ms`` / ``spec_tpot_ms``
    (median over rounds of the median request TPOT, the unmodified engine's and the
    speculating one's), ``speedup`` (their ratio), ``acceptance_rate``,
    ``mean_accepted_length``, ``token_agreement`` (share of generated tokens equal to the
    unmodified engine's, position by position) and ``identical`` (every greedy output equal).
    ``speculative_config``: the first method's config; ``speculative_configs``: all of them."""

    model: str
    device: str
    speculative_config: dict
    decode_tokens: int
    rounds: int
    loadavg_before: list | None
    loadavg_after: list | None
    rows: list[dict] = field(default_factory=list)
    speculative_configs: list[dict] = field(default_factory=list)

    def stops_paying(self, method: str) -> int | None:
        """The smallest measured batch size from which ``method`` never beat the unmodified
        engine (speedup <= 1 there and at every larger batch measured); None if it paid at the
        largest."""
        rows = sorted((r for r in self.rows if r["method"] == method), key=lambda r: r["batch_size"])
        first = None
        for r in reversed(rows):
            if r["speedup"] > 1:
                break
            first = r["batch_size"]
        return first


def _tpot(llm, prompts, params):
    from statistics import median

    outs = llm.generate(prompts, params, use_tqdm=False)
    return median(o.metrics.tpot_ms for o in outs), outs


def _agreement(base_outs, spec_outs) -> float:
    same = total = 0
    for a, b in zip(base_outs, spec_outs):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        same += sum(u == v for u, v in zip(x, y))
        total += max(len(x), len(y))
    return same / total if total else 1.0


def run_speculative(model: str | None = None, *, method="ngram", num_speculative_tokens: int = 4,
                    batch_sizes=(1, 4, 16, 64), decode_tokens: int = 96, rounds: int = 3,
                    draft_model: str | None = None, log=print, **engine_args) -> SpeculativeResult:
    """Measure greedy decode TPOT with and without speculative decoding (see module docstring).

    ``method``: "ngram", "draft" (``draft_model``, default the embedded ``minivllm-tiny-draft``)
    or a list of them: every method is measured against the same unmodified engine, the
    engines alternating within each round. ``num_speculative_tokens``: drafts proposed per step.

    Raises:
        ValueError: a bad speculative method (or an empty list of them) or engine argument's value
            (from ``LLM``), a batch size
            below 1 or above a given ``max_num_seqs``, ``decode_tokens`` or ``rounds`` below 1.
        TypeError: an engine argument ``LLM`` does not know (naming it).
    """
    from minivllm import SamplingParams

    check_batch_sizes(batch_sizes, engine_args)
    if decode_tokens < 1 or rounds < 1:
        raise ValueError(f"decode_tokens={decode_tokens}, rounds={rounds}: each must be at least 1")
    methods = [method] if isinstance(method, str) else list(method)
    if not methods:  # [] failed at methods[0] after the base engine had loaded
        raise ValueError(f"method={method!r}: give a method, or a list of at least one, from {sorted(METHODS)}")
    configs = [speculative_config(m, num_speculative_tokens, draft_model) for m in methods]
    before = loadavg()
    base = build_llm(model, **engine_args)
    specs = []
    try:
        for c in configs:
            specs.append(build_llm(model, speculative_config=c, **engine_args))
        result = SpeculativeResult(model=base.llm_engine.source.name,
                                   device=device_label(base.llm_engine.config.device),
                                   speculative_config=configs[0], speculative_configs=configs,
                                   decode_tokens=decode_tokens, rounds=rounds, loadavg_before=before,
                                   loadavg_after=None)
        params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
        for b in batch_sizes:
            prompts = repeat_prompts(b)
            for llm in [base] + specs:  # warm-up
                _tpot(llm, prompts, params)
            base_t, spec_t = [], [[] for _ in specs]
            spec_outs = [None] * len(specs)
            for _ in range(rounds):
                t, base_outs = _tpot(base, prompts, params)
                base_t.append(t)
                for i, spec in enumerate(specs):
                    t, spec_outs[i] = _tpot(spec, prompts, params)
                    spec_t[i].append(t)
            for m, c, times, outs in zip(methods, configs, spec_t, spec_outs):
                drafts = sum(o.metrics.num_draft_tokens for o in outs)
                accepted = sum(o.metrics.num_accepted_draft_tokens for o in outs)
                steps = sum(o.metrics.num_spec_steps for o in outs)
                row = {"method": m, "batch_size": b, "tpot_ms": statistics.median(base_t),
                       "spec_tpot_ms": statistics.median(times),
                       "acceptance_rate": accepted / drafts if drafts else None,
                       "mean_accepted_length": 1 + accepted / steps if steps else None,
                       "token_agreement": _agreement(base_outs, outs),
                       "identical": [o.outputs[0].token_ids for o in base_outs] ==
                                    [o.outputs[0].token_ids for o in outs]}
                row["speedup"] = row["tpot_ms"] / row["spec_tpot_ms"]
                result.rows.append(row)
                log(f"{m} batch {b}: TPOT {row['tpot_ms']:.2f} ms -> {row['spec_tpot_ms']:.2f} ms with "
                    f"speculation ({row['speedup']:.2f}x), acceptance {row['acceptance_rate'] or 0:.2f}, "
                    f"identical {row['identical']}")
    finally:
        base.shutdown()
        for spec in specs:
            spec.shutdown()
    result.loadavg_after = loadavg()
    return result


def _describe(config: dict) -> str:
    return config["method"] + (f" ({config['model']})" if config.get("model") else "")


def print_speculative(result: SpeculativeResult, log=print) -> None:
    """Print ``result`` (TPOT with and without speculation, acceptance, mean accepted length) through ``log``."""
    configs = result.speculative_configs or [result.speculative_config]
    log(f"\nspeculative decoding ({', '.join(_describe(c) for c in configs)}; k="
        f"{configs[0]['num_speculative_tokens']}) on {result.model}, {result.device}, greedy, "
        f"{result.decode_tokens} new tokens, median of {result.rounds} alternating rounds; "
        f"load average (1 / 5 / 15 min) {format_load(result.loadavg_before)} -> {format_load(result.loadavg_after)}")
    log("TPOT ms: the unmodified engine's; spec ms: with speculation; accept: drafts accepted / proposed; mean len: "
        "tokens per verification step; agree: share of tokens equal to the unmodified engine's, position by position")
    log(f"{'method':>7} {'batch':>6} {'TPOT ms':>9} {'spec ms':>9} {'speedup':>8} {'accept':>7} {'mean len':>9} "
        f"{'agree':>6} identical")
    for r in result.rows:
        log(f"{r.get('method', configs[0]['method']):>7} {r['batch_size']:>6} {r['tpot_ms']:>9.2f} "
            f"{r['spec_tpot_ms']:>9.2f} {r['speedup']:>7.2f}x {(r['acceptance_rate'] or 0):>7.2f} "
            f"{(r['mean_accepted_length'] or 0):>9.2f} {r.get('token_agreement', 1.0):>6.3f} {r['identical']}")
    for m in dict.fromkeys(r.get("method") for r in result.rows):
        rows = [r for r in result.rows if r.get("method") == m]
        losing = [r["batch_size"] for r in rows if r["speedup"] <= 1]
        stop = result.stops_paying(m) if m is not None else None
        if not losing:
            log(f"{m}: speculation paid at every batch size measured")
        elif stop == min(r["batch_size"] for r in rows):
            log(f"{m}: speculation did not pay at any batch size measured on this machine")
        elif stop is not None:
            log(f"{m}: speculation stops paying from batch {stop} on this machine (speedup <= 1 there and at "
                f"every larger batch measured)")
        else:
            log(f"{m}: speculation did not pay at batch {', '.join(map(str, losing))} on this machine")
