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
# # 06 · Prefill vs Decode
#
# The same model and the same weights, yet the first step of a request (**prefill**: the whole
# prompt at once) and every step after it (**decode**: one new token per sequence) cost very
# different amounts. This chapter measures why, on the machine you run it on.
#
# **Goal:** explain, with numbers measured here, why prefill is limited by arithmetic and decode by
# memory traffic, and which levers make decode produce more tokens per second.
#
# **Prerequisites:** chapter 01 (the generation loop), chapter 03 (the KV cache), chapter 05
# (batching in the scheduler); a matrix multiply as rows times a weight matrix.
#
# **Time:** about 40 minutes (reading and running; with the embedded model the cells themselves
# run in under a minute on a 2-core CPU).
#
# **Map of this chapter**
#
# 1. *An intuition first*: one matrix-vector and one matrix-matrix product, counted by hand and timed.
# 2. *Two phases in one loop*: step the engine and watch the KV blocks fill.
# 3. *Step time against prompt length* on the embedded model, with arithmetic intensity, MFU (model FLOPs
#    utilisation: the share of the machine's peak FLOP/s a step used) and MBU (model bandwidth utilisation:
#    the share of its peak memory bandwidth).
# 4. *A memory-bound model*: the roofline, a side-by-side table of the two phases, decode throughput
#    against batch size, the weight-read floor.
# 5. *Myths and the levers on decode*: batching, int8 weights and speculative decoding, each measured.
# 6. *Why it matters*.
# 7. *Check yourself*: a quiz; then a recap.
#
# Chapter 07 carries on from here with the latencies a user feels (TTFT and TPOT), a latency
# calculator fitted to this machine, and chunked prefill.
#
# **You will:** predict and then measure how much longer a product of many rows takes than a product
# of one · step the engine through a request · place real steps on this machine's measured roofline ·
# predict and measure how decode throughput grows with the batch · measure three levers on decode.

# %% [markdown]
# ## Setup
#
# The parameters cell chooses the model: the embedded `minivllm-tiny` (a Qwen3-shaped
# model that ships with the repo) unless the environment variable `MINIVLLM_MODEL` names another one
# (a Qwen3 checkpoint directory, or `random:qwen3-0.6b`). `BIG_MODEL` is the model of section 4: random
# weights at Qwen3-0.6B's shapes, too big for any CPU cache. `MINIVLLM_THREADS` sets torch's CPU
# threads (the stored outputs were produced with 1 thread on a CPU shared with other work). The prose
# describes the default, the embedded model; every figure is measured on `MODEL`, and the sentences
# rendered from the measurements name the model they ran.

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
BIG_MODEL = "random:qwen3-0.6b"            # section 4: a memory-bound model (random weights, real shapes)
if THREADS > 0:
    torch.set_num_threads(THREADS)

# %%
llm = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64,
          max_num_batched_tokens=64, max_num_seqs=8)
engine = llm.llm_engine
cfg, hf = engine.config, engine.source.hf_config
n_params = sum(p.numel() for p in engine.runner.model.parameters())
gpu = f" ({torch.cuda.get_device_name(cfg.device)})" if cfg.device.type == "cuda" else ""
DTYPE = str(cfg.dtype).removeprefix("torch.")
print(f"machine : {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
      f"using {torch.get_num_threads()} thread(s)")
print(f"device  : {cfg.device}{gpu}")
print(f"model   : {engine.source.name}: {n_params / 1e6:.2f} M parameters, {hf.num_hidden_layers} layers, "
      f"hidden size {hf.hidden_size}, vocabulary {hf.vocab_size}")
print(f"dtype   : {DTYPE}; attention backend {cfg.attention_backend}; "
      f"KV pool {cfg.num_kv_blocks} blocks of {cfg.block_size} tokens; token budget per step "
      f"{cfg.max_num_batched_tokens}")

from minivllm.utils.env_report import describe

print(describe(llm))

# This machine's ceilings: a large matmul (FLOP/s), a large copy and a large reduction (bytes/s),
# measured now. A peak measured while other processes share the machine reads low, so the
# per-machine cache keeps the best figure measured so far (this run's included), and that best is
# the ceiling used below. From here on every StepRecord of this engine carries its FLOPs, bytes,
# MFU and MBU. MBU, the roofline and every memory floor use the READ bandwidth (the reduction),
# because a decode step mostly reads (its weights); the copy figure, which counts bytes read plus
# bytes written, is printed for reference only.
now = engine.measure_peaks(refresh=True)
peaks = engine.measure_peaks()  # the cached best, this run's measurement included
BW = peaks.mbu_bytes_per_s      # the one memory ceiling used in this chapter
print(f"measured now: {now.flops_per_s / 1e9:.1f} GFLOP/s (matmul), read {now.mbu_bytes_per_s / 1e9:.1f} GB/s")
print(f"ceilings    : {peaks.flops_per_s / 1e9:.1f} GFLOP/s (matmul), read {BW / 1e9:.1f} GB/s "
      f"(copy {peaks.bytes_per_s / 1e9:.1f} GB/s, not used); ridge point {peaks.ridge_intensity:.1f} FLOP/byte; "
      f"{peaks.provenance}")
# every chart built below names what it measured
from minivllm.utils.env_report import device_name

DEVICE_NAME = f"{cfg.device} ({device_name(cfg.device)})"
WHERE = f"{DEVICE_NAME}, {DTYPE}, {torch.get_num_threads()} thread(s)"

# %% [markdown]
# ## 1. An intuition first
#
# Picture a kitchen whose recipe binder is kept in a storeroom at the far end of the building. For
# every round of cooking the cook must walk there and back with it; the walk takes the same time
# whether the round is one plate or a banquet. Cooking one plate per walk, the cook spends nearly all
# the day walking; cooking five hundred plates per walk, nearly all of it at the stove.
#
# A model's weights are the binder, memory is the corridor, and the arithmetic units are the stove.
# A **decode** step is one plate per walk (one new token per sequence); a **prefill** step is the
# banquet (every prompt token in one pass). The rest of this chapter turns that picture into counts
# and measurements.
#
# ### Counting by hand
#
# Multiply `t` rows of activations (`t × k`) by a weight matrix (`k × n`). Each output element is `k`
# multiplies and `k` adds, so the product costs `2·t·k·n` FLOPs. The weight matrix has to come from
# memory once, `k·n` numbers; the inputs and outputs add `t·k + t·n`. In fp32 (4 bytes a number):
#
# * one row (`t = 1`, a **matrix-vector** product, what decode does at batch 1): `2·k·n` FLOPs over
#   about `4·k·n` bytes, so about **0.5 FLOP per byte**;
# * `t` rows (a **matrix-matrix** product, what prefill does): `t` times the FLOPs over almost the
#   same bytes, so about **t/2 FLOP per byte**.
#
# FLOPs per byte moved is the **arithmetic intensity**. The cell counts both products for one
# weight of 4096 × 4096 in fp32 (its size is in the printout: more than a laptop CPU's caches hold,
# though a server CPU's last-level cache can keep it; the sentence under the measurement says which
# happened here).

# %%
# NBVAL_CHECK_OUTPUT
K_IN, N_OUT, BYTES = 4096, 4096, 4  # a 4096 x 4096 fp32 weight


def hand_count(t, k=K_IN, n=N_OUT, nbytes=BYTES):
    """FLOPs and bytes of a (t x k) @ (k x n) product: weights, inputs and outputs each moved once."""
    return 2 * t * k * n, nbytes * (k * n + t * k + t * n)


for t in (1, 128):
    f, b = hand_count(t)
    print(f"{t:3d} row(s): {f / 1e9:6.3f} GFLOP over {b / 2**20:5.1f} MiB -> intensity {f / b:6.2f} FLOP/byte")

# %% [markdown]
# The 128-row product does 128 times the arithmetic of the one-row product while moving only a little
# more data. How much longer will it take on this machine?
#
# ### Exercise 1 · One row against 128 rows
#
# Predict how many times longer the 128-row product takes than the one-row product (a ratio of
# times, e.g. `128` if time followed the FLOPs, `1` if it followed the bytes). The peaks printed in
# the setup cell give a first-principles estimate: the matmul FLOP/s and the read bandwidth, and
# their ratio, the **ridge point**, the intensity at which a product's compute time and its memory
# time are equal. Real products sit some way off such an estimate (the worked solution says why), so
# expect the check to show how far, not to confirm the estimate. (They are this CPU's when the engine runs on the CPU; with a GPU engine,
# these products still run on the CPU, and the next cell prints the CPU's own.)

# %%
# These products (and section 5's int8 one) run on the CPU in fp32 whatever the engine's device, so
# their ceilings are the CPU's fp32 ones: the setup cell's when the engine is an fp32 CPU engine.
if (cfg.device.type, cfg.dtype) == ("cpu", torch.float32):
    cpu_peaks = peaks
else:
    from minivllm.telemetry.peaks import get_peaks

    cpu_peaks = get_peaks(torch.device("cpu"), torch.float32)
    print(f"the CPU's fp32 peaks ({cpu_peaks.provenance}): matmul {cpu_peaks.flops_per_s / 1e9:.1f} GFLOP/s, read "
          f"{cpu_peaks.mbu_bytes_per_s / 1e9:.1f} GB/s, ridge point {cpu_peaks.ridge_intensity:.1f} FLOP/byte")
CPU_BW = cpu_peaks.mbu_bytes_per_s

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: time(128 rows) / time(1 row), a ratio (x)

# %%
import statistics
import time

W_DEMO = torch.randn(N_OUT, K_IN)


def time_rows(t, repeats=11):
    """Median, min and max wall time (s) of x @ W_DEMO.T for t rows, after one warm-up call."""
    x = torch.randn(t, K_IN)
    torch.nn.functional.linear(x, W_DEMO)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, W_DEMO)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), max(times)


import pandas as pd

rows_table = []
for t in (1, 2, 4, 16, 128):
    med_s, lo, hi = time_rows(t)  # the fastest of the 11 counts: other processes only ever add time
    f, b = hand_count(t)
    rows_table.append({"rows": t, "GFLOP": f / 1e9, "MiB moved": b / 2**20, "FLOP/byte": f / b,
                       "ms (fastest of 11)": lo * 1e3, "ms median": med_s * 1e3, "ms slowest": hi * 1e3,
                       "GFLOP/s": f / lo / 1e9, "GB/s of weights": N_OUT * K_IN * BYTES / lo / 1e9})
rows_df = pd.DataFrame(rows_table).set_index("rows")
rows_df.round(2)

