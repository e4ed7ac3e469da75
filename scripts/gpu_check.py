#!/usr/bin/env python3
"""One-command check of minivllm's GPU path, within 8 minutes on one H200.

    python3 scripts/gpu_check.py [--scale 1.0] [--out gpu_check.json] [--budget-s 480]

Needs only torch (CUDA), triton, transformers, numpy and this repository (no plotly, no
flash-attn; nvidia-ml-py is used when present). Sections, in order of importance:

1. kernels       our Triton kernels vs the naive fp32 reference and the torch backend, run
                 under ``CUDA_LAUNCH_BLOCKING=1`` so a fault is reported at the launch of the
                 kernel that caused it: max abs error per kernel (fp32; bf16 within 2e-2).
2. cuda_graphs   decode through ``CudaGraphDecodeRunner`` vs eager on ``random:qwen3-0.6b``
                 in bf16 with equal KV split counts (logits within bf16 tolerance, argmax up
                 to near-ties; padded buckets; a decode at the full ``max_model_len``), memory
                 after capture, and the model step time eager vs graph at batch 1/16/64.
3. engine_graphs engine-level bf16 greedy tokens, ``enforce_eager=True`` vs CUDA graphs, at
                 batch 1, 3, 13, 201 (padded into bucket 208) and 300 (above the largest bucket,
                 256: eager fallback), with graph replays, eager decode steps and Dynamo
                 graph compilations counted.
4. pool_edges    on the real ``gpu_memory_utilization=0.9`` pool: store and decode into the
                 highest block ids (triton vs torch backend); after padded graph replays,
                 block 0 and unused blocks unchanged.
5. tpot          engine decode TPOT at batch 1/16/64 with and without CUDA graphs (bf16), and
                 memory after the benchmark.
6. embedded      triton vs torch backend on the embedded model in fp32: greedy tokens agree.
7. prefill       engine prefill throughput (prompt tokens/s).
8. offline       nano-vllm's benchmark workload (256 requests x ``--scale``, input and output
                 lengths uniform in 100..1024, random token ids, ignore_eos): output tokens/s,
                 the same requests through transformers ``generate`` for a ratio, and NVML
                 utilisation samples taken during our run (when nvidia-ml-py is present).
9. int8          weight-only int8 (``minivllm/quantization/gpu_check_int8.py``): the Triton
                 kernel's error (pass under 2% of the largest output) and time against bf16
                 cuBLAS on Qwen3-0.6B's linear shapes at 1/8/64/512 rows, its tile sweep, then
                 batch-1 decode of the int8 engine against the bf16 one (ratio, greedy agreement).

Each section runs in its own ``python3`` subprocess, so a CUDA fault (which poisons the
process's context) ends only that section and is named in its row; the JSON file is
rewritten after every section (and each section's rows as it makes them), so whatever was
measured comes back. ``--out`` defaults to ``$OUT/gpu_check.json`` when ``$OUT`` is set;
the sections' output goes next to it, into one log (``gpu_check.log``, a header line per
section: a device run returns at most 8 files from ``$OUT``). Sections that would start past
``--budget-s`` are skipped, and one the budget's end cuts short is listed as cut (status
"skipped", its rows kept), not as an error. Exit status 1 if any check failed or a section
errored.

JSON (``--out``)::

    {"schema": 2,
     "environment": {"python", "torch", "triton", "transformers", "gpu", "gpu_memory_gib", "sms"},
     "args": {...},                       # the command line, as strings
     "budget_s": 480.0, "total_seconds": float, "complete": bool,   # false while running
     "sections": {NAME: {"status": "ok" | "error" | "skipped" | "pending",
                         "returncode": int | null,   # negative: killed by that signal
                         "seconds": float, "log": "gpu_check.log", "error": str | null}},
     "rows": [{"section", "check", "value", "target",
               "status": "pass" | "fail" | "info" | "skip" | "error", "data": {...}}]}
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("kernels", "cuda_graphs", "engine_graphs", "pool_edges", "tpot", "embedded", "prefill", "offline",
            "int8")
#: extra environment per section subprocess
SECTION_ENV = {"kernels": {"CUDA_LAUNCH_BLOCKING": "1"}}
BF16_TOL = 2e-2
SCHEMA = 2
DEFAULT_BUDGET_S = 480.0  # the whole run must fit 8 minutes of a 10-minute device lease
#: a section is not started with less than this left (process start + imports + CUDA init)
MIN_SECTION_S = 20.0
#: a section that hangs (e.g. after a CUDA fault) must not eat the rest of the budget
DEFAULT_SECTION_TIMEOUT_S = 240.0
SMOKE_MODEL = "minivllm-tiny"
FAULT_KINDS = ("raise", "abort", "hang")


# ------------------------------------------------------------------------------ pure helpers
@dataclass
class Row:
    """One line of the summary: ``status`` is pass / fail / info / skip / error."""

    section: str
    check: str
    value: str
    target: str = ""
    status: str = "info"
    data: dict = field(default_factory=dict)


def default_out() -> Path:
    """``$OUT/gpu_check.json`` when ``$OUT`` is set (what comes back from a device run), else
    ``gpu_check.json`` in the working directory."""
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else Path("gpu_check.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 scripts/gpu_check.py",
                                description="One-command check of minivllm's GPU path (kernels, CUDA graphs, "
                                            "KV pool, TPOT, throughput against transformers), within the "
                                            "--budget-s budget; results go to a JSON file.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0,
                   help="fraction of nano-vllm's 256-request workload to run (default 1.0)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results file (default: $OUT/gpu_check.json when $OUT is set, else ./gpu_check.json)")
    p.add_argument("--model", default=None,
                   help=f"model for the speed sections (default random:qwen3-0.6b; {SMOKE_MODEL} with --smoke)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of the sections: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile of the small fused ops (the engine argument compile; "
                        "auto: the engine's default)")
    p.add_argument("--hf-budget-s", type=float, default=45.0,
                   help="seconds of transformers generate for the offline ratio (whole batches)")
    p.add_argument("--hf-batch", type=int, default=64, help="transformers generate batch size")
    p.add_argument("--tpot-tokens", type=int, default=128, help="output tokens per TPOT request")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="wall-clock budget of the whole run; sections past it are skipped (default 480)")
    p.add_argument("--section-timeout-s", type=float, default=DEFAULT_SECTION_TIMEOUT_S,
                   help="a section still running after this many seconds is killed (default 240)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and weights (default 0)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (CUDA graphs emulated): checks "
                        "this script's plumbing on a machine without a GPU; its numbers mean nothing")
    p.add_argument("--inject-fault", action="append", default=[], metavar="SECTION=KIND",
                   help=f"test the fault isolation: make SECTION fail ({'/'.join(FAULT_KINDS)}: a Python "
                        "error, the process killed by SIGABRT like a CUDA fault, or a hang) after its first row")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)       # run one section in-process
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    if args.model is None:
        args.model = SMOKE_MODEL if args.smoke else "random:qwen3-0.6b"
    if args.out is None:
        args.out = default_out()
    # absolute: the sections run with the repository as their directory and write beside it
    args.out = Path(args.out).expanduser().resolve()
    if not 0 < args.scale <= 4:
        p.error(f"--scale must be in (0, 4], got {args.scale}")
    unknown = [s for s in args.sections.split(",") if s and s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    args.sections = [s for s in SECTIONS if s in args.sections.split(",")]
    if args.hf_batch < 1:
        p.error(f"--hf-batch must be >= 1, got {args.hf_batch}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.section_timeout_s <= 0:
        p.error(f"--section-timeout-s must be > 0, got {args.section_timeout_s}")
    faults = {}
    for spec in args.inject_fault:
        name, _, kind = spec.partition("=")
        if name not in SECTIONS or kind not in FAULT_KINDS:
            p.error(f"--inject-fault {spec!r}: expected SECTION=KIND with SECTION in {SECTIONS} "
                    f"and KIND in {FAULT_KINDS}")
        faults[name] = kind
    args.faults = faults
    if args.worker is not None and (args.worker not in SECTIONS or args.worker_out is None):
        p.error(f"--worker {args.worker!r} needs a section name and --worker-out")
    return args


def format_table(rows: list[Row]) -> str:
    """Fixed-width text table: section | check | value | target | status."""
    head = ("section", "check", "value", "target", "status")
    cells = [head] + [(r.section, r.check, r.value, r.target, r.status.upper()) for r in rows]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(head))]
    line = "+".join("-" * (w + 2) for w in widths)
    out = [line]
    for i, c in enumerate(cells):
        out.append("|".join(f" {str(v):<{w}} " for v, w in zip(c, widths)))
        if i == 0:
            out.append(line)
    out.append(line)
    return "\n".join(out)


def nanovllm_workload(num_requests: int, seed: int = 0, min_len: int = 100, max_len: int = 1024,
                      vocab: int = 10001) -> list[tuple[list[int], int]]:
    """nano-vllm's bench.py requests: ``(prompt token ids, output length)`` per request, drawn as it
    draws them (``minivllm.bench.workload``'s ``nano`` preset: lengths uniform in ``min_len..max_len``,
    ids uniform in ``0..vocab-1``; 256 requests of seed 0 are its very benchmark)."""
    from minivllm.bench.workload import make_workload

    w = make_workload("nano", vocab_size=vocab, num_requests=num_requests, input_len=(min_len, max_len),
                      output_len=(min_len, max_len), seed=seed)
    return list(zip(w.prompts, w.output_lens))


def fmt_ms(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f} ms"


def status_of(ok: bool) -> str:
    return "pass" if ok else "fail"


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


class RowLog(list):
    """The rows of one section; every append rewrites ``path`` so that the rows made before a
    crash survive it."""

    def __init__(self, path: Path | None, env: dict | None = None):
        super().__init__()
        self.path, self.env = path, env or {}

    def _flush(self) -> None:
        if self.path is not None:
            write_json(self.path, {"environment": self.env, "rows": [asdict(r) for r in self]})

    def append(self, row: Row) -> None:  # noqa: D102
        super().append(row)
        self._flush()

    def extend(self, rows) -> None:  # noqa: D102
        super().extend(rows)
        self._flush()


def near_tie_agreement(a_logits, b_logits, tol: float) -> tuple[int, int]:
    """Rows whose argmax agrees, counting a disagreement as agreement when each side's pick
    is within ``tol`` (relative to the row's largest logit magnitude, at least 1) of the
    other side's top logit: bf16 rounding can swap near-tied tokens.

    Args:
        a_logits, b_logits: ``[n, vocab]`` float tensors.

    Returns:
        ``(agreeing rows, n)``.
    """
    a, b = a_logits.float(), b_logits.float()
    ia, ib = a.argmax(-1), b.argmax(-1)
    scale = a.abs().amax(-1).clamp(min=1.0)
    ra = a.gather(-1, ia[:, None])[:, 0] - a.gather(-1, ib[:, None])[:, 0]
    rb = b.gather(-1, ib[:, None])[:, 0] - b.gather(-1, ia[:, None])[:, 0]
    ok = (ia == ib) | ((ra <= tol * scale) & (rb <= tol * scale))
    return int(ok.sum()), int(ok.numel())


# ------------------------------------------------------------------------------ GPU helpers
def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_gpu():
    """Release cached blocks between parts of one section (never called after an error:
    after a sticky CUDA fault every CUDA call raises again)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _memory_row(section: str, label: str) -> Row:
    """Device memory now: ``torch.cuda.mem_get_info`` (all processes and allocators) and
    this process's ``max_memory_reserved`` (the caching allocator's high-water mark)."""
    import torch

    if not torch.cuda.is_available():
        return Row(section, f"memory {label}", "n/a (no CUDA)", "", "skip")
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.max_memory_reserved()
    allocated = torch.cuda.max_memory_allocated()
    return Row(section, f"memory {label}",
               f"free {free / 2**30:.1f} of {total / 2**30:.1f} GiB; max reserved {reserved / 2**30:.1f} GiB",
               "", "info", {"free_bytes": free, "total_bytes": total, "max_reserved_bytes": reserved,
                            "max_allocated_bytes": allocated})


def _meta(q_lens, ctx_lens, slots, tables, block_size, device):
    """AttentionMetadata for hand-built steps (tables: list of block-id lists)."""
    import torch

    from minivllm.layers.attention.metadata import AttentionMetadata

    width = max(len(t) for t in tables)
    tab = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, row in enumerate(tables):
        tab[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    cu_q = [0]
    cu_k = [0]
    for q, c in zip(q_lens, ctx_lens):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + c)
    dev = torch.device(device)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=tab.to(dev),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx_lens), block_size=block_size,
        is_decode_only=max(q_lens) == 1, q_lens_cpu=list(q_lens), context_lens_cpu=list(ctx_lens),
    )


