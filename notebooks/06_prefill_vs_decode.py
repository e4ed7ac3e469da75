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
# # 06 · Prefill vs Decode
#
# The same model, the same weights, and yet the first step of a request and every step after it
# cost very different amounts. The first step reads the whole prompt (**prefill**); each later
# step writes one more token of the answer (**decode**). In this chapter you drive minivllm one
# step at a time, watch what each step does to the KV cache, and **measure** on your own machine
# why the two phases behave so differently and what that means for latency.
#
# Nothing below is typed in by hand: every time, token count and utilisation figure is produced
# when you run the notebook, on the hardware you run it on.
#
# **You will:** step the engine through a request and watch the KV blocks fill · measure step time
# against prompt length for both phases · compute the arithmetic intensity of real steps and place
# them on this machine's measured roofline · compare MFU and MBU of prefill and decode · measure how
# decode throughput grows with the batch, and the weight-read floor of a decode step · measure TTFT
# and TPOT per request and turn the measurements into a latency model · see chunked prefill protect
# other requests' inter-token latency · check the usual myths about the two phases against
# measurements · test yourself.

# %% [markdown]
# ## Setup
#
# The parameters cell chooses the model: the embedded `minivllm-tiny` (a 4M-parameter Qwen3-shaped
# model that ships with the repo) unless the environment variable `MINIVLLM_MODEL` names another one
# (a Qwen3 checkpoint directory, or `random:qwen3-0.6b`). KV blocks of 16 tokens and a small pool of
# 64 blocks keep the paging visible. `BIG_MODEL` is the model of section 3, big enough that its
# weights do not fit in any CPU cache: random weights at Qwen3-0.6B's shapes (2.4 GB in fp32). `MINIVLLM_THREADS` sets torch's CPU threads (the stored outputs
# were produced with 1 thread on a CPU shared with other work).

# %% tags=["parameters"]
import os
import platform

import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
BLOCK_SIZE = 16                            # tokens per KV block
# CPU threads for torch; 0 keeps torch's default. On a machine shared with other busy
# processes, 1 avoids threads waiting on each other and makes timings far steadier.
THREADS = int(os.environ.get("MINIVLLM_THREADS", "0"))
BIG_MODEL = "random:qwen3-0.6b"            # section 3: a memory-bound model (random weights, real shapes)
if THREADS > 0:
    torch.set_num_threads(THREADS)

# %%
llm = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64,
          max_num_batched_tokens=64, max_num_seqs=8)
engine = llm.llm_engine
cfg, hf = engine.config, engine.source.hf_config
n_params = sum(p.numel() for p in engine.runner.model.parameters())
gpu = f" ({torch.cuda.get_device_name(cfg.device)})" if cfg.device.type == "cuda" else ""
print(f"machine : {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
      f"using {torch.get_num_threads()} thread(s)")
print(f"device  : {cfg.device}{gpu}")
print(f"model   : {engine.source.name}: {n_params / 1e6:.2f} M parameters, {hf.num_hidden_layers} layers, "
      f"hidden size {hf.hidden_size}, vocabulary {hf.vocab_size}")
print(f"dtype   : {cfg.dtype}; attention backend {cfg.attention_backend}; "
      f"KV pool {cfg.num_kv_blocks} blocks of {cfg.block_size} tokens; token budget per step "
      f"{cfg.max_num_batched_tokens}")

from minivllm.utils.env_report import describe

print(describe(llm))

# This machine's ceilings, measured now (a large matmul and a large copy), so the MFU / MBU
# figures below compare steps with peaks taken under the same conditions. From here on every
# StepRecord of this engine carries its FLOPs, bytes, MFU and MBU.
peaks = engine.measure_peaks(refresh=True)
print(f"peaks   : {peaks.flops_per_s / 1e9:.1f} GFLOP/s (matmul), {peaks.bytes_per_s / 1e9:.1f} GB/s (copy)")

# %% [markdown]
# ## 1. Two phases in one loop
#
# A request arrives as a list of prompt tokens. Before the model can say anything it must compute,
# in every layer, the key and value vectors of **all** those tokens and store them in the KV cache
# (chapter 03). They are all known up front, so the engine pushes them through the model together:
# each layer multiplies a tall matrix (one row per prompt token) by its weights. That is prefill,
# and it ends by sampling the first output token from the last position's logits.
#
# From then on the engine runs decode steps: one row per sequence goes through the model (the token
# sampled last), its key and value are appended to the cache, and attention reads every earlier
# key and value back. One step, one new token per sequence.
#
# Both phases read **every weight matrix once per step**. What differs is how much arithmetic each
# weight read pays for: a prefill step of 500 tokens does 500 multiply-adds per weight, a decode
# step of one sequence does one. Arithmetic per byte moved (the *arithmetic intensity*) is what
# decides whether a step waits on the arithmetic units or on memory.
#
# Here is one request run by hand through `LLMEngine.step()`, greedy, with the step records the
# engine produces:

