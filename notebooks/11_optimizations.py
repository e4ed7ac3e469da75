# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Optimizations: launches, graphs, compilers and kernels
#
# A decode step of a small model does very little arithmetic, and yet it can be slow: the host
# spends its time *issuing* hundreds of small operations, one after another. This chapter measures
# that cost on your machine and looks at the three tools an inference engine uses against it and
# against wasted memory traffic: **CUDA graphs** (issue a whole step with one call), **torch.compile**
# (fuse several small operations into one kernel) and **attention kernels** written for the job
# (minivllm's Triton kernels, flash-attn).
#
# **You will:** count the operations one decode step issues, with the PyTorch profiler, and measure
# what each costs here · see how the engine prepares CUDA graphs for decode batches (and measure them
# when a GPU is present) · compile the engine's fused RMSNorm + residual with `torch.compile` and time
# the compile and the result · compare the attention backends this machine has, and check our Triton
# kernels against the reference in Triton's interpreter.

# %% [markdown]
# ## Setup

# %% tags=["parameters"]
import os

# Threads that finish their share of an operation early spin, by default, waiting for the next
# one. On a machine shared with other busy processes that spinning steals the cores the other
# threads need, and small steps get many times slower. PASSIVE lets waiting threads sleep; it is
# read when torch loads its OpenMP runtime, so it must be set before `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import statistics
import time

import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)

# %%
llm = LLM(MODEL, device=DEVICE, num_kvcache_blocks=128, max_num_seqs=8)
engine = llm.llm_engine
cfg, hf = engine.config, engine.source.hf_config
ON_CUDA = cfg.device.type == "cuda"
print(describe(llm))
print(f"{hf.num_hidden_layers} layers, hidden {hf.hidden_size}; "
      f"CUDA graphs captured: {engine.runner.graph_runner is not None}")

# %% [markdown]
# ## 1. What a decode step issues
#
# Every PyTorch operation called from Python goes through the dispatcher: argument checks, choosing
# a kernel for the device and dtype, allocating the output, and on a GPU enqueueing a kernel launch.
# That costs a few microseconds of host time per operation whatever the tensor size. A decode step
# runs every layer's operations for a handful of rows, so the fixed cost per operation can outweigh
# the arithmetic.
#
# The stepper below holds a request; we let it prefill and decode once, then record its next decode
# step with `torch.profiler` and count the ATen operations that do work (views and reshapes, which
# only relabel memory, are left out). On a GPU each of these is at least one kernel launch.

# %%
from widgets import EngineStepper

stepper = EngineStepper(llm, prompt="The module provides", max_tokens=12)
stepper.add_request("Return a new list containing", max_tokens=12)
stepper.step()  # the prefill
stepper.step()  # the first decode step
stepper.display()

# %%
from collections import Counter

from torch.profiler import ProfilerActivity, profile

# Operations that only relabel or allocate memory, or convert a tensor that already has the
# right dtype/device: no kernel of their own on a GPU.
NO_KERNEL = {"aten::view", "aten::as_strided", "aten::reshape", "aten::_reshape_alias", "aten::transpose",
             "aten::slice", "aten::narrow", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::split",
             "aten::chunk", "aten::expand", "aten::expand_as", "aten::view_as", "aten::permute", "aten::select",
             "aten::alias", "aten::detach", "aten::_unsafe_view", "aten::resolve_conj", "aten::resolve_neg",
             "aten::result_type", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::to",
             "aten::_to_copy", "aten::contiguous"}


