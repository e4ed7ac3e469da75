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
# # 04 · PagedAttention: blocks, block tables, slot mapping
#
# **Goal:** understand how a paged KV cache stores each request's keys and values in fixed-size blocks,
# how a token's position becomes a physical slot, and why that lets an engine run more requests at once.
#
# **Prerequisites:** chapter 01 (the generate loop: prefill, then one token per step) and chapter 03
# (what the KV cache holds and how big it gets).
#
# **Time:** about 35 minutes.
#
# Chapter 03 showed that the KV cache is what fills memory. The simple way to hold it, one contiguous
# strip per request sized for the longest sequence the request *might* reach, reserves slots that sit
# empty for most of the request's life, because nobody knows in advance how long an answer will be.
# PagedAttention (Kwon et al., 2023, "Efficient Memory Management for Large Language Model Serving with
# PagedAttention", the paper behind vLLM) borrows the operating system's answer: cut memory into
# fixed-size **blocks** (pages), give each request blocks only as it needs them, and keep a per-request
# **block table** mapping its logical positions to physical blocks.
#
# **You will:** watch the engine hand out blocks to live requests and read their block tables · predict
# how many blocks are in use after a few steps · work out a token's physical slot from the block table and
# check it against the slot mapping the engine built · prove, by reading the engine's KV tensor, that a
# token's key sits exactly where the block table says · measure on a mixed workload how many slots a
# contiguous allocation would reserve against what the paged pool allocates and uses · predict from
# decode steps at batch 1 and 4, then time, a step at batch 8 against batch 1, to see why the memory
# saved turns into throughput.

# %% [markdown]
# ## Setup
#
# The embedded `minivllm-tiny` unless `MINIVLLM_MODEL` says otherwise. A small pool (64 blocks of
# 16 token slots) keeps every block visible. Prefix caching is switched off here so that every block
# belongs to exactly one request (sharing blocks between requests is chapter 08).
# The stored outputs were produced by `scripts/execute_notebook.py` with one CPU thread
# (`OMP_NUM_THREADS=1`): on a CPU shared with other work one thread gives the steadiest timings. The
# setup cell prints how many threads this run uses.

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
backend_name = engine.config.attention_backend
# ("attention: torch" above names the backend; on a CPU in fp32 its decode path is a small C kernel: section 3)
print("decode attention:", "our C kernel, reading K and V in place through the block table"
      if getattr(runner.backend, "native_kernel", False) else
      "gather into a contiguous copy, then SDPA" if backend_name == "torch" else f"the {backend_name} kernels")


def setting(llm):
    """Model, device, dtype and threads of a live LLM: every chart title carries them."""
    cfg = llm.llm_engine.config
    return (f"{llm.llm_engine.source.name}, {cfg.device}, {str(cfg.dtype).replace('torch.', '')}, "
            f"{torch.get_num_threads()} thread(s)")


print(f"KV pool: {bm.num_blocks} blocks x {bm.block_size} slots = {bm.num_blocks * bm.block_size} token slots; "
      f"tensor {list(runner.kv_cache.shape)} = [K/V, layers, blocks, block_size, kv_heads, head_dim]")

# %% [markdown]
# ## 1. Blocks on live requests
#
# Three requests arrive together: prompts of 20, 7 and 40 tokens, asking for 14, 30 and 6 new tokens.
# The stepper below drives the engine; the KV cache view under it draws the pool, one cell per
# physical block, coloured by the request that owns it (hover a block for the tokens whose keys and
# values it holds). Under the grid, each request's block table and the slots its tokens occupy. The
# widgets name each request by its engine id; the tables printed below give that id beside the letter
# the text uses.

# %%
from pydoc_data.topics import topics  # English text that ships with Python: prompt material

from widgets import EngineStepper, KVCacheView

text_ids = [t for name in ("for", "while", "if", "try") for t in tok.encode(topics[name])]
stepper = EngineStepper(llm, show_chart=False)
stepper.reset()  # an idle engine and an empty prefix cache, even when this cell runs a second time
view = KVCacheView(llm, stepper=stepper)
requests = {}
for name, start, prompt_len, max_tokens in (("A", 0, 20, 14), ("B", 100, 7, 30), ("C", 200, 40, 6)):
    requests[name] = stepper.add_request(text_ids[start:start + prompt_len], max_tokens=max_tokens,
                                         ignore_eos=True)  # exact lengths, whatever the model writes
