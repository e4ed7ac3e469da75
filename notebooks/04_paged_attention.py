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
# # 04 · PagedAttention: blocks, block tables, slot mapping
#
# Chapter 03 showed that the KV cache is what fills memory. The simple way to hold it, one contiguous
# strip per request sized for the longest sequence the request *might* reach, wastes most of that
# memory, because nobody knows in advance how long an answer will be. PagedAttention (Kwon et al.,
# 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention", the paper
# behind vLLM) borrows the operating system's answer: cut memory into fixed-size **blocks** (pages),
# give each request blocks only as it needs them, and keep a per-request **block table** mapping its
# logical positions to physical blocks.
#
# **You will:** watch the engine hand out blocks to live requests and read their block tables · work
# out a token's physical slot from the block table and check it against the slot mapping the engine
# actually built · prove, by reading the engine's KV tensor, that a token's key sits exactly where the
# block table says · measure on a mixed workload how many slots a contiguous max-length allocation
# would reserve against what the paged pool really allocates and uses.

# %% [markdown]
# ## Setup
#
# The embedded `minivllm-tiny` unless `MINIVLLM_MODEL` says otherwise. A small pool (64 blocks of
# 16 token slots) keeps every block visible. Prefix caching is switched off here so that every block
# belongs to exactly one request (sharing blocks between requests is chapter 08).

# %% tags=["parameters"]
import os

import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
BLOCK_SIZE = 16                            # token slots per KV block

# %%
llm = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64, enable_prefix_caching=False)
engine = llm.llm_engine
bm, runner = engine.block_manager, engine.runner
tok = llm.get_tokenizer()
print(describe(llm))
print("torch threads:", torch.get_num_threads())
print(f"KV pool: {bm.num_blocks} blocks x {bm.block_size} slots = {bm.num_blocks * bm.block_size} token slots; "
      f"tensor {list(runner.kv_cache.shape)} = [K/V, layers, blocks, block_size, kv_heads, head_dim]")

# %% [markdown]
# ## 1. Blocks on live requests
#
# Three requests arrive together: prompts of 20, 7 and 40 tokens, asking for 14, 30 and 6 new tokens.
# The stepper below drives the engine; the KV cache view under it draws the pool, one cell per
# physical block, coloured by the request that owns it (hover a block for the tokens whose keys and
# values it holds). Under the grid, each request's block table and the slots its tokens occupy.

# %%
from pydoc_data.topics import topics  # English text that ships with Python: prompt material

from widgets import EngineStepper, KVCacheView

text_ids = [t for name in ("for", "while", "if", "try") for t in tok.encode(topics[name])]
stepper = EngineStepper(llm, show_chart=False)
view = KVCacheView(llm, stepper=stepper)
requests = {}
for name, start, prompt_len, max_tokens in (("A", 0, 20, 14), ("B", 100, 7, 30), ("C", 200, 40, 6)):
    requests[name] = stepper.add_request(text_ids[start:start + prompt_len], max_tokens=max_tokens,
                                         ignore_eos=True)  # exact lengths, whatever the model writes
stepper.step()  # one step: all three prompts are prefilled together
stepper.display()
view.display()


# %%
# NBVAL_CHECK_OUTPUT
def show_tables():
    for name, rid in requests.items():
        seq = stepper.sequence(rid)
        print(f"{name}: {seq.num_computed_tokens:3d} tokens with KV, status {seq.status.value:8s} block table "
              f"{seq.block_table}")
    print(f"pool: {bm.num_used_blocks} blocks used, {bm.num_free_blocks} free")


show_tables()

# %% [markdown]
# After the prefill, A holds 2 blocks (20 tokens: one full block of 16 and 4 slots of the next), B one
# block (7 of 16 slots) and C three (40 tokens). Blocks are taken from the front of the free list in
# the order the requests were planned. Now let the requests decode for 12 steps:

# %%
# NBVAL_CHECK_OUTPUT
for _ in range(12):
    stepper.step()
show_tables()