# %%
from minivllm.utils.env_report import last_level_cache_bytes
from widgets import check_claim, check_prediction, idle_engine, render

LLC = last_level_cache_bytes()  # bytes of the largest cache the OS reports (None where it does not say)
t1, t128 = rows_df.loc[1, "ms (fastest of 11)"], rows_df.loc[128, "ms (fastest of 11)"]
roofline_ratio_1 = max(1.0, (128 / 2) / cpu_peaks.ridge_intensity)  # the worked solution's estimate
check_prediction(my_prediction_1, t128 / t1, rel_tol=0.5, unit="x", what="time(128 rows) / time(1 row)",
                 hint=f"The roofline estimate, (128/2) / ridge = {roofline_ratio_1:.1f}x, assumes each product "
                      "runs on its floor; the table's GFLOP/s and GB/s columns show how far each one ran from it.")
render(f"Here 128 times the arithmetic took **{t128 / t1:.1f}x** the time: the one-row product ran at "
       f"{rows_df.loc[1, 'GFLOP/s']:.1f} GFLOP/s while streaming its weights at "
       f"{rows_df.loc[1, 'GB/s of weights']:.1f} GB/s (the CPU's measured read ceiling is {CPU_BW / 1e9:.1f} GB/s); "
       f"the 128-row product reached {rows_df.loc[128, 'GFLOP/s']:.1f} GFLOP/s "
       f"({rows_df.loc[128, 'GFLOP/s'] * 1e9 / cpu_peaks.flops_per_s:.0%} of the CPU's measured fp32 matmul peak)."
       + (f" The one-row product read faster than the ceiling: this CPU's caches (the largest "
          f"{f'{LLC / 2**20:.0f} MiB' if LLC else 'of a size the OS does not report'}) kept part of the "
          f"{N_OUT * K_IN * BYTES / 2**20:.0f} MiB weight between calls, so here it was not bound by main memory, "
          "as it would be on a CPU with smaller caches (the worked solution below says what that does to the ratio)."
          if rows_df.loc[1, "GB/s of weights"] * 1e9 > 1.1 * CPU_BW else
          f" The one-row product read its {N_OUT * K_IN * BYTES / 2**20:.0f} MiB weight no faster than the ceiling: "
          "from main memory, not from this CPU's caches (the largest "
          f"{f'{LLC / 2**20:.0f} MiB' if LLC else 'of a size the OS does not report'})."));

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Each product can go no faster than the slower of two floors: its bytes divided by the read
# bandwidth, and its FLOPs divided by the peak FLOP/s. The one-row product has intensity 0.5
# FLOP/byte, far below the ridge point printed in the setup cell (peak FLOP/s over read bandwidth),
# so its floor is the memory one: about `4·k·n / bandwidth`. The 128-row product has intensity near
# 64 FLOP/byte, above the ridge, so its floor is the compute one: `2·128·k·n / peak FLOP/s`. The ratio
# of the two floors is `(128/2) / ridge`: the intensity of the big product divided by the ridge point.
# On a CPU, whose ridge is a few to a few tens of FLOP/byte, that is somewhere between a few and a few
# tens: not 128 and not 1.
#
# The measured ratio differs from that estimate because neither product sits exactly on its floor.
# The 128-row product runs below the peak FLOP/s (the table's GFLOP/s column against the peak). The
# one-row product can run either side of its memory floor: slower when the maths library streams
# a thin product slowly, faster when a large CPU cache still holds part of the weight, since the
# measured read ceiling is main memory's (compare its GB/s with the ceiling in the sentence above).
# The lesson stands either way: 128 times the arithmetic cost far less than 128 times the time,
# because the weights were read once for all 128 rows.
# </details>

# %% [markdown]
# Look down the `GB/s of weights` column. Ideally the products of a few rows (2, 4) would take as
# long as the one-row product: the same bytes, and an intensity of 1 to 2 FLOP/byte, below the ridge
# point printed in the setup cell unless that is under 2. On many
# CPUs they take longer, because the maths library runs a single row on a path built to stream the
# weights (a matrix-vector product) and a few rows on the general matrix-multiply path, which is less
# efficient at such thin shapes. Whether that happened here:

# %%
check_claim("4 rows streamed the weights more slowly than 1 row",
            rows_df.loc[4, "GB/s of weights"] < 0.8 * rows_df.loc[1, "GB/s of weights"],
            f"1 row {rows_df.loc[1, 'GB/s of weights']:.1f} GB/s, 4 rows {rows_df.loc[4, 'GB/s of weights']:.1f} GB/s",
            why_it_may_not="A maths library with a good thin-matrix path (or a GPU) runs a few rows at the speed of "
                           "one.")
render(f"And 2 rows: {rows_df.loc[2, 'GB/s of weights']:.1f} GB/s, "
       f"**{rows_df.loc[2, 'GB/s of weights'] / rows_df.loc[1, 'GB/s of weights']:.2f}x** one row's rate "
       + ("(slower too)." if rows_df.loc[2, "GB/s of weights"] < 0.8 * rows_df.loc[1, "GB/s of weights"] else
          "(not slower here: the effect, where it shows, can start at another row count)."));

# %% [markdown]
# That is a property of the maths library, not of the hardware, and the engine does not take that
# path: on a CPU its linear layers go through minivllm's own matrix multiply, the *panel GEMM*
# (`minivllm/layers/cpu_gemm.py`; its module docstring explains the layout), written so that a few rows
# stream the weights about as fast as one. Section 4 measures whether a decode step of 4 sequences costs about what a step of one
# does. Try the library's path yourself: the playground cell below times any number of rows against
# the two floors.

# %% tags=["playground"]
# Knob: ROWS, the number of activation rows multiplied by the 4096 x 4096 weight (try 1, 8, 32, 64, 512).
# Compare the measured time with the larger of the two floors, the best this machine could do. The
# intensity is about ROWS/2 in fp32, so the floors cross near ROWS = 2 x ridge point: below it the memory
# floor is the larger, above it the compute floor. On a CPU expect the measured time to sit well above both.
ROWS = 32
f, b = hand_count(ROWS)
med_s, _, _ = time_rows(ROWS, repeats=3)
mem_floor_ms, comp_floor_ms = b / CPU_BW * 1e3, f / cpu_peaks.flops_per_s * 1e3
print(f"{ROWS} rows: intensity {f / b:.1f} FLOP/byte (ridge {cpu_peaks.ridge_intensity:.1f}); memory floor "
      f"{mem_floor_ms:.2f} ms, compute floor {comp_floor_ms:.2f} ms, measured {med_s * 1e3:.2f} ms "
      f"({med_s * 1e3 / max(mem_floor_ms, comp_floor_ms):.1f}x the larger floor)")

# %% [markdown]
# ## 2. Two phases in one loop
#
# A request arrives as a list of prompt tokens. Before the model can say anything it must compute,
# in every layer, the key and value vectors of **all** those tokens and store them in the KV cache
# (chapter 03). They are all known up front, so the engine pushes them through the model together:
# each layer multiplies a tall matrix (one row per prompt token) by its weights. That is prefill, and
# it ends by sampling the first output token from the last position's logits.
#
# From then on the engine runs decode steps: one row per sequence goes through the model (the token
# sampled last), its key and value are appended to the cache, and attention reads every earlier key
# and value back. One step, one new token per sequence. Both phases read every weight matrix once per
# step; what differs is how many rows each weight read serves.
#
# Here is one request run by hand through `LLMEngine.step()`, greedy, with the step records the
# engine produces:

# %%
# NBVAL_CHECK_OUTPUT
PROMPT = 'Return a new list containing all items from the iterable in ascending order. A custom key function can be supplied to customize the sort order.'
tok = llm.get_tokenizer()
print(f"prompt: {len(tok.encode(PROMPT))} tokens -> {-(-len(tok.encode(PROMPT)) // BLOCK_SIZE)} KV blocks of {BLOCK_SIZE}")
idle_engine(engine)  # only this request in the steps (the stepper below, or an interrupted run, may leave one)
engine.reset_prefix_cache()  # run again, this cell would otherwise find its prompt's blocks cached
engine.add_request("by-hand", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
n, blocks_after = 0, []
while engine.has_unfinished_requests():
    result = engine.step_with_record()
    r = result.record
    blocks_after.append(r.kv_blocks_used)
    new = result.outputs[0].outputs[0].token_ids[-1] if result.outputs else None
    print(f"step {n}: {r.phase:7s} tokens in the forward pass {r.num_tokens:3d}   "
          f"KV blocks in use after it {r.kv_blocks_used}   sampled token {new}")
    n += 1
final = result.outputs[0]
print("generated:", final.outputs[0].token_ids, repr(final.outputs[0].text))
print("KV blocks during decode:", "rose above" if max(blocks_after) > blocks_after[0] else "stayed at",
      f"the {blocks_after[0]} of the prefill (a new block is needed after every {BLOCK_SIZE} cached tokens)")

# %% [markdown]
# One prefill step carried the whole prompt; each decode step carried a single token. The block
# count goes up only when the sequence's cached tokens cross the next multiple of the block size
# (`BLOCK_SIZE`), so a short answer may not add a block at all (the last line of the printout says
# whether this one did), and it drops to zero when the request finishes and its blocks return to the
# pool (its full blocks stay in the prefix cache, reusable, until something else needs the space; a
# partly filled last block is not cached: chapter 08).
#
# ### Step it yourself
#
# The stepper below drives the same engine. It has already added a request and run two steps (the
# prefill, then one decode; its header numbers steps as the engine does, counting every step the engine
# has run since it was built, so it shows a larger number). Press **Step** to run one more engine step, **Run to end** to step until
# every request finishes (**Stop** halts it between steps), **Reset** to abort everything and free
# the cache. Type a prompt (text, or token ids like `[1, 2, 3]`) and press **Add request** while
# another request is decoding: the next step is *mixed*, a prefill chunk and decodes in one forward
# pass. Under the stepper, the KV cache view shows every physical block, coloured by its owner;
# hover a block to see the tokens whose keys and values it holds.

# %%
from widgets import EngineStepper, KVCacheView

STEPPER_PROMPT = 'If the object supports len(), the length is returned; otherwise a TypeError is raised.'
stepper = EngineStepper(llm, prompt="The module provides", max_tokens=12)
stepper.reset()  # an idle engine and an empty prefix cache, also when this cell runs again
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
# ### Where the two phases part in the code
#
# The model code is the same for both phases: embeddings, linear layers, norms and MLPs run on
# however many token rows the step has. The phases part only inside attention. Here is the `forward`
# of our Triton backend (`minivllm/layers/attention/triton_backend.py`), printed from the installed
# package: every step first writes the new keys and values to their cache slots; a step made only of
# decodes runs the paged decode kernel (one query per sequence, reading that sequence's blocks
# through its block table); any step with a prefill chunk, mixed steps included, runs the prefill
# kernel, in which a decode is simply a query of length one.

# %%
import inspect

from minivllm.layers.attention.triton_backend import TritonAttentionBackend

print(inspect.getsource(TritonAttentionBackend.forward))
print("backend that runs this notebook's steps:", cfg.attention_backend)

# %% [markdown]
# The `torch` backend (the reference, used on CPU by default) makes the same split: it groups a step's
# sequences into decodes and prefills and runs one attention call per group, in plain PyTorch, except
# that on a CPU in float32 its decode group goes to a small C kernel that reads the paged cache in
# place, and prompts with no cached prefix to a causal C kernel over their own keys and values
# (chapter 11, section 4). Every backend is tested against the plain PyTorch path on the same inputs.
#
# ## 3. Step time against prompt length
#
# Now a sweep on this chapter's model (`MODEL`: the embedded one unless `MINIVLLM_MODEL` names another).
# For several prompt lengths, one request is prefilled in one step
# and then runs eight decode steps, of which the table keeps the last three: the first decode steps
# after a prefill run slower than the ones that follow (on a CPU the very first decode step at a batch
# size records the graph that later steps replay, and the next few after each prefill measure slower
# too, which the table leaves out rather than explains; a request spends most of its decode past them). Each length is
# repeated three times and the median kept (a shared machine has hiccups). A separate engine with a
# larger token budget is used so the widgets above keep their state. Every step's FLOPs and bytes
# come from the roofline model in `minivllm.telemetry.roofline` (what the step must compute and move,
# from the model's shape), and
# MFU / MBU divide them by the step's time and this machine's peak FLOP/s / read bandwidth: the
# ceilings of the setup cell, the best measured on this machine, not a data sheet's peak (which the
# usual definition of MFU, PaLM's, divides by), so they say how close a step came to what this CPU
# was seen to do.
#
# The bytes count each weight as the engine holds it. The embedded model's checkpoint stores its
# weights as float16; a float32 engine computes in float32, but on a CPU its linear layers keep the
# 16-bit values as they are and widen them inside the panel GEMM (section 1), so a step reads 2
# bytes per weight, not 4 (a checkpoint whose values need float32, such as a `random:` preset's, is
# read in 4). The intensities below use the bytes per weight the cell prints.

# %%
from widgets import measure_step_latency

bench = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=256,
            max_num_batched_tokens=1024, max_num_seqs=16)
