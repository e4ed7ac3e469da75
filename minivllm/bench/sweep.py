"""Roofline sweep: decode step time vs batch size and prefill step time vs prompt length,
each point with its FLOPs and bytes (``minivllm.telemetry.roofline``) against peaks measured
in the same run."""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.bench.common import (ResultMixin, build_llm, cost_and_peaks, device_label, kv_bytes_for, loadavg,
                                   check_batch_sizes, next_tag, wants_cuda)
from minivllm.bench.matmul_share import LinearReplay, eager_steps, record_linear_calls
from minivllm.bench.report import describe_peaks, peaks_summary, print_sweep_summary, write_roofline_html
from minivllm.bench.step_breakdown import BREAKDOWN_STEPS, breakdown, print_breakdown
from minivllm.layers.cpu_graph import time_replays
from minivllm.utils.checks import is_count
from minivllm.utils.gc_heap import heap_frozen

__all__ = ["SweepResult", "run_sweep"]


@dataclass
class SweepResult(ResultMixin):
    """What :func:`run_sweep` measured.

    Attributes:
        model / device / dtype / attention_backend: what ran.
        peaks: the peaks measured in this run (``peaks_summary``).
        model_cost: the model's static cost figures (``ModelCost.to_dict()``).
        decode: one point per batch size: ``batch_size``, ``step_ms`` (median), ``flops``,
            ``bytes``, ``flops_per_s``, ``bytes_per_s``, ``intensity`` (FLOP/byte), ``mfu``,
            ``mbu``, ``model_ms``, ``num_steps``, ``matmul_ms`` (the step's linear layers, same
            weights and rows, run alone: ``minivllm.bench.matmul_share``), ``matmul_from_c``
            (those calls were timed as one C loop over their kernels, as a CPU graph makes them;
            else from Python), ``step_over_matmul`` (``step_ms / matmul_ms``) and, where the steps
            replay a CPU graph, ``breakdown``: where the time of :data:`BREAKDOWN_STEPS` more steps
            went (``minivllm.bench.step_breakdown``), else None.
        prefill: the same per prompt length (``prompt_len``).
        loadavg: 1/5/15-minute load averages at the end.
        html: where the roofline HTML was written, if anywhere.
        output_kind: what the requests asked for ("final_only" unless ``run_sweep`` was told
            otherwise; sweeps before 2026-12-04 22:30 UTC asked for "cumulative").
        kv_cache_dtype: the KV cache's dtype (the model's unless ``kv_cache_dtype`` said otherwise).
    """

    mode: str
    model: str
    device: str
    dtype: str
    attention_backend: str
    peaks: dict
    model_cost: dict
    decode: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    loadavg: list | None = None
    html: str | None = None
    output_kind: str = "final_only"
    kv_cache_dtype: str | None = None