# %% [markdown]
# B grew past 16 tokens and got a second block, taken from wherever the free list pointed (block 6, the
# next on the free list; C's returned blocks went to its back): its table is no longer a run of consecutive ids. A has just filled its second block;
# its next token will need a third. That is the point of the block table: a request's KV does not
# need to be contiguous in memory, so any free block will do, and no request has to reserve room for
# growth it may never need. C finished (6 tokens) and its blocks went back to the pool, ready for the
# next block anyone needs.
#
# ## 2. From position to slot
#
# The KV tensor of a layer is addressed by *slot*: slot `s` is offset `s % block_size` of block
# `s // block_size`. A token at logical position `p` of a sequence lives in
#
# `slot = block_table[p // block_size] * block_size + p % block_size`
#
# Every step, the model runner computes this **slot mapping** for every new token (where to write
# its K and V), and passes the block tables to the attention backend (where to read everyone's
# earlier K and V). Below we capture the input the runner really built for the next step and check
# both against the formula:

# %%
# NBVAL_CHECK_OUTPUT
captured = []
real_prepare = runner.prepare_input


def capture(plan):  # keep the plan, each sequence's block table as the runner saw it, and the input built
    inp = real_prepare(plan)
    captured.append((plan, [list(e.seq.block_table) for e in plan.scheduled], inp))
    return inp


runner.prepare_input = capture
try:
    stepper.step()
finally:
    del runner.prepare_input  # back to the class method
plan, tables, inp = captured[0]
slots = inp.meta.slot_mapping.tolist()
row = 0
for i, entry in enumerate(plan.scheduled):
    p, table = entry.start_pos, tables[i]
    expected = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    name = next(k for k, v in requests.items() if v == entry.seq.request_id)
    print(f"{name}: new token at position {p}: block_table[{p} // {BLOCK_SIZE}] = "
          f"{table[p // BLOCK_SIZE]}, offset {p % BLOCK_SIZE} -> slot {expected}; runner's slot_mapping "
          f"{slots[row]}; block table row {inp.meta.block_tables[i].tolist()}")
    assert slots[row] == expected
    row += entry.num_tokens

# %% [markdown]
# The runner pads the block tables of a step into one `[num_seqs, max_blocks]` tensor (`-1` past a
# sequence's last block); the attention backend finds the K and V of positions
# `0 .. context_len - 1` of each sequence through its row.
#
# ### Proof by reading the cache
#
# Is a token's key really where the block table says? We compute the layer-0 keys of request B's
# tokens by hand (embedding, RMSNorm, the key part of `qkv_proj`, `k_norm`, rotary) and compare them
# with what sits in the engine's KV tensor at the slots its block table gives.

# %%
# NBVAL_CHECK_OUTPUT
model = runner.model
layer0 = model.model.layers[0].self_attn
seq = stepper.sequence(requests["B"])
n = seq.num_computed_tokens
with torch.inference_mode():
    ids = torch.tensor(seq.token_ids[:n], device=runner.device)
    pos = torch.arange(n, device=runner.device)
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    q, k, _ = layer0.qkv_proj(x).split([layer0.q_size, layer0.kv_size, layer0.kv_size], dim=-1)
    k = layer0.k_norm(k.view(n, layer0.num_kv_heads, layer0.head_dim))
    _, k = layer0.rotary(pos, q.view(n, layer0.num_heads, layer0.head_dim), k)
    k_cache = runner.kv_caches[0][0]  # layer 0's keys: [blocks, block_size, kv_heads, head_dim]
    table = torch.tensor(seq.block_table, device=runner.device)
    from_cache = k_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE]  # gathered through the block table
print(f"request B: {n} tokens in blocks {seq.block_table}")
print("keys computed by hand:", list(k.shape), "| keys read from the engine's cache via the block table:",
      list(from_cache.shape))
