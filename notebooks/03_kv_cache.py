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
# # 03 · The KV cache
#
# In chapter 01 the hand-written loop did more work for every new token, because it pushed the
# whole sequence through the model each time, while the engine's decode steps pushed one token
# through. The difference is the **KV cache**: the engine keeps every earlier token's attention keys
# and values instead of recomputing them. In this chapter you build generation both ways by hand on
# the engine's model, check that they produce the same tokens, measure what each costs per token as
# the sequence grows (next to the FLOPs each must do), and then measure what the cache costs in
# memory: bytes per token from the config against the engine's real KV tensor.
#
# **Goal:** understand why keys and values can be cached exactly, what the cache saves in work and
# time, and what it costs in memory, for a toy model and for a real one.
#
# **Prerequisites:** chapter 01 (the generation loop, prefill and decode steps, counting FLOPs) and
# chapter 02 (attention heads, grouped-query attention, the engine's KV pool).
#
# **Time:** about 30 minutes (reading and running).
#
# **You will:** see why causal attention lets earlier keys and values be reused · generate with and
# without a cache and get identical tokens · measure cost per token against sequence length for both,
# after predicting the ratio · compute KV bytes per token from the config and check it against the
# allocated tensor, for minivllm-tiny and Qwen3-0.6B · watch the engine's cache fill block by block.

# %% [markdown]
# ## Setup
#
# The embedded `minivllm-tiny` unless `MINIVLLM_MODEL` says otherwise; the device is chosen
# automatically. A pool of 64 blocks of 16 tokens is plenty for this chapter.

# %% tags=["parameters"]
import os
import statistics
import time

import pandas as pd  # imported here, not at the end of the long timing cell, where an interrupt could cut it in half
import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)

# %%
from widgets import check_claim, check_prediction, idle_engine, render

llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64)
engine = llm.llm_engine
runner, model, hf = engine.runner, engine.runner.model, engine.source.hf_config
tok = llm.get_tokenizer()
print(describe(llm))
print("torch threads:", torch.get_num_threads())
# what every chart of this chapter says it measured: model, device, dtype, threads
RUN = (f"{engine.source.name} · {engine.config.device} · {str(engine.config.dtype).replace('torch.', '')} · "
       f"{torch.get_num_threads()} thread(s)")

# %% [markdown]
# ## 1. What can be reused
#
# In every layer, attention turns each token into a query `q`, a key `k` and a value `v`. The output
# at position `p` is a weighted average of the values `v_0 .. v_p`, weighted by how well `q_p`
# matches each key `k_0 .. k_p`. It is *causal*: a token never looks at later tokens.
#
# So when the sequence grows by one token, nothing about the earlier tokens changes: their keys and
# values in every layer are exactly what they were one step ago. Only the new token's `q`, `k`, `v`
# are new. If we keep every `k` and `v` (the KV cache), a step only has to push **one** token through
# the model: it writes its own `k` and `v` to the cache and attends over all the cached ones.
#
# ## 2. Both ways, by hand, on the engine's model
#
# The function below runs a slice of a sequence through `llm.llm_engine.runner.model` (the engine's
# Qwen3 module) with a KV cache we pass in. `start` says where the slice begins: the new tokens' keys
# and values are written at positions `start ..`, and they attend to everything from position 0,
# whatever is already in the cache. Our cache here is one contiguous strip of slots for a single
# sequence (chapter 04 shows why the engine does something cleverer).

# %%
from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata

BS, DEV = runner.block_size, runner.device


def new_cache(max_tokens: int):
    """A private KV cache for one sequence of up to max_tokens: per layer (k, v), each
    [blocks, block_size, kv_heads, head_dim], used as one contiguous strip of slots."""
    blocks = -(-max_tokens // BS)
    return allocate_kv_cache(hf, blocks, BS, runner.dtype, DEV)[1], blocks


@torch.inference_mode()
def forward(token_ids: list[int], start: int, cache) -> torch.Tensor:
    """Run tokens at positions start .. start+n-1; returns fp32 logits [vocab] of the last one."""
    kv, blocks = cache
    n, ctx = len(token_ids), start + len(token_ids)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)
    meta = AttentionMetadata(
        cu_seqlens_q=i32([0, n]), cu_seqlens_k=i32([0, ctx]), context_lens=i32([ctx]),
        slot_mapping=torch.arange(start, ctx, device=DEV),  # where the new K/V go
        block_tables=i32([list(range(blocks))]), max_seqlen_q=n, max_seqlen_k=ctx, block_size=BS,
        is_decode_only=n == 1, q_lens_cpu=[n], context_lens_cpu=[ctx])
    runner.backend.prepare(meta)
    hidden = model(torch.tensor(token_ids, device=DEV), torch.arange(start, ctx, device=DEV),
                   ForwardContext(meta, runner.backend, kv))
    return model.compute_logits(hidden[-1:])[0]


