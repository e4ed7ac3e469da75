"""``python -m minivllm bench``: offline throughput against transformers, sweeps, overhead.

Three modes, each a plain function that returns a JSON-ready dict (the notebooks
call them directly) and a ``main(argv)`` that prints them:

* throughput (default): an offline workload of random-token prompts, greedy,
  ``ignore_eos``, each request with its own output length. minivllm runs it,
  then in the same process Hugging Face transformers runs the same prompts on the
  same weights: ``generate`` on padded batches (each batch runs to its longest
  output; only the requested tokens count towards its throughput) and, where it
  works, transformers' continuous-batching ``generate_batch`` machinery. Prints
  throughput, TTFT/TPOT percentiles, the ratios, roofline MFU/MBU and whether
  the greedy outputs are identical.
* ``--sweep``: decode step time vs batch size and prefill step time vs prompt
  length, each point placed on a roofline (FLOPs and bytes from
  ``minivllm.telemetry.roofline`` against measured peaks), written as a plotly HTML.
* ``--overhead``: the engine's own CPU cost (scheduler, block manager, input
  preparation, postprocessing) with the model and sampler replaced by a stub that
  returns a fixed token, in microseconds per sequence per decode step.

Workloads: ``nano`` is nano-vllm's benchmark (256 requests, prompt and output
lengths uniform in 100..1024, random token ids); ``cpu`` is a CPU-sized one
(32 requests, prompts 16..256, outputs 16..128). The default is ``nano`` on a GPU,
``cpu`` otherwise; ``--scale`` multiplies the number of requests.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minivllm.utils import cdiv

__all__ = ["Workload", "make_workload", "run_throughput", "run_sweep", "run_overhead", "run_cli", "main", "WORKLOADS"]

WORKLOADS = {
    "nano": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024)),
    "cpu": dict(num_requests=32, input_len=(16, 256), output_len=(16, 128)),
}
# Passed to ``measure_peaks`` (tests shrink the microbenchmark through this).
PEAK_MEASURE_KWARGS: dict = {}
# nano-vllm's overhead on the CI machine class (us per sequence per decode step), from the design brief.
OVERHEAD_TARGETS_US = {1: 45.0, 16: 6.0, 64: 4.8, 256: 4.3}

_ids = itertools.count()


# ----------------------------------------------------------------------------------- workload
@dataclass
class Workload:
    """Prompts (token ids) and the number of tokens to generate for each."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        pl = [len(p) for p in self.prompts]
        return {"name": self.name, "num_requests": self.num_requests, "seed": self.seed,
                "prompt_len_min": min(pl), "prompt_len_max": max(pl), "prompt_len_mean": statistics.fmean(pl),
                "output_len_min": min(self.output_lens), "output_len_max": max(self.output_lens),
                "output_len_mean": statistics.fmean(self.output_lens),
                "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens}


def _check_range(name, r):
    if (not isinstance(r, (tuple, list)) or len(r) != 2 or not all(isinstance(x, int) for x in r)
            or not 1 <= r[0] <= r[1]):
        raise ValueError(f"{name}={r!r}: expected (min, max) with 1 <= min <= max")
    return tuple(r)


def make_workload(name: str = "cpu", vocab_size: int = 10000, *, scale: float = 1.0,
                  num_requests: int | None = None, input_len: tuple[int, int] | None = None,
                  output_len: tuple[int, int] | None = None, max_model_len: int | None = None,
                  seed: int = 0) -> Workload:
    """A reproducible workload: token ids uniform in ``[0, min(vocab_size, 10000))`` (as
    nano-vllm's benchmark draws them), lengths uniform in the ranges (inclusive).

    ``scale`` multiplies the preset's request count (ignored when ``num_requests`` is
    given). With ``max_model_len``, a prompt is shortened so prompt + output fits.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r}: choose one of {sorted(WORKLOADS)}")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale={scale!r}: must be a positive number")
    preset = WORKLOADS[name]
    n = num_requests if num_requests is not None else max(1, round(preset["num_requests"] * scale))
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_requests={n!r}: must be a positive int")
    lo_in, hi_in = _check_range("input_len", input_len or preset["input_len"])
    lo_out, hi_out = _check_range("output_len", output_len or preset["output_len"])
    if max_model_len is not None and lo_in + lo_out > max_model_len:
        raise ValueError(f"input_len min {lo_in} + output_len min {lo_out} exceed max_model_len={max_model_len}")
    rng = random.Random(seed)
    high = min(vocab_size, 10000) - 1
    prompts, outs = [], []
    for _ in range(n):
        li, lo = rng.randint(lo_in, hi_in), rng.randint(lo_out, hi_out)
        if max_model_len is not None and li + lo > max_model_len:
            li = max(1, max_model_len - lo)
        prompts.append([rng.randint(0, high) for _ in range(li)])
        outs.append(lo)
    return Workload(name, prompts, outs, seed)


# ----------------------------------------------------------------------------------- helpers
def _percentiles(values, ps=(50, 90, 99)) -> dict:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {f"p{p}": None for p in ps} | {"mean": None}
    out = {}
    for p in ps:  # linear interpolation between closest ranks
        k = (len(vals) - 1) * p / 100
        f, c = math.floor(k), math.ceil(k)
        out[f"p{p}"] = vals[f] + (vals[c] - vals[f]) * (k - f)
    out["mean"] = statistics.fmean(vals)
    return out


def _sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def _device_label(device) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    from minivllm.telemetry.peaks import _device_name

    return f"cpu ({_device_name(device)}, {torch.get_num_threads()} threads)"


def _loadavg() -> list[float] | None:
    import os

    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _wants_cuda(engine_args: dict) -> bool:
    import torch

    dev = str(engine_args.get("device") or "auto")
    return dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())


def _build_llm(model, **engine_args):
    from minivllm import LLM

    return LLM(model, **{k: v for k, v in engine_args.items() if v is not None})


def _cost_and_peaks(engine, log=None):
    """The model's cost figures, and the device peaks re-measured now (a second or so) and
    merged with the cache, which keeps the best figure seen: a run on a busy machine then
    still compares against the machine's real ceiling."""
    import os

    from minivllm.telemetry.peaks import get_peaks
    from minivllm.telemetry.roofline import ModelCost

    cost = ModelCost.from_config(engine.source.hf_config, dtype=engine.config.dtype)
    peaks = get_peaks(engine.config.device, engine.config.dtype, refresh=True, **PEAK_MEASURE_KWARGS)
    if log is not None and engine.config.device.type == "cpu" and hasattr(os, "getloadavg"):
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if load > 0.75 * cores:
            log(f"note: load average {load:.1f} on {cores} cores: other processes compete for the CPU, "
                f"so every figure below reads low (--threads 1 suffers least)")
    return cost, peaks


def _kv_bytes_for(model, tokens: int, dtype: str | None = None) -> int | None:
    """CPU KV pool size holding ``tokens`` tokens (None: keep the engine default)."""
    from minivllm.telemetry.roofline import ModelCost
    from minivllm.utils.model_source import resolve_model

    import torch

    if torch.cuda.is_available():
        return None
    cfg = resolve_model(model).hf_config
    cost = ModelCost.from_config(cfg, dtype=4 if dtype in (None, "auto") else dtype)
    need = int(tokens * cost.kv_bytes_per_token * 1.1) + (1 << 20)
    return max(need, 512 << 20)


def _drive(engine, workload: Workload, temperature: float = 0.0):
    """Add every request at once and step the engine until all finish.

    Returns ``(outputs in workload order, step records, t_start, t_end)``.
    """
    from minivllm.sampling_params import SamplingParams

    run = next(_ids)
    rids = [f"bench{run}-{i}" for i in range(workload.num_requests)]
    finals: dict[str, Any] = {}
    records = []
    t0 = time.perf_counter()
    for rid, prompt, n in zip(rids, workload.prompts, workload.output_lens):
        engine.add_request(rid, prompt, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        res = engine.step_with_record()
        records.append(res.record)
        for out in res.outputs:
            if out.finished:
                finals[out.request_id] = out
    t1 = time.perf_counter()
    return [finals[r] for r in rids], records, t0, t1


def _summarise_roofline(records, cost, peaks) -> dict:
    from minivllm.telemetry.roofline import fill_step_record

    for r in records:
        fill_step_record(r, cost, peaks)
    busy = sum(r.wall_ms for r in records if r.num_tokens) / 1e3
    flops = sum(r.flops or 0.0 for r in records)
    nbytes = sum(r.bytes_moved or 0.0 for r in records)
    out = {"flops": flops, "bytes": nbytes, "step_seconds": busy,
           "achieved_flops_per_s": flops / busy if busy else None,
           "achieved_bytes_per_s": nbytes / busy if busy else None}
    if peaks is not None and busy:
        out["mfu"] = flops / busy / peaks.flops_per_s
        out["mbu"] = nbytes / busy / peaks.bytes_per_s
    return out


def _summarise_samples(samples) -> dict:
    if not samples:
        return {}

    def mean(attr):
        vals = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return statistics.fmean(vals) if vals else None

    def peak(attr):
        vals = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return max(vals) if vals else None

    return {"num_samples": len(samples), "cpu_percent_mean": mean("cpu_percent"),
            "process_cpu_percent_mean": mean("process_cpu_percent"), "rss_bytes_max": peak("rss_bytes"),
            "gpu_util_percent_mean": mean("gpu_util_percent"), "mem_util_percent_mean": mean("mem_util_percent"),
            "mem_used_bytes_max": peak("mem_used_bytes"), "power_w_mean": mean("power_w"),
            "sm_clock_mhz_mean": mean("sm_clock_mhz")}


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Identical requests, and the mean fraction of each output before the first differing token."""
    same = 0
    prefix_fracs = []
    for a, b in zip(ours, theirs):
        if a == b:
            same += 1
            prefix_fracs.append(1.0)
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix_fracs.append(k / max(len(a), 1))
    return {"identical_requests": same, "num_requests": len(ours),
            "mean_matching_prefix": statistics.fmean(prefix_fracs) if prefix_fracs else None}


# ----------------------------------------------------------------------------------- HF peers
def _hf_state_from_ours(model, config) -> dict:
    """Our Qwen3 state dict in Hugging Face names: split the packed ``qkv_proj`` (rows
    q | k | v) and ``gate_up_proj`` (rows gate | up) back into their parts."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * d
    kv = config.num_key_value_heads * d
    out = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def load_hf_model(engine):
    """The same weights as ``engine``'s model, as a transformers model on the same device
    and dtype: loaded from the checkpoint directory, or (random models) copied from ours."""
    import torch
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    src, dev, dt = engine.source, engine.config.device, engine.config.dtype
    if src.checkpoint_dir is not None:
        hf_logging.disable_progress_bar()  # a loading bar per benchmark run is noise in logs and notebooks
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(src.checkpoint_dir), dtype=dt)
        finally:
            hf_logging.enable_progress_bar()
    else:
        hf = AutoModelForCausalLM.from_config(src.hf_config, dtype=dt)
        sd = _hf_state_from_ours(engine.runner.model, src.hf_config)
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and src.hf_config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"weight layout mismatch copying to transformers: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    return hf.to(dev).eval()


def run_hf_generate(hf, workload: Workload, batch_size: int, pad_token_id: int, device) -> dict:
    """transformers ``generate`` on padded batches in request order (left padding, greedy,
    eos disabled so every row runs to the batch's longest output). Throughput counts only
    the tokens each request asked for."""
    import torch

    outputs: list[list[int]] = []
    n = workload.num_requests
    _sync(device)
    t0 = time.perf_counter()
    for start in range(0, n, batch_size):
        prompts = workload.prompts[start:start + batch_size]
        outs = workload.output_lens[start:start + batch_size]
        width, m = max(len(p) for p in prompts), max(outs)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              max_new_tokens=m, eos_token_id=None, pad_token_id=pad_token_id)
        if gen.shape[1] != width + m:
            raise RuntimeError(f"transformers generate stopped at {gen.shape[1] - width} of {m} new tokens")
        new = gen[:, width:].tolist()
        outputs.extend(row[:k] for row, k in zip(new, outs))
    _sync(device)
    t1 = time.perf_counter()
    return {"seconds": t1 - t0, "outputs": outputs, "batch_size": batch_size}


