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
# # 08 · Prefix Caching
#
# Many requests to a served model begin with the same tokens: a system prompt, a few-shot template,
# the conversation so far. Their keys and values in every layer are the same too, because KV depends
# only on the tokens and their positions. **Prefix caching** keeps the KV blocks of prompts already
# computed and hands them to any later request whose prompt starts with the same tokens, so its
# prefill only computes what is new.
#
# **You will:** send requests that share a system prompt and watch them reuse the same physical KV
# blocks · measure the hit rate and the time to first token with and without caching · prove the
# output does not change · shrink the KV pool until cached blocks are evicted, least recently used
# first, and measure the hit rate collapse · explore it live in the prefix cache view.

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

# %% [markdown]
# ## 1. Two requests, one system prompt
#
# How is a hit found? After a step computes a **full** block of a sequence, the block manager hashes
# it: the hash covers the block's 16 token ids *and* the hash of the block before it, so equal hashes
# mean equal token prefixes from position 0, not just equal 16-token windows. A new request walks its
# prompt block by block, looks each hash up, and stops at the first miss. Matching blocks are added to
# its block table (their reference count goes up); prefill starts after them. A block only becomes
# hittable once the step that wrote its KV has finished, and the last prompt token is always computed
# (its logits are needed to sample), so at most `(prompt_len - 1) // 16` blocks can hit.

# %%
# NBVAL_CHECK_OUTPUT
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
eng = cached.llm_engine
sys_len = len(tok.encode(SYSTEM))
print(f"system prompt: {sys_len} tokens = {sys_len // BLOCK_SIZE} full blocks + {sys_len % BLOCK_SIZE} tokens")

tables = {}
for rid, q in (("first", QUESTIONS[0]), ("second", QUESTIONS[1])):
    eng.add_request(rid, SYSTEM + q, greedy(4))
    eng.step()                                    # its prefill
    seq = eng.requests[rid].seq
    tables[rid] = list(seq.block_table)
    print(f"{rid:6s}: prompt {len(seq.prompt_token_ids)} tokens, served from the cache {seq.num_cached_tokens}, "
          f"block table {tables[rid]}")
    while eng.has_unfinished_requests():
        eng.step()
shared = [a for a, b in zip(tables["first"], tables["second"]) if a == b]
print(f"physical blocks in both block tables: {shared} ({len(shared) * BLOCK_SIZE} tokens of KV computed once)")

# %% [markdown]
# The second request's block table *starts with the same physical block ids* as the first's: those
# blocks hold the system prompt's KV, computed once. Its prefill computed only the tokens after them.
# Only full blocks are shared, and only when all 16 of their tokens match: if the system prompt does
# not end exactly on a block boundary, the block holding its last tokens also holds the question's
# first tokens, so that block is computed again for every request.
#
# Reuse must not change the answer. Greedy tokens of every question, with and without caching:

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


on, off = one_by_one(cached), one_by_one(plain)

# %%
# NBVAL_CHECK_OUTPUT
for name, df in (("prefix caching on ", on), ("prefix caching off", off)):
    rate = df.cached_tokens.sum() / df.prompt_tokens.sum()
    print(f"{name}: {df.cached_tokens.sum():4d} of {df.prompt_tokens.sum()} prompt tokens from the cache "
          f"(hit rate {rate:.1%}); prefill computed {df.prompt_tokens.sum() - df.cached_tokens.sum()} tokens")
print("cached tokens per request (on):", on.cached_tokens.tolist())

# %%
import plotly.graph_objects as go

from widgets import show_figure

print(f"median TTFT, requests 1-9: with caching {on.ttft_ms.iloc[1:].median():.2f} ms, "
      f"without {off.ttft_ms.iloc[1:].median():.2f} ms "
      f"({off.ttft_ms.iloc[1:].median() / on.ttft_ms.iloc[1:].median():.1f}x)")
fig = go.Figure()
fig.add_bar(x=off.index, y=off.ttft_ms, name="prefix caching off", marker_color="#bbbbbb")
fig.add_bar(x=on.index, y=on.ttft_ms, name="prefix caching on", marker_color="#54a24b")
fig.update_layout(barmode="group", title="Measured time to first token, one request at a time "
                  f"({cached.llm_engine.source.name}, {cached.llm_engine.config.device})",
                  xaxis_title="request (0 = cold cache)", yaxis_title="TTFT (ms)", height=360)
