# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Optimizations: launches, graphs, compilers, kernels, int8 weights and speculation
#
# **Goal:** measure where a decode step's time goes on your machine beyond the arithmetic, and what
# five standard optimisations do about it: CUDA graphs, `torch.compile`, attention kernels, int8
# weights and speculative decoding.
#
# **Prerequisites:** chapter 02 (the model's layers), 04 (the paged KV cache and its block tables),
# 06 (decode of a model whose weights stream from main memory is memory-bound: a step reads every weight
# once; the embedded model's weights are few, and section 1 below measures what else its decode
# step spends its time on) and 07 (TPOT).
#
# **Time:** about 45 minutes (reading and running).
#
# A decode step of a small model does little arithmetic, yet it is not free of other costs: the host
# issues many small operations one after another (PyTorch operations, and on a CPU minivllm's own C
# calls), each with a fixed cost before it touches a byte, and every weight is read once per step (from main memory, unless the CPU's caches hold it). This chapter measures both on your machine, then looks at the
# tools an inference engine uses against them: **CUDA graphs**, and their CPU counterpart (issue a whole step with one call),
# **torch.compile** (fuse small operations into one kernel), **attention kernels** written for the job
# (minivllm's Triton kernels, flash-attn), **int8 weights** (fewer bytes per step) and **speculative
# decoding** (several tokens per step).
#
# **You will:** count the operations one decode step issues, with the PyTorch profiler, and measure
# what their dispatch costs here · see how the engine prepares graphs for decode batches and
# measure what they save (CUDA graphs on a GPU, CPU graphs on a CPU) · compile the engine's fused RMSNorm + residual with
# `torch.compile` and time the compile and the result · time the attention backends this machine
# has, fairly, and check our Triton kernels in Triton's interpreter · predict, then measure, what int8
# weights and speculative decoding do to a decode step here.

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
from minivllm.utils.env_report import chart_provenance, describe
from widgets import check_claim, check_prediction, idle_engine, render

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)

# %%
# enforce_eager=True: every step runs the model's forward operation by operation, which is what
# section 1 counts; section 2 turns the recorded decode graphs on and times both.
llm = LLM(MODEL, device=DEVICE, num_kvcache_blocks=128, max_num_seqs=8, enforce_eager=True)
engine = llm.llm_engine
cfg, hf = engine.config, engine.source.hf_config
ON_CUDA = cfg.device.type == "cuda"
print(describe(llm))
print(f"{hf.num_hidden_layers} layers, hidden {hf.hidden_size}; "
      f"decode graphs: {engine.runner.graph_runner is not None}")

# %% [markdown]
# ## 1. What a decode step issues
#
# Every PyTorch operation called from Python goes through the dispatcher: argument checks, choosing
# a kernel for the device and dtype, allocating the output, and on a GPU enqueueing a kernel launch.
# That costs around a microsecond or more of host time per operation whatever the tensor size (the
# cells below measure it on this machine). A decode step
# runs every layer's operations for a handful of rows, so the fixed cost per operation can outweigh
# the arithmetic. On a CPU, minivllm's layers do most of their work in its own compiled C functions
# (the GEMMs, norms, rotary, SiLU, attention and KV writes) instead of ATen operations; each is called
# from Python through `ctypes`, behind a wrapper that checks the tensors and allocates the output, so it
# has a fixed host cost of its own.
#
# The stepper below holds a request; we let it prefill and decode once, then record its next decode
# step with `torch.profiler` and count the ATen operations that do work (views and reshapes, which
# only relabel memory, are left out), and with `minivllm.layers.cpu_graph.count_calls` the calls into
# minivllm's C code. On a GPU each ATen operation is at least one kernel launch. (The stepper's card
# numbers a step as the engine counts them, every step this engine has run in the cells above included;
# "steps taken here" counts the widget's own.)

# %%
from widgets import EngineStepper


def start_stepper():
    """The stepper's one request, prefilled and one decode step in, on an idle engine with an empty
    prefix cache (Reset first: running this again starts over instead of adding a second request)."""
    stepper.reset()
    stepper.add_request("Return a new list containing", max_tokens=12)
    stepper.step()  # the prefill
    stepper.step()  # the first decode step


# prompt= and max_tokens= only fill the widget's form; start_stepper submits the one request.
stepper = EngineStepper(llm, prompt="The module provides", max_tokens=12)
start_stepper()
stepper.display()

# %%
from collections import Counter

from torch.profiler import ProfilerActivity

from minivllm.layers.cpu_graph import count_calls
from widgets import quiet_profile

# Operations that only relabel or allocate memory, or convert a tensor that already has the
# right dtype/device: no kernel of their own on a GPU.
NO_KERNEL = {"aten::view", "aten::as_strided", "aten::reshape", "aten::_reshape_alias", "aten::transpose",
             "aten::slice", "aten::narrow", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::split",
             "aten::chunk", "aten::expand", "aten::expand_as", "aten::view_as", "aten::permute", "aten::select",
             "aten::alias", "aten::detach", "aten::_unsafe_view", "aten::resolve_conj", "aten::resolve_neg",
             "aten::result_type", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::to",
             "aten::_to_copy", "aten::contiguous", "aten::type_as", "aten::empty_like", "aten::new_empty",
             "aten::new_empty_strided", "aten::split_with_sizes", "aten::unbind", "aten::flatten",
             "aten::unflatten"}


def does_work(e) -> bool:
    """An ATen operation that does work of its own: not in NO_KERNEL, not a reduction's zeroing of
    its output (a fill_ inside sum is part of the sum), not a Python scalar turned into a tensor
    (a copy_ between 0-dimensional tensors: `x / 1024` converts the 1024)."""
    if not e.name.startswith("aten::") or e.name in NO_KERNEL:
        return False
    if e.name in ("aten::fill_", "aten::zero_") and e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
        return False
    return not (e.name == "aten::copy_" and e.input_shapes
                and all(s == [] for s in e.input_shapes if isinstance(s, list)))


def works_below(e) -> bool:
    return any(does_work(c) or works_below(c) for c in e.cpu_children)


