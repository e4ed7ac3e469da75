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
# # 03 · The KV cache
#
# In chapter 01 the hand-written loop got slower with every token, while the engine's decode steps
# did not. The difference is the **KV cache**: the engine keeps every earlier token's attention keys
# and values instead of recomputing them. In this chapter you build generation both ways by hand
# on the engine's model, check that they produce the same tokens, measure what each costs per token
# as the sequence grows (next to the FLOPs each must do), and then measure what the cache costs in
# memory: bytes per token from the config against the engine's real KV tensor.
#
# **You will:** see why causal attention lets earlier keys and values be reused · generate with and
# without a cache and get identical tokens · measure cost per token against sequence length for both
# · compute KV bytes per token from the config and check it against the allocated tensor · watch the
# engine's cache fill block by block.

# %% [markdown]
# ## Setup
#
# The embedded `minivllm-tiny` unless `MINIVLLM_MODEL` says otherwise; the device is chosen
# automatically. A pool of 64 blocks of 16 tokens is plenty for this chapter.

# %% tags=["parameters"]
import os
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
llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64)
engine = llm.llm_engine
runner, model, hf = engine.runner, engine.runner.model, engine.source.hf_config
tok = llm.get_tokenizer()
print(describe(llm))
print("torch threads:", torch.get_num_threads())

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
# * **the engine**: a decode step at that length, from its `StepRecord` (the same work as "with a
#   cache", plus the engine's scheduling and bookkeeping).
#
# Each is timed three times and the median kept. Beside the times, the FLOPs each route must do,
# from the roofline model (`minivllm.telemetry.roofline.step_cost`: 2 FLOPs per weight per token,
# plus attention's `QK^T` and `PV`).

# %%
from pydoc_data.topics import topics  # a long English text that ships with Python

from minivllm.telemetry.roofline import step_cost

text_ids = tok.encode(topics["for"] + topics["while"] + topics["if"])
LENGTHS = [16, 64, 128, 256, 512]
assert len(text_ids) > max(LENGTHS), len(text_ids)


def median_ms(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


rows = []
greedy3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
for L in LENGTHS:
    ids = text_ids[:L]
    full_ms = median_ms(lambda: forward(ids, 0, new_cache(L)))
    cache = new_cache(L)
    forward(ids[:-1], 0, cache)                            # the first L-1 tokens' K/V are cached
    step_ms = median_ms(lambda: forward(ids[-1:], L - 1, cache))  # the token at position L-1 alone
    engine.add_request(f"len{L}", ids[:-1], greedy3)       # prompt of L-1: its first decode step has context L
    recs = []
    while engine.has_unfinished_requests():
        recs.append(engine.step_with_record().record)
    engine_ms = statistics.median(r.wall_ms for r in recs if r.phase == "decode")
    flops_full, _ = step_cost(engine.model_cost, [(L, L)], 1)
    flops_step, _ = step_cost(engine.model_cost, [(1, L)], 1)
    rows.append(dict(L=L, no_cache_ms=full_ms, cache_ms=step_ms, engine_decode_ms=engine_ms,
                     no_cache_mflop=flops_full / 1e6, cache_mflop=flops_step / 1e6))

import pandas as pd

df = pd.DataFrame(rows).set_index("L")
df["time ratio"] = df.no_cache_ms / df.cache_ms
df["FLOP ratio"] = df.no_cache_mflop / df.cache_mflop
df.round(2)

# %%
# NBVAL_CHECK_OUTPUT
print("FLOPs the step must do, from the config (roofline.step_cost):")
for r in rows:
    print(f"  L={r['L']:4d}: without cache {r['no_cache_mflop']:10.1f} MFLOP   with cache {r['cache_mflop']:7.2f} MFLOP"
          f"   ratio {r['no_cache_mflop'] / r['cache_mflop']:6.1f}")

# %%
import plotly.graph_objects as go

from widgets import show_figure

fig = go.Figure()
fig.add_scatter(x=df.index, y=df.no_cache_ms, mode="lines+markers", name="without cache: L tokens per step")
fig.add_scatter(x=df.index, y=df.cache_ms, mode="lines+markers", name="with cache: 1 token per step (by hand)")
fig.add_scatter(x=df.index, y=df.engine_decode_ms, mode="lines+markers", name="engine decode step")
fig.update_layout(title=f"Measured cost of the next token after L tokens ({engine.source.name}, {DEV})",
                  xaxis_title="sequence length L (tokens)", yaxis_title="ms for one token", height=400,
                  yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.25))