def generate_without_cache(prompt_ids, n):
    seq = list(prompt_ids)
    for _ in range(n):  # every token: a fresh cache and the WHOLE sequence through the model
        seq.append(int(forward(seq, 0, new_cache(len(seq))).argmax()))
    return seq[len(prompt_ids):]


def generate_with_cache(prompt_ids, n):
    cache = new_cache(len(prompt_ids) + n)
    seq = list(prompt_ids)
    logits = forward(seq, 0, cache)  # prefill: the prompt once
    for _ in range(n):
        seq.append(int(logits.argmax()))
        logits = forward(seq[-1:], len(seq) - 1, cache)  # decode: ONLY the newest token
    return seq[len(prompt_ids):]


# %%
# NBVAL_CHECK_OUTPUT
PROMPT = 'If the object supports the buffer protocol, the'
prompt_ids = tok.encode(PROMPT)
N = 16
no_cache = generate_without_cache(prompt_ids, N)
with_cache = generate_with_cache(prompt_ids, N)
engine_out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
print("without cache:", no_cache)
print("with cache   :", with_cache)
print("engine       :", list(engine_out.outputs[0].token_ids))
print("all identical:", no_cache == with_cache == list(engine_out.outputs[0].token_ids))
print(repr(PROMPT + tok.decode(with_cache)))

# %% [markdown]
# Three routes, one answer: reusing keys and values is an exact optimisation, not an approximation.
# (With floating point, the two routes add numbers in a different order, so logits can differ in the
# last bits; greedy tokens agree unless two candidates are within that rounding of each other.)
#
# ## 3. Cost per token as the sequence grows
#
# Now the price of each route for producing the token after a sequence of `L` tokens:
#
# * **without a cache**: one forward pass over all `L` tokens;
# * **with a cache**: one forward pass over one token that attends to `L` cached keys and values;
# * **the engine**: a decode step at that length, from its `StepRecord` (the same arithmetic as "with
#   a cache", plus the engine's scheduling and bookkeeping, but on a CPU replayed from a recorded graph
#   of C calls instead of run operation by operation from Python: chapter 11; so it can come out
#   faster than the by-hand step).
#
# Each by-hand route is timed five times at every length, the lengths taking turns. We keep the
# **fastest** of the five:
# other processes on a shared machine can only add time to a run, never remove it, so the fastest
# run is the closest to the step's own cost (the chart's bars reach up to the slowest run). Beside
# the times, the FLOPs each route must do, counted from the model's shape by the engine's roofline
# module (`minivllm.telemetry.roofline.step_cost`: 2 FLOPs per weight per token, plus attention's
# `QK^T` and `PV`; chapter 06 sets such counts against the machine's measured limits, the roofline).
#
# ### Exercise 1 · How much does the cache save at L = 512?
#
# The longest length measured below is `L = 512`. Without a cache, the step runs 512 tokens through
# the model; with one, it runs one token that reads 511 cached keys and values. The next cell times
# the two routes at short lengths first: passes over 16 and over 64 tokens without a cache, and a
# one-token step with 15 cached tokens. Draw a straight line through the two passes to reach 512
# tokens, suppose the one-token step costs about the same at any length, and predict how many times
# longer the step **without** a cache takes than the step **with** one at `L = 512`, on this machine.

# %%
from pydoc_data.topics import topics  # a long English text that ships with Python

from minivllm.telemetry.roofline import step_cost

text_ids = tok.encode(topics["for"] + topics["while"] + topics["if"])
LENGTHS = [16, 64, 128, 256, 512]
REPEATS = 5
assert len(text_ids) > max(LENGTHS), len(text_ids)