stepper.step()  # one step: all three prompts are prefilled together
after_12 = {}  # the exercise below keeps the state after its 12th decode step here
stepper.display()
view.display()


# %%
# NBVAL_CHECK_OUTPUT
def tables_now():
    lines = []
    for name, rid in requests.items():
        seq = stepper.sequence(rid)
        lines.append(f"{name} ({rid}): {seq.num_computed_tokens:3d} tokens with KV, status {seq.status.value:8s} "
                     f"block table {seq.block_table}")
    lines.append(f"pool: {bm.num_used_blocks} blocks used, {bm.num_free_blocks} free")
    return "\n".join(lines)


print(tables_now())

# %% [markdown]
# After the prefill, A holds 2 blocks (20 tokens: one full block of 16 and 4 slots of the next), B one
# block (7 of 16 slots) and C three (40 tokens). Blocks are taken from the front of the free list in
# the order the requests were planned. Each decode step adds one token's KV to every running request,
# and a request gets a new block only when its next token's position falls past its last block.
#
# ### Exercise 1 · Blocks in use after twelve decode steps
#
# The three requests now decode for 12 steps (remember their budgets: A asked for 14 new tokens, B for
# 30, C for 6; the prefill step already produced each request's first new token). How many blocks of
# the pool will be in use after those 12 steps? Write your answer, then run the next cells. (The next
# cell counts the stepper's own steps, so presses of its Step button count toward the 12.)

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: blocks in use after 12 decode steps (a whole number)

# %%
# NBVAL_CHECK_OUTPUT
# The stepper's history holds the prefill step and then the decode steps. The state after the 12th is
# kept, so running this cell again (after section 2 has stepped on) shows that state, not today's.
if not after_12:
    if any(rid not in stepper.request_ids for rid in requests.values()):
        raise RuntimeError("the stepper was reset after section 1's first code cell: run that cell again, "
                           "then this one")
    if set(stepper.request_ids) != set(requests.values()) or set(engine.requests) - set(requests.values()):
        raise RuntimeError("the engine holds a request besides A, B and C (the stepper's Add request?): its blocks "
                           "would count too; run section 1's first code cell again, then this one")
    if len(stepper.steps) > 1 + 12:
        raise RuntimeError(f"the stepper has already run {len(stepper.steps) - 1} decode steps, more than the "
                           "exercise's 12: run section 1's first code cell again, then this one")
    while len(stepper.steps) < 1 + 12 and stepper.step() is not None:
        pass
    if len(stepper.steps) != 1 + 12:  # a step refused: the stepper's status line says why
        raise RuntimeError(f"stopped after {len(stepper.steps) - 1} decode steps: {stepper.last_message}")
    after_12.update(blocks=bm.num_used_blocks, tables=tables_now())
blocks_after_12 = after_12["blocks"]
print(after_12["tables"])

# %%
from widgets import check_prediction

check_prediction(my_prediction_1, blocks_after_12, rel_tol=0, unit="blocks",
                 what="the number of blocks in use after 12 decode steps");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Count each request's tokens *with KV* and round up to whole blocks of 16.
#
# * C asked for 6 new tokens: the prefill gave it the first, five decode steps the rest. It finished
#   long before step 12, and a finished request hands all its blocks back: 0 blocks.
# * A had 20 prompt tokens with KV after the prefill; each decode step computes the KV of one more
#   token (the one sampled the step before), so after 12 steps it holds 20 + 12 = 32 tokens: exactly two
#   full blocks. The token it sampled last has no KV yet, so no third block so far.
# * B: 7 + 12 = 19 tokens, which spill into a second block: 2 blocks.
#
# So 0 + 2 + 2 blocks; the check above compares that with the block manager's count, and the table
# printed above shows each request's share.
# </details>