# ------------------------------------------------------------------------------ 1. kernels
def check_kernels(args, rows: list[Row]) -> None:
    import torch

    from minivllm.layers.attention import triton_kernels as tk
    from minivllm.testing import make_case, naive_attention
    from minivllm.layers.attention.torch_backend import TorchAttentionBackend
    from minivllm.layers.attention.triton_backend import TritonAttentionBackend

    dev = args.device
    tri, ref_backend = TritonAttentionBackend(), TorchAttentionBackend()
    # (name, seqs (context_len, q_len), H, Hk, D, block_size)
    cases = [
        ("decode 16:8 d128 bs16", [(1, 1), (100, 1), (3000, 1), (4096, 1)], 16, 8, 128, 16),
        ("decode batch1 8k ctx", [(8000, 1)], 16, 8, 128, 16),
        ("decode 8:1 d64 bs256", [(257, 1), (40, 1), (1500, 1)], 8, 1, 64, 256),
        ("prefill+prefix+chunk 16:8 d128 bs16", [(1000, 1000), (700, 200), (300, 1), (2000, 64)], 16, 8, 128, 16),
        ("prefill 8:1 d64 bs256", [(600, 600), (900, 37), (513, 1)], 8, 1, 64, 256),
        ("prefill 4:2 d128 bs256", [(260, 6), (1024, 512)], 4, 2, 128, 256),
    ]
    if args.smoke:
        cases = [("decode smoke", [(1, 1), (40, 1)], 4, 2, 64, 16),
                 ("prefill smoke", [(20, 20), (40, 5), (9, 1)], 8, 1, 128, 256)]
    worst = {"store": 0.0, "decode": 0.0, "prefill": 0.0}
    worst_bf16 = {"decode": 0.0, "prefill": 0.0}
    worst_vs_torch = 0.0
    for name, seqs, H, Hk, D, bs in cases:
        kind = "decode" if all(q == 1 for _, q in seqs) else "prefill"
        for dtype in (torch.float32, torch.bfloat16):
            case = make_case(seqs, H, Hk, D, bs, dtype, device=dev, seed=7, fill=0.0)
            tk.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
            flat = case.k_cache.view(-1, Hk, D)
            store_ok = torch.equal(flat[case.meta.slot_mapping], case.k)
            worst["store"] = max(worst["store"], 0.0 if store_ok else float("inf"))
            out = tri.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
            expected = naive_attention(case)
            errs = [(out.float() - expected).abs().max().item()]
            if kind == "decode":  # forced split counts as well (the automatic one is above)
                for splits in ((1,) if args.smoke else (1, 3, tk.MAX_SPLITS)):
                    one = tk.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                                    case.meta.context_lens, case.scale, num_splits=splits)
                    errs.append((one.float() - expected).abs().max().item())
            target = worst if dtype == torch.float32 else worst_bf16
            target[kind] = max(target[kind], *errs)
            if dtype == torch.float32:
                case2 = make_case(seqs, H, Hk, D, bs, dtype, device=dev, seed=7, fill=0.0)
                ref_backend.prepare(case2.meta)
                ref = ref_backend.forward(case2.q, case2.k, case2.v, case2.k_cache, case2.v_cache, case2.meta,
                                          case2.scale)
                worst_vs_torch = max(worst_vs_torch, (out.float() - ref.float()).abs().max().item())
        _sync()
        rows.append(Row("kernels", f"case ran: {name}", "ok", "", "info"))
    rows.append(Row("kernels", "KV store (exact)", "exact" if worst["store"] == 0 else "MISMATCH",
                    "bit-exact", status_of(worst["store"] == 0)))
    for kind in ("decode", "prefill"):
        rows.append(Row("kernels", f"{kind} fp32 max abs err", f"{worst[kind]:.2e}", "<= 1e-4",
                        status_of(worst[kind] <= 1e-4), {"max_abs_err": worst[kind]}))
        rows.append(Row("kernels", f"{kind} bf16 vs fp32 max abs err", f"{worst_bf16[kind]:.2e}",
                        f"<= {BF16_TOL:g}", status_of(worst_bf16[kind] <= BF16_TOL),
                        {"max_abs_err": worst_bf16[kind]}))
    rows.append(Row("kernels", "triton vs torch backend fp32", f"{worst_vs_torch:.2e}", "<= 1e-4",
                    status_of(worst_vs_torch <= 1e-4), {"max_abs_err": worst_vs_torch}))


