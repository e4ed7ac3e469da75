"""Helpers shared by the benchmark modes: engine set-up, driving a workload, summaries."""
from __future__ import annotations

import contextlib
import gc
import itertools
import math
import numbers
import os
import statistics
import time
from typing import Any

from minivllm.bench.workload import Workload
from minivllm.utils.gc_heap import heap_frozen

_ids = itertools.count()  # request-id prefixes unique within the process


def percentiles(values, ps=(50, 90, 99)) -> dict:
    """``{"p50": ..., "p90": ..., "p99": ..., "mean": ...}`` of ``values`` (None entries skipped; all
    None where none is left), in their unit. Each percentile interpolates linearly between the two
    closest ranks (numpy's default "linear" method, Hyndman and Fan's definition 7).

    Raises:
        ValueError: a percentile outside [0, 100] (naming it)."""
    bad = [p for p in ps if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 100]
    if bad:
        raise ValueError(f"percentiles {bad}: each must be a number in [0, 100]")
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


def sync(device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing to wait for on a CPU."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def device_label(device) -> str:
    """What a benchmark ran on, for its header: ``"cuda (<GPU name>)"`` or ``"cpu (<CPU name>, N threads)"``."""
    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    from minivllm.utils.env_report import device_name

    n = torch.get_num_threads()
    return f"cpu ({device_name(device)}, {n} thread{'s' if n != 1 else ''})"


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (``os.getloadavg``), or ``None`` where unavailable."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def format_load(load: list[float] | None) -> str:
    """``"0.88 / 0.86 / 1.03"`` (1, 5, 15 minutes) or ``"n/a"``."""
    return " / ".join(f"{x:.2f}" for x in load) if load else "n/a"


def wants_cuda(engine_args: dict) -> bool:
    """Whether an engine built from ``engine_args`` runs on CUDA (``device`` "cuda...", or "auto" with a GPU)."""
    import torch

    dev = str(engine_args.get("device") or "auto")
    return dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())