bench.llm_engine.measure_peaks()  # the peaks measured above (same device and dtype)
PROMPT_LENS = [16, 64, 128, 256, 512]
df = pd.DataFrame(measure_step_latency(bench, PROMPT_LENS, decode_steps=8, repeats=3))
df["nth_decode"] = (df.phase == "decode").groupby([df.prompt_len, df.repeat]).cumsum()  # 1..8 after each prefill
steps = df[(df.phase == "prefill") | ((df.phase == "decode") & (df.nth_decode > 5))]  # each request's last 3 decodes
table = steps.groupby(["phase", "prompt_len"])[["wall_ms", "model_ms", "intensity", "mfu", "mbu"]].median()
table.round(4)

# %%
import plotly.graph_objects as go

from widgets import show_figure

med = steps.groupby(["phase", "prompt_len"]).wall_ms.median()
fig = go.Figure()
for phase, colour in (("prefill", "#e4572e"), ("decode", "#f0a202")):
    pts = steps[steps.phase == phase]
    fig.add_scatter(x=pts.prompt_len, y=pts.wall_ms, mode="markers", marker=dict(color=colour, opacity=0.35),
                    name=f"{phase}: every step kept (3 repeats)")
    fig.add_scatter(x=med[phase].index, y=med[phase].values, mode="lines+markers",
                    line=dict(color=colour, width=3), name=f"{phase}: median")
fig.update_layout(title=f"Step time by phase against prompt length<br><sup>measured: {engine.source.name}, "
                        f"{WHERE}</sup>",
                  xaxis_title="prompt length (tokens)", yaxis_title="step wall time (ms)", height=380)
show_figure(fig)

# %%
longest = PROMPT_LENS[-1]
pre_ms, dec_ms = med["prefill"][longest], med["decode"][longest]
ai = table["intensity"]
first_dec = df[(df.phase == "decode") & (df.nth_decode == 1)].wall_ms.median()
render(f"The prefill of {longest} tokens took **{pre_ms:.1f} ms**, {1e3 * pre_ms / longest:.0f} µs per prompt "
       f"token; a decode step at that context took **{dec_ms:.2f} ms** for one token, so per token the prefill was "
       + (f"**{dec_ms / (pre_ms / longest):.1f}x** cheaper" if dec_ms > pre_ms / longest else
          f"no cheaper (**{(pre_ms / longest) / dec_ms:.1f}x** a decode step's time)")
       + f". Intensity: prefill of {longest} tokens "
       f"{ai['prefill'][longest]:.1f} FLOP/byte, decode {ai['decode'][longest]:.2f} FLOP/byte, against a "
       f"ridge point of {peaks.ridge_intensity:.1f} FLOP/byte here. (The table keeps the last three of each "
       f"request's eight decode steps; the first decode step after each prefill took a median {first_dec:.2f} ms "
       f"over all lengths, the kept ones "
       f"{steps[steps.phase == 'decode'].wall_ms.median():.2f} ms.)")
pre_growth = med["prefill"][longest] / med["prefill"][PROMPT_LENS[0]]
dec_growth = med["decode"][longest] / med["decode"][PROMPT_LENS[0]]
check_claim(f"from {PROMPT_LENS[0]} to {longest} prompt tokens the prefill step grows far more than the decode step",
            pre_growth > 2 * dec_growth, f"prefill {pre_growth:.1f}x, decode {dec_growth:.2f}x")
check_claim(f"the {longest}-token prefill is above the ridge point and the decode step below it",
            ai["prefill"][longest] > peaks.ridge_intensity > ai["decode"][longest],
            f"{ai['prefill'][longest]:.1f} and {ai['decode'][longest]:.2f} FLOP/byte, ridge {peaks.ridge_intensity:.1f}",
            why_it_may_not="A device with a very high ridge point (a GPU running fp32) can leave even a long prefill "
                           "under it.");

# %% [markdown]
# The prefill line climbs with the prompt: more rows, more arithmetic. The decode line moves far less:
# a decode step does the same weight work whatever came before it; only attention reads a longer
# cache. The *ridge point* (peak FLOP/s divided by read bandwidth, both measured here) is the
# intensity a step needs before arithmetic, not memory, limits it; the checks above place the long
# prefill and the decode step on either side of it.
#
# Two details of the table deserve a closer look. First, decode's intensity can change with the
# context: every cached token adds attention FLOPs and KV bytes in a ratio of its own, which the next
# cell computes from the model's shape and compares with the weights' ratio (2 FLOPs per weight over
# the bytes the engine holds it in). Where the two ratios differ, the context moves decode's intensity
# from one towards the other; where they happen to be equal, it stays put.

# %%
cost_tiny = bench.llm_engine.model_cost
kv_flops = 4 * cost_tiny.head_dim * cost_tiny.num_heads * cost_tiny.num_layers  # QK^T and PV per cached token
kv_intensity = kv_flops / cost_tiny.kv_bytes_per_token
weights_intensity = 2 / cost_tiny.held_weight_bytes  # bytes per weight as the engine holds it
d_first, d_last = ai["decode"][PROMPT_LENS[0]], ai["decode"][longest]
same = abs(kv_intensity - weights_intensity) < 0.01 * weights_intensity
render(f"Each cached token costs a decode step {kv_flops:,} FLOPs and {cost_tiny.kv_bytes_per_token:,} bytes of KV "
       f"reads: **{kv_intensity:.2f} FLOP/byte** ({cost_tiny.num_heads} query heads share "
       f"{cost_tiny.num_kv_heads} KV heads, {cost_tiny.kv_dtype_bytes} bytes per KV value), against "
       f"**{weights_intensity:.2f}** for the weights ({cost_tiny.held_weight_bytes:g} bytes per weight as held). "
       + (f"The two are equal for this model, so the context leaves decode's intensity where it is: "
          f"{d_first:.3f} at {PROMPT_LENS[0]} tokens, {d_last:.3f} at {longest}. (With the weights held in 32 bits, "
          f"`MINIVLLM_PANELS_16BIT=0` before the engine starts, the weights' ratio halves and the context pulls "
          f"decode's intensity up towards the KV cache's.)"
          if same else
          f"So as the context grows, decode's intensity moves towards {kv_intensity:.2f}: here it went from "
          f"{d_first:.3f} at {PROMPT_LENS[0]} tokens to {d_last:.3f} at {longest} tokens."))
if same:
    check_claim("with equal FLOP/byte ratios for the weights and the KV cache, the context leaves decode's "
                "intensity within 2% of that ratio",
                abs(d_last / d_first - 1) < 0.02 and abs(d_last / kv_intensity - 1) < 0.02,
                f"{d_first:.3f} -> {d_last:.3f} FLOP/byte; weights {weights_intensity:.2f}, KV {kv_intensity:.2f}")
else:
    check_claim("decode's intensity moves from the weights' value towards the KV cache's as the context grows",
                (d_last - d_first) * (kv_intensity - weights_intensity) > 0,
                f"{d_first:.3f} -> {d_last:.3f} FLOP/byte; weights {weights_intensity:.2f}, KV {kv_intensity:.2f}")

# %% [markdown]
# Second, decode's MBU on the chapter's model (the `mbu` column; the embedded model unless
# `MINIVLLM_MODEL` names another). Two things move a small model's away from what a large model shows.
# Fixed costs per step (scheduling, building input tensors, sampling, the calls that make up the
# forward) take time whatever the weights, which pulls MBU down. And a few MB of weights (the cell
# below gives the figure) may stay in a CPU cache between steps, so the step can read them faster than main memory
# allows, which pushes MBU up (past 100 % even: MBU divides by main memory's bandwidth). Which of the
# two wins depends on the machine. The cell compares the memory floor with the step:

# %%
tiny_weight_bytes = cost_tiny.body_weight_bytes + cost_tiny.lm_head_bytes
tiny_floor_ms = tiny_weight_bytes / BW * 1e3
tiny_dec = steps[steps.phase == "decode"]
tiny_share = tiny_floor_ms / tiny_dec.wall_ms.median()
render(f"{engine.source.name}'s weights are {tiny_weight_bytes / 1e6:.1f} MB; at the measured read bandwidth they "
       f"stream in **{tiny_floor_ms:.2f} ms**, while a decode step took **{tiny_dec.wall_ms.median():.2f} ms** "
       f"(of which {tiny_dec.model_ms.median():.2f} ms in the model's forward pass), median MBU "
       f"{tiny_dec.mbu.median():.0%} (MBU also counts the step's KV reads and is each step's own bytes over its own "
       f"time, so it need not equal the weights-only share that follows). The weights' floor is {tiny_share:.0%} of "
       f"the median step: "
       + ("the forward pass took less than reading the weights from main memory would, so a CPU cache held "
          "them between steps; outside the forward pass, the engine's per-step work took "
          f"{tiny_dec.wall_ms.median() - tiny_dec.model_ms.median():.2f} ms."
          if tiny_dec.model_ms.median() < tiny_floor_ms else
          "fixed per-step work takes most of the step on this machine." if tiny_share < 0.5 else
          "from MBU alone the two effects cannot be told apart here (the weights may stream from main memory "
          "with fixed per-step work the smaller part, or come from a CPU cache with fixed work taking more; "
          "outside the forward pass alone, the engine's per-step work took "
          f"{tiny_dec.wall_ms.median() - tiny_dec.model_ms.median():.2f} ms)."));

# %% [markdown]
# To see the memory wall itself we need a model whose weights dwarf every cache and every fixed cost.
#
# ## 4. A memory-bound model: roofline, the two phases side by side, batching
#
# `BIG_MODEL` has the shapes of Qwen3-0.6B (its layers, hidden size and vocabulary are printed below)
# with random weights: its answers are noise, but every step does exactly as many FLOPs as the real
# model would, and moves as many bytes as the real model would with its weights in the dtype printed
# below (fp32 on a CPU: random values need all 32 bits, so each weight takes 4 bytes; the released bf16
# checkpoint's values would be held in 2, as the CPU linears keep a 16-bit checkpoint's values in 16
# bits). A small KV pool
# (`KV_POOL_BYTES`) keeps its footprint down to the weights.

# %%
KV_POOL_BYTES = 64 << 20  # the big model's KV pool: room for this section's short requests
if "big" in globals():  # run again: free the last run's engine first (GBs at Qwen3-0.6B's shapes)
    big.shutdown()
big = LLM(BIG_MODEL, device=DEVICE, kv_cache_memory_bytes=KV_POOL_BYTES, max_num_seqs=16,
          max_num_batched_tokens=256)
big_engine = big.llm_engine
print(describe(big))
big_hf = big_engine.source.hf_config
print(f"{BIG_MODEL}: {big_hf.num_hidden_layers} layers, hidden size {big_hf.hidden_size}, a {big_hf.vocab_size:,}-token vocabulary")
big_engine.peaks = big_peaks = peaks   # the ceilings measured in the setup cell (same device, dtype, threads)
cost = big_engine.model_cost            # the model's shape, as minivllm.telemetry.roofline sees it
BIG_DTYPE = str(big_engine.config.dtype).removeprefix("torch.")
BIG_NAME, BIG_ON_CUDA = big_engine.source.name, big_engine.config.device.type == "cuda"  # for after its shutdown

# %% [markdown]
# ### Arithmetic intensity, from the model's shape
#
# Section 1's count, applied to a whole model: a step over `T` tokens costs about `2·N·T` FLOPs for
# `N` weights in the layers' matrix multiplies, and reads all `N` weights whatever `T` is. The
# intensity of the weight traffic is `2·N·T / (N · bytes per weight)`: `T/2` FLOP/byte in fp32, `T` in
# bf16. Prefill of a long prompt (large `T`) is far up the intensity axis; decode at batch `B`
# (`T = B`) is at `B/2` in fp32. At this section's short contexts (4 to 8 tokens) attention and the
# KV cache add only a little on both sides; at long contexts they do not, as the GPU cell below
# computes.

# %%
# NBVAL_CHECK_OUTPUT
N = cost.matmul_params
print(f"weights in the layers' matrix multiplies N = {N:,}; LM head {cost.lm_head_params:,} "
      f"(tied to the embedding: {cost.tie_word_embeddings}); {cost.held_weight_bytes:g} bytes per weight")
print(f"FLOPs per token through the layers: 2N = {2 * N / 1e9:.3f} GFLOP")
print(f"bytes every step reads for the weights: {(cost.body_weight_bytes + cost.lm_head_bytes) / 1e9:.3f} GB "
      f"(+ {cost.kv_bytes_per_token:,} bytes of KV cache per token attended to or written)")
for T in (1, 16, 128):
    print(f"  {T:3d} tokens in a step: intensity of the weight traffic 2N*T/bytes = "
          f"{2 * N * T / (N * cost.held_weight_bytes):5.1f} FLOP/byte")

# %% [markdown]
# ### Exercise 2 · Decode throughput at batch 16
#
# The next cell runs, for batch sizes 1, 2, 4, 8 and 16, that many requests of 4 random tokens
# arriving together, each generating 6 tokens: one prefill step and five decode steps per batch. The
# first decode step at each batch size is set aside: at a batch size the engine has not decoded before,
# that step records a graph (chapter 11; batch 1's was recorded by the warm-up request).
# Predict the decode throughput (output tokens per second) at batch 16 as a multiple of batch 1.
# Think about the intensity of a decode step, about `B/2` with fp32 weights (`B` with 16-bit ones: 2
# FLOPs per weight per sequence over the weight's bytes), and where it meets this machine's ridge point.
# That gives the ideal speed-up (the roofline's); the engine's steps fall short of it by a margin the
# worked solution explains, so the check shows how far your estimate lands from the measurement.

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: decode tokens/s at batch 16 / tokens/s at batch 1 (x)

# %%
import random

from widgets.measure import random_prompt, run_requests, warm_up

if big_engine.is_shut_down:  # the end of section 4 frees it: a learner back here after running the whole notebook
    raise RuntimeError("the big model was shut down at the end of section 4: run the cell that builds it "
                       "(big = LLM(BIG_MODEL, ...), at the start of section 4) again, then this one")
warm_up(big)  # first-call costs (memory allocation) are not what we want to measure
rng = random.Random(0)
BATCHES = [1, 2, 4, 8, 16]
big_rows = []
for b in BATCHES:
    big_engine.reset_prefix_cache()
    _, records = run_requests(big, [random_prompt(big_engine, 4, rng) for _ in range(b)], 6)
    # the first decode step at a new batch size records the engine's CPU graph for it (chapter 11; batch 1's
    # was recorded by warm_up): set aside at every size, so each keeps four replayed decode steps
    first_decode = next((r for r in records if r.phase == "decode"), None)
    for r in (r for r in records if r is not first_decode):
        big_rows.append(dict(batch=b, phase=r.phase, tokens=r.num_tokens, wall_ms=r.wall_ms, model_ms=r.model_ms,
                             sample_ms=r.sample_ms,
                             flops=r.flops, bytes=r.bytes_moved, mfu=r.mfu, mbu=r.mbu))
big_df = pd.DataFrame(big_rows)
big_df["intensity"] = big_df.flops / big_df.bytes
big_df["GFLOP/s"] = big_df.flops / big_df.wall_ms / 1e6
big_df["GB/s"] = big_df.bytes / big_df.wall_ms / 1e6
# one line per batch size and phase (medians over its kept steps); big_df keeps every step for the cells below
big_df.groupby(["phase", "batch"]).agg(steps=("wall_ms", "size"), tokens=("tokens", "first"),
                                       wall_ms=("wall_ms", "median"), mfu=("mfu", "median"),
                                       mbu=("mbu", "median")).round(3)

# %%
# NBVAL_CHECK_OUTPUT
# FLOPs and bytes depend only on the shapes of the steps, so this table is the same on every CPU.
shape = big_df.groupby(["phase", "batch", "tokens"])[["flops", "bytes", "intensity"]].first()
shape["GFLOP"], shape["GB"] = shape.flops / 1e9, shape.bytes / 1e9
print(shape[["GFLOP", "GB", "intensity"]].round(3).to_string())

# %%
# The roofline: attainable FLOP/s = min(peak FLOP/s, intensity x read bandwidth), both measured here.
import numpy as np

xs = np.logspace(-0.7, 2.2, 100)
roof = np.minimum(big_peaks.flops_per_s, xs * big_peaks.mbu_bytes_per_s) / 1e9
fig = go.Figure()
fig.add_scatter(x=xs, y=roof, mode="lines", line=dict(color="#333", width=2),
                name="measured ceilings (matmul peak, read bandwidth)")
fig.add_vline(x=big_peaks.ridge_intensity, line=dict(color="#999", dash="dot"))
fig.add_annotation(x=np.log10(big_peaks.ridge_intensity), xref="x", y=0.02, yref="paper", xanchor="left",
                   showarrow=False, text=f" ridge point {big_peaks.ridge_intensity:.1f} FLOP/byte")
for phase, colour in (("prefill", "#e4572e"), ("decode", "#f0a202")):
    pts = big_df[big_df.phase == phase]
    # label each batch once: prefill steps by their tokens, decode steps by their batch
    labels = [("" if dup else (f"{b}×{t // b} tok" if phase == "prefill" else f"B={b}"))
              for b, t, dup in zip(pts.batch, pts.tokens, pts.batch.duplicated())]
    fig.add_scatter(x=pts.intensity, y=pts["GFLOP/s"], mode="markers+text", text=labels,
                    # a prefill of b x 4 tokens (intensity ~2b) sits below and right of the decode steps of batch
                    # 2b-4b: prefill labels go further down and right, decode labels up and left
                    textposition="bottom right" if phase == "prefill" else "top left",
                    marker=dict(color=colour, size=10), name=f"{phase} steps")
fig.update_layout(title=f"Roofline: every step of the batch sweep<br><sup>measured: {BIG_NAME} "
                        f"({cost.num_params / 1e6:.0f} M parameters), {DEVICE_NAME}, {BIG_DTYPE}, "
                        f"{torch.get_num_threads()} thread(s)</sup>",
                  xaxis=dict(type="log", title="arithmetic intensity (FLOP per byte moved, log scale)",
                             range=[np.log10(xs[0]), np.log10(xs[-1])]),
                  yaxis=dict(type="log", title="achieved GFLOP/s (log scale)"), height=480,
                  legend=dict(orientation="h", y=-0.22))
show_figure(fig)