def profile_call(fn):
    """Run fn() under the profiler; returns (its result, Counter of the innermost ATen operations
    that do work, Counter of calls into minivllm's C code, kernels on GPU)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_CUDA else [])
    # quiet_profile: torch.profiler.profile without its start/stop trace lines on stderr
    with quiet_profile(activities=acts, record_shapes=True) as prof, count_calls() as c_calls:
        out = fn()
    events = prof.events()
    # innermost: an operation built from others (rms_norm, mean) counts as those
    ops = Counter(e.name for e in events if does_work(e) and not works_below(e))
    kernels = sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return out, ops, c_calls, kernels


engine.abort_request([f"extra-{i}" for i in range(3)])  # left by an interrupted run of this cell, if any
# the profiled step must be the stepper's one request in decode: start it again unless the engine holds
# exactly that (this cell ran before and finished it, or the stepper's buttons added or reset requests)
if (list(engine.requests) != stepper.request_ids[:1] or len(stepper.request_ids) != 1
        or stepper.sequence(stepper.request_ids[0]).num_output_tokens < 1):  # not yet past its prefill
    start_stepper()
rec, ops, c_calls, kernels = profile_call(stepper.step)
# The same at batch 4: three more requests join the stepper's, then one 4-sequence decode step is profiled.
for i in range(3):
    engine.add_request(f"extra-{i}", "The module provides" + " and" * i,
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
while engine.has_unfinished_requests():
    if engine.step_with_record().record.phase == "decode":
        break
rec4, ops4, c_calls4, kernels4 = profile_call(lambda: engine.step_with_record().record)
while engine.has_unfinished_requests():
    engine.step()
for r, o, c in ((rec, ops, c_calls), (rec4, ops4, c_calls4)):
    print(f"{r.phase} step of {r.num_seqs} sequence{'s' if r.num_seqs > 1 else ''}: {sum(o.values())} ATen operation{'s' if sum(o.values()) != 1 else ''} that do{'' if sum(o.values()) != 1 else 'es'} work, "
          f"{sum(c.values())} calls into minivllm's C code")
print("   most frequent at batch 1:", ", ".join(f"{n.removeprefix('aten::')} x{k}"
                                             for n, k in (ops + c_calls).most_common(8)))

# %%
# NBVAL_CHECK_OUTPUT
# (The exact counts change whenever the model or backend code does; this checks which operations run:)
print(f"profiled: a {rec.phase} step of {rec.num_seqs} sequence and a {rec4.phase} step of {rec4.num_seqs}")
calls1, calls4 = ops + c_calls, ops4 + c_calls4  # ATen operations and C calls together
print("operations at batch 1 and at batch 4:", "the same" if set(calls1) == set(calls4) else "different")
print("operations whose count differs between the two:", sorted(op for op in set(calls1) | set(calls4)
                                                              if calls1[op] != calls4[op]))

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

# What one of minivllm's C calls costs the host: an RMSNorm of one 256-value row through its wrapper
# (checks, output allocation, the ctypes call; the arithmetic itself is a fraction of a microsecond).
n_c = sum(c_calls.values())
per_c_us = 0.0
from minivllm.layers import cpu_fused

fused = cpu_fused.load() if n_c else None  # None: no C calls here (a GPU), or the fused ops are off
if fused is not None:
    row, ones = torch.randn(1, 256), torch.ones(256)
    for _ in range(2000):
        fused.rms_norm(row, ones, 1e-6)
    t0 = time.perf_counter()
    for _ in range(20000):
        fused.rms_norm(row, ones, 1e-6)
    per_c_us = (time.perf_counter() - t0) / 20000 * 1e6

# Unprofiled decode steps at batch 1, for comparison (alone: nothing a click in the stepper added).
idle_engine(llm)
engine.add_request("timing", "The module provides", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
decode = [r for r in (engine.step_with_record().record for _ in range(24)) if r.phase == "decode"][4:]
n_ops = sum(ops.values())
print(f"one tiny ATen operation: {per_op_us:.1f} µs of host time"
      + (f"; one tiny C call through its wrapper: {per_c_us:.1f} µs" if n_c else ""))
step_ms = statistics.median(r.wall_ms for r in decode)
floor_ms = (n_ops * per_op_us + n_c * per_c_us) / 1e3
floor_terms = f"{n_ops} ATen operation{'s' if n_ops != 1 else ''} x {per_op_us:.1f} µs" + (f" + {n_c} C calls x {per_c_us:.1f} µs" if n_c else "")
print(f"{floor_terms} = {floor_ms:.2f} ms of pure dispatch per step")
print(f"measured decode step at batch 1: median {step_ms:.2f} ms, of which the model's forward pass "
      f"{statistics.median(r.model_ms for r in decode):.2f} ms; the dispatch floor is "
      f"{floor_ms / step_ms:.0%} of the step")

# %%
floor_share = floor_ms / step_ms
render(f"On this run the dispatch floor ({floor_terms} = {floor_ms:.2f} ms) is "
       f"**{floor_share:.0%}** of a batch-1 decode step of {step_ms:.2f} ms (one timing of {len(decode)} steps: "
       "section 2 times the same engine again, alternating with others, and gives the share against that). "
       f"The other {1 - floor_share:.0%} "
       "is the model's Python code, the engine's own work (scheduling, building inputs, sampling) and the "
       "arithmetic itself, including reading every weight once.");

# %% [markdown]
# The step issues the same operations at batch 1 and batch 4, on taller tensors; the cell above the
# timing names any operation whose *count* differs (an empty list when none does). So the dispatch cost is a nearly fixed
# floor under every decode step, paid again at every step whatever the batch, and its share of the
# step is the figure just rendered. On a GPU the floor matters more: the GPU finishes a small kernel
# quickly and then waits for the host to issue the next one, so a small model's decode step can take
# longer than its arithmetic needs unless the launches are taken off the host (section 2 measures
# this, and checks it, when a GPU is present).
#
# ## 2. CUDA graphs (and CPU graphs): issue the whole step at once
#
# A CUDA graph records every kernel launch of one forward pass, with its arguments, and replays the
# whole sequence with a single call: the host cost of hundreds of launches becomes the cost of one.
# The price is rigidity: a graph replays fixed shapes at fixed memory addresses. The engine
# (`minivllm/engine/cuda_graph.py`, switched on by `ModelRunner.enable_cuda_graphs` when
# `enforce_eager=False` and the attention backend can be captured) therefore
#
# * captures one graph per **batch-size bucket** and runs a step of `n` sequences in the smallest
#   bucket `>= n`, padding the extra rows (they write no KV and attend to one dummy key);
# * copies each step's inputs into **static buffers** the graph reads, and reads the output from a
#   static buffer the graph writes;
# * captures decode steps only: prefill shapes vary too much, and a prefill has enough work per
#   launch that launches matter less. (vLLM's V1 engine goes further: its piecewise CUDA graphs
#   capture everything but the attention for mixed and prefill batches too, attention running between
#   the pieces; minivllm keeps nano-vllm's decode-only graphs.)
#
# A CPU has no kernel launches, but the same idea applies to the Python around our C calls: a float32
# decode step on a CPU is a few dozen calls into our C code (GEMMs, norms, rotary, attention), each
# behind module calls, shape checks and tensor allocations. A **CPU graph**
# (`minivllm/layers/cpu_graph.py`) records those calls with the memory addresses they were given while
# one step runs, then replays them with nothing else around them, from one C loop (a call made from Python
# pays its wrapper's checks and `ctypes`' conversion of its arguments, section 1's "tiny C call", dozens of times
# a step). The static buffers carry
# over; the buckets do not. A padded row adds little to a GPU's decode step, which waits on reading the
# weights, but on a CPU it is arithmetic like any other row, so the engine records a graph for every
# batch size (`cpu_capture_batch_sizes`): no padded rows. It records each one at the first step of that
# size instead of ahead of time, up to 64 sequences (`CPU_MAX_CAPTURE_SIZE`), where a CPU step's
# arithmetic has long outgrown the Python. And an ATen operation that would hand back a fresh tensor
# cannot be replayed (the calls after it would never see the new tensor), so the recorder refuses it
# and the engine stays eager. On either device a step with a prefill chunk in it runs eagerly. A step
# that verifies speculative drafts is replayed on a CPU, one graph row per scored token (a scored token
# is a decode row that sees the keys up to its own position), and runs eagerly on a GPU.
#
# The bucket choice is plain Python and runs anywhere:

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.engine.cuda_graph import capture_batch_sizes, cpu_capture_batch_sizes, select_bucket

for max_num_seqs in (8, 32, 256):
    print(f"CUDA, max_num_seqs={max_num_seqs}: graphs for batch sizes {capture_batch_sizes(max_num_seqs)}")
cpu_sizes = cpu_capture_batch_sizes(256)
print(f"CPU, max_num_seqs=256: {len(cpu_sizes)} graphs, for batch sizes {cpu_sizes[0]} to {cpu_sizes[-1]}"
      + (", each size its own" if cpu_sizes == list(range(cpu_sizes[0], cpu_sizes[-1] + 1)) else f": {cpu_sizes}"))
buckets = capture_batch_sizes(32)
print("CUDA: a decode batch of n runs the graph of:",
      ", ".join(f"{n}->{select_bucket(n, buckets)}" for n in (1, 3, 5, 9, 17, 31)),
      f"; 33 -> {select_bucket(33, buckets)} (eager)")
print(f"this engine ({cfg.device}, enforce_eager=True): graphs = {engine.runner.graph_runner is not None}")

# %%
import pandas as pd

# Measured: decode step time with and without graphs (CUDA graphs on a GPU, CPU graphs on a CPU), same
# model and prompts, three rounds alternating the engines (so that load from other processes falls on
# all of them); the graph engine's first step at each batch size records its graph, and each run's
# first 5 decode steps are left out. Section 1's engine (eager, built the same way) runs in the rounds too.
memory = dict(gpu_memory_utilization=0.3) if ON_CUDA else dict(num_kvcache_blocks=128)
g_eager = LLM(MODEL, device=DEVICE, enforce_eager=True, max_num_seqs=8, **memory)
g_graph = LLM(MODEL, device=DEVICE, enforce_eager=False, max_num_seqs=8, **memory)
ENGINES = {"eager": g_eager.llm_engine, "graphs": g_graph.llm_engine, "eager (section 1's engine)": engine}


def decode_step_ms(e, b, tag):
    """Median wall time of the steady decode steps of b requests decoding together."""
    idle_engine(e)  # a request the stepper above (or an interrupted run of this cell) left would join the steps
    for i in range(b):
        e.add_request(f"{tag}-{i}", "The module provides", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    steps = []
    while e.has_unfinished_requests():
        r = e.step_with_record().record
        if r.phase == "decode" and r.num_seqs == b:
            steps.append(r)
    return statistics.median(r.wall_ms for r in steps[5:])


round_ms = {(name, b): [] for name in ENGINES for b in (1, 8)}
for rnd in range(3):
    for b in (1, 8):
        for name, e in ENGINES.items():
            round_ms[(name, b)].append(decode_step_ms(e, b, f"r{rnd}-{name}-{b}"))
has_graphs = g_graph.llm_engine.runner.graph_runner is not None
replays = g_graph.llm_engine.runner.graph_runner.num_replays if has_graphs else 0
rows = [dict(engine=name, graphs=name == "graphs" and has_graphs, batch=b, decode_step_ms=statistics.median(v),
             rounds_ms=f"{min(v):.2f}-{max(v):.2f}") for (name, b), v in round_ms.items()]
g_eager.shutdown()
g_graph.shutdown()
graphs = pd.DataFrame(rows).set_index(["engine", "batch"])
display(graphs.round(2))
graphs = graphs.reset_index()
print(f"decode steps replayed from a graph by the graph engine: {replays}")
eager_b1 = graphs[(graphs.engine == "eager") & (graphs.batch == 1)].decode_step_ms
graph_b1 = graphs[graphs.graphs & (graphs.batch == 1)].decode_step_ms
if len(eager_b1) and len(graph_b1) and replays:
    graph_speedup = float(eager_b1.iloc[0]) / float(graph_b1.iloc[0])
    _ = check_claim("decode graphs shorten a batch-1 decode step", graph_speedup > 1,
                    f"{float(eager_b1.iloc[0]):.2f} ms eager, {float(graph_b1.iloc[0]):.2f} ms with graphs",
                    why_it_may_not="A large model's step is dominated by reading its weights, which "
                                   "graphs do not shorten.")
    _ = render(f"On this {'GPU' if ON_CUDA else 'CPU'} ({cfg.device}, {engine.source.name}) the eager batch-1 "
               f"decode step took **{graph_speedup:.2f}x** as long as the same step replayed from a "
               f"{'CUDA' if ON_CUDA else 'CPU'} graph (medians of three rounds, from the table above).")
    saved_ms = float(eager_b1.iloc[0]) - float(graph_b1.iloc[0])
    _ = render(f"The replay saved {saved_ms:.2f} ms a step against section 1's dispatch floor of {floor_ms:.2f} ms"
               + (": more than the floor, because the floor counts only each operation's own dispatch, and a "
                  "replay also skips the model's Python code around the calls (module calls, shape checks, "
                  "tensor allocations)." if saved_ms > floor_ms else
                  ": no more than the floor, so part of the dispatch cost is still paid in a replay here."))
    s1_b1 = float(graphs[(graphs.engine == "eager (section 1's engine)") & (graphs.batch == 1)].decode_step_ms.iloc[0])
    s1_range = graphs[(graphs.engine == "eager (section 1's engine)") & (graphs.batch == 1)].rounds_ms.iloc[0]
    _ = render(f"Section 1's engine, eager too, took {s1_b1:.2f} ms a batch-1 decode step in these rounds (rounds "
               f"{s1_range} ms), the fresh eager engine {float(eager_b1.iloc[0]):.2f} ms, and section 1 timed it at "
               f"{step_ms:.2f} ms alone. Figures taken at different moments of one run move by this much (other "
               "processes, what the caches hold), which is why this comparison alternates the engines and gives each "
               f"one's range over the rounds. Against this round's median, section 1's dispatch floor "
               f"({floor_ms:.2f} ms) is **{floor_ms / s1_b1:.0%}** of a batch-1 decode step, where section 1's single "
               f"timing made it {floor_ms / step_ms:.0%}.")
else:
    print("The engine recorded no graphs here (enforce_eager=False still ran eagerly: the attention "
          "backend or the dtype cannot be recorded), so there is no graph to compare with.")

# %% [markdown]
# ## 3. torch.compile: fewer, fused kernels
#
# CUDA graphs remove the *launch* cost but still run every kernel. Many of a transformer's small
# operations are element-wise and each one reads its input from memory and writes its output back.
# The engine's RMSNorm with a fused residual add (`minivllm/layers/norm.py`) is plain PyTorch: add the
# residual, cast to fp32, `torch.nn.functional.rms_norm` (the mean of squares, eps and the reciprocal
# square root), cast back, multiply by the weight. Not every line becomes an operation that does
# work (in fp32 the two casts do nothing), and one line can run as more than one ATen operation. The
# profiler below counts the *innermost* ATen operations that do work, so an operation that calls
# others internally shows up as those (`rms_norm` as the kernels it is built from: the mean of
# squares as `pow`, `sum` and `div_`), and the bookkeeping around them (a Python scalar such as
# eps turned into a tensor) is left out. So the names in the
# list below do not match the formula's steps one for one (and vary between PyTorch versions). Run eagerly, each of those operations is one kernel and one
# trip through memory. `torch.compile` traces the function and its backend (Inductor) generates one
# fused kernel: C++ with OpenMP on a CPU, Triton on a GPU.
#
# Generating and compiling that code takes seconds (the first call pays it; Inductor keeps a cache on
# disk, so a later process may find the kernel already built). The engine's `compile=True` compiles
# RMSNorm, SiLU-and-multiply and the rotary embedding this way (`dynamic=True`, so one kernel serves
# every number of tokens from 2 up; torch.compile specialises sizes 0 and 1, so a one-token step gets
# a kernel of its own); it is on by default on CUDA, off on CPU, where a notebook would wait for it
# at every start. A float32 model on a CPU gets a third version instead: the same ops written once in
# C by us (`minivllm/layers/csrc/cpu_fused_f32.c`, built at first use like the attention kernel of
# section 4), one call each, with no tracing. Here is the compile, once, on one op, at the size of
# Qwen3-0.6B's hidden state, and below, all three versions timed side by side:

# %%
from minivllm.layers.norm import RMSNorm
from minivllm.models.presets import load_preset_config

QWEN3_06B = load_preset_config("qwen3-0.6b")  # the released model's config, packaged with minivllm
HIDDEN = QWEN3_06B.hidden_size
print(f"Qwen3-0.6B's hidden size: {HIDDEN}")
norm = RMSNorm(HIDDEN).to(cfg.device)
torch.manual_seed(0)
inputs = {t: (torch.randn(t, HIDDEN, device=cfg.device), torch.randn(t, HIDDEN, device=cfg.device))
          for t in (8, 512)}

torch._dynamo.reset()  # forget earlier compiles: run again, this cell would time a cache hit, not a compile
compiled = torch.compile(norm.forward, dynamic=True)  # as ModelRunner.enable_compile does
t0 = time.perf_counter()
with torch.inference_mode():
    compiled(*inputs[8])
if ON_CUDA:
    torch.cuda.synchronize()
compile_s = time.perf_counter() - t0
print(f"first call of the compiled RMSNorm + residual (trace + code generation + build): {compile_s:.1f} s")
with torch.inference_mode():
    _, eager_ops, _, _ = profile_call(lambda: norm(*inputs[8]))
    _, compiled_ops, _, _ = profile_call(lambda: compiled(*inputs[8]))

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


from minivllm.layers import cpu_fused

c_norm = None  # the engine's C version (CPU, float32 only): the same module with its `fused` ops set
if not ON_CUDA and norm.weight.dtype == torch.float32 and cpu_fused.load() is not None:
    c_norm = RMSNorm(HIDDEN)
    c_norm.fused = cpu_fused.load()
rows = []
for t, args in inputs.items():
    e_us, c_us = bench_us(norm.forward, args), bench_us(compiled, args)
    moved = 4 * t * HIDDEN * args[0].element_size()  # read x and residual, write y and the new residual
    row = {"tokens": t, "eager µs": e_us, "compiled µs": c_us, "compiled speed-up": e_us / c_us,
           "compiled GB/s (4 x tokens x hidden x 4 B)": moved / (c_us * 1e-6) / 1e9}
    if c_norm is not None:
        with torch.inference_mode():
            same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(c_norm(*args), norm(*args)))
        row.update({"C op µs": bench_us(c_norm.forward, args), "C op equals eager (atol 1e-5)": same})
        row["C op speed-up"] = e_us / row["C op µs"]
    rows.append(row)
display(pd.DataFrame(rows).round(2))
if c_norm is None:
    print("no C version here:", "CUDA" if ON_CUDA else cpu_fused.describe())
eager_list = ", ".join(f"{n.removeprefix('aten::')} x{c}" for n, c in eager_ops.items())
render(f"Eager, in {str(norm.weight.dtype).removeprefix('torch.')} on {cfg.device}, the RMSNorm + residual ran "
       f"**{sum(eager_ops.values())} ATen operations that do work** ({eager_list}); compiled, "
       f"{sum(compiled_ops.values())} ran outside the fused kernel.");

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
# hours, yes; in a notebook that runs a few steps on a CPU, no. The C version has no compile wait and
# no guards, and it replaces the eager operations' dispatches with one call through `ctypes`, into a
# loop the compiler vectorised. Its column says what that is worth on this machine. A long input (a
# prefill) is split by rows over torch's threads, each running the same C loop on its share
# (`cpu_fused.MIN_ELEMENTS_PER_THREAD` sets how much work makes a thread worth waking). A decode step
# calls four such ops per layer: two norms with their residual adds, SiLU-and-multiply, and one call
# for the q and k norms together with the rotary embedding (`CpuFusedOps.qk_norm_rope`; four separate
# calls while a forward hook watches one of those modules), so at decode sizes their fixed cost adds up.
#
# ## 4. Attention backends
#
# The attention backend stores a step's new keys and values in the paged KV cache and attends over
# it (chapter 04). minivllm has three behind one interface (`minivllm/layers/attention/`):
#
# * `torch`: the reference, plain PyTorch on any device: gathers the keys and values through the block
#   table into dense tensors, then calls `scaled_dot_product_attention`. On a CPU in fp32 its decode
#   sequences (one query token each) go instead through a small C kernel of ours
#   (`minivllm/layers/attention/csrc/`, compiled on first use) that reads the blocks in place, and a
#   fresh prompt (no cached prefix) through a causal kernel in the same C file that reads the step's
#   own keys and values; the table below times both, the plain path as `torch (gather + SDPA)`;
# * `triton`: our Triton kernels, reading the paged cache directly (no gathered copy); on GPUs;
# * `flash_attn`: flash-attn 2's paged kernels; CUDA only, and blocks of a multiple of 256 tokens.
#
# Which of them this machine can run, and the time of each on the same inputs: a decode step of 8
# sequences with 256 to 480 tokens of context (32 more for each), and a prefill of two 256-token
# prompts, at Qwen3-0.6B's attention shape (its query heads, KV heads and head dim, printed below). `naive` is the
# test suite's plain reference (`minivllm.testing.naive_attention`, a Python loop over sequences), for
# scale. Every contender gets the same inputs, one warm-up call and the same number of timed repeats;
# the table shows the median and the fastest and slowest repeat.

# %%
import importlib.util

from minivllm.layers.attention import flash_attn_available, get_attention_backend, triton_available
from minivllm.testing import make_case, naive_attention

runnable = {"torch": True,
            "torch (gather + SDPA)": not ON_CUDA,  # the same backend with its C kernels switched off
            "triton": triton_available() and ON_CUDA,
            "flash_attn": flash_attn_available() and ON_CUDA}
print(f"triton installed: {triton_available()}; flash-attn installed: {flash_attn_available()}; device {cfg.device}")
print("backends that run at full speed here:", [n for n, ok in runnable.items() if ok])
if not ON_CUDA and triton_available():
    print("triton on a CPU runs only in its interpreter (TRITON_INTERPRET=1, set before triton is imported): "
          "a correctness tool, far too slow to time; see the check below")

# %%
H, HK, D = QWEN3_06B.num_attention_heads, QWEN3_06B.num_key_value_heads, QWEN3_06B.head_dim
print(f"Qwen3-0.6B's attention: {H} query heads, {HK} KV heads, head dim {D}")
dtype = torch.bfloat16 if ON_CUDA else torch.float32
CASES = {"decode: 8 seqs, ctx 256-480": [(256 + 32 * i, 1) for i in range(8)],
         "prefill: 2 x 256 tokens": [(256, 256), (256, 256)]}
REPEATS = 5


def time_ms(fn, repeats=REPEATS):
    """One warm-up call, then `repeats` timed calls: (median, fastest, slowest) in ms and the last result."""
    ms = []
    for _ in range(repeats + 1):
        if ON_CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if ON_CUDA:
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    timed = ms[1:]
    return statistics.median(timed), min(timed), max(timed), out


def backend_call(name, case):
    if name == "torch (gather + SDPA)":
        from minivllm.layers.attention.torch_backend import TorchAttentionBackend
        be = TorchAttentionBackend(native_decode=False)
    else:
        be = get_attention_backend(name, cfg.device, case.meta.block_size)
    args = (case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)

    def call():
        case.meta.extras.clear()  # the per-step plan is rebuilt every call, as in a real step
        be.prepare(case.meta)
        return be.forward(*args)
    return call


rows = []
for label, seqs in CASES.items():
    for name, ok in [*runnable.items(), ("naive", True)]:
        if not ok:
            continue
        block = 256 if name == "flash_attn" else 16
        case = make_case(seqs, H, HK, D, block, dtype=dtype, device=cfg.device, fill=0.0)
        fn = (lambda c=case: naive_attention(c)) if name == "naive" else backend_call(name, case)
        med, lo, hi, out = time_ms(fn)
        err = (out.float() - naive_attention(case)).abs().max().item()
        kv_bytes = sum(ctx for ctx, _ in seqs) * HK * D * 2 * case.k.element_size()
        rows.append({"case": label, "backend": name, "median ms": med, "fastest ms": lo, "slowest ms": hi,
                     "max |error| vs naive": err,
                     # a decode reads every cached key and value once; a prefill here has no cached prefix
                     "decode KV read GB/s": kv_bytes / (med * 1e-3) / 1e9 if label.startswith("decode") else None})
attn = pd.DataFrame(rows)
display(attn.round({"median ms": 2, "fastest ms": 2, "slowest ms": 2, "decode KV read GB/s": 2}))


def vs_naive(label):
    t = attn[(attn.case == label) & (attn.backend == "torch")]["median ms"].item()
    n = attn[(attn.case == label) & (attn.backend == "naive")]["median ms"].item()
    return t, n, ("slower" if t > n else "faster"), max(t, n) / min(t, n)


def faster_or_slower(ms, other_ms):
    """'**1.50x faster**' or '**1.20x slower**': ``ms`` against ``other_ms``."""
    return f"**{other_ms / ms:.2f}x faster**" if ms <= other_ms else f"**{ms / other_ms:.2f}x slower**"


lines = []
for label in CASES:
    t, n, word, r = vs_naive(label)
    lines.append(f"* {label}: `torch` {t:.2f} ms, `naive` {n:.2f} ms: the backend is **{r:.2f}x {word}**")
if not ON_CUDA:
    dec = next(iter(CASES))
    t_native, t_plain = (attn[(attn.case == dec) & (attn.backend == b)]["median ms"].item()
                         for b in ("torch", "torch (gather + SDPA)"))
    lines.append(f"* {dec}: the C decode kernel {t_native:.2f} ms against gather + SDPA {t_plain:.2f} ms: "
                 f"reading the blocks in place was {faster_or_slower(t_native, t_plain)}")
    pre = list(CASES)[1]
    p_native, p_plain = (attn[(attn.case == pre) & (attn.backend == b)]["median ms"].item()
                         for b in ("torch", "torch (gather + SDPA)"))
    lines.append(f"* {pre}: the C causal kernel {p_native:.2f} ms against one SDPA call per prompt "
                 f"{p_plain:.2f} ms: the C kernel was {faster_or_slower(p_native, p_plain)}")
render("Median of the timed repeats on this run:\n\n" + "\n".join(lines))
if not ON_CUDA:
    check_claim("on this CPU, reading the blocks in place beats gathering them for the decode case",
                t_native < t_plain, f"{t_native:.2f} vs {t_plain:.2f} ms");

# %% [markdown]
# `naive` and `torch (gather + SDPA)` do not do the same work, which is why either can win. `naive` is
# handed every sequence's keys
# and values already laid out contiguously (the test case keeps a dense copy, `full_k` and `full_v`)
# and never touches the paged cache; it pays a Python loop iteration and a few small operations per
# sequence. The `torch (gather + SDPA)` path does what a real step must: it writes the step's new keys
# and values into the paged cache, builds its plan from the block tables, copies every sequence's
# blocks into one dense, padded tensor (padding to the longest context) and then attends for all
# sequences in one `scaled_dot_product_attention` call. So its time includes the price of paging, a
# copy of every key and value the step reads, that `naive` does not pay; `naive` pays instead for its
# Python loop, a cost that grows with the number of sequences. A paged kernel avoids the copy: it reads
# the blocks in place, block by block. That is what Triton and flash-attn do on a GPU, and what the
# `torch` backend's C decode kernel does on a CPU for one-token queries. The prefill case's two prompts
# have no cached prefix, so neither `torch` row gathers there: each attends over its own new keys and
# values, through the C causal kernel (up to eight query vectors against a vector's width of keys at a
# time: 16 keys with AVX-512, else 8) or through one
# causal SDPA call per prompt.
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
interp.assign(err=interp.err.map(lambda v: f"{v:.1e}"), ms=interp.ms.round(2))

# %%
# NBVAL_CHECK_OUTPUT
for row in interp.itertuples():
    print(f"{row.case:15s} {row.backend:7s} matches the naive reference (max error < 1e-5): {row.err < 1e-5}")

# %% [markdown]
# The interpreted Triton kernels agree with the reference to rounding, and the same kernel source is
# what a GPU compiles. Their interpreted time (the `ms` column) says nothing about GPU speed: it
# measures Python executing one program instance after another.
#
# ## 5. int8 weights: fewer bytes per step
#
# A batch-1 decode step reads every weight once and does two FLOPs with it (chapter 06). Stored in one
# byte instead of four (fp32) or two (bf16), the weights cost a quarter (or half) of the memory
# traffic, and a step that is bound by reading them gets faster by up to as much (less the time it
# spends on anything else, such as widening each int8 value back to float). minivllm quantises at
# load time: `LLM(..., quantization="int8")` turns every linear layer (and, by default, the LM head)
# into per-output-channel symmetric int8, `scale[n] = max |W[n, :]| / 127`, `Q = round(W / scale)`;
# embeddings and norms stay float (`docs/quantization.md`). On a CPU the matmul goes through our panel
# GEMM (the kernel of the float32 linears), reading the weights as int8 panels and widening each value to
# float32 as it loads it, the scale applied once per output at the end (`minivllm/layers/cpu_gemm.py`); on
# CUDA, through our Triton kernel, which converts int8 weight tiles to the activation dtype inside the
# matmul loop. On both the scheme is *weight-only*: int8 weights, activations untouched. (torch's fbgemm
# dynamic int8 linear, the CPU path where our kernel does not build, also rounds each token's activations
# to 7 bits at run time: *dynamic W8A8*.)
#
# Two engines of the same model, side by side: the one from the setup cell (fp32 on a CPU, bf16 on CUDA;
# the cells name it by its dtype) and an int8 one, both eager, so that decode graphs (section 2) do not
# enter the comparison. (On a CPU the fp32 engine holds a 16-bit checkpoint's values, such as the
# embedded model's float16 ones, in 16-bit panels: a float16 or bfloat16 value widens to float32
# exactly, so keeping it in 16 bits halves the bytes every step reads and changes no result. There
# int8 halves the bytes read rather than quartering them. The cell prints both engines' bytes.)
# First what int8 should save, from each engine's cost model and this machine's measured read
# bandwidth (the time to read the weights once from main memory: a floor under a decode step whose weights
# stream from there, though not under one whose weights a CPU's last-level cache holds; the cell says which
# this model's are):

# %%
from minivllm.quantization.int8 import describe_kernel
from minivllm.quantization.layer import quantized_layers
from minivllm.telemetry.peaks import get_peaks

q_llm = LLM(MODEL, device=DEVICE, quantization="int8", num_kvcache_blocks=128, max_num_seqs=8, enforce_eager=True)
q_engine = q_llm.llm_engine
BASE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(cfg.dtype, str(cfg.dtype))
print("int8 matmul path:", "; ".join(sorted({describe_kernel(m.int8.kernel)
                                             for m in quantized_layers(q_engine.runner.model)})))
peaks = get_peaks(cfg.device, cfg.dtype)
print(f"read bandwidth {peaks.mbu_bytes_per_s / 1e9:.1f} GB/s ({peaks.provenance})")
wbytes = {name: e.model_cost.body_weight_bytes + e.model_cost.lm_head_bytes
          for name, e in ((BASE, engine), ("int8", q_engine))}
read_ms = {name: b / peaks.mbu_bytes_per_s * 1e3 for name, b in wbytes.items()}
from minivllm.layers.prepack import matmul_bytes_per_weight

held = matmul_bytes_per_weight(engine.runner.model) if cfg.device.type == "cpu" else None
held_note = (f" (its linears' weights held in {held[0]:g} bytes each)" if held and held[0] else "")
for name in wbytes:
    print(f"{name} engine{held_note if name == BASE else ''}: layer + LM head weights {wbytes[name] / 2**20:.2f} MiB, "
          f"read once in {read_ms[name]:.2f} ms")
print(f"bytes ratio {BASE} / int8: {wbytes[BASE] / wbytes['int8']:.2f}x")
if cfg.device.type == "cpu":
    from minivllm.utils.env_report import last_level_cache_bytes

    llc = last_level_cache_bytes()
    graph_ms = float(graph_b1.iloc[0]) if len(graph_b1) and replays else None
    fits = llc is not None and wbytes[BASE] < llc
    _ = render(f"This CPU reports a largest cache of {f'{llc / 2**20:.0f} MiB' if llc else 'unknown size'}: the {BASE} "
               f"engine's {wbytes[BASE] / 2**20:.2f} MiB of weights "
               + ("fit in it, so a step may read them from cache, faster than the floor above"
                  if fits else "do not fit in it (or its size is unknown), so each step reads them from main memory")
               + (f"; section 2's batch-1 step replayed from a CPU graph took {graph_ms:.2f} ms, "
                  f"{'below' if graph_ms < read_ms[BASE] else 'above'} that floor's {read_ms[BASE]:.2f} ms."
                  if graph_ms is not None else "."))

# %% [markdown]
# ### Exercise 1 · How much faster is an int8 decode step here?
#
# The int8 engine reads fewer weight bytes than the setup cell's engine (the ratio is printed above; on a
# CPU the fp32 engine keeps a 16-bit checkpoint's values, such as the embedded model's, in 16 bits:
# `minivllm/layers/cpu_gemm.py`). Predict
# the speed-up of a **batch-1 decode step of this notebook's model** with int8 weights: the setup
# engine's step time (fp32 on a CPU) divided by the int8 step time (1.0 = no change). A way to a
# number: take section 1's measured batch-1 decode step, suppose int8 saves exactly the difference
# between the two engines' weight-read times printed above and changes nothing else (the dispatch,
# the Python, attention, norms and sampling of section 1 stay), and divide the old step by the new.

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: fp32 (bf16 on CUDA) decode step time / int8 decode step time, in x (e.g. 2.5)

# %%
greedy = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)


def decode_itls(llm, prompt="The module provides"):
    """Inter-token latencies (ms) of one batch-1 greedy request: one per decode step."""
    idle_engine(llm)  # batch 1: nothing a click in the stepper added may join it
    return llm.generate([prompt], greedy, use_tqdm=False)[0].metrics.itl_ms


for e in (llm, q_llm):  # warm-up
    decode_itls(e)
itl = {BASE: [], "int8": []}
round_medians = {BASE: [], "int8": []}
for _ in range(6):  # alternate the engines, so that load from other processes falls on both
    for name, e in ((BASE, llm), ("int8", q_llm)):
        x = decode_itls(e)
        itl[name] += x
        round_medians[name].append(statistics.median(x))
# the fastest round's median: load from other processes only ever slows a round
step = {name: min(v) for name, v in round_medians.items()}
int8_speedup = step[BASE] / step["int8"]
for name in step:
    print(f"{name}: decode step {step[name]:.2f} ms (the fastest of {len(round_medians[name])} rounds' medians, "
          f"{len(itl[name])} steps in all; round medians {min(round_medians[name]):.2f} to "
          f"{max(round_medians[name]):.2f} ms)")
check_prediction(my_prediction_1, int8_speedup, rel_tol=0.25, unit="x",
                 what="the int8 speed-up of a batch-1 decode step",
                 hint="How much of this model's step is reading weights (section 1), and does an int8 layer do "
                      "anything per call that a float layer does not? Then open the solution.");

# %%
render(f"On this run int8 changed the batch-1 decode step from {step[BASE]:.2f} ms to {step['int8']:.2f} ms: "
       f"**{int8_speedup:.2f}x**, while the weights shrank {wbytes[BASE] / wbytes['int8']:.2f}x. Reading the "
       f"{BASE} engine's weights once, as it holds them, at the measured read bandwidth would take {read_ms[BASE]:.2f} ms, "
       f"**{read_ms[BASE] / step[BASE]:.0%}** of the {BASE} step. (These steps are timed from the outside, as the gaps "
       "between one request's tokens through `generate`, so everything between two tokens counts; section 1's figure "
       "is the same engine's own record of its steps, the wall time of `step()`, taken earlier in the run.)")
read_saved = read_ms[BASE] - read_ms["int8"]  # the exercise's way to a number, from section 1's step
render(f"The exercise's estimate: section 1's step of {step_ms:.2f} ms less the {read_saved:.2f} ms of weight reading "
       f"int8 saves gives **{step_ms / max(step_ms - read_saved, 1e-9):.2f}x**; from this cell's own {BASE} step "
       f"({step[BASE]:.2f} ms, timed as the gaps between tokens) it gives "
       f"**{step[BASE] / max(step[BASE] - read_saved, 1e-9):.2f}x**; measured: **{int8_speedup:.2f}x**.")
check_claim("int8 speeds this model's decode step up by less than its weights shrank",
            int8_speedup < wbytes[BASE] / wbytes["int8"],
            f"{int8_speedup:.2f}x ({'slower' if int8_speedup < 1 else 'faster'}) against "
            f"{wbytes[BASE] / wbytes['int8']:.2f}x fewer bytes",
            why_it_may_not="A step bound by reading its weights from main memory, with an int8 linear that costs "
                           "little per call, would approach the bytes' ratio; reading this model's weights is a small part "
                           "of its step (the line above).");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# A step's time is a sum of parts, and int8 changes only one of them: the matrix multiplies of the
# linear layers and the LM head. The rest, the dispatch of the step's operations (section 1), the
# engine's Python work, attention, norms and sampling, does not depend on the weights' dtype, and the
# int8 path's widening costs what it costs: every int8 weight is widened to float32 as it is read (so is
# every 16-bit weight of the fp32 engine's panels on a CPU, as above), and a weight that comes from a
# cache rather than main memory gains little from being smaller. Amdahl's
# law then bounds the gain: if the matmuls are a share `f` of the step and get `s` times faster, the
# step gets `1 / ((1 - f) + f / s)` times faster, which stays far below `s` unless `f` is close to 1.
#
# How large is `f` here, and how much does int8 speed the matmuls up? The rendered sentence gives
# the weight-read floor's share of the step. Where that share is small, the step is bound by its fixed
# costs, not its weight reads. Where it is large, the matmuls are most of the step, but this model's
# few MB of weights may not come from main memory at all: a large CPU cache can hold them between
# steps (a step's matmuls can then take less time than the floor computed from main memory's
# bandwidth), and a cached read gains little from fewer bytes. int8's own per-call costs can
# also outweigh the bytes it saves on layers this small, so the step can even come out slower: the
# ratio rendered above says which happened on your run. On a model large enough that
# the weights dominate the step, the next cell's layer, one of Qwen3-0.6B's, shows whether int8 comes
# closer to its byte ratio there (its sentence gives both ratios).
#
# </details>

# %% [markdown]
# The same comparison on one linear layer of Qwen3-0.6B's size (the MLP's gate and up projections,
# hidden size -> twice the MLP's width, sizes printed below), at one row, so that reading the weight is most of the work. The
# layer is timed on several copies of its weight in turn, together twice the largest cache this CPU reports
# (at least 512 MiB), so that every call reads its weight from main memory as a real model's step does; the
# cell compares the rate it read them at with the measured read ceiling to check that:

# %%
import math

from minivllm.layers.prepack import linear, pack_weight
from minivllm.quantization.int8 import Int8Weight
from minivllm.utils.env_report import last_level_cache_bytes

LLC = last_level_cache_bytes()  # None where the OS does not say (then 512 MiB is assumed to be enough)
K_IN, N_OUT, COLD = QWEN3_06B.hidden_size, 2 * QWEN3_06B.intermediate_size, max(512 << 20, 2 * (LLC or 0))
cpu_read = (peaks if cfg.device.type == "cpu" and cfg.dtype == torch.float32
            else get_peaks(torch.device("cpu"), torch.float32)).mbu_bytes_per_s  # these products run on the CPU
print(f"the layer: {K_IN} -> {N_OUT}, {4 * K_IN * N_OUT / 2**20:.0f} MiB in fp32; copies of it: {COLD / 2**20:.0f} MiB "
      f"per dtype (largest CPU cache reported: {f'{LLC / 2**20:.0f} MiB' if LLC else 'unknown'})")
w = torch.randn(N_OUT, K_IN, generator=torch.Generator().manual_seed(0)) * 0.02
x1 = torch.randn(1, K_IN)
layer_bytes = {"fp32": 4 * N_OUT * K_IN, "int8": N_OUT * K_IN + 4 * N_OUT}  # int8: + one fp32 scale per row
copies = {"fp32": [pack_weight(w) for _ in range(math.ceil(COLD / layer_bytes["fp32"]))],
          "int8": [Int8Weight(w) for _ in range(math.ceil(COLD / layer_bytes["int8"]))]}
calls = {"fp32": lambda p: linear(x1, p), "int8": lambda q: q.matmul(x1)}
layer_ms = {}
with torch.inference_mode():
    for name, ws in copies.items():
        for wc in ws:  # warm-up
            calls[name](wc)
        trials = []
        for _ in range(3):
            t0 = time.perf_counter()
            for wc in ws * 2:
                calls[name](wc)
            trials.append((time.perf_counter() - t0) / (2 * len(ws)) * 1e3)
        layer_ms[name] = min(trials)
        print(f"{name}: {layer_ms[name]:.3f} ms per call (best of 3 passes over {len(ws)} copies), "
              f"{layer_bytes[name] / (layer_ms[name] * 1e-3) / 1e9:.1f} GB/s of weight read "
              f"(the CPU's measured read ceiling: {cpu_read / 1e9:.1f} GB/s)")
del copies
fp32_gbps = layer_bytes["fp32"] / (layer_ms["fp32"] * 1e-3) / 1e9
layer_speedup = layer_ms["fp32"] / layer_ms["int8"]
render(f"One Qwen3-0.6B-sized layer at one row: fp32's time over int8's **{layer_speedup:.2f}x** here "
       f"(int8 {'faster' if layer_speedup > 1 else 'slower'}), for "
       f"{layer_bytes['fp32'] / layer_bytes['int8']:.2f}x fewer bytes; {engine.source.name}'s whole step above "
       f"changed by {int8_speedup:.2f}x.")
check_claim("the fp32 copies were read from main memory: at no more than the read ceiling",
            fp32_gbps * 1e9 <= 1.1 * cpu_read, f"{fp32_gbps:.1f} GB/s against {cpu_read / 1e9:.1f} GB/s",
            why_it_may_not="A cache larger than the CPU reports (or one the operating system does not show) can "
                           "hold the copies; then the comparison below is between cached reads.")
check_claim(f"int8 gains more on a large layer that reads its weight from memory than on {engine.source.name}'s "
            f"whole step",
            layer_speedup > int8_speedup, f"layer {layer_speedup:.2f}x, whole step {int8_speedup:.2f}x",
            why_it_may_not="Heavy load from other processes during one of the two measurements can swap them.");

# %% [markdown]
# What int8 costs is accuracy: every weight is rounded to one of 255 levels of its row's scale (and
# where our panel GEMM does not build on a CPU, fbgemm's fallback rounds the activations too; the
# "int8 matmul path" line above says which ran here). Two measurements against the setup cell's engine: the greedy
# continuations of a fixed set of 16 prompts, 32 tokens each (how many tokens agree before the first
# difference; greedy decoding amplifies any change, since one flipped token changes all that follows),
# and, on one passage of text, the logits themselves and the loss of predicting each next token:

# %%
from minivllm.quantization.accuracy import AGREEMENT_PROMPTS, compare_greedy, int8_hf_linears, restore_hf_linears

agree = compare_greedy(llm, q_llm, AGREEMENT_PROMPTS, max_tokens=32)
print(f"greedy agreement over {agree['num_prompts']} prompts x {agree['max_tokens']} tokens: "
      f"{agree['prefix_agreement']:.1%} of tokens before the first difference, "
      f"{agree['position_agreement']:.1%} equal position by position, "
      f"{agree['identical']} of {agree['num_prompts']} continuations identical")

PASSAGE = ("Return a new list containing all items from the iterable in ascending order. A custom key "
           "function can be supplied to customize the sort order, and the reverse flag can be set to "
           "request the result in descending order.")
logits_err = None
if engine.source.checkpoint_dir is not None:  # a trained checkpoint: transformers' Qwen3 reads it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no loading bar in the output
    hf = AutoModelForCausalLM.from_pretrained(str(engine.source.checkpoint_dir), dtype=torch.float32).eval()
    ids = torch.tensor([engine.tokenizer.encode(PASSAGE)])
    with torch.inference_mode():
        ref = hf(input_ids=ids).logits.float()[0]
        int8_hf_linears(hf)  # the same int8 layers the engine uses, in transformers' model
        got = hf(input_ids=ids).logits.float()[0]
        restore_hf_linears(hf)
    nll = {name: torch.nn.functional.cross_entropy(lg[:-1], ids[0, 1:]).item() for name, lg in
           (("fp32", ref), ("int8", got))}
    diff = (got - ref).abs()
    logits_err = {"max": diff.max().item(), "rel": (diff.max() / ref.abs().max()).item(),
                  "argmax": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    print(f"{ids.shape[1]}-token passage: largest logit error {logits_err['max']:.3f} "
          f"({logits_err['rel']:.1%} of the largest |logit|), arg-max unchanged at {logits_err['argmax']:.0%} of "
          f"positions; loss {nll['fp32']:.4f} -> {nll['int8']:.4f} nats/token")
    del hf
else:
    print("random weights: no logits comparison (docs/quantization.md measures one on random:qwen3-0.6b)")

# %%
if logits_err is not None:
    render(f"On this run int8 moved the loss on the passage by **{nll['int8'] - nll['fp32']:+.4f} nats/token** "
           f"and its largest logit error was {logits_err['rel']:.1%} of the largest logit; "
           f"**{agree['identical']} of {agree['num_prompts']}** greedy continuations came out identical to {BASE}.")
check_claim("int8 changes some greedy tokens of this model", agree["position_agreement"] < 1.0,
            f"{agree['position_agreement']:.1%} of tokens equal position by position",
            why_it_may_not="A model whose top two candidates are never close keeps every token.");

# %% [markdown]
# A small change in the logits moves the loss very little, but it flips a greedy token wherever the
# model's top two candidates were nearly tied, and from that token on the continuation is a different
# text: greedy agreement is the harshest of these measures. Whether a change of that size matters is
# a question for an evaluation on the task the model serves, not for a single number.

# %% [markdown]
# ### The KV cache's bytes: `kv_cache_dtype="bfloat16"`
#
# Weights are not the only bytes a decode step reads: every sequence's keys and values, at every
# layer, are read once per step too, and at a large batch they outweigh a small model's weights.
# vLLM's `kv_cache_dtype` argument stores them in fewer bits; minivllm takes `"bfloat16"` (besides
# `"auto"`, the model's dtype). With a float32 model on a CPU that halves the KV bytes: the pool holds
# twice the tokens, and the decode kernel reads half as much, widening each value to float32 as it
# loads it (exactly: a bfloat16 is the top half of a float32's bits). The price is precision: each key
# and value is rounded to bfloat16 once, when it is written, so the logits move by about bfloat16's
# precision and a greedy token can flip where the top two candidates were close, as with int8 weights
# above. (On a GPU the model runs in bfloat16 by default, so there the two settings are the same.)
#
# Two engines take the same 32 requests (128-token prompts, 40 new tokens each); their steps are
# interleaved one by one, so that a slow moment of the machine hits both, and each pair of
# neighbouring steps gives one ratio: their spread says how much of a difference is noise.

# %%
KV_BATCH, KV_PROMPT, KV_NEW = 32, 128, 40
kv_llms = {kv: LLM(MODEL, device=DEVICE, kv_cache_dtype=kv, max_num_seqs=KV_BATCH) for kv in ("auto", "bfloat16")}
for kv, kv_llm in kv_llms.items():
    e = kv_llm.llm_engine
    print(f"kv_cache_dtype={kv!r}: the cache holds {str(e.runner.kv_cache.dtype).removeprefix('torch.')}, "
          f"{e.model_cost.kv_bytes_per_token} bytes per token; {e.config.num_kv_blocks} blocks in the pool")
vocab = kv_llms["auto"].llm_engine.source.hf_config.vocab_size
gen = torch.Generator().manual_seed(0)
kv_prompts = [torch.randint(1, vocab, (KV_PROMPT,), generator=gen).tolist() for _ in range(KV_BATCH)]
kv_step_ms = {kv: [] for kv in kv_llms}
kv_tokens = {kv: {} for kv in kv_llms}
for kv, kv_llm in kv_llms.items():
    for i, p in enumerate(kv_prompts):
        kv_llm.llm_engine.add_request(f"kv{i}", {"prompt_token_ids": p},
                                      SamplingParams(temperature=0, max_tokens=KV_NEW, ignore_eos=True))
while any(kv_llm.llm_engine.has_unfinished_requests() for kv_llm in kv_llms.values()):
    for kv, kv_llm in kv_llms.items():
        if not kv_llm.llm_engine.has_unfinished_requests():
            continue
        result = kv_llm.llm_engine.step_with_record()
        if result.record.num_prefill_tokens == 0 and result.record.num_decode_tokens == KV_BATCH:
            kv_step_ms[kv].append(result.record.wall_ms)
        for out in result.outputs:
            if out.finished:
                kv_tokens[kv][out.request_id] = out.outputs[0].token_ids
# the first decode step of a batch size records its CPU graph: leave the first two out
kv_ms = {kv: statistics.median(ms[2:]) for kv, ms in kv_step_ms.items()}
# float32 step / bfloat16 step, pair by pair (steps taken one after the other): quartiles of the ratios
kv_pairs = [a / b for a, b in zip(kv_step_ms["auto"][2:], kv_step_ms["bfloat16"][2:])]
kv_q1, kv_q2, kv_q3 = statistics.quantiles(kv_pairs, n=4)
kv_same = sum(kv_tokens["auto"][r] == kv_tokens["bfloat16"][r] for r in kv_tokens["auto"])
kv_bytes = {kv: kv_llm.llm_engine.model_cost.kv_bytes_per_token for kv, kv_llm in kv_llms.items()}
kv_auto_dtype = str(kv_llms["auto"].llm_engine.runner.kv_cache.dtype).removeprefix("torch.")
kv_provenance = chart_provenance(kv_llms["auto"])
for kv_llm in kv_llms.values():
    kv_llm.shutdown()  # both engines' memory back; what the next cell reports is kept above
print({kv: f"{len(ms) - 2} decode steps, median {kv_ms[kv]:.2f} ms" for kv, ms in kv_step_ms.items()})

# %%
kv_read_mb = {kv: KV_BATCH * (KV_PROMPT + KV_NEW / 2) * b / 1e6 for kv, b in kv_bytes.items()}
kv_verdict = ("faster with the bfloat16 cache in at least three of four pairs" if kv_q1 > 1 else
              "slower with the bfloat16 cache in at least three of four pairs" if kv_q3 < 1 else
              "no difference beyond this machine's step-to-step spread")
render(f"Decode steps of {KV_BATCH} sequences: **{kv_ms['auto']:.2f} ms** with the KV cache in "
       f"{kv_auto_dtype}, **{kv_ms['bfloat16']:.2f} ms** in bfloat16 (medians); step by step the ratio was "
       f"**{kv_q2:.2f}x** (the middle half of the {len(kv_pairs)} pairs between {kv_q1:.2f}x and {kv_q3:.2f}x): "
       f"**{kv_verdict}**, while a step's keys and values went from about {kv_read_mb['auto']:.1f} to "
       f"{kv_read_mb['bfloat16']:.1f} MB (at the average context of the run). **{kv_same} of {KV_BATCH}** greedy "
       f"continuations came out identical. ({kv_provenance}.)")
if kv_bytes["auto"] > kv_bytes["bfloat16"]:  # (a bfloat16 model, as on a GPU: the two caches are the same)
    check_claim("the bfloat16 cache holds twice the tokens in the same memory",
                kv_bytes["auto"] == 2 * kv_bytes["bfloat16"],
                f"{kv_bytes['auto']} -> {kv_bytes['bfloat16']} bytes per token")
else:
    print(f"The model runs in {kv_auto_dtype} here, so kv_cache_dtype='auto' already stores bfloat16: the two "
          "engines are the same, and their steps differ only by noise.")

# %% [markdown]
# Halving the bytes shortens a step only by the time the step spends reading them. That share is
# largest where the keys and values come from main memory and the rest of the step is small: long
# contexts, many sequences, a model whose weights are a small part of what a step reads. Where the
# whole cache fits the CPU's last-level cache, as a small model's can, the reads are fast already and
# the saving can vanish into the step-to-step spread, as the ratio's middle half shows when it
# straddles 1.

# %% [markdown]
# ## 6. Speculative decoding: several tokens per step
#
# Int8 makes each step read fewer bytes. Speculative decoding makes each step produce more tokens. A decode
# step that is bound by reading the weights (or by fixed per-step costs) costs far less than
# five steps when it processes five tokens per sequence instead of one, so if something cheap can
# **guess** the next few tokens, the model can check all the guesses in one step: it scores the last known token and the
# k drafts together, keeps the drafts up to the first one it disagrees with, and adds its own token
# after them. Greedy output is unchanged by construction, up to floating-point near-ties (the check
# below): a draft is kept only when it is the model's own arg-max; at temperature > 0 drafts are accepted by rejection sampling (Leviathan et al. 2023;
# Chen et al. 2023), which leaves the output distribution unchanged.
#
# minivllm's `ngram` method is prompt lookup decoding (Saxena, 2023), which vLLM also offers as its `ngram`
# speculative method: the draft is whatever followed an earlier occurrence of the context's last 2 to 4
# tokens. minivllm takes the latest such occurrence (vLLM's
# proposer takes the earliest one of the longest match), so the two can propose different drafts for
# the same context. It costs no model at all, and it guesses
# well exactly when the continuation repeats text already in the context: code being edited, a
# document being quoted, or, as here, a small model that falls into repeating its own lines.
#
# The workload: this prompt of four short Python functions, continued greedily for 48 tokens. The
# continuation below (from the engine without speculation) shows what the model does with it; count
# the lines it repeats.

# %%
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
OPS = [("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"), ("pow", "**"), ("floordiv", "//"),
       ("rshift", ">>")]


def repeating_prompt(i=0):
    """Four small functions (rotated through OPS by i); the model's continuation repeats lines."""
    return "".join(f"def {n}(a, b):\n    return a {op} b\n\n\n" for n, op in (OPS[(i + j) % 8] for j in range(4)))