# %%
# NBVAL_CHECK_OUTPUT
PROMPT = 'Return a new list containing all items from the iterable in ascending order. A custom key function can be supplied to customize the sort order.'
tok = llm.get_tokenizer()
print(f"prompt: {len(tok.encode(PROMPT))} tokens -> {-(-len(tok.encode(PROMPT)) // BLOCK_SIZE)} KV blocks of {BLOCK_SIZE}")
engine.add_request("by-hand", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
n = 0
while engine.has_unfinished_requests():
    result = engine.step_with_record()
    r = result.record
    new = result.outputs[0].outputs[0].token_ids[-1] if result.outputs else None
    print(f"step {n}: {r.phase:7s} tokens in the forward pass {r.num_tokens:3d}   "
          f"KV blocks in use after it {r.kv_blocks_used}   sampled token {new}")
    n += 1
final = result.outputs[0]
print("generated:", final.outputs[0].token_ids, repr(final.outputs[0].text))

# %% [markdown]
# One prefill step carried the whole prompt; each decode step carried a single token. The block
# count goes up when the sequence crosses a multiple of 16 tokens, and drops to zero when the
# request finishes and its blocks return to the pool (they stay in the prefix cache, reusable,
# until something else needs the space: chapter 08).
#
# ### Step it yourself
#
# The stepper below drives the same engine. It has already added a request and run two steps (the
# prefill, then one decode). Press **Step** to run one more engine step, **Run to end** to step until
# every request finishes (**Stop** halts it between steps), **Reset** to abort everything and free
# the cache. Type a prompt (text, or token ids like `[1, 2, 3]`) and press **Add request** while
# another request is decoding: the next step is *mixed*, a prefill chunk and decodes in one forward
# pass. Under the stepper, the KV cache view shows every physical block, coloured by its owner;
# hover a block to see the tokens whose keys and values it holds.

# %%
from widgets import EngineStepper, KVCacheView

STEPPER_PROMPT = 'If the object supports len(), the length is returned; otherwise a TypeError is raised.'
stepper = EngineStepper(llm, prompt="The module provides", max_tokens=12)
kv_view = KVCacheView(llm, stepper=stepper)
stepper.add_request(STEPPER_PROMPT, max_tokens=12)
stepper.step()  # the prefill
stepper.step()  # the first decode step
stepper.display()
kv_view.display()

# %%
# NBVAL_CHECK_OUTPUT
for i, r in enumerate(stepper.steps[:2]):
    print(f"stepper step {i}: {r.phase}, {r.num_prefill_tokens} prefill + {r.num_decode_tokens} decode tokens, "
          f"KV blocks in use {r.kv_blocks_used}")
print("generated tokens after these steps:", stepper.generated_token_count)

# %% [markdown]
# ## 2. Measured: step time against prompt length
#
# Now a sweep. For several prompt lengths, one request is prefilled in one step and then runs three
# decode steps (four output tokens in all); each length is repeated three times and the median kept (a shared machine has
# hiccups). A separate engine instance with a larger token budget is used so the widget above keeps
# its state.

# %%
import pandas as pd

from widgets import measure_step_latency

bench = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=256,
            max_num_batched_tokens=1024, max_num_seqs=16)
PROMPT_LENS = [16, 64, 128, 256, 512]
rows = measure_step_latency(bench, PROMPT_LENS, decode_steps=3, repeats=3)
df = pd.DataFrame(rows)
steps = df[df.phase.isin(["prefill", "decode"])]
table = steps.groupby(["phase", "prompt_len"])[["wall_ms", "intensity", "mfu", "mbu"]].median()
table.round(4)

# %%
import plotly.graph_objects as go

from widgets import show_figure

med = steps.groupby(["phase", "prompt_len"]).wall_ms.median()
fig = go.Figure()
for phase, colour in (("prefill", "#e4572e"), ("decode", "#f0a202")):
    pts = steps[steps.phase == phase]
    fig.add_scatter(x=pts.prompt_len, y=pts.wall_ms, mode="markers", marker=dict(color=colour, opacity=0.35),
                    name=f"{phase}: every step", showlegend=True)
    fig.add_scatter(x=med[phase].index, y=med[phase].values, mode="lines+markers",
                    line=dict(color=colour, width=3), name=f"{phase}: median")
fig.update_layout(title=f"Measured step time by phase ({engine.source.name}, {cfg.device}, {cfg.dtype})",
                  xaxis_title="prompt length (tokens)", yaxis_title="step wall time (ms)", height=380)
show_figure(fig)

# %%
longest = PROMPT_LENS[-1]
pre_ms = med["prefill"][longest]
dec_ms = med["decode"][longest]
print(f"prefill of {longest} tokens: {pre_ms:.2f} ms, i.e. {1e3 * pre_ms / longest:.1f} µs per prompt token")
print(f"one decode step after that prompt: {dec_ms:.2f} ms for one token")
print(f"per token, the prefill was {dec_ms / (pre_ms / longest):.0f}x cheaper than a decode step")
ai = table["intensity"]
print(f"arithmetic intensity: prefill of {longest} tokens {ai['prefill'][longest]:.1f} FLOP/byte, "
      f"decode {ai['decode'][longest]:.2f} FLOP/byte")
print(f"ridge point of this machine: {peaks.ridge_intensity:.1f} FLOP/byte")

# %% [markdown]
# Read the chart from left to right. The prefill line climbs with the prompt: more rows to multiply,
# more arithmetic. The decode line hardly moves: a decode step does the same work whatever came
# before it, apart from attention reading a slightly longer cache.
#
# The intensity figures come from the roofline model in `minivllm.telemetry.roofline` (FLOPs and
# bytes a step *must* do, from the model's shape), and MFU / MBU divide them by the measured step
# time and by this machine's measured peak FLOP/s and copy bandwidth. A long prefill step does on the
# order of a hundred FLOPs or more per byte moved. A decode step at batch 1 does 2 FLOPs per weight it
# reads: half a FLOP per byte in fp32 (one in bf16), a little less once the KV cache reads are counted.
# The *ridge point* printed above (peak FLOP/s divided by peak bytes/s, both measured here) is the
# intensity a step needs before arithmetic, not memory, limits it; decode sits far below it, so its
# time is set by how fast the weights stream from memory.
#
# Look for that pattern in the MFU and MBU columns of the table: prefill steps reach a sizeable share
# of the measured matmul peak while moving few bytes per FLOP; decode steps use a small fraction of the
# arithmetic, and what they do use is mostly memory traffic. Decode's MBU stays well short of 100 % on
# the embedded model because it is tiny: a step lasts a few milliseconds, fixed per-step costs (Python,
# scheduling, building input tensors) take a good part of that, and its 17 MB of weights partly fit
# in the CPU's caches. The next section repeats the measurement on a model large enough to be
# limited by memory.