# ------------------------------------------------------------------------------ 2. CUDA graphs
def _build_model(model_name, dtype, device, seed=0):
    from minivllm.engine.model_runner import build_model
    from minivllm.utils.model_source import resolve_model

    src = resolve_model(model_name)
    return build_model(src, device, dtype, seed), src.hf_config


def check_cuda_graphs(args, rows: list[Row]) -> None:
    import torch

    from minivllm.engine.cuda_graph import CudaGraphDecodeRunner
    from minivllm.engine.kv_cache import allocate_kv_cache
    from minivllm.layers.attention import get_attention_backend
    from minivllm.layers.attention.context import ForwardContext
    from minivllm.utils import cdiv

    dev, dtype, bs = torch.device(args.device), torch.bfloat16, 16
    max_model_len, max_num_seqs, lo, hi = 4096, 64, 50, 600
    if args.smoke:
        dtype, max_model_len, max_num_seqs, lo, hi = torch.float32, 32, 4, 3, 12
    max_blocks = max_model_len // bs
    model, cfg = _build_model(args.model, dtype, dev, args.seed)
    backend = get_attention_backend("triton", dev, bs)
    rng = random.Random(args.seed)
    # sequence 0 fills max_model_len - 1 tokens; the others lo..hi tokens; block 0 unused
    lens = [max_model_len - 1] + [rng.randint(lo, hi) for _ in range(max_num_seqs - 1)]
    tables, nxt = [], 1
    for n in lens:
        nb = cdiv(n + 1, bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    _, kv = allocate_kv_cache(cfg, nxt, bs, dtype, dev)
    vocab = cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]

    def slots_for(table, positions):
        return [table[p // bs] * bs + p % bs for p in positions]

    with torch.inference_mode():
        group = 8
        for g0 in range(0, len(lens), group):  # eager prefill, a few sequences per step
            idx = list(range(g0, min(len(lens), g0 + group)))
            ids = sum((prompts[i] for i in idx), [])
            pos = sum((list(range(lens[i])) for i in idx), [])
            slots = sum((slots_for(tables[i], range(lens[i])) for i in idx), [])
            meta = _meta([lens[i] for i in idx], [lens[i] for i in idx], slots, [tables[i] for i in idx], bs, dev)
            backend.prepare(meta)
            model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), ForwardContext(meta, backend, kv))
        _sync()

        t0 = time.perf_counter()
        runner = CudaGraphDecodeRunner(model, kv, backend, max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks,
                                       hidden_size=cfg.hidden_size, device=dev, dtype=dtype,
                                       emulate=dev.type != "cuda")
        runner.capture()
        _sync()
        capture_s = time.perf_counter() - t0
        rows.append(Row("cuda_graphs", "capture", f"{len(runner.graph_keys)} graphs in {capture_s:.1f} s",
                        "", "info", {"buckets": runner.buckets, "graphs": [list(k) for k in runner.graph_keys],
                                     "capture_s": capture_s}))
        rows.append(_memory_row("cuda_graphs", "after capture"))

        def decode_inputs(n):
            ids = torch.tensor([prompts[i][-1] for i in range(n)], device=dev)
            pos = torch.tensor([lens[i] for i in range(n)], device=dev)
            slots = [slots_for(tables[i], [lens[i]])[0] for i in range(n)]
            meta = _meta([1] * n, [lens[i] + 1 for i in range(n)], slots, [tables[i] for i in range(n)], bs, dev)
            return ids, pos, meta

        worst, agree, total = 0.0, 0, 0
        # exact buckets and padded ones; sequence 0 decodes at max_model_len
        for n in ((1, 3, 13, 64) if not args.smoke else (1, 3)):
            ids, pos, meta = decode_inputs(n)
            backend.prepare(meta)
            eager = model.compute_logits(model(ids, pos, ForwardContext(meta, backend, kv))).float()
            graph = model.compute_logits(runner.run(ids, pos, meta)).float()
            scale = max(1.0, eager.abs().max().item())
            worst = max(worst, (graph - eager).abs().max().item() / scale)
            a, t = near_tie_agreement(eager, graph, BF16_TOL)
            agree += a
            total += t
        rows.append(Row("cuda_graphs", "graph vs eager logits (rel. max abs)", f"{worst:.2e}", f"<= {BF16_TOL:g}",
                        status_of(worst <= BF16_TOL), {"rel_max_abs_err": worst}))
        rows.append(Row("cuda_graphs", "graph vs eager argmax (near-ties within tol count as agreeing)",
                        f"{agree}/{total}", "all", status_of(agree == total)))
        rows.append(Row("cuda_graphs", "decode at full max_model_len in graph", f"ctx {max_model_len}", "runs",
                        "pass"))

        # pure model-step time (no scheduler, inputs already on the device), eager vs graph replay
        for n in ((1, 16, 64) if not args.smoke else (2,)):
            ids, pos, meta = decode_inputs(n)
            runner.run(ids, pos, meta)  # stages this step in the static buffers
            times = {}
            for mode in ("eager", "graph"):
                def step():
                    if mode == "eager":
                        meta.extras.clear()
                        backend.prepare(meta)
                        model(ids, pos, ForwardContext(meta, backend, kv))
                    else:
                        runner.replay(n)
                for _ in range(3 if not args.smoke else 1):
                    step()
                _sync()
                iters = 30 if not args.smoke else 1
                t0 = time.perf_counter()
                for _ in range(iters):
                    step()
                _sync()
                times[mode] = (time.perf_counter() - t0) / iters * 1e3
            rows.append(Row("cuda_graphs", f"model step batch {n} eager / graph",
                            f"{times['eager']:.3f} / {times['graph']:.3f} ms", "", "info", times))
        rows.append(_memory_row("cuda_graphs", "after step timing"))