# %% [markdown]
# The sloped part of the roof is the memory ceiling (a step there can go no faster than its bytes
# stream in), the flat part the compute ceiling; they meet at the ridge point (dotted). Decode steps
# sit at about `B/2` FLOP/byte in fp32 (`B` with 16-bit weights), prefill steps somewhat below `T/2`
# (`T`) for `T` prompt tokens (the LM head
# runs only on each sequence's last token, so its weights serve fewer rows). The gap between a
# point and the roof is overhead and inefficiency: small matrix multiplies run below the big square
# matmul that set the peak, and a step also spends time outside them.
#
# ### The two phases side by side
#
# The same model, the same memory, two steps from the sweep: the largest prefill step and the decode
# steps at batch 1 (their median; the table says of how many). The steps' figures are this run's; the *floors* are the step's FLOPs
# over the matmul peak and its bytes over the read bandwidth, both the ceilings of the setup cell (the best
# measured on this machine, this run's measurement included), and the larger floor names what bounds it.

# %%
pre = big_df[big_df.phase == "prefill"].sort_values("tokens").iloc[-1]
dec1 = big_df[(big_df.phase == "decode") & (big_df.batch == 1)]
d1 = dec1.median(numeric_only=True)


def floors(row):
    return row.flops / big_peaks.flops_per_s * 1e3, row.bytes / big_peaks.mbu_bytes_per_s * 1e3


(pre_c, pre_m), (dec_c, dec_m) = floors(pre), floors(d1)
pre_bound = "compute" if pre_c > pre_m else "memory"
dec_bound = "compute" if dec_c > dec_m else "memory"
render(f"""
| measured on {BIG_NAME}, {WHERE} | prefill ({int(pre.tokens)} prompt tokens, batch {int(pre.batch)}) | decode (batch 1, median of {len(dec1)} steps) |
|---|---|---|
| rows through every weight per step | {int(pre.tokens)} | 1 |
| FLOPs per step | {pre.flops / 1e9:.1f} GFLOP | {d1.flops / 1e9:.2f} GFLOP |
| bytes per step | {pre.bytes / 1e9:.2f} GB | {d1.bytes / 1e9:.2f} GB |
| arithmetic intensity | {pre.intensity:.1f} FLOP/byte | {d1.intensity:.2f} FLOP/byte |
| compute floor / memory floor | {pre_c:.0f} ms / {pre_m:.0f} ms | {dec_c:.1f} ms / {dec_m:.1f} ms |
| bound by (larger floor) | **{pre_bound}** | **{dec_bound}** |
| measured step time | {pre.wall_ms:.0f} ms | {d1.wall_ms:.0f} ms |
| time per token produced or processed | {pre.wall_ms / pre.tokens:.1f} ms | {d1.wall_ms:.0f} ms |
| MFU (share of the matmul peak) | {pre.mfu:.1%} | {d1.mfu:.1%} |
| MBU (share of the read bandwidth) | {pre.mbu:.1%} | {d1.mbu:.1%} |
| the latency it sets (chapter 07) | time to first token (TTFT) | time per output token (TPOT) |
""")
check_claim("neither step exceeded this machine's ceilings (MFU and MBU at most 100 %)",
            max(pre.mfu, pre.mbu, d1.mfu, d1.mbu) <= 1.0,
            f"prefill MFU {pre.mfu:.1%}, decode MBU {d1.mbu:.1%}",
            why_it_may_not="A ceiling measured while the machine was busier than during the step reads low; "
                           "run the setup cell again on a quieter machine.")
check_claim("the prefill step is compute-bound and the batch-1 decode step memory-bound",
            pre_bound == "compute" and dec_bound == "memory",
            f"prefill floors {pre_c:.0f}/{pre_m:.0f} ms, decode floors {dec_c:.1f}/{dec_m:.1f} ms (compute/memory)",
            why_it_may_not="With a very short prompt or a machine whose ridge point is high, a prefill step can "
                           "stay under the memory ceiling too.");

# %% [markdown]
# Neither step is expected to reach 100 % of its own ceiling: the peaks come from one large matmul
# and one large reduction, the best case for each, and a real step is hundreds of smaller operations
# plus Python (the MFU and MBU rows say how close each came here).
#
# ### Decode throughput against batch size
#
# Every decode step reads all the weights once, whatever the batch. If that read alone set the step's
# time, a batch of 16 would cost no more than a batch of 1 and produce 16 tokens. The roofline bound
# (dashed below) is `B / max(FLOPs / peak FLOP/s, bytes / read bandwidth)`: it grows in proportion to
# the batch while the step is memory-bound, and flattens once the intensity (`B/2` in fp32, `B` with
# 16-bit weights) passes the ridge.

# %%
big_dec = big_df[big_df.phase == "decode"].groupby("batch").agg(
    wall_ms=("wall_ms", "median"), lo_ms=("wall_ms", "min"), hi_ms=("wall_ms", "max"),
    flops=("flops", "first"), bytes=("bytes", "first"), intensity=("intensity", "first"))
big_dec["tokens/s"] = big_dec.index / big_dec.wall_ms * 1e3
big_dec["roofline tokens/s"] = big_dec.index / np.maximum(big_dec.flops / big_peaks.flops_per_s,
                                                          big_dec.bytes / big_peaks.mbu_bytes_per_s)
big_dec["speed-up vs batch 1"] = big_dec["tokens/s"] / big_dec["tokens/s"].iloc[0]
big_dec["measured / bound"] = big_dec["tokens/s"] / big_dec["roofline tokens/s"]
fig = go.Figure()
fig.add_scatter(x=big_dec.index, y=big_dec["tokens/s"], mode="lines+markers", name="measured (median of 4 steps)",
                line=dict(color="#f0a202", width=3),
                error_y=dict(type="data", symmetric=False,
                             array=big_dec.index / big_dec.lo_ms * 1e3 - big_dec["tokens/s"],
                             arrayminus=big_dec["tokens/s"] - big_dec.index / big_dec.hi_ms * 1e3))
fig.add_scatter(x=big_dec.index, y=big_dec["roofline tokens/s"], mode="lines", name="roofline bound (measured peaks)",
                line=dict(color="#333", dash="dash"))
fig.add_scatter(x=big_dec.index, y=big_dec["tokens/s"].iloc[0] * big_dec.index, mode="lines",
                name="batch 1 x B (perfect scaling)", line=dict(color="#aaa", dash="dot"))
fig.update_layout(title=f"Decode throughput against batch size<br><sup>measured: {BIG_NAME}, "
                        f"{DEVICE_NAME}, {BIG_DTYPE}, {torch.get_num_threads()} thread(s); bars: "
                        f"fastest and slowest step</sup>",
                  xaxis_title="sequences in the decode step (batch)", yaxis_title="output tokens per second",
                  height=400)
show_figure(fig)
big_dec[["wall_ms", "tokens/s", "speed-up vs batch 1", "roofline tokens/s", "measured / bound"]].round(2)

# %%
b_max = big_dec.index[-1]
speedup = big_dec["speed-up vs batch 1"].iloc[-1]
ideal_2 = big_dec["roofline tokens/s"].iloc[-1] / big_dec["roofline tokens/s"].iloc[0]
check_prediction(my_prediction_2, speedup, rel_tol=0.3, unit="x", what=f"decode tokens/s at batch {b_max} / batch 1",
                 hint=f"The roofline's ideal here is {ideal_2:.1f}x (the table's bound column, batch {b_max} over "
                      "batch 1); the 'measured / bound' column shows where the steps fell short of it.")
below = big_dec[big_dec.intensity < big_peaks.ridge_intensity].index
above = big_dec[big_dec.intensity >= big_peaks.ridge_intensity].index
knee = (f"between batch {below[-1]} and batch {above[0]}" if len(below) and len(above) else
        ("beyond the batches measured" if len(below) else "already at batch 1"))
worst = big_dec["measured / bound"].idxmin()
render(f"From batch 1 to batch {b_max} the decode step "
       f"{'grew' if big_dec.wall_ms.iloc[-1] > big_dec.wall_ms.iloc[0] else 'went'} from {big_dec.wall_ms.iloc[0]:.0f} ms to "
       f"{big_dec.wall_ms.iloc[-1]:.0f} ms, so throughput rose **{speedup:.1f}x** "
       f"({big_dec['tokens/s'].iloc[0]:.1f} -> {big_dec['tokens/s'].iloc[-1]:.1f} tokens/s). The roofline bound stops "
       f"growing in proportion to the batch **{knee}**, where the intensity (about "
       f"`{'B/2' if cost.held_weight_bytes == 4 else f'2B/{cost.held_weight_bytes:g}'}` with "
       f"{cost.held_weight_bytes:g}-byte weights) crosses the ridge point "
       f"({big_peaks.ridge_intensity:.1f} FLOP/byte). The measured points sit furthest below the bound at "
       f"**batch {worst}** ({big_dec.loc[worst, 'measured / bound']:.0%} of it).")
check_claim(f"decode at batch {b_max} produces more tokens per second than at batch 1 on the same weights and memory",
            speedup > 1, f"{speedup:.2f}x")
# fastest steps: a single step slowed by another process says nothing about the matmul path
check_claim("the engine's fastest decode step at batch 4 took less than 1.5x its fastest at batch 1 (section 1's "
            f"library path took {rows_df.loc[1, 'GB/s of weights'] / rows_df.loc[4, 'GB/s of weights']:.1f}x as long "
            "per weight read at 4 rows as at 1)",
            big_dec.lo_ms.loc[4] < 1.5 * big_dec.lo_ms.loc[1],
            f"{big_dec.lo_ms.loc[4]:.0f} vs {big_dec.lo_ms.loc[1]:.0f} ms",
            why_it_may_not="Without the native panel GEMM (no C compiler at first use) the engine falls back to "
                           "oneDNN or torch's own matmul; a busy machine can also slow every step of one size.");
# the forward's share of a step; on CUDA model_ms is the launches only and the wait for the GPU lands in
# sample_ms (StepRecord), so there the two count together
big_df["forward_ms"] = big_df.model_ms + (big_df.sample_ms if BIG_ON_CUDA else 0)
model_share = big_df[big_df.phase == "decode"].groupby("batch").apply(lambda g: (g.forward_ms / g.wall_ms).median())
share_text = (f"{model_share.min():.1%}" if f"{model_share.min():.1%}" == f"{model_share.max():.1%}" else
              f"{model_share.min():.1%}-{model_share.max():.1%}")