def run_hf_continuous_batching(hf, workload: Workload, device) -> dict:
    """transformers' continuous batching manager (the machinery behind ``generate_batch``),
    one request per prompt with its own ``max_new_tokens``, eos disabled. Set-up (cache
    allocation, warm-up) is outside the timed region, as for minivllm."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cuda = device.type == "cuda"
    total = workload.num_prompt_tokens + workload.num_output_tokens
    page = 256 if cuda else 16
    cb_kwargs: dict[str, Any] = {"auto_switch_to_flash": False}  # flash kernels come from the Hub: offline
    if not cuda:  # automatic sizing probes device memory; on CPU give it the whole workload
        cb_kwargs.update(page_size=page, num_blocks=total // page + 2 * workload.num_requests + 8,
                         max_batch_tokens=2048)
    cb_config = ContinuousBatchingConfig(**cb_kwargs)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1,
                                  pad_token_id=0)
    results: dict[str, Any] = {}
    with torch.inference_mode(), hf.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=10,
            warmup=cuda) as manager:
        _sync(device)
        t0 = time.perf_counter()
        rids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))]
        while len(results) < len(rids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching loop stopped unexpectedly")
                continue
            if res.is_finished():
                if res.error:
                    raise RuntimeError(f"transformers continuous batching: {res.error}")
                results[res.request_id] = res
        _sync(device)
        t1 = time.perf_counter()
    return {"seconds": t1 - t0, "outputs": [list(results[r].generated_tokens) for r in rids]}


# ----------------------------------------------------------------------------------- throughput
def run_throughput(model: str | None = None, *, workload: Workload | None = None, workload_name: str | None = None,
                   scale: float = 1.0, num_requests: int | None = None, input_len=None, output_len=None,
                   seed: int = 0, peers: tuple[str, ...] = ("hf_generate", "hf_generate_batch"),
                   hf_batch_size: int | None = None, sample_period_s: float = 0.1, log=print,
                   **engine_args) -> dict:
    """Run the offline workload on minivllm and on the transformers peers; returns a JSON-ready dict.

    ``peers``: any of "hf_generate", "hf_generate_batch" (empty: minivllm only).
    ``engine_args`` go to ``LLM`` (e.g. ``device``, ``attention_backend``, ``max_num_seqs``).
    """
    import torch
    import transformers

    from minivllm.telemetry.utilisation import UtilisationSampler

    transformers.logging.set_verbosity_error()
    name = workload_name or ("nano" if _wants_cuda(engine_args) else "cpu")
    if workload is None and engine_args.get("kv_cache_memory_bytes") is None and engine_args.get(
            "num_kvcache_blocks") is None:
        preset = WORKLOADS.get(name, WORKLOADS["cpu"])
        n = num_requests or max(1, round(preset["num_requests"] * scale))
        lens = (input_len or preset["input_len"])[1] + (output_len or preset["output_len"])[1]
        engine_args["kv_cache_memory_bytes"] = _kv_bytes_for(model, n * lens, engine_args.get("dtype"))
    llm = _build_llm(model, **engine_args)
    try:
        engine = llm.llm_engine
        cfg = engine.source.hf_config
        if workload is None:
            workload = make_workload(name, cfg.vocab_size, scale=scale, num_requests=num_requests,
                                     input_len=input_len, output_len=output_len,
                                     max_model_len=engine.config.max_model_len, seed=seed)
        device = engine.config.device
        cost, peaks = _cost_and_peaks(engine, log)
        result: dict[str, Any] = {
            "mode": "throughput", "model": engine.source.name, "device": _device_label(device),
            "dtype": str(engine.config.dtype).removeprefix("torch."),
            "attention_backend": engine.config.attention_backend, "workload": workload.describe(),
            "peaks": {"flops_per_s": peaks.flops_per_s, "bytes_per_s": peaks.bytes_per_s},
            "torch": torch.__version__, "transformers": transformers.__version__, "loadavg": _loadavg()}
        log(f"minivllm bench: model={result['model']} device={result['device']} dtype={result['dtype']} "
            f"attention={result['attention_backend']}")
        w = result["workload"]
        log(f"workload {w['name']}: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']} "
            f"(mean {w['prompt_len_mean']:.0f}), output {w['output_len_min']}..{w['output_len_max']} "
            f"(mean {w['output_len_mean']:.0f}); random token ids, greedy, ignore_eos")
        log(f"measured peaks: matmul {peaks.flops_per_s / 1e9:.1f} GFLOP/s, copy {peaks.bytes_per_s / 1e9:.1f} GB/s "
            f"(read + written)")

        # warm-up: kernels, allocator, lazy imports
        warm = make_workload("cpu", cfg.vocab_size, num_requests=2, input_len=(8, 16), output_len=(4, 4), seed=seed + 1)
        _drive(engine, warm)
        engine.reset_prefix_cache()

        sampler = UtilisationSampler(sample_period_s, device=str(device))
        with sampler:
            outs, records, t0, t1 = _drive(engine, workload)
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
            "ttft_ms": _percentiles([o.metrics.ttft_ms for o in outs]),
            "tpot_ms": _percentiles([o.metrics.tpot_ms for o in outs]),
            "itl_ms": _percentiles([x for o in outs for x in o.metrics.itl_ms]),
            "e2e_ms": _percentiles([o.metrics.e2e_ms for o in outs]),
            "roofline": _summarise_roofline(records, cost, peaks),
            "utilisation": _summarise_samples(sampler.samples),
            "time_breakdown_ms": {k: sum(getattr(r, k) for r in records) for k in
                                  ("schedule_ms", "prepare_ms", "model_ms", "sample_ms", "postprocess_ms")},
            "preemptions": sum(len(r.preempted) for r in records),
        }
        if sampler.nvml_error:
            mine["utilisation"]["nvml_error"] = sampler.nvml_error
        result["minivllm"] = mine
        result["peers"] = {}
        log("")
        log(f"{'engine':<28}{'seconds':>9}{'req/s':>9}{'out tok/s':>12}{'total tok/s':>13}{'minivllm x':>12}")
        _row(log, "minivllm", mine["seconds"], workload)

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
                        bs = hf_batch_size or (64 if device.type == "cuda" else min(32, workload.num_requests))
                        _warm_peer(hf, workload, device, pad)
                        r = run_hf_generate(hf, workload, bs, pad, device)
                        label = f"hf generate (batch {bs})"
                    elif p == "hf_generate_batch":
                        r = run_hf_continuous_batching(hf, workload, device)
                        label = "hf generate_batch (CB)"
                    else:
                        raise ValueError(f"unknown peer {p!r}: choose hf_generate or hf_generate_batch")
                except ValueError:
                    raise
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    result["peers"][p] = {"available": False, "reason": f"{type(e).__name__}: {e}"}
                    log(f"{p:<28}unavailable: {type(e).__name__}: {str(e)[:120]}")
                    continue
                agree = _agreement(ours_tokens, r.pop("outputs"))
                r.update(available=True, label=label, agreement=agree,
                         output_tokens_per_s=workload.num_output_tokens / r["seconds"],
                         total_tokens_per_s=(workload.num_output_tokens + workload.num_prompt_tokens) / r["seconds"],
                         speedup=r["seconds"] / secs)
                result["peers"][p] = r
                _row(log, label, r["seconds"], workload, r["speedup"])
            del hf
        log("")
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            q = mine[k]
            if q["p50"] is not None:
                log(f"minivllm {k[:-3].upper():<5} ms  p50 {q['p50']:9.2f}  p90 {q['p90']:9.2f}  p99 {q['p99']:9.2f}  "
                    f"mean {q['mean']:9.2f}")
        rf = mine["roofline"]
        if rf.get("mfu") is not None:
            log(f"roofline over the run: {rf['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s (MFU {rf['mfu']:.1%}), "
                f"{rf['achieved_bytes_per_s'] / 1e9:.2f} GB/s (MBU {rf['mbu']:.1%})")
        tb = mine["time_breakdown_ms"]
        tot = sum(tb.values()) or 1.0
        log("time in steps: " + ", ".join(f"{k[:-3]} {v / tot:.0%}" for k, v in tb.items()))
        u = mine["utilisation"]
        if u.get("gpu_util_percent_mean") is not None:
            log(f"NVML (windowed averages, {u['num_samples']} samples): SM busy {u['gpu_util_percent_mean']:.0f}%, "
                f"memory busy {u['mem_util_percent_mean']:.0f}%, power {u['power_w_mean']:.0f} W, "
                f"memory used max {u['mem_used_bytes_max'] / 2**30:.1f} GiB")
        elif u:
            log(f"CPU busy (psutil, {u['num_samples']} samples): {u['cpu_percent_mean']:.0f}% of all cores")
        for p, r in result["peers"].items():
            if r.get("available"):
                a = r["agreement"]
                log(f"greedy outputs vs {r['label']}: {a['identical_requests']}/{a['num_requests']} requests identical "
                    f"(mean matching prefix {a['mean_matching_prefix']:.1%})")
        return result
    finally:
        llm.shutdown()


def _warm_peer(hf, workload, device, pad):
    """One tiny generate so the peer's first-call costs stay out of its timing."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([workload.prompts[0][:8]], device=device)
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2,
                    eos_token_id=None, pad_token_id=pad)