# ------------------------------------------------------------------------------ engines
def _compile_kw(args) -> dict:
    return {} if args.compile == "auto" else {"compile": args.compile == "on"}


def _engine(args, enforce_eager, max_capture_size=None, **kw):
    """An engine on ``args.model`` (bf16 on CUDA, fp32 in smoke mode). With
    ``enforce_eager=False`` in smoke mode, decode CUDA graphs are emulated (the same static
    buffers, replayed eagerly), so the graph plumbing runs on the CPU too.
    ``max_capture_size`` re-captures the graphs with that largest bucket."""
    from minivllm import LLM

    if args.smoke:  # the CPU default backend (torch) cannot be captured; triton runs interpreted
        kw.setdefault("num_kvcache_blocks", 256)
        kw.setdefault("attention_backend", "triton")
    own_graphs = not enforce_eager and (args.smoke or max_capture_size is not None)
    # with graphs of our own the engine captures none (torch.compile is set up either way)
    llm = LLM(args.model, device=args.device, dtype="bfloat16" if not args.smoke else "float32",
              enforce_eager=enforce_eager or own_graphs, seed=args.seed, **_compile_kw(args), **kw)
    eng = llm.llm_engine
    if own_graphs:
        from minivllm.engine.cuda_graph import CudaGraphDecodeRunner
        from minivllm.utils import cdiv

        runner = eng.runner
        runner.graph_runner = CudaGraphDecodeRunner(
            runner.model, runner.kv_caches, runner.backend, eng.args.max_num_seqs,
            cdiv(eng.config.max_model_len, runner.block_size), runner.hf_config.hidden_size, runner.device,
            runner.dtype, emulate=args.smoke,
            **({} if max_capture_size is None else {"max_capture_size": max_capture_size}))
        runner.graph_runner.capture()
    return llm


def _engine_uses_graphs(llm) -> bool:
    g = getattr(llm.llm_engine.runner, "graph_runner", None)
    return g is not None and g.captured


