"""Measurement sweeps on the live engine: step latency by phase, and end-to-end request latency.

Every figure is a ``StepRecord.wall_ms`` or a ``RequestMetrics`` value from real engine
steps on this machine. Prompts are random token ids (seeded), so the prefix cache never
hits by accident (it is also reset before each point), and ``ignore_eos`` keeps the
number of decode steps exact.
"""
from __future__ import annotations

import random
import statistics
import weakref

from minivllm.sampling_params import SamplingParams
from minivllm.utils.checks import is_count
from minivllm.utils.gc_heap import heap_frozen

from ._engine import engine_of

_counter = [0]


def _new_id(prefix: str) -> str:
    _counter[0] += 1
    return f"{prefix}-{_counter[0]}"


def _require_idle(engine) -> None:
    if engine.has_unfinished_requests():
        raise ValueError(f"the engine has {engine.get_num_unfinished_requests()} unfinished request(s); "
                         "measurements need it to themselves (finish or reset them first)")


def _require_positive_int(label: str, value) -> None:
    """Raise ``ValueError("{label} must be a positive int")`` unless ``value`` is an int >= 1 (numpy's
    integers too; not a bool)."""
    if not is_count(value, 1):
        raise ValueError(f"{label} must be a positive int")



def random_prompt(engine, length: int, rng: random.Random) -> list[int]:
    """``length`` random token ids in ``[1, vocab_size)`` avoiding the eos ids."""
    _require_positive_int(f"prompt length {length!r}", length)
    eos = set(engine.eos_token_ids)
    out = []
    while len(out) < length:
        t = rng.randrange(1, engine.vocab_size)
        if t not in eos:
            out.append(t)
    return out