# %% [markdown]
# B grew past 16 tokens and got a second block: the next one on the free list, not one of those C had
# returned (a freed block joins the back of the list). Its table, printed above, is no longer a run of
# consecutive ids. A has just filled its second block; its next token will need a third. That is the
# point of the block table: a request's KV does not need to be contiguous in memory, so any free block
# will do, and no request has to reserve room for growth it may never need. C finished (6 tokens) and
# its blocks went back to the pool, ready for the next block anyone needs.
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
if not captured:
    raise RuntimeError("the stepper had nothing left to run (its Run to end or Reset was pressed): run section "
                       "1's first code cell and the cells after it again, then this one")
plan, tables, inp = captured[0]
slots = inp.meta.slot_mapping.tolist()
row = 0
for i, entry in enumerate(plan.scheduled):
    p, table = entry.start_pos, tables[i]
    expected = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    name = next(k for k, v in requests.items() if v == entry.seq.request_id)
    table_row = inp.meta.block_tables[i].tolist()
    held = [b for b in table_row if b >= 0]
    assert held == table, (held, table)
    print(f"{name}: new token at position {p}: block_table[{p} // {BLOCK_SIZE}] = "
          f"{table[p // BLOCK_SIZE]}, offset {p % BLOCK_SIZE} -> slot {expected}; runner's slot_mapping "
          f"{slots[row]}; block table row {held} then {len(table_row) - len(held)} x -1")
    assert slots[row] == expected
    row += entry.num_tokens
replayed = inp.graph_rows is not None  # staged into the recorded decode graphs' buffers
print(f"each row has {len(table_row)} entries; this step "
      + (f"was replayed from the decode graphs (max_model_len {engine.config.max_model_len} / block_size "
         f"{BLOCK_SIZE} = {-(-engine.config.max_model_len // BLOCK_SIZE)})" if replayed
         else "ran eagerly (the longest table of the step)"))

# %% [markdown]
# The runner pads the block tables of a step into one tensor with a row per sequence (`-1` past a
# sequence's last block); the attention backend finds the K and V of positions
# `0 .. context_len - 1` of each sequence through its row. In a step run eagerly the rows are as wide
# as the step's longest table. A decode step replayed from a recorded graph (chapter 11) keeps one
# input shape from step to step, so its rows have room for the longest table `max_model_len` allows
# (`max_model_len`: the most tokens, prompt and output together, one sequence may hold, an engine
# argument as in vLLM; so `max_model_len / block_size` entries, rounded up; this engine's
# `max_model_len` is no more than its 64-block pool can hold). The last line above says which kind of step this was.
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
# 03's by-hand cache did that). Either way the slots are reserved from the first step and fill up one
# token per step, so the reservation is partly empty until the very end; and a request that stops
# early (end-of-sequence token, stop string) never uses the rest.
#
# The paged pool reserves blocks as tokens arrive, so each live request wastes at most the unused part
# of its last block (at most `block_size - 1` slots).
#
# We run a mixed workload of 24 requests (random lengths: prompts of 8 to 120 tokens, 4 to 64 new
# tokens; each prompt a slice of the text from a random offset) on a fresh engine and, **after every
# step, read the live block manager**: slots allocated (blocks in use x block size), slots actually
# holding KV (each live sequence's `num_computed_tokens`), and what the two contiguous policies would
# reserve for the same live requests.

# %%
import random

MAX_MODEL_LEN = 256
POOL_SLOTS = 4096  # the pool's size in token slots, whatever the block size


CENSUS_REQUESTS = 24


