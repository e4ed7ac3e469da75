"""``python -m minivllm bench --quantization int8``: batch-1 decode of the quantised engine
against the unquantised one, in the same process and the same run, and their greedy agreement.

Both engines are built from the same model (same weights; ``random:`` presets are seeded) and
kept alive together; the timed runs alternate between them, round after round, so that load
from other processes falls on both alike. A timed run is one request (a ``prompt_len``-token
prompt, ids drawn with ``seed``) decoding ``decode_tokens`` tokens greedily at batch 1; the
figure per engine is the median inter-token latency over all rounds (robust to the odd
preempted step on a shared machine), and the mean TPOT of its best round is reported beside it.
Bytes per decode step come from each engine's ``ModelCost`` (int8 weights as 1 byte + scales),
so the achieved bandwidth and MBU of the int8 engine are computed on int8 bytes.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from minivllm.bench.common import ResultMixin, build_llm, device_label, format_load, loadavg
from minivllm.utils.checks import is_count

__all__ = ["QuantizationResult", "run_quantization", "print_quantization"]


@dataclass
class QuantizationResult(ResultMixin):
    """What :func:`run_quantization` measured (latencies in ms, bandwidths in bytes/s).

    Attributes:
        model / device / dtype / quantization / quantize_lm_head: what ran.
        kernel: the int8 matmul path(s) the quantised engine uses.
        prompt_len / decode_tokens / rounds: the timed workload (batch 1).
        loadavg_start / loadavg_end: 1/5/15-minute load averages around the timed runs.
        base / quant: per engine ``median_itl_ms``, ``best_tpot_ms``, ``tpot_ms`` (every round),
            ``bytes_per_step`` (the roofline model's bytes for one decode step at the run's middle
            context, ``prompt_len + decode_tokens // 2``: ``minivllm.telemetry.roofline.step_cost``,
            computed, not measured), ``achieved_bytes_per_s`` (bytes_per_step / median ITL), ``mbu``
            (None without peaks) and ``weight_bytes`` (ModelCost: layers + LM head).
        speedup: base median ITL / quant median ITL (> 1: int8 is faster).
        agreement: :func:`minivllm.quantization.accuracy.compare_greedy` (base as reference).
    """

    mode: str
    model: str
    device: str
    dtype: str
    quantization: str
    quantize_lm_head: bool
    kernel: str
    prompt_len: int
    decode_tokens: int
    rounds: int
    loadavg_start: list | None
    loadavg_end: list | None = None
    base: dict = field(default_factory=dict)
    quant: dict = field(default_factory=dict)
    speedup: float | None = None
    agreement: dict = field(default_factory=dict)


def _timed_decode(llm, prompt_ids: list[int], decode_tokens: int) -> tuple[float, list[float]]:
    from minivllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], sp, use_tqdm=False)[0]
    return out.metrics.tpot_ms, out.metrics.itl_ms


#: KV pool of each of the two engines on a GPU (batch-1 decode and 16 short agreement prompts use a
#: fraction of it, whatever the block size)
TWO_ENGINE_KV_BYTES = 1 << 30


def two_engine_kv_args(engine_args: dict) -> dict:
    """``engine_args`` with an explicit KV pool (``TWO_ENGINE_KV_BYTES``) on a GPU when they size none:
    the two engines live at once, and the second's memory profile would count the first's pool, sized
    to ``gpu_memory_utilization`` of the device, as its own use and find no room for one block."""
    from minivllm.config import resolve_device

    sized = any(engine_args.get(k) is not None
                for k in ("num_kvcache_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization"))
    if sized or resolve_device(engine_args.get("device") or "auto").type != "cuda":
        return engine_args
    return {**engine_args, "kv_cache_memory_bytes": TWO_ENGINE_KV_BYTES}


def run_quantization(model: str | None = None, *, quantization: str = "int8", quantize_lm_head: bool = True,
                     prompt_len: int = 16, decode_tokens: int = 32, rounds: int = 3, seed: int = 0,
                     agreement_tokens: int = 32, peaks: bool = True, log=print, peak_kwargs: dict | None = None,
                     **engine_args) -> QuantizationResult:
    """Measure batch-1 decode with and without ``quantization`` (see the module docstring).

    ``quantization``: the scheme of the quantised engine (``"int8"``), ``quantize_lm_head`` its LM
    head too; ``prompt_len`` tokens of prompt, ``decode_tokens`` timed output tokens, ``rounds``
    timed runs per engine (alternating), ``seed`` the prompt's random ids, ``agreement_tokens``
    greedy tokens compared on the fixed agreement prompts. ``engine_args`` go to both ``LLM``
    instances (on a GPU, with a 1 GiB KV pool each unless they size one: :func:`two_engine_kv_args`).
    ``peaks=False`` skips the device peak measurement (then MBU is None).

    Raises:
        ValueError: an unknown ``quantization`` or None (nothing to compare against), or a count
            that is not a positive int (naming it).
        TypeError: an engine argument ``LLM`` does not know (naming it).
    """
    import torch

    from minivllm.quantization.accuracy import AGREEMENT_PROMPTS, compare_greedy
    from minivllm.quantization.int8 import describe_kernel
    from minivllm.quantization.layer import check_quantization, quantized_layers
    from minivllm.telemetry.roofline import step_cost

    if check_quantization(quantization) is None:
        raise ValueError("quantization=None: nothing to compare against")
    for name, v in (("prompt_len", prompt_len), ("decode_tokens", decode_tokens), ("rounds", rounds),
                    ("agreement_tokens", agreement_tokens)):
        if not is_count(v, 1):
            raise ValueError(f"{name}={v!r}: must be a positive int")
    prompt_len, decode_tokens, rounds, agreement_tokens = map(int, (prompt_len, decode_tokens, rounds, agreement_tokens))
    engine_args = two_engine_kv_args(engine_args)
    base = build_llm(model, **engine_args)
    try:
        quant = build_llm(model, quantization=quantization, quantize_lm_head=quantize_lm_head, **engine_args)
        try:
            eng = quant.llm_engine
            kernels = sorted({m.int8.kernel for m in quantized_layers(eng.runner.model)})
            vocab = eng.source.hf_config.vocab_size
            gen = torch.Generator().manual_seed(seed)
            prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            result = QuantizationResult(
                mode="quantization", model=eng.source.name, device=device_label(eng.config.device),
                dtype=str(eng.config.dtype).removeprefix("torch."), quantization=quantization,
                quantize_lm_head=quantize_lm_head,
                kernel="; ".join(describe_kernel(k) for k in kernels) or "(no layer quantised: tensor-parallel "
                                                                        "ranks hold them)",
                prompt_len=prompt_len, decode_tokens=decode_tokens, rounds=rounds, loadavg_start=loadavg())
            log(f"int8 path: {result.kernel}")
            engines = {"base": base, "quant": quant}
            for llm in engines.values():  # warm-up: first-call allocations and lazy inits
                _timed_decode(llm, prompt, 2)
            tpots = {k: [] for k in engines}
            itls = {k: [] for k in engines}
            for r in range(rounds):
                for key, llm in engines.items():
                    tpot, itl = _timed_decode(llm, prompt, decode_tokens)
                    tpots[key].append(tpot)
                    itls[key].extend(itl)
                log(f"round {r + 1}/{rounds}: TPOT base {tpots['base'][-1]:.2f} ms, "
                    f"{quantization} {tpots['quant'][-1]:.2f} ms")
            result.loadavg_end = loadavg()
            pk = None
            if peaks:
                from minivllm.telemetry.peaks import get_peaks

                # measured now, like the other modes: a cached peak from a quieter hour would
                # make this run's MBU read low, one from a busier hour above 100%
                pk = get_peaks(eng.config.device, eng.config.dtype, refresh=True, **(peak_kwargs or {}))
            mid_context = prompt_len + decode_tokens // 2
            for key, llm in engines.items():
                cost = llm.llm_engine.model_cost
                _, nbytes = step_cost(cost, [(1, mid_context)], 1)
                med = statistics.median(itls[key])
                figures = {"median_itl_ms": med, "best_tpot_ms": min(tpots[key]), "tpot_ms": tpots[key],
                           "bytes_per_step": nbytes, "achieved_bytes_per_s": nbytes / (med / 1e3),
                           "weight_bytes": cost.body_weight_bytes + cost.lm_head_bytes, "mbu": None}
                if pk is not None:
                    figures["mbu"] = figures["achieved_bytes_per_s"] / pk.mbu_bytes_per_s
                setattr(result, key, figures)
            result.speedup = result.base["median_itl_ms"] / result.quant["median_itl_ms"]
            result.agreement = compare_greedy(base, quant, AGREEMENT_PROMPTS, agreement_tokens)
            return result
        finally:
            quant.shutdown()
    finally:
        base.shutdown()


def print_quantization(r: QuantizationResult, log=print) -> None:
    """The summary lines of :func:`run_quantization`."""
    log(f"\n{r.model} on {r.device}, {r.dtype}: batch-1 decode, {r.prompt_len}-token prompt, "
        f"{r.decode_tokens} tokens x {r.rounds} rounds (alternating); load {format_load(r.loadavg_start)} -> "
        f"{format_load(r.loadavg_end)}")
    for key, name in (("base", r.dtype), ("quant", r.quantization)):
        f = r[key]
        mbu = "" if f["mbu"] is None else f", MBU {f['mbu']:.1%}"
        log(f"  {name:>8}: median ITL {f['median_itl_ms']:.2f} ms (best TPOT {f['best_tpot_ms']:.2f} ms), "
            f"weights {f['weight_bytes'] / 2**20:.0f} MiB, {f['bytes_per_step'] / 2**20:.0f} MiB/step -> "
            f"{f['achieved_bytes_per_s'] / 1e9:.2f} GB/s{mbu}")
    way = f"{r.speedup:.2f}x faster" if r.speedup >= 1 else f"{1 / r.speedup:.2f}x slower"
    log(f"  {r.quantization} vs {r.dtype}: {way} per decode token (median ITL {r.dtype} / {r.quantization}: "
        f"{r.speedup:.2f}x)")
    a = r.agreement
    log(f"  greedy agreement ({a['num_prompts']} prompts x {a['max_tokens']} tokens): {a['prefix_agreement']:.1%} "
        f"of tokens before the first difference, {a['position_agreement']:.1%} position-wise, "
        f"{a['identical']}/{a['num_prompts']} identical")