# eager, like section 1's engine it is compared with: with graphs (section 2) the comparison would
# also measure what replaying saves on each kind of step
s_llm = LLM(MODEL, device=DEVICE, speculative_config=SPEC, num_kvcache_blocks=128, max_num_seqs=8,
            enforce_eager=True)
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
print(repeating_prompt(0) + "----- continuation -----")
cont = llm.generate([repeating_prompt(0)], GREEDY, use_tqdm=False)[0].outputs[0]
print(cont.text)


def first_repeat(ids, tokenizer):
    """(token index, text) of the first non-empty line of ``ids``' text that repeats an earlier one of its lines."""
    text = tokenizer.decode(ids)
    ends = [len(tokenizer.decode(ids[:i + 1])) for i in range(len(ids))]  # characters after each token
    seen, start = set(), 0
    for line in text.split("\n"):
        if line.strip() and line in seen:
            return next(i for i, e in enumerate(ends) if e > start), line
        seen.add(line)
        start += len(line) + 1
    return None


rep = first_repeat(cont.token_ids, llm.get_tokenizer())
print(f"----- {len(cont.token_ids)} tokens; "
      + (f"the first line that repeats an earlier one, {rep[1]!r}, starts at token {rep[0]} (counting from 0)"
         if rep else "no line repeats an earlier one") + " -----")