def slot_census(block_size):
    """Run the CENSUS_REQUESTS-request workload on a fresh engine; after every step, count the slots each policy
    holds."""
    llm_ = LLM(MODEL, device=DEVICE, block_size=block_size, num_kvcache_blocks=POOL_SLOTS // block_size,
               enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    eng = llm_.llm_engine
    rng = random.Random(0)
    for i in range(CENSUS_REQUESTS):
        prompt_len, new = rng.randint(8, 120), rng.randint(4, 64)
        start = rng.randrange(0, len(text_ids) - prompt_len)
        eng.add_request(f"r{i:02d}", text_ids[start:start + prompt_len],
                        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    samples = []
    while eng.has_unfinished_requests():
        eng.step()
        live = [s for s in eng.scheduler.running if s.block_table]
        samples.append(dict(
            step=len(samples),
            live=len(live),
            used=sum(s.num_computed_tokens for s in live),
            paged=eng.block_manager.num_used_blocks * block_size,
            # the most empty slots one live request holds: its table's capacity less what it filled
            slack=max((len(s.block_table) * block_size - s.num_computed_tokens for s in live), default=0),
            contiguous_max_tokens=sum(s.num_prompt_tokens + s.params.max_tokens for s in live),
            contiguous_max_len=len(live) * MAX_MODEL_LEN))
        eng.check_invariants()
    totals = {k: sum(s[k] for s in samples) for k in ("used", "paged", "contiguous_max_tokens", "contiguous_max_len")}
    waste = {k: 1 - totals["used"] / totals[k] for k in ("paged", "contiguous_max_tokens", "contiguous_max_len")}
    return llm_, samples, totals, waste


work, samples, totals, waste = slot_census(BLOCK_SIZE)

# %%
# NBVAL_CHECK_OUTPUT
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
                        ("paged", f"paged: blocks allocated x {BLOCK_SIZE}", "solid"),
                        ("used", "slots holding KV", "solid")):
    fig.add_scatter(x=steps, y=[s[key] for s in samples], mode="lines", name=name, line=dict(dash=dash))
fig.add_hline(y=POOL_SLOTS, line=dict(color="#c03", dash="dashdot"), annotation_text=f"the pool: {POOL_SLOTS:,} slots",
              annotation_position="top left")
fig.update_layout(title=f"KV slots held per step, {CENSUS_REQUESTS} mixed requests (live block manager)<br><sub>{setting(work)}</sub>",
                  xaxis_title="engine step", yaxis_title="token slots held", height=440,
                  yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.25))
show_figure(fig)

# %%
from widgets import check_claim, render

render(f"Summed over the run, the share of held slots that sat empty was **{waste['paged']:.1%}** for the paged "
       f"pool, **{waste['contiguous_max_tokens']:.1%}** for a contiguous `prompt + max_tokens` reservation and "
       f"**{waste['contiguous_max_len']:.1%}** for a contiguous `max_model_len` reservation.")
policies = (("contiguous_max_tokens", "`prompt + max_tokens`"), ("contiguous_max_len", "`max_model_len`"))
over = [(k, name) for k, name in policies if peak[k] > POOL_SLOTS]
fits = [(k, name) for k, name in policies if peak[k] <= POOL_SLOTS]
render(f"The pool has **{POOL_SLOTS:,}** slots, and the paged engine held at most **{peak['paged']:,}** of them in one "
       "step. " + " ".join(f"The contiguous {name} policy would have needed **{peak[k]:,}** slots at its peak: it "
                           "could not have run this schedule in this pool at all, and would have had to admit "
                           "fewer requests at once." for k, name in over)
       + (" " if over and fits else "")
       + " ".join(f"The contiguous {name} policy's peak, **{peak[k]:,}** slots, fits in the pool on this schedule, "
                  "if its strips could be packed without gaps (the lessons below say why they cannot always be)."
                  for k, name in fits))
worst = max(s["slack"] for s in samples if s["live"])
check_claim("no live request ever holds more than block_size - 1 empty slots", worst <= BLOCK_SIZE - 1,
            f"the most any one request held in any step: {worst} (block_size {BLOCK_SIZE})");
check_claim("paged wastes less than either contiguous policy, and max_model_len wastes the most",
            waste["paged"] < waste["contiguous_max_tokens"] < waste["contiguous_max_len"],
            ", ".join(f"{k} {v:.1%}" for k, v in waste.items()));

