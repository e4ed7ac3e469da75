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
# # 07 · Latency: TTFT, TPOT and chunked prefill
#
# Chapter 06 measured what a prefill step and a decode step cost. A user does not see steps: they see
# how long the first word takes to appear and how fast the rest streams. This chapter turns step
# costs into those two latencies, fits a small latency model to this machine, and measures what
# chunked prefill does for requests that are already streaming when a long prompt arrives.
#
# **Goal:** measure TTFT and TPOT per request, predict them from step costs, and explain who gains
# and who pays when a long prompt is chunked.
#
# **Prerequisites:** chapter 05 (the scheduler and its token budget per step), chapter 06 (prefill is
# compute-bound and grows with the prompt; a decode step is a weight read, shared by the batch).
#
# **Time:** about 30 minutes (reading and running).
#
# **Map of this chapter**
#
# 1. *TTFT and TPOT*: five requests of different lengths, timed by the engine.
# 2. *A latency calculator fitted to this machine*: predict a workload's latencies, then measure it;
#    what batching does to TPOT.
# 3. *Chunked prefill*: a long prompt arrives while others decode, with and without chunking.
# 4. *Myths* about latency and chunking, checked.
# 5. *Why it matters*.
# 6. *Check yourself*: a quiz; then a recap.
#
# **You will:** read per-request timings from `RequestOutput.metrics` · predict the time to first
# token of four prompts that arrive together, then measure it · watch a prompt split into chunks that
# share steps with decodes · predict and measure what chunking costs the long prompt itself.

# %% [markdown]
# ## Setup
#
# The same parameters as chapter 06: the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names
# another model, KV blocks of 16 tokens, and `MINIVLLM_THREADS` CPU threads (the stored outputs were
# produced with 1 thread; the setup cell prints the machine's load, since other busy processes slow
# every timing below).

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
THREADS = int(os.environ.get("MINIVLLM_THREADS", "0"))  # CPU threads for torch; 0 keeps torch's default
if THREADS > 0:
    torch.set_num_threads(THREADS)

# %%
from minivllm.utils.env_report import describe

mixed = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=128, max_num_batched_tokens=64,
            max_num_seqs=8)
me = mixed.llm_engine
cfg = me.config
DTYPE = str(cfg.dtype).removeprefix("torch.")
print(f"machine : {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
      f"using {torch.get_num_threads()} thread(s)")
print(f"device  : {cfg.device}; model {me.source.name}; dtype {DTYPE}; token budget per step "
      f"{cfg.max_num_batched_tokens}")
print(describe(mixed))
import psutil

print("load average (1, 5, 15 min):", ", ".join(f"{x:.2f}" for x in psutil.getloadavg()), f"on {os.cpu_count()} CPUs")
if psutil.getloadavg()[0] >= (os.cpu_count() or 1):  # this notebook's own process counts for about 1
    print("The machine is busy: other processes compete with this notebook for the CPUs, so this chapter's timings "
          "will come out slower and noisier than on an idle machine (run it again when the load is lower).")
WHERE = f"{me.source.name}, {cfg.device}, {DTYPE}, {torch.get_num_threads()} thread(s)"

# %% [markdown]
# ## 1. TTFT and TPOT
#
# Two latencies describe what a user of a served model feels:
#
# * **TTFT**, time to first token: from the request's arrival to its first output token. It is the
#   wait in the queue plus every step that carried part of its prompt (the first token is sampled at
#   the end of the step that finishes the prompt).
# * **TPOT**, time per output token: the mean gap between later tokens, `(time of the last token -
#   time of the first) / (tokens - 1)`. Each gap is one decode step of whatever batch the request
#   shares, so TPOT is set by decode, and by everything else that runs in the same steps.
# * **ITL**, inter-token latency: each single gap between two consecutive tokens of a request
#   (`metrics.itl_ms` lists them). TPOT is their mean; the largest one is what a streaming user sees as
#   a stall, and section 3 measures it.
#
# The engine stamps every request with its times (`RequestOutput.metrics`: arrival, first scheduled,
# first token, every token, finished). Here five requests of different lengths arrive together at an
# engine whose step holds at most 64 tokens, so some prompts wait for others, and a prompt that does
# not fit in the budget left in a step is split across steps (even a short one: what counts is the room
# the step has left, not the prompt's length). The same workload runs once first and is thrown away:
# an engine's first steps pay one-off costs (memory allocation, recording a decode graph for each new
# batch size, chapter 11) that are not what a user of a running server feels. The prompts are made
# before the clock starts, so the five arrivals are moments apart:

# %%
import random

from widgets import idle_engine
from widgets.measure import random_prompt

rng = random.Random(6)
WORKLOAD = {"a": (24, 16), "b": (100, 4), "c": (8, 24), "d": (60, 8), "e": (40, 12)}  # id: (prompt, output tokens)
prompts = {rid: random_prompt(me, n_prompt, rng) for rid, (n_prompt, _) in WORKLOAD.items()}


