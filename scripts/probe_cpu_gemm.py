"""Time CPU linears on this machine: F.linear (MKL), oneDNN prepacked (1-row and 8-row layouts)
and minivllm's panel GEMM (float32 panels, and 16-bit panels of the same weights rounded to
bfloat16 / float16 as a 16-bit checkpoint holds them), on the shapes of Qwen3-0.6B's layers.

    python scripts/probe_cpu_gemm.py [--threads 1] [--cold-mib 176]

Two tables. Decode: the four linears of one layer (qkv 1024->4096, o 2048->1024, gate_up
1024->6144, down 3072->1024), over enough copies of their weights to exceed the CPU's caches,
so every call reads its weight from memory as an engine step does; milliseconds per pass over
all copies (median of 7) and the weight bytes read per second (16-bit panels read 2 bytes a weight). Prefill: one layer's qkv and down
shapes at 64-512 rows, cache-resident, GFLOP/s (median of 5). The figures in
``minivllm/layers/cpu_gemm.py`` came from this script.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from minivllm.layers import cpu_gemm

LAYER = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # (in, out)


def paths(w: torch.Tensor) -> dict:
    """name -> (packed weight, call(x, packed), bytes read per weight)."""
    out = {"F.linear (MKL)": (w, F.linear, 4)}
    for hint in (1, 8):
        out[f"oneDNN {hint}-row layout"] = (torch.ops.mkldnn._reorder_linear_weight(w, hint),
                                           lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                                           4)
    gemm = cpu_gemm.load()
    if gemm is not None:
        out["panel GEMM"] = (cpu_gemm.pack_panels(w), gemm, 4)
        for dtype in (torch.bfloat16, torch.float16):
            if dtype in gemm.panel_dtypes:  # the weight's values rounded to dtype, as a checkpoint holds them
                name = f"panels {str(dtype).removeprefix('torch.')}"
                out[name] = (cpu_gemm.pack_panels(w.to(dtype).float(), dtype), gemm, 2)
    return out


def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_table(cold_bytes: int, rows_list: list[int]) -> None:
    layer_bytes = sum(4 * i * o for i, o in LAYER)
    copies = math.ceil(cold_bytes / layer_bytes)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(copies) for i, o in LAYER]
    per_path: dict[str, list] = {}
    width: dict[str, int] = {}
    for w in weights:
        for name, (p, call, nbytes) in paths(w).items():
            per_path.setdefault(name, []).append((p, call))
            width[name] = nbytes
    del weights
    total = copies * layer_bytes
    print(f"\nDecode: {len(LAYER)} linears of one Qwen3-0.6B layer x {copies} copies ({total / 2**20:.0f} MiB), "
          f"ms per pass (median of 7), weight GB/s")
    print(f"{'rows':>5s}  " + "  ".join(f"{n:>24s}" for n in per_path))
    for rows in rows_list:
        xs = {i: torch.randn(rows, i, generator=gen) for i, _ in LAYER}
        cells = []
        for name, pairs in per_path.items():
            def one_pass(pairs=pairs):
                for p, call in pairs:
                    k = p.shape[1]
                    call(xs[k], p)
            s = median_seconds(one_pass, 7)
            cells.append(f"{s * 1e3:9.2f} ms {total * width[name] / 4 / s / 1e9:5.1f} GB/s")
        print(f"{rows:5d}  " + "  ".join(f"{c:>24s}" for c in cells))


def prefill_table(rows_list: list[int]) -> None:
    print("\nPrefill (cache-resident), GFLOP/s (median of 5)")
    gen = torch.Generator().manual_seed(1)
    for i, o in (LAYER[0], LAYER[3]):
        w = torch.randn(o, i, generator=gen) * 0.02
        for rows in rows_list:
            x = torch.randn(rows, i, generator=gen)
            cells = []
            for name, (p, call, _) in paths(w).items():
                s = median_seconds(lambda: call(x, p), 5)
                cells.append(f"{name} {2 * rows * i * o / s / 1e9:5.1f}")
            print(f"  {i}->{o} x {rows:3d} rows: " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--cold-mib", type=int, default=176, help="weight bytes cycled in the decode table (MiB)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gemm = "loaded" if cpu_gemm.load() is not None else f"unavailable: {cpu_gemm.unavailable_reason()}"
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} thread(s), load average {' / '.join(f'{v:.1f}' for v in os.getloadavg())}, "
          f"panel GEMM {gemm}")
    with torch.inference_mode():
        decode_table(args.cold_mib << 20, [1, 2, 4, 8, 16])
        prefill_table([64, 256, 512])
    print(f"load average at the end {' / '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