# %% [markdown]
# ### Exercise 2 · What does speculation buy at batch 1?
#
# With k = 4 drafts per step, a step emits between 1 and 5 tokens. Predict the **TPOT speed-up** of
# this request at batch 1: TPOT without speculation divided by TPOT with it. A way to a number: the 48
# tokens take 47 plain decode steps without speculation, each costing section 2's eager batch-1 decode
# step `t_plain` (this engine is eager too). With it, the steps before the continuation starts
# repeating itself (the last line above says at which token) find no useful drafts and stay plain; after that, each step checks 5
# tokens and, if the drafts keep matching, emits 5. A step that checks 5 tokens costs about an eager
# step of 5 rows, `t_verify ≈ t_plain + 4 × (t8 - t_plain) / 7` from section 2's eager batch-1 and
# batch-8 rows. Then speed-up ≈ 47 · t_plain / (verifying steps · t_verify + plain steps · t_plain).

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: TPOT without / TPOT with speculation at batch 1, in x (e.g. 1.8)


# %%
def spec_compare(prompts, params, rounds=5):
    """The plain and the speculative engine's request TPOT (ms; the median over the prompts, the fastest of
    `rounds` alternating rounds: load from other processes only ever slows a round), and the speculative
    run's drafts, accepted drafts, verification steps and whether every output is identical."""
    for e in (llm, s_llm):  # warm-up
        idle_engine(e)  # batch 1: nothing a click in the stepper added may join the timed runs
        e.generate(prompts[:1], params, use_tqdm=False)
    tp = {"plain": [], "spec": []}
    for _ in range(rounds):
        base_outs = llm.generate(prompts, params, use_tqdm=False)
        spec_outs = s_llm.generate(prompts, params, use_tqdm=False)
        tp["plain"].append(statistics.median(o.metrics.tpot_ms for o in base_outs))
        tp["spec"].append(statistics.median(o.metrics.tpot_ms for o in spec_outs))
    m = [o.metrics for o in spec_outs]
    drafts, accepted = sum(x.num_draft_tokens for x in m), sum(x.num_accepted_draft_tokens for x in m)
    steps = sum(x.num_spec_steps for x in m)
    # a step emits 1 + its accepted drafts, so a request of n tokens needs n - 1 - accepted decode steps
    plain_steps = sum(len(o.outputs[0].token_ids) - 1 for o in spec_outs) / len(prompts)
    return {"plain TPOT ms": min(tp["plain"]), "spec TPOT ms": min(tp["spec"]),
            "plain spread": (min(tp["plain"]), max(tp["plain"])), "spec spread": (min(tp["spec"]), max(tp["spec"])),
            "drafts": drafts, "acceptance": accepted / drafts if drafts else float("nan"),
            "tokens per verification": 1 + accepted / steps if steps else float("nan"),
            "decode steps per request": f"{plain_steps:.1f} -> {plain_steps - accepted / len(prompts):.1f}",
            "steps saved": accepted / len(prompts) / plain_steps,
            # greedy: must be equal; sampled: the draws differ with speculation (not the distribution)
            "identical": ([o.outputs[0].token_ids for o in base_outs] == [o.outputs[0].token_ids for o in spec_outs]
                          if params.temperature == 0 else "n/a (sampled)")}