def _row(log, label, seconds, workload, speedup=None):
    ratio = "1.00" if speedup is None else f"{speedup:.2f}"
    log(f"{label:<28}{seconds:>9.2f}{workload.num_requests / seconds:>9.2f}"
        f"{workload.num_output_tokens / seconds:>12.1f}"
        f"{(workload.num_output_tokens + workload.num_prompt_tokens) / seconds:>13.1f}{ratio:>12}")


# ----------------------------------------------------------------------------------- sweep
def run_sweep(model: str | None = None, *, batch_sizes=None, prompt_lens=None, context_len: int = 128,
              decode_steps: int = 12, warmup_steps: int = 3, repeats: int = 3, html: str | Path | None = None,
              seed: int = 0, log=print, **engine_args) -> dict:
    """Decode step time vs batch size (prompts of ``context_len`` tokens, ``decode_steps``
    timed steps after ``warmup_steps``) and prefill step time vs prompt length (median of
    ``repeats`` single-prompt steps); each point with its FLOPs, bytes, FLOP/s, bytes/s,
    arithmetic intensity, MFU and MBU. Writes a plotly roofline to ``html`` if given."""
    import torch

    from minivllm.sampling_params import SamplingParams
    from minivllm.telemetry.roofline import arithmetic_intensity, fill_step_record

    cuda = _wants_cuda(engine_args)
    batch_sizes = list(batch_sizes or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 2, 4, 8, 16, 32]))
    prompt_lens = list(prompt_lens or ([64, 128, 256, 512, 1024, 2048, 4096] if cuda else [16, 32, 64, 128, 256, 512]))
    if engine_args.get("kv_cache_memory_bytes") is None and engine_args.get("num_kvcache_blocks") is None:
        need = max(max(batch_sizes) * (context_len + warmup_steps + decode_steps + 2), max(prompt_lens) + 2)
        engine_args["kv_cache_memory_bytes"] = _kv_bytes_for(model, need, engine_args.get("dtype"))
    engine_args.setdefault("max_num_seqs", max(256, max(batch_sizes)))
    engine_args.setdefault("max_num_batched_tokens", max(8192, max(prompt_lens)))
    llm = _build_llm(model, **engine_args)
    rng = random.Random(seed)
    try:
        engine = llm.llm_engine
        cfg = engine.source.hf_config
        cost, peaks = _cost_and_peaks(engine, log)
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
                    "mfu": flops / (ms / 1e3) / peaks.flops_per_s, "mbu": nbytes / (ms / 1e3) / peaks.bytes_per_s,
                    "model_ms": statistics.median(r.model_ms for r in records), "num_steps": len(records)}

        max_len = engine.config.max_model_len
        # warm-up
        engine.add_request("sweep-warm", prompt(16), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

        decode = []
        log(f"decode sweep (context {context_len} tokens): batch, step ms, ms/seq, GFLOP/s, GB/s, MFU, MBU")
        for b in batch_sizes:
            if context_len + warmup_steps + decode_steps + 2 > max_len:
                raise ValueError(f"context_len={context_len} + steps does not fit max_model_len={max_len}")
            tag = next(_ids)
            for i in range(b):
                engine.add_request(f"sweep{tag}-{i}", prompt(context_len),
                                   SamplingParams(temperature=0, max_tokens=warmup_steps + decode_steps + 1,
                                                  ignore_eos=True))
            recs = []
            while engine.has_unfinished_requests():
                rec = engine.step_with_record().record
                if rec.phase == "decode" and rec.num_seqs == b:
                    recs.append(rec)
            recs = recs[warmup_steps:warmup_steps + decode_steps]
            if not recs:
                log(f"  batch {b}: no full decode steps (KV pool too small?)")
                continue
            p = point(recs, f"decode B={b}", batch_size=b, context_len=context_len)
            decode.append(p)
            log(f"  {b:5d} {p['step_ms']:9.2f} {p['step_ms'] / b:8.3f} {p['flops_per_s'] / 1e9:9.2f} "
                f"{p['bytes_per_s'] / 1e9:8.2f} {p['mfu']:6.1%} {p['mbu']:6.1%}")
            engine.reset_prefix_cache()

        prefill = []
        log("prefill sweep (one prompt per step): length, step ms, tok/s, GFLOP/s, GB/s, MFU, MBU")
        budget = engine.config.max_num_batched_tokens
        for n in prompt_lens:
            if n >= max_len or n > budget:
                log(f"  {n}: skipped (max_model_len {max_len}, step budget {budget})")
                continue
            recs = []
            for _ in range(repeats):
                engine.add_request(f"sweep{next(_ids)}", prompt(n),
                                   SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                while engine.has_unfinished_requests():
                    rec = engine.step_with_record().record
                    if rec.phase == "prefill":
                        recs.append(rec)
                engine.reset_prefix_cache()
            p = point(recs, f"prefill L={n}", prompt_len=n)
            prefill.append(p)
            log(f"  {n:5d} {p['step_ms']:9.2f} {n / p['step_ms'] * 1e3:9.0f} {p['flops_per_s'] / 1e9:9.2f} "
                f"{p['bytes_per_s'] / 1e9:8.2f} {p['mfu']:6.1%} {p['mbu']:6.1%}")

        result = {"mode": "sweep", "model": engine.source.name, "device": _device_label(engine.config.device),
                  "dtype": str(engine.config.dtype).removeprefix("torch."),
                  "attention_backend": engine.config.attention_backend,
                  "peaks": {"flops_per_s": peaks.flops_per_s, "bytes_per_s": peaks.bytes_per_s,
                            "ridge_intensity": peaks.ridge_intensity},
                  "model_cost": cost.to_dict(), "decode": decode, "prefill": prefill, "loadavg": _loadavg()}
        one = next((q for q in decode if q["batch_size"] == 1), None)
        if one is not None:
            log(f"decode at batch 1 moves {one['bytes_per_s'] / 1e9:.2f} GB/s = {one['mbu']:.0%} of the measured copy "
                f"bandwidth (project target >= 70% on a model of >= 200 MB)")
        log(f"ridge point: {peaks.ridge_intensity:.1f} FLOPs/byte (peaks {peaks.flops_per_s / 1e9:.1f} GFLOP/s, "
            f"{peaks.bytes_per_s / 1e9:.1f} GB/s); weights {cost.body_weight_bytes / 2**20:.1f} MiB")
        if html:
            path = write_roofline_html(result, html)
            result["html"] = str(path)
            log(f"roofline written to {path}")
        return result
    finally:
        llm.shutdown()


def roofline_figure(sweep: dict):
    """A plotly figure: the measured roofline with the sweep's points, plus step time vs
    batch size and vs prompt length."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    pk = sweep["peaks"]
    pts = sweep["decode"] + sweep["prefill"]
    xs = [p["intensity"] for p in pts] or [1.0]
    lo, hi = min(xs + [pk["ridge_intensity"]]) / 4, max(xs + [pk["ridge_intensity"]]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig = make_subplots(rows=1, cols=3, column_widths=[0.5, 0.25, 0.25],
                        subplot_titles=("Roofline (measured peaks)", "Decode step time", "Prefill step time"))
    fig.add_trace(go.Scatter(x=grid, y=[min(pk["flops_per_s"], x * pk["bytes_per_s"]) / 1e9 for x in grid],
                             mode="lines", name="ceiling: min(peak FLOP/s, I x peak B/s)",
                             line=dict(color="black")), row=1, col=1)
    for kind, color in (("decode", "#1f77b4"), ("prefill", "#d62728")):
        ps = sweep[kind]
        if not ps:
            continue
        fig.add_trace(go.Scatter(
            x=[p["intensity"] for p in ps], y=[p["flops_per_s"] / 1e9 for p in ps], mode="markers+text",
            text=[p["label"].split()[-1] for p in ps], textposition="top center", name=kind,
            marker=dict(color=color, size=9),
            hovertemplate="%{text}<br>I=%{x:.2f} FLOPs/B<br>%{y:.2f} GFLOP/s<extra>" + kind + "</extra>"),
            row=1, col=1)
    d, p = sweep["decode"], sweep["prefill"]
    fig.add_trace(go.Scatter(x=[q["batch_size"] for q in d], y=[q["step_ms"] for q in d], mode="lines+markers",
                             name="decode step ms", marker=dict(color="#1f77b4"), showlegend=False), row=1, col=2)
    fig.add_trace(go.Scatter(x=[q["prompt_len"] for q in p], y=[q["step_ms"] for q in p], mode="lines+markers",
                             name="prefill step ms", marker=dict(color="#d62728"), showlegend=False), row=1, col=3)
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOPs / byte)", row=1, col=1)
    fig.update_yaxes(type="log", title_text="GFLOP/s", row=1, col=1)
    fig.update_xaxes(type="log", title_text="batch size", row=1, col=2)
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=2)
    fig.update_xaxes(type="log", title_text="prompt tokens", row=1, col=3)
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=3)
    fig.update_layout(title=f"{sweep['model']} on {sweep['device']} ({sweep['dtype']})", height=480, width=1400)
    return fig


def write_roofline_html(sweep: dict, path: str | Path) -> Path:
    """Write :func:`roofline_figure` as a self-contained HTML file (plotly.js inlined: works offline)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    roofline_figure(sweep).write_html(str(path), include_plotlyjs=True)
    return path


# ----------------------------------------------------------------------------------- overhead
def _stub_run(runner, token_id: int):
    """Replacement for ``ModelRunner.run``: build the real inputs (ids, positions, attention
    metadata, on the engine's device), skip the model and sampler, return ``token_id`` for
    every sequence that samples."""
    from minivllm.engine.model_runner import RunnerOutput

    def run(plan):
        t0 = time.perf_counter()
        inp = runner.prepare_input(plan)
        t1 = time.perf_counter()
        return RunnerOutput(inp.sampling_seqs, [token_id] * len(inp.sampling_seqs), set(), (t1 - t0) * 1e3, 0.0, 0.0)

    return run


def run_overhead(model: str | None = None, *, batch_sizes=(1, 16, 64, 256), prompt_len: int = 128,
                 decode_steps: int = 64, warmup_steps: int = 8, seed: int = 0, log=print, **engine_args) -> dict:
    """Engine overhead with the model stubbed out: per batch size, the mean and median of
    ``LLMEngine.step()`` wall time over ``decode_steps`` decode-only steps, per sequence
    (microseconds), with the StepRecord breakdown (schedule / prepare / postprocess)."""
    from minivllm.sampling_params import SamplingParams

    bmax = max(batch_sizes)
    block = engine_args.get("block_size") or 16
    budget = engine_args.get("max_num_batched_tokens") or 8192
    # With chunked prefill the first-admitted sequences start decoding while later ones
    # still prefill, so they run ahead by up to this many steps: give every request room.
    lead = cdiv(bmax * prompt_len, budget) + 2
    max_tokens = warmup_steps + decode_steps + lead + 1
    per_seq = cdiv(prompt_len + max_tokens + 1, block)
    engine_args.setdefault("num_kvcache_blocks", bmax * per_seq + 8)
    engine_args.setdefault("max_num_seqs", max(256, bmax))
    engine_args.setdefault("enable_prefix_caching", True)
    llm = _build_llm(model, **engine_args)
    rng = random.Random(seed)
    try:
        engine = llm.llm_engine
        cfg = engine.source.hf_config
        high = min(cfg.vocab_size, 10000) - 1
        token = min(cfg.vocab_size - 1, 100)
        engine.runner.run = _stub_run(engine.runner, token)
        rows = []
        import os

        if engine.config.device.type == "cpu" and hasattr(os, "getloadavg") and \
                os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1):
            log(f"note: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: other processes compete "
                f"for the CPU, so the times below read high")
        log(f"engine overhead, model stubbed (fixed token), {prompt_len}-token prompts, "
            f"{decode_steps} decode steps per batch size")
        log(f"{'batch':>6}{'us/seq/step':>13}{'(median)':>10}{'step ms':>9}{'sched':>8}{'prep':>8}{'post':>8}"
            f"{'other':>8}{'nano-vllm':>11}")
        for b in batch_sizes:
            tag = next(_ids)
            rids = [f"ovh{tag}-{i}" for i in range(b)]
            for rid in rids:
                engine.add_request(rid, [rng.randint(0, high) for _ in range(prompt_len)],
                                   SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                   output_kind="final_only")  # as LLM.generate (and nano-vllm) do
            # prefill (possibly several chunked steps), then warm-up decodes
            while True:
                rec = engine.step_with_record().record
                if rec.phase == "decode" and rec.num_seqs == b:
                    break
            for _ in range(warmup_steps - 1):
                engine.step()
            times, recs = [], []
            for _ in range(decode_steps):
                t0 = time.perf_counter()
                res = engine.step_with_record()
                times.append(time.perf_counter() - t0)
                if res.record.phase != "decode" or res.record.num_seqs != b:
                    raise RuntimeError(f"overhead run: expected a decode step of {b} sequences, "
                                       f"got {res.record.phase} with {res.record.num_seqs}")
                recs.append(res.record)
            for rid in rids:
                engine.abort_request(rid)
            engine.reset_prefix_cache()
            mean_us = statistics.fmean(times) / b * 1e6
            row = {"batch_size": b, "us_per_seq_step": mean_us,
                   "us_per_seq_step_median": statistics.median(times) / b * 1e6,
                   "step_ms_mean": statistics.fmean(times) * 1e3,
                   "schedule_ms": statistics.fmean(r.schedule_ms for r in recs),
                   "prepare_ms": statistics.fmean(r.prepare_ms for r in recs),
                   "postprocess_ms": statistics.fmean(r.postprocess_ms for r in recs),
                   "nano_vllm_target_us": OVERHEAD_TARGETS_US.get(b)}
            # the rest of step(): building the StepRecord (with its roofline figures), bookkeeping
            row["other_ms"] = row["step_ms_mean"] - row["schedule_ms"] - row["prepare_ms"] - row["postprocess_ms"]
            rows.append(row)
            tgt = f"{row['nano_vllm_target_us']:.1f}" if row["nano_vllm_target_us"] else "-"
            log(f"{b:>6}{mean_us:>13.2f}{row['us_per_seq_step_median']:>10.2f}{row['step_ms_mean']:>9.3f}"
                f"{row['schedule_ms']:>8.3f}{row['prepare_ms']:>8.3f}{row['postprocess_ms']:>8.3f}"
                f"{row['other_ms']:>8.3f}{tgt:>11}")
        return {"mode": "overhead", "model": engine.source.name, "device": _device_label(engine.config.device),
                "prompt_len": prompt_len, "decode_steps": decode_steps, "rows": rows, "loadavg": _loadavg()}
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------------- CLI
def _resolve_threads(value: str) -> int | None:
    """``--threads``: an int >= 1, or "auto" (1 on an overloaded CPU, else None = leave torch's default)."""
    if value == "auto":
        load = _loadavg()
        return 1 if load is not None and load[0] > (os.cpu_count() or 1) else None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--threads {value!r}: expected 'auto' or an int >= 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="embedded model (default), 'random:qwen3-0.6b', or a local checkpoint directory")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="'nano' (256 requests, 100..1024 in/out; default on GPU) or 'cpu' (32 requests; default on CPU)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the workload's number of requests")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peers", action="store_true", help="run minivllm only")
    p.add_argument("--peers", default="hf_generate,hf_generate_batch",
                   help="comma-separated: hf_generate, hf_generate_batch")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="batch size of transformers generate (default: 32 on CPU, 64 on GPU)")
    p.add_argument("--sweep", action="store_true", help="decode vs batch and prefill vs length, with a roofline")
    p.add_argument("--html", default="bench_roofline.html", help="where --sweep writes its plotly roofline")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="for --sweep / --overhead")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="for --sweep")
    p.add_argument("--overhead", action="store_true", help="engine overhead with the model stubbed out")
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps for --sweep / --overhead")
    p.add_argument("--threads", default="auto",
                   help="torch CPU threads (torch.set_num_threads) for minivllm and the peers alike. 'auto' "
                        "(default): 1 when the load average already exceeds the core count (other work shares "
                        "the CPU and OpenMP threads would wait on each other, ~10x slower), else torch's default")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--quiet", action="store_true")
    e = p.add_argument_group("engine arguments")
    e.add_argument("--device", default=None)
    e.add_argument("--dtype", default=None)
    e.add_argument("--attention-backend", default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--enforce-eager", action="store_true", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m minivllm bench``: prints the results, returns exit status 0."""
    run_cli(argv)
    return 0


def run_cli(argv: list[str] | None = None) -> dict:
    """Parse ``python -m minivllm bench`` arguments, run the chosen mode(s), return the results dict."""
    args = build_parser().parse_args(argv)
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    import torch

    threads = _resolve_threads(args.threads)
    if args.threads == "auto" and (_wants_cuda({"device": args.device}) or threads is None):
        threads = None  # GPU runs and idle CPUs keep torch's default
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        if args.threads == "auto":
            log(f"load average {_loadavg()[0]:.1f} exceeds the {os.cpu_count()} cores: running with 1 torch "
                f"thread (pass --threads N to override)")
    try:
        return _run_modes(args, log)
    finally:
        torch.set_num_threads(previous_threads)


def _run_modes(args, log) -> dict:
    import torch

    engine_args = {k: getattr(args, k) for k in ("device", "dtype", "attention_backend", "max_num_seqs",
                                                 "max_num_batched_tokens", "block_size", "enforce_eager")
                   if getattr(args, k) is not None}
    results: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    if args.sweep:
        kw = {"decode_steps": args.decode_steps} if args.decode_steps else {}
        results["sweep"] = run_sweep(args.model, batch_sizes=args.batch_sizes, prompt_lens=args.prompt_lens,
                                     html=args.html, seed=args.seed, log=log, **kw, **engine_args)
    if args.overhead:
        kw = {"decode_steps": args.decode_steps} if args.decode_steps else {}
        if args.batch_sizes:
            kw["batch_sizes"] = tuple(args.batch_sizes)
        results["overhead"] = run_overhead(args.model, seed=args.seed, log=log, **kw, **engine_args)
    if not (args.sweep or args.overhead):
        peers = () if args.no_peers else tuple(x.strip() for x in args.peers.split(",") if x.strip())
        results["throughput"] = run_throughput(
            args.model, workload_name=args.workload, scale=args.scale, num_requests=args.num_requests,
            input_len=tuple(args.input_len) if args.input_len else None,
            output_len=tuple(args.output_len) if args.output_len else None, seed=args.seed, peers=peers,
            hf_batch_size=args.hf_batch_size, log=log, **engine_args)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        from minivllm.telemetry.export import _plain

        path.write_text(json.dumps(_plain(results), indent=1))
        log(f"results written to {path}")
    return results


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