class StepCounter:
    """Counts an engine's decode steps, graph replays (per bucket) and Dynamo graph compiles."""

    def __init__(self, llm):
        self.runner = llm.llm_engine.runner
        self.decode_steps = 0
        self._orig = self.runner.forward_logits

        def counting(inp):
            if inp.meta.is_decode_only:
                self.decode_steps += 1
            return self._orig(inp)

        self.runner.forward_logits = counting

    def snapshot(self) -> dict:
        from torch._dynamo.utils import counters

        g = self.runner.graph_runner
        return {"decode_steps": self.decode_steps, "graph_replays": g.num_replays if g is not None else 0,
                "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"])}

    @staticmethod
    def delta(after: dict, before: dict) -> dict:
        d = {k: after[k] - before[k] for k in after}
        d["eager_decode_steps"] = d["decode_steps"] - d["graph_replays"]
        return d


def graphs_as_expected(counts: dict, want_graphs: bool) -> bool:
    """A batch within the captured buckets decodes by graph replays only; one above the top bucket
    has eager decode steps, and replays too once requests finish and the rest fit a bucket (batch 300
    of 32-token prompts: 256 prefilled in the first step, 44 in the second, finishing a step later)."""
    if want_graphs:
        return counts["graph_replays"] > 0 and counts["eager_decode_steps"] == 0
    return counts["eager_decode_steps"] > 0


def check_engine_graphs(args, rows: list[Row]) -> None:
    from minivllm import SamplingParams

    # smoke: bucket 1 and an eager fallback (padded buckets are covered by cuda_graphs)
    batches = (1, 3, 13, 201, 300) if not args.smoke else (1, 5)
    top = 256 if not args.smoke else 4  # largest captured bucket: the last batch runs eagerly
    n_out = 16 if not args.smoke else 2
    plen = 32 if not args.smoke else 4
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    for mode in ("eager", "graphs"):
        llm = _engine(args, mode == "eager", max_capture_size=None if mode == "eager" else top,
                      max_num_seqs=max(batches), **({} if args.smoke else {"max_model_len": 2048}))
        if mode == "graphs":
            rows.append(Row("engine_graphs", "captured buckets",
                            f"{len(llm.llm_engine.runner.graph_runner.buckets)} up to {top}", "", "info",
                            {"buckets": llm.llm_engine.runner.graph_runner.buckets}))
            rows.append(_memory_row("engine_graphs", "after capture"))
        vocab = llm.llm_engine.runner.hf_config.vocab_size
        counter = StepCounter(llm)
        sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        if not args.smoke:
            llm.generate([[1, 2, 3]], sp, use_tqdm=False)  # warm-up (compiles)
        tokens[mode] = {}
        for b in batches:
            r = random.Random(args.seed + b)
            prompts = [[r.randrange(vocab) for _ in range(plen)] for _ in range(b)]
            before = counter.snapshot()
            res = llm.generate(prompts, sp, use_tqdm=False)
            d = StepCounter.delta(counter.snapshot(), before)
            tokens[mode][b] = [list(o.outputs[0].token_ids) for o in res]
            if mode == "graphs":
                want_graphs = b <= top
                ok = graphs_as_expected(d, want_graphs)
                rows.append(Row("engine_graphs", f"batch {b}: graph replays / eager decode steps / dynamo compiles",
                                f"{d['graph_replays']} / {d['eager_decode_steps']} / {d['dynamo_unique_graphs']}",
                                "graphs" if want_graphs else "eager fallback", status_of(ok), d))
        llm.shutdown()
        del llm, counter
        _free_gpu()
    for b in batches:
        e, g = tokens["eager"][b], tokens["graphs"][b]
        same = sum(x == y for x, y in zip(e, g))
        first_diff = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(e, g)]
        diverged = [i for i in first_diff if i is not None]
        # bf16 with different KV split counts (eager vs graph) may swap near-tied tokens of a
        # random model; a divergence at the first token of most requests would be a bug
        rows.append(Row("engine_graphs", f"batch {b}: greedy tokens eager == graphs", f"{same}/{len(e)} requests",
                        "most requests", status_of(same >= len(e) / 2),
                        {"identical": same, "requests": len(e), "first_divergence": diverged[:32]}))


