"""How fast one CPU core can read a decode step's KV cache, against what the decode attention
kernel takes for it: the ceiling under the embedded model's batch-32 target (design brief: a
batch-32 decode step <= 1.4x its matmuls alone).

    python scripts/probe_kv_read.py [--seqs 32] [--context 168] [--threads 1] [--kv-cache-dtype bfloat16]

A decode step's KV, laid out as the engine lays it out (the embedded model's 4 layers, 2 KV heads
of 64, 16-token blocks; each sequence's prompt blocks allocated together, the blocks it grows into
while decoding interleaved with the other sequences'; on 2 MiB pages where the system grants them, as the
engine's pool: before 2026-12-07 23:35 UTC on 4 KiB pages, where this probe read the same KV slower than the
engine does), timed four ways per step, with 16 MiB of
other data read between steps (an engine step streams its weights between the layers' attention):

- the decode attention kernel (``minivllm/layers/attention/csrc/paged_decode_f32.c``) on every layer;
- a bare read of the same blocks through the same block table, with the kernel's software
  prefetch of the next sequence's blocks, and without it (a loop of vector adds, no attention);
- ``torch.sum`` over as many contiguous bytes (the read bandwidth ``get_peaks`` measures);
- the kernel one layer at a time, 2 MiB of other data (a layer's weights) read before each, its
  time alone summed over the layers: as the step runs it ("cold"), and with the layer's blocks read
  just before the call ("KV in cache"): what software prefetch of a layer's KV during the layer
  before it could save at best.

Milliseconds per step (median of --steps) and the KV bytes read per second.
"""
from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minivllm.layers.attention import cpu_decode
from minivllm.layers.native_build import build_and_load
from minivllm.utils.hugepages import zeroed_cpu_tensor

LAYERS, KV_HEADS, HEAD_DIM, HEADS, BLOCK = 4, 2, 64, 4, 16  # the embedded model's attention

# A bare read through a block table: every byte of every block of every row's K then V, summed as
# unsigned 32-bit integers (whatever the cache's element type), optionally prefetching the next row's blocks the
# way the kernel's cursor does (a line a hint).
BARE_READ_C = r"""
#include <stdint.h>
typedef uint32_t veci __attribute__((vector_size(64), aligned(4), may_alias));
uint32_t paged_read_sum(const uint32_t *k_cache, const uint32_t *v_cache, const int32_t *table, int64_t stride,
                       int64_t rows, int64_t blocks, int64_t block_words, int prefetch) {
    veci a = {0}, b = {0};
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *t = table + r * stride, *next = r + 1 < rows ? t + stride : 0;
        for (int pass = 0; pass < 2; pass++) {
            const uint32_t *cache = pass ? v_cache : k_cache;
            for (int64_t i = 0; i < blocks; i++) {
                const uint32_t *p = cache + (int64_t)t[i] * block_words;
                if (prefetch && next)
                    for (int64_t j = 0; j < block_words; j += 16)
                        __builtin_prefetch(cache + (int64_t)next[i] * block_words + j, 0, 2);
                for (int64_t j = 0; j < block_words; j += 32) {
                    a += *(const veci *)(p + j);
                    b += *(const veci *)(p + j + 16);
                }
            }
        }
    }
    uint32_t s = 0;
    for (int i = 0; i < 16; i++) s += a[i] + b[i];
    return s;
}
"""