def run_workload(tag=""):
    """Add the five requests together, step until all finish: the step records and final outputs."""
    idle_engine(me)  # what an interrupted run left queued would join these steps
    for rid, (_, n_out) in WORKLOAD.items():
        me.add_request(tag + rid, prompts[rid], SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    records, done = [], {}
    while me.has_unfinished_requests():
        res = me.step_with_record()
        records.append(res.record)
        done.update({o.request_id.removeprefix(tag): o for o in res.outputs if o.finished})
    me.reset_prefix_cache()  # the measured run computes every prompt again
    return records, done


warm_records, _ = run_workload("warm-")  # one-off costs, thrown away
mixed_records, finals = run_workload()

# %%
# NBVAL_CHECK_OUTPUT
# Which steps each request's prompt went through, and the step that sampled its first token (steps counted
# from 1, as everywhere in this chapter).
for rid, (n_prompt, n_out) in WORKLOAD.items():
    chunks = [(i, e.num_tokens) for i, r in enumerate(mixed_records, 1) for e in r.scheduled
              if e.request_id == rid and e.is_prefill]
    first = next(i for i, r in enumerate(mixed_records, 1) for e in r.scheduled if e.request_id == rid and e.sampled)
    print(f"request {rid}: prompt {n_prompt:3d} tokens in chunks (step, tokens) {chunks}; first token at step {first}; "
          f"{len(finals[rid].outputs[0].token_ids)} output tokens")
print(f"{len(mixed_records)} steps; mixed prefill + decode steps: {sum(r.phase == 'mixed' for r in mixed_records)}")

# %%
import pandas as pd

lat = pd.DataFrame([dict(request=rid, prompt=WORKLOAD[rid][0], output=WORKLOAD[rid][1],
                         queue_ms=m.queue_ms, ttft_ms=m.ttft_ms, tpot_ms=m.tpot_ms, e2e_ms=m.e2e_ms)
                    for rid, m in ((rid, finals[rid].metrics) for rid in WORKLOAD)]).set_index("request")
lat["e2e / TTFT"] = lat.e2e_ms / lat.ttft_ms
lat.round(2)

# %%
import statistics

from widgets import check_claim, check_prediction, render

slow_start = lat.ttft_ms.idxmax()
long_tail, short_tail = lat["e2e / TTFT"].idxmax(), lat["e2e / TTFT"].idxmin()
# the step that sampled each request's first token; several requests can share the last such step
first_step = {rid: next(i for i, r in enumerate(mixed_records, 1) for e in r.scheduled if e.request_id == rid and e.sampled)
              for rid in WORKLOAD}
last_first = [f"**{rid}**" for rid, i in first_step.items() if i == max(first_step.values())]
plural = "s" if len(last_first) > 1 else ""
named = ", ".join(last_first[:-1]) + (" and " if plural else "") + last_first[-1]
# a decode-only step far slower than the others (another process took the CPU) weighs on the TPOT of every
# request in it; steps that carry prompt tokens are longer by their nature, so they are not compared
decode_only = [(i, r) for i, r in enumerate(mixed_records, 1) if r.num_prefill_tokens == 0]
slowest_no, slowest = max(decode_only, key=lambda ir: ir[1].wall_ms)
median_step_ms = statistics.median(r.wall_ms for _, r in decode_only)
stalled = sorted(e.request_id for e in slowest.scheduled)
stall_text = (f" One decode-only step stands out: step {slowest_no} took **{slowest.wall_ms:.1f} ms** against a median "
              f"of {median_step_ms:.2f} ms for such steps, a stall (another process on the machine, most likely) that "
              f"counts in the TPOT of request{'s' if len(stalled) > 1 else ''} {', '.join(stalled)}."
              if slowest.wall_ms > 3 * median_step_ms else "")
render(f"The last first token{plural} came at step {max(first_step.values())}, to request{plural} {named}; "
       f"the longest TTFT "
       f"was request **{slow_start}**'s ({lat.loc[slow_start, 'prompt']} prompt tokens, "
       f"{lat.loc[slow_start, 'queue_ms']:.1f} ms of it queued, TTFT {lat.loc[slow_start, 'ttft_ms']:.1f} ms). "
       f"Request **{long_tail}** ({lat.loc[long_tail, 'output']} output tokens) took "
       f"{lat.loc[long_tail, 'e2e / TTFT']:.1f}x its TTFT in all, request **{short_tail}** "
       f"({lat.loc[short_tail, 'output']} output tokens) only {lat.loc[short_tail, 'e2e / TTFT']:.1f}x. TPOT ranged from "
       f"{lat.tpot_ms.min():.2f} to {lat.tpot_ms.max():.2f} ms: each request's decode steps were shared with "
       f"different company, mixed steps with a prefill chunk in them included.{stall_text} (The thrown-away run took "
       f"{sum(r.wall_ms for r in warm_records):.1f} ms over its {len(warm_records)} steps, its slowest "
       f"{max(r.wall_ms for r in warm_records):.1f} ms; this one {sum(r.wall_ms for r in mixed_records):.1f} ms, its "
       f"slowest {max(r.wall_ms for r in mixed_records):.1f} ms.)");

# %% [markdown]
# Each request's TTFT is its wait plus the steps that carried its prompt, so it grows for requests
# whose prompts are long or queued behind others. Note what is *not* a check: `TTFT + (output - 1) ×
# TPOT` is, by the definition of TPOT, exactly the time of the last token, so it always matches the
# end-to-end time `e2e_ms` up to the moment between the last token and the request being marked
# finished. The informative columns are the measured ones: the queue, TTFT and TPOT.
#
# ## 2. A latency calculator, fitted to this machine
#
# A short sweep on this chapter's model (`MODEL`: the embedded one unless `MINIVLLM_MODEL` names
# another): prefill steps for several
# prompt lengths and decode steps at batch sizes 1 to 8, on an engine whose step holds up to 1024
# tokens. The latency calculator fits a cost model to these steps: a fixed cost per step plus a cost
# per prefill token, and a fixed cost per decode step plus a cost per sequence in the batch. It then
# replays the scheduler's policy (decodes first, then prompt chunks up to the token budget) for any
# workload. (A straight line through the prefill steps can meet zero tokens below zero: where the
# longest prompts' steps grow faster than their token count, because each token's attention reads
# all the tokens before it, the line tilts up. A negative cost per step would be no cost at all, so
# the fit then fixes that coefficient at 0 and fits the others again, and the calculator shows
# 0.00 ms.)

# %%
from widgets import measure_decode_batch, measure_step_latency

bench = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=256, max_num_batched_tokens=1024,
            max_num_seqs=16)