render(f"The forward pass took **{share_text}** of a decode step's wall time "
       f"across these batch sizes (medians): the rest of the engine (scheduling, input building, sampling, "
       + ("outputs) is a small share here, so the shortfall below the bound lies in the forward pass: its matrix "
          "multiplies, and the weight read itself where the machine delivered less bandwidth during these steps than "
          "the ceiling the bound uses (the floor cell at the end of this section sets the two figures side by side)."
          if model_share.min() > 0.8 else "outputs) takes the rest, part of the shortfall below the bound."));

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# A decode step at batch `B` reads the same weights (the bytes printed by the intensity cell above)
# whatever `B` is and does `B` times the arithmetic, so its intensity is about `B/2` FLOP/byte in
# fp32 (the shape table above; this paragraph assumes fp32, the CPU's dtype here: with 2-byte weights,
# as bf16 on a GPU, the intensity is about `B` and every "twice the ridge" below becomes "the ridge"). While `B/2` is below the ridge point, the memory floor sets the step's
# time and `B` tokens cost about the same as one: throughput grows almost in proportion to `B`. Once `B/2` passes the ridge, the compute floor
# takes over and each extra row costs its own arithmetic, so throughput stops growing. The ideal
# bound therefore flattens at a batch of about twice the ridge point (this machine's is printed in the
# setup cell): with a ridge below 8 FLOP/byte the ideal speed-up at batch 16 is roughly `2 × ridge`,
# not 16; with a higher ridge every batch measured here is still under it, and the ideal is about 16.
#
# The measured gain differs from that ideal because each measured point sits under its bound by a
# different margin (the `measured / bound` column). The bound takes the arithmetic to run at the
# peak FLOP/s that one large square matmul set; the step's matrix multiplies have only `B` rows, and
# such thin products run well below that peak. So as `B` grows the arithmetic starts to cost time
# before the intensity reaches the ridge point: for these thin shapes the ridge is in effect lower.
# Below that, the engine's panel GEMM streams a few rows about as fast as one (the check under the
# table). The rest of the step (scheduling, sampling, attention over contexts of a few tokens) is a
# small share of it here: the sentence under the table gives the forward pass's share of the step.
# The rendered sentences and the table give this run's figures, and which points sit closest to
# their bound.
# </details>

# %% [markdown]
# On a data-centre GPU the picture is the same with a much higher ridge point, so the weight traffic
# of a bf16 decode step stays memory-bound up to batches in the hundreds. The GPU figures below are
# the vendors' data sheets, not measurements. That counts the weights only: each sequence also reads
# its own keys and values, which the batch does not share and whose FLOP/byte is fixed by the model's
# shape (section 3), so at long contexts the KV reads keep decode memory-bound at any batch. The
# second part of the cell computes it for section 4's model shape in bf16 (arithmetic from the shape,
# not a measurement):

# %%
# External figures (NVIDIA data sheets): dense bf16 tensor-core FLOP/s (without sparsity) and HBM bandwidth.
GPUS = {"H100 SXM5 (80 GB HBM3), NVIDIA H100 data sheet": (989e12, 3.35e12),
        "H200 SXM (141 GB HBM3e), NVIDIA H200 data sheet": (989e12, 4.8e12)}
WEIGHTS_7B_BF16 = 7e9 * 2  # a 7B-parameter model in bf16: 2 bytes per weight
for name, (flops, bw) in GPUS.items():
    ridge = flops / bw
    print(f"{name}: ridge point {ridge:.0f} FLOP/byte -> the weight traffic of bf16 decode (intensity ~B) is "
          f"memory-bound up to batch ~{ridge:.0f}; weight-read floor of a 7B bf16 decode step "
          f"{WEIGHTS_7B_BF16 / bw * 1e3:.1f} ms")
# Section 4's model shape in bf16 (2 bytes a weight, 2 bytes a KV value), batch 256, C cached tokens per sequence
B_GPU = 256
w_params = cost.matmul_params + cost.lm_head_params
kv_flops_tok = 4 * cost.head_dim * cost.num_heads * cost.num_layers     # QK^T and PV, per cached token
kv_bytes_tok = cost.kv_bytes_per_token // cost.kv_dtype_bytes * 2       # its keys and values in bf16
print(f"{BIG_NAME} shape in bf16, batch {B_GPU}: KV cache alone {kv_flops_tok / kv_bytes_tok:.1f} FLOP/byte")
for C in (0, 1024, 8192):
    f_step = 2 * w_params * B_GPU + B_GPU * C * kv_flops_tok
    b_step = 2 * w_params + B_GPU * C * kv_bytes_tok
    print(f"  context {C:5d} tokens: reads {b_step / 1e9:6.1f} GB a step ({B_GPU * C * kv_bytes_tok / b_step:4.0%} of "
          f"it KV), intensity {f_step / b_step:6.1f} FLOP/byte")

# %% [markdown]
# ### The weight-read floor of a decode step
#
# A decode step cannot finish before its weights have streamed through the memory system once. That
# floor is the weight bytes divided by the bandwidth, here with the read bandwidth measured on this
# machine, beside the measured step. The same arithmetic for the 7B model on the GPUs above gave a
# few milliseconds per step for the weights, a read shared by the whole batch (the KV reads come on
# top, one per sequence): a fixed "milliseconds per output token" constant is never right in general,
# because it depends on the model's bytes, the memory's speed, the batch and the contexts.

# %%
weight_bytes = cost.body_weight_bytes + cost.lm_head_bytes
floor_ms = weight_bytes / big_peaks.mbu_bytes_per_s * 1e3
step_ms = dec1.wall_ms.median()
render(f"Weights **{weight_bytes / 1e9:.2f} GB**; read-bandwidth ceiling {big_peaks.mbu_bytes_per_s / 1e9:.1f} GB/s "
       f"({big_peaks.provenance}; this run measured {now.mbu_bytes_per_s / 1e9:.1f}); "
       f"weight-read floor of a decode step **{floor_ms:.0f} ms**; compute floor at batch 1 "
       f"{dec1.flops.iloc[0] / big_peaks.flops_per_s * 1e3:.1f} ms; measured decode step at batch 1 **{step_ms:.0f} ms** "
       f"(the floor is {floor_ms / step_ms:.0%} of it; at the bandwidth this run measured, "
       f"{weight_bytes / now.mbu_bytes_per_s * 1e3:.0f} ms, {weight_bytes / now.mbu_bytes_per_s * 1e3 / step_ms:.0%}); "
       f"at batch {b_max}, {big_dec.wall_ms.iloc[-1]:.0f} ms for {b_max} tokens."
       + (" At this run's own bandwidth reading the floor is longer than the measured step, which cannot be: that "
          "reading came out low (other work on the machine while the setup cell measured it), which is why the "
          "ceiling used is the best measured on this machine."
          if weight_bytes / now.mbu_bytes_per_s * 1e3 > step_ms else ""))
check_claim("no decode step beat its weight-read floor", big_df[big_df.phase == "decode"].wall_ms.min() >= floor_ms,
            f"fastest decode step {big_df[big_df.phase == 'decode'].wall_ms.min():.0f} ms, floor {floor_ms:.0f} ms",
            why_it_may_not="A step faster than the floor would mean the bandwidth measurement read low (a busy "
                           "machine during the setup cell).");

# %% [markdown]
# That is all we need from the big model; shutting it down returns its memory.

# %%
big.shutdown()  # its weights and KV cache go back now (shutting down twice is harmless)

# %% [markdown]
# ## 5. Myths, checked against measurements
#
# Explanations of prefill and decode repeat a few claims that sound right. Each is held against
# something measured in this notebook.
#
# **"A faster GPU always means faster generation."** It depends on which ceiling a step is under.
# The side-by-side table in section 4 gave each step a compute floor and a memory floor; a step's
# roofline bound is the larger of the two, so only the resource behind that one can lower it. On
# this machine:

# %%
more = {"memory": "more bandwidth (more FLOP/s could shave at most its compute floor)",
        "compute": "more FLOP/s (more bandwidth could shave at most its memory floor)"}
_ = render(f"the batch-1 decode step is **{dec_bound}-bound** (floors {dec_c:.1f} ms compute, {dec_m:.1f} ms memory): "
           f"its roofline bound would improve only with {more[dec_bound]}. The largest prefill step "
           f"({int(pre.tokens)} prompt tokens in {int(pre.batch)} prompts) is **{pre_bound}-bound** (floors "
           f"{pre_c:.0f} ms compute, {pre_m:.0f} ms memory): only {more[pre_bound]} would lower its bound. The measured "
           "steps sit above both floors; the table's MFU and MBU rows say how far. On another machine the answer "
           "can differ: a GPU's ridge point is far higher than a CPU's, so the same short prefill can be memory-bound "
           "there.")

# %% [markdown]
# Past the ridge point, which a large enough decode batch reaches (at about twice the ridge in fp32),
# FLOP/s matters to decode too.
#
# **"Prefill and decode use different weights."** Same weights, same code: the difference is how many
# rows go through them per step. If that were not so, decoding token by token would give different
# tokens from recomputing the whole sequence in one prefill. Check it: generate greedily, then for
# every position run a fresh one-step prefill over the prompt plus the tokens generated so far (prefix
# cache reset, so nothing is reused) and compare its token with the decode step's.

# %%
# NBVAL_CHECK_OUTPUT
check = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompt_ids = tok.encode(PROMPT)
decoded = bench.generate([prompt_ids], check, use_tqdm=False)[0].outputs[0].token_ids
replayed = []
for k in range(len(decoded)):
    bench.llm_engine.reset_prefix_cache()
    replayed.append(bench.generate([prompt_ids + decoded[:k]], SamplingParams(temperature=0, max_tokens=1),
                                   use_tqdm=False)[0].outputs[0].token_ids[0])
print("decode steps       :", decoded)
print("one prefill each   :", replayed)
print("identical:", decoded == replayed)