# %% [markdown]
# ## 3. A memory-bound model: roofline, MFU and MBU, batching
#
# The embedded model is too small to show the memory wall: its weights sit in the CPU's caches and
# Python overhead dominates its steps. `BIG_MODEL` has the shapes of Qwen3-0.6B (28 layers, hidden
# size 1024, a 151,936-token vocabulary) with random weights: its answers are noise, but every step
# moves exactly as many bytes and does exactly as many FLOPs as the real model would. A 64 MiB KV
# pool keeps its memory footprint down to the weights.

# %%
big = LLM(BIG_MODEL, device=DEVICE, kv_cache_memory_bytes=64 << 20, max_num_seqs=16,
          max_num_batched_tokens=256)
big_engine = big.llm_engine
print(describe(big))
big_peaks = big_engine.measure_peaks()  # same device and dtype as above: the peaks measured there
cost = big_engine.model_cost            # the model's shape, as minivllm.telemetry.roofline sees it
print(f"peaks here: {big_peaks.flops_per_s / 1e9:.1f} GFLOP/s, {big_peaks.bytes_per_s / 1e9:.1f} GB/s; "
      f"ridge point {big_peaks.ridge_intensity:.1f} FLOP/byte")

# %% [markdown]
# ### Arithmetic intensity, from the model's shape
#
# A matrix multiply of `t` token rows by a `k x n` weight costs `2·t·k·n` FLOPs (a multiply and an
# add per weight per row) and must read the `k·n` weights once. So a step over `T` tokens costs about
# `2·N·T` FLOPs for `N` weights in the layers, while it reads all `N` weights whatever `T` is. The
# intensity of the weight traffic is `2·N·T / (N · bytes per weight)`: `T/2` FLOP/byte in fp32, `T` in
# bf16. Prefill of a long prompt (large `T`) is far up the intensity axis; decode at batch `B`
# (`T = B`) is at `B/2`. Attention and the KV cache traffic add a little on both sides. These are the
# figures the engine computes for every step (`minivllm.telemetry.roofline`):

# %%
# NBVAL_CHECK_OUTPUT
N = cost.matmul_params
print(f"weights in the layers' matrix multiplies N = {N:,}; LM head {cost.lm_head_params:,} "
      f"(tied to the embedding: {cost.tie_word_embeddings}); {cost.weight_bytes} bytes per weight")
print(f"FLOPs per token through the layers: 2N = {2 * N / 1e9:.3f} GFLOP")
print(f"bytes every step reads for the weights: {(cost.body_weight_bytes + cost.lm_head_bytes) / 1e9:.3f} GB "
      f"(+ {cost.kv_bytes_per_token:,} bytes of KV cache per token attended to or written)")
for T in (1, 16, 128):
    print(f"  {T:3d} tokens in a step: intensity of the weight traffic 2N*T/bytes = "
          f"{2 * N * T / (N * cost.weight_bytes):5.1f} FLOP/byte")

# %% [markdown]
# ### Measured: one workload, every step on the roofline
#
# Now the real thing, and deliberately small: for batch sizes 1, 2, 4, 8 and 16, that many requests
# of 8 random tokens each arrive together and generate 3 tokens. Each batch gives one prefill step
# (`8 x batch` prompt tokens) and two decode steps of `batch` sequences. Every step's FLOPs and bytes
# come from its `StepRecord` (`record.flops`, `record.bytes_moved`), and its MFU and MBU divide them
# by the step's wall time and this machine's peaks.

# %%
import random

from widgets.measure import random_prompt, run_requests, warm_up

warm_up(big)  # first-call costs (memory allocation) are not what we want to measure
rng = random.Random(0)
BATCHES = [1, 2, 4, 8, 16]
big_rows = []
for b in BATCHES:
    big_engine.reset_prefix_cache()
    _, records = run_requests(big, [random_prompt(big_engine, 8, rng) for _ in range(b)], 3)
    for r in records:
        big_rows.append(dict(batch=b, phase=r.phase, tokens=r.num_tokens, wall_ms=r.wall_ms,
                             flops=r.flops, bytes=r.bytes_moved, mfu=r.mfu, mbu=r.mbu))
big_df = pd.DataFrame(big_rows)
big_df["intensity"] = big_df.flops / big_df.bytes
big_df["GFLOP/s"] = big_df.flops / big_df.wall_ms / 1e6
big_df["GB/s"] = big_df.bytes / big_df.wall_ms / 1e6
big_df.round(3)

# %%
# NBVAL_CHECK_OUTPUT
# FLOPs and bytes depend only on the shapes of the steps, so this table is the same on every CPU.
shape = big_df.groupby(["phase", "batch", "tokens"])[["flops", "bytes", "intensity"]].first()
shape["GFLOP"], shape["GB"] = shape.flops / 1e9, shape.bytes / 1e9
print(shape[["GFLOP", "GB", "intensity"]].round(3).to_string())

# %%
# The roofline: attainable FLOP/s = min(peak FLOP/s, intensity x peak bytes/s), both peaks measured here.
import numpy as np