def profile_call(fn):
    """Run fn() under the profiler; returns (its result, Counter of leaf ATen ops that do work, kernels on GPU)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_CUDA else [])
    with profile(activities=acts) as prof:
        out = fn()
    events = prof.events()
    ops = Counter(e.name for e in events if e.name.startswith("aten::") and e.name not in NO_KERNEL
                  and not any(c.name.startswith("aten::") for c in e.cpu_children))
    kernels = sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return out, ops, kernels


rec, ops, kernels = profile_call(stepper.step)
# The same at batch 4: three more requests join the stepper's, then one 4-sequence decode step is profiled.
for i in range(3):
    engine.add_request(f"extra-{i}", "The module provides" + " and" * i,
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
while engine.has_unfinished_requests():
    if engine.step_with_record().record.phase == "decode":
        break
rec4, ops4, kernels4 = profile_call(lambda: engine.step_with_record().record)
while engine.has_unfinished_requests():
    engine.step()
print(f"{rec.phase} step of {rec.num_seqs} sequence: {sum(ops.values())} ATen operations that do work")
print("   most frequent:", ", ".join(f"{n.removeprefix('aten::')} x{c}" for n, c in ops.most_common(8)))
print(f"{rec4.phase} step of {rec4.num_seqs} sequences: {sum(ops4.values())} ATen operations that do work")

# %%
# NBVAL_CHECK_OUTPUT
# (The exact counts change whenever the model or backend code does; this checks which operations run:)
print(f"profiled: a {rec.phase} step of {rec.num_seqs} sequence and a {rec4.phase} step of {rec4.num_seqs}")
print("operations at batch 1 and at batch 4:", "the same" if set(ops) == set(ops4) else "different")
print("operations whose count differs between the two:", sorted(op for op in set(ops) | set(ops4)
                                                              if ops[op] != ops4[op]))

# %%
if ON_CUDA:
    print(f"CUDA kernels launched: {kernels} (batch 1), {kernels4} (batch 4)")

# What one operation costs the host here: a tiny add, dispatched 20,000 times.
a = torch.ones(1, device=cfg.device)
for _ in range(2000):
    torch.add(a, a)
if ON_CUDA:
    torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20000):
    torch.add(a, a)
if ON_CUDA:
    torch.cuda.synchronize()
per_op_us = (time.perf_counter() - t0) / 20000 * 1e6

# Unprofiled decode steps at batch 1, for comparison.
engine.add_request("timing", "The module provides", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
decode = [r for r in (engine.step_with_record().record for _ in range(24)) if r.phase == "decode"][4:]
n_ops = sum(ops.values())
print(f"one tiny operation: {per_op_us:.1f} µs of host time")
step_ms = statistics.median(r.wall_ms for r in decode)
print(f"{n_ops} operations x {per_op_us:.1f} µs = {n_ops * per_op_us / 1e3:.2f} ms of pure dispatch per step")
print(f"measured decode step at batch 1: median {step_ms:.2f} ms, of which the model's forward pass "
      f"{statistics.median(r.model_ms for r in decode):.2f} ms; the dispatch floor is "
      f"{n_ops * per_op_us / 1e3 / step_ms:.0%} of the step")

# %% [markdown]
# The step issues the same operations at batch 1 and batch 4, on taller tensors; the cell above
# names any operation whose *count* differs (on the CPU backend, memory copies PyTorch makes when
# the attention output's layout cannot be reshaped in place). So the dispatch cost is a nearly fixed
# floor under every decode step, paid again at every step whatever the batch; the rest of the measured step is the model's Python code, the engine's own
# work (scheduling, building inputs, sampling) and the arithmetic itself. On a GPU the floor matters
# far more: the GPU finishes a small kernel quickly and then waits for the host to issue the next
# one, so a small model's decode step can take longer than its arithmetic needs unless the launches
# are taken off the host (section 2 measures this when a GPU is present).
#
# ## 2. CUDA graphs: issue the whole step at once
#
# A CUDA graph records every kernel launch of one forward pass, with its arguments, and replays the
# whole sequence with a single call: the host cost of hundreds of launches becomes the cost of one.
# The price is rigidity: a graph replays fixed shapes at fixed memory addresses. The engine
# (`minivllm/engine/cuda_graph.py`, switched on by `ModelRunner.enable_cuda_graphs` when the device
# is CUDA, `enforce_eager=False` and the attention backend can be captured) therefore
#
# * captures one graph per **batch-size bucket** and runs a step of `n` sequences in the smallest
#   bucket `>= n`, padding the extra rows (they write no KV and attend to one dummy key);
# * copies each step's inputs into **static buffers** the graph reads, and reads the output from a
#   static buffer the graph writes;
# * captures decode steps only: prefill shapes vary too much, and a prefill has enough work per
#   launch that launches matter less.
#
# The bucket choice is plain Python and runs anywhere:

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.engine.cuda_graph import capture_batch_sizes, select_bucket

for max_num_seqs in (8, 32, 256):
    print(f"max_num_seqs={max_num_seqs}: graphs for batch sizes {capture_batch_sizes(max_num_seqs)}")
buckets = capture_batch_sizes(32)
print("a decode batch of n runs the graph of:",
      ", ".join(f"{n}->{select_bucket(n, buckets)}" for n in (1, 3, 5, 9, 17, 31)),
      f"; 33 -> {select_bucket(33, buckets)} (eager)")
print(f"this engine ({cfg.device}): graphs captured = {engine.runner.graph_runner is not None}")

# %%
import pandas as pd

if ON_CUDA:
    # Measured: decode step time with and without CUDA graphs, same model and prompts.
    rows = []
    for eager in (True, False):
        g = LLM(MODEL, device=DEVICE, enforce_eager=eager, max_num_seqs=8, gpu_memory_utilization=0.3)
        e = g.llm_engine
        for b in (1, 8):
            for i in range(b):
                e.add_request(f"g{eager}-{b}-{i}", "The module provides",
                              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            steps = []
            while e.has_unfinished_requests():
                r = e.step_with_record().record
                if r.phase == "decode" and r.num_seqs == b:
                    steps.append(r)
            rows.append(dict(cuda_graphs=not eager and e.runner.graph_runner is not None, batch=b,
                             decode_step_ms=statistics.median(r.wall_ms for r in steps[5:])))
        g.shutdown()
    graphs = pd.DataFrame(rows)
    display(graphs)
else:
    print("No CUDA device here, so no CUDA graph to measure: on a GPU this cell times decode steps with "
          "enforce_eager=True and False. On this CPU the launch counts above are the measurement: "
          "every one of those operations is host work each step, with or without a graph.")

# %% [markdown]
# ## 3. torch.compile: fewer, fused kernels
#
# CUDA graphs remove the *launch* cost but still run every kernel. Many of a transformer's small
# operations are element-wise and each one reads its input from memory and writes its output back.
# The engine's RMSNorm with a fused residual add (`minivllm/layers/norm.py`) is written as plain
# PyTorch: add, cast, square, mean, add eps, rsqrt, multiply, cast, multiply by the weight; one
# kernel and one trip through memory each. `torch.compile` traces the function and its backend
# (Inductor) generates one fused kernel: C++ with OpenMP on a CPU, Triton on a GPU.
#
# Generating and compiling that code takes seconds (the first call pays it; Inductor keeps a cache on
# disk, so a later process may find the kernel already built). The engine's `compile=True` compiles
# RMSNorm, SiLU-and-multiply and the rotary embedding this way (`dynamic=True`, so one kernel serves
# every number of tokens); it is on by default on CUDA, off on CPU, where a notebook would wait for it
# at every start. Here is that compile, once, on one op, at the size of Qwen3-0.6B's hidden state:

# %%
from minivllm.layers.norm import RMSNorm

HIDDEN = 1024  # Qwen3-0.6B's hidden size
norm = RMSNorm(HIDDEN).to(cfg.device)
torch.manual_seed(0)
inputs = {t: (torch.randn(t, HIDDEN, device=cfg.device), torch.randn(t, HIDDEN, device=cfg.device))
          for t in (8, 512)}

compiled = torch.compile(norm.forward, dynamic=True)  # as ModelRunner.enable_compile does
t0 = time.perf_counter()
with torch.inference_mode():
    compiled(*inputs[8])
if ON_CUDA:
    torch.cuda.synchronize()
compile_s = time.perf_counter() - t0
print(f"first call of the compiled RMSNorm + residual (trace + code generation + build): {compile_s:.1f} s")
with torch.inference_mode():
    _, eager_ops, _ = profile_call(lambda: norm(*inputs[8]))
    _, compiled_ops, _ = profile_call(lambda: compiled(*inputs[8]))

# %%
# NBVAL_CHECK_OUTPUT
with torch.inference_mode():
    for t, (x, res) in inputs.items():
        (y_e, r_e), (y_c, r_c) = norm(x, res), compiled(x, res)
        print(f"{t:4d} tokens: compiled output equals eager (atol 1e-5): "
              f"{torch.allclose(y_e, y_c, atol=1e-5) and torch.allclose(r_e, r_c)}")


# %%
def bench_us(fn, args, repeats=7, number=100):
    """Median over `repeats` of the mean time of `number` calls, in microseconds."""
    times = []
    with torch.inference_mode():
        for _ in range(3):
            fn(*args)
        for _ in range(repeats):
            if ON_CUDA:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(number):
                fn(*args)
            if ON_CUDA:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(times)


rows = []
for t, args in inputs.items():
    e_us, c_us = bench_us(norm.forward, args), bench_us(compiled, args)
    moved = 4 * t * HIDDEN * args[0].element_size()  # read x and residual, write y and the new residual
    rows.append({"tokens": t, "eager µs": e_us, "compiled µs": c_us, "speed-up": e_us / c_us,
                 "compiled GB/s (4 x tokens x hidden x 4 B)": moved / (c_us * 1e-6) / 1e9})
print(f"eager RMSNorm + residual: {sum(eager_ops.values())} ATen operations "
      f"({', '.join(n.removeprefix('aten::') for n in eager_ops)}); "
      f"compiled: {sum(compiled_ops.values())} left outside the fused kernel")
pd.DataFrame(rows).round(2)

# %% [markdown]
# The fused kernel does the arithmetic of the eager operations listed above in one pass over memory
# and one call. Whether that is faster, and by how much, is what the table measures, and on a CPU the
# answer can go either way: with few tokens the call is dominated by fixed costs (the compiled
# function has its own Python wrapper and guard checks, the eager one a handful of dispatches); with
# many, by the memory traffic and by how well the generated C++ loop uses the cores, compared with
# PyTorch's own hand-written vectorised CPU kernels, which on a busy shared machine is not a given.
# On a GPU, where each eager operation is a separate kernel with its own trip through memory, fusion
# is the reliable win, which is why the engine compiles by default on CUDA only. And whether the
# seconds of compilation pay for themselves depends on how many calls follow: in a server running for
# hours, yes; in a notebook that runs a few steps on a CPU, no.
#
# ## 4. Attention backends
#
# The attention backend stores a step's new keys and values in the paged KV cache and attends over
# it (chapter 04). minivllm has three behind one interface (`minivllm/layers/attention/`):
#
# * `torch`: the reference, plain PyTorch on any device: gathers the keys and values through the block
#   table into dense tensors, then calls `scaled_dot_product_attention`;
# * `triton`: our Triton kernels, reading the paged cache directly (no gathered copy); on GPUs;
# * `flash_attn`: flash-attn 2's paged kernels; CUDA only, and blocks of a multiple of 256 tokens.
#
# Which of them this machine can run, and the time of each on the same inputs: a decode step of 8
# sequences with 256 to 512 tokens of context, and a prefill of two 256-token prompts, at Qwen3-0.6B's
# attention shape (16 query heads, 8 KV heads, head dim 128). `naive` is the test suite's plain
# reference (a Python loop over sequences), for scale.

# %%
import importlib.util

from minivllm.layers.attention import flash_attn_available, get_attention_backend, triton_available
from minivllm.testing import make_case, naive_attention

runnable = {"torch": True,
            "triton": triton_available() and ON_CUDA,
            "flash_attn": flash_attn_available() and ON_CUDA}
print(f"triton installed: {triton_available()}; flash-attn installed: {flash_attn_available()}; device {cfg.device}")
print("backends that run at full speed here:", [n for n, ok in runnable.items() if ok])
if not ON_CUDA and triton_available():
    print("triton on a CPU runs only in its interpreter (TRITON_INTERPRET=1, set before triton is imported): "
          "a correctness tool, far too slow to time; see the check below")

# %%
H, HK, D = 16, 8, 128
dtype = torch.bfloat16 if ON_CUDA else torch.float32
CASES = {"decode: 8 seqs, ctx 256-512": [(256 + 32 * i, 1) for i in range(8)],
         "prefill: 2 x 256 tokens": [(256, 256), (256, 256)]}


def time_backend(name, case, repeats=5):
    be = get_attention_backend(name, cfg.device, case.meta.block_size)
    args = (case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    ms = []
    for _ in range(repeats + 1):
        case.meta.extras.clear()
        if ON_CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        be.prepare(case.meta)
        out = be.forward(*args)
        if ON_CUDA:
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms[1:]), out


rows = []
for label, seqs in CASES.items():
    for name, ok in runnable.items():
        if not ok:
            continue
        block = 256 if name == "flash_attn" else 16
        case = make_case(seqs, H, HK, D, block, dtype=dtype, device=cfg.device, fill=0.0)
        ms, out = time_backend(name, case)
        err = (out.float() - naive_attention(case)).abs().max().item()
        kv_bytes = sum(ctx for ctx, _ in seqs) * HK * D * 2 * case.k.element_size()
        rows.append({"case": label, "backend": name, "ms": ms, "max |error| vs naive": err,
                     "KV read GB/s": kv_bytes / (ms * 1e-3) / 1e9})
    case = make_case(seqs, H, HK, D, 16, dtype=dtype, device=cfg.device, fill=0.0)
    t0 = time.perf_counter()
    naive_attention(case)
    rows.append({"case": label, "backend": "naive", "ms": (time.perf_counter() - t0) * 1e3})
pd.DataFrame(rows)

# %% [markdown]
# The gather in the `torch` backend copies every key and value the step reads into a dense tensor
# before attending; a paged kernel (Triton or flash-attn) reads them in place, block by block, and
# fuses the softmax with both matrix products so the attention scores never go to memory. On a GPU,
# with a real checkpoint, the table above shows the difference; on a CPU only `torch` runs at speed.
#
# ### Our Triton kernels on a CPU: correct, not fast
#
# Triton compiles kernels for GPUs. Its **interpreter** runs the same kernel code on the CPU, one
# program instance at a time in Python and NumPy, so the kernels can be tested on any machine. It is
# switched on by the environment variable `TRITON_INTERPRET=1`, which Triton reads **when it is
# imported**: setting it in a notebook that has already imported triton does nothing. So the check runs
# in a fresh Python process, on tiny shapes: a prefill, a prompt continuing after a cached prefix
# (a prefix-cache hit or a later chunk), and a decode batch of three sequences of different lengths.

# %%
import json
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent('''
    import json, time
    import torch
    from minivllm.layers.attention import get_attention_backend
    from minivllm.testing import make_case, naive_attention
    cases = {"prefill": [(20, 20), (9, 9)], "prefix + chunk": [(40, 8)], "decode": [(33, 1), (17, 1), (5, 1)]}
    out = []
    for label, seqs in cases.items():
        for name in ("torch", "triton"):
            case = make_case(seqs, 4, 2, 16, 16, seed=1, fill=0.0)
            be = get_attention_backend(name, "cpu", 16)
            t0 = time.perf_counter()
            be.prepare(case.meta)
            o = be.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
            ms = (time.perf_counter() - t0) * 1e3
            out.append(dict(case=label, backend=name, err=(o.float() - naive_attention(case)).abs().max().item(), ms=ms))
    print(json.dumps(out))
''')
t0 = time.perf_counter()
proc = subprocess.run([sys.executable, "-c", CHECK], env={**os.environ, "TRITON_INTERPRET": "1"},
                      capture_output=True, text=True, timeout=300)
if proc.returncode != 0:
    raise RuntimeError(proc.stderr[-2000:])
interp = pd.DataFrame(json.loads(proc.stdout.strip().splitlines()[-1]))
print(f"subprocess with TRITON_INTERPRET=1 finished in {time.perf_counter() - t0:.1f} s (Python start and imports included)")
interp.round(7)

# %%
# NBVAL_CHECK_OUTPUT
for row in interp.itertuples():
    print(f"{row.case:15s} {row.backend:7s} matches the naive reference (max error < 1e-5): {row.err < 1e-5}")

# %% [markdown]
# The interpreted Triton kernels agree with the reference to rounding, and the same kernel source is
# what a GPU compiles. Their interpreted time (the `ms` column) says nothing about GPU speed: it
# measures Python executing one program instance after another.
#
# ## 5. Check yourself

# %%
from widgets import Question, Quiz

Quiz([
    Question(
        "A decode step at batch 1 and one at batch 4 issued the same kinds of operations, in nearly the same number. What follows?",
        ["The batch-4 step does no more arithmetic",
         "The per-operation host cost is a fixed floor per step, so larger batches spread it over more tokens",
         "The profiler missed the extra sequences",
         "Batch 4 must be using a CUDA graph"],
        1,
        ["The matrices have four times as many rows: more arithmetic per operation, and almost no more operations.",
         "Right: the dispatch cost is paid per operation, not per row; this is one reason batching makes "
         "decode cheaper per token.",
         "Each operation processes all sequences at once; the batch is a dimension of the tensors.",
         "This machine has no CUDA graphs at all (the engine captures them on CUDA only); the count is the "
         "eager one."],
    ),
    Question(
        "Why does the engine capture CUDA graphs for decode steps but not for prefill steps?",
        ["Prefill cannot run on a GPU",
         "Graphs need fixed shapes; decode has few shapes (bucketed batch sizes) and much launch overhead "
         "relative to its work, prefill has many shapes and long kernels",
         "Prefill does not use the KV cache",
         "torch.compile already removes all prefill launches"],
        1,
        ["Prefill runs on the GPU like everything else; the question is whether a graph pays.",
         "Right: a prefill of hundreds of tokens keeps each kernel busy long enough that launches are a small "
         "share, and its token count varies too much to capture every shape.",
         "Prefill writes the KV cache; that is not what decides it.",
         "Compilation fuses element-wise operations; the matrix multiplies and attention still launch their "
         "own kernels."],
    ),
    Question(
        "The triton backend on this CPU needs TRITON_INTERPRET=1. Why set it in a new process rather than with "
        "os.environ in the notebook?",
        ["os.environ cannot set variables", "Triton reads it once, when it is imported",
         "The interpreter needs root rights", "It only works under pytest"],
        1,
        ["os.environ does set it, for code that reads it afterwards; Triton has read it already.",
         "Right: once triton is imported in the kernel, changing the variable changes nothing, so a fresh "
         "process started with the variable set is the reliable way.",
         "Nothing about the interpreter needs privileges.",
         "The tests use it the same way, but it is an environment variable read by triton, wherever it runs."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * A decode step issues nearly the same few hundred operations whatever the batch; each costs
#   microseconds of host time, measured above: a fixed floor under every step, and on a GPU, where
#   each operation is a kernel launch the device waits for, a large share of a small model's step.
# * CUDA graphs replay a whole decode step with one launch. They need fixed shapes, so minivllm
#   captures batch-size buckets and pads; they run on CUDA only (`enforce_eager=False`).
# * `torch.compile` fuses chains of element-wise operations into one kernel and one pass over memory,
#   at a cost of seconds of compilation the first time; the engine compiles RMSNorm, SiLU-and-mul and
#   rotary when `compile=True` (default on CUDA).
# * Attention backends share one interface and one reference: the `torch` backend runs everywhere;
#   our Triton kernels match it (checked here in the interpreter) and run at speed on GPUs, as does
#   flash-attn.
#
# Next: chapter 12, benchmarks: measuring the whole engine against a peer.