rows = measure_step_latency(bench, [16, 64, 128, 256, 512], decode_steps=3, repeats=3, roofline=False)
decode_rows = measure_decode_batch(bench, batch_sizes=[1, 2, 4, 8], prompt_len=32, decode_steps=5)
steps = pd.DataFrame(rows)
pre = steps[steps.phase == "prefill"].groupby("prompt_len").wall_ms.median()
dec = pd.DataFrame(decode_rows).groupby("batch").wall_ms.median()
print("prefill step (one prompt, median of 3):",
      ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in pre.items()))
print("decode step (median of the steps at each batch):", ", ".join(f"batch {b} {ms:.2f} ms" for b, ms in dec.items()))

# %% [markdown]
# ### Exercise 1 · Four prompts arriving together
#
# Four requests, each with a 128-token prompt and a 12-token answer, arrive at this engine at the same
# moment (budget 1024 tokens per step). Predict their mean time to first token, in ms, from the step
# times just printed. Think about which step produces each request's first token.

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: the mean TTFT of the four requests, in ms

# %% [markdown]
# The calculator below is set to that point and has measured it once (the **measured** bars); move the
# sliders to predict other points and press **measure this point** to run that exact workload on the
# engine.

# %%
from widgets import LatencyCalculator

calc = LatencyCalculator({me.source.name: bench}, sweeps={me.source.name: rows + decode_rows})
calc.prompt_slider.value, calc.response_slider.value, calc.batch_slider.value = 128, 12, 4
point = calc.measure()
calc.display()

# %%
check_prediction(my_prediction_1, point["ttft_ms"], rel_tol=0.25, unit="ms", what="the mean TTFT of the four requests")
render("| | predicted by the fitted model | measured |\n|---|---|---|\n" + "\n".join(
    f"| {name} | {point['predicted'][key]:.2f} ms | {point[key]:.2f} ms |"
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "total")))
       + f"\n\nThe sweep's one-prompt prefill steps: 128 tokens {pre.loc[128]:.1f} ms, 512 tokens {pre.loc[512]:.1f} ms; "
         f"the four requests' mean TTFT was **{point['ttft_ms'] / pre.loc[512]:.2f}x** the 512-token step."
       + (f" The measured TPOT is **{point['tpot_ms'] / point['predicted']['tpot_ms']:.2f}x** the fitted one: the fit's "
          "decode steps are steady-state ones (the sweep sets aside the first five after each prefill, which run "
          "slower: the first at a batch size records its graph, the next run with caches the prefill left cold) "
          "at 32-token contexts, while this workload's TPOT averages all of its decode gaps, the first ones "
          "included, at 128-token contexts."
          if point["tpot_ms"] > 1.2 * point["predicted"]["tpot_ms"] else ""));

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# The four prompts hold 4 × 128 = 512 tokens, which fit in one step of the 1024-token budget, so the
# scheduler prefills all four in the same step and samples all four first tokens at its end. Each
# request's TTFT is therefore about the time of one 512-token prefill step, not the time of a
# 128-token prefill: the sweep printed a 512-token prefill step, and that is the estimate. Expect the
# measured mean to come out near it (the sentence under the table gives the ratio on this run), on
# either side: four prompts of 128 tokens do less attention work than one of 512 (each token attends
# only over its own prompt), which pulls it below; each TTFT also counts the engine's work around the
# step (queueing the requests, sampling four first tokens), which pulls it above; and the two were
# timed in different runs, and single steps on a CPU vary from run to run. A common slip is to
# take the 128-token figure: it ignores that the other three prompts ride in the same step. (With a
# budget of 128 tokens the four would be served one after another, and the mean TTFT would be more
# than the 2.5 steps that (1 + 2 + 3 + 4) / 4 suggests: each step serves the running requests' decodes
# first, so every later prompt gives up a token of its step to each request already decoding and
# spills into one step more. Counted by that rule, the first tokens come at the ends of steps 1, 3, 4
# and 5, 3.25 steps on average (the cell below counts them with the engine); `LatencyModel.predict`
# with a budget of 128 counts the same steps, in milliseconds.)
#
# The fitted model makes the same reasoning with its per-step and per-token costs; the table above
# shows how close it and you came to the measurement.
# </details>