# %% [markdown]
# Three lessons in one chart, and a caveat:
#
# * The paged line hugs the used line: the gap is the partly filled last block of each live request,
#   never more than `block_size - 1` slots each (checked above).
# * Reserving `prompt + max_tokens` holds the answer's slots for the request's whole life, and they
#   fill only one per step. This workload is the *best case* for that policy: `ignore_eos=True` makes
#   every request use all its `max_tokens`. Real requests often stop early, and then the slots they
#   never use are wasted too.
# * Reserving `max_model_len` per request wastes the most, and in the same memory it fits fewer
#   requests at once (the sentence above the checks compares each policy's peak with the pool: a
#   policy whose peak exceeds the pool could not have run this schedule at all). That is the capacity
#   argument of the PagedAttention paper: less waste means bigger batches (section 4 shows why bigger
#   batches mean more throughput).
# * The contiguous peaks are lower bounds: they add up the strips as if they packed without gaps. In a
#   real pool, strips of different lengths leave holes between them as requests finish (*external*
#   fragmentation, the third kind of waste the PagedAttention paper names, after slots reserved for
#   tokens not yet generated and internal fragmentation, slots never used: Kwon et al. 2023, section 3),
#   so a contiguous
#   policy can fail to place a request even where the sum says it fits. Paging has no such holes: any
#   free block will do.
#
# What paging costs: attention must find K and V through the block table instead of reading one
# contiguous strip. The `torch` backend gathers the cached ones into a contiguous tensor before
# attending (a prompt with nothing cached attends over its own new K and V, with no gather; and on a
# CPU in fp32, where minivllm's small C kernel builds with the system compiler, decode steps follow the
# block table in place instead: the setup cell's report names the path this run took); the Triton and
# flash-attn kernels (chapter 11) follow the block table inside the kernel.

# %%
pool_slots = work.llm_engine.block_manager.num_blocks * BLOCK_SIZE
max_live = max(s["live"] for s in samples)
render(f"Reserving `max_model_len` = {MAX_MODEL_LEN} per request, the pool's {pool_slots:,} slots would hold "
       f"**{pool_slots // MAX_MODEL_LEN}** requests at once, whatever their length. Paged, "
       + (f"all **{max_live}** of the workload's requests ran at once" if max_live == CENSUS_REQUESTS else
          f"**{max_live}** of the workload's {CENSUS_REQUESTS} requests ran at once")
       + f", holding at most {peak['paged']:,} of the {POOL_SLOTS:,} slots.")
check_claim("paging ran more requests at once than a max_model_len reservation fits in the same pool",
            max_live > pool_slots // MAX_MODEL_LEN,
            f"{max_live} live requests vs room for {pool_slots // MAX_MODEL_LEN}");

# %% [markdown]
# ## 4. Why more requests in memory means more throughput
#
# A decode step gives every running sequence one token. Part of its cost is paid once per step, however
# many sequences share it: reading the model's weights (the main cost of a real model on a GPU; chapter
# 06 measures it with the roofline), launching each layer's operations, the engine's bookkeeping. If
# that part dominates, a step with many sequences costs much less than that many steps with one, and
# the memory paging frees becomes tokens per second.
#
# ### Exercise 2 · A decode step of 8 against a step of 1
#
# The cell below times this engine's decode step with 1 and with 4 sequences (each sequence 32 prompt
# tokens, on the engine of section 3). Suppose every sequence adds the same time to a step, and the
# rest of a step is paid once, whatever the batch. From the two times it prints, how many times longer
# will a decode step with 8 sequences take than a decode step with 1? (1.0 would mean "the same"; 8.0
# would mean "no gain from batching".)

# %%
import statistics

from widgets import measure_decode_batch

REPEATS = 3  # interleaved runs; each gives a median per batch size


def decode_step_ms(batch_sizes):
    """Per batch size, the median decode step (ms) of each of REPEATS interleaved runs on ``work``."""
    runs = {b: [] for b in batch_sizes}
    for _ in range(REPEATS):
        rows = measure_decode_batch(work, batch_sizes=batch_sizes, prompt_len=32, decode_steps=16)
        for b in runs:
            runs[b].append(statistics.median(r["wall_ms"] for r in rows if r["batch"] == b))
    return runs


given = decode_step_ms((1, 4))
g1, g4 = min(given[1]), min(given[4])  # the fastest repeat: the slower ones measure the neighbours
print(f"decode step, batch 1: {g1:.2f} ms; batch 4: {g4:.2f} ms (the fastest of {REPEATS} runs' medians)")

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: decode step time at batch 8 / at batch 1 (a ratio, x)

# %%
step_ms = decode_step_ms((1, 8))
t1, t8 = min(step_ms[1]), min(step_ms[8])
ratio = t8 / t1
print(f"decode step, batch 1: {t1:.2f} ms (repeats {min(step_ms[1]):.2f}-{max(step_ms[1]):.2f}); "
      f"batch 8: {t8:.2f} ms (repeats {min(step_ms[8]):.2f}-{max(step_ms[8]):.2f})")