xs = np.logspace(-0.7, 2.2, 100)
roof = np.minimum(big_peaks.flops_per_s, xs * big_peaks.bytes_per_s) / 1e9
fig = go.Figure()
fig.add_scatter(x=xs, y=roof, mode="lines", line=dict(color="#333", width=2), name="measured ceilings")
fig.add_vline(x=big_peaks.ridge_intensity, line=dict(color="#999", dash="dot"))
for phase, colour in (("prefill", "#e4572e"), ("decode", "#f0a202")):
    pts = big_df[big_df.phase == phase]
    # label each batch once: prefill steps by their tokens, decode steps by their batch
    labels = [("" if dup else (f"{t} tok" if phase == "prefill" else f"B={b}"))
              for b, t, dup in zip(pts.batch, pts.tokens, pts.batch.duplicated())]
    fig.add_scatter(x=pts.intensity, y=pts["GFLOP/s"], mode="markers+text", text=labels,
                    textposition="top center" if phase == "prefill" else "bottom center",
                    marker=dict(color=colour, size=10), name=f"{phase} steps")
fig.update_layout(title=f"Roofline of {cost.num_params / 1e6:.0f} M-parameter steps on this machine "
                        f"({big_engine.config.device}, {str(big_engine.config.dtype).removeprefix('torch.')})",
                  xaxis=dict(type="log", title="arithmetic intensity (FLOP per byte moved)"),
                  yaxis=dict(type="log", title="achieved GFLOP/s"), height=420)
show_figure(fig)

# %% [markdown]
# The sloped part of the roof is the memory ceiling (a step there can go no faster than its bytes
# stream in), the flat part the compute ceiling; they meet at the ridge point (dotted). Decode steps
# sit at `B/2` FLOP/byte: at small batches they are left of the ridge, under the slope, and what
# limits them is bandwidth. Prefill steps sit at `T/2` for `T` prompt tokens: all but the shortest
# are to the right of the ridge, where only the arithmetic can limit them. The gap between a point
# and the roof is overhead and inefficiency: small matrix multiplies run below the big square matmul
# that set the peak, and a step also spends time outside them.
#
# ### MFU and MBU, prefill against decode
#
# MFU (model FLOPs utilisation) is the share of the measured peak FLOP/s a step achieved, MBU (model
# bandwidth utilisation) the share of the measured peak bandwidth. Here they are for the largest
# prefill step and for the decode steps at batch 1, the two ends of the roofline:

# %%
pre = big_df[big_df.phase == "prefill"].sort_values("tokens").iloc[-1]
dec1 = big_df[(big_df.phase == "decode") & (big_df.batch == 1)]
util = pd.DataFrame({f"prefill ({pre.tokens} tokens)": [pre.mfu, pre.mbu],
                     "decode (batch 1)": [dec1.mfu.median(), dec1.mbu.median()]},
                    index=["MFU (share of peak FLOP/s)", "MBU (share of peak bytes/s)"])
fig = go.Figure()
for name, colour in (("MFU (share of peak FLOP/s)", "#4c78a8"), ("MBU (share of peak bytes/s)", "#54a24b")):
    fig.add_bar(x=list(util.columns), y=100 * util.loc[name], name=name, marker_color=colour,
                text=[f"{100 * v:.0f} %" for v in util.loc[name]], textposition="outside")
fig.update_layout(title="Measured utilisation of one prefill step and one decode step", barmode="group",
                  yaxis=dict(title="% of this machine's measured peak", range=[0, 110]), height=360)
show_figure(fig)
(100 * util).round(1)

# %% [markdown]
# These bars are measured, step by step, on this machine: the prefill
# step's FLOPs are a large share of the matmul peak while its bandwidth share is small; the decode
# step is the other way round. Neither reaches 100 %: the peaks come from one large matmul and one
# large copy, the best case for each, and a real step is hundreds of smaller operations plus Python.
#
# ### Decode throughput against batch size
#
# Every decode step reads all the weights once, whatever the batch. If that read alone set the
# step's time, a batch of 8 would cost no more than a batch of 1 and produce 8 tokens: tokens per
# second would grow in proportion to the batch until the intensity (`B/2` here) crosses the ridge
# point and arithmetic takes over. The dashed line is that roofline prediction from the measured
# peaks alone: `B / max(FLOPs / peak FLOP/s, bytes / peak bytes/s)`. Compare it with the measured
# points below: on a CPU the real step grows with the batch well before the ridge (its ridge point is
# low, and the maths library reads weights more slowly for a few rows than for one), so the measured
# gain is smaller than the ideal one; on a GPU the flat region is much longer.

# %%
big_dec = big_df[big_df.phase == "decode"].groupby("batch").agg(wall_ms=("wall_ms", "median"), flops=("flops", "first"),
                                                            bytes=("bytes", "first"))
big_dec["tokens/s"] = big_dec.index / big_dec.wall_ms * 1e3
big_dec["roofline tokens/s"] = big_dec.index / np.maximum(big_dec.flops / big_peaks.flops_per_s, big_dec.bytes / big_peaks.bytes_per_s)
big_dec["speed-up vs batch 1"] = big_dec["tokens/s"] / big_dec["tokens/s"].iloc[0]
fig = go.Figure()
fig.add_scatter(x=big_dec.index, y=big_dec["tokens/s"], mode="lines+markers", name="measured", line=dict(color="#f0a202", width=3))
fig.add_scatter(x=big_dec.index, y=big_dec["roofline tokens/s"], mode="lines", name="roofline bound (measured peaks)",
                line=dict(color="#333", dash="dash"))
fig.add_scatter(x=big_dec.index, y=big_dec["tokens/s"].iloc[0] * big_dec.index, mode="lines", name="batch 1 x B (perfect scaling)",
                line=dict(color="#aaa", dash="dot"))
fig.update_layout(title="Decode throughput against batch size (measured)", xaxis_title="sequences in the decode step",
                  yaxis_title="output tokens per second", height=380)
