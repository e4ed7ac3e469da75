"""Where a CPU decode step's time goes: its CPU graph's C calls timed one by one
(``minivllm.layers.cpu_graph.time_replays``) in a few steps of their own, beside the step's
``StepRecord``.

A decode step that replays a CPU graph is: the engine around the model (scheduling, the inputs and
their copy into the graph's static buffers, sampling, the outputs: the step's wall time less
``model_ms``), the LM head (``model_ms`` less the replays: the head is not in the graph, it finds the
greedy tokens as it writes the logits; with it the few microseconds of the replay's own call and
checks), and the graphs themselves (a draft model's too), whose calls are the layers' linears (our
panel GEMM), the decode attention, and the rest (norms, rotary, SiLU, the KV writes, the embedding
lookup, the copy into the static output). ``bench --sweep`` prints one row per batch size; the
embedded model's batch-32 row is what its target (a step <= 1.4x its matmuls) is made of. The
steps timed so come between the warm-up and the timed ones, each followed by the matmuls' replay
as those are, but they are not those steps: their sum is near the row's step time, not equal to it.
"""
from __future__ import annotations

import statistics

__all__ = ["BREAKDOWN_STEPS", "CATEGORIES", "breakdown", "category", "print_breakdown"]

#: decode steps per batch size timed call by call (after the warm-up steps, before the timed ones)
BREAKDOWN_STEPS = 3
#: the graph's calls by kind, in the order printed
CATEGORIES = ("linears", "attention", "other")


def category(name: str) -> str:
    """The kind of a recorded call, by its name: "linears" (our panel GEMM, any weight type),
    "attention" (the paged decode kernel) or "other"."""
    if name.startswith("panel_gemm"):
        return "linears"
    if name.startswith("paged_decode_attention"):
        return "attention"
    return "other"


def breakdown(records, timings) -> dict | None:
    """Medians over the steps, in ms: ``step`` (wall), ``graph`` and each of :data:`CATEGORIES` (the
    calls of every graph the step replayed, summed), ``lm_head`` (``model_ms`` less the graphs) and
    ``engine`` (the wall time less ``model_ms``). ``records``: the steps' ``StepRecord``; ``timings``:
    per step, the ``ReplayTiming`` of each of its replays. None when a step replayed no graph (an eager
    step, CUDA graphs) or the counts differ."""
    if not records or len(records) != len(timings) or not all(timings):
        return None
    per_step = []
    for rec, replays in zip(records, timings):
        parts = dict.fromkeys(CATEGORIES, 0.0)
        for t in replays:
            for name, s in zip(t.names, t.seconds):
                parts[category(name)] += s * 1e3
        graph = sum(parts.values())
        per_step.append({"step": rec.wall_ms, "graph": graph, **parts, "lm_head": rec.model_ms - graph,
                         "engine": rec.wall_ms - rec.model_ms})
    return {k: statistics.median(p[k] for p in per_step) for k in per_step[0]} | {
        "num_steps": len(per_step), "from_c": all(t.from_c for replays in timings for t in replays)}


def print_breakdown(decode: list[dict], log=print) -> None:
    """A table of the decode points' ``breakdown`` (those that have one)."""
    rows = [p for p in decode if p.get("breakdown")]
    if not rows:
        return
    how = "from C" if all(p["breakdown"]["from_c"] for p in rows) else "from Python, ~1 us a call more"
    log(f"where a decode step goes (ms; medians of {BREAKDOWN_STEPS} more steps, not the timed ones; each C call of "
        f"the step's CPU graph timed {how}; other: norms, rotary, SiLU, KV writes, embedding; outside the graph: "
        "the LM head, and the engine's scheduling, inputs, sampling and outputs)")
    log(f"  {'batch':>5} {'step':>7} {'linears':>8} {'attention':>10} {'other':>7} {'LM head':>8} {'engine':>7}")
    for p in rows:
        b = p["breakdown"]
        log(f"  {p['batch_size']:5d} {b['step']:7.2f} {b['linears']:8.2f} {b['attention']:10.2f} {b['other']:7.2f} "
            f"{b['lm_head']:8.2f} {b['engine']:7.2f}")