show_figure(fig)
longest = LENGTHS[-1]
print(f"at L={longest}: without cache {df.no_cache_ms[longest]:.1f} ms, with cache {df.cache_ms[longest]:.2f} ms "
      f"({df['time ratio'][longest]:.0f}x); the FLOPs differ {df['FLOP ratio'][longest]:.0f}x")
print(f"generating {longest} tokens from nothing: without cache ~{df.no_cache_ms.mean() * longest / 1e3:.1f} s "
      f"(the per-token cost grows with L, so the total grows ~L^2), with cache ~{df.cache_ms.mean() * longest / 1e3:.2f} s")

# %% [markdown]
# Without a cache the cost per token climbs with the sequence: the FLOPs grow in proportion to `L`,
# and so, once the step is big enough to be dominated by arithmetic, does the time. Over a whole
# generation that makes the total quadratic in the length. With a cache the cost per token is
# nearly flat: one token's worth of matmuls, plus attention over `L` cached entries, which grows
# with `L` but is small next to the weights until contexts get long.
#
# The measured time ratio is smaller than the FLOP ratio at short lengths: a one-token step on a
# small model is dominated by fixed costs (Python, launching dozens of small operations), not by
# FLOPs. That is exactly what chapter 06 measures in detail.
#
# ## 4. What the cache costs: bytes per token
#
# Every token in the cache stores one key and one value vector per KV head, in every layer:
#
# `KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element`

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.engine.kv_cache import kv_bytes_per_token
from minivllm.models.hf_config import get_head_dim

elem = torch.empty((), dtype=runner.dtype).element_size()
formula = 2 * hf.num_hidden_layers * hf.num_key_value_heads * get_head_dim(hf) * elem
print(f"from the config: 2 x {hf.num_hidden_layers} layers x {hf.num_key_value_heads} kv heads x "
      f"{get_head_dim(hf)} head_dim x {elem} bytes ({runner.dtype}) = {formula:,} bytes per token")
kv = runner.kv_cache  # the engine's whole KV pool: one tensor
slots = engine.block_manager.num_blocks * engine.block_manager.block_size
measured = kv.numel() * kv.element_size() / slots
print(f"measured: the engine's KV tensor {list(kv.shape)} = {kv.numel() * kv.element_size():,} bytes "
      f"for {slots:,} token slots = {measured:,.0f} bytes per token")
print("engine's own sizing function kv_bytes_per_token():", kv_bytes_per_token(hf, runner.dtype))
print("match:", formula == measured == kv_bytes_per_token(hf, runner.dtype))
mha = 2 * hf.num_hidden_layers * hf.num_attention_heads * get_head_dim(hf) * elem
print(f"with one KV head per query head ({hf.num_attention_heads}, no grouping) it would be {mha:,} bytes: "
      f"grouped-query attention saves {1 - formula / mha:.0%}")

# %% [markdown]
# For a real model the numbers get serious. Here the engine's own allocator builds the KV tensor for
# one 16-token block with the Qwen3-0.6B configuration (packaged with minivllm; no weights needed),
# and we read its size:

# %%
# NBVAL_CHECK_OUTPUT
import json
from importlib.resources import files

from transformers import Qwen3Config