show_figure(fig)
big_dec[["wall_ms", "tokens/s", "speed-up vs batch 1", "roofline tokens/s"]].round(2)

# %% [markdown]
# The step time grows far more slowly than the batch, so the tokens per second climb with it (the
# table's `speed-up vs batch 1`). Two things keep the measured line below perfect scaling (dotted):
#
# * The roofline bound (dashed) flattens once the batch's intensity, `B/2` FLOP/byte in fp32, passes
#   the ridge point. On a CPU the ridge is low (a few FLOPs per byte, printed above), so fp32 decode
#   turns compute-bound at a batch of about twice that. On a data-centre GPU the ridge is a few
#   hundred FLOPs per byte, and bf16 decode stays memory-bound up to batches in the hundreds.
# * The measured points sit under the bound, furthest at batch 2. CPU math libraries run a
#   one-row product (a matrix-vector product) on a path that streams the weights at close to full
#   bandwidth, and a few rows on a general matrix-multiply path that is much less efficient at such
#   thin shapes. The cell below measures that on weights of this model's shape: twelve matrices the
#   size of its MLP up-projection (1024 x 3072), 151 MB in all so they cannot sit in a CPU cache,
#   each multiplied once per pass as in a decode step:

# %%
import time

ws = torch.randn(12, 3072, 1024)
for n_rows in (1, 2, 4, 16):
    x = torch.randn(n_rows, 1024)
    torch.nn.functional.linear(x, ws[0])  # warm-up
    t0 = time.perf_counter()
    for _ in range(3):
        for w in ws:
            torch.nn.functional.linear(x, w)
    dt = (time.perf_counter() - t0) / 3
    print(f"{n_rows:2d} row(s) through 12 weights of 1024 x 3072: {dt * 1e3:6.2f} ms per pass -> "
          f"{ws.nbytes / dt / 1e9:5.1f} GB/s of weights read")
del ws, w

# %% [markdown]
# Even so, the conclusion does not depend on the library: on the same weights and the same memory,
# batch 16 produced several times the tokens per second of batch 1. "Decode does not scale with
# batch size" is wrong; batching is the main lever on decode throughput.
#
# ### The weight-read floor of a decode step
#
# A decode step cannot finish before its weights have streamed through the memory system once. That
# floor is the weight bytes divided by the bandwidth, here with the bandwidth measured on this
# machine, beside the measured step:

# %%
weight_bytes = cost.body_weight_bytes + cost.lm_head_bytes
floor_ms = weight_bytes / big_peaks.bytes_per_s * 1e3
compute_ms = dec1.flops.iloc[0] / big_peaks.flops_per_s * 1e3
step_ms = dec1.wall_ms.median()
print(f"weights: {weight_bytes / 1e9:.2f} GB; measured bandwidth {big_peaks.bytes_per_s / 1e9:.1f} GB/s")
print(f"weight-read floor of a decode step : {floor_ms:7.1f} ms")
print(f"compute floor of a batch-1 step    : {compute_ms:7.1f} ms")
print(f"measured decode step at batch 1    : {step_ms:7.1f} ms (the floor is {floor_ms / step_ms:.0%} of it)")
print(f"measured decode step at batch {big_dec.index[-1]:2d}   : {big_dec.wall_ms.iloc[-1]:7.1f} ms for {big_dec.index[-1]} tokens")

# %% [markdown]
# The same arithmetic works for any machine, which is why a fixed "milliseconds per output token"
# constant is never right in general: it depends on the model's bytes, the memory's speed and the
# batch. For a 7B-parameter model in fp16 (14 GB of weights) on an H100 (about 3.35 TB/s of HBM
# bandwidth on its data sheet) the floor is 14 / 3350 s, about 4 ms per decode step, shared by the
# whole batch.
#
# That is all we need from the big model; shutting it down returns its 2.4 GB.

# %%
big.shutdown()
del big, big_engine

# %% [markdown]
# ## 4. TTFT and TPOT
#
# Two latencies describe what a user of a served model feels:
#
# * **TTFT**, time to first token: from the request's arrival to its first output token. Waiting in
#   the queue plus every prefill step of its prompt.
# * **TPOT**, time per output token: the mean gap between later tokens, i.e. the decode step time of
#   whatever batch the request shares.
#
# The engine stamps every request with these times (`RequestOutput.metrics`: arrival, first
# scheduled, first token, every token, finished). Here five requests of different lengths arrive
# together at an engine of the embedded model whose step holds at most 64 tokens, so some prompts
# wait for others and prompts that do not fit in a step are split across steps:

# %%
mixed = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=128, max_num_batched_tokens=64,
            max_num_seqs=8)