def timed_ms(fn, repeats=REPEATS):
    """Wall times of `repeats` calls of fn, in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


short_scratch = {L: new_cache(L) for L in (16, 64)}  # made outside the clock, as below
forward(text_ids[:16], 0, short_scratch[16])  # untimed: the first pass pays one-off costs
short_cache = new_cache(16)
forward(text_ids[:15], 0, short_cache)  # the first 15 tokens' K/V, for the one-token step
short = {L: min(timed_ms(lambda: forward(text_ids[:L], 0, short_scratch[L]))) for L in (16, 64)}
forward(text_ids[15:16], 15, short_cache)  # untimed: the passes above left the CPU's caches cold for it
short_step = min(timed_ms(lambda: forward(text_ids[15:16], 15, short_cache), repeats=3 * REPEATS))
del short_scratch, short_cache
print(f"without a cache: a pass over 16 tokens {short[16]:.2f} ms, over 64 tokens {short[64]:.2f} ms (each the "
      f"fastest of {REPEATS}); with a cache: one token after 15 cached {short_step:.2f} ms (the fastest of "
      f"{3 * REPEATS}, a short call that load moves more)")

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: time without cache / time with cache at L = 512 (a ratio, x)

# %%
rows = []
# 10 decode steps: the first 5 after the prefill run slower (they warm up: the prefill left the CPU's caches
# cold for them), so the median is over the last 5
greedy11 = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
idle_engine(engine)  # a request an interrupted run of this cell left would join its steps
warm = new_cache(LENGTHS[0])
forward(text_ids[:LENGTHS[0]], 0, warm)  # untimed: the first pass pays one-off costs, which the shortest L would carry
# Made, and written once, outside the clock: every timed pass without a cache rewrites all L slots of
# its scratch cache; the cached step's cache holds the first L-1 tokens' K/V.
scratch = {L: new_cache(L) for L in LENGTHS}
cache = {L: new_cache(L) for L in LENGTHS}
for L in LENGTHS:
    forward(text_ids[:L], 0, scratch[L])
    forward(text_ids[:L - 1], 0, cache[L])
# The lengths take turns, round after round, so that a slow moment of the machine (or one that
# speeds up as the run goes on) falls on every length alike instead of looking like a trend in L.
# The one-token steps run in rounds of their own, as the short step above was timed: right after an
# L-token pass a step runs with the CPU caches that pass left cold, slower by more the longer the pass,
# which would look like a step that grows with L.
full = {L: [] for L in LENGTHS}
step = {L: [] for L in LENGTHS}
for _ in range(REPEATS):
    for L in LENGTHS:
        full[L] += timed_ms(lambda: forward(text_ids[:L], 0, scratch[L]), repeats=1)
for L in LENGTHS:  # untimed: one step each, so the first timed round does not pay for the last pass
    forward(text_ids[L - 1:L], L - 1, cache[L])
for _ in range(REPEATS):
    for L in LENGTHS:
        step[L] += timed_ms(lambda: forward(text_ids[L - 1:L], L - 1, cache[L]), repeats=1)  # the token at L-1
for L in LENGTHS:
    engine.add_request(f"len{L}", text_ids[:L - 1], greedy11)  # prompt of L-1: its first decode step has context L
    recs = []
    while engine.has_unfinished_requests():
        recs.append(engine.step_with_record().record)
    decode_ms = [r.wall_ms for r in recs if r.phase == "decode"][5:]  # past the warm-up (contexts L+5 to L+9)
    flops_full, _ = step_cost(engine.model_cost, [(L, L)], 1)
    flops_step, _ = step_cost(engine.model_cost, [(1, L)], 1)
    rows.append(dict(L=L, no_cache_ms=min(full[L]), no_cache_max=max(full[L]), cache_ms=min(step[L]),
                     cache_max=max(step[L]), engine_decode_ms=statistics.median(decode_ms),
                     # for comparing the two one-token steps like with like: the median of each one's five times,
                     # and its noise, the range of the middle three of the five (one outlying time, such as a
                     # request's first decode step, does not widen it)
                     cache_median=statistics.median(step[L]), cache_spread=sorted(step[L])[3] - sorted(step[L])[1],
                     engine_spread=sorted(decode_ms)[3] - sorted(decode_ms)[1],
                     no_cache_mflop=flops_full / 1e6, cache_mflop=flops_step / 1e6))
del scratch, cache

df = pd.DataFrame(rows).set_index("L")
df["time ratio"] = df.no_cache_ms / df.cache_ms
df["FLOP ratio"] = df.no_cache_mflop / df.cache_mflop
df[["no_cache_ms", "cache_ms", "engine_decode_ms", "time ratio", "FLOP ratio"]].round(2)  # the FLOPs: next cell

# %%
# NBVAL_CHECK_OUTPUT
print("FLOPs the step must do, from the config (roofline.step_cost):")
for r in rows:
    print(f"  L={r['L']:4d}: without cache {r['no_cache_mflop']:10.1f} MFLOP   with cache {r['cache_mflop']:7.2f} MFLOP"
          f"   ratio {r['no_cache_mflop'] / r['cache_mflop']:6.1f}")

# %%
import plotly.graph_objects as go

from widgets import show_figure


def bars(col):
    return dict(type="data", symmetric=False, array=df[f"{col}_max"] - df[f"{col}_ms"], arrayminus=0 * df[f"{col}_ms"])


fig = go.Figure()
fig.add_scatter(x=df.index, y=df.no_cache_ms, error_y=bars("no_cache"), mode="lines+markers",
                name="without cache: L tokens per step")
fig.add_scatter(x=df.index, y=df.cache_ms, error_y=bars("cache"), mode="lines+markers",
                name="with cache: 1 token per step (by hand)")
fig.add_scatter(x=df.index, y=df.engine_decode_ms, mode="lines+markers", name="engine decode step (median of its steps)")
fig.update_layout(title=f"Measured cost of the next token after L tokens<br><sup>by hand: fastest of {REPEATS}, "
                        f"bars up to the slowest; engine: median of its decode steps</sup><br><sup>{RUN}</sup>",
                  xaxis_title="sequence length L (tokens)", yaxis_title="time for one token (ms)", height=420,
                  yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.25))
show_figure(fig)
longest = LENGTHS[-1]
print(f"at L={longest}: without cache {df.no_cache_ms[longest]:.1f} ms, with cache {df.cache_ms[longest]:.2f} ms "
      f"({df['time ratio'][longest]:.1f}x); the FLOPs differ {df['FLOP ratio'][longest]:.0f}x")
_ = check_prediction(my_prediction_1, df["time ratio"][longest], rel_tol=0.5, unit="x",
                     what="the time ratio (without cache / with cache) at the longest length",
                     hint="Compare the FLOP ratio printed above with the time ratio: what does a one-token step "
                          "cost that does not shrink with its tokens? (Chapter 01 timed a one-token pass too.)")
# the exercise's straight line (a noisy run where the 64-token pass came out faster gives it no rise, not a fall)
line_full = short[16] + max(0.0, short[64] - short[16]) / (64 - 16) * (longest - 16)
print(f"the exercise's route: the line through the 16- and 64-token passes reaches {line_full:.1f} ms at L={longest} "
      f"(measured {df.no_cache_ms[longest]:.1f} ms); over the one-token step timed first, {short_step:.2f} ms "
      f"(at L={longest}: {df.cache_ms[longest]:.2f} ms), that gives {line_full / short_step:.1f}x")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# The timed passes give the estimate: each extra token a pass without a cache carries adds
# `(t64 - t16) / 48` ms, so a 512-token pass takes about `t16 + 496 × (t64 - t16) / 48`, and the ratio is
# that over the one-token step's time. The last line under the check works it out for this run, beside
# what was measured at 512. Why is it nowhere near 512x, or even the FLOP ratio? Start from the work.
# Both routes run every weight once per token they push through the model, so
# the matmul FLOPs differ by the number of tokens: 512 against 1. Two things pull the FLOP ratio
# printed above below 512: both routes pay the LM head once (logits for the last position only), and
# the cached step still does attention over all 511 earlier keys and values. (Without a cache the
# attention work grows with `L²`, about `L²/2` query-key pairs under the causal mask, but against the
# cached step's `L` pairs that is only `L/2` times as much, less than the matmuls' factor of `L`.) If
# time followed FLOPs, that ratio would be the answer.
#
# It does not, because the cached step is tiny: one token through this small model is little
# arithmetic for any modern processor (the `with cache` column printed above), yet the
# step costs the fixed price of every pass (Python in each module, dozens of small operations
# launched one by one). The step without a cache pays the same fixed price plus real arithmetic. So
# the time ratio is the FLOP ratio squeezed by that fixed cost: compare the two figures on the line
# above the check.
#
# A large model with negligible fixed costs would not necessarily bring the time ratio up to the FLOP ratio
# either. Time follows FLOPs only when both steps are limited by arithmetic. A one-token step does
# two FLOPs per weight it reads, so on a GPU it is usually limited by memory traffic (reading the
# weights); a 512-token step reads the same weights once and does 512 times the arithmetic, so on
# a large GPU it can be limited by arithmetic instead. The time ratio is then far below the FLOP
# ratio; chapter 06 draws this as a roofline. A guess near the FLOP ratio fits only where both
# steps are bound by arithmetic; for this small model, whose few MB of weights a CPU's cache can keep,
# fixed costs (Python, launching each small operation) decide first.
# </details>

# %% [markdown]
# What the measurements show, on this run (each sentence below is built from, or checked against,
# the table above):

# %%
import numpy as np

below = [L for L in LENGTHS if df["time ratio"][L] < df["FLOP ratio"][L]]
where = ("at every length measured" if below == LENGTHS else
         f"at L = {', '.join(map(str, below))} only" if below else "at none of the lengths measured")
# each series' median over all lengths (of its medians of five): one length's figure carries that moment's load
e0, c0 = statistics.median(df.engine_decode_ms), statistics.median(df.cache_median)


def trend(what, col, spreads):
    """A sentence on a straight line through df[col] against L: its rise from the shortest to the longest L,
    set against the noise at one length: the range of the middle three of five times (median over the lengths).
    Only a rise of more than twice that noise counts as growth."""
    rise = np.polyfit(LENGTHS, df[col].to_numpy(), 1)[0] * (longest - LENGTHS[0])
    noise = float(np.median(spreads))
    clear = abs(rise) > 2 * noise
    verdict = ("it grows measurably. " if clear and rise > 0 else
               "a step cannot get cheaper with more context, so other load on the machine changed between lengths. "
               if clear else "on this run its growth with L is lost in the noise. ")
    return clear and rise > 0, (
        f"A straight line through {what} {'rises' if rise >= 0 else 'falls'} by {abs(rise):.2f} ms from "
        f"L={LENGTHS[0]} to L={longest}, {'more' if clear else 'not more'} than twice the noise at one length "
        f"(the middle three of its five times span {noise:.2f} ms, median over the lengths): " + verdict)


grows_c, cache_text = trend("the hand-written cached step's median times", "cache_median", df.cache_spread)
grows_e, engine_text = trend("the engine's median decode step times", "engine_decode_ms", df.engine_spread)
_ = render(f"The measured time ratio is smaller than the FLOP ratio **{where}** (at L={longest}: "
           f"{df['time ratio'][longest]:.1f}x against {df['FLOP ratio'][longest]:.0f}x). Without a cache the "
           f"time per token went from {df.no_cache_ms.iloc[0]:.1f} ms at L={LENGTHS[0]} to "
           f"{df.no_cache_ms[longest]:.1f} ms at L={longest} ({df.no_cache_ms[longest] / df.no_cache_ms.iloc[0]:.1f}x, "
           f"fastest times). "
           + cache_text + engine_text
           + f"The engine's step is {'leaner' if e0 < c0 else 'not leaner'} (median {e0:.2f} ms over the lengths "
           f"against the hand-written step's {c0:.2f} ms)"
           + (", so the part that grows with L, the attention over the cached entries (read from memory at every "
              "step), is a larger share of it." if e0 < c0 and grows_e else "."))
grow_no_cache = df.no_cache_ms[longest] / df.no_cache_ms.iloc[0]
grow_cache = df.cache_ms[longest] / df.cache_ms.iloc[0]
_ = check_claim("without a cache the time per token climbs with the sequence at every step of L",
                df.no_cache_ms.is_monotonic_increasing, ", ".join(f"{v:.1f}" for v in df.no_cache_ms) + " ms",
                why_it_may_not="Another process competing for the CPU can slow one measurement; rerun the cell.")
_ = check_claim("with a cache the time per token grows far less than without one (under a third as much, "
                "from the shortest to the longest L)",
                grow_cache < grow_no_cache / 3, f"{grow_cache:.2f}x with a cache, {grow_no_cache:.1f}x without",
                why_it_may_not="Load from other processes adds noise to a step this short; rerun the cell.")

# %% [markdown]
# Without a cache the cost per token climbs with the sequence: the FLOPs grow about in proportion
# to `L`, and so, once the step is big enough to be dominated by arithmetic, does the time. With a
# cache the *work* per token grows far less: one token's worth of matmuls, plus attention over `L`
# cached entries, whose FLOPs grow with `L` but stay small next to the weights until contexts get
# long (the `with cache` column printed above). The measured *time* of the hand-written step may not
# visibly grow at all: its fixed costs dominate, and run-to-run noise can exceed the extra attention;
# whether it grew on this run, and whether the engine's leaner step showed more of it, the sentences
# above say.
# Where the time ratio falls short of the FLOP ratio, the reason is that a one-token step on a
# small model is dominated by costs that do not depend on the context (Python, launching dozens of
# small operations, and on a model too large for the CPU's caches reading its weights once), not by
# FLOPs; chapter 06 weighs the weight reads, chapter 11 takes the rest apart.
#
# Over a whole generation the difference compounds: producing token `L` costs about `a + b·L`
# without a cache (plus a smaller `c·L²` from attention over the `L` tokens), so `n` tokens cost at
# least `n·a + b·n²/2`, quadratic in the length. We have not timed a 512-token generation without a
# cache (this chapter keeps its cells short), but a curve through the five measured lengths, summed
# over every length from 1 to 512, gives an **estimate**. The cached route's times grow far less with `L` (by how much on
# this run, the sentences above say), so noise can tilt its line downward; a negative slope would predict times falling towards zero, so where the fit comes out
# negative the cell uses the median of the measured times as a constant instead:

# %%
ls = np.array(LENGTHS, dtype=float)
# Without a cache: a + b L + c L^2 (attention over the L tokens adds the squared part); a noisy run
# can bend that fit into a negative fixed cost or curvature, and then the straight line is used.
c_nc, b_nc, a_nc = np.polyfit(ls, df.no_cache_ms.to_numpy(), 2)
no_cache_fit = "quadratic fit"
if a_nc < 0 or c_nc < 0:
    c_nc, (b_nc, a_nc) = 0.0, np.polyfit(ls, df.no_cache_ms.to_numpy(), 1)
    no_cache_fit = "straight-line fit (the quadratic one had a negative term)"
b_c, a_c = np.polyfit(ls, df.cache_ms.to_numpy(), 1)
cache_fit = "straight-line fit"
if b_c < 0:  # noise tilted the line down: a step's time cannot shrink with more context, so use a constant
    b_c, a_c = 0.0, float(np.median(df.cache_ms))
    cache_fit = "median as a constant (the fitted slope was negative)"
every_length = np.arange(1, longest + 1)
est_no_cache_s = float(np.sum(a_nc + b_nc * every_length + c_nc * every_length ** 2)) / 1e3
est_cache_s = float(np.sum(a_c + b_c * every_length)) / 1e3
print(f"fit without cache: {a_nc:.2f} ms + {b_nc * 1e3:.1f} µs x L + {c_nc * 1e6:.2f} ns x L^2;  "
      f"with cache: {a_c:.2f} ms {b_c * 1e3:+.2f} µs x L")
_ = render(f"**Estimate, not a measurement** (fits of the fastest times above, summed over L = 1 .. {longest}; "
           f"without a cache a {no_cache_fit}, with a cache a {cache_fit}): "
           f"generating {longest} tokens from a one-token start would take about **{est_no_cache_s:.1f} s without a "
           f"cache** and **{est_cache_s:.1f} s with one** on this machine, about {est_no_cache_s / est_cache_s:.0f}x apart.")

# %% [markdown]
# ## 4. What the cache costs: bytes per token
#
# Every token in the cache stores one key and one value vector per KV head, in every layer:
#
# `KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element`

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.engine.kv_cache import kv_bytes_per_token
from minivllm.models.hf_config import get_head_dim

elem = torch.empty((), dtype=runner.kv_dtype).element_size()  # the cache's dtype: the model's by default
formula = 2 * hf.num_hidden_layers * hf.num_key_value_heads * get_head_dim(hf) * elem
print(f"from the config: 2 x {hf.num_hidden_layers} layers x {hf.num_key_value_heads} kv heads x "
      f"{get_head_dim(hf)} head_dim x {elem} bytes ({runner.kv_dtype}) = {formula:,} bytes per token")
kv = runner.kv_cache  # the engine's whole KV pool: one tensor
slots = engine.block_manager.num_blocks * engine.block_manager.block_size
measured = kv.numel() * kv.element_size() / slots
print(f"measured: the engine's KV tensor {list(kv.shape)} = {kv.numel() * kv.element_size():,} bytes "
      f"for {slots:,} token slots = {measured:,.0f} bytes per token")
print("engine's own sizing function kv_bytes_per_token():", kv_bytes_per_token(hf, runner.kv_dtype))
print("match:", formula == measured == kv_bytes_per_token(hf, runner.kv_dtype))
mha = 2 * hf.num_hidden_layers * hf.num_attention_heads * get_head_dim(hf) * elem
print(f"with one KV head per query head ({hf.num_attention_heads}, no grouping) it would be {mha:,} bytes: "
      f"grouped-query attention saves {1 - formula / mha:.0%}")

# %% [markdown]
# The last factor is the cache's own dtype, which is the model's unless the engine is told otherwise:
# vLLM's `kv_cache_dtype="bfloat16"` halves it for a float32 model (chapter 11 measures what that does
# to a decode step, and what it costs in precision).
#
# For a real model the numbers get serious. minivllm ships the configuration of Qwen3-0.6B (no
# weights needed for what follows):

# %%
# NBVAL_CHECK_OUTPUT
import json
from importlib.resources import files

from transformers import Qwen3Config

cfg06 = Qwen3Config(**json.loads((files("minivllm") / "assets/configs/qwen3-0.6b/config.json").read_text()))
print(f"Qwen3-0.6B: {cfg06.num_hidden_layers} layers, {cfg06.num_attention_heads} query heads, "
      f"{cfg06.num_key_value_heads} KV heads, head_dim {cfg06.head_dim}, hidden size {cfg06.hidden_size}")

# %% [markdown]
# ### Exercise 2 · KV bytes per token of Qwen3-0.6B
#
# From the figures just printed, how many bytes of KV cache does one token need in Qwen3-0.6B with
# bf16 (2 bytes per element)? The next cell asks the engine's own allocator for one block of 16
# token slots with that configuration and measures the tensor it returns.

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: KV bytes per token, Qwen3-0.6B, bf16

# %%
# NBVAL_CHECK_OUTPUT
CONTEXT = 32_768  # one long conversation, in tokens
kv06 = {}
for dt in (torch.bfloat16, torch.float32):
    pool, _ = allocate_kv_cache(cfg06, 1, 16, dt, torch.device("cpu"))  # one block of 16 token slots
    kv06[dt] = pool.numel() * pool.element_size() // 16
    print(f"Qwen3-0.6B in {str(dt).replace('torch.', '')}: {kv06[dt]:,} bytes per token measured, "
          f"formula {kv_bytes_per_token(cfg06, dt):,}; a {CONTEXT:,}-token context needs "
          f"{kv06[dt] * CONTEXT / 2**30:.2f} GiB")
    del pool

# %%
_ = check_prediction(my_prediction_2, kv06[torch.bfloat16], rel_tol=0.02, unit="bytes",
                     what="the measured bytes per token (bf16)")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Each layer stores, per token, one key and one value vector for each **KV** head (not each query
# head: grouped-query attention shares them). So per token:
# `2 (K and V) x layers x KV heads x head_dim x 2 bytes`. With the layer count, KV-head count and
# head dimension printed above, that is the measured figure; a guess that used the query heads
# instead of the KV heads comes out too large by the group size (query heads per KV head). The
# allocator's tensor has exactly that many bytes per slot: the KV cache is nothing but these
# vectors, with no overhead per token.
# </details>

# %% [markdown]
# Now set that against the model itself. The next cell builds minivllm's Qwen3-0.6B module on
# PyTorch's `meta` device (shapes only, no memory) and counts its parameters; in bf16 each takes 2
# bytes.

# %%
from minivllm.models.qwen3 import Qwen3ForCausalLM

with torch.device("meta"):
    params06 = sum(p.numel() for p in Qwen3ForCausalLM(cfg06).parameters())  # tied embeddings counted once
weights06_gib = params06 * 2 / 2**30
kv_context_gib = kv06[torch.bfloat16] * CONTEXT / 2**30
print(f"Qwen3-0.6B: {params06:,} parameters -> {weights06_gib:.2f} GiB of bf16 weights")
_ = render(f"About **{kv06[torch.bfloat16] / 1024:.0f} KiB per token** in bf16: a single {CONTEXT:,}-token "
           f"conversation holds **{kv_context_gib:.2f} GiB** of KV, **{kv_context_gib / weights06_gib:.1f}x** the "
           f"model's own {weights06_gib:.2f} GiB of bf16 weights ({params06 / 1e6:.0f}M parameters x 2 bytes). "
           f"Serving many users at once is therefore mostly a question of KV memory, which is why the next chapter "
           f"is about managing it.")

# %% [markdown]
# ## 5. Watch the engine's cache fill
#
# The engine does not reserve a strip per sequence. It hands out blocks of 16 token slots, one at
# a time, as a sequence grows. Below, a request with a 30-token prompt asks for 40 tokens; the
# view shows the engine's KV pool (each cell a block, coloured by owner; hover for the tokens it
# holds). The cell takes the first 12 steps (the prefill and 11 decode steps, listed in the printout
# after it); press the stepper's **Step** for the rest and watch a new block appear each time the
# tokens with KV pass a multiple of 16.

# %%
from widgets import EngineStepper, KVCacheView

stepper = EngineStepper(llm, max_tokens=40, show_chart=False)
view = KVCacheView(llm, stepper=stepper)
# section 3's requests began with the same text, and the engine kept their full blocks for reuse (prefix
# caching, chapter 08); Reset forgets them (and aborts whatever an earlier run of this cell left), so this
# request computes and stores every one of its tokens itself
stepper.reset()
rid = stepper.add_request(text_ids[:30], max_tokens=40, ignore_eos=True)
history = []
for _ in range(12):  # the prefill, then 11 decode steps
    r = stepper.step()
    seq = stepper.sequence(rid)
    history.append((r.index, r.phase, seq.num_computed_tokens, len(seq.block_table), r.kv_blocks_used))
stepper.display()
view.display()

# %%
# NBVAL_CHECK_OUTPUT
per_token = kv_bytes_per_token(hf, runner.dtype)
print("(step numbers count this engine's steps since it was built, earlier sections' included)")
for index, phase, n, blocks, used in history:
    print(f"step {index}: {phase:7s} tokens with KV {n:3d} -> blocks held {blocks} ({blocks * BS} slots, "
          f"{blocks * BS * per_token / 1024:.0f} KiB reserved, {n * per_token / 1024:.1f} KiB used)")

# %%
_ = check_claim(f"the reserved slots never run a whole block ({BS} slots) ahead of the tokens stored",
                all(0 <= blocks * BS - n < BS for _, _, n, blocks, _ in history),
                "slack per step: " + ", ".join(str(blocks * BS - n) for _, _, n, blocks, _ in history) + " slots")

# %% [markdown]
# The reserved memory steps up one block at a time and never runs a whole block ahead of what is
# used (the check above). Press **Run to end** above and the request finishes: its blocks go back
# to the pool (the full ones stay registered in the prefix cache, hatched: chapter 08).
#
# ## 6. Playground
#
# How many conversations fit in a device's memory? Set `MEMORY_GIB` to the memory of a GPU you know
# (or of this machine) and run the cell: it subtracts Qwen3-0.6B's bf16 weights and fills the rest
# with KV cache. That is an upper bound: a real engine also needs room for activations, runtime
# buffers and (on a GPU) the CUDA context, so fewer tokens fit in practice. Look for: the point where the weights stop mattering, and how few long conversations
# fit next to the number of short ones.

# %% tags=["playground"]
MEMORY_GIB = 24  # the knob: memory available to the engine, in GiB

kv_room = MEMORY_GIB * 2**30 - params06 * 2
tokens_fit = max(0, kv_room) // kv06[torch.bfloat16]
print(f"{MEMORY_GIB} GiB - {weights06_gib:.2f} GiB of weights = {max(0, kv_room) / 2**30:.2f} GiB for KV: "
      f"at most {tokens_fit:,} tokens of Qwen3-0.6B in bf16 (activations and buffers take part of it)")
for ctx in (512, 4_096, 32_768):
    print(f"  conversations of {ctx:6,} tokens that fit at once: at most {tokens_fit // ctx:,}")

# %% [markdown]
# ## 7. Check yourself

# %%
from widgets import Quiz, Question

kib06 = kv06[torch.bfloat16] / 1024
batch_gib = 64 * 4096 * kv06[torch.bfloat16] / 2**30
Quiz([
    Question(
        "Why can the keys and values of earlier tokens be reused when a new token is added?",
        ["They are approximations that are good enough", "Attention is causal: earlier tokens never attend to "
         "later ones, so their keys and values do not change", "The model is small", "The weights are frozen "
         "during inference, so every activation is constant"],
        1,
        ["The cached route gave exactly the tokens of the full recomputation above; it is not an approximation.",
         "Right: a token's K and V depend only on it and the tokens before it, which a new token does not change.",
         "The argument is the same for a 70B model; only the savings are larger.",
         "Frozen weights are necessary but not enough: without causal masking, every earlier token's hidden "
         "state would change when a token is appended, and nothing could be reused."],
    ),
    Question(
        "Without a KV cache, generating n tokens costs about how much work compared to with one?",
        ["The same", "About twice as much", "Roughly n/2 times as much for outputs much longer than the prompt (somewhat less while "
         "the LM head, run once per step either way, is a large share, and nearer n/3 where attention over long "
         "contexts dominates): each step redoes the whole sequence",
         "Less, because there is no cache to manage"],
        2,
        [f"The FLOPs per token without a cache grow with L ({df.no_cache_mflop.iloc[0]:.0f} to "
         f"{df.no_cache_mflop[longest]:.0f} MFLOP from L={LENGTHS[0]} to {longest} above); with one only from "
         f"{df.cache_mflop.iloc[0]:.1f} to {df.cache_mflop[longest]:.1f}.",
         f"The ratio grows with the length: one token at L={longest} costs {df['FLOP ratio'][longest]:.0f}x the FLOPs "
         f"without a cache (the table above), and a whole generation's ratio is about the average of that over "
         f"its steps.",
         "Right: step i processes about p + i tokens instead of 1, so the total grows with the square of the "
         "length; with a cache it grows mostly linearly (only the attention over the cached entries grows).",
         "Managing the cache costs bookkeeping, but recomputation costs far more FLOPs (table above)."],
    ),
    Question(
        f"Qwen3-0.6B in bf16 holds about {kib06:.0f} KiB of KV per token. What does a batch of 64 requests "
        "with 4,096 tokens each need?",
        [f"About {batch_gib:.0f} GiB", f"About {kib06:.0f} MiB",
         f"About {kib06 * 16384 / 2**20:.2f} GiB", "Nothing extra: the cache is in the weights"],
        0,
        [f"Right: 64 x 4,096 tokens x {kv06[torch.bfloat16]:,} bytes = {batch_gib:.0f} GiB, "
         f"{batch_gib / weights06_gib:.0f}x the {weights06_gib:.2f} GiB of weights.",
         "That is the cache of 1,024 tokens, not of 64 x 4,096 = 262,144.",
         "That is the cache of one 16k-token request, not 64 requests of 4k.",
         "The KV cache is per token of every live request, separate from the weights."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * explain why causal attention makes earlier tokens' keys and values reusable, and show on the
#   engine's model that caching them changes the cost, not the computation (results agree up to
#   floating-point rounding);
# * measure the cost per token with and without a cache against the sequence length, and say why the
#   time ratio falls short of the FLOP ratio on a small model;
# * estimate a whole generation's time from a fit of per-token times, and label it as an estimate;
# * compute KV bytes per token (`2 x layers x kv_heads x head_dim x element size`) and check it
#   against a real allocation; say how much grouped-query attention saves;
# * set KV memory against weight memory for a real model, and see why serving at scale is a
#   question of KV memory.
#
# Next: chapter 04, how the engine hands out that memory in blocks (PagedAttention).