def block_table(seqs: int, context: int, prompt: int) -> torch.Tensor:
    """Block ids as the engine hands them out: each prompt's blocks together, then one block per
    sequence in turn as the sequences grow past each block boundary. A context shorter than the
    prompt is all prompt (its blocks together)."""
    if seqs < 1 or context < 1:
        raise ValueError(f"block_table: seqs and context must be >= 1, got seqs={seqs}, context={context}")
    per_seq = -(-context // BLOCK)
    first = -(-min(prompt, context) // BLOCK)
    table = torch.empty(seqs, per_seq, dtype=torch.int32)
    nxt = 0
    for s in range(seqs):
        table[s, :first] = torch.arange(nxt, nxt + first)
        nxt += first
    for i in range(first, per_seq):
        table[:, i] = torch.arange(nxt, nxt + seqs)
        nxt += seqs
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=168, help="keys per sequence (default: 128-token prompts + 40)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=101)
    ap.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the caches' element type (the engine's kv_cache_dtype)")
    args = ap.parse_args(argv)
    for name in ("seqs", "context", "threads", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    dtype = getattr(torch, args.kv_cache_dtype)
    torch.set_num_threads(args.threads)
    kernel = cpu_decode.load()
    if kernel is None:
        raise SystemExit(f"the decode kernel is unavailable: {cpu_decode.unavailable_reason()}")
    src = Path(tempfile.mkdtemp()) / "paged_read_sum.c"
    src.write_text(BARE_READ_C)
    lib, _ = build_and_load(src)
    bare = lib.paged_read_sum
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    bare.argtypes, bare.restype = [p, p, p, i64, i64, i64, i64, ctypes.c_int], ctypes.c_uint32

    table = block_table(args.seqs, args.context, 128)
    blocks = table.shape[1]
    num_blocks = int(table.max()) + 1
    gen = torch.Generator().manual_seed(0)
    def on_huge_pages(values: torch.Tensor) -> torch.Tensor:
        """``values`` in memory laid out as the engine's (its KV pool and weights sit on 2 MiB pages where
        the system grants them: the hardware prefetcher then runs on past 4 KiB boundaries)."""
        out, _ = zeroed_cpu_tensor(tuple(values.shape), values.dtype)
        return out.copy_(values)

    caches = [tuple(on_huge_pages(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
                    for _ in range(2)) for _ in range(LAYERS)]
    q = torch.randn(args.seqs, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    row_seq = torch.arange(args.seqs, dtype=torch.int32)
    scratch = torch.empty(HEADS * args.context + 64)
    other = torch.randn(4 << 20)  # 16 MiB read between steps
    kv_bytes = LAYERS * 2 * args.seqs * args.context * KV_HEADS * HEAD_DIM * dtype.itemsize
    block_words = BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize // 4
    flat = on_huge_pages(torch.randn(kv_bytes // 4, generator=gen))
    fn = kernel.c_function(dtype)

    def attention():
        for k, v in caches:
            fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), table.stride(0), row_seq.data_ptr(),
               lens.data_ptr(), out.data_ptr(), args.seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5,
               scratch.data_ptr())

    def read(prefetch: int):
        def run():
            for k, v in caches:
                bare(k.data_ptr(), v.data_ptr(), table.data_ptr(), table.stride(0), args.seqs, blocks,
                     block_words, prefetch)
        return run

    layer_weights = on_huge_pages(torch.randn(512 << 10))  # 2 MiB: about a layer's weights

    def per_layer(warm: bool):
        def run() -> float:
            total = 0.0
            for k, v in caches:
                layer_weights.sum()
                if warm:
                    bare(k.data_ptr(), v.data_ptr(), table.data_ptr(), table.stride(0), args.seqs, blocks,
                         block_words, 0)
                t0 = time.perf_counter()
                fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), table.stride(0), row_seq.data_ptr(),
                   lens.data_ptr(), out.data_ptr(), args.seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5,
                   scratch.data_ptr())
                total += time.perf_counter() - t0
            return total
        return run

    ways = {"decode attention kernel": attention, "bare read, the kernel's prefetch": read(1),
            "bare read, no software prefetch": read(0), "torch.sum, the same bytes contiguous": flat.sum,
            "kernel by layer, cold (summed)": per_layer(False),
            "kernel by layer, KV in cache (summed)": per_layer(True)}
    times = {name: [] for name in ways}
    for _ in range(args.steps):  # the ways alternate step by step, so a slow moment hits them all
        for name, way in ways.items():
            other.sum()
            t0 = time.perf_counter()
            alone = way()  # the per-layer ways return their own sum of the kernel's calls
            times[name].append(alone if isinstance(alone, float) else time.perf_counter() - t0)
    print(f"{args.seqs} sequences x {args.context} keys, {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}, "
          f"{BLOCK}-token blocks: {kv_bytes / 1e6:.1f} MB of {args.kv_cache_dtype} K and V a step; "
          f"{platform.processor() or platform.machine()}, {args.threads} thread(s), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"  {name:40s} {ms:7.3f} ms  {kv_bytes / ms / 1e6:6.1f} GB/s")


if __name__ == "__main__":
    main()