b1 = spec_compare([repeating_prompt(0)], GREEDY)
b1_speedup = b1["plain TPOT ms"] / b1["spec TPOT ms"]
print(f"batch 1: TPOT {b1['plain TPOT ms']:.2f} ms -> {b1['spec TPOT ms']:.2f} ms with speculation; "
      f"acceptance {b1['acceptance']:.0%} of {b1['drafts']} drafts, {b1['tokens per verification']:.2f} tokens "
      f"per verification step; greedy output identical: {b1['identical']}")
check_prediction(my_prediction_2, b1_speedup, rel_tol=0.25, unit="x", what="the batch-1 TPOT speed-up");

# %% [markdown]
# Each verification is recorded per step too (`StepRecord.num_draft_tokens` and
# `num_accepted_draft_tokens`); here are the speculative engine's steps for the same request, with
# what each cost:

# %%
s_engine = s_llm.llm_engine
idle_engine(s_engine)  # what an interrupted run of this cell left queued would join its steps
s_engine.add_request("steps", repeating_prompt(0), GREEDY)
recs = []
while s_engine.has_unfinished_requests():
    recs.append(s_engine.step_with_record().record)
step_table = pd.DataFrame([{"step": i, "phase": r.phase, "tokens in step": r.num_tokens,
                            "drafts": r.num_draft_tokens, "accepted": r.num_accepted_draft_tokens,
                            "wall ms": round(r.wall_ms, 2)} for i, r in enumerate(recs)])