show_figure(fig)

# %% [markdown]
# Request 0 pays for the whole prompt in both runs. From request 1 on, the cached engine computes
# only what follows the last shared block (the question), and its TTFT drops accordingly; without
# caching every request pays the full prefill. (On a CPU with the embedded model, part of every
# TTFT is fixed per-step overhead that no cache removes, so the ratio is smaller than the ratio of
# computed tokens.) How much time that saves grows with the
# shared prefix's length and the model's size; run this notebook with a real checkpoint
# (`MINIVLLM_MODEL`) to measure it there.
#
# ## 3. When the pool fills: eviction, least recently used first
#
# Cached blocks cost nothing while the pool has room: a finished request's blocks go back to the
# free list *with their hashes*, still hittable. When a request needs a block, the allocator first
# takes a *plain* free block, one holding nothing reusable (a partly filled tail block, or one never
# used). Only when none is left does it take a cached block: the one freed longest ago, whose hash is
# then forgotten. That is an **LRU eviction** (least recently used, since a hit takes a block off the
# free list and its release puts it back at the end). (Within one request, blocks are released tail
# first, so a prompt's tail is evicted before its head; heads are what other requests are most likely
# to share.)
#
# A small pool of 16 blocks makes it visible. Four different "system prompts" (random token ids),
# each 4 full blocks plus 8 tokens, so a request uses 5 blocks while it runs and leaves 4 cached
# blocks behind. After each request the cell prints how many blocks of each prefix are still cached.

# %%
import random

small = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=16, max_num_seqs=1)
sm = small.llm_engine

# %%
# NBVAL_CHECK_OUTPUT
rng = random.Random(0)
PREFIX = {name: [rng.randrange(1, sm.vocab_size) for _ in range(4 * BLOCK_SIZE)] for name in "ABCD"}


def tail():
    return [rng.randrange(1, sm.vocab_size) for _ in range(8)]


