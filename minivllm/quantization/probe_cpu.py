"""Time the CPU int8 matmul candidates on Qwen3-0.6B's linear shapes
(``python -m minivllm.quantization.probe_cpu``): the measurement behind the CPU path's choice;
with ``--engine random:qwen3-0.6b``, the int8 matmuls timed inside the engine instead.

Candidates, each computing ``x [m, k] @ W.T`` for ``W [n, k]``:

* ``fp32-packed``: the engine's fp32 path (the weight packed as the engine packs it: panels for our
  GEMM, else oneDNN; :mod:`minivllm.layers.prepack`);
* ``panel-int8``: :class:`minivllm.quantization.int8.Int8Weight` on our panel GEMM's int8 panels
  (weight-only; the CPU default where the GEMM builds);
* ``fbgemm-dynamic``: :class:`minivllm.quantization.int8.Int8Weight` on torch's fbgemm dynamic linear;
* ``int8pack-mm``: ``torch._weight_int8pack_mm`` (weight-only int8, torch's own CPU kernel);
* ``reference``: dequantise + ``F.linear``.

Each figure is the best of ``trials`` means over ``repeats`` calls (ms), with the weight bytes
read per ms as GB/s. Every candidate cycles through enough copies of its weight to hold at least
``cold_bytes`` (default 512 MiB, beyond the CPU caches measured: the 2-core Xeon's L3 holds 260 MiB), so each call reads its weight from memory as
an engine step does, not from a cache warmed by the previous call. Numbers on a shared machine
vary; compare within one run.
"""
from __future__ import annotations

import argparse
import os
import time

SHAPES = ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936))


def _time_ms(fn, repeats: int, trials: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t) / repeats * 1e3)
    return best


class _Cycle:
    """Calls ``fn(weight)`` on the next of several weight copies each time."""

    def __init__(self, fn, copies):
        self.fn, self.copies, self.i = fn, copies, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.copies)
        return self.fn(self.copies[self.i])


def probe(rows=(1, 8), shapes=SHAPES, repeats: int = 5, trials: int = 3, cold_bytes: int = 512 << 20,
          log=print) -> list[dict]:
    """Time every candidate on every ``(k, n)`` in ``shapes`` at every row count; returns one dict
    per (shape, rows) with ``{candidate: ms}`` and prints a line each."""
    import torch

    from minivllm.layers import cpu_gemm
    from minivllm.layers.prepack import linear, pack_weight
    from minivllm.quantization.int8 import Int8Weight, quantize_per_channel

    out = []
    gen = torch.Generator().manual_seed(0)
    for k, n in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02

        def copies(make, nbytes):
            return [make() for _ in range(max(1, -(-cold_bytes // nbytes)))]

        packed = copies(lambda: pack_weight(w), 4 * n * k)
        q, scale = quantize_per_channel(w)
        qs = copies(lambda: q.clone(), n * k)
        fb = copies(lambda: Int8Weight(w, "fbgemm-dynamic"), n * k)
        pq = copies(lambda: Int8Weight(w, "panel-int8"), n * k) if cpu_gemm.load() is not None and n % 16 == 0 else []
        ref = copies(lambda: Int8Weight(w, "reference"), n * k)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            r = repeats if n < 100_000 else 1
            cands = {"fp32-packed": _Cycle(lambda p: linear(x, p), packed),
                     **({"panel-int8": _Cycle(lambda iw: iw.matmul(x), pq)} if pq else {}),
                     "fbgemm-dynamic": _Cycle(lambda iw: iw.matmul(x), fb),
                     "int8pack-mm": _Cycle(lambda qq: torch._weight_int8pack_mm(x, qq, scale), qs),
                     "reference": _Cycle(lambda iw: iw.matmul(x), ref)}
            ms = {name: _time_ms(f, r, trials) for name, f in cands.items()}
            out.append({"k": k, "n": n, "m": m, "ms": ms})
            log(f"{k:>5}->{n:<6} x{m:<2} " + "  ".join(
                f"{name} {t:.3f} ms ({n * k * (4 if name == 'fp32-packed' else 1) / t / 1e6:.1f} GB/s)"
                for name, t in ms.items()))
    return out


def engine_linear_times(model: str = "random:qwen3-0.6b", max_tokens: int = 9, prompt_len: int = 16,
                        log=print) -> dict:
    """Per-call time of every int8 matmul inside the engine, during one greedy generate at batch 1
    (``LLM(model, quantization="int8")``): ``{"tpot_ms", "by_shape": {(k, n, rows): (calls, ms per
    call)}}``. Set the thread count before calling. Wraps :meth:`Int8Weight.matmul` while it runs."""
    from minivllm import LLM, SamplingParams
    from minivllm.quantization.int8 import Int8Weight

    llm = LLM(model, quantization="int8")
    original = Int8Weight.matmul
    total: dict = {}

    def timed(self, x, bias=None):
        t = time.perf_counter()
        y = original(self, x, bias)
        key = (self.in_features, self.out_features, x.reshape(-1, x.shape[-1]).shape[0])
        calls, secs = total.get(key, (0, 0.0))
        total[key] = (calls + 1, secs + time.perf_counter() - t)
        return y

    Int8Weight.matmul = timed
    try:
        out = llm.generate([{"prompt_token_ids": list(range(100, 100 + prompt_len))}],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
    finally:
        Int8Weight.matmul = original
        llm.shutdown()
    by_shape = {k: (c, s / c * 1e3) for k, (c, s) in sorted(total.items())}
    # one-row calls of the decode steps (max_tokens - 1 of them): all of them, less the LM head
    # call of the prefill step (the only one-row call there)
    head = max(by_shape, key=lambda key: key[1])
    one_row = sum(c * ms for (k, n, m), (c, ms) in by_shape.items() if m == 1)
    decode_ms = (one_row - by_shape[head][1]) / max(1, max_tokens - 1)
    log(f"engine, {model}, batch 1: TPOT {out.metrics.tpot_ms:.1f} ms, int8 matmuls ~{decode_ms:.1f} ms of it per step")
    for (k, n, m), (c, ms) in by_shape.items():
        log(f"  {k:>5}->{n:<6} x{m:<3} {c:4d} calls, {ms:.3f} ms/call")
    return {"tpot_ms": out.metrics.tpot_ms, "decode_matmul_ms": decode_ms, "by_shape": by_shape}


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    p = argparse.ArgumentParser(prog="python -m minivllm.quantization.probe_cpu",
                                description="Time the CPU int8 matmul candidates on Qwen3-0.6B's linear shapes.")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8],
                   help="activation rows (tokens in the step) to time (default 1 8)")
    p.add_argument("--engine", default=None, metavar="MODEL",
                   help="instead: time the int8 matmuls inside LLM(MODEL, quantization='int8') at batch 1")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, torch {torch.__version__}, {args.threads} threads, "
          f"load {os.getloadavg()}")
    res = engine_linear_times(args.engine) if args.engine else probe(tuple(args.rows))
    print(f"load at the end {os.getloadavg()}")
    return res


if __name__ == "__main__":
    main()
