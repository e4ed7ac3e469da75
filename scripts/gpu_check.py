#!/usr/bin/env python
"""One-command check of minivllm's GPU path (issue 3), about 5 minutes on one H200.

    python scripts/gpu_check.py [--scale 1.0] [--out gpu_check.json]

Needs only torch (CUDA), triton, transformers, numpy and this repository (no plotly, no
flash-attn; nvidia-ml-py is used when present). Sections, in order:

1. kernels      our Triton kernels vs the naive fp32 reference and the torch backend on the
                GPU: max abs error per kernel (fp32, and bf16 inputs within 2e-2 of fp32).
2. cuda_graphs  decode through ``CudaGraphDecodeRunner`` vs eager on ``random:qwen3-0.6b``
                in bf16 (logits within bf16 tolerance; padded buckets; a decode at the full
                ``max_model_len``), and the model step time eager vs graph at batch 1/16/64.
3. embedded     triton vs torch backend on the embedded model in fp32: greedy tokens agree.
4. tpot         engine decode TPOT at batch 1/16/64 with and without CUDA graphs (bf16).
5. prefill      engine prefill throughput (prompt tokens/s).
6. offline      nano-vllm's benchmark workload (256 requests x ``--scale``, input and output
                lengths uniform in 100..1024, random token ids, ignore_eos): output tokens/s,
                and the same requests through transformers ``generate`` for a ratio.
7. nvml         utilisation samples taken during the offline run (when NVML is available).

Sections 4-6 share one engine with CUDA graphs (start-up paid once); it is shut down
before transformers runs. Prints one summary table and writes every number to JSON (``--out``). Each section is
guarded: an error is recorded and the next section runs. Exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("kernels", "cuda_graphs", "embedded", "tpot", "prefill", "offline")
BF16_TOL = 2e-2


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0,
                   help="fraction of nano-vllm's 256-request workload to run (default 1.0)")
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="JSON results file")
    p.add_argument("--model", default="random:qwen3-0.6b", help="model for the speed sections")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile of the small fused ops (engine arg `compile`; auto = engine default)")
    p.add_argument("--hf-budget-s", type=float, default=45.0,
                   help="seconds of transformers generate for the offline ratio (whole batches)")
    p.add_argument("--hf-batch", type=int, default=64, help="transformers generate batch size")
    p.add_argument("--tpot-tokens", type=int, default=128, help="output tokens per TPOT request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (CUDA graphs emulated): checks "
                        "this script's plumbing on a machine without a GPU; its numbers mean nothing")
    args = p.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    if not 0 < args.scale <= 4:
        p.error(f"--scale must be in (0, 4], got {args.scale}")
    unknown = [s for s in args.sections.split(",") if s and s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    args.sections = [s for s in SECTIONS if s in args.sections.split(",")]
    if args.hf_batch < 1:
        p.error(f"--hf-batch must be >= 1, got {args.hf_batch}")
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
                      vocab: int = 10000) -> list[tuple[list[int], int]]:
    """nano-vllm's bench.py shape: ``(prompt token ids, output length)`` per request, both
    lengths uniform in ``min_len..max_len`` and ids uniform in ``0..vocab-1``."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        n_in = rng.randint(min_len, max_len)
        n_out = rng.randint(min_len, max_len)
        work.append(([rng.randrange(vocab) for _ in range(n_in)], n_out))
    return work


def fmt_ms(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f} ms"


def status_of(ok: bool) -> str:
    return "pass" if ok else "fail"


# ------------------------------------------------------------------------------ GPU helpers
def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_gpu():
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
def check_kernels(args) -> list[Row]:
    import torch

    from minivllm.layers.attention import triton_kernels as tk
    from minivllm.layers.attention.testing import make_case, naive_attention
    from minivllm.layers.attention.torch_backend import TorchAttentionBackend
    from minivllm.layers.attention.triton_backend import TritonAttentionBackend

    dev = args.device
    rows: list[Row] = []
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
            err = (out.float() - expected).abs().max().item()
            if dtype == torch.float32:
                worst[kind] = max(worst[kind], err)
            else:
                worst_bf16[kind] = max(worst_bf16[kind], err)
            if kind == "decode":  # the unsplit path as well (split count is automatic above)
                one = tk.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                                case.meta.context_lens, case.scale, num_splits=1)
                e1 = (one.float() - expected).abs().max().item()
                if dtype == torch.float32:
                    worst[kind] = max(worst[kind], e1)
                else:
                    worst_bf16[kind] = max(worst_bf16[kind], e1)
            case2 = make_case(seqs, H, Hk, D, bs, dtype, device=dev, seed=7, fill=0.0)
            ref_backend.prepare(case2.meta)
            ref = ref_backend.forward(case2.q, case2.k, case2.v, case2.k_cache, case2.v_cache, case2.meta,
                                      case2.scale)
            worst_vs_torch = max(worst_vs_torch, (out.float() - ref.float()).abs().max().item()
                                 if dtype == torch.float32 else 0.0)
        _sync()
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
    return rows