def check_pool_edges(args, rows: list[Row]) -> None:
    import torch

    from minivllm.layers.attention.torch_backend import TorchAttentionBackend
    from minivllm.layers.attention.triton_backend import TritonAttentionBackend

    llm = _engine(args, False)
    runner = llm.llm_engine.runner
    nb, bs, dev = runner.num_kv_blocks, runner.block_size, runner.device
    k_cache, v_cache = runner.kv_caches[0]
    rows.append(Row("pool_edges", "KV pool", f"{nb} blocks x {bs} tokens", "", "info",
                    {"num_blocks": nb, "block_size": bs, "k_cache_numel": k_cache.numel()}))
    _, _, hk, d = k_cache.shape
    h = runner.hf_config.num_attention_heads
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    # two sequences whose blocks are the pool's last ones (highest block ids, largest offsets)
    ctx = [3 * bs - 1, bs + 5]
    top_blocks = [[nb - 3, nb - 2, nb - 1], [nb - 5, nb - 4]]
    dt = k_cache.dtype
    new_k = torch.randn(2, hk, d, generator=g).to(dev, dt)
    new_v = torch.randn(2, hk, d, generator=g).to(dev, dt)
    q = torch.randn(2, h, d, generator=g).to(dev, dt)
    # the prefix keys: fill the tops of the pool with random values first
    for blk in sum(top_blocks, []):
        k_cache[blk].copy_(torch.randn(bs, hk, d, generator=g).to(dev, dt))
        v_cache[blk].copy_(torch.randn(bs, hk, d, generator=g).to(dev, dt))
    slots = [top_blocks[i][(ctx[i] - 1) // bs] * bs + (ctx[i] - 1) % bs for i in range(2)]
    meta = _meta([1, 1], ctx, slots, top_blocks, bs, dev)
    scale = d ** -0.5
    with torch.inference_mode():
        out_tri = TritonAttentionBackend().forward(q, new_k, new_v, k_cache, v_cache, meta, scale)
        stored = k_cache.view(-1, hk, d)[torch.tensor(slots, device=dev)]
        torch_backend = TorchAttentionBackend()
        torch_backend.prepare(meta)
        out_ref = torch_backend.forward(q, new_k, new_v, k_cache, v_cache, meta, scale)
        _sync()
    err = (out_tri.float() - out_ref.float()).abs().max().item()
    rows.append(Row("pool_edges", "store into the highest slots (exact)", str(torch.equal(stored, new_k)),
                    "True", status_of(torch.equal(stored, new_k)), {"slots": slots}))
    rows.append(Row("pool_edges", "decode over the highest blocks triton vs torch", f"{err:.2e}",
                    f"<= {BF16_TOL:g}", status_of(err <= BF16_TOL), {"max_abs_err": err}))

    graphs = runner.graph_runner
    if graphs is None or not graphs.captured:
        rows.append(Row("pool_edges", "padded graph replays", "no graphs captured", "", "skip"))
    else:
        # 3 sequences in bucket 4 over blocks 1..6: block 0 is what padded rows read, the
        # blocks after 6 are unused; neither may change
        tables = [[1, 2], [3, 4], [5, 6]]
        lens = [bs + 3, 2 * bs - 1, 7]
        watch = [0] + list(range(7, min(nb, 12))) + [nb - 1]
        before = [(kc[watch].clone(), vc[watch].clone()) for kc, vc in runner.kv_caches]
        ids = torch.zeros(3, dtype=torch.int64, device=dev)
        pos = torch.tensor([n - 1 for n in lens], device=dev)
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
        m = _meta([1, 1, 1], lens, slots, tables, bs, dev)
        with torch.inference_mode():
            for _ in range(3):
                graphs.run(ids, pos, m)
            _sync()
        changed = [i for i, ((kb, vb), (kc, vc)) in enumerate(zip(before, runner.kv_caches))
                   if not (torch.equal(kb, kc[watch]) and torch.equal(vb, vc[watch]))]
        rows.append(Row("pool_edges", "block 0 and unused blocks after padded replays",
                        "unchanged" if not changed else f"changed in layers {changed[:8]}", "unchanged",
                        status_of(not changed), {"watched_blocks": watch}))
    llm.shutdown()


# ------------------------------------------------------------------------------ speed
def check_tpot(args, rows: list[Row]) -> None:
    from minivllm import SamplingParams

    rng = random.Random(args.seed + 2)
    for eager in (True, False):
        llm = _engine(args, eager, max_num_seqs=64)
        label = "eager" if eager else "cuda graphs"
        uses = _engine_uses_graphs(llm)
        backend = llm.llm_engine.config.attention_backend
        vocab = llm.llm_engine.runner.hf_config.vocab_size
        sp = SamplingParams(temperature=0.0, max_tokens=args.tpot_tokens if not args.smoke else 3,
                            ignore_eos=True)
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8 if not args.smoke else 2, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        for batch in ((1, 16, 64) if not args.smoke else (1,)):
            prompts = [[rng.randrange(vocab) for _ in range(128 if not args.smoke else 6)] for _ in range(batch)]
            res = llm.generate(prompts, sp, use_tqdm=False)
            tpots = [r.metrics.tpot_ms for r in res if r.metrics.tpot_ms is not None]
            tpot = statistics.median(tpots) if tpots else float("nan")
            target, status = "", "info"
            if batch == 1 and not eager and not args.smoke:  # smoke numbers mean nothing
                target, status = "<= 1.5 ms", status_of(tpot <= 1.5)
            rows.append(Row("tpot", f"batch {batch} {label} ({backend}, graphs used: {uses})", fmt_ms(tpot),
                            target, status, {"tpot_ms": tpot, "graphs_used": uses, "backend": backend}))
        rows.append(_memory_row("tpot", f"after the {label} benchmark"))
        llm.shutdown()
        del llm
        _free_gpu()


def check_embedded(args, rows: list[Row]) -> None:
    from minivllm import LLM, SamplingParams

    rng = random.Random(args.seed + 1)
    outs: dict[str, list[list[int]]] = {}
    prompts: list = []
    for backend in ("torch", "triton"):
        # eager, no torch.compile: this section compares attention backends, not speed
        llm = LLM(None, device=args.device, dtype="float32", attention_backend=backend, enforce_eager=True,
                  num_kvcache_blocks=2048 if not args.smoke else 64, seed=args.seed, compile=False)
        if not prompts:
            cfg = llm.llm_engine.runner.hf_config
            longest = max(8, min(300 if not args.smoke else 12, cfg.max_position_embeddings - 64))
            n_prompts = 16 if not args.smoke else 2
            prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(5, longest))]
                       for _ in range(n_prompts)]
            if not args.smoke:  # text prompts need the embedded tokenizer's vocabulary
                prompts += ["The ", "def ", "Return the ", "class "]
        sp = SamplingParams(temperature=0.0, max_tokens=48 if not args.smoke else 3, ignore_eos=True)
        res = llm.generate(prompts, sp, use_tqdm=False)
        outs[backend] = [r.outputs[0].token_ids for r in res]
        llm.shutdown()
        del llm
        _free_gpu()
    same = sum(a == b for a, b in zip(outs["torch"], outs["triton"]))
    tok_agree = sum(x == y for a, b in zip(outs["torch"], outs["triton"]) for x, y in zip(a, b))
    tok_total = sum(len(a) for a in outs["torch"])
    rows.extend([
        Row("embedded", "triton vs torch fp32: identical requests", f"{same}/{len(outs['torch'])}",
            ">= 90%", status_of(same >= 0.9 * len(outs["torch"]))),
        Row("embedded", "triton vs torch fp32: token agreement", f"{tok_agree}/{tok_total}", "", "info"),
    ])