def run_requests(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    """Add all ``prompts`` at once (greedy, ``ignore_eos``), step until done.

    Returns (final ``RequestOutput`` per prompt in order, every ``StepRecord``).
    """
    engine = engine_of(llm)
    _require_idle(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [_new_id("measure") for _ in prompts]
    final, records = {}, []
    try:  # the adds too: an interrupt between two leaves none queued (aborting one never added is a no-op)
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params, output_kind="final_only")  # as LLM.generate does
        with heap_frozen():  # a full collection of the process's heap is not the step (minivllm.utils.gc_heap)
            while engine.has_unfinished_requests():
                res = engine.step_with_record()
                records.append(res.record)
                for out in res.outputs:
                    if out.finished:
                        final[out.request_id] = out
    finally:
        for rid in ids:  # an interrupt leaves nothing behind
            if rid not in final:
                engine.abort_request(rid)
    return [final[i] for i in ids], records


_cost_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> (cost, peaks)


def _roofline(engine, record, row: dict) -> None:
    """Add the roofline figures of ``record`` to ``row`` (engine-filled when present)."""
    from minivllm.telemetry.peaks import get_peaks
    from minivllm.telemetry.roofline import arithmetic_intensity, engine_cost, fill_step_record

    if record.mfu is None:
        if engine not in _cost_cache:
            _cost_cache[engine] = (engine_cost(engine), get_peaks(engine.config.device, engine.config.dtype))
        cost, peaks = _cost_cache[engine]
        fill_step_record(record, cost, peaks)
    row.update(flops=record.flops, bytes=record.bytes_moved,
               intensity=arithmetic_intensity(record.flops, record.bytes_moved), mfu=record.mfu, mbu=record.mbu)


def warm_up(llm, seed: int = 0) -> None:
    """One short request, so first-call costs (allocation, kernel selection) are not measured."""
    engine = engine_of(llm)
    run_requests(llm, [random_prompt(engine, 8, random.Random(seed))], 2)
    engine.reset_prefix_cache()


def measure_step_latency(llm, prompt_lens=(16, 32, 64, 128), decode_steps: int = 4, repeats: int = 2,
                         seed: int = 0, roofline: bool = True) -> list[dict]:
    """Step wall time by phase for a range of prompt lengths (batch 1).

    For each prompt length, ``repeats`` times: one request of that many random tokens,
    ``decode_steps + 1`` output tokens. Each step yields one row:
    ``{"prompt_len", "phase" ("prefill"/"decode"/"mixed"), "tokens" (in the step),
    "context_len" (tokens attended to by the step's last token), "wall_ms", "model_ms",
    "repeat"}``, and with ``roofline`` the step's ``flops``, ``bytes``, ``intensity``
    (FLOPs per byte) from ``minivllm.telemetry.roofline`` and ``mfu`` / ``mbu`` against
    this machine's measured peaks. A prompt longer than ``max_num_batched_tokens`` is prefilled in chunks
    (one row per chunk).

    Raises:
        ValueError: the engine has unfinished requests (it must be idle), ``decode_steps`` below 0,
            ``repeats`` not a positive int, or a prompt length below 1 or leaving no room for ``decode_steps + 1`` tokens within
            ``max_model_len`` (naming it), before anything runs.
    """
    engine = engine_of(llm)
    _require_idle(engine)
    if not is_count(decode_steps, 0):
        raise ValueError(f"decode_steps={decode_steps!r}: must be an int >= 0")
    _require_positive_int(f"repeats={repeats!r}", repeats)  # 0 returned no rows, without a word
    max_len = engine.config.max_model_len
    for n in prompt_lens:  # all before the first measurement: a refused call changes nothing
        _require_positive_int(f"prompt length {n!r}", n)
        if n + decode_steps + 1 > max_len:
            raise ValueError(f"prompt length {n} + decode_steps={decode_steps} + 1 output tokens = "
                             f"{n + decode_steps + 1}: more than max_model_len={max_len}")
    rng = random.Random(seed)
    warm_up(llm, seed)
    rows = []
    for rep in range(repeats):
        for n in prompt_lens:
            engine.reset_prefix_cache()
            _, records = run_requests(llm, [random_prompt(engine, n, rng)], decode_steps + 1)
            for r in records:
                e = r.scheduled[0]
                row = dict(prompt_len=n, phase=r.phase, tokens=r.num_tokens,
                           context_len=e.first_position + e.num_tokens, wall_ms=r.wall_ms,
                           model_ms=r.model_ms, repeat=rep)
                if roofline:
                    _roofline(engine, r, row)
                rows.append(row)
    engine.reset_prefix_cache()
    return rows


def measure_decode_batch(llm, batch_sizes=(1, 2, 4, 8), prompt_len: int = 16, decode_steps: int = 4,
                         seed: int = 1, warmup_steps: int = 5) -> list[dict]:
    """Decode step wall time against batch size: ``B`` requests of ``prompt_len`` random
    tokens, ``warmup_steps + decode_steps + 1`` output tokens each; one row per decode-only step
    after the first ``warmup_steps``: ``{"batch", "phase": "decode", "tokens", "wall_ms", "model_ms"}``.

    The first decode steps after a prefill are not the steady state: the first at a batch size
    records its CPU graph, and the next few run with caches the prefill left cold (the embedded
    model at batch 1, one thread, Zen 4, 2026-12-04: 0.85, 0.69, 0.50, 0.41 ms, then 0.33-0.38 ms).

    Raises:
        ValueError: a batch size that is not a positive int or is above the engine's ``max_num_seqs``,
            ``warmup_steps`` or ``decode_steps`` not an int >= 0, a ``prompt_len`` that is not a positive int, or an engine with unfinished requests
            (measuring beside them would time their steps too).
    """
    for name, value in (("warmup_steps", warmup_steps), ("decode_steps", decode_steps)):
        if not is_count(value, 0):
            raise ValueError(f"{name}={value!r}: must be an int >= 0")
    _require_positive_int(f"prompt_len={prompt_len!r}", prompt_len)
    engine = engine_of(llm)
    _require_idle(engine)
    batch_sizes = list(batch_sizes)
    for b in batch_sizes:  # all before the first measurement (a batch of 0 gave no rows, without a word)
        _require_positive_int(f"batch size {b!r}", b)
        if b > engine.config.args.max_num_seqs:
            raise ValueError(f"batch size {b} exceeds max_num_seqs={engine.config.args.max_num_seqs}")
    rng = random.Random(seed)
    rows = []
    for b in batch_sizes:
        engine.reset_prefix_cache()
        _, records = run_requests(llm, [random_prompt(engine, prompt_len, rng) for _ in range(b)],
                                  warmup_steps + decode_steps + 1)
        decodes = [r for r in records if r.phase == "decode" and r.num_seqs == b]
        for r in decodes[warmup_steps:]:
            rows.append(dict(batch=b, phase="decode", tokens=r.num_tokens, wall_ms=r.wall_ms, model_ms=r.model_ms))
    engine.reset_prefix_cache()
    return rows


def measure_request_latency(llm, prompt_len: int, max_tokens: int, batch: int, seed: int = 2,
                            warm: bool = True) -> dict:
    """Run ``batch`` requests of ``prompt_len`` random tokens and ``max_tokens`` outputs,
    submitted together. Returns the means over requests of ``RequestMetrics``:
    ``{"ttft_ms", "tpot_ms" (None when max_tokens == 1), "e2e_ms", "steps"}``.

    ``warm``: first run ``batch`` short requests (8-token prompts, 2 outputs, not measured), so a
    one-off cost of the first decode step at this batch size (recording its CPU graph: the embedded
    model's batch-3 TPOT read 1.37 ms on a first run, 0.53-0.56 ms after; dev EPYC, one thread, 2026-12-05)
    is not in the figures.

    Raises:
        ValueError: the engine has unfinished requests, ``prompt_len``, ``max_tokens`` or ``batch``
            not a positive int, or ``prompt_len + max_tokens`` above ``max_model_len`` (nothing is
            changed).
    """
    engine = engine_of(llm)
    _require_idle(engine)  # before the reset below: a refused measurement changes nothing
    for name, value in (("prompt_len", prompt_len), ("max_tokens", max_tokens), ("batch", batch)):
        _require_positive_int(f"{name}={value!r}:", value)
    if prompt_len + max_tokens > engine.config.max_model_len:
        raise ValueError(f"prompt_len={prompt_len} + max_tokens={max_tokens}: more than "
                         f"max_model_len={engine.config.max_model_len}")
    rng = random.Random(seed * 1_000_003 + prompt_len * 1009 + max_tokens * 31 + batch)
    if warm:
        run_requests(llm, [random_prompt(engine, 8, random.Random(seed)) for _ in range(batch)], 2)
    engine.reset_prefix_cache()
    outs, records = run_requests(llm, [random_prompt(engine, prompt_len, rng) for _ in range(batch)],
                                 max_tokens)
    engine.reset_prefix_cache()
    tpots = [o.metrics.tpot_ms for o in outs if o.metrics.tpot_ms is not None]
    return dict(ttft_ms=statistics.fmean(o.metrics.ttft_ms for o in outs),
                tpot_ms=statistics.fmean(tpots) if tpots else None,
                e2e_ms=statistics.fmean(o.metrics.e2e_ms for o in outs), steps=len(records))