check_prediction(my_prediction_2, ratio, rel_tol=0.35, unit="x", what="the batch-8 / batch-1 step time ratio");
d = max(0.0, (g4 - g1) / 3)  # what each sequence beyond the first added (none, where noise made batch 4 faster)
line = (g1 + 7 * d) / g1
render(f"The straight line through the exercise's batch 1 and 4 (each sequence adding {d:.3f} ms) gives a batch-8 "
       f"step of {g1 + 7 * d:.2f} ms: **{line:.2f}x** the batch-1 step, "
       f"{abs(line / ratio - 1):.0%} {'below' if line < ratio else 'above'} the ratio measured now.")
render(f"A decode step of 8 sequences took **{ratio:.2f}x** a step of 1 here, so 8 sequences in memory "
       f"produce **{8 / ratio:.1f}x** the tokens per second of one ({setting(work)}). Each sequence beyond the "
       f"first added {(t8 - t1) / 7:.2f} ms, {(t8 - t1) / 7 / t1:.0%} of a batch-1 step: that is the per-sequence "
       f"part of the solution below, and the rest of a batch-1 step, about {t1 - (t8 - t1) / 7:.2f} ms "
       f"({1 - (t8 - t1) / 7 / t1:.0%}), its once-per-step part."
       + (f" If each further sequence kept adding the same, a step of b sequences would take once-per-step + "
          f"b x per-sequence, and its tokens per second would approach, but not pass, **{t1 / ((t8 - t1) / 7):.1f}x** "
          "the batch-1 rate (the batch-1 step over the per-sequence part), however large the batch. "
          + (f"It need not keep the same: the exercise's batches 1 and 4 gave {d:.3f} ms a sequence, these steps "
             f"{(t8 - t1) / 7:.3f} ms from 1 to 8, so an extra sequence cost "
             f"{'more' if (t8 - t1) / 7 > d else 'less'} in the larger batch here, and the bound is a rough one."
             if abs((t8 - t1) / 7 - d) > 0.2 * d else
             f"The exercise's batches 1 and 4 gave about the same per sequence ({d:.3f} ms).")
          if t1 < t8 < 8 * t1 else ""))  # a once-per-step part above zero
check_claim("a decode step of 8 sequences costs less than 8 steps of one sequence (batching raises tokens per second)",
            t8 < 8 * t1, f"{t8:.3f} ms vs 8 x {t1:.3f} ms = {8 * t1:.3f} ms",
            why_it_may_not="A heavily loaded CPU during the batch-8 steps alone can break it.");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# If each sequence adds `d` ms to a step, batch 4 minus batch 1 is three sequences' worth:
# `d = (t4 - t1) / 3`. A step of eight then takes about `t1 + 7 d`, and the ratio is `1 + 7 d / t1`
# (the sentence under the measurement works it out for this run and says how far the measured ratio
# landed from it). Why does that model fit at all?
# Split a decode step into what is paid once per step and what is paid per sequence.
#
# * Once per step: reading every weight matrix (the model's parameters), launching the layers'
#   operations, Python bookkeeping in the scheduler and runner. The sentence under the measurement
#   gives its share of a batch-1 step on this run; on a real model on a GPU the weight read dominates it.
# * Per sequence: one row in each matrix multiplication (8 rows cost less than 8 single rows while
#   the weights are being read anyway, until the arithmetic itself is what the step waits for),
#   attention over that sequence's own KV, sampling one token.
#
# So the ratio lands below 8: the once-per-step part does not grow with the batch. How far below
# depends on how the two parts compare, and the measurement splits them: the sentence under it gives
# what each sequence beyond the first added between batch 1 and 8, and what that leaves of a batch-1
# step as its once-per-step part. With the embedded model on a CPU the fixed part is
# running the layers' operations, the engine's bookkeeping and reading the weights once (its few MB of
# weights may come from the CPU's cache or from memory: chapter 06, section 3, weighs the two); each
# extra sequence adds its rows in the matrix multiplies,
# its attention over its own KV, its sampling. The larger the fixed share, the more tokens per
# second eight sequences get over one, since they pay it once. On a GPU, launching each of the
# layers' operations takes about as long for one row as for eight, so a model this small pays mostly
# that fixed cost there (run this notebook on a GPU to see the ratio it gives); a model whose weights
# come from memory at every step pays mostly the
# once-per-step read, and its ratio lands near 1 (chapter 06 measures a batch of 4 against 1 at
# Qwen3-0.6B's shapes). For such a model the gain keeps growing with the batch only until the
# per-sequence work (the arithmetic) catches up with the weight read; where that happens is the ridge
# point of chapter 06's roofline (the arithmetic per byte read at which a step stops waiting for memory
# and starts waiting for arithmetic). Where the per-sequence part is already large, as the sentence
# under the measurement finds for this tiny model when it gives a bound, the gain levels off sooner.
# </details>