def check_prefill(args, rows: list[Row]) -> None:
    from minivllm import SamplingParams

    rng = random.Random(args.seed + 3)
    llm = _engine(args, False)  # prefill steps never use graphs
    vocab = llm.llm_engine.runner.hf_config.vocab_size
    llm.generate([[rng.randrange(vocab) for _ in range(512 if not args.smoke else 8)]],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()
    n_prompts, plen = (32, 1024) if not args.smoke else (2, 16)
    prompts = [[rng.randrange(vocab) for _ in range(plen)] for _ in range(n_prompts)]
    _sync()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    tps = n_prompts * plen / dt
    rows.append(Row("prefill", f"prefill {n_prompts} x {plen} tokens", f"{tps:,.0f} tok/s", "", "info",
                    {"tokens_per_s": tps}))
    llm.shutdown()


def _hf_throughput(args, work) -> dict:
    """transformers generate on whole batches of the workload until the time budget is spent."""
    import torch
    from transformers import AutoModelForCausalLM

    from minivllm.utils.model_source import resolve_model

    cfg = resolve_model(args.model).hf_config
    dev = args.device
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg)
    model = model.to(torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    useful, elapsed, done = 0, 0.0, 0
    with torch.inference_mode():  # warm-up
        model.generate(torch.ones(1, 8, dtype=torch.long, device=dev), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    for b0 in range(0, len(work), args.hf_batch):
        if elapsed >= args.hf_budget_s:
            break
        batch = work[b0: b0 + args.hf_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(o for _, o in batch)
        _sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        _sync()
        elapsed += time.perf_counter() - t0
        useful += sum(o for _, o in batch)
        done += len(batch)
    return {"requests": done, "output_tokens": useful, "seconds": elapsed,
            "tokens_per_s": useful / elapsed if elapsed else float("nan")}


def check_offline(args, rows: list[Row]) -> None:
    from minivllm import SamplingParams

    if args.smoke:
        n, work = 2, nanovllm_workload(2, seed=args.seed, min_len=4, max_len=10, vocab=50)
    else:
        n = max(1, round(256 * args.scale))
        work = nanovllm_workload(n, seed=args.seed)
    llm = _engine(args, False)
    uses = _engine_uses_graphs(llm)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=8 if not args.smoke else 2), use_tqdm=False)
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for _, o in work]
    sampler = _start_sampler()
    _sync()
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    samples = _stop_sampler(sampler)
    llm.shutdown()  # transformers needs the memory the KV pool holds
    del llm
    _free_gpu()
    out_tokens = sum(len(r.outputs[0].token_ids) for r in res)
    ours = out_tokens / dt
    rows.append(Row("offline", f"minivllm {n} req (graphs used: {uses})", f"{ours:,.0f} out tok/s ({dt:.1f} s)",
                    "", "info", {"requests": n, "output_tokens": out_tokens, "seconds": dt, "tokens_per_s": ours}))
    rows.extend(nvml_rows(samples))
    if args.hf_budget_s > 0:
        hf = _hf_throughput(args, work)
        ratio = ours / hf["tokens_per_s"] if hf["tokens_per_s"] else float("nan")
        rows.append(Row("offline", f"transformers generate ({hf['requests']} req, batch {args.hf_batch})",
                        f"{hf['tokens_per_s']:,.0f} out tok/s", "", "info", hf))
        rows.append(Row("offline", "ratio minivllm / transformers", f"{ratio:.1f}x", "well ahead (> 1x)",
                        "info" if args.smoke else status_of(ratio > 1.0), {"ratio": ratio}))


# ------------------------------------------------------------------------------ NVML
# ------------------------------------------------------------------------------ int8 weights
def check_int8(args, rows: list[Row]) -> None:
    """``minivllm.quantization.gpu_check_int8``'s two parts (``check_int8`` = kernel, then
    engine), each part's rows appended as soon as it returns: the Triton int8 kernel's error
    (pass/fail) and speed against cuBLAS on Qwen3-0.6B's shapes, then batch-1 decode of the
    int8 engine against the bf16 one (info). With ``--smoke``: tiny shapes, untimed, under
    the Triton interpreter, and the engine pair on the embedded model on the CPU (plumbing)."""
    import torch

    from minivllm.quantization.gpu_check_int8 import check_engine, check_kernel

    if args.smoke:
        kernel = check_kernel("cpu", torch.float32, rows=(1, 3), shapes=((32, 48),), timed=False)
    else:
        kernel = check_kernel("cuda")
    for c in kernel["cases"]:
        speed = "" if "speedup" not in c else (f"; {c['int8_ms'] * 1e3:.1f} us vs cuBLAS {c['float_ms'] * 1e3:.1f} us "
                                               f"({c['speedup']:.2f}x)")
        rows.append(Row("int8", f"kernel {c['k']}->{c['n']} x{c['m']}", f"rel err {c['rel_error']:.1e}{speed}",
                        "rel err < 2e-2", status_of(c["ok"]), c))
    for t in kernel["tiles"]:
        best = min(t["ms"], key=t["ms"].get)
        rows.append(Row("int8", f"tiles {t['k']}->{t['n']} x1", f"default {t['default']}; best {best} "
                        f"{t['ms'][best] * 1e3:.1f} us", "", "info", t))
    if args.smoke:
        eng = check_engine(model=SMOKE_MODEL, decode_tokens=3, rounds=1, device="cpu", num_kvcache_blocks=64)
    else:
        eng = check_engine(model=args.model, device="cuda")
    rows.append(Row("int8", f"engine batch-1 decode int8 vs {eng['dtype']} ({eng['model']})",
                    f"{eng['speedup']:.2f}x", "", "info",
                    {k: eng[k] for k in ("speedup", "base", "quant", "agreement", "device", "model", "kernel")}))
    _free_gpu()


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _start_sampler():
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py)

        from minivllm.telemetry.utilisation import UtilisationSampler

        return UtilisationSampler(period_s=0.2, device="cuda").start() if torch_cuda() else None
    except Exception:  # optional: the check must run without nvidia-ml-py
        return None


def _stop_sampler(sampler):
    if sampler is None:
        return None
    sampler.stop()
    return [s.to_dict() for s in sampler.samples]


def nvml_rows(samples) -> list[Row]:
    if not samples:
        return [Row("nvml", "utilisation during offline run", "no samples (nvidia-ml-py missing?)", "", "skip")]
    rows = []
    for key, label in (("gpu_util_percent", "GPU busy %"), ("mem_util_percent", "memory busy %"),
                       ("power_w", "power W"), ("mem_used_bytes", "memory used GiB")):
        vals = [s[key] for s in samples if s.get(key) is not None]
        if not vals:
            continue
        if key == "mem_used_bytes":
            vals = [v / 2**30 for v in vals]
        rows.append(Row("nvml", f"{label} (mean / max, {len(vals)} samples)",
                        f"{statistics.fmean(vals):.1f} / {max(vals):.1f}", "", "info",
                        {"mean": statistics.fmean(vals), "max": max(vals)}))
    return rows