def check_batch_sizes(batch_sizes, engine_args: dict) -> None:
    """Refuse decode batch sizes a run could never form: below 1, or above a ``max_num_seqs`` or
    ``max_num_batched_tokens`` the caller gave (the scheduler would never run that many at once,
    and a loop waiting for such a step would wait for ever).

    Raises:
        ValueError: naming the batch sizes (and the limit they pass).
    """
    sizes = list(batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes={sizes}: each must be an int of at least 1")
    for name in ("max_num_seqs", "max_num_batched_tokens"):  # a decode step of b sequences needs b of each
        limit = engine_args.get(name)
        if limit is not None and max(sizes) > limit:
            raise ValueError(f"batch_sizes={[int(b) for b in sizes]}: {max(sizes)} is above {name}={limit}, so no "
                             f"step could carry that many sequences")


def build_llm(model, **engine_args):
    """``LLM(model, **engine_args)`` without the arguments left at None (the command line's "not given")."""
    from minivllm import LLM

    return LLM(model, **{k: v for k, v in engine_args.items() if v is not None})


def cost_and_peaks(engine, log=None, peak_kwargs: dict | None = None):
    """The model's cost figures, and the device peaks measured now (1.2 s on one thread of the Zen 4
    dev EPYC, 2026-12-05; the
    cache keeps the best figure seen for later cached reads). ``peak_kwargs`` go to
    ``measure_peaks`` (sizes, repeats)."""
    from minivllm.telemetry.peaks import get_peaks
    from minivllm.telemetry.roofline import engine_cost

    cost = engine_cost(engine)
    peaks = get_peaks(engine.config.device, engine.config.dtype, refresh=True, **(peak_kwargs or {}))
    if log is not None and engine.config.device.type == "cpu" and hasattr(os, "getloadavg"):
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if load > 0.75 * cores:
            log(f"note: load average {load:.1f} on {cores} cores: other processes compete for the CPU, "
                f"so times below read long and throughputs low, and a peak measured now can read low, which makes "
                f"MFU and MBU read high, above 100% at times (--threads 1 suffers least)")
    return cost, peaks


def kv_bytes_for(model, tokens: int, dtype: str | None = None, kv_cache_dtype: str | None = None) -> int | None:
    """CPU KV pool size in bytes holding at least ``tokens`` tokens (None on a machine with CUDA, even
    for a CPU run: keep the engine's default). ``dtype`` None or "auto" is float32 (4 bytes, the CPU's default); ``kv_cache_dtype`` as
    ``EngineArgs`` takes it ("bfloat16": 2 bytes an element). 10% and 1 MiB above the need (the
    pool is whole blocks, so a last partial block is covered), and never below the engine's own
    512 MiB CPU default: a small run is not given a smaller pool than it would have by default."""
    from minivllm.config import KV_CACHE_DTYPES
    from minivllm.telemetry.roofline import ModelCost
    from minivllm.utils.model_source import resolve_model

    import torch

    if torch.cuda.is_available():
        return None
    cfg = resolve_model(model).hf_config
    cost = ModelCost.from_config(cfg, dtype=4 if dtype in (None, "auto") else dtype,
                                 kv_dtype=KV_CACHE_DTYPES.get(kv_cache_dtype or "auto"))  # a bad name: the engine names it
    need = int(tokens * cost.kv_bytes_per_token * 1.1) + (1 << 20)
    return max(need, 512 << 20)


@contextlib.contextmanager
def frozen_heap():
    """Around a timed run: collect garbage, then run with every object that survives out of the
    collector's generations (:func:`~minivllm.utils.gc_heap.heap_frozen`), so that a full collection
    during the run walks only what the run itself made, not the process's whole heap (torch,
    transformers, the models: a full collection inside the throughput run took 106-138 ms of its
    ~1.1 s, in two of two runs a reviewer traced on the 2-core dev EPYC, docs/benchmarks.md). The collector
    stays on; Python's ``timeit`` switches it off
    for the same reason."""
    gc.collect()
    with heap_frozen():
        yield


def drive(engine, workload: Workload, temperature: float = 0.0):
    """Add every request at once and step the engine until all finish. Each request's output
    comes when it finishes (``output_kind="final_only"``, as ``LLM.generate`` asks; per-step
    cumulative outputs would build a text and an output object per request per step).

    Returns ``(outputs in workload order, step records, t_start, t_end)``.
    """
    from minivllm.sampling_params import SamplingParams

    run = next_tag()
    rids = [f"bench{run}-{i}" for i in range(workload.num_requests)]
    finals: dict[str, Any] = {}
    records = []
    t0 = time.perf_counter()
    for rid, prompt, n in zip(rids, workload.prompts, workload.output_lens):
        engine.add_request(rid, prompt, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True),
                           output_kind="final_only")
    while engine.has_unfinished_requests():
        res = engine.step_with_record()
        records.append(res.record)
        for out in res.outputs:
            if out.finished:
                finals[out.request_id] = out
    t1 = time.perf_counter()
    return [finals[r] for r in rids], records, t0, t1


def summarise_roofline(records, cost, peaks) -> dict:
    """Totals over a run's step records (each filled by ``fill_step_record``): ``flops``, ``bytes``,
    ``step_seconds`` (the steps that ran tokens), achieved FLOP/s and bytes/s over those seconds, and
    with ``peaks`` ``mfu`` / ``mbu`` (fractions, not percent)."""
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
        out["mbu"] = nbytes / busy / peaks.mbu_bytes_per_s
    return out


def summarise_samples(samples) -> dict:
    """Means (CPU and GPU busy %, power W, SM clock MHz) and peaks (bytes) of a run's
    ``UtilisationSample`` list; ``{}`` without samples."""
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


def next_tag() -> int:
    """A process-unique number for request-id prefixes."""
    return next(_ids)


class ResultMixin:
    """For the result dataclasses of the modes: ``to_dict()`` (JSON-ready) and read-only
    ``result["field"]`` access, the form the notebooks were written against."""

    def to_dict(self) -> dict:
        """Every field, recursively (``dataclasses.asdict``): JSON-ready."""
        import dataclasses

        return dataclasses.asdict(self)

    def __getitem__(self, key: str):
        import dataclasses

        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return getattr(self, key)
