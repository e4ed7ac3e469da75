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
# # 08 · Prefix Caching
#
# **Goal:** understand how the engine reuses the KV blocks of a prompt prefix it has already computed,
# measure what that saves, and see when eviction takes the savings away.
#
# **Prerequisites:** chapter 03 (what the KV cache holds), chapter 04 (KV blocks and block tables),
# chapter 05 (requests, steps, the scheduler) and the time to first token, TTFT (chapter 07).
#
# **Time:** about 35 minutes.
#
# Many requests to a served model begin with the same tokens: a system prompt, a few-shot template,
# the conversation so far. Their keys and values in every layer are the same too, because a token's KV
# depends only on that token, its position and the tokens before it (attention is causal).
# **Prefix caching** keeps the KV blocks of prompts already
# computed and hands them to any later request whose prompt starts with the same tokens, so its
# prefill only computes what is new.
#
# **You will:** send requests that share a system prompt and watch them reuse the same physical KV
# blocks · predict, then measure, the hit rate, and measure the time to first token with and without
# caching · check that the greedy output does not change (the reused KV is mathematically the same as
# the KV a fresh prefill computes, up to floating-point rounding; section 1 compares the greedy tokens
# on this run) · shrink the KV pool until cached blocks are evicted, least recently used first, predict
# where the hit rate starts to fall and measure it · explore it live in the prefix cache view.

# %% [markdown]
# ## Setup
#
# `MODEL` is the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names another model. KV blocks of
# 16 tokens. Two engines on the same weights: one with prefix caching (the default,
# `enable_prefix_caching=True`) and one without.

# %% tags=["parameters"]
import os

import pandas as pd
import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
BLOCK_SIZE = 16                            # tokens per KV block

# %%
SYSTEM = 'You are a helpful assistant for the Python standard library. Answer with the name of the function or class first, then its signature, then one sentence on what it returns. When a function takes an optional argument, say what the default is. When an exception can be raised, name it and say when. If the object supports the iterator protocol, say so. Prefer the built-in functions and the modules documented in the library reference; do not invent modules. Keep every answer short: a signature and two sentences at most.\n\n'
QUESTIONS = ['Question: how do I sort a list?', 'Question: how do I open a file?', 'Question: what does len() return?', 'Question: how do I join strings?', 'Question: how do I read a line?', 'Question: what does zip() do?', 'Question: how do I copy a dict?', 'Question: what is a generator?', 'Question: how do I round a float?', 'Question: what does repr() return?']

cached = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=128, enable_prefix_caching=True)
plain = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=128, enable_prefix_caching=False)
tok = cached.get_tokenizer()
print(describe(cached))
print(f"torch threads: {torch.get_num_threads()}")


def setting(llm):
    """Model, device, dtype and threads of a live LLM: every chart title carries them."""
    cfg = llm.llm_engine.config
    return (f"{llm.llm_engine.source.name}, {cfg.device}, {str(cfg.dtype).replace('torch.', '')}, "
            f"{torch.get_num_threads()} thread(s)")

# %% [markdown]
# ## 1. Two requests, one system prompt
#
# How is a hit found? After a step computes a **full** block of a sequence, the block manager hashes
# it: the hash covers the block's 16 token ids *and* the hash of the block before it, so equal hashes
# mean equal token prefixes from position 0, not just equal 16-token windows. (Two different prefixes
# can share a 64-bit hash, rarely; so a hit is also checked against the block's own token ids and its
# link to the block before it, and
# `prefix_caching_hash_algo="sha256"` makes such a collision practically impossible.) A new request walks its
# prompt block by block, looks each hash up, and stops at the first miss. Matching blocks are added to
# its block table; prefill starts after them. Each block keeps a **reference count**: how many live
# requests' block tables hold it. A hit adds one, a finished request's release takes one away, and a
# block is back on the free list only at zero. A block only becomes
# hittable once the step that wrote its KV has finished, and the last prompt token is always computed
# (its logits are needed to sample), so at most `(prompt_len - 1) // 16` blocks can hit.
#
# Below, the first request is prefilled, then the second arrives while the first is still running, so
# for a while both block tables hold the system prompt's blocks.

# %%
# NBVAL_CHECK_OUTPUT
from widgets import idle_engine

greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
eng = cached.llm_engine
idle_engine(eng)  # what an interrupted run of this cell left queued would join its steps
eng.reset_prefix_cache()  # the first request computes the system prompt, also when this cell runs again
sys_len = len(tok.encode(SYSTEM))
print(f"system prompt: {sys_len} tokens = {sys_len // BLOCK_SIZE} full blocks + {sys_len % BLOCK_SIZE} tokens")

bm = eng.block_manager
tables = {}
for rid, q in (("first", QUESTIONS[0]), ("second", QUESTIONS[1])):
    eng.add_request(rid, SYSTEM + q, greedy(4))
    eng.step()  # its prefill (the second's step also decodes the first, which is still running)
    seq = eng.requests[rid].seq
    tables[rid] = list(seq.block_table)
    print(f"{rid:6s}: prompt {len(seq.prompt_token_ids)} tokens, served from the cache {seq.num_cached_tokens}, "
          f"block table {tables[rid]}")
shared = [a for a, b in zip(tables["first"], tables["second"]) if a == b]
print(f"physical blocks in both block tables: {shared} ({len(shared) * BLOCK_SIZE} tokens of KV computed once)")


def counts(blocks):
    return [bm.blocks[b].ref_count for b in blocks]


print(f"while both run:  reference counts {counts(shared)}; on the free list: "
      f"{[b for b in shared if b in bm.free]}")
assert shared and counts(shared) == [2] * len(shared) and not set(shared) & set(bm.free)
while eng.has_unfinished_requests():
    eng.step()
print(f"after both ended: reference counts {counts(shared)}; on the free list: {[b for b in shared if b in bm.free]}, "
      f"still cached (hash kept): {[b for b in shared if bm.blocks[b].hash is not None]}")
assert counts(shared) == [0] * len(shared) and set(shared) <= set(bm.free)
assert all(bm.blocks[b].hash is not None for b in shared)

# %% [markdown]
# The second request's block table *starts with the same physical block ids* as the first's: those
# blocks hold the system prompt's KV, computed once. Its prefill computed only the tokens after them.
# While both ran, each shared block had a reference count of 2 and was off the free list, so nothing
# could evict it. When both had finished, the counts fell to 0 and the blocks went back on the free
# list *with their hashes*: still cached, until the pool needs the block for something else (section 3).
# Only full blocks are shared, and only when all 16 of their tokens match: if the system prompt does
# not end exactly on a block boundary, the block holding its last tokens also holds the question's
# first tokens, so that block is computed again for every request.
#
# Reuse must not change the answer, beyond floating-point rounding: a prefill that reads cached KV adds
# up its attention in another order than one that computes it, so the logits can differ in their last
# bits, and only a near-tie between the two most likely tokens could flip a greedy token (in
# bf16, whose rounding is coarser, a flip is likelier). Greedy tokens of every question, with and without caching:

# %%
# NBVAL_CHECK_OUTPUT
prompts = [SYSTEM + q for q in QUESTIONS]
with_cache = cached.generate(prompts, greedy(8), use_tqdm=False)
without = plain.generate(prompts, greedy(8), use_tqdm=False)
print("identical greedy tokens for all", len(prompts), "questions:",
      all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(with_cache, without)))
print("example:", repr(QUESTIONS[0]), "->", repr(with_cache[0].outputs[0].text))


# %% [markdown]
# ## 2. Hit rate and time to first token, measured
#
# Now the ten questions arrive one after another (each finishes before the next arrives, so time to
# first token is that request's own prefill, with no queueing). The prefix cache is cleared first,
# so the first request is a cold miss. For each request: prompt tokens, tokens served from the cache
# (`RequestOutput.num_cached_tokens`) and TTFT (`RequestOutput.metrics.ttft_ms`, measured by the
# engine), on both engines.
#
# ### Exercise 1 · The hit rate of ten questions
#
# Every prompt is the system prompt (its length in blocks is printed in section 1) followed by a short
# question; the first two prompts' lengths are printed there too. Of all the prompt tokens of the ten requests, what share
# will the cached engine serve from the prefix cache?

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: cached prompt tokens / all prompt tokens, as a fraction (0.5 = half)