# %% [markdown]
# **"The only way to improve decode throughput is faster memory or a smaller model."** Three levers
# can change decode throughput on the same memory and the same model; whether each pays depends on
# what bounds the step, so the next cell measures each on the chapter's model (`MODEL`), greedy, 48 new
# tokens per request, alternating the engines for three rounds and
# keeping the fastest (load from other processes only ever slows a round):
#
# * **batching**: 8 requests decoding together instead of one (one weight read serves 8 tokens);
# * **int8 weights**: `LLM(..., quantization="int8")` stores every linear layer's weights in one byte
#   (plus a scale per output channel) instead of the baseline's two or four (fewer bytes to read per
#   step; the embedded model's float16 values are held in two, and the table gives the baseline's). It
#   is not exact, so the tokens may differ: the weights are rounded (the activations stay float32:
#   `docs/quantization.md`). It shrinks only the matrix multiplies' reads, and section 3 measured how
#   the chapter's model's step compares
#   with reading its weights from main memory (weights small enough to stay in a CPU cache gain little
#   from fewer bytes), so int8 has less to gain there than on a large model; a second cell
#   times one-row products with section 1's 4096 × 4096 weight shape, in fp32 and through the engine's
#   int8 matmul (`minivllm.quantization.int8.Int8Weight`), taking at least 32 such weights in turn (and in
#   int8 at least twice the largest CPU cache the OS reports) so that each product reads its weight from
#   main memory, not from a cache that still holds it;
# * **speculative decoding**: `speculative_config={"method": "ngram", ...}` proposes up to 4 tokens by
#   looking up the latest earlier occurrence of the context's last 2 to 4 tokens, and the model checks
#   all proposals in one step (several tokens per weight read when they are accepted; greedy output
#   unchanged). It pays only where the continuation repeats the context, so its workload is one:
#   each prompt asks the model to copy a document, gives the document twice and then the start of a
#   third copy (documents from Python's built-in `pydoc_data` help topics, the workload of
#   `python -m minivllm bench --speculative ngram`).
#
# All three engines run every step eagerly (`enforce_eager=True`). By default an engine replays its
# decode steps, speculation's verification steps included, from recorded graphs (chapter 11), which on a
# CPU removes most of the Python around the model's C calls: eager, the table measures the levers, not
# how much of each step's Python the graphs remove.
# `python -m minivllm bench --speculative ngram` measures speculation against the default engine.

# %%
from minivllm.bench.speculative import repeat_prompts