def run_sweep(model: str | None = None, *, batch_sizes=None, prompt_lens=None, context_len: int = 128,
              decode_steps: int = 12, warmup_steps: int = 3, repeats: int = 3, html: str | Path | None = None,
              seed: int = 0, log=print, peak_kwargs: dict | None = None, output_kind: str = "final_only",
              **engine_args) -> SweepResult:
    """Decode step time vs batch size (prompts of ``context_len`` tokens, ``decode_steps``
    timed steps after ``warmup_steps``, both after two set-up steps: the first full decode step,
    which on a CPU records the batch size's graph, and an eager one that records the step's
    matmuls) and prefill step time vs prompt length (median of
    ``repeats`` single-prompt steps); each point with its FLOPs, bytes, FLOP/s, bytes/s,
    arithmetic intensity, MFU and MBU (against the read bandwidth measured in this run).
    Writes a plotly roofline to ``html`` if given. ``peak_kwargs`` go to ``measure_peaks``.
    ``output_kind``: what the sweep's requests ask for, as ``LLMEngine.add_request``'s argument
    (an ``OutputKind`` or its value). By default "final_only", as ``LLM.generate`` asks and as the
    throughput and overhead modes drive the engine; "cumulative" (``SamplingParams``' default, what
    a plain loop over ``LLMEngine.step()`` gets) adds a text and a ``RequestOutput`` per running
    request to every step, "delta" (``LLM.stream``'s) the new part of each.

    Raises:
        ValueError: ``context_len``, a batch size, a prompt length, ``decode_steps`` or ``repeats``
            below 1, ``warmup_steps`` below 0, a batch size above a given ``max_num_seqs``, or ``context_len`` with
            the steps not fitting the model's length; ``output_kind`` not one of "cumulative",
            "delta", "final_only". Not raised but skipped, with a log line saying so: a prompt length
            at or above ``max_model_len`` or the step budget (``max_num_batched_tokens``), and a
            batch size whose full decode steps never formed.
    """
    from minivllm.sampling_params import OutputKind, SamplingParams
    from minivllm.telemetry.roofline import arithmetic_intensity, fill_step_record

    try:
        output_kind = OutputKind(output_kind).value
    except ValueError:
        raise ValueError(f"output_kind={output_kind!r}: choose from {[k.value for k in OutputKind]}") from None
    if not is_count(context_len, 1):
        raise ValueError(f"context_len={context_len!r}: a decode row needs a prompt of a whole number of tokens, "
                         "at least one")
    context_len = int(context_len)  # a numpy integer too, as a plain int in the result
    if batch_sizes is not None:
        check_batch_sizes(batch_sizes, engine_args)
    if decode_steps < 1 or warmup_steps < 0 or repeats < 1:
        raise ValueError(f"decode_steps={decode_steps}, warmup_steps={warmup_steps}, repeats={repeats}: decode_steps "
                         "and repeats must be at least 1, warmup_steps at least 0")
    if prompt_lens is not None and any(n < 1 for n in prompt_lens):
        raise ValueError(f"prompt_lens={list(prompt_lens)}: each must be at least 1")

    cuda = wants_cuda(engine_args)
    batch_sizes = list(batch_sizes or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 2, 4, 8, 16, 32]))
    prompt_lens = list(prompt_lens or ([64, 128, 256, 512, 1024, 2048, 4096] if cuda else [16, 32, 64, 128, 256, 512]))
    if engine_args.get("kv_cache_memory_bytes") is None and engine_args.get("num_kvcache_blocks") is None:
        need = max(max(batch_sizes) * (context_len + warmup_steps + decode_steps + 3 + BREAKDOWN_STEPS),
                   max(prompt_lens) + 2)
        engine_args["kv_cache_memory_bytes"] = kv_bytes_for(model, need, engine_args.get("dtype"))
    engine_args.setdefault("max_num_seqs", max(256, max(batch_sizes)))
    engine_args.setdefault("max_num_batched_tokens", max(8192, max(prompt_lens)))
    llm = build_llm(model, **engine_args)
    rng = random.Random(seed)
    try:
        engine = llm.llm_engine
        cfg = engine.source.hf_config
        max_len = engine.config.max_model_len
        # before the peaks: a refused sweep measures nothing
        need_len = context_len + warmup_steps + decode_steps + 3 + BREAKDOWN_STEPS
        if need_len > max_len:
            raise ValueError(f"context_len={context_len} + warmup_steps={warmup_steps} + decode_steps={decode_steps} "
                             f"+ {3 + BREAKDOWN_STEPS} (set-up and breakdown steps) = {need_len} tokens: more than "
                             f"max_model_len={max_len}")
        cost, peaks = cost_and_peaks(engine, log, peak_kwargs)
        high = min(cfg.vocab_size, 10000) - 1

        def prompt(n):
            return [rng.randint(0, high) for _ in range(n)]

        def point(records, label, **extra):
            for r in records:
                fill_step_record(r, cost, peaks)
            ms = statistics.median(r.wall_ms for r in records)
            flops = statistics.median(r.flops for r in records)
            nbytes = statistics.median(r.bytes_moved for r in records)
            return {"label": label, **extra, "step_ms": ms, "flops": flops, "bytes": nbytes,
                    "flops_per_s": flops / (ms / 1e3), "bytes_per_s": nbytes / (ms / 1e3),
                    "intensity": arithmetic_intensity(flops, nbytes),
                    "mfu": flops / (ms / 1e3) / peaks.flops_per_s, "mbu": nbytes / (ms / 1e3) / peaks.mbu_bytes_per_s,
                    "model_ms": statistics.median(r.model_ms for r in records), "num_steps": len(records)}

        # warm-up
        engine.add_request("sweep-warm", prompt(16), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           output_kind=output_kind)
        while engine.has_unfinished_requests():
            engine.step()

        decode = []
        log(describe_peaks(peaks))
        kv_dtype = str(engine.config.kv_cache_dtype or engine.config.dtype).removeprefix("torch.")
        log(f"decode sweep (context {context_len} tokens, KV cache in {kv_dtype}, {output_kind} outputs; step ms: "
            f"the median step; the last column: the step over its matmuls alone)")
        log(f"  {'batch':>5} {'step ms':>9} {'ms/seq':>8} {'GFLOP/s':>9} {'GB/s':>8} {'MFU':>6} {'MBU':>6} "
            f"{'/matmuls':>10}")
        for b in batch_sizes:
            tag = next_tag()
            for i in range(b):
                engine.add_request(f"sweep{tag}-{i}", prompt(context_len),
                                   SamplingParams(temperature=0, max_tokens=warmup_steps + decode_steps + 3
                                                  + BREAKDOWN_STEPS, ignore_eos=True), output_kind=output_kind)
            # Two set-up steps come before the warm-up and timed ones: the first full decode step (on
            # a CPU it records this batch size's graph) and an eager one that records its matmuls.
            recs, replay, matmul_s, graph_step_done = [], None, [], False
            timed_recs, timings = [], []  # steps with each C call of the graph timed
            with heap_frozen():  # a full collection of the whole process is not the engine's step
                while engine.has_unfinished_requests():
                    if replay is None and graph_step_done:  # which matmuls such a step does
                        with record_linear_calls() as calls, eager_steps(engine):
                            rec = engine.step_with_record().record
                        if rec.phase == "decode" and rec.num_seqs == b:
                            replay = LinearReplay(calls) if calls else False  # int8 layers: not recorded
                        continue
                    if replay is not None and len(recs) == warmup_steps and len(timed_recs) < BREAKDOWN_STEPS:
                        # between the warm-up and the timed steps (the set-up steps done)
                        with time_replays() as replays:
                            rec = engine.step_with_record().record
                        if rec.phase == "decode" and rec.num_seqs == b:
                            timed_recs.append(rec)
                            timings.append(replays)  # every graph the step replayed (a draft model's too)
                            if replay:  # as between the timed steps, so these steps find the caches as those do
                                replay.seconds()
                        continue
                    rec = engine.step_with_record().record
                    if rec.phase == "decode" and rec.num_seqs == b:
                        if not graph_step_done:
                            graph_step_done = True
                            continue
                        recs.append(rec)
                        if replay and len(recs) > warmup_steps:  # interleaved with the timed steps
                            matmul_s.append(replay.seconds())
            recs = recs[warmup_steps:warmup_steps + decode_steps]
            if not recs:
                log(f"  batch {b}: no full decode steps of {b} sequences (KV pool or max_num_batched_tokens too "
                    f"small for them?)")
                continue
            p = point(recs, f"decode B={b}", batch_size=b, context_len=context_len)
            # the same linear layers on the same rows, alone: how far the step is from its matmuls
            p["matmul_ms"] = statistics.median(matmul_s) * 1e3 if matmul_s else None
            p["step_over_matmul"] = p["step_ms"] / p["matmul_ms"] if p["matmul_ms"] else None
            p["matmul_from_c"] = bool(replay) and replay.from_c  # (else from Python, one call at a time)
            p["breakdown"] = breakdown(timed_recs, timings)
            decode.append(p)
            share = f"{p['step_over_matmul']:9.2f}x" if p["step_over_matmul"] else f"{'-':>10}"
            log(f"  {b:5d} {p['step_ms']:9.2f} {p['step_ms'] / b:8.3f} {p['flops_per_s'] / 1e9:9.2f} "
                f"{p['bytes_per_s'] / 1e9:8.2f} {p['mfu']:6.1%} {p['mbu']:6.1%} {share}")
            engine.reset_prefix_cache()

        print_breakdown(decode, log)
        prefill = []
        log(f"prefill sweep (one prompt per step, median of {repeats})")
        log(f"  {'length':>6} {'step ms':>9} {'tok/s':>9} {'GFLOP/s':>9} {'GB/s':>8} {'MFU':>6} {'MBU':>6}")
        budget = engine.config.max_num_batched_tokens
        for n in prompt_lens:
            if n >= max_len or n > budget:
                log(f"  {n}: skipped (max_model_len {max_len}, step budget {budget})")
                continue
            recs = []
            with heap_frozen():
                for _ in range(repeats):
                    engine.add_request(f"sweep{next_tag()}", prompt(n),
                                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                       output_kind=output_kind)
                    while engine.has_unfinished_requests():
                        rec = engine.step_with_record().record
                        if rec.phase == "prefill":
                            recs.append(rec)
                    engine.reset_prefix_cache()
            p = point(recs, f"prefill L={n}", prompt_len=n)
            prefill.append(p)
            log(f"  {n:6d} {p['step_ms']:9.2f} {n / p['step_ms'] * 1e3:9.0f} {p['flops_per_s'] / 1e9:9.2f} "
                f"{p['bytes_per_s'] / 1e9:8.2f} {p['mfu']:6.1%} {p['mbu']:6.1%}")

        result = SweepResult("sweep", engine.source.name, device_label(engine.config.device),
                             str(engine.config.dtype).removeprefix("torch."), engine.config.attention_backend,
                             peaks_summary(peaks), cost.to_dict(), decode, prefill, loadavg(),
                             output_kind=output_kind, kv_cache_dtype=kv_dtype)
        print_sweep_summary(result, log)
        if html:
            result.html = str(write_roofline_html(result, html))
            log(f"roofline written to {result.html}")
        else:
            log("roofline chart not written (--html PATH writes it; run_sweep's html=)")
        return result
    finally:
        llm.shutdown()
