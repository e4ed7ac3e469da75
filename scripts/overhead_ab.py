#!/usr/bin/env python
"""Engine overhead of two source trees in ONE process, steps interleaved (model stubbed, as
``bench --overhead``): on a shared machine, runs in separate processes differed by up to 2x
from run to run, while interleaved steps see the same conditions.

    mkdir -p /tmp/base && git archive <rev> minivllm | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python scripts/overhead_ab.py /tmp/base . --batch-sizes 1 16 64 256

Prints, per batch size, microseconds per sequence per decode step (min, p10, median) of each
tree and the ratio of the medians (second / first).
"""
from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time
from pathlib import Path


def load_tree(path: str):
    """Import ``minivllm`` from ``path`` (dropping any copy imported before); returns the
    package, its overhead module and SamplingParams. Objects built from a tree keep using
    that tree's modules after the next tree is loaded."""
    path = str(Path(path).resolve())
    for name in [k for k in sys.modules if k == "minivllm" or k.startswith("minivllm.")]:
        del sys.modules[name]
    sys.path.insert(0, path)
    try:
        pkg = importlib.import_module("minivllm")
        overhead = importlib.import_module("minivllm.bench.overhead")
        params = importlib.import_module("minivllm.sampling_params").SamplingParams
    finally:
        sys.path.remove(path)
    if not pkg.__file__.startswith(path):
        raise SystemExit(f"minivllm came from {pkg.__file__}, not {path}")
    return pkg, overhead, params


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    bmax = max(args.batch_sizes)
    blocks_per_seq = (args.prompt_len + args.steps + 80) // 16 + 2
    engines = []
    for tree in (args.first, args.second):
        pkg, overhead, params = load_tree(tree)
        llm = pkg.LLM(None, num_kvcache_blocks=bmax * blocks_per_seq + 8, max_num_seqs=max(256, bmax),
                      enable_prefix_caching=True)
        llm.llm_engine.runner.run = overhead.stub_run(llm.llm_engine.runner, 100)
        engines.append((llm, params))
    for b in args.batch_sizes:
        times = [[], []]
        for llm, params in engines:
            engine, rng = llm.llm_engine, random.Random(b)
            for i in range(b):
                engine.add_request(f"{b}-{i}", [rng.randint(0, 4000) for _ in range(args.prompt_len)],
                                   params(temperature=0, max_tokens=args.steps + 60, ignore_eos=True),
                                   output_kind="final_only")
            while not (engine.step_with_record().record.phase == "decode" and engine.last_step_record.num_seqs == b):
                pass
            for _ in range(8):
                engine.step()
        for _ in range(args.steps):
            for k, (llm, _) in enumerate(engines):
                t0 = time.perf_counter()
                record = llm.llm_engine.step_with_record().record
                times[k].append(time.perf_counter() - t0)
                if record.phase != "decode" or record.num_seqs != b:
                    raise SystemExit(f"expected a decode step of {b} sequences, got {record.phase}/{record.num_seqs}")
        for llm, _ in engines:
            llm.llm_engine.abort_request([f"{b}-{i}" for i in range(b)])
            llm.llm_engine.reset_prefix_cache()
        cols = []
        for tree, t in zip((args.first, args.second), times):
            s = sorted(t)
            cols.append(f"{tree}: min {s[0] / b * 1e6:.2f} p10 {s[len(s) // 10] / b * 1e6:.2f} "
                        f"median {statistics.median(s) / b * 1e6:.2f}")
        ratio = statistics.median(times[1]) / statistics.median(times[0])
        print(f"batch {b:4d} us/seq/step | " + " | ".join(cols) + f" | median ratio {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