cfg06 = Qwen3Config(**json.loads((files("minivllm") / "assets/configs/qwen3-0.6b/config.json").read_text()))
for dt in (torch.bfloat16, torch.float32):
    pool, _ = allocate_kv_cache(cfg06, 1, 16, dt, torch.device("cpu"))  # one block of 16 token slots
    per_token = pool.numel() * pool.element_size() // 16
    print(f"Qwen3-0.6B ({cfg06.num_hidden_layers} layers, {cfg06.num_key_value_heads} kv heads x "
          f"{cfg06.head_dim}) in {str(dt).replace('torch.', '')}: {per_token:,} bytes per token measured, "
          f"formula {kv_bytes_per_token(cfg06, dt):,}; a 32,768-token context needs "
          f"{per_token * 32768 / 2**30:.2f} GiB")
    del pool

# %% [markdown]
# About 112 KiB per token in bf16: a single 32k-token conversation holds 3.5 GiB of KV, more than
# twice the model's own 1.2 GiB of bf16 weights. Serving many users at once is therefore mostly a
# question of KV memory, which is why the next chapter is about managing it.
#
# ## 5. Watch the engine's cache fill
#
# The engine does not reserve a strip per sequence. It hands out blocks of 16 token slots, one at
# a time, as a sequence grows. Below, a request with a 30-token prompt generates 20 tokens; the
# view shows the engine's KV pool (each cell a block, coloured by owner; hover for the tokens it
# holds). Step it with the stepper's **Step** and watch a new block appear every 16 tokens.

# %%
from widgets import EngineStepper, KVCacheView

stepper = EngineStepper(llm, max_tokens=20, show_chart=False)
view = KVCacheView(llm, stepper=stepper)
rid = stepper.add_request(text_ids[:30], max_tokens=20, ignore_eos=True)
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
for index, phase, n, blocks, used in history:
    print(f"step {index}: {phase:7s} tokens with KV {n:3d} -> blocks held {blocks} ({blocks * 16} slots, "
          f"{blocks * 16 * per_token / 1024:.0f} KiB reserved, {n * per_token / 1024:.1f} KiB used)")

# %% [markdown]
# The reserved memory steps up one block at a time and never runs more than one block (15 slots)
# ahead of what is used. Press **Run to end** above and the request finishes: its blocks go back to
# the pool (the full ones stay registered in the prefix cache, hatched: chapter 08).
#
# ## 6. Check yourself

# %%
from widgets import Quiz, Question

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
        "Without a KV cache, generating n tokens costs about how much compared to with one?",
        ["The same", "About twice as much", "About n/2 times as much for long outputs: each step redoes the "
         "whole sequence", "Less, because there is no cache to manage"],
        2,
        ["The measured per-token cost without a cache grows with L while the cached one stays nearly flat.",
         "The ratio grows with the length: at L=512 the FLOP ratio above is in the hundreds.",
         "Right: step i processes about p + i tokens instead of 1, so the total is quadratic instead of linear.",
         "Managing the cache costs bookkeeping, but recomputation costs far more FLOPs (table above)."],
    ),
    Question(
        "Qwen3-0.6B in bf16 holds about 112 KiB of KV per token. What does a batch of 64 requests "
        "with 4,096 tokens each need?",
        ["About 28 GiB", "About 112 MiB", "About 1.75 GiB", "Nothing extra: the cache is in the weights"],
        0,
        ["Right: 64 x 4096 tokens x 114,688 bytes = 28 GiB, far more than the 1.2 GiB of weights.",
         "That is the cache of about 1,000 tokens, not 262,144.",
         "That is the cache of one 16k-token request, not 64 requests of 4k.",
         "The KV cache is per token of every live request, separate from the weights."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * Causal attention makes earlier tokens' keys and values reusable; caching them turns each decode
#   step into one token's work. It changes cost, never the result (identical greedy tokens above).
# * Without a cache the cost per token grows with the sequence and the total with its square; with a
#   cache the per-token cost is nearly flat until attention over long contexts becomes significant.
# * KV bytes per token = 2 x layers x kv_heads x head_dim x element size; measured on the engine's
#   tensor it matches exactly. Grouped-query attention shrinks it by the group size.
# * At serving scale the KV cache, not the weights, is what fills memory.
#
# Next: chapter 04, how the engine hands out that memory in blocks (PagedAttention).