# ------------------------------------------------------------------------------ 2. CUDA graphs
def _build_model(model_name, dtype, device, seed=0):
    from minivllm.engine.model_runner import build_model
    from minivllm.utils.model_source import resolve_model

    src = resolve_model(model_name)
    return build_model(src, device, dtype, seed), src.hf_config


def check_cuda_graphs(args) -> list[Row]:
    import torch

    from minivllm.engine.cuda_graph import CudaGraphDecodeRunner
    from minivllm.engine.kv_cache import allocate_kv_cache
    from minivllm.layers.attention import get_attention_backend
    from minivllm.layers.attention.context import ForwardContext

    dev, dtype, bs = torch.device(args.device), torch.bfloat16, 16
    max_model_len = 4096
    if args.smoke:
        dtype, max_model_len = torch.float32, 64
    max_blocks = max_model_len // bs
    model, cfg = _build_model(args.model, dtype, dev, args.seed)
    backend = get_attention_backend("triton", dev, bs)
    rng = random.Random(args.seed)
    # sequence 0 fills max_model_len - 1 tokens; 63 more of 50..600 tokens; block 0 unused
    lo, hi = (50, 600) if not args.smoke else (3, 30)
    lens = [max_model_len - 1] + [rng.randint(lo, hi) for _ in range(63)]
    tables, nxt = [], 1
    for n in lens:
        nb = -(-(n + 1) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    _, kv = allocate_kv_cache(cfg, nxt, bs, dtype, dev)
    vocab = cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]

    def slots_for(table, positions):
        return [table[p // bs] * bs + p % bs for p in positions]

    rows: list[Row] = []
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
        runner = CudaGraphDecodeRunner(model, kv, backend, max_num_seqs=64, max_blocks_per_seq=max_blocks,
                                       hidden_size=cfg.hidden_size, device=dev, dtype=dtype,
                                       emulate=dev.type != "cuda")
        runner.capture()
        _sync()
        capture_s = time.perf_counter() - t0
        rows.append(Row("cuda_graphs", "capture buckets", f"{len(runner.buckets)} graphs in {capture_s:.1f} s",
                        "", "info", {"buckets": runner.buckets, "capture_s": capture_s}))

        def decode_inputs(n):
            ids = torch.tensor([prompts[i][-1] for i in range(n)], device=dev)
            pos = torch.tensor([lens[i] for i in range(n)], device=dev)
            meta = _meta([1] * n, [lens[i] + 1 for i in range(n)], [slots_for(tables[i], [lens[i]])[0] for i in range(n)],
                         [tables[i] for i in range(n)], bs, dev)
            return ids, pos, meta

        worst, agree, total = 0.0, 0, 0
        for n in ((1, 3, 13, 64) if not args.smoke else (1, 3)):  # exact buckets and padded ones; seq 0 decodes at max_model_len
            ids, pos, meta = decode_inputs(n)
            backend.prepare(meta)
            eager = model.compute_logits(model(ids, pos, ForwardContext(meta, backend, kv))).float()
            graph = model.compute_logits(runner.run(ids, pos, meta)).float()
            scale = max(1.0, eager.abs().max().item())
            worst = max(worst, (graph - eager).abs().max().item() / scale)
            agree += int((graph.argmax(-1) == eager.argmax(-1)).sum())
            total += n
        rows.append(Row("cuda_graphs", "graph vs eager logits (rel. max abs)", f"{worst:.2e}", f"<= {BF16_TOL:g}",
                        status_of(worst <= BF16_TOL), {"rel_max_abs_err": worst}))
        rows.append(Row("cuda_graphs", "graph vs eager argmax agreement", f"{agree}/{total}", "all",
                        status_of(agree == total)))
        rows.append(Row("cuda_graphs", "decode at full max_model_len in graph", f"ctx {max_model_len}", "runs",
                        "pass"))

        for n in ((1, 16, 64) if not args.smoke else (2,)):  # pure model-step time (no scheduler), eager vs graph
            ids, pos, meta = decode_inputs(n)
            times = {}
            for mode in ("eager", "graph"):
                for _ in range(3):
                    if mode == "eager":
                        backend.prepare(meta)
                        model(ids, pos, ForwardContext(meta, backend, kv))
                    else:
                        runner.run(ids, pos, meta)
                _sync()
                iters = 30 if not args.smoke else 1
                t0 = time.perf_counter()
                for _ in range(iters):
                    if mode == "eager":
                        backend.prepare(meta)
                        model(ids, pos, ForwardContext(meta, backend, kv))
                    else:
                        runner.run(ids, pos, meta)
                _sync()
                times[mode] = (time.perf_counter() - t0) / iters * 1e3
            rows.append(Row("cuda_graphs", f"model step batch {n} eager / graph",
                            f"{times['eager']:.3f} / {times['graph']:.3f} ms", "", "info", times))
    del runner, kv, model
    _free_gpu()
    return rows


# ------------------------------------------------------------------------------ 3. embedded model
def check_embedded(args) -> list[Row]:
    from minivllm import LLM, SamplingParams

    rng = random.Random(args.seed + 1)
    outs: dict[str, list[list[int]]] = {}
    prompts: list = []
    for backend in ("torch", "triton"):
        model = None if not args.smoke else args.model
        # eager, no torch.compile: this section compares attention backends, not speed
        llm = LLM(model, device=args.device, dtype="float32", attention_backend=backend, enforce_eager=True,
                  num_kvcache_blocks=2048, seed=args.seed, compile=False)
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
    return [
        Row("embedded", "triton vs torch fp32: identical requests", f"{same}/{len(outs['torch'])}",
            ">= 90%", status_of(same >= 0.9 * len(outs["torch"]))),
        Row("embedded", "triton vs torch fp32: token agreement", f"{tok_agree}/{tok_total}", "", "info"),
    ]


# ------------------------------------------------------------------------------ 4-6. engine speed
def _compile_kw(args) -> dict:
    return {} if args.compile == "auto" else {"compile": args.compile == "on"}


def _engine(args, enforce_eager, **kw):
    from minivllm import LLM

    if args.smoke:
        kw.setdefault("num_kvcache_blocks", 256)
    return LLM(args.model, device=args.device, dtype="bfloat16" if not args.smoke else "float32",
               enforce_eager=enforce_eager, seed=args.seed, **_compile_kw(args), **kw)


_SHARED: dict = {}


def _graph_engine(args):
    """One bf16 engine with CUDA graphs (engine defaults otherwise), shared by the TPOT,
    prefill and offline sections so start-up (compile, capture) is paid once."""
    if "llm" not in _SHARED:
        _SHARED["llm"] = _engine(args, False)
    return _SHARED["llm"]


def _release_graph_engine():
    llm = _SHARED.pop("llm", None)
    if llm is not None:
        llm.shutdown()
        del llm
        _free_gpu()


def _engine_uses_graphs(llm) -> bool:
    from minivllm.engine.cuda_graph import CudaGraphDecodeRunner

    runner = llm.llm_engine.runner
    return any(isinstance(v, CudaGraphDecodeRunner) and v.captured for v in vars(runner).values())


def check_tpot(args) -> list[Row]:
    from minivllm import SamplingParams

    rows = []
    rng = random.Random(args.seed + 2)
    result = {}
    for eager in (True, False):
        llm = _engine(args, True, max_num_seqs=64) if eager else _graph_engine(args)
        label = "eager" if eager else "cuda graphs"
        uses = _engine_uses_graphs(llm)
        backend = llm.llm_engine.config.attention_backend
        vocab = llm.llm_engine.runner.hf_config.vocab_size
        sp = SamplingParams(temperature=0.0, max_tokens=args.tpot_tokens if not args.smoke else 4,
                            ignore_eos=True)
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        for batch in ((1, 16, 64) if not args.smoke else (1, 2)):
            prompts = [[rng.randrange(vocab) for _ in range(128 if not args.smoke else 8)] for _ in range(batch)]
            res = llm.generate(prompts, sp, use_tqdm=False)
            tpots = [r.metrics.tpot_ms for r in res if r.metrics.tpot_ms is not None]
            tpot = statistics.median(tpots) if tpots else float("nan")
            result[(label, batch)] = tpot
            target, status = "", "info"
            if batch == 1 and not eager:
                target, status = "<= 1.5 ms", status_of(tpot <= 1.5)
            rows.append(Row("tpot", f"batch {batch} {label} ({backend}, graphs used: {uses})", fmt_ms(tpot),
                            target, status, {"tpot_ms": tpot, "graphs_used": uses, "backend": backend}))
        if eager:
            llm.shutdown()
            del llm
            _free_gpu()
    return rows


def check_prefill(args) -> list[Row]:
    from minivllm import SamplingParams

    rng = random.Random(args.seed + 3)
    llm = _graph_engine(args)  # prefill steps never use graphs
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
    llm.llm_engine.reset_prefix_cache()
    tps = n_prompts * plen / dt
    return [Row("prefill", f"prefill {n_prompts} x {plen} tokens", f"{tps:,.0f} tok/s", "", "info",
                {"tokens_per_s": tps})]


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
    # warm-up
    with torch.inference_mode():
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
    del model
    _free_gpu()
    return {"requests": done, "output_tokens": useful, "seconds": elapsed,
            "tokens_per_s": useful / elapsed if elapsed else float("nan")}


def check_offline(args, sampler_box: dict) -> list[Row]:
    from minivllm import SamplingParams

    if args.smoke:
        n, work = 2, nanovllm_workload(2, seed=args.seed, min_len=4, max_len=10, vocab=50)
    else:
        n = max(1, round(256 * args.scale))
        work = nanovllm_workload(n, seed=args.seed)
    llm = _graph_engine(args)
    uses = _engine_uses_graphs(llm)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for _, o in work]
    sampler = _start_sampler()
    _sync()
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    sampler_box["samples"] = _stop_sampler(sampler)
    del llm
    _release_graph_engine()  # transformers needs the memory the KV pool holds
    out_tokens = sum(len(r.outputs[0].token_ids) for r in res)
    ours = out_tokens / dt
    rows = [Row("offline", f"minivllm {n} req (graphs used: {uses})", f"{ours:,.0f} out tok/s ({dt:.1f} s)",
                "", "info", {"requests": n, "output_tokens": out_tokens, "seconds": dt, "tokens_per_s": ours})]
    if args.hf_budget_s > 0:
        hf = _hf_throughput(args, work)
        ratio = ours / hf["tokens_per_s"] if hf["tokens_per_s"] else float("nan")
        rows.append(Row("offline", f"transformers generate ({hf['requests']} req, batch {args.hf_batch})",
                        f"{hf['tokens_per_s']:,.0f} out tok/s", "", "info", hf))
        rows.append(Row("offline", "ratio minivllm / transformers", f"{ratio:.1f}x", "well ahead (> 1x)",
                        status_of(ratio > 1.0), {"ratio": ratio}))
    return rows


# ------------------------------------------------------------------------------ 7. NVML
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
    for key, label in (("gpu_util_percent", "SM busy %"), ("mem_util_percent", "memory busy %"),
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
def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this script checks the GPU path and needs one", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows: list[Row] = []
    box: dict = {}
    runners = {
        "kernels": lambda: check_kernels(args),
        "cuda_graphs": lambda: check_cuda_graphs(args),
        "embedded": lambda: check_embedded(args),
        "tpot": lambda: check_tpot(args),
        "prefill": lambda: check_prefill(args),
        "offline": lambda: check_offline(args, box),
    }
    timings = {}
    for name in args.sections:
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            rows += runners[name]()
        except Exception as e:  # record and go on: one broken section must not hide the others
            traceback.print_exc()
            rows.append(Row(name, "section", f"{type(e).__name__}: {str(e)[:80]}", "", "error"))
            _free_gpu()
        timings[name] = time.perf_counter() - t0
        if name == args.sections[-1]:
            _release_graph_engine()
        print(f"[gpu_check] {name} done in {timings[name]:.1f} s", flush=True)
    if "offline" in args.sections:
        rows += nvml_rows(box.get("samples"))
    total = time.perf_counter() - start
    print(format_table(rows))
    print(f"total {total:.1f} s")
    payload = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()},
               "section_seconds": timings, "total_seconds": total, "rows": [asdict(r) for r in rows]}
    args.out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {args.out}")
    return 1 if any(r.status in ("fail", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