decodes = step_table[step_table.phase == "decode"]
with_drafts, plain = decodes[decodes.drafts > 0], decodes[decodes.drafts == 0]
with pd.option_context("display.max_columns", 60, "display.width", 250):
    display(step_table.set_index("step").T)
render(f"{len(recs)} steps for {GREEDY.max_tokens} new tokens (without speculation: 1 prefill + "
       f"{GREEDY.max_tokens - 1} decode steps). Decode steps that verified drafts took a median "
       f"**{with_drafts['wall ms'].median():.2f} ms** ({len(with_drafts)} steps), plain decode steps "
       f"**{plain['wall ms'].median():.2f} ms** ({len(plain)} steps). (The prefill's tokens in step are only "
       f"those not already in the prefix cache: the runs above left this prompt's full blocks there, chapter 08.)")
check_claim("a decode step that verifies 4 drafts costs less than two plain decode steps",
            with_drafts["wall ms"].median() < 2 * plain["wall ms"].median(),
            f"median {with_drafts['wall ms'].median():.2f} ms verifying, against 2 x {plain['wall ms'].median():.2f} ms "
            f"plain = {2 * plain['wall ms'].median():.2f} ms",
            why_it_may_not="On a machine where the step is bound by its arithmetic, 5 tokens cost nearly 5x.")