# %%
# The solution's count with a 128-token budget, by the engine itself: the step at which each
# request's first token came (four different 128-token prompts, so no prefix is shared)
budget_llm = LLM(MODEL, device=DEVICE, max_num_batched_tokens=128, max_model_len=256)
be = budget_llm.llm_engine
for i in range(4):
    be.add_request(f"r{i}", {"prompt_token_ids": [1 + (7 * i + j) % 97 for j in range(128)]},
                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
first_token_step, step_no = {}, 0
while be.has_unfinished_requests():
    step_no += 1
    for out in be.step():
        first_token_step.setdefault(out.request_id, step_no)
budget_llm.shutdown()
steps_seen = sorted(first_token_step.values())
render(f"With a 128-token budget the four first tokens came at the ends of steps **{steps_seen}**: "
       f"{sum(steps_seen) / len(steps_seen):.2f} steps on average.")
check_claim("the worked solution's count (steps 1, 3, 4 and 5)", steps_seen == [1, 3, 4, 5], str(steps_seen));

# %% [markdown]
# ### What batching does to TPOT
#
# The decode steps of the sweep tell a second story. A bigger batch tends to make each step longer
# (more rows of arithmetic; on a noisy CPU run neighbouring sizes can come out of order), so each
# request's TPOT rises, while the step produces one token for every request in it. How much each
# moves depends on what the step is waiting for: while it is memory-bound (it reads all the weights
# whatever the batch), added rows are nearly free; past the ridge point (chapter 06) each row costs
# its own arithmetic. By how much, here:

# %%
tpot_ratio = dec.iloc[-1] / dec.iloc[0]
b_last = dec.index[-1]
render(f"From batch 1 to batch {b_last}, the decode step went from {dec.iloc[0]:.2f} ms to {dec.iloc[-1]:.2f} ms: "
       f"each request's TPOT **{tpot_ratio:.2f}x**, while the engine's decode throughput went from "
       f"{1e3 / dec.iloc[0]:.0f} to {b_last * 1e3 / dec.iloc[-1]:.0f} tokens/s (**{b_last / tpot_ratio:.1f}x**).")
check_claim(f"a decode step of {b_last} sequences takes at least as long as a step of one", tpot_ratio >= 1,
            f"{dec.iloc[0]:.2f} -> {dec.iloc[-1]:.2f} ms",
            why_it_may_not="On a busy machine one size's steps can be slowed by other processes; run the sweep "
                           "(section 2's first cell) and this cell again to see whether it repeats.")
check_claim(f"batching to {b_last} raised the decode throughput", b_last / tpot_ratio > 1,
            f"TPOT {tpot_ratio:.2f}x, throughput {b_last / tpot_ratio:.1f}x");
# Which grew more depends on where the step sits on the roofline (chapter 06): the batch-b step's
# FLOPs and weight bytes from the model's shape, against this machine's measured ceilings.
cost7, peaks7 = bench.llm_engine.model_cost, bench.llm_engine.measure_peaks()
flops_b = 2 * (cost7.matmul_params + cost7.lm_head_params) * b_last  # the matrix multiplies, 2 FLOPs a weight a row
weight_bytes7 = cost7.body_weight_bytes + cost7.lm_head_bytes
intensity_b = flops_b / weight_bytes7
achieved_b = flops_b / (dec.iloc[-1] * 1e-3)
past_ridge = intensity_b >= peaks7.ridge_intensity
weights7 = cost7.matmul_params + cost7.lm_head_params
# the memory ceiling was measured over a buffer larger than the caches: weights that fit the CPU's
# last-level cache are not read from main memory at all, and that ceiling does not bound them
from minivllm.utils.env_report import last_level_cache_bytes

llc7 = last_level_cache_bytes() if bench.llm_engine.config.device.type == "cpu" else None
cache_resident = llc7 is not None and weight_bytes7 < llc7
if cache_resident:  # measured, not assumed: a buffer of the weights' size, read again and again, against memory's ceiling
    import time

    buf7 = torch.ones(int(weight_bytes7 // 4))
    buf7.sum()
    reread_s = []
    for _ in range(30):
        t0 = time.perf_counter()
        buf7.sum()
        reread_s.append(time.perf_counter() - t0)
    reread_bw = weight_bytes7 / min(reread_s)
    del buf7
    cache_resident = reread_bw > 1.5 * peaks7.mbu_bytes_per_s
render(f"Here throughput grew **{'more' if b_last / tpot_ratio > tpot_ratio else 'less'}** than TPOT did. At batch "
       f"{b_last} the step's matrix multiplies do {flops_b / 1e6:.0f} MFLOP over {weight_bytes7 / 1e6:.1f} MB of weights "
       f"({weights7 / 1e6:.2f} M weights at {weight_bytes7 / weights7:.1f} bytes each, as the engine holds them: "
       f"a 16-bit checkpoint's values stay in 16 bits, which widen to float32 exactly and halve the bytes read; "
       f"chapter 11 measures what that does to int8's gain): "
       f"intensity **{intensity_b:.1f} FLOP/byte** against this machine's ridge point of {peaks7.ridge_intensity:.1f} "
       f"({peaks7.provenance}), and the whole step ran at {achieved_b / 1e9:.0f} GFLOP/s of them, "
       f"{achieved_b / peaks7.flops_per_s:.0%} of the measured matmul peak. "
       + (f"But these {weight_bytes7 / 1e6:.1f} MB fit this CPU's {llc7 / 2**20:.0f} MiB last-level cache: a buffer "
          f"of that size, read again and again, ran at **{reread_bw / 1e9:.0f} GB/s** (the fastest of 30 reads), "
          f"against memory's {peaks7.mbu_bytes_per_s / 1e9:.0f} GB/s. So after the first step the weights come from "
          "the cache, not main memory, and the roofline's memory ceiling (measured "
          "over a buffer larger than the cache) does not bound this model: what a step costs here is its "
          "arithmetic, run below the peak by small matrix multiplies, and what every row brings (attention over "
          "its own KV, its norms and sampling, its bookkeeping). Chapter 06 shows a memory-bound decode step on a "
          "model too large for the cache. "
          if cache_resident else
          "So the step is past the ridge: by the roofline, arithmetic, not the weight read, bounds its matrix "
          "multiplies, and every added row costs its own arithmetic. "
          if past_ridge else
          "So the step is still below the ridge: by the roofline the weight read, not the arithmetic, bounds its "
          "matrix multiplies, and what grew with the batch is what every row brings (attention over its own KV, "
          "its norms and sampling, its bookkeeping) and small matrix multiplies running below the peak. ")
       + "On a GPU, whose ridge point is typically in the hundreds, a decode step of a model too large for its "
         "caches stays memory-bound to far larger batches, and there, at short contexts, TPOT barely moves while "
         "throughput grows almost with the batch (at long contexts each sequence's KV read grows the step too: "
         "chapter 06 counts those bytes).");

# %% [markdown]
# So batching is a **throughput** lever, not a TPOT lever: it serves more users per second at the
# price of a slower stream for each (by the TPOT factor just rendered). What can lower a request's TPOT
# is a cheaper decode step (fewer bytes per weight, which pays where the step is bound by reading its
# weights; faster memory) or more tokens per step for that request (speculative decoding); chapters 06
# and 11 measure both on this machine, and what they find depends on that condition. The calculator's constants are fitted to this machine, so on a
# GPU with a real checkpoint the same cells fit different ones.
#
# ## 3. Chunked prefill
#
# A prompt longer than the step's token budget (`max_num_batched_tokens`) is split into chunks, one
# per step. The point is not the long prompt's own latency; it is everybody else's. Requests already
# decoding get their token in *every* step, mixed in with the chunk, instead of waiting for the whole
# prompt. Here a request decodes while an 80-token prompt arrives at an engine whose budget is 32
# tokens per step:

# %%
# NBVAL_CHECK_OUTPUT
small = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64, max_num_batched_tokens=32)
e = small.llm_engine
e.add_request("chatting", "The module provides", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
e.step()  # step 1: its prefill
e.add_request("long", list(range(1, 81)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # 80 token ids
for i in range(2, 7):
    r = e.step_with_record().record
    parts = ", ".join(f"{x.request_id}: {x.num_tokens} {'prefill' if x.is_prefill else 'decode'}" for x in r.scheduled)
    print(f"step {i}: {r.phase:7s} [{parts}]")
while e.has_unfinished_requests():
    e.step()
small.shutdown()

# %% [markdown]
# The 80-token prompt took three steps, and the decoding request got a token in each of them: its one
# decode token plus a prefill chunk fill the 32-token budget (1 + 31), and the last step takes the
# prompt tokens that remain. Without chunking the whole prompt runs
# in one long step and the decoding requests wait for it.
#
# Now measured: three requests decode while a 384-token prompt arrives, once on an engine that chunks
# (64-token budget) and once on one that schedules the prompt whole.
#
# ### Exercise 2 · What chunking costs the long prompt
#
# Predict the long prompt's own TTFT with chunking divided by its TTFT without (a ratio: below 1 if
# chunking makes it faster, above 1 if slower). A way to a number: count the chunk steps (each step's
# budget of 64 tokens, less the three decode tokens it also carries, into the 384 prompt tokens), price
# each at section 2's one-prompt prefill step of a chunk's size, and set their sum against one 384-token
# step, read between section 2's 256- and 512-token steps. (That leaves things out, which the sentence
# under the table names; the check allows 40%.)

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: long prompt's TTFT chunked / TTFT whole (x)

# %%
from widgets import ChunkedPrefillDemo

demo = ChunkedPrefillDemo.from_model(MODEL, budget=64, max_model_len=512, long_prompt_len=384,
                                     num_decoders=3, decode_tokens=20, device=DEVICE, repeats=3)
demo.display()

# %%
import numpy as np

c, w = demo.results["chunked"], demo.results["whole"]
ttft_ratio = c["long_ttft_ms"] / w["long_ttft_ms"]
check_prediction(my_prediction_2, ttft_ratio, rel_tol=0.4, unit="x", what="the long prompt's TTFT chunked / whole")
render(f"""| | long prompt: steps | long prompt: TTFT | worst gap between a decoding request's tokens |
|---|---|---|---|
| chunked (64-token budget) | {c['prefill_steps']} | {c['long_ttft_ms']:.1f} ms | {c['max_itl_ms']:.1f} ms |
| whole prompt in one step | {w['prefill_steps']} | {w['long_ttft_ms']:.1f} ms | {w['max_itl_ms']:.1f} ms |

Chunking changed the long prompt's TTFT **{ttft_ratio:.2f}x** and the worst stall of the requests already streaming
**{c['max_itl_ms'] / w['max_itl_ms']:.2f}x**.""")
# the estimate the worked solution describes: the sweep's one-prompt prefill steps (section 2), read at a chunk's
# size for each chunk step and at the whole prompt's size for the unchunked step
long_len = demo.scenario["long_prompt_len"]
chunk_tokens = long_len / c["prefill_steps"]
est_chunk_ms = float(np.interp(chunk_tokens, pre.index, pre.values))
est_whole_ms = float(np.interp(long_len, pre.index, pre.values))
est_ratio = c["prefill_steps"] * est_chunk_ms / est_whole_ms
render(f"From the sweep alone: {c['prefill_steps']} chunk steps of about {chunk_tokens:.0f} prompt tokens, about "
       f"{est_chunk_ms:.1f} ms each, against one {long_len}-token step of about {est_whole_ms:.1f} ms (read between "
       f"the sweep's prefill steps): a ratio of about **{est_ratio:.2f}**, against **{ttft_ratio:.2f}x** measured. "
       + ("The measurement is higher. What the estimate leaves out: the sweep's one-prompt steps were fresh prompts, "
          "whose attention over their own tokens runs in one call (on a CPU in fp32, the C causal kernel), while a "
          "chunk after the first has a prefix in the KV cache, so its attention gathers the prefix's keys and values "
          "through the block table into a copy and runs the masked reference attention (the torch backend's "
          "paths, chapter 04), another path "
          "for the same query-key pairs with a copy of its own; and each chunk shares its step with the decoding "
          "requests, which the sweep's steps did not."
          if ttft_ratio > 1.15 * est_ratio else
          "The measurement is lower: the two were timed in different runs, and single steps on a CPU vary from run "
          "to run." if ttft_ratio < est_ratio / 1.15 else
          "The two are close."))
check_claim("chunking shortened the worst gap between a decoding request's tokens", c["max_itl_ms"] < w["max_itl_ms"],
            f"{w['max_itl_ms']:.1f} -> {c['max_itl_ms']:.1f} ms")
check_claim("chunking did not make the long prompt's own first token come sooner", ttft_ratio >= 1,
            f"TTFT {w['long_ttft_ms']:.1f} -> {c['long_ttft_ms']:.1f} ms",
            why_it_may_not="Noise on a busy machine can swing even a median of three runs when the two are close.");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Unchunked, the long prompt goes through the model in one step, and its first token comes at the end
# of that step. Chunked, the same prompt tokens still have to be computed before its first token, now
# spread over several steps, and each of those steps also carries the other requests' decodes and
# reads all the weights again. So chunking does not bring the long prompt's first token sooner, and
# usually delays it: expect a ratio of 1 or more. How much it adds depends on what each extra step
# costs beyond its share of the prompt: the other requests' decodes it carries, reading the weights
# again, and the engine's own work per step. With a budget of a few hundred tokens or more on a large
# model on a GPU, where each chunk is compute-bound and costs about its share of the prompt, we expect
# the ratio to come closer to 1; with this exercise's 64-token budget each chunk sits far below a GPU's
# ridge point and costs about a whole read of the weights, so there the ratio stays well above 1.
# Neither is measured here: run this notebook with `MINIVLLM_MODEL` naming a real checkpoint on a GPU. The table above gives
# this run's figure. For a number before you measure: count the chunk steps (the budget less the
# decodes each step carries, into 384 tokens) and price each at the sweep's prefill step of a chunk's
# size, against one 384-token step read between the sweep's 256- and 512-token steps (while the three
# requests decode, a step has room for 61 of the prompt's tokens). The sentence under the table works
# that estimate out for this run and says what it leaves out.
#
# What chunking buys is the other column: the requests already decoding never wait for more than one
# chunk.
# </details>

# %% [markdown]
# Chunking costs the long prompt some of its own TTFT and buys a smaller worst-case stall for
# everyone already streaming (the checks above say whether both held on this run). The size of the chunks is the knob between the two:

# %% tags=["playground"]
# Knob: BUDGET, the token budget per step (max_num_batched_tokens) of the chunking engine; try 32, 128, 256.
# Look for the trade: a smaller budget means more chunks, a smaller worst gap for the decoding requests and a
# longer TTFT for the long prompt (each chunk is one more step, with its own fixed costs); a larger one the
# reverse. A single run can be thrown off by other processes, so the scenario runs 3 times (medians printed).
import statistics

from widgets.chunked_prefill_demo import itl_around_long_prompt

BUDGET = 128
knob = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET, max_model_len=512,
           num_kvcache_blocks=128)
runs = [itl_around_long_prompt(knob, num_decoders=3, decode_tokens=20, long_prompt_len=384) for _ in range(3)]
gap, ttft = (statistics.median(r[k] for r in runs) for k in ("max_itl_ms", "long_ttft_ms"))
print(f"budget {BUDGET}: the 384-token prompt in {runs[0]['prefill_steps']} steps; worst gap {gap:.1f} ms; "
      f"long prompt's TTFT {ttft:.1f} ms (medians of 3 runs; the 64-token engine above, likewise: "
      f"{c['prefill_steps']} steps, {c['max_itl_ms']:.1f} ms, {c['long_ttft_ms']:.1f} ms)")
knob.shutdown()

# %% [markdown]
# ## 4. Myths, checked
#
# **"TTFT and total response time are the same thing."** Section 1's table already answered it: the
# total was a different multiple of TTFT for every request (its `e2e / TTFT` column): `e2e / TTFT = 1 +
# (tokens after the first) x TPOT / TTFT`, so it depends on how many tokens came after the first, on how
# long their steps took, and as much on the TTFT itself (a request that queued has a long TTFT and so a
# small ratio). They are different measurements, tuned by different means (prefix
# caching and chunk size for TTFT; bandwidth, int8 and speculation for the decode part, while batching
# trades some of each request's TPOT for throughput: section 2 measured how much).
#
# **"Chunked prefill comes with `enforce_eager=False`."** `enforce_eager` decides whether decode steps
# are replayed from recorded graphs (CUDA graphs on a GPU, CPU graphs on a CPU: chapter 11); chunking is
# the scheduler's `enable_chunked_prefill`. Run the
# same workload (a request decoding while a 60-token and an 80-token prompt arrive together, a step
# budget of 96 tokens) under both values of `enforce_eager`, then with chunking off and nothing else
# changed. Both prompts fit the budget; they do not both fit the room one step has:

# %%
# NBVAL_CHECK_OUTPUT
def chunk_run(**engine_args):
    sub = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64, **engine_args)
    e = sub.llm_engine
    e.add_request("chatting", "The module provides", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    e.step()
    # (8 tokens: after their chunks, plain decode steps enough for a graph to be replayed, not only recorded)
    e.add_request("mid", list(range(1, 61)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    e.add_request("long", list(range(101, 181)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    recs = []
    while e.has_unfinished_requests():
        recs.append(e.step_with_record().record)
    g = e.runner.graph_runner
    graphs = (g.num_recordings, g.num_replays) if g is not None else None
    sub.shutdown()
    return recs, graphs


graph_state, chunks_by = {}, {}
SAME = dict(max_num_batched_tokens=96, max_model_len=96)  # without chunking a prompt must fit one step
for args in (dict(enforce_eager=True), dict(enforce_eager=False), dict(enable_chunked_prefill=False)):
    name = ", ".join(f"{k}={v}" for k, v in args.items())
    recs, graph_state[name] = chunk_run(**args, **SAME)
    # r.index: the engine's step count from 0 (a fresh engine each run): step r.index + 1 as the other cells count
    chunks_by[name] = {rid: [(r.index + 1, x.num_tokens) for r in recs for x in r.scheduled
                             if x.request_id == rid and x.is_prefill] for rid in ("mid", "long")}
    print(f"{name:28s}: chunks (step, tokens) of the 60-token prompt {chunks_by[name]['mid']}, "
          f"of the 80-token prompt {chunks_by[name]['long']}; mixed steps {sum(r.phase == 'mixed' for r in recs)}")
mixed_example = next(r for r in recs if r.phase == "mixed")
print(f"a mixed step of the last run ({name}):",
      [(x.request_id, x.num_tokens, "prefill" if x.is_prefill else "decode") for x in mixed_example.scheduled])

# %%
import inspect

import minivllm.engine.scheduler as scheduler_module

for name, counts in graph_state.items():
    print(f"device {cfg.device}, {name}: decode graphs recorded / replayed: "
          f"{'none (graphs off)' if counts is None else '%d / %d' % counts}")
check_claim("the scheduler, which decides the chunks, never reads enforce_eager",
            "enforce_eager" not in inspect.getsource(scheduler_module),
            "searched the source of minivllm/engine/scheduler.py");
graphs_on = graph_state["enforce_eager=False"]
check_claim("the chunks were the same under both values of enforce_eager and different with chunking off",
            chunks_by["enforce_eager=True"] == chunks_by["enforce_eager=False"] != chunks_by["enable_chunked_prefill=False"],
            "; ".join(f"{k}: 80-token prompt {v['long']}" for k, v in chunks_by.items()))
check_claim("the enforce_eager=False engine replayed recorded graphs for plain decode steps",
            graphs_on is not None and graphs_on[1] > 0,
            "recorded / replayed: " + ("none (graphs off)" if graphs_on is None else "%d / %d" % graphs_on),
            why_it_may_not="Graphs are off for some backends, dtypes and tensor parallelism (the engine's startup "
                           "log says why); the chunks are the same either way.");

# %% [markdown]
# What this shows, and what it does not. The chunks were the same under both values of
# `enforce_eager` and changed only when `enable_chunked_prefill` was turned off; the scheduler that
# makes the chunks does not even read `enforce_eager`. The `enforce_eager=False` engine ran its plain
# decode steps from graphs, recording one at the first plain decode step of each batch size and
# replaying it at any later one (the printout counts both; mixed steps always run eagerly), and the
# chunks stayed the same; chapter 11 measures what the graphs buy.
#
# **"Engines like nano-vllm mix prefill and decode in one batch."** Ours does, as the mixed steps above
# show: one forward pass holding a decode token and prompt tokens (a chunk, or with chunking off a whole
# prompt, as in the printed example). nano-vllm (commit bb823b3,
# `nanovllm/engine/scheduler.py`, `Scheduler.schedule`) does not: each of its steps is prefill-only or
# decode-only, and it chunks only the first prompt of a step. Mixing is what lets the decoding request
# above get a token in every step.
#
# ## 5. Why it matters
#
# * **Interactive use is judged on TTFT.** A slow first token feels like a hang however fast the rest
#   streams; long prompts, queues and big batches of arriving prompts all lengthen it. Prefix caching
#   (chapter 08) removes prefill work outright; the token budget decides how long one step can be.
# * **Long answers are judged on TPOT.** For an essay or a code listing the decode part dominates the
#   total; TPOT is one decode step of whatever batch the request shares.
# * **A server trades one user's latency for everyone's throughput.** Batching raises tokens per second
#   while each request's TPOT rises; chunking protects streaming requests while the long
#   prompt waits longer (sections 2 and 3 measured both costs). Serving targets are usually written as
#   limits on both latencies.
# * **Estimates come from step costs.** A few measured steps and the scheduler's policy predict a
#   workload's latencies roughly (the calculator against the measurement in section 2 says how close it
#   came here): enough to compare settings, not to promise a figure; measure the point you care about.
#
# ## 6. Check yourself

# %%
from widgets import Question, Quiz

longer = "longer" if ttft_ratio >= 1 else "shorter"
Q_PROMPT, Q_ANSWER = 2000, 20  # the first question's request: prompt and answer tokens
Quiz([
    Question(
        f"A request has a {Q_PROMPT:,}-token prompt and gets a {Q_ANSWER}-token answer. What sets its time to "
        "first token?",
        ["The decode steps", "Queueing plus the prefill steps of its prompt",
         "Prefill and decode equally", "The sampler"],
        1,
        ["Decode starts only after the first token exists; it sets the pace of the tokens that follow.",
         "Right: the first token is sampled at the end of the step that finishes the prompt, so TTFT is the "
         "wait in the queue plus every prefill step (chunks included).",
         f"The {Q_ANSWER - 1} decode steps (the first of the {Q_ANSWER} tokens comes from the prefill) all come "
         "after the first token; they add to the total time, not to TTFT.",
         "Sampling one token from the logits is a tiny part of any step."],
    ),
    Question(
        "With chunked prefill, who benefits when a long prompt arrives?",
        ["The long prompt's own TTFT drops a lot", "Requests already decoding: a token every step",
         "Nobody; it only changes memory use", "It is what enforce_eager=False turns on"],
        1,
        ["The long prompt still needs every chunk computed before its first token, and each chunk shares a "
         f"step with the decodes: here its TTFT was {ttft_ratio:.2f}x ({longer}) with chunking "
         f"({w['long_ttft_ms']:.1f} -> {c['long_ttft_ms']:.1f} ms).",
         "Right: the token budget caps each step, so decodes are never stalled for a whole long prefill "
         f"(worst gap {w['max_itl_ms']:.1f} -> {c['max_itl_ms']:.1f} ms here).",
         "The chunked run above shows the decoding request getting a token in every step; that is a latency "
         "change for it.",
         "enforce_eager switches decode graphs off; chunking is the scheduler's enable_chunked_prefill."],
    ),
    Question(
        f"Going from batch 1 to batch {b_last}, what happened to each request's TPOT on this machine?",
        ["It fell in proportion to the batch",
         f"It {'rose' if tpot_ratio > 1 else 'did not rise'} ({tpot_ratio:.2f}x here), "
         f"{'by less than' if tpot_ratio < b_last else 'by no less than'} the batch, while throughput "
         f"{'rose' if b_last > tpot_ratio else 'did not rise'} ({b_last / tpot_ratio:.1f}x)", "It stayed exactly the same",
         "It rose in proportion to the batch"],
        1,
        ["Batching does not make any one request's steps faster: each step carries more rows.",
         ("Right: a step's fixed costs (launching its operations; on a model too large for the CPU's caches, its "
          "weight read) serve every sequence in it, so the step grows less than the batch; batching is a "
          "throughput lever that costs each request some TPOT.")
         if tpot_ratio < b_last else
         ("Right for this run's numbers, though not the usual outcome: a step's fixed costs serve every "
          "sequence, so the step normally grows less than the batch. A slow step in this short "
          "sweep (other processes on the machine) can hide that: run the sweep cell again."),
         "The step does a little more arithmetic and reads a little more KV cache for each extra sequence.",
         "That would mean no gain from batching; the weight read is shared, so the step grows less."
         if tpot_ratio < b_last else
         f"Near what this run measured ({tpot_ratio:.2f}x), but the choice above states the measurement itself; "
         "with the weight read shared, the step normally grows less than the batch."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * read a request's TTFT, TPOT, queue time and end-to-end time from `RequestOutput.metrics`, and say
#   which steps each one is made of;
# * predict TTFT for prompts that arrive together from measured prefill step times and the token
#   budget, and check the prediction with the latency calculator;
# * explain why batching is a throughput lever that raises each request's TPOT;
# * say who gains (requests already streaming) and who pays (the long prompt) when a prompt is chunked,
#   and which setting controls it (`enable_chunked_prefill`, `max_num_batched_tokens`, not
#   `enforce_eager`).
#
# Next: chapter 08, prefix caching, skips prefill for tokens the cache has already seen.