tol = dict(atol=1e-4, rtol=1e-3) if runner.dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)  # bf16/fp16
print("equal (to float rounding):", torch.allclose(k, from_cache, **tol))
wrong = k_cache[table.roll(1)[pos // BLOCK_SIZE], pos % BLOCK_SIZE] if len(seq.block_table) > 1 else None
if wrong is not None:
    print("and with the block table scrambled:", torch.allclose(k, wrong, **tol))

# %% [markdown]
# ## 3. What paging saves, measured
#
# Without paging, an engine that cannot move a sequence's KV must reserve its strip **up front**:
# enough slots for the longest the sequence can become. If it knows nothing about the request, that
# is `max_model_len`; if it trusts the request's `max_tokens`, it is `prompt + max_tokens` (chapter
# 03's by-hand cache did that). Either way the slots are reserved from the first step and mostly
# empty until the end; and a request that stops early (end-of-sequence token, stop string) never
# uses the rest.
#
# The paged pool reserves blocks as tokens arrive, so it wastes at most the unused part of each
# sequence's last block (at most `block_size - 1` slots).
#
# We run a mixed workload of 24 requests (prompts of 8 to 120 tokens, 4 to 64 new tokens, all
# different) on a fresh engine and, **after every step, read the live block manager**: slots
# allocated (blocks in use x 16), slots actually holding KV (each live sequence's
# `num_computed_tokens`), and what the two contiguous policies would reserve for the same live
# requests.

# %%
# NBVAL_CHECK_OUTPUT
import random

MAX_MODEL_LEN = 256
work = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=256, enable_prefix_caching=False,
           max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
we = work.llm_engine
rng = random.Random(0)
for i in range(24):
    prompt_len, new = rng.randint(8, 120), rng.randint(4, 64)
    start = rng.randrange(0, len(text_ids) - prompt_len)
    we.add_request(f"r{i:02d}", text_ids[start:start + prompt_len],
                   SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
samples = []
while we.has_unfinished_requests():
    rec = we.step_with_record().record
    live = [s for s in we.scheduler.running if s.block_table]
    samples.append(dict(
        step=len(samples),
        live=len(live),
        used=sum(s.num_computed_tokens for s in live),
        paged=we.block_manager.num_used_blocks * BLOCK_SIZE,
        contiguous_max_tokens=sum(s.num_prompt_tokens + s.params.max_tokens for s in live),
        contiguous_max_len=len(live) * MAX_MODEL_LEN))
    we.check_invariants()
totals = {k: sum(s[k] for s in samples) for k in ("used", "paged", "contiguous_max_tokens", "contiguous_max_len")}
print(f"{len(samples)} steps; at most {max(s['live'] for s in samples)} requests live at once")
print("slot-steps (slots held, summed over every step):")
for k, label in (("used", "holding KV"), ("paged", "paged: allocated blocks"),
                 ("contiguous_max_tokens", "contiguous, prompt + max_tokens"),
                 ("contiguous_max_len", f"contiguous, max_model_len={MAX_MODEL_LEN}")):
    print(f"  {label:34s} {totals[k]:8d}   used/held {totals['used'] / totals[k]:6.1%}")
peak = {k: max(s[k] for s in samples) for k in totals}
print("peak slots held in one step:", peak)

# %%
import plotly.graph_objects as go

from widgets import show_figure

steps = [s["step"] for s in samples]
fig = go.Figure()
for key, name, dash in (("contiguous_max_len", f"contiguous, max_model_len ({MAX_MODEL_LEN})", "dot"),
                        ("contiguous_max_tokens", "contiguous, prompt + max_tokens", "dash"),
                        ("paged", "paged: blocks allocated x 16", "solid"),
                        ("used", "slots holding KV", "solid")):
    fig.add_scatter(x=steps, y=[s[key] for s in samples], mode="lines", name=name, line=dict(dash=dash))
fig.update_layout(title="KV slots held per step: 24 mixed requests, read from the live block manager",
                  xaxis_title="engine step", yaxis_title="token slots", height=420,
                  yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.25))
show_figure(fig)
print(f"waste (held but empty), summed over the run: paged {1 - totals['used'] / totals['paged']:.1%}, "
      f"contiguous prompt+max_tokens {1 - totals['used'] / totals['contiguous_max_tokens']:.1%}, "
      f"contiguous max_model_len {1 - totals['used'] / totals['contiguous_max_len']:.1%}")

# %% [markdown]
# Three lessons in one chart:
#
# * The paged line hugs the used line: the gap is the partly filled last block of each live request,
#   never more than 15 slots each.
# * Reserving `prompt + max_tokens` wastes the answer's slots for its whole lifetime (they fill up
#   only at the very end), and this workload is the *best case* for that policy: `ignore_eos=True`
#   makes every request use all its `max_tokens`. Real requests often stop early, and the gap grows.
# * Reserving `max_model_len` per request wastes the most; in the same memory it would also fit far
#   fewer requests at once. That is the capacity argument of the PagedAttention paper: less waste
#   means bigger batches, and bigger batches mean more throughput (chapters 05 and 06).
#
# What paging costs: attention must find K and V through the block table instead of reading one
# contiguous strip. The `torch` backend gathers them into a contiguous tensor before attending; the
# Triton and flash-attn kernels (chapter 11) follow the block table inside the kernel.

# %%
# NBVAL_CHECK_OUTPUT
pool_slots = we.block_manager.num_blocks * BLOCK_SIZE
print(f"the pool: {pool_slots} slots")
print(f"contiguous, max_model_len: room for {pool_slots // MAX_MODEL_LEN} requests at once, whatever their length")
print(f"paged: this workload ran up to {max(s['live'] for s in samples)} requests at once "
      f"(using at most {peak['paged']} of the {pool_slots} slots)")
work.shutdown()

# %% [markdown]
# ## 4. Check yourself

# %%
from widgets import Quiz, Question

Quiz([
    Question(
        "Block size 16; a request's block table is [7, 2, 9]. In which slot is the key of its token at position 20?",
        ["Slot 20", "Slot 2 * 16 + 4 = 36", "Slot 7 * 16 + 20 = 132", "Slot 9 * 16 + 4 = 148"],
        1,
        ["Slot 20 is position 20 of a contiguous layout; here position 20 is in the request's second block.",
         "Right: 20 // 16 = 1 selects table entry 1, physical block 2; the offset is 20 % 16 = 4.",
         "The offset within a block is at most 15: first pick the block with 20 // 16, then add 20 % 16.",
         "Block 9 holds positions 32 to 47 of this request; position 20 is in the second table entry."],
    ),
    Question(
        "With paging, how many slots can one request waste at most?",
        ["None", "block_size - 1: the unused part of its last block",
         "max_model_len minus its length", "Half of its blocks"],
        1,
        ["The last block is rarely exactly full; the chart's gap between 'paged' and 'used' is that.",
         "Right: blocks are taken only when a token needs a slot, so only the tail of the last block is empty.",
         "That is the waste of a contiguous max-length reservation, which paging avoids.",
         "Every block but the last is full: blocks are handed out one at a time, as tokens arrive."],
    ),
    Question(
        "Why does paging raise throughput, not only save memory?",
        ["Gathering through a block table is faster than reading a strip",
         "Memory that is not wasted holds more requests at once, and bigger decode batches produce more "
         "tokens per step",
         "Blocks are computed in parallel", "It skips the prefill"],
        1,
        ["The gather is a (small) cost, not a speed-up; the gain comes from elsewhere.",
         "Right: decode steps cost about the same for 1 or many sequences (chapter 06), so more requests "
         "in memory means more tokens per step.",
         "Blocks are only a memory layout; the computation is the same attention over the same keys.",
         "Prefill is unchanged; chapter 08's prefix caching is what skips part of it."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * minivllm's KV pool is one tensor cut into blocks of `block_size` token slots; the block manager
#   hands blocks to requests as they grow and takes them back when they finish.
# * A request's block table maps its logical positions to physical blocks;
#   `slot = block_table[p // block_size] * block_size + p % block_size`. The runner computes this slot
#   mapping for every new token; the backend reads earlier tokens through the block tables.
# * Measured on a mixed workload, paged allocation holds little more than the slots in use, while a
#   contiguous reservation wastes most of what it reserves, even when output lengths are known.
# * Less waste means more concurrent requests in the same memory: the capacity that continuous
#   batching (chapter 05) turns into throughput.