me = mixed.llm_engine
rng = random.Random(6)
WORKLOAD = {"a": (24, 16), "b": (100, 4), "c": (8, 24), "d": (60, 8), "e": (40, 12)}  # id: (prompt, output tokens)
for rid, (n_prompt, n_out) in WORKLOAD.items():
    me.add_request(rid, random_prompt(me, n_prompt, rng), SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
mixed_records, finals = [], {}
while me.has_unfinished_requests():
    res = me.step_with_record()
    mixed_records.append(res.record)
    finals.update({o.request_id: o for o in res.outputs if o.finished})

# %%
# NBVAL_CHECK_OUTPUT
# Which steps each request's prompt went through, and the step that sampled its first token.
for rid, (n_prompt, n_out) in WORKLOAD.items():
    chunks = [(i, e.num_tokens) for i, r in enumerate(mixed_records) for e in r.scheduled
              if e.request_id == rid and e.is_prefill]
    first = next(i for i, r in enumerate(mixed_records) for e in r.scheduled if e.request_id == rid and e.sampled)
    print(f"request {rid}: prompt {n_prompt:3d} tokens in chunks (step, tokens) {chunks}; first token at step {first}; "
          f"{len(finals[rid].outputs[0].token_ids)} output tokens")
print(f"{len(mixed_records)} steps; mixed prefill + decode steps: {sum(r.phase == 'mixed' for r in mixed_records)}")

# %%
lat = pd.DataFrame([dict(request=rid, prompt=WORKLOAD[rid][0], output=WORKLOAD[rid][1],
                         queue_ms=m.queue_ms, ttft_ms=m.ttft_ms, tpot_ms=m.tpot_ms, e2e_ms=m.e2e_ms,
                         check_ms=m.ttft_ms + (WORKLOAD[rid][1] - 1) * m.tpot_ms)
                    for rid, m in ((rid, finals[rid].metrics) for rid in WORKLOAD)]).set_index("request")
lat.round(2)

# %% [markdown]
# Each request's TTFT is its wait plus the steps that carried its prompt, so it grows for requests
# whose prompts are long or queued behind others. TPOT is the mean gap between its later tokens:
# every decode step it shares with the others, mixed steps with a prefill chunk in them included,
# which is why it differs from request to request. The last column is `TTFT + (output - 1) x TPOT`;
# it matches the end-to-end time (`e2e_ms`) up to the moment between the last token and the
# request being marked finished.
#
# ### A latency calculator, fitted to this machine
#
# The calculator below predicts TTFT, TPOT and total time
# from a cost model **fitted to the steps you just measured** (plus a short sweep of decode steps at
# batch sizes 1 to 8): a fixed cost per step plus a cost per prefill token, and a fixed cost per
# decode step plus a cost per sequence in the batch. It replays the scheduler's policy (decodes
# first, then prompt chunks up to the token budget). Move the sliders, then press **measure this
# point** to run that exact workload on the engine and plot the measurement beside the prediction.

# %%
from widgets import LatencyCalculator, measure_decode_batch

decode_rows = measure_decode_batch(bench, batch_sizes=[1, 2, 4, 8], prompt_len=32, decode_steps=5)
calc = LatencyCalculator({engine.source.name: bench}, sweeps={engine.source.name: rows + decode_rows})
calc.prompt_slider.value, calc.response_slider.value, calc.batch_slider.value = 128, 12, 4
calc.measure()
calc.display()

# %%
m = calc.measurements[-1]
for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "total")):
    print(f"{name:5s}: predicted {m['predicted'][key]:8.2f} ms   measured {m[key]:8.2f} ms")
dec = pd.DataFrame(decode_rows).groupby("batch").wall_ms.median()
for b, ms in dec.items():
    print(f"decode batch {b}: step {ms:6.2f} ms -> {b / ms * 1e3:8.0f} tokens/s")

# %% [markdown]
# The calculator's constants are not typed in: they are fitted to this machine's steps, so on a
# GPU with a real checkpoint the same cell fits different ones. The decode lines show on the small
# model what section 3 showed on the big one: the step time grows far more slowly than the batch, so
# decode throughput grows with it (here the per-step overhead of a tiny model also gets shared).

# %% [markdown]
# ## 5. Chunked prefill
#
# A prompt longer than the step's token budget (`max_num_batched_tokens`) is split into chunks, one
# per step. The point is not the long prompt's own latency; it is everybody else's. Requests already
# decoding get their token in *every* step, mixed in with the chunk, instead of waiting for the whole
# prompt. (Chunking is a scheduler setting, `enable_chunked_prefill`; it has nothing to do with
# `enforce_eager`, which switches CUDA graphs off.) Here a request decodes while an 80-token prompt
# arrives at an engine whose budget is 32 tokens per step:

# %%
# NBVAL_CHECK_OUTPUT
small = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64, max_num_batched_tokens=32)
e = small.llm_engine
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
e.add_request("chatting", "The module provides", greedy)
e.step()  # its prefill
long_prompt = list(range(1, 81))  # 80 token ids
e.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
for i in range(5):
    r = e.step_with_record().record
    parts = ", ".join(f"{x.request_id}: {x.num_tokens} {'prefill' if x.is_prefill else 'decode'}" for x in r.scheduled)
    print(f"step {i}: {r.phase:7s} [{parts}]")
while e.has_unfinished_requests():
    e.step()
small.shutdown()

# %% [markdown]
# The 80-token prompt took three steps (31 + 31 + 18 tokens), and the decoding request got a token in
# each of them: 1 decode token plus a prefill chunk fills the 32-token budget. Without chunking the
# whole prompt runs in one long step and the decoding requests wait for it. Measured: below, three
# requests decode while a 384-token prompt arrives, once on an engine that chunks (64-token budget)
# and once on one that schedules the prompt whole. Each point is one token of a decoding request: how
# long after its previous token it came.

# %%
from widgets import ChunkedPrefillDemo

demo = ChunkedPrefillDemo.from_model(MODEL, budget=64, max_model_len=512, long_prompt_len=384,
                                     num_decoders=3, decode_tokens=20, device=DEVICE)
demo.display()

# %%
c, w = demo.results["chunked"], demo.results["whole"]
print(f"chunked: the long prompt took {c['prefill_steps']} steps; worst gap between a decoding request's tokens "
      f"{c['max_itl_ms']:.1f} ms; the long prompt's TTFT {c['long_ttft_ms']:.1f} ms")
print(f"whole  : the long prompt took {w['prefill_steps']} step;  worst gap {w['max_itl_ms']:.1f} ms; "
      f"the long prompt's TTFT {w['long_ttft_ms']:.1f} ms")