# the step counts and the two medians, turned into an estimate of the TPOT ratio (the worked solution's accounting)
t_plain, t_verify = plain["wall ms"].median(), with_drafts["wall ms"].median()
estimate = (GREEDY.max_tokens - 1) * t_plain / (len(with_drafts) * t_verify + len(plain) * t_plain)
render(f"Accounting from this table: {GREEDY.max_tokens - 1} plain decode steps of {t_plain:.2f} ms against "
       f"{len(with_drafts)} verifying steps of {t_verify:.2f} ms plus {len(plain)} plain ones predicts a TPOT ratio of "
       f"**{estimate:.2f}x**; the exercise measured **{b1_speedup:.2f}x** (TPOT over whole requests, the fastest of five "
       "rounds, where this table is one run of single steps).");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Count steps. Without speculation a request of `n` new tokens takes one prefill and `n - 1` plain
# decode steps. With it, some decode steps verify drafts and emit `1 + accepted` tokens each (the
# "tokens per verification" figure printed under the exercise is their mean), and the others, where
# no n-gram matched (the first tokens of the continuation are new text), are plain decodes. So
#
#     speed-up ≈ (n - 1) · t_plain / (verifying steps · t_verify + plain steps · t_plain)
#
# where `t_verify` is what a step checking 5 tokens costs. On this model a step is dominated by costs
# that do not grow with its token count (the Python around the model's calls, reading the weights
# once, the engine's bookkeeping), so `t_verify` is far less than 5 plain steps. The accounting under
# the step table puts this run's figures into the formula next to the measured ratio.
#
# `tokens per verification x t_plain / t_verify` alone is an upper bound: it is the speed-up if every
# step verified drafts. The plain steps at the start pull the real ratio well below it, so a
# prediction built from the acceptance rate alone comes out too high.
#
# </details>

# %% [markdown]
# ### Where speculation stops paying
#
# Speculation is a bet that checking k extra tokens costs almost nothing. Two things break it: a
# workload whose continuation does not repeat its context (few drafts are proposed, and those are
# mostly rejected), and a step that is no longer nearly free to widen (a larger batch: every
# sequence's drafts add rows to the step, and once the step is bound by its arithmetic, extra rows cost
# their full price). Measured here on three workloads: the same prompt at batch 1 (above), 8 such
# prompts at batch 8, and the batch-1 prompt **sampled at temperature 0.6** (seeded; nano-vllm's
# `bench.py` at commit bb823b3 samples at 0.6; see chapter 12): sampled text repeats itself less, and a draft is only accepted with the
# probability the model gives it. (A sampled request draws its random numbers differently with
# speculation, so its tokens can differ from the plain engine's even with the same seed; what rejection
# sampling keeps equal is the distribution they are drawn from. The `identical` column applies to
# greedy requests only.)

# %%
b8 = spec_compare([repeating_prompt(i) for i in range(8)], GREEDY)
SAMPLED = SamplingParams(temperature=0.6, seed=0, max_tokens=48, ignore_eos=True)
t1 = spec_compare([repeating_prompt(0)], SAMPLED)
spec_rows = pd.DataFrame({"greedy, batch 1": b1, "greedy, batch 8": b8, "T = 0.6, batch 1": t1}).T
spec_rows["speed-up"] = spec_rows["plain TPOT ms"] / spec_rows["spec TPOT ms"]
for col in ("plain spread", "spec spread"):
    spec_rows[col] = spec_rows[col].map(lambda r: f"{r[0]:.2f}-{r[1]:.2f} ms")