# ------------------------------------------------------------------------------ main
CHECKS = {
    "kernels": check_kernels, "cuda_graphs": check_cuda_graphs, "engine_graphs": check_engine_graphs,
    "pool_edges": check_pool_edges, "tpot": check_tpot, "embedded": check_embedded,
    "prefill": check_prefill, "offline": check_offline, "int8": check_int8,
}


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    return env


class _InjectedFault(RuntimeError):
    pass


def run_worker(args) -> int:
    """Run one section in this process; its rows go to ``--worker-out`` as they are made."""
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    rows = RowLog(args.worker_out, environment())
    rows._flush()
    try:  # Dynamo recompiles, with their reasons, go to the section's log
        import torch._logging

        torch._logging.set_logs(recompiles=True)
    except Exception:  # a torch without this API: the counts in engine_graphs still come back
        pass
    name = args.worker
    fault = args.faults.get(name)
    if fault:  # fire after the section's first row: that row must still come back
        class FaultyLog(RowLog):
            def append(self, row):
                rows.append(row)
                if fault == "abort":
                    os.abort()
                if fault == "hang":
                    time.sleep(10**6)
                raise _InjectedFault(f"fault injected into {name} (--inject-fault)")

            def extend(self, more):
                for row in more:
                    self.append(row)

        sink = FaultyLog(None)
    else:
        sink = rows
    try:
        CHECKS[name](args, sink)
    except Exception as e:  # the orchestrator turns this into the section's error row
        traceback.print_exc()
        rows.append(Row(name, "section", f"{type(e).__name__}: {str(e)[:200]}", "", "error"))
        return 1
    return 0


def _worker_argv(args, name: str, rows_path: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--worker-out", str(rows_path),
            "--scale", str(args.scale), "--model", args.model, "--compile", args.compile,
            "--hf-budget-s", str(args.hf_budget_s), "--hf-batch", str(args.hf_batch),
            "--tpot-tokens", str(args.tpot_tokens), "--seed", str(args.seed), "--out", str(args.out)]
    if args.smoke:
        argv.append("--smoke")
    for sec, kind in args.faults.items():
        argv += ["--inject-fault", f"{sec}={kind}"]
    return argv


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "killed: out of time (budget or --section-timeout-s)"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def run_sections(args) -> int:
    """Run every section in its own subprocess within the budget; rewrite ``args.out`` after
    each. Returns the exit status (1 when a check failed or a section errored)."""
    start = time.perf_counter()
    out = args.out
    payload = {"schema": SCHEMA, "environment": {}, "args": {k: str(v) for k, v in vars(args).items()},
               "budget_s": args.budget_s, "total_seconds": 0.0, "complete": False,
               "sections": {n: {"status": "pending", "returncode": None, "seconds": 0.0, "log": None,
                                "error": None} for n in args.sections},
               "rows": []}
    write_json(out, payload)
    log_path = out.with_name(f"{out.stem}.log")
    log_path.write_text("")  # this run's sections only
    for name in args.sections:
        sec = payload["sections"][name]
        left = args.budget_s - (time.perf_counter() - start)
        if left < MIN_SECTION_S:
            sec.update(status="skipped", error=f"budget spent ({args.budget_s:.0f} s): not started")
            payload["rows"].append(asdict(Row(name, "section", "skipped: run budget spent", "", "skip")))
            print(f"[gpu_check] {name} skipped: {left:.0f} s of the budget left", flush=True)
            write_json(out, payload)
            continue
        rows_path = out.with_name(f"{out.stem}.{name}.rows.json")
        rows_path.unlink(missing_ok=True)
        env = dict(os.environ, **SECTION_ENV.get(name, {}))
        print(f"[gpu_check] {name} ... (log: {log_path.name})", flush=True)
        t0 = time.perf_counter()
        cut_by_budget = False
        section_start = log_path.stat().st_size
        with open(log_path, "ab") as log:
            log.write(f"===== section {name} =====\n".encode())
            log.flush()
            proc = subprocess.Popen(_worker_argv(args, name, rows_path), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=ROOT, start_new_session=True)
            try:
                rc = proc.wait(timeout=min(left, args.section_timeout_s))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the section and anything it started
                proc.wait()
                rc = None
                cut_by_budget = left < args.section_timeout_s  # the run's end, not its own limit, stopped it
        got = json.loads(rows_path.read_text()) if rows_path.exists() else {"rows": [], "environment": {}}
        rows_path.unlink(missing_ok=True)
        if got.get("environment") and not payload["environment"]:
            payload["environment"] = got["environment"]
        sec.update(seconds=time.perf_counter() - t0, returncode=rc, log=log_path.name)
        payload["rows"] += got["rows"]
        if cut_by_budget:  # a section still running when the run's time is up has not failed
            sec.update(status="skipped", error=f"cut after {sec['seconds']:.0f} s: the run budget ({args.budget_s:.0f} s) "
                                               "was spent")
            payload["rows"].append(asdict(Row(name, "section", "cut: run budget spent", "", "skip")))
        elif rc != 0:
            with open(log_path, "rb") as log:
                log.seek(section_start)
                tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
            sec.update(status="error", error=f"{_describe_exit(rc)}; last log line: {tail[0][:300]}")
            if not any(r["status"] == "error" for r in got["rows"]):
                payload["rows"].append(asdict(Row(name, "section", _describe_exit(rc), "", "error",
                                                  {"log": log_path.name})))
        elif not got["rows"]:  # a section that checked nothing has not passed
            why = f"exit status 0 but no rows in {rows_path}"
            sec.update(status="error", error=why)
            payload["rows"].append(asdict(Row(name, "section", why, "", "error", {"log": log_path.name})))
        else:
            sec["status"] = "ok"
        payload["total_seconds"] = time.perf_counter() - start
        write_json(out, payload)
        print(f"[gpu_check] {name}: {sec['status']} in {sec['seconds']:.1f} s", flush=True)
    payload["complete"] = True
    payload["total_seconds"] = time.perf_counter() - start
    write_json(out, payload)
    rows = [Row(**r) for r in payload["rows"]]
    print(format_table(rows))
    print(f"total {payload['total_seconds']:.1f} s; wrote {out}")
    return 1 if any(r.status in ("fail", "error") for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args)
    if not args.smoke:
        import torch  # is_available() creates no CUDA context: the sections get the whole GPU

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; this script checks the GPU path and needs one", file=sys.stderr)
            return 2
    return run_sections(args)


if __name__ == "__main__":
    sys.exit(main())