# %%
def one_by_one(llm):
    llm.llm_engine.reset_prefix_cache()
    llm.generate(["warm-up prompt"], greedy(2), use_tqdm=False)  # first-call allocations, off the clock
    rows = []
    for i, p in enumerate(prompts):
        out = llm.generate(p, greedy(4), use_tqdm=False)[0]
        rows.append({"request": i, "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                     "ttft_ms": out.metrics.ttft_ms})
    return pd.DataFrame(rows).set_index("request")


REPEATS = 3  # each engine runs the ten questions three times, interleaved; TTFT spread comes from these
runs = {"on": [], "off": []}
for _ in range(REPEATS):
    runs["on"].append(one_by_one(cached))
    runs["off"].append(one_by_one(plain))
on, off = runs["on"][0].copy(), runs["off"][0].copy()  # token counts are the same in every repeat
for name, df in (("on", on), ("off", off)):
    ttfts = pd.concat([r.ttft_ms for r in runs[name]], axis=1)
    df["ttft_ms"], df["ttft_min"], df["ttft_max"] = ttfts.median(axis=1), ttfts.min(axis=1), ttfts.max(axis=1)

# %%
# NBVAL_CHECK_OUTPUT
for name, df in (("prefix caching on ", on), ("prefix caching off", off)):
    rate = df.cached_tokens.sum() / df.prompt_tokens.sum()
    print(f"{name}: {df.cached_tokens.sum():4d} of {df.prompt_tokens.sum()} prompt tokens from the cache "
          f"(hit rate {rate:.1%}); prefill computed {df.prompt_tokens.sum() - df.cached_tokens.sum()} tokens")
print("cached tokens per request (on):", on.cached_tokens.tolist())

# %%
from widgets import check_claim, check_prediction, render

check_prediction(my_prediction_1, on.cached_tokens.sum() / on.prompt_tokens.sum(), rel_tol=0.1,
                 what="the share of prompt tokens served from the cache");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Request 0 finds an empty cache: none of its tokens hit. Each of the nine others finds the system
# prompt's full blocks cached, so the tokens of those full blocks hit (section 1 printed whether the
# system prompt ends on a block boundary; if not, its last partial block is computed with the
# question), and the rest of the prompt, the question after them, is computed (it differs between
# requests, and the last prompt token is always computed anyway). So the share is about
#
# `9 x (system-prompt tokens in full blocks) / (10 x prompt length)`,
#
# that is nine tenths of the system prompt's share of a prompt: put in the lengths printed in section 1.
# The check compares your figure with the engine's count, and the printout above has the exact number
# of tokens served from the cache.
# </details>

# %%
import plotly.graph_objects as go

from widgets import show_figure

med_on, med_off = on.ttft_ms.iloc[1:].median(), off.ttft_ms.iloc[1:].median()
computed_on = on.prompt_tokens.iloc[1:].sum() - on.cached_tokens.iloc[1:].sum()
token_ratio = off.prompt_tokens.iloc[1:].sum() / computed_on
fig = go.Figure()
for df, name, colour in ((off, "prefix caching off", "#bbbbbb"), (on, "prefix caching on", "#54a24b")):
    fig.add_bar(x=df.index, y=df.ttft_ms, name=name, marker_color=colour,
                error_y=dict(type="data", symmetric=False, array=df.ttft_max - df.ttft_ms,
                             arrayminus=df.ttft_ms - df.ttft_min))
fig.update_layout(barmode="group", title=f"Time to first token, one request at a time (median of {REPEATS} runs, "
                  f"whiskers: min-max)<br><sub>{setting(cached)}</sub>",
                  xaxis=dict(title="request (0 = cold cache)", dtick=1), yaxis_title="TTFT (ms)", height=380)
show_figure(fig)
render(f"Requests 1-9: median TTFT **{med_on:.2f} ms** with caching, **{med_off:.2f} ms** without "
       f"(**{med_off / med_on:.1f}x**), while the cached engine computed **{token_ratio:.1f}x** fewer prompt "
       f"tokens for them.")
check_claim("from request 1 on, prefix caching lowers the median TTFT", med_on < med_off,
            f"{med_on:.2f} ms vs {med_off:.2f} ms",
            why_it_may_not="On a heavily loaded machine the noise of single prefills can swamp the saving; on a "
                           "GPU a tiny model's prefill can take about the same time whatever its length (launching "
                           "the operations, not the arithmetic).")
check_claim("the TTFT ratio is smaller than the ratio of computed prompt tokens", med_off / med_on < token_ratio,
            f"TTFT {med_off / med_on:.1f}x vs tokens {token_ratio:.1f}x",
            why_it_may_not="It needs the short prefill that caching leaves to cost more per token than the full one "
                           "(the cells below measure why it can).");

# %% [markdown]
# Request 0 pays for the whole prompt in both runs. From request 1 on, the cached engine computes
# only what follows the last shared block (the question); without caching every request pays the full
# prefill. Why is the TTFT ratio smaller than the ratio of computed tokens? Because a prefill's time is
# not proportional to its tokens. Part of every step costs the same however few tokens it holds
# (scheduling, building the inputs, sampling, launching each layer's operations), and no cache removes
# it. A matrix multiply over a dozen token rows gets less work done per millisecond than one over a
# hundred (chapter 06: with fewer rows, each weight read, from a cache or from memory, serves fewer
# FLOPs). And the tokens the cached engine does compute still attend over the keys and values of the
# whole cached prefix, a cost the cell below tries to see.
#
# The cell below times prefills on the engine without caching, interleaved and each the median of nine
# runs: a single token (close to the fixed part alone), as many tokens as the cached engine computed
# for request 1 (the same work, with no prefix to attend to), and request 1's whole prompt; and in the
# same rounds the cached engine's request 1 behind request 0's prefix (its cache emptied and refilled
# with request 0 each round, as in section 2), which did that work with a prefix to attend to.

# %%
import statistics

ids_1 = plain.generate(prompts[1], greedy(1), use_tqdm=False)[0].prompt_token_ids  # also a warm-up
n_new, n_all = int(on.prompt_tokens[1] - on.cached_tokens[1]), len(ids_1)
SHORT = {"1 token": ids_1[-1:], f"{n_new} tokens": ids_1[-n_new:], f"{n_all} tokens": ids_1}
short_ttft = {name: [] for name in SHORT}
hit_ttft, hit_cached = [], set()
for _ in range(9):
    for name, ids in SHORT.items():
        short_ttft[name].append(plain.generate([ids], greedy(1), use_tqdm=False)[0].metrics.ttft_ms)
    cached.reset_prefix_cache()
    cached.generate(prompts[0], greedy(1), use_tqdm=False)  # request 0's blocks into the cache
    hit = cached.generate(prompts[1], greedy(1), use_tqdm=False)[0]
    hit_ttft.append(hit.metrics.ttft_ms)
    hit_cached.add(hit.num_cached_tokens)
t_one, t_new, t_all = (statistics.median(short_ttft[name]) for name in SHORT)
render(f"Without caching, a prefill of **1** token took **{t_one:.2f} ms**, one of **{n_new}** tokens (what the "
       f"cached engine computed for request 1) **{t_new:.2f} ms**, and request 1's whole prompt of **{n_all}** "
       f"tokens **{t_all:.2f} ms**. So {n_new} tokens, **{n_new / n_all:.0%}** of the prompt, took "
       f"**{t_new / t_all:.0%}** of its prefill time, and a single token already took **{t_one / t_new:.0%}** "
       f"of the {n_new}-token prefill's time."
       + (f" (Section 2 timed the same whole prompt without caching at **{off.ttft_ms[1]:.2f} ms**, the median of its "
          f"{REPEATS} runs: single prefills of a few milliseconds move this much between cells on this machine.)"
          if abs(t_all - off.ttft_ms[1]) > 0.2 * off.ttft_ms[1] else ""))
check_claim(f"a prefill of {n_new} tokens takes a larger share of the full prefill's time than its share of "
            "the tokens", t_new / t_all > n_new / n_all,
            f"{t_new / t_all:.0%} of the time for {n_new / n_all:.0%} of the tokens",
            why_it_may_not="When the per-token work dwarfs the fixed part (a large model on a CPU), a prefill's "
                           "time comes close to proportional to its tokens.");
ttft_cached_1 = statistics.median(hit_ttft)  # the cached engine's request 1, in the same rounds
gap = ttft_cached_1 - t_new
new_range = f"{min(short_ttft[f'{n_new} tokens']):.2f}-{max(short_ttft[f'{n_new} tokens']):.2f} ms"
hit_range = f"{min(hit_ttft):.2f}-{max(hit_ttft):.2f} ms"
separated = (max(hit_ttft) < min(short_ttft[f"{n_new} tokens"]) or
             min(hit_ttft) > max(short_ttft[f"{n_new} tokens"]))
render(f"The cached engine computed the same **{n_new}** tokens for request 1 (cached tokens each round: "
       f"{', '.join(map(str, sorted(hit_cached)))}), behind request 0's prefix, with a TTFT of "
       f"**{ttft_cached_1:.2f} ms** (median of 9, rounds {hit_range}), against the {n_new}-token prefill with no "
       f"prefix's {t_new:.2f} ms (rounds {new_range}): **{abs(gap):.2f} ms {'more' if gap > 0 else 'less'}**. "
       + ("Every round of one was above every round of the other, so the difference is larger than the noise. "
          if separated else "The rounds overlap, so the difference is within this machine's noise. ")
       + "What a hit adds is finding the prefix's blocks and attending over its keys and values; it also runs "
         "another attention path (a prompt with nothing cached attends over its own new keys and values, one "
         "with a cached prefix reads the prefix from the paged cache), so the gap is the hit path's whole extra "
         "cost, not the prefix's attention alone.");

# %% [markdown]
# The prefill work the cache skips is at least the shared prefix's tokens times the model's FLOPs per
# token (chapter 06; attention over the prefix adds a part that grows with its square), so it grows
# with the prefix length and with the model's size, while the fixed part of a step does not; run this
# notebook with a real checkpoint (`MINIVLLM_MODEL`) to measure what that does to the TTFT ratio there.
#
# ## 3. When the pool fills: eviction, least recently used first
#
# Cached blocks cost nothing while the pool has room: a finished request's blocks go back to the
# free list *with their hashes*, still hittable. When a request needs a block, the allocator first
# takes a *plain* free block, one holding nothing reusable (a partly filled tail block, one never
# used, or a full block whose content another block already holds in the cache). Only when none is left does it take a cached block: the one freed longest ago, whose hash is
# then forgotten. That is an **LRU eviction** (least recently used, since a hit takes a block off the
# free list and its release puts it back at the end). (Within one request, blocks are released tail
# first, so a prompt's tail is evicted before its head; heads are what other requests are most likely
# to share.) Taking plain blocks first is this engine's policy. vLLM's V1 allocator keeps a single
# queue of every unreferenced block, a finished request's blocks appended tail first whether they are
# cached or not, and takes from its front, evicting a cached block it finds there even while plain ones
# wait behind it.
#
# A small pool of 16 blocks makes it visible. Four different "system prompts" (random token ids) of
# 4 full blocks each, followed in each request by 8 random tokens of its own, so a request uses 5
# blocks while it runs and leaves 4 cached blocks behind. The engine runs one request at a time (`max_num_seqs=1`), so the pool holds only the
# running request's blocks and what earlier ones left. After each request the cell prints how many
# blocks of each prefix are still cached.

# %%
import random

POOL_BLOCKS = 16
small = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=POOL_BLOCKS, max_num_seqs=1)
sm = small.llm_engine

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.engine.block_manager import hash_block

rng = random.Random(0)
PREFIX = {name: [rng.randrange(1, sm.vocab_size) for _ in range(4 * BLOCK_SIZE)] for name in "ABCD"}


def tail():
    return [rng.randrange(1, sm.vocab_size) for _ in range(8)]


def cached_blocks_of(name):
    """How many of prefix ``name``'s 4 blocks the pool still holds (walking the hash chain)."""
    parent, n = None, 0
    for i in range(4):
        parent = hash_block(parent, PREFIX[name][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        if parent not in sm.block_manager.hash_to_block:
            break
        n += 1
    return n


sm.reset_prefix_cache()  # a cold pool, also when this cell runs again
trace = []  # (prefix, blocks hit, {prefix: blocks still cached afterwards})
print("next free: the first six blocks the allocator would hand out next "
      "(plain blocks first, then cached ones, least recently freed first)")
for name in "ABCDABC":
    out = small.generate(PREFIX[name] + tail(), greedy(4), use_tqdm=False)[0]
    trace.append((name, out.num_cached_tokens // BLOCK_SIZE, {p: cached_blocks_of(p) for p in "ABCD"}))
    still = " ".join(f"{p}:{n}" for p, n in trace[-1][2].items())
    print(f"request with prefix {name}: {trace[-1][1]} of 4 blocks hit;   "
          f"cached blocks per prefix afterwards  {still};   next free {list(sm.block_manager.free)[:6]}")
sm.check_invariants()

# %% [markdown]
# Follow it through. A, B and C fit (12 cached blocks; the other 4 hold nothing reusable). D needs 5
# blocks: it takes the 4 plain ones and evicts a single cached block, the one freed longest ago, which
# is A's 4th (last full) block (A finished first, and a request's blocks are released from its last
# block to its first). A comes back and hits 3 of its 4 blocks; it needs two blocks, one for its
# recomputed 4th block and one for its partial tail: it takes the plain block D's partial tail left and
# evicts one cached block, B's 4th block (the one freed longest ago), and so on: each returning prefix
# loses one block per round. The cell below checks this story against the trace printed above.

# %%
after_d = trace[3][2]
check_claim("D evicts exactly one cached block, one of A's, and leaves B and C whole",
            after_d == {"A": 3, "B": 4, "C": 4, "D": 4}, f"after D: {after_d}")
check_claim("each returning prefix (A, B, C) hits 3 of its 4 blocks and evicts one block of the next prefix",
            [t[1] for t in trace[4:]] == [3, 3, 3]
            and [t[2][nxt] for t, nxt in zip(trace[4:], "BCD")] == [3, 3, 3],
            f"hits {[t[1] for t in trace[4:]]}; next prefix's cached blocks afterwards "
            f"{[t[2][nxt] for t, nxt in zip(trace[4:], 'BCD')]}");

# %% [markdown]
# Once the prefixes need more blocks than the pool holds beside the running request, a round-robin is
# the worst case for LRU: each request evicts what will be needed soonest.
#
# The same effect, measured as a hit rate: K distinct prefixes (4 blocks each) requested round-robin
# for three rounds on the 16-block pool, for K = 1 to 6. The first round is always cold; the rest
# should hit, as long as the K prefixes fit.
#
# ### Exercise 2 · Where does the hit rate start to fall?
#
# Each request is one of the K prefixes (4 blocks) followed by an 8-token tail of its own. While the
# request for prefix X runs in rounds two and three, which blocks must the 16-block pool hold at that
# moment for every later request to find its prefix still cached? From that, what is the largest K
# for which rounds two and three still hit every cached block?

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: the largest number of prefixes K that still all hit (a whole number)

# %%
import statistics
import string


def round_robin(llm, k: int, rounds: int = 3) -> dict:
    eng = llm.llm_engine
    eng.reset_prefix_cache()
    names = string.ascii_uppercase[:k]  # k distinct prefixes (up to 26)
    assert len(names) == k, f"round_robin names at most 26 prefixes, asked for {k}"
    prefixes = {n: [rng.randrange(1, eng.vocab_size) for _ in range(4 * BLOCK_SIZE)] for n in names}
    hit = total = 0
    ttft = []
    for r in range(rounds):
        for n in names:
            out = llm.generate(prefixes[n] + tail(), greedy(2), use_tqdm=False)[0]
            hit += out.num_cached_tokens
            total += len(out.prompt_token_ids)
            if r > 0:  # rounds after the first are the ones that can hit
                ttft.append(out.metrics.ttft_ms)
    return {"prefixes": k, "blocks they need": 4 * k, "hit rate": hit / total,
            "TTFT ms": statistics.median(ttft), "TTFT min": min(ttft), "TTFT max": max(ttft), "ttfts": ttft}


sweep = pd.DataFrame([round_robin(small, k) for k in range(1, 7)]).set_index("prefixes")

# %%
# NBVAL_CHECK_OUTPUT
print(sweep[["blocks they need", "hit rate"]].round(3).to_string())

# %%
full_hit = sweep["hit rate"].iloc[0]
k_full = max(k for k in sweep.index if sweep.loc[k, "hit rate"] >= full_hit - 1e-9)
check_prediction(my_prediction_2, k_full, rel_tol=0, what="K, the largest number of prefixes whose rounds 2-3 all hit");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# In rounds two and three, when prefix X arrives its 4 blocks are (hopefully) cached, and it needs one
# more block for its tail. Nothing must be evicted, so all K prefixes' cached blocks plus that one
# block must fit in the pool: `4K + 1 <= 16`, so `K <= 3.75`, and the largest whole K is 3. One more
# prefix and every request must evict one cached block, and LRU picks the block freed longest ago,
# which belongs to the prefix that comes next. The check above compares your K with the largest K
# whose measured hit rate equals the one-prefix rate.
# </details>

# %%
setting_small = setting(small)
fig = go.Figure()
fig.add_bar(x=sweep.index, y=sweep["hit rate"], marker_color="#54a24b", name="hit rate")
fig.add_vline(x=k_full + 0.5, line_dash="dash", line_color="#888",
              annotation_text="prefixes + the running request > pool", annotation_position="top right")
fig.update_layout(title=f"Prefix-cache hit rate, round-robin over K prefixes, {POOL_BLOCKS}-block pool"
                        f"<br><sub>{setting_small}</sub>",
                  xaxis=dict(title="K distinct prefixes (4 blocks each)", dtick=1),
                  yaxis=dict(title="hit rate (share of prompt tokens)", range=[0, 1], dtick=0.2, tickformat=".0%"),
                  height=360, showlegend=False)
show_figure(fig)
fig = go.Figure()
fig.add_scatter(x=sweep.index, y=sweep["TTFT ms"], mode="lines+markers", line=dict(color="#e45756"),
                error_y=dict(type="data", symmetric=False, array=sweep["TTFT max"] - sweep["TTFT ms"],
                             arrayminus=sweep["TTFT ms"] - sweep["TTFT min"]))
fig.update_layout(title=f"TTFT of rounds 2-3 (median, whiskers: min-max over the 2K requests)<br><sub>{setting_small}</sub>",
                  xaxis=dict(title="K distinct prefixes (4 blocks each)", dtick=1),
                  yaxis=dict(title="TTFT (ms)", rangemode="tozero"), height=340, showlegend=False)
show_figure(fig)

# %%
later = [k for k in sweep.index if k > k_full]
zero = [k for k in sweep.index if sweep.loc[k, "hit rate"] == 0]
text = (f"Up to **{k_full}** prefixes, rounds two and three hit every cached block (the hit rate, "
        f"{full_hit:.1%}, is below 100% only because round one is cold and each prompt's last 8 tokens are "
        f"always computed).")
if later:
    text += (f" At **{later[0]}** prefixes it falls to **{sweep.loc[later[0], 'hit rate']:.1%}**: every request "
             f"evicts one block of the prefix needed next.")
if zero:
    text += (f" From **{zero[0]}** prefixes on it is **zero**: LRU under a round-robin evicts each prefix "
             f"before it comes back, so nothing survives a full round.")
# TTFT of rounds 2-3, pooled over every K that hit fully and over every K that hit nothing (more samples
# than one K alone: single prefills of the embedded model are short and noisy)
cold_ks = zero or later
t_hit = statistics.median(t for k in sweep.index if k <= k_full for t in sweep.loc[k, "ttfts"])
t_cold = statistics.median(t for k in cold_ks for t in sweep.loc[k, "ttfts"])
text += (f" The median TTFT of rounds two and three was **{t_hit:.2f} ms** where every cached block hit "
         f"(K <= {k_full}) and **{t_cold:.2f} ms** at K = {', '.join(map(str, cold_ks))}.")
render(text)
check_claim("once the prefixes outgrow the pool, the TTFT of rounds 2-3 rises", t_cold > t_hit,
            f"median {t_hit:.2f} ms at K <= {k_full} vs {t_cold:.2f} ms at K = {', '.join(map(str, cold_ks))}",
            why_it_may_not=f"The embedded model's prefill of {4 * BLOCK_SIZE + 8} tokens is short; load on the "
                           "machine can hide it, and on a GPU its time can hardly depend on its length.");

# %% [markdown]
# In a server, the remedy is more KV memory for the cache (a bigger pool, or a smaller KV footprint), or
# routing requests that share a prefix to the same replica.
#
# ## Playground
#
# `PLAY_POOL_BLOCKS` is the size of the KV pool in blocks. Change it (try 12, 20, 24, 32) and rerun: the
# cell repeats the round-robin sweep on a fresh engine of that size, for K = 1 to `PLAY_MAX_K`
# prefixes, and prints the hit rates (no timing). Look for the K where the hit rate first drops, and
# compare it with `4K + 1 <= blocks`; the hit rate reaches zero about one K later, so for a pool of 32
# blocks the sweep must reach K = 9 to show both (raise `PLAY_MAX_K` for larger pools).

# %% tags=["playground"]
PLAY_POOL_BLOCKS = 24  # KV blocks of 16 slots in the pool
PLAY_MAX_K = 9         # the sweep runs K = 1 .. PLAY_MAX_K prefixes

play = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=PLAY_POOL_BLOCKS, max_num_seqs=1)
rates = [round_robin(play, k)["hit rate"] for k in range(1, PLAY_MAX_K + 1)]
play.shutdown()
print(f"{PLAY_POOL_BLOCKS} blocks: hit rate for K = 1..{PLAY_MAX_K} prefixes:", " ".join(f"{r:.2f}" for r in rates))

# %% [markdown]
# ## 4. The prefix cache view
#
# The view below runs four of the questions on the cached engine. For each request it shows the
# prompt's KV blocks as hits (reused) or misses (computed), and measures its TTFT twice: *warm*
# (the system prompt already cached by request 0) and *cold* (the cache cleared first), each the
# median of three runs. For requests 1 to 3 the difference is the time the cache saved, measured;
# request 0 is the one that fills the cache, with nothing to reuse, so the view gives it no warm time
# and no saving (a warm-up run before it keeps one-off first-run costs out of its cold time). The view
# tokenises the system prompt and the question separately and joins the token ids, so a prompt's
# length can differ by a token or so from the same text tokenised whole in section 1 (the printout
# below gives each prompt's length). Press **Run** to measure again.

# %%
from widgets import PrefixCacheView

cached.llm_engine.reset_prefix_cache()
view = PrefixCacheView(cached, SYSTEM, QUESTIONS[:4], repeats=3)
view.display()

# %%
# NBVAL_CHECK_OUTPUT
for i, r in enumerate(view.results):
    print(f"request {i}: {r['prompt_tokens']} prompt tokens, {r['hit_blocks']} KV blocks hit, {r['miss_blocks']} computed")

# %% [markdown]
# ## 5. Check yourself

# %%
from widgets import Question, Quiz

drop = (f"the sweep above measured a hit rate of {full_hit:.0%} up to K = {k_full}, "
        + ", ".join(f"{sweep.loc[k, 'hit rate']:.0%} at K = {k}" for k in later)
        + (f": zero from K = {zero[0]}, where the {zero[0]} prefixes and the running request need "
           f"{4 * zero[0] + 1 - POOL_BLOCKS} blocks more than the pool holds, more than a whole prefix. Eight "
           f"prefixes in room for six are two whole prefixes short." if zero else "."))
Quiz([
    Question(
        "Two prompts share their first 40 tokens; blocks hold 16 tokens. How many prompt tokens can the second "
        "request take from the cache?",
        ["40", "32", "48", "0: the prompts are different"],
        1,
        ["A block is shared only when all 16 of its tokens match; tokens 32-39 sit in a block whose other "
         "tokens differ.",
         "Right: two full blocks (tokens 0-31) match; the third block mixes shared and different tokens.",
         "Only 40 tokens are shared; a block that contains different tokens cannot be reused.",
         "Matching is block by block from the start, not all or nothing: section 1 measured a partial hit."],
    ),
    Question(
        "Why does each block's hash include the hash of the block before it?",
        ["To make hashing faster", "So a hit means the whole prefix up to that block matches, which is what "
         "makes its KV valid", "So blocks can be evicted in order", "It does not matter; the block's own "
         "tokens are enough"],
        1,
        ["Chaining adds work; it is there for correctness.",
         "Right: a token's key and value depend on every token before it (through attention in earlier "
         "layers) and on its position, so equal 16-token windows after different prefixes hold different KV.",
         "Eviction order comes from the free list (least recently used first), not from the hashes.",
         "Two sequences can contain the same 16 tokens after different histories; their KV differs."],
    ),
    Question(
        "A server rotates requests over 8 system prompts, and its KV pool holds the cached blocks of 6. What "
        "hit rate should you expect on the shared prefixes, and why?",
        ["About 75%: 6 of 8 stay cached", "Close to zero: LRU evicts each prefix just before it is needed again",
         "100%: cached blocks are never evicted", "It depends only on the block size"],
        1,
        ["That would be true with a policy that pins some prefixes; LRU under a round-robin keeps the most recent "
         "ones, which are exactly the ones not needed next.",
         "Right: " + drop,
         "Unreferenced cached blocks are reused as soon as the pool has no plain free block left.",
         "Block size changes how much of each prompt can match, not whether a prefix survives eviction."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * explain how a prefix-cache hit is found: full blocks only, a hash chained over the whole prefix, a
#   walk from the first block that stops at the first miss;
# * predict the hit rate of requests sharing a system prompt from the prompt and block lengths, and
#   measure it with `num_cached_tokens`;
# * measure what caching does to time to first token, and say why the saving can be smaller than the
#   share of tokens skipped (a prefill's time is not proportional to its tokens);
# * check that caching changes what is computed and not the result (the reused KV is mathematically
#   the same; section 1 compares the greedy tokens with and without the cache);
# * explain LRU eviction from the free list, compute the largest number of prefixes a pool can keep
#   under a round-robin, and recognise the collapse past it.
#
# Next: chapter 09 looks at the last stage of every step, picking the token.