# %% [markdown]
# Chunking costs the long prompt some of its own TTFT (its chunks share steps with the decodes, and
# each chunk re-reads the weights; compare the two TTFT figures above) and buys a much smaller
# worst-case stall for everyone already streaming.
#
# ### Where the two phases part in the code
#
# The model code is the same for both phases: embeddings, the same linear layers, norms and MLPs
# run on however many token rows the step has. The phases part only inside attention. Here is the
# `forward` of our Triton backend (`minivllm/layers/attention/triton_backend.py`), printed from the
# installed package: every step first writes the new keys and values to their cache slots; a step
# made only of decodes runs the paged decode kernel (one query per sequence, reading that sequence's
# blocks through its block table); any step with a prefill chunk, mixed steps included, runs the
# prefill kernel, in which a decode is simply a query of length one.

# %%
import inspect

from minivllm.layers.attention.triton_backend import TritonAttentionBackend

print(inspect.getsource(TritonAttentionBackend.forward))
print("backend that ran this notebook's steps:", mixed_records[0].attention_backend)

# %% [markdown]
# The `torch` backend (the reference, used on CPU by default) makes the same split with plain
# PyTorch: it groups a step's sequences into decodes and prefills and runs one batched attention
# per group. Every backend is tested against it on the same inputs.
#
# ## 6. Myths, checked against measurements
#
# Explanations of prefill and decode repeat a few claims that sound right. Each one below is held
# against something measured in this notebook.
#
# **"A faster GPU always means faster generation."** It depends on which ceiling the step is under.
# The decode step of section 3 would get faster only with more bandwidth; more FLOP/s would shave at
# most its compute floor. The prefill step is the other way round:

# %%
for name, r in ((f"prefill, {pre.tokens} tokens", pre), ("decode, batch 1", dec1.iloc[0])):
    mem_ms = r.bytes / big_peaks.bytes_per_s * 1e3
    fl_ms = r.flops / big_peaks.flops_per_s * 1e3
    bound = "memory" if mem_ms > fl_ms else "compute"
    print(f"{name:20s}: memory floor {mem_ms:7.1f} ms, compute floor {fl_ms:7.1f} ms -> {bound}-bound "
          f"(measured {r.wall_ms:7.1f} ms)")

# %% [markdown]
# **"Prefill and decode use different weights."** Same weights, same code: the difference is how
# many rows go through them per step. If that were not so, decoding token by token would give
# different tokens from recomputing the whole sequence in one prefill. Check it: generate greedily,
# then for every position run a fresh one-step prefill over the prompt plus the tokens generated so
# far (prefix cache reset, so nothing is reused) and compare its token with the decode step's.

# %%
# NBVAL_CHECK_OUTPUT
check = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompt_ids = tok.encode(PROMPT)
decoded = mixed.generate([prompt_ids], check, use_tqdm=False)[0].outputs[0].token_ids
replayed = []
for k in range(len(decoded)):
    me.reset_prefix_cache()
    replayed.append(mixed.generate([prompt_ids + decoded[:k]], SamplingParams(temperature=0, max_tokens=1),
                                   use_tqdm=False)[0].outputs[0].token_ids[0])
print("decode steps       :", decoded)
print("one prefill each   :", replayed)
print("identical:", decoded == replayed)

# %% [markdown]
# **"TTFT and total response time are the same thing."** The table of section 4 already answers it:

# %%
print((lat.e2e_ms / lat.ttft_ms).round(1).rename("e2e / TTFT").to_string())


# %% [markdown]
# A request with a long answer spends most of its life after its first token; one with a long
# prompt and a short answer, before it. They are different measurements, tuned by different means
# (prefix caching and chunk size for TTFT, batching and bandwidth for TPOT).
#
# **"Chunked prefill comes with `enforce_eager=False`."** `enforce_eager` decides whether decode
# steps are replayed from captured CUDA graphs (on CUDA only); chunking is the scheduler's
# `enable_chunked_prefill`. Run the same workload (a request decoding while an 80-token prompt
# arrives, 32-token budget) under both values of `enforce_eager`, then with chunking off:

# %%
# NBVAL_CHECK_OUTPUT
def chunk_run(**engine_args):
    sub = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64, **engine_args)
    e = sub.llm_engine
    e.add_request("chatting", "The module provides", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    e.step()
    e.add_request("long", list(range(1, 81)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    recs = []
    while e.has_unfinished_requests():
        recs.append(e.step_with_record().record)
    graphs = e.runner.graph_runner is not None
    sub.shutdown()
    return recs, graphs

graph_state = {}
for args in (dict(enforce_eager=True, max_num_batched_tokens=32), dict(enforce_eager=False, max_num_batched_tokens=32),
             dict(enable_chunked_prefill=False, max_num_batched_tokens=96, max_model_len=96)):
    name = ", ".join(f"{k}={v}" for k, v in args.items())
    recs, graph_state[name] = chunk_run(**args)
    chunks = [x.num_tokens for r in recs for x in r.scheduled if x.request_id == "long" and x.is_prefill]
    print(f"{name:78s}: the 80-token prompt in chunks {chunks}; mixed steps: "
          f"{sum(r.phase == 'mixed' for r in recs)}")
mixed_example = next(r for r in recs if r.phase == "mixed")
print("a mixed step:", [(x.request_id, x.num_tokens, "prefill" if x.is_prefill else "decode") for x in mixed_example.scheduled])

# %%
for name, captured in graph_state.items():
    print(f"device {cfg.device}, {name}: decode CUDA graphs captured: {captured}")

# %% [markdown]
# `enforce_eager` changed nothing about the chunks; `enable_chunked_prefill=False` scheduled the
# prompt whole. (On a CPU no CUDA graphs are captured either way; on a GPU the second run captures
# them and the chunks are still the same.)
#
# **"Engines like nano-vllm mix prefill and decode in one batch."** Ours does, as the mixed steps
# above show: one forward pass holding a decode token and a prefill chunk. nano-vllm's scheduler
# does not: each of its steps is prefill-only or decode-only, and it chunks only the first waiting
# prompt. Mixing is what lets the decoding request above get a token in every step.
#
# **"Only faster memory or a smaller model improves decode throughput."** Section 3 measured
# another lever on the same model and the same memory:

# %%
b_max = big_dec.index[-1]
print(f"batch 1: {big_dec['tokens/s'].iloc[0]:.2f} tokens/s; batch {b_max}: {big_dec['tokens/s'].iloc[-1]:.2f} tokens/s "
      f"({big_dec['speed-up vs batch 1'].iloc[-1]:.1f}x, same weights, same memory)")

# %% [markdown]
# Batching spreads one weight read over many tokens. Two other levers are not part of minivllm, so
# they are not measured here: quantisation (fewer bytes per weight, so less to read) and speculative
# decoding (a cheap draft proposes several tokens and the model checks them in one step, several
# tokens per weight read).
#
# ## 7. Check yourself

# %%
from widgets import Quiz, Question

Quiz([
    Question(
        "A request has a 2,000-token prompt and gets a 20-token answer. What sets its time to first token?",
        ["The decode steps", "Queueing plus the prefill steps of its prompt",
         "Prefill and decode equally", "The sampler"],
        1,
        ["Decode starts only after the first token exists; it sets the pace of the tokens that follow.",
         "Right: the first token is sampled at the end of the step that finishes the prompt, so TTFT is the "
         "wait in the queue plus every prefill step (chunks included).",
         "The 20 decode steps all come after the first token; they add to the total time, not to TTFT.",
         "Sampling one token from the logits is a tiny part of any step; the chart above shows where the time goes."],
    ),
    Question(
        "While decode is memory-bound, why does a step for 8 sequences cost far less than 8 steps for one?",
        ["Decode uses a different, faster kernel for batches",
         "Each weight is read once per step, whatever the batch; 8 rows of arithmetic add little to that",
         "The KV cache is empty during decode",
         "The sequences run one after another, and each is very short"],
        1,
        ["The kernels are the same matrix multiplies; the batch just adds rows to them.",
         "Right: eight rows instead of one barely change the bytes moved, so while the step is memory-bound "
         "its time grows much less than eightfold and throughput rises (by how much on this machine: the "
         "throughput chart above).",
         "Decode reads the KV cache of every earlier token; it is the prefill that starts with it empty.",
         "They run together in one forward pass: that is what batching means here."],
    ),
    Question(
        "With chunked prefill, who benefits when a long prompt arrives?",
        ["The long prompt's own TTFT drops a lot", "Requests already decoding: a token every step",
         "Nobody; it only changes memory use", "It is what enforce_eager=False turns on"],
        1,
        ["The long prompt still needs every chunk computed before its first token, so its TTFT stays about "
         "the same (slightly longer, as it shares steps).",
         "Right: the token budget caps each step, so decodes are never stalled for a whole long prefill.",
         "The chunked run above shows the decoding request getting a token in every step; that is a latency "
         "change for it.",
         "enforce_eager switches CUDA graphs off; chunking is the scheduler's enable_chunked_prefill."],
    ),
    Question(
        "In section 3, the roofline bound on decode throughput (dashed line) stops rising between batch 8 "
        "and batch 16 on this CPU. Why there?",
        ["The KV cache ran out of blocks", "The batch's intensity (B/2 FLOP/byte in fp32) reached the ridge "
         "point, so arithmetic, not the weight read, set the step time",
         "Python overhead grows with the square of the batch", "Batching never helps decode on a CPU"],
        1,
        ["The 64 MiB pool held every sequence of that workload; no request waited or was preempted.",
         "Right: below the ridge a bigger batch rides on the same weight read; past it the step is "
         "compute-bound and more rows cost proportionally more time. On a GPU the ridge is far higher.",
         "Host overhead per sequence is small and linear; the roofline bound alone predicts the bend.",
         "The chart shows throughput several times higher at batch 16 than at batch 1."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * Prefill processes every prompt token in one pass (or one pass per chunk): high arithmetic
#   intensity, time grows with the prompt. It sets TTFT.
# * Decode produces one token per sequence per step: every weight read for a few rows of arithmetic,
#   so memory traffic and fixed overhead set its time. It sets TPOT.
# * Arithmetic intensity (FLOPs per byte) places a step on the roofline: a decode step at batch `B`
#   does about `B/2` FLOPs per byte in fp32, a prefill step of `T` tokens about `T/2`. Below the
#   measured ridge point a step is memory-bound (MBU is its figure of merit), above it compute-bound
#   (MFU).
# * A decode step can never beat its weight-read floor, weight bytes divided by bandwidth; that
#   floor, not a fixed milliseconds-per-token constant, is what to estimate for a new model or machine.
# * Batching is what makes decode efficient: one weight read serves every sequence in the step, so
#   throughput grows with the batch (several-fold from 1 to 16 sequences on this CPU) until the step
#   reaches the ridge point, which on a GPU is at batches in the hundreds.
# * TTFT is queueing plus prefill, TPOT the decode steps a request shares; the engine records both
#   per request in `RequestOutput.metrics`.
# * A cost model fitted to a handful of measured steps predicts TTFT and TPOT well enough to reason
#   with; measure the point you care about to check it.
# * Chunked prefill (`enable_chunked_prefill`, unrelated to `enforce_eager`) bounds every step's size,
#   and minivllm mixes the chunks with decodes, so a long prompt cannot freeze everyone else's stream.
#
# Next: chapter 08, prefix caching, skips prefill for tokens the cache has already seen.