LEVER_TOKENS = 48
greedy = SamplingParams(temperature=0, max_tokens=LEVER_TOKENS, ignore_eos=True)
copy_prompts = repeat_prompts(8)  # 8 different documents, each to be copied
print(repr(copy_prompts[0][:160]), "...")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# enforce_eager=True for all three: the levers alone, without the graph replay that chapter 11 measures.
# Each KV pool holds the batch-8 run (its prompts, LEVER_TOKENS new tokens, the drafts) and little more: with
# MINIVLLM_MODEL set to a 0.6B model a 16-token block takes 3.5 MiB, and three engines load at once.
lever_blocks = sum(-(-(len(tok.encode(p)) + LEVER_TOKENS + 8) // BLOCK_SIZE) for p in copy_prompts) + 8
lever_args = dict(device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=lever_blocks, max_num_seqs=8,
                  enforce_eager=True)
bench.shutdown()  # the check above was its last use: its memory goes back first (shutting down twice is harmless)
engines = {"baseline": LLM(MODEL, **lever_args), "int8": LLM(MODEL, quantization="int8", **lever_args),
           "ngram": LLM(MODEL, speculative_config=SPEC, **lever_args)}
RUNS = {"batch 1": ("baseline", copy_prompts[:1]), "batch 8": ("baseline", copy_prompts),
        "int8": ("int8", copy_prompts[:1]), "ngram": ("ngram", copy_prompts[:1])}
tpots, outs_by = {k: [] for k in RUNS}, {}
for _ in range(3):  # alternate the engines so that a change in machine load hits all of them
    for key, (name, prompts) in RUNS.items():
        outs = engines[name].generate(prompts, greedy, use_tqdm=False)
        tpots[key].append(statistics.median(o.metrics.tpot_ms for o in outs))
        outs_by[key] = outs


def first_difference(a, b):
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(a, b):
    """Tokens equal before the first difference, out of the length."""
    return f"{first_difference(a, b)}/{len(a)}" + (" (identical)" if a == b else "")


def agreement_all(name):
    """Of the 8 documents, how many came out identical to the baseline's batch-8 run, and where the others split."""
    refs = [o.outputs[0].token_ids for o in outs_by["batch 8"]]
    got = [o.outputs[0].token_ids for o in all8[name]]
    splits = sorted(first_difference(r, g) for r, g in zip(refs, got) if r != g)
    return (f"{len(refs) - len(splits)} of {len(refs)} requests identical"
            + (f"; the others first differ at token {', '.join(map(str, splits))}" if splits else ""))


ref = outs_by["batch 1"][0].outputs[0].token_ids
tps1 = 1e3 / min(tpots["batch 1"])  # the fastest round of each: a median of three was moved by two slow ones
lever_rows = [
    ("batching (8 requests)", 8e3 / min(tpots["batch 8"]), outs_by["batch 8"][0].outputs[0].token_ids),
    ("int8 weights (batch 1)", 1e3 / min(tpots["int8"]), "int8"),
    ("n-gram speculation, k=4 (batch 1)", 1e3 / min(tpots["ngram"]), "ngram"),
]
spec_m = outs_by["ngram"][0].metrics
# greedy agreement over all 8 documents (untimed): int8 and speculation against the baseline at batch 8
all8 = {name: engines[name].generate(copy_prompts, greedy, use_tqdm=False) for name in ("int8", "ngram")}
held = engines["baseline"].llm_engine.model_cost.held_weight_bytes
for e_ in engines.values():  # their memory goes back before the next cell's weights are made
    e_.shutdown()
engines.clear()  # nothing left to shut down if this cell runs again

# %%
# int8 where the weight read is the whole cost: one row times a 4096 x 4096 weight, fp32 vs int8. Weights
# taken in turn, at least 32 (512 MiB in int8, 2 GiB in fp32) and at least twice the largest cache the OS
# reports, more than a CPU cache keeps between two uses, so each product reads its weight from main memory
from minivllm.layers.prepack import linear, pack_weight
from minivllm.quantization.int8 import Int8Weight
from minivllm.utils.env_report import last_level_cache_bytes

LLC = last_level_cache_bytes()  # bytes, or None where the OS does not say
W_TURN = max(32, -(-2 * (LLC or 0) // (N_OUT * K_IN)))
w_fp32, w_int8 = [], []
for _ in range(W_TURN):
    w = torch.randn(N_OUT, K_IN)
    w_int8.append(Int8Weight(w))
    # fp32 as the engine multiplies it (its packed weight and matrix multiply, chapter 11), not
    # torch.nn.functional.linear, whose one-row product section 1 timed: that would flatter int8
    w_fp32.append(pack_weight(w))
del w
x1 = torch.randn(1, K_IN)


def median_ms(fn, repeats=7):
    """Median ms of one product, each repeat going once through the W_TURN weights."""
    for i in range(W_TURN):
        fn(i)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(W_TURN):
            fn(i)
        times.append((time.perf_counter() - t0) / W_TURN)
    return statistics.median(times) * 1e3


with torch.inference_mode():
    fp32_ms = median_ms(lambda i: linear(x1, w_fp32[i]))
    int8_ms = median_ms(lambda i: w_int8[i].matmul(x1))
int8_gbps = N_OUT * K_IN / (int8_ms * 1e-3) / 1e9  # one byte a weight (the per-channel scales are 16 KiB)
fp32_gbps = N_OUT * K_IN * BYTES / (fp32_ms * 1e-3) / 1e9
del w_fp32, w_int8

# %%
lines = "\n".join(f"| {name} | {tps:.0f} | **{tps / tps1:.2f}x** | "
                  f"{agreement(ref, toks) + ' (first request)' if isinstance(toks, list) else agreement_all(toks)} |"
                  for name, tps, toks in lever_rows)
render(f"""Decode throughput on {engine.source.name} ({WHERE}), fastest of 3 rounds; baseline: one request, a {DTYPE}
model whose linears hold {held:g} bytes a weight, no speculation, **{tps1:.0f} tokens/s**.

| lever | decode tokens/s | vs baseline | greedy tokens equal to the baseline's |
|---|---|---|---|
{lines}

Speculation accepted {spec_m.draft_acceptance_rate:.0%} of its draft tokens, {spec_m.mean_accepted_length:.2f} tokens
per verification step. Where the weight read is the whole cost, one row times a {N_OUT} × {K_IN} weight
({W_TURN} weights in turn{f", twice this CPU's largest cache ({LLC / 2**20:.0f} MiB) or more in int8" if LLC else ""}): **{fp32_ms:.2f} ms** in fp32 ({N_OUT * K_IN * BYTES / 2**20:.0f} MiB at {fp32_gbps:.1f} GB/s),
**{int8_ms:.2f} ms** in int8 ({N_OUT * K_IN / 2**20:.0f} MiB at {int8_gbps:.1f} GB/s): **{fp32_ms / int8_ms:.1f}x** faster
for {BYTES}x fewer bytes (on the CPU; its read-bandwidth ceiling {CPU_BW / 1e9:.1f} GB/s).""")
check_claim("batching raises decode tokens/s over one request", lever_rows[0][1] > tps1,
            f"{lever_rows[0][1] / tps1:.2f}x")
check_claim("n-gram speculation emitted more than one token per verification step on text that repeats its context",
            (spec_m.mean_accepted_length or 0) > 1, f"{spec_m.mean_accepted_length or 0:.2f} tokens per verification step, "
            f"acceptance {spec_m.draft_acceptance_rate:.0%}")
spec_ratio = lever_rows[2][1] / tps1
# the speculating request's decode steps: each emits 1 + its accepted drafts, so its n tokens after the first
# took n - accepted steps; their mean time over the baseline's (a step emits one token there), fastest rounds
spec_tokens = len(outs_by["ngram"][0].outputs[0].token_ids) - 1
spec_steps = spec_tokens - spec_m.num_accepted_draft_tokens
spec_step_cost = min(tpots["ngram"]) * spec_tokens / spec_steps / min(tpots["batch 1"])
# a gain or a loss only where every round of one engine beat every round of the other: three rounds on a
# shared machine move by several percent
spec_won, spec_lost = max(tpots["ngram"]) < min(tpots["batch 1"]), min(tpots["ngram"]) > max(tpots["batch 1"])
render(f"Those extra tokens per step turned into **{spec_ratio:.2f}x** the baseline's decode tokens/s on this run "
       f"(rounds: speculation {min(tpots['ngram']):.2f}-{max(tpots['ngram']):.2f} ms per token, the baseline "
       f"{min(tpots['batch 1']):.2f}-{max(tpots['batch 1']):.2f} ms): "
       + ("more than the verification steps cost: every round of speculation beat every round of the baseline."
          if spec_won else
          f"a loss: on {engine.source.name} run eagerly, verifying 5 tokens cost more than the accepted drafts saved."
          if spec_lost else
          "the two engines' rounds overlap, so this run cannot tell a gain or a loss from the machine's noise, "
          "whichever side of 1 the ratio of the fastest rounds fell: the spread of the rounds is wider than the gap "
          "between the fastest ones.")
       + f" Where the ratio comes from: {spec_tokens} tokens after the first took the speculating engine {spec_steps} "
       f"decode steps, **{spec_tokens / spec_steps:.2f} tokens a step** (only {spec_m.num_spec_steps} of the "
       f"{spec_steps} steps carried drafts; in the others no n-gram of the context matched), and its steps took "
       f"on average **{spec_step_cost:.2f}x** as long as the baseline's: {spec_tokens / spec_steps:.2f} / "
       f"{spec_step_cost:.2f} = {spec_ratio:.2f}x. Chapter 11 measures speculation with the decode graphs on, "
       "step by step.")
int8_won, int8_lost = max(tpots["int8"]) < min(tpots["batch 1"]), min(tpots["int8"]) > max(tpots["batch 1"])
render(f"int8's whole-step figure on {engine.source.name}: rounds {min(tpots['int8']):.2f}-{max(tpots['int8']):.2f} ms "
       f"per token against the baseline's {min(tpots['batch 1']):.2f}-{max(tpots['batch 1']):.2f} ms: "
       + ("every int8 round beat every baseline round." if int8_won else
          "every int8 round was slower than every baseline round." if int8_lost else
          "the rounds overlap, so this run measured no difference beyond the machine's noise."))
check_claim("int8 weights make a product that is one weight read faster", int8_ms < fp32_ms,
            f"{fp32_ms:.2f} -> {int8_ms:.2f} ms",
            why_it_may_not="This needs a fast CPU int8 path (the panel GEMM's int8 panels, or fbgemm where it does "
                           "not build) and a weight far larger than the CPU caches.")
check_claim("the int8 products read their weights at no more than the read-bandwidth ceiling (from main memory)",
            int8_gbps * 1e9 <= 1.1 * CPU_BW, f"{int8_gbps:.1f} GB/s against {CPU_BW / 1e9:.1f} GB/s",
            why_it_may_not=f"A CPU whose caches hold all {W_TURN} int8 weights ({W_TURN * N_OUT * K_IN / 2**20:.0f} MiB) "
                           "serves them from there, faster than main memory.");

# %% [markdown]
# The three can work for the same reason: where a decode step's time is the weight read, any way of
# getting more tokens out of one read (batching, speculation) or of reading fewer bytes (int8) can help;
# the table says how much each bought here.
# Faster memory and smaller models are two more ways, not the only ones. How much batching buys depends
# on how much of a step is a fixed cost it shares: these engines run eagerly, with the Python of every
# operation in each step, where chapter 04's engine replayed its decode steps from recorded graphs, so
# the two chapters' batching figures differ for that reason as well. int8 shows the condition
# plainly: it speeds up only the matrix multiplies, so what it gains on a whole step depends on their
# share of the step and on how slowly they read their weights: towards the single-weight figure for a model whose weights
# stream from main memory (not measured in this chapter: see the bench command below), less on the
# embedded one, whose few MB of weights can stay in a CPU cache and whose step has fixed costs
# beside them. There it can even come out below 1 (the sentence after the table says whether its rounds
# and the baseline's separated on this run): the int8 engine's panel GEMM widens every int8 weight to float32 as it reads it, work that
# fewer bytes repay only when the weights come from main memory, and the embedded model's float16 weights
# were already read in 2 bytes, not 4. Compare that row with the single-weight figure; on a busy
# machine the whole-step figure is also the noisiest. `python -m minivllm bench --model random:qwen3-0.6b
# --quantization int8` measures it on a memory-bound model. Batching raises throughput
# but not each request's own speed (chapter 07 measures what it costs a request's time per token);
# speculation raises both when its accepted drafts save more steps than verifying them costs (the
# sentence under the table says how it went here), and its outputs are the greedy tokens, up to
# floating-point near-ties (a verification step sums in another order than a one-token step); int8
# rounds every weight to 8 bits, so its tokens drift from the baseline's wherever two candidates were
# close (the table counts the requests where that happened).

# %% [markdown]
# ## 6. Why it matters
#
# * **Prefill sets the time to first token.** Long system prompts, retrieved documents and chat
#   histories all make prefill longer. Prefix caching (chapter 08) skips prefill for tokens already in
#   the cache; chunked prefill (chapter 07) keeps one long prompt from stalling everyone else.
# * **Decode sets the streaming speed and the cost per token.** Because a decode step is a weight read,
#   the ways to make it cheaper are to share the read (batching, chapter 05's continuous batching),
#   to read fewer bytes (int8 weights, smaller models) or to get several tokens per read (speculative
#   decoding); chapter 11 gives each of the last two its own section, and
#   `python -m minivllm bench --quantization int8` and `--speculative ngram draft` measure them on larger
#   workloads.
# * **Kernels are tuned per phase.** Prefill attention is a dense, compute-heavy product over many
#   queries; decode attention reads scattered KV blocks for one query per sequence, so the
#   two get different kernels (section 2 printed where they part; chapter 11 compares backends).
# * **Estimates start from floors, not constants.** Weight bytes over bandwidth and FLOPs over peak
#   FLOP/s bound any step on any machine; measure the point you care about to see how close it gets.
#
# ## 7. Check yourself

# %%
from widgets import Question, Quiz

# the largest measured batch still below the ridge point (memory-bound), for the first question's feedback
b_mem = below[-1] if len(below) > 1 else None
mem_example = (f"here batch {b_mem}, still below the ridge point, took "
               f"{big_dec.wall_ms.loc[b_mem] / big_dec.wall_ms.loc[1]:.1f}x the time of batch 1 on the big model"
               if b_mem is not None else "on this machine even batch 2 of the big model was past the ridge point, "
               "so the sweep had no larger memory-bound batch to compare")
ridge_batch = big_peaks.ridge_intensity * cost.held_weight_bytes / 2  # decode intensity B x 2 / bytes per weight = ridge
# did every step of section 4's sweep carry its whole batch (prefill 4 x B tokens, decodes B), i.e. did the pool hold it?
pre_rows, dec_rows = big_df[big_df.phase == "prefill"], big_df[big_df.phase == "decode"]
pool_held = bool((pre_rows.tokens == 4 * pre_rows.batch).all() and (dec_rows.tokens == dec_rows.batch).all())
Quiz([
    Question(
        "While decode is memory-bound, why does a step for 8 sequences cost far less than 8 steps for one?",
        ["Decode uses a different, faster kernel for batches",
         "Each weight is read once per step, whatever the batch; 8 rows of arithmetic add little to that",
         "The KV cache is empty during decode",
         "The sequences run one after another, and each is very short"],
        1,
        ["The kernels are the same matrix multiplies; the batch just adds rows to them.",
         "Right: eight rows instead of one barely change the bytes moved, so while the step is memory-bound "
         f"its time grows less than in proportion to the batch ({mem_example}).",
         "Decode reads the KV cache of every earlier token; it is the prefill that starts with it empty.",
         "They run together in one forward pass: that is what batching means here."],
    ),
    Question(
        "In section 4, where does the roofline bound on decode throughput stop growing in proportion to the "
        f"batch (on this machine: {knee}), and why there?",
        ["Where the KV cache runs out of blocks", "At the batch whose intensity (B/2 FLOP/byte in fp32) reaches "
         "the ridge point: from there arithmetic, not the weight read, sets the step time",
         "Where Python overhead, which grows with the square of the batch, takes over",
         "Nowhere: batching never helps decode on a CPU"],
        1,
        [(f"Every step of that sweep carried its whole batch (the table's tokens column): the {KV_POOL_BYTES >> 20} "
          "MiB pool held every sequence, so no request waited or was preempted."
          if pool_held else
          f"On this run some steps carried less than their whole batch (the {KV_POOL_BYTES >> 20} MiB pool or the "
          "token budget held requests back), but the roofline bound is computed per batch from FLOPs and bytes "
          "alone: it bends at the ridge point whatever the pool does."),
         f"Right: the ridge point here is {big_peaks.ridge_intensity:.1f} FLOP/byte, so with "
         f"{cost.held_weight_bytes:g}-byte weights the bend comes near batch {ridge_batch:.0f}. Below it a bigger batch rides on the same weight read; past it the "
         "step is compute-bound and more rows cost proportionally more time. On a data-centre GPU the ridge is in "
         "the hundreds.",
         "Host overhead per sequence is small and linear; the roofline bound alone predicts the bend.",
         f"The measured throughput at batch {b_max} was {speedup:.1f}x that of batch 1."],
    ),
    Question(
        "By the roofline: starting from batch-1 decode of a model whose weights come from memory (memory-bound, as "
        "section 4's), which of these does the least for decode tokens per second on the same model?",
        ["Batching more requests into each decode step", "Storing the weights in int8",
         "Speculative decoding on text that repeats its context", "A GPU with more FLOP/s and the same bandwidth"],
        3,
        ["It does: one weight read serves every sequence in the step (section 5 measured it).",
         "It can where the weight read dominates: fewer bytes per weight, less to read per step (section 5's "
         f"single weight: {fp32_ms / int8_ms:.1f}x faster; {engine.source.name}'s whole step, run eagerly: "
         f"{lever_rows[1][1] / tps1:.2f}x"
         + (", slower: in a model this small the weight read is not all of the step, and the int8 path has costs "
            "of its own)." if lever_rows[1][1] < tps1 else ")."),
         "It can, when drafts are accepted and checking them costs little more than a plain step, as in a "
         f"memory-bound step: several tokens come out of one weight read (on {engine.source.name} run eagerly, "
         f"section 5 measured {spec_ratio:.2f}x).",
         "Right, at small batches: a memory-bound decode step waits on bandwidth, and more arithmetic units "
         "would mostly sit idle (they could shave only the step's small compute floor). Past the ridge point (decode intensity B x 2 / bytes per weight reaches it near batch "
         f"{ridge_batch:.0f} in {BIG_DTYPE} on this machine, at short contexts) the step is compute-bound and "
         "FLOP/s matters too; long contexts add KV reads that keep it memory-bound (section 4's GPU cell)."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * count the FLOPs and bytes of a matrix product by hand and say whether it will be limited by
#   arithmetic or by memory on a machine whose peaks you know (its ridge point);
# * explain why prefill (many rows per weight read) is compute-bound and decode (one row per sequence)
#   memory-bound, and place real steps on this machine's measured roofline;
# * read MFU and MBU, and tell when a low MBU means overhead rather than memory;
# * estimate a decode step's weight-read floor for any model and memory, from bytes and bandwidth;
# * name and measure three levers on decode throughput besides faster memory: batching, int8 weights
#   and speculative decoding.
#
# Next: chapter 07 turns these step costs into the latencies a user feels (TTFT and TPOT) and shows
# what chunked prefill does for requests that are already streaming.