def cached_blocks_of(name):
    """How many of prefix ``name``'s 4 blocks the pool still holds (walking the hash chain)."""
    from minivllm.engine.block_manager import hash_block
    parent, n = None, 0
    for i in range(4):
        parent = hash_block(parent, PREFIX[name][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        if parent not in sm.block_manager.hash_to_block:
            break
        n += 1
    return n


for name in "ABCDABC":
    out = small.generate(PREFIX[name] + tail(), greedy(4), use_tqdm=False)[0]
    still = " ".join(f"{p}:{cached_blocks_of(p)}" for p in "ABCD")
    print(f"request with prefix {name}: {out.num_cached_tokens // BLOCK_SIZE} of 4 blocks hit;   "
          f"cached blocks per prefix afterwards  {still};   free-list order (evicted first -> last) "
          f"{list(sm.block_manager.free)[:6]}...")
sm.check_invariants()

# %% [markdown]
# Follow it through. A, B and C fit (12 cached blocks; the other 4 hold nothing reusable). D needs 5
# blocks: it takes the 4 plain ones and evicts a single cached block, the one freed longest ago, which
# is A's tail (A finished first, and its tail was released before its head). A comes back and hits 3
# of its 4 blocks; the one block it recomputes evicts B's tail, and so on: each returning prefix loses
# one block per round. Once the prefixes need more blocks than the pool holds beside the running
# request, a round-robin is the worst case for LRU: each request evicts what will be needed soonest.
#
# The same effect, measured as a hit rate: K distinct prefixes (4 blocks each) requested round-robin
# for three rounds on the 16-block pool, for K = 1 to 6. The first round is always cold; the rest
# should hit, as long as the K prefixes fit.

# %%
import statistics


def round_robin(k: int, rounds: int = 3) -> dict:
    sm.reset_prefix_cache()
    names = "ABCDEF"[:k]
    prefixes = {n: [rng.randrange(1, sm.vocab_size) for _ in range(4 * BLOCK_SIZE)] for n in names}
    hit = total = 0
    ttft = []
    for r in range(rounds):
        for n in names:
            out = small.generate(prefixes[n] + tail(), greedy(2), use_tqdm=False)[0]
            hit += out.num_cached_tokens
            total += len(out.prompt_token_ids)
            if r > 0:  # rounds after the first are the ones that can hit
                ttft.append(out.metrics.ttft_ms)
    return {"prefixes": k, "blocks they need": 4 * k, "hit rate": hit / total,
            "median TTFT ms, rounds 2-3": statistics.median(ttft)}


sweep = pd.DataFrame([round_robin(k) for k in range(1, 7)]).set_index("prefixes")

# %%
# NBVAL_CHECK_OUTPUT
print(sweep[["blocks they need", "hit rate"]].round(3).to_string())

# %%
fig = go.Figure()
fig.add_scatter(x=sweep.index, y=sweep["hit rate"], mode="lines+markers", name="hit rate (measured)",
                line=dict(color="#54a24b", width=3))
ttft_col = "median TTFT ms, rounds 2-3"
fig.add_scatter(x=sweep.index, y=sweep[ttft_col], mode="lines+markers", name="median TTFT, rounds 2-3 (measured)",
                yaxis="y2", line=dict(color="#e45756", dash="dot"))
fig.add_vline(x=3.5, line_dash="dash", line_color="#888",
              annotation_text="prefixes + the running request > 16 blocks", annotation_position="top right")
fig.update_layout(title="Round-robin over K shared prefixes, 16-block KV pool",
                  xaxis=dict(title="K distinct prefixes (4 blocks each)", dtick=1, range=[0.5, 6.5]),
                  yaxis=dict(title="prefix-cache hit rate", range=[0, 1]),
                  yaxis2=dict(title="TTFT (ms)", overlaying="y", side="right", rangemode="tozero"),
                  legend=dict(orientation="h", y=-0.25), height=380)
show_figure(fig)
small.shutdown()

# %% [markdown]
# Up to three prefixes, rounds two and three hit every cached block (the hit rate is below 100% only
# because round one is cold and each prompt's last 8 tokens are always computed). At four prefixes the
# cached blocks plus the running request's 5 blocks no longer fit in 16: every request evicts one block
# of the prefix needed next, so the hit rate drops. From five on, LRU under a round-robin evicts each
# prefix before it comes back: the hit rate is zero (nothing survives a full round) and TTFT goes back
# up towards the cold-cache figure. In a
# server, the remedy is more KV memory for the cache (a bigger pool, or a smaller KV footprint), or
# routing requests that share a prefix to the same replica.
#
# ## 4. The prefix cache view
#
# The view below runs four of the questions on the cached engine. For each request it shows the
# prompt's KV blocks as hits (reused) or misses (computed), and measures its TTFT twice: *warm*
# (the system prompt already cached by request 0) and *cold* (the cache cleared first), each the
# median of two runs. The difference is the time the cache saved, measured. Press **Run** to
# measure again.

# %%
from widgets import PrefixCacheView

cached.llm_engine.reset_prefix_cache()
view = PrefixCacheView(cached, SYSTEM, QUESTIONS[:4], repeats=2)
view.display()

# %%
# NBVAL_CHECK_OUTPUT
for i, r in enumerate(view.results):
    print(f"request {i}: {r['prompt_tokens']} prompt tokens, {r['hit_blocks']} KV blocks hit, {r['miss_blocks']} computed")

# %% [markdown]
# ## 5. Check yourself

# %%
from widgets import Question, Quiz

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
         "Right: the sweep above measured the hit rate falling to zero once the prefixes outgrew the pool.",
         "Unreferenced cached blocks are reused as soon as the pool has no plain free block left.",
         "Block size changes how much of each prompt can match, not whether a prefix survives eviction."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * Prefix caching reuses the KV of any full block whose whole prefix matches, found by a chained hash;
#   the second request shares the *physical* blocks of the first.
# * It changes only what is computed, not the result: greedy tokens were identical with and without it.
# * On the shared system prompt it served most prompt tokens from the cache and cut the measured TTFT;
#   the saving grows with the prefix length and the model size.
# * Cached blocks live in the free list; plain blocks are handed out first, and cached ones are
#   evicted least recently used first. When the shared prefixes outgrow the pool, a round-robin
#   workload drives the hit rate to zero (measured).
#
# Next: chapter 09 looks at the last stage of every step, picking the token.