# %% [markdown]
# ## Playground
#
# The block size is the knob of paging: small blocks waste less in each request's last block but make
# block tables longer (more entries to read per step); larger blocks waste more, and once one block
# holds a whole request, paging has become a contiguous reservation. Well before that, the paged
# waste can exceed that of the `prompt + max_tokens` policy (the cell says which way it went).
# Change `PLAY_BLOCK_SIZE` (try 1, 4, 64, 256) and rerun: the paged waste grows with the block size,
# while the two contiguous policies do not depend on it. The pool keeps the same number of slots.

# %% tags=["playground"]
PLAY_BLOCK_SIZE = 64  # token slots per block; the pool keeps POOL_SLOTS slots in all

play, _, play_totals, play_waste = slot_census(PLAY_BLOCK_SIZE)
play.shutdown()
print(f"block size {PLAY_BLOCK_SIZE}: share of held slots that sat empty: "
      + ", ".join(f"{k} {v:.1%}" for k, v in play_waste.items())
      + f" (block size {BLOCK_SIZE}: paged {waste['paged']:.1%})")


def compare(a, b):
    return "more than" if a > b else "less than" if a < b else "as much as"


render(f"With blocks of {PLAY_BLOCK_SIZE} slot{'' if PLAY_BLOCK_SIZE == 1 else 's'} the paged pool left "
       f"**{play_waste['paged']:.1%}** of its held slots empty, "
       f"{compare(play_waste['paged'], play_waste['contiguous_max_tokens'])} the contiguous "
       f"`prompt + max_tokens` reservation's **{play_waste['contiguous_max_tokens']:.1%}**.")
if PLAY_BLOCK_SIZE != BLOCK_SIZE:
    bigger = PLAY_BLOCK_SIZE > BLOCK_SIZE
    check_claim(f"paged waste is {'larger' if bigger else 'smaller'} with blocks of {PLAY_BLOCK_SIZE} than of {BLOCK_SIZE}",
                (play_waste["paged"] > waste["paged"]) == bigger,
                f"{play_waste['paged']:.1%} vs {waste['paged']:.1%}")
check_claim("the contiguous policies do not depend on the block size",
            all(abs(play_waste[k] - waste[k]) < 1e-12 for k in ("contiguous_max_tokens", "contiguous_max_len")),
            ", ".join(f"{k} {play_waste[k]:.1%}" for k in ("contiguous_max_tokens", "contiguous_max_len")));

# %% [markdown]
# ## 5. Check yourself

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
         "Right: blocks are taken only when a token needs a slot, so only the tail of the last block is empty "
         "(checked on every step of the workload above).",
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
         f"Right: a decode step of 8 sequences cost {ratio:.2f}x a step of 1 on this run (section 4), so "
         f"more requests in memory means more tokens per step.",
         "Blocks are only a memory layout; the computation is the same attention over the same keys.",
         "Prefill is unchanged; chapter 08's prefix caching is what skips part of it."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * describe minivllm's KV pool: one tensor cut into blocks of `block_size` token slots, handed to
#   requests as they grow and taken back when they finish;
# * count the blocks a request holds from its tokens with KV, and read its block table;
# * turn a logical position into a physical slot,
#   `slot = block_table[p // block_size] * block_size + p % block_size`, and know that the runner builds
#   this slot mapping for every new token while the backend reads earlier tokens through the block tables;
# * measure how much of a reservation sits empty under paged and contiguous allocation, and explain why
#   paging keeps that to the tail of each request's last block;
# * explain, with a measured decode step at batch 1 and 8, why memory saved turns into throughput:
#   the capacity that continuous batching (chapter 05) fills.