with pd.option_context("display.max_columns", 20, "display.width", 250, "display.precision", 2):
    display(spec_rows)
ratios = spec_rows["speed-up"].astype(float)
overlap = not (t1["spec spread"][1] < t1["plain spread"][0] or t1["plain spread"][1] < t1["spec spread"][0])
sampled = (f"{t1['drafts']} drafts were proposed and {t1['acceptance'] if t1['drafts'] else 0:.0%} of them accepted, "
           f"so the request's decode steps went {t1['decode steps per request']} ({t1['steps saved']:.0%} fewer; "
           f"greedy: {b1['steps saved']:.0%} fewer). Its TPOT ratio, {ratios['T = 0.6, batch 1']:.2f}x, "
           + ("lies within the spread of the repeats (the two engines' round TPOTs overlap): no measurable "
              "difference on this run" if overlap else "lies outside the spread of the repeats on this run"))
render(f"On this run, plain TPOT over speculative TPOT (above 1: speculation was faster): greedy at batch 1, "
       f"**{ratios['greedy, batch 1']:.2f}x**; greedy at batch 8, **{ratios['greedy, batch 8']:.2f}x** "
       f"({'less' if ratios['greedy, batch 8'] < ratios['greedy, batch 1'] else 'not less'} than at batch 1); "
       f"sampled at T = 0.6, {sampled}. (Tokens per verification step and decode steps per request are "
       "exact counts; TPOTs vary with the machine's load, see the spread columns.)");
# The batch-8 prompts also repeat less well (their acceptance column): take the steps saved out, and what is left
# is what a verification step costs against a plain step, at each batch size.
step_cost = {k: (1 / (1 - r["steps saved"])) / ratios[k] for k, r in (("greedy, batch 1", b1), ("greedy, batch 8", b8))}
render(f"The batch-8 prompts also saved fewer steps ({b8['steps saved']:.0%} against {b1['steps saved']:.0%}). With the steps "
       f"saved taken out (the TPOT ratio against the ratio of decode steps), the speculative engine's average decode step "
       f"(those that verified drafts and those that had none, together) cost **{step_cost['greedy, batch 1']:.2f}x** "
       f"a plain step at batch 1 and **{step_cost['greedy, batch 8']:.2f}x** at batch 8"
       + (": below 1x, which the same steps with drafts added to some of them cannot cost (the step table above "
          "times them one by one): on this run the TPOTs' noise is larger than the difference, so these figures say "
          "nothing about the batch." if min(step_cost.values()) < 1 else
          ": verifying drafts costs relatively more in a batch of 8, apart from the lower acceptance."
          if step_cost["greedy, batch 8"] > step_cost["greedy, batch 1"] else
          ": on this run the smaller gain at batch 8 came from its lower acceptance, not from the batch."));

# %%
check_claim("greedy outputs are identical with and without speculation",
            bool(b1["identical"] and b8["identical"]), f"batch 1: {b1['identical']}, batch 8: {b8['identical']}",
            why_it_may_not="Only a floating-point near-tie between the top two tokens, which a different step "
                           "shape can break, may flip a token.")
check_claim("speculation shortens a greedy batch-1 request's TPOT on a prompt that repeats itself",
            ratios["greedy, batch 1"] > 1, f"{ratios['greedy, batch 1']:.2f}x",
            why_it_may_not="Load from other processes during the speculative runs, or too few accepted drafts.")
check_claim("speculation gains less at batch 8 than at batch 1 on the same kind of prompt",
            ratios["greedy, batch 8"] < ratios["greedy, batch 1"],
            f"{ratios['greedy, batch 8']:.2f}x at batch 8 vs {ratios['greedy, batch 1']:.2f}x at batch 1",
            why_it_may_not="The eight prompts do not repeat equally well (compare the acceptance column), and "
                           "load from other processes can swamp a small difference.")
check_claim("sampling at T = 0.6 leaves speculation fewer accepted drafts than the greedy repeating workload",
            t1["drafts"] * (0 if t1["drafts"] == 0 else t1["acceptance"]) < b1["drafts"] * b1["acceptance"],
            f"accepted drafts: {round(t1['drafts'] * (t1['acceptance'] if t1['drafts'] else 0))} sampled vs "
            f"{round(b1['drafts'] * b1['acceptance'])} greedy",
            why_it_may_not="A model that repeats itself even when sampled can keep proposing acceptable drafts.");

# %% [markdown]
# Why the gain should shrink with the batch (the check above says whether it did here, and the sentence
# before the checks whether the batch itself, with the batch-8 prompts' lower acceptance taken out, made
# the speculative engine's steps costlier against plain ones): a verification step of 8 sequences carries up to 40 tokens instead of 8, and the larger the step, the
# less of its cost is fixed and the more grows with every token it carries. On a GPU with a real model
# the same happens once the batch is large enough for the step to become compute-bound, which is why
# vLLM V0 offered to switch speculation off above a batch size (`speculative_disable_by_batch_size`). Why sampled text gives speculation little to
# work with: the n-gram proposer has nothing to propose when the text does not repeat, a step without
# drafts is an ordinary decode, and a draft that is proposed is kept only with the probability the
# model gives it.

# %% tags=["playground"]
# Playground. Knob: K, the number of draft tokens proposed per step (vLLM's num_speculative_tokens).
# Try 1, 2, 8, 16 and watch three things: the acceptance rate (does it fall as K grows? the further
# ahead a guess, the likelier it is wrong), the tokens emitted per verification step, and the TPOT
# against the plain engine's, both the fastest of three alternating runs. On text that repeats long
# stretches, as this prompt's continuation does, long drafts can keep landing; on text that repeats
# less (try the sampled request of the cell above) the rejected drafts' cost can outweigh what the
# accepted ones save. One run of a 48-token request moves by tens of percent here: compare Ks only
# by differences larger than the spread printed.
K = 4
pg = LLM(MODEL, device=DEVICE, speculative_config={**SPEC, "num_speculative_tokens": K},
         num_kvcache_blocks=128, max_num_seqs=8, enforce_eager=True)
pg.generate([repeating_prompt(0)], GREEDY, use_tqdm=False)  # warm-up
tpot = {"plain": [], f"K={K}": []}
for _ in range(3):  # alternate, so that load from other processes falls on both
    tpot["plain"].append(llm.generate([repeating_prompt(0)], GREEDY, use_tqdm=False)[0].metrics.tpot_ms)
    out = pg.generate([repeating_prompt(0)], GREEDY, use_tqdm=False)[0]
    tpot[f"K={K}"].append(out.metrics.tpot_ms)
m = out.metrics
print(f"K={K}: TPOT {min(tpot[f'K={K}']):.2f} ms (runs {min(tpot[f'K={K}']):.2f}-{max(tpot[f'K={K}']):.2f}) against "
      f"{min(tpot['plain']):.2f} ms without speculation (runs {min(tpot['plain']):.2f}-{max(tpot['plain']):.2f}); "
      f"acceptance {m.draft_acceptance_rate or 0:.0%} of {m.num_draft_tokens} drafts, "
      f"{m.mean_accepted_length or 1:.2f} tokens per verification step")
pg.shutdown()

# %% [markdown]
# ## 7. Check yourself

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
         "The profiled steps ran eagerly, operation by operation (that engine has enforce_eager=True); a "
         "graph would replay the recorded kernels with one call (CUDA) or the recorded C calls from one C loop "
         "(CPU), without the Python around them (section 2)."],
    ),
    Question(
        "Why does minivllm (as nano-vllm) capture CUDA graphs for decode steps but not for prefill steps?",
        ["Prefill cannot run on a GPU",
         "Graphs need fixed shapes; decode has few shapes (bucketed batch sizes) and much launch overhead "
         "relative to its work, prefill has many shapes and long kernels",
         "Prefill does not use the KV cache",
         "torch.compile already removes all prefill launches"],
        1,
        ["Prefill runs on the GPU like everything else; the question is whether a graph pays.",
         "Right: a prefill of hundreds of tokens keeps each kernel busy long enough that launches are a small "
         "share, and its token count varies too much to capture every shape. (vLLM's V1 engine still captures "
         "prefill and mixed batches in pieces, the attention left out of its graphs.)",
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
    Question(
        "A bfloat16 KV cache halves the bytes of every key and value, and so doubles the tokens the same memory "
        "holds, yet the engine's default keeps the model's dtype. Why?",
        ["The bfloat16 cache makes the attention's arithmetic bfloat16, which this CPU computes slowly",
         "Each key and value is rounded once when written, so the logits move and a greedy token can flip; float32 "
         "keeps them equal to the reference implementation's",
         "A bfloat16 cache holds fewer tokens",
         "CPU graphs cannot replay a step over a bfloat16 cache"],
        1,
        ["The kernel widens each value to float32 as it loads it; the arithmetic is float32's either way.",
         "Right: the saving is bytes, the price is one rounding of K and V, visible in the greedy continuations "
         "that changed; a choice for the user to make, not a default.",
         "Half the bytes per token: twice the tokens in the same memory.",
         "The engines above both replayed CPU graphs; the C kernel and store have a bfloat16 version each."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * count the operations a decode step issues with `torch.profiler` (and on a CPU minivllm's C calls
#   with `count_calls`), time one dispatch, and say what share of a step the dispatch floor is on a
#   given machine;
# * explain what a CUDA graph removes (the host's launches), why it needs fixed shapes, and how the
#   engine buckets decode batch sizes and pads to capture them;
# * compile a chain of element-wise operations with `torch.compile`, check it against eager, and weigh
#   its seconds of compilation against what each call saves;
# * time attention implementations fairly (same inputs, warm-up, repeats, spread) and say what each
#   one's time includes (the paged backend's gather copy, the loop's per-sequence overhead);
# * switch on int8 weights (`quantization="int8"`), predict its gain from the bytes a step reads and
#   the rest of the step, and measure both its speed-up and what it changes in the model's outputs;
# * keep the KV cache in bfloat16 (`kv_cache_dtype="bfloat16"`) and weigh the bytes a decode step saves
#   against the rounding of every key and value;
# * switch on n-gram speculative decoding (`speculative_config`), read its acceptance rate and tokens
#   per verification step, and find the workload or batch where it stops paying.
#
# Next: chapter 12, benchmarks: measuring the whole engine against a peer.
