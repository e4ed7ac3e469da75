"""Offline throughput: a workload on minivllm, then the same prompts on transformers peers
(same process, same weights), with latency percentiles, roofline MFU/MBU and greedy agreement."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.bench.common import (ResultMixin, build_llm, cost_and_peaks, device_label, drive, frozen_heap,
                                   kv_bytes_for, loadavg, percentiles, summarise_roofline, summarise_samples,
                                   wants_cuda)
from minivllm.bench.peers import agreement, load_hf_model, run_hf_continuous_batching, run_hf_generate
from minivllm.bench.report import describe_peaks, peaks_summary, throughput_header, throughput_row
from minivllm.bench.workload import WORKLOADS, Workload, check_range, check_scale, make_workload
from minivllm.config import EngineArgs
from minivllm.utils.checks import is_count

__all__ = ["ThroughputResult", "run_throughput"]


@dataclass
class ThroughputResult(ResultMixin):
    """What :func:`run_throughput` measured (times in seconds, latencies in ms).

    Attributes:
        model / device / dtype / attention_backend / kv_cache_dtype: what ran.
        workload: the workload's description (``Workload.describe()``).
        peaks: the peaks used for MFU/MBU, measured in this run (``peaks_summary``).
        torch / transformers: library versions.
        loadavg: 1/5/15-minute load averages at the start (None where unavailable).
        minivllm: seconds, requests/s, tokens/s, steps (and those with prefill tokens), the
            engine's token budget per step and most sequences, latency percentiles, roofline,
            utilisation, time breakdown, preemptions, prefix-cache hit tokens (0: the warm-up
            shares no prompt).
        peers: peer name -> its figures (``available``, ``seconds``, ``speedup`` = peer
            seconds / minivllm seconds, greedy ``agreement``) or ``available: False`` + reason.
    """

    mode: str
    model: str
    device: str
    dtype: str
    attention_backend: str
    workload: dict
    peaks: dict
    torch: str
    transformers: str
    loadavg: list | None
    minivllm: dict = field(default_factory=dict)
    peers: dict = field(default_factory=dict)
    kv_cache_dtype: str | None = None


#: the transformers peers ``run_throughput`` can run beside minivllm
HF_PEERS = ("hf_generate", "hf_generate_batch")


def run_throughput(model: str | None = None, *, workload: Workload | None = None, workload_name: str | None = None,
                   scale: float = 1.0, num_requests: int | None = None, input_len=None, output_len=None,
                   seed: int = 0, peers: tuple[str, ...] = ("hf_generate", "hf_generate_batch"),
                   hf_batch_size: int | None = None, sample_period_s: float = 0.1, log=print,
                   peak_kwargs: dict | None = None, **engine_args) -> ThroughputResult:
    """Run the offline workload on minivllm and on the transformers peers.

    Before its timed run each engine (minivllm and each peer) runs ``workload.warm_up()`` off the
    clock: the same prompt lengths (other token ids) with 2 output tokens each, so none is timed
    with first-call costs such as its allocator's first growth to a full prefill's activations.
    Each timed run is inside :func:`~minivllm.bench.common.frozen_heap` (garbage collected, the
    heap that exists before it left out of the collector's full passes).

    ``workload``: the requests to run (:func:`~minivllm.bench.workload.make_workload`); else one is
    made from ``workload_name`` (``WORKLOADS``: "cpu", the default on a CPU, or "nano", nano-vllm's
    bench.py shape, the default on CUDA), ``scale`` (its number of requests times this),
    ``num_requests``, ``input_len`` / ``output_len`` (``(min, max)`` token counts, inclusive) and
    ``seed`` (the prompts' random ids and lengths). ``sample_period_s``: seconds between the
    utilisation samples taken during minivllm's timed run.
    ``peers``: any of "hf_generate", "hf_generate_batch" (empty: minivllm only).
    ``peak_kwargs`` go to ``measure_peaks``; ``engine_args`` go to ``LLM`` (e.g. ``device``,
    ``attention_backend``, ``max_num_seqs``). Progress lines go to ``log``; the summary is
    printed by :func:`minivllm.bench.report.print_throughput`.

    Raises:
        ValueError: ``peers`` not a list of known peer names, ``hf_batch_size`` below 1, or a bad
            workload argument (all before the model loads, but lengths that ``max_model_len``
            cannot fit).
        RuntimeError: minivllm produced a different number of tokens than asked for.
        TypeError / ValueError: an engine argument ``LLM(**engine_args)`` refuses (naming it).
    """
    import torch
    import transformers

    if isinstance(peers, str) or not isinstance(peers, (list, tuple)):  # a str was read letter by letter
        raise ValueError(f"peers={peers!r}: give a list of peer names, from {list(HF_PEERS)}")
    unknown = [p for p in peers if p not in HF_PEERS]
    if unknown:
        raise ValueError(f"peers={list(peers)}: unknown {unknown}; choose from {list(HF_PEERS)}")
    if hf_batch_size is not None and hf_batch_size < 1:
        raise ValueError(f"hf_batch_size={hf_batch_size}: must be at least 1 (None: the default)")

    from minivllm.telemetry.utilisation import UtilisationSampler

    transformers.logging.set_verbosity_error()
    name = workload_name or ("nano" if wants_cuda(engine_args) else "cpu")
    if workload is None:  # the workload's arguments, before the model loads (make_workload checks them again)
        if name not in WORKLOADS:
            raise ValueError(f"workload {name!r}: choose one of {sorted(WORKLOADS)}")
        preset = WORKLOADS[name]
        check_scale(scale)
        if num_requests is not None and not is_count(num_requests, 1):
            raise ValueError(f"num_requests={num_requests!r}: must be a positive int")
        lens = (check_range("input_len", input_len or preset["input_len"])[1]
                + check_range("output_len", output_len or preset["output_len"])[1])
    if workload is None and engine_args.get("kv_cache_memory_bytes") is None and engine_args.get(
            "num_kvcache_blocks") is None:
        n = num_requests or max(1, round(preset["num_requests"] * scale))
        # room for the requests that can run at once, not for all of them (20,000 asked for 30 GB)
        running = min(n, engine_args.get("max_num_seqs") or EngineArgs.max_num_seqs)
        engine_args["kv_cache_memory_bytes"] = kv_bytes_for(model, running * lens, engine_args.get("dtype"),
                                                            engine_args.get("kv_cache_dtype"))
    llm = build_llm(model, **engine_args)
    try:
        engine = llm.llm_engine
        cfg = engine.source.hf_config
        if workload is None:
            workload = make_workload(name, cfg.vocab_size, scale=scale, num_requests=num_requests,
                                     input_len=input_len, output_len=output_len,
                                     max_model_len=engine.config.max_model_len, seed=seed)
        device = engine.config.device
        cost, peaks = cost_and_peaks(engine, log, peak_kwargs)
        result: dict[str, Any] = {
            "mode": "throughput", "model": engine.source.name, "device": device_label(device),
            "dtype": str(engine.config.dtype).removeprefix("torch."),
            "attention_backend": engine.config.attention_backend, "workload": workload.describe(),
            "kv_cache_dtype": str(engine.config.kv_cache_dtype or engine.config.dtype).removeprefix("torch."),
            "peaks": peaks_summary(peaks),
            "torch": torch.__version__, "transformers": transformers.__version__, "loadavg": loadavg()}
        log(f"minivllm bench: model={result['model']} device={result['device']} dtype={result['dtype']} "
            f"attention={result['attention_backend']} kv_cache={result['kv_cache_dtype']}")
        w = result["workload"]
        log(f"workload {w['name']}: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']} "
            f"(mean {w['prompt_len_mean']:.0f}), output {w['output_len_min']}..{w['output_len_max']} "
            f"(mean {w['output_len_mean']:.0f}); random token ids, greedy, ignore_eos")
        log(describe_peaks(peaks))

        # Warm-up, off the clock, the same for every engine: the workload's prompt lengths with 2
        # output tokens each (kernels, lazy imports, and the allocator's first growth to the largest
        # activations: a 4004-token prefill's first run here paid ~12% of the whole run in page faults)
        warm = workload.warm_up(cfg.vocab_size)
        drive(engine, warm)
        engine.reset_prefix_cache()

        sampler = UtilisationSampler(sample_period_s, device=str(device))
        with frozen_heap(), sampler:
            outs, records, t0, t1 = drive(engine, workload)
        secs = t1 - t0
        ours_tokens = [list(o.outputs[0].token_ids) for o in outs]
        got = sum(len(t) for t in ours_tokens)
        if got != workload.num_output_tokens:
            raise RuntimeError(f"minivllm produced {got} tokens, the workload asked for {workload.num_output_tokens}")
        mine = {
            "seconds": secs, "requests_per_s": workload.num_requests / secs,
            "output_tokens_per_s": workload.num_output_tokens / secs,
            "total_tokens_per_s": (workload.num_output_tokens + workload.num_prompt_tokens) / secs,
            "num_steps": len(records),
            "num_prefill_steps": sum(1 for r in records if r.num_prefill_tokens),
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,  # the step's token budget
            "max_num_seqs": engine.config.args.max_num_seqs,
            "ttft_ms": percentiles([o.metrics.ttft_ms for o in outs]),
            "tpot_ms": percentiles([o.metrics.tpot_ms for o in outs]),
            "itl_ms": percentiles([x for o in outs for x in o.metrics.itl_ms]),
            "e2e_ms": percentiles([o.metrics.e2e_ms for o in outs]),
            "roofline": summarise_roofline(records, cost, peaks),
            "utilisation": summarise_samples(sampler.samples),
            "time_breakdown_ms": {k: sum(getattr(r, k) for r in records) for k in
                                  ("schedule_ms", "prepare_ms", "model_ms", "sample_ms", "postprocess_ms")},
            "preemptions": sum(len(r.preempted) for r in records),
            "prefix_cache_hit_tokens": sum(r.prefix_cache_hit_tokens for r in records),
        }
        if sampler.nvml_error:
            mine["utilisation"]["nvml_error"] = sampler.nvml_error
        result["minivllm"] = mine
        result["peers"] = {}
        log("")
        log(throughput_header())
        log(throughput_row("minivllm", mine["seconds"], workload))

        if peers:
            hf = None
            try:
                hf = load_hf_model(engine)
            except Exception as e:  # noqa: BLE001 - report the peer as unavailable, keep our numbers
                for p in peers:
                    result["peers"][p] = {"available": False, "reason": f"{type(e).__name__}: {e}"}
            pad = engine.tokenizer.pad_token_id
            pad = pad if pad is not None else 0
            for p in peers:
                if hf is None:
                    log(f"{p:<28}unavailable: {result['peers'][p]['reason']}")
                    continue
                try:
                    if p == "hf_generate":
                        bs = hf_batch_size if hf_batch_size is not None else (64 if device.type == "cuda" else min(32, workload.num_requests))
                        run_hf_generate(hf, warm, bs, pad, device)  # the same warm-up as minivllm's
                        with frozen_heap():
                            r = run_hf_generate(hf, workload, bs, pad, device)
                        label = f"hf generate (batch {bs})"
                    else:  # "hf_generate_batch" (the names were checked on entry)
                        run_hf_continuous_batching(hf, warm, device)  # the same warm-up as minivllm's
                        with frozen_heap():
                            r = run_hf_continuous_batching(hf, workload, device)
                        label = "hf generate_batch (CB)"
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    result["peers"][p] = {"available": False, "reason": f"{type(e).__name__}: {e}"}
                    log(f"{p:<28}unavailable: {type(e).__name__}: {str(e)[:120]}")
                    continue
                agree = agreement(ours_tokens, r.pop("outputs"))
                r.update(available=True, label=label, agreement=agree,
                         output_tokens_per_s=workload.num_output_tokens / r["seconds"],
                         total_tokens_per_s=(workload.num_output_tokens + workload.num_prompt_tokens) / r["seconds"],
                         speedup=r["seconds"] / secs)
                result["peers"][p] = r
                log(throughput_row(label, r["seconds"], workload, r["speedup"]))
            del hf
        return ThroughputResult(**result)
    finally:
        llm.shutdown()
