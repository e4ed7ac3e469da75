"""The CUDA check of int8 weights: our Triton kernel's accuracy and speed against cuBLAS, and
the int8 engine against the bf16 one (``python -m minivllm.quantization.gpu_check_int8``).

Meant to be called from ``scripts/gpu_check.py``::

    from minivllm.quantization.gpu_check_int8 import check_int8
    result = check_int8(log=print)      # dict; result["ok"] is False on an accuracy failure

Speed figures are reported, never asserted (a shared GPU can be slow for reasons of its own).
"""
from __future__ import annotations

import argparse
import json
import time

#: (in_features, out_features) of Qwen3-0.6B's linears: qkv, o, gate_up, down, LM head
QWEN3_06B_SHAPES = ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936))
#: candidate (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) tilings timed at one row beside the default
TILE_CANDIDATES = ((16, 16, 128, 4), (16, 32, 128, 4), (16, 64, 128, 4), (16, 32, 256, 4), (16, 64, 64, 4))


def _cuda_time_ms(fn, repeats: int = 50) -> float:
    """Median of ``repeats`` CUDA-event timings of ``fn()`` (after 5 warm-up calls), in ms."""
    import statistics

    import torch

    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def check_kernel(device: str = "cuda", dtype=None, rows=(1, 8, 64, 512), shapes=QWEN3_06B_SHAPES,
                 log=print, timed: bool = True) -> dict:
    """Accuracy (vs ``F.linear`` with the dequantised weight in ``dtype``) and speed (vs
    ``F.linear`` with the float weight, cuBLAS) of :func:`minivllm.quantization.triton_int8.int8_linear`.
    ``timed=False``: accuracy only (times None, no tile sweep), e.g. on the CPU under
    ``TRITON_INTERPRET=1``.

    Returns ``{"ok": bool, "cases": [...], "tiles": [...]}``; a case fails when the largest error
    exceeds 2% of the largest reference output (bf16 output rounding is ~0.4%).
    """
    import torch
    import torch.nn.functional as F

    from minivllm.quantization.int8 import dequantize, quantize_per_channel
    from minivllm.quantization.triton_int8 import block_sizes, int8_linear

    dtype = dtype or torch.bfloat16
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    cases, ok = [], True
    for k, n in shapes:
        w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.float32) * 0.02
        q, scale = quantize_per_channel(w)
        w_deq = dequantize(q, scale, dtype)
        w_float = w.to(dtype)
        del w
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.float32).to(dtype)
            got = int8_linear(x, q, scale)
            want = F.linear(x.float(), w_deq.float()).to(dtype)
            rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            case = {"k": k, "n": n, "m": m, "rel_error": rel, "tiles": block_sizes(m, n, k), "ok": rel < 0.02}
            ok &= case["ok"]
            cases.append(case)
            if not timed:
                log(f"int8 kernel {k}->{n} x{m} rel err {rel:.2e} {'ok' if case['ok'] else 'FAIL'} (untimed)")
                continue
            t_int8 = _cuda_time_ms(lambda: int8_linear(x, q, scale))
            t_float = _cuda_time_ms(lambda: F.linear(x, w_float))
            case.update(int8_ms=t_int8, float_ms=t_float, speedup=t_float / t_int8,
                        int8_gb_s=(n * k + 4 * n) / t_int8 / 1e6,
                        float_gb_s=n * k * w_float.element_size() / t_float / 1e6)
            log(f"int8 kernel {k:>5}->{n:<6} x{m:<4} rel err {rel:.2e} {'ok' if case['ok'] else 'FAIL'}  "
                f"{t_int8 * 1e3:8.1f} us ({case['int8_gb_s']:.0f} GB/s) vs {dtype} cuBLAS {t_float * 1e3:8.1f} us "
                f"({case['float_gb_s']:.0f} GB/s): {case['speedup']:.2f}x")
    tiles = []
    for k, n in shapes if timed else ():
        q, scale = quantize_per_channel(torch.randn(n, k, device=dev, generator=gen) * 0.02)
        x = torch.randn(1, k, device=dev, generator=gen).to(dtype)
        row = {"k": k, "n": n, "default": block_sizes(1, n, k), "ms": {}}
        for tile in TILE_CANDIDATES:
            row["ms"][str(tile)] = _cuda_time_ms(lambda: int8_linear(x, q, scale, blocks=tile), repeats=30)
        best = min(row["ms"], key=row["ms"].get)
        log(f"tiles at 1 row, {k}->{n}: default {row['default']}; best {best} {row['ms'][best] * 1e3:.1f} us; "
            + ", ".join(f"{t} {v * 1e3:.1f}" for t, v in row["ms"].items()))
        tiles.append(row)
    return {"ok": ok, "cases": cases, "tiles": tiles}


def check_engine(model: str = "random:qwen3-0.6b", decode_tokens: int = 64, rounds: int = 3, log=print,
                 **engine_args) -> dict:
    """``bench --quantization int8`` on CUDA: batch-1 decode of the int8 engine vs the bf16 one
    (:func:`minivllm.bench.quant.run_quantization`), as a dict."""
    from minivllm.bench.quant import print_quantization, run_quantization

    r = run_quantization(model, quantization="int8", decode_tokens=decode_tokens, rounds=rounds, peaks=False,
                         log=log, **engine_args)
    print_quantization(r, log)
    return r.to_dict()


def check_int8(device: str = "cuda", engine: bool = True, log=print) -> dict:
    """:func:`check_kernel` then (``engine=True``) :func:`check_engine`; ``{"ok", "kernel",
    "engine", "seconds"}``. Raises ``RuntimeError`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("check_int8 needs a CUDA device")
    t0 = time.perf_counter()
    out = {"kernel": check_kernel(device, log=log)}
    if engine:
        out["engine"] = check_engine(log=log, device=device)
    out["ok"] = out["kernel"]["ok"]
    out["seconds"] = time.perf_counter() - t0
    log(f"int8 GPU check: {'ok' if out['ok'] else 'FAILED'} in {out['seconds']:.0f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.quantization.gpu_check_int8",
                                description="The CUDA check of int8 weights: our Triton kernel's accuracy and "
                                            "speed against cuBLAS, and the int8 engine against the bf16 one.")
    p.add_argument("--no-engine", action="store_true", help="check the kernel only, not the int8 engine")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    out = check_int8(engine=not args.no_engine)
    if args.json:
        from minivllm.telemetry.export import _plain

        with open(args.json, "w") as f:
            json.dump(_plain(out), f, indent=1)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
