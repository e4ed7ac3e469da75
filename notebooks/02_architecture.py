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
# # 02 · Architecture: the Qwen3 model and the engine around it
#
# Chapter 01 called the model as one function. This chapter opens it: what a Qwen3 decoder layer is
# made of, how many parameters sit in each part (counted on the loaded model, and checked against the
# formula from its config), and what shape every tensor has as one real forward pass goes through it.
# Then the same for the engine: which objects make it up in the running `LLM`, and the path one
# request takes through them, step by step, as the engine records it.
#
# **Goal:** name every part of a Qwen3 model and of the engine, derive any parameter count from the
# config, and follow one request through the engine with real values.
#
# **Prerequisites:** chapter 01 (tokens, logits, the generation loop, prefill and decode steps);
# matrix multiplication and the idea of attention (queries, keys, values).
#
# **Time:** about 35 minutes (reading and running).
#
# **You will:** count the parameters of every module of the loaded model and derive the counts from
# the config, after predicting one layer's count yourself · predict, then count, the parameters of
# Qwen3-0.6B from its config · watch tensor shapes through one prefill and one decode pass with
# forward hooks · name the engine's components in the live object · trace one request through
# scheduler, runner, model, attention backend, sampler and detokenizer · read its step records.

# %% [markdown]
# ## Setup
#
# As in every chapter, the model is the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names a Qwen3
# checkpoint directory or a `random:` preset; the device is chosen automatically.

# %% tags=["parameters"]
import os
import collections
from collections import defaultdict

import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)

# %%
# enforce_eager: every step runs the model's forward (no replay of a recorded decode graph: CUDA
# graphs on a GPU, CPU graphs on a CPU, chapter 11), so the tracers below see every pass.
from widgets import check_claim, check_prediction, idle_engine, render

llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64, enforce_eager=True)
engine = llm.llm_engine
model = engine.runner.model
hf = model.config
print(describe(llm))
print("torch threads:", torch.get_num_threads())
# what every chart of this chapter says it measured: model, device, dtype, threads
RUN = (f"{engine.source.name} · {engine.config.device} · {str(engine.config.dtype).replace('torch.', '')} · "
       f"{torch.get_num_threads()} thread(s)")

# %% [markdown]
# ## 1. The model, from the object itself
#
# Printing a `torch.nn.Module` lists its submodules. Here is the top and the first decoder layer
# (all layers are identical in structure):

# %%
# NBVAL_CHECK_OUTPUT
print(f"Qwen3ForCausalLM: {len(model.model.layers)} x Qwen3DecoderLayer, hidden size {hf.hidden_size}, "
      f"{hf.num_attention_heads} query heads and {hf.num_key_value_heads} key/value heads of {model.head_dim}, "
      f"MLP width {hf.intermediate_size}, vocabulary {hf.vocab_size}, tied embeddings {model.tie_word_embeddings}")
print(model.model.layers[0])

# %% [markdown]
# Reading it top to bottom, one layer computes
#
# * `input_layernorm`: RMSNorm, rescales each token's vector to unit root-mean-square (times a learned gain);
# * `self_attn`: one matmul `qkv_proj` produces queries, keys and values for all heads at once;
#   `q_norm` / `k_norm` normalise every head (a Qwen3 detail); `rotary` rotates q and k by the token's
#   position (RoPE); the attention backend mixes information across tokens; `o_proj` maps back;
# * a residual add, `post_attention_layernorm`, then the `mlp`: SwiGLU,
#   `down_proj(silu(gate) * up)` where `gate_up_proj` computes gate and up in one matmul.
#
# minivllm packs q/k/v into one matrix and gate/up into another; the loader copies Hugging Face
# checkpoints' separate `q_proj`, `k_proj`, ... into slices of them. Grouped-query attention (GQA):
# there are fewer key/value heads than query heads, and each key/value head serves a group of query
# heads, which shrinks the KV cache (chapter 03).
#
# Why pack? One matmul over the packed matrix does the same arithmetic as three over its slices, but
# it is one call instead of three (each call has a fixed cost: dispatch, and on a GPU a kernel launch)
# and one wider output the hardware can fill better. The cell below times both on this device through
# the engine's own matmul (`minivllm.layers.prepack.linear`: on a CPU our C GEMM over the layer's
# packed weight, chapter 11; on a GPU torch's), with layer 0's `qkv_proj` weight, for one token's row
# (a decode step) and for 64 rows (a prefill chunk). A third timing is a call on a 16 x 16 weight, which
# does almost no arithmetic: its time is roughly what any call costs before it computes anything.
# Each timing is the median of `torch.utils.benchmark`'s repeated runs; the three are interleaved over
# five rounds and the fastest round kept, since other work on the machine only ever slows a round.

# %%
from torch.utils import benchmark

from minivllm.layers.prepack import dense, is_packed, linear, pack_weight

nq_, nkv_, hd_ = hf.num_attention_heads, hf.num_key_value_heads, model.head_dim
W_qkv = model.model.layers[0].self_attn.qkv_proj.matmul_weight  # as the engine multiplies it: packed on a CPU
# the same values as three separate weights, each prepared as the engine prepares a weight
W_parts = [w.contiguous() for w in dense(W_qkv).split([nq_ * hd_, nkv_ * hd_, nkv_ * hd_])]
W_q, W_k, W_v = (pack_weight(w) if is_packed(W_qkv) else w for w in W_parts)
gen = torch.Generator(device=engine.config.device).manual_seed(0)
make = dict(device=engine.config.device, dtype=engine.config.dtype, generator=gen)
W_tiny = torch.randn(16, 16, **make).to(torch.float16).to(engine.config.dtype)  # float16-exact, as the model's
W_tiny = pack_weight(W_tiny) if is_packed(W_qkv) else W_tiny


def median_us(fn) -> float:
    """Median time of one call of ``fn``, microseconds (benchmark.Timer syncs a GPU)."""
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.1).median * 1e6


packing = {}  # rows -> (packed, three apart, one call on the 16 x 16 weight), fastest of five rounds, us
for rows in (1, 64):
    x = torch.randn(rows, hf.hidden_size, **make)
    x_tiny = torch.randn(rows, 16, **make)
    rounds = [(median_us(lambda: linear(x, W_qkv)),
               median_us(lambda: (linear(x, W_q), linear(x, W_k), linear(x, W_v))),
               median_us(lambda: linear(x_tiny, W_tiny))) for _ in range(5)]
    packed, apart, tiny = (min(col) for col in zip(*rounds))
    packing[rows] = (packed, apart, tiny)
    print(f"{rows:>2} row(s) x {hf.hidden_size}: one packed {tuple(dense(W_qkv).shape)} matmul {packed:6.1f} us, "
          f"three (q, k, v) {apart:6.1f} us  -> three take {apart / packed:.2f}x;  a 16 x 16 call {tiny:5.1f} us")

# %%
ratio = {r: a_ / p_ for r, (p_, a_, _t) in packing.items()}  # > 1: the packed matmul was faster
verdicts = [f"**{x:.2f}x** faster than the three at {r} row(s)" if x > 1.05 else
            f"**{1 / x:.2f}x** slower than the three at {r} row(s)" if x < 1 / 1.05 else
            f"as fast as the three within 5% at {r} row(s) ({x:.2f}x)" for r, x in ratio.items()]
extra = {r: (a_ - p_, 2 * t_) for r, (p_, a_, t_) in packing.items()}  # the three's extra time; two calls' cost
_ = render(f"Here ({RUN}), the packed matmul was {' and '.join(verdicts)}. The three took "
           + " and ".join(f"{e:.1f} us more at {r} row(s)" for r, (e, _c) in extra.items())
           + "; two calls on the 16 x 16 weight take "
           + " and ".join(f"{c:.1f} us" for _e, c in extra.values()) + " at the same row counts.")
check_claim("packing q, k and v into one matmul pays off more for one row than for 64",
            ratio[1] > 1.05 and ratio[1] > 1.05 * ratio[64],
            f"three calls over one: {ratio[1]:.2f}x at 1 row, {ratio[64]:.2f}x at 64",
            why_it_may_not="A call's fixed cost is the same at both sizes but weighs most where a call computes "
                           "least; load from other processes during one round can hide that.")

# %% [markdown]
# At one row, a call computes little, so the two extra calls' fixed cost is a large share of the
# three calls' time; at 64 rows the same fixed cost hides behind 64 times the arithmetic. In a decode
# step every matmul has the batch's few rows, which is why the engine packs q/k/v and gate/up.

# %% [markdown]
# ### Exercise 1 · One decoder layer's parameters
#
# The printout above gives everything you need: the hidden size, the head counts and head
# dimension, the MLP width, and each layer's modules with their `in_features` and `out_features`. A
# linear layer without bias holds `in x out` weights; an RMSNorm holds one gain per element of the
# vector it normalises. How many parameters does one decoder layer hold?

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: parameters in one decoder layer (a count)

# %% [markdown]
# ### Parameter counts, measured and derived
#
# Below, each module's parameter count is read from the model (`p.numel()` summed over its
# parameters) and, beside it, computed from the config alone.

# %%
# NBVAL_CHECK_OUTPUT
H, V, I = hf.hidden_size, hf.vocab_size, hf.intermediate_size
nq, nkv, d = hf.num_attention_heads, hf.num_key_value_heads, model.head_dim
bias = bool(getattr(hf, "attention_bias", False))
layer = model.model.layers[0]
expected = {  # formula from the config: rows x columns of each weight (+ bias, + norm gains)
    "self_attn.qkv_proj": H * (nq + 2 * nkv) * d + bias * (nq + 2 * nkv) * d,
    "self_attn.o_proj": nq * d * H + bias * H,
    "self_attn.q_norm": d,
    "self_attn.k_norm": d,
    "mlp.gate_up_proj": H * 2 * I,
    "mlp.down_proj": I * H,
    "input_layernorm": H,
    "post_attention_layernorm": H,
}
count = lambda m: sum(p.numel() for p in m.parameters())
print(f"{'module (layer 0)':28s} {'measured':>10s} {'from config':>12s}")
for name, want in expected.items():
    got = count(layer.get_submodule(name))
    print(f"{name:28s} {got:10,d} {want:12,d}  {'ok' if got == want else 'MISMATCH'}")
per_layer = count(layer)
print(f"{'one decoder layer':28s} {per_layer:10,d} {sum(expected.values()):12,d}")
print()
total_unique = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
parts = {
    "embed_tokens": (count(model.model.embed_tokens), V * H),
    f"{len(model.model.layers)} decoder layers": (sum(count(l) for l in model.model.layers),
                                                  len(model.model.layers) * sum(expected.values())),
    "final norm": (count(model.model.norm), H),
    "lm_head (own weights)": (total_unique - count(model.model), 0 if model.tie_word_embeddings else V * H),
}
for name, (got, want) in parts.items():
    print(f"{name:28s} {got:10,d} {want:12,d}  {'ok' if got == want else 'MISMATCH'}")
print(f"{'total':28s} {total_unique:10,d} {sum(w for _, w in parts.values()):12,d}")

# %%
_ = check_prediction(my_prediction_1, per_layer, rel_tol=0.02, unit="parameters",
                     what="the measured count of one decoder layer")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Go module by module, with `H` the hidden size, `nq` and `nkv` the query and key/value heads, `d`
# the head dimension and `I` the MLP width:
#
# * `qkv_proj`: `H` in, `(nq + 2·nkv)·d` out (queries for every query head, keys and values for
#   every KV head), so `H·(nq + 2·nkv)·d` weights;
# * `o_proj`: `nq·d` in, `H` out;
# * `gate_up_proj`: `H` in, `2·I` out; `down_proj`: `I` in, `H` out, so the MLP holds `3·H·I`;
# * norms: `q_norm` and `k_norm` have `d` gains each (they normalise one head at a time), the two
#   layer norms `H` each.
#
# The matmuls are nearly everything: compare the norms' rows with the matmuls' in the table. The
# sum is the "one decoder layer" row of the table, where the measured and derived columns agree. A common slip is to give keys and values as many heads as queries: that
# overcounts `qkv_proj` whenever the model uses grouped-query attention.
# </details>

# %%
share = {name: got / total_unique for name, (got, _) in parts.items()}
attn = len(model.model.layers) * (expected["self_attn.qkv_proj"] + expected["self_attn.o_proj"])
mlp = len(model.model.layers) * (expected["mlp.gate_up_proj"] + expected["mlp.down_proj"])
print(f"embedding table: {share['embed_tokens']:.0%} of all parameters; attention matmuls {attn / total_unique:.0%}; "
      f"MLP matmuls {mlp / total_unique:.0%}; norms {1 - share['embed_tokens'] - (attn + mlp) / total_unique:.2%}")
# as held: the engine may keep a float32 model's linears in 16 bits where the checkpoint's values fit exactly
held = collections.Counter()
for p in model.parameters():
    held[p.dtype] += p.numel() * p.element_size()
# a tied weight keeps the plain table for lookups and, on a CPU, a private copy laid out for its matmul
copies = [m.packed_copy for m in model.modules() if getattr(m, "packed_copy", None) is not None]
for c in copies:
    held[c.dtype] += c.numel() * c.element_size()
print(f"weights in memory: {sum(held.values()) / 2**20:.1f} MiB as held ("
      + ", ".join(f"{b / 2**20:.1f} MiB in {dt}" for dt, b in held.items()) + f"; engine dtype {engine.config.dtype}"
      + (f"; of which {sum(c.numel() * c.element_size() for c in copies) / 2**20:.1f} MiB is the output layer's "
         f"packed copy of the tied embedding table" if copies else "") + ")")

# %% [markdown]
# The last line counts the weights as the engine holds them, with the engine's dtype. The embedded
# model's checkpoint is stored in float16. On a CPU the engine computes in float32 (its default dtype
# there) but keeps each linear layer's weights in float16 when every value fits exactly (its matrix
# multiply widens them back to the same float32 values as it reads them: same results, half the bytes;
# `minivllm/layers/cpu_gemm.py`), and the embedding table and the norms stay in float32. On a GPU the
# default dtype is bfloat16 and every weight is held in it; the line above says which case this run is.
#
# When weights are **tied** (`tie_word_embeddings`), the LM head reuses the embedding matrix, so it
# adds no parameters. It need not save memory, though: on a CPU the engine keeps a second copy of that
# matrix for the LM head, in the layout its matrix multiply reads (the lookup needs the plain table), and
# the line above counts such a copy when there is one. How the parameters divide up depends on the
# model's shape, so let us set this toy model beside real ones.
#
# ### Exercise 2 · How many parameters has Qwen3-0.6B?
#
# minivllm ships the configurations of Qwen3-0.6B and Qwen3-1.7B (no weights). The next cell prints
# the numbers the formulas above need. From them, predict Qwen3-0.6B's total parameter count, in
# millions; then the cell after builds minivllm's own model module with that config on PyTorch's
# `meta` device (shapes only, no memory) and counts.

# %%
# NBVAL_CHECK_OUTPUT
import json
from importlib.resources import files

from transformers import Qwen3Config

from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.telemetry.roofline import ModelCost

configs = {name: Qwen3Config(**json.loads((files("minivllm") / f"assets/configs/{name.lower()}/config.json").read_text()))
           for name in ("Qwen3-0.6B", "Qwen3-1.7B")}
FIELDS = ["hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
          "head_dim", "num_hidden_layers"]
FLAGS = ["tie_word_embeddings", "attention_bias"]
for name, c in configs.items():
    print(name + ": " + ", ".join(f"{f} {getattr(c, f)}" for f in FIELDS + FLAGS))

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: Qwen3-0.6B's parameters, in millions

# %%
from minivllm.models.hf_config import get_head_dim

rows = []
for name, c in [(engine.source.name, hf)] + list(configs.items()):
    if name == engine.source.name:
        nparams = total_unique                # the loaded model: counted above
    else:
        with torch.device("meta"):            # shapes only: nothing is allocated
            nparams = sum(p.numel() for p in Qwen3ForCausalLM(c).parameters())
    mc = ModelCost.from_config(c)             # the same formulas as the table above, from the config
    hd = get_head_dim(c)
    layer_attn = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * hd \
        + c.num_attention_heads * hd * c.hidden_size
    layer_mlp = 3 * c.hidden_size * c.intermediate_size
    rows.append(dict(model=name, config=c, params=nparams, from_config=mc.num_params,
                     embedding=mc.embedding_params / nparams,
                     attention=c.num_hidden_layers * layer_attn / nparams,
                     mlp=c.num_hidden_layers * layer_mlp / nparams, bf16_gib=nparams * 2 / 2**30))
print(f"{'model':14s} {'parameters':>14s} {'from config':>14s} {'embedding':>10s} {'attention':>10s} {'MLP':>6s} "
      f"{'in bf16 (*)':>13s}")
for r in rows:
    print(f"{r['model']:14s} {r['params']:14,d} {r['from_config']:14,d} {r['embedding']:10.1%} {r['attention']:10.1%} "
          f"{r['mlp']:6.1%} {r['bf16_gib']:9.2f} GiB")
print("(*) what the weights take stored in bfloat16: parameters x 2 bytes")
params06 = next(r["params"] for r in rows if r["model"] == "Qwen3-0.6B")
_ = check_prediction(my_prediction_2, params06 / 1e6, rel_tol=0.05, unit="M",
                     what="the parameters counted on the model built from the config")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Use exercise 1's per-layer formula with Qwen3-0.6B's numbers, times the layer count, then add the
# embedding table (`vocab_size x hidden_size`) once: the embeddings are tied, so the LM head adds
# nothing. The layers hold the attention projections and the MLP (`3 x hidden x MLP width` each);
# the norms are negligible. Two details decide whether you land close: Qwen3-0.6B's head dimension
# times its query heads is *larger* than its hidden size (its `q_proj` widens the vector), and its
# vocabulary of about 152k entries makes the embedding table a large slice of the total, as the
# table's embedding column shows. Forgetting the embedding, or counting it twice, is the usual slip.
# </details>

# %%
real = rows[1:]  # the two Qwen3 configurations: same vocabulary, different widths and depths
toy = rows[0]    # the loaded model
share_text = f"{real[0]['embedding']:.0%} in {real[0]['model']}, {real[1]['embedding']:.0%} in {real[1]['model']}"
_ = render("The embedding table holds " + ", ".join(f"**{r['embedding']:.0%}** of {r['model']}'s" for r in rows)
           + " parameters. Between the two real Qwen3 models the vocabulary stays the same while the layers widen, "
           + (f"so the embedding's share falls as the model grows ({share_text}) and the decoder layers' matmuls "
              "dominate more. "
              if real[1]["embedding"] < real[0]["embedding"] else
              f"yet the embedding's share does not fall here ({share_text}). ")
           + (f"{toy['model']} is no point on that trend: its vocabulary ({toy['config'].vocab_size:,} entries, "
              f"against {real[0]['config'].vocab_size:,} for Qwen3) is far smaller, but so are its layers, so its "
              "share reflects how it was shrunk, not its size. "
              if toy["config"].vocab_size < real[0]["config"].vocab_size else "")
           + "The norm gains are a rounding error in every one.")
_ = check_claim("in every model above, the MLP holds more parameters than attention",
                all(r["mlp"] > r["attention"] for r in rows),
                "; ".join(f"{r['model']}: MLP {r['mlp']:.0%}, attention {r['attention']:.0%}" for r in rows))
_ = check_claim("the embedding's share is smaller in Qwen3-1.7B than in Qwen3-0.6B",
                real[1]["embedding"] < real[0]["embedding"],
                " vs ".join(f"{r['model']} {r['embedding']:.0%}" for r in real))

# %% [markdown]
# ## 2. Tensor shapes along one forward pass
#
# Forward hooks are callbacks PyTorch runs after a module's forward. We register one on every
# module of layer 0 (and on the embedding and final norm), wrap the attention backend and the LM
# head the same way, and then let **the engine** run a request: one prefill step of the whole
# prompt, and one decode step of a single token. Every shape below was recorded during those two
# real steps.

# %%
PROMPT = 'Return the number of items in the container'
idle_engine(llm)  # a request left by the stepper in section 5 would join these passes and their shapes
shapes = defaultdict(list)  # module name -> [shapes in the prefill pass, shapes in the decode pass]


def shape_of(x):
    if isinstance(x, torch.Tensor):
        return list(x.shape)
    if isinstance(x, (tuple, list)):
        return [shape_of(t) for t in x if isinstance(t, (torch.Tensor, tuple, list))]
    return None


layer = model.model.layers[0]  # again here: the engine's cell may have run again since section 1 (a new model)
watched = {"model.embed_tokens": model.model.embed_tokens, "model.norm": model.model.norm}
watched.update({f"layers.0.{n}": m for n, m in layer.named_modules() if n and n != "self_attn.rotary"})
watched["layers.0"] = layer
handles = [m.register_forward_hook(lambda mod, args, out, name=name: shapes[name].append(shape_of(out)))
           for name, m in watched.items()]

backend = engine.runner.backend
real_attention, real_logits = backend.forward, model.compute_logits


def traced_attention(q, k, v, k_cache, v_cache, meta, scale):
    out = real_attention(q, k, v, k_cache, v_cache, meta, scale)
    if len(shapes["attention q, k, v"]) < len(shapes["model.embed_tokens"]):  # first call of a pass: layer 0
        shapes["attention q, k, v"].append([list(q.shape), list(k.shape), list(v.shape)])
        shapes["attention output"].append(list(out.shape))
        shapes["KV cache of the layer"].append(list(k_cache.shape))
    return out


def traced_logits(hidden):
    logits = real_logits(hidden)
    shapes["compute_logits"].append([list(hidden.shape), list(logits.shape)])
    return logits


backend.forward, model.compute_logits = traced_attention, traced_logits
try:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
finally:
    for h in handles:
        h.remove()
    del backend.forward, model.compute_logits  # back to the class methods

# %%
# NBVAL_CHECK_OUTPUT
n = len(out.prompt_token_ids)
print(f"prompt: {n} tokens; T = tokens in the forward pass (prefill: {n}, decode: 1)")
order = ["model.embed_tokens", "layers.0.input_layernorm", "layers.0.self_attn.qkv_proj", "layers.0.self_attn.q_norm",
         "layers.0.self_attn.k_norm", "attention q, k, v", "KV cache of the layer", "attention output",
         "layers.0.self_attn.o_proj", "layers.0.self_attn", "layers.0.post_attention_layernorm",
         "layers.0.mlp.gate_up_proj", "layers.0.mlp.act_fn", "layers.0.mlp.down_proj", "layers.0.mlp", "layers.0",
         "model.norm", "compute_logits"]
print(f"{'module':36s} {'prefill pass':42s} decode pass")
for name in order:
    pre, dec = shapes[name][0], shapes[name][1]
    print(f"{name:36s} {str(pre):42s} {dec}")

# %% [markdown]
# How to read it (`T` is the number of tokens in the step, the first dimension everywhere):
#
# * The embedding turns `T` ids into `T` vectors of the hidden size. Between layers (the residual
#   stream, up to the final norm) the shape stays `[T, hidden]`: a decoder layer maps a sequence of
#   vectors to a sequence of vectors. Inside a layer the projections widen it and narrow it back.
# * `qkv_proj` widens each token to `(query heads + 2 x kv heads) x head_dim` columns; the attention
#   backend receives them split per head: q `[T, query heads, head_dim]`, k and v
#   `[T, kv heads, head_dim]`.
# * The layer's KV cache is `[num_blocks, block_size, kv heads, head_dim]`: the same shape in both
#   passes, because it is a preallocated pool (chapter 04); each step writes its `T` new keys and
#   values into it, and every later step's attention reads them back (a decode step reads the keys
#   and values of every token before it).
# * `gate_up_proj` is twice the MLP width (gate and up side by side); `act_fn` (SiLU(gate) x up)
#   halves it again; `down_proj` returns to the hidden size.
# * The decoder layer returns two tensors: minivllm fuses the residual add into the next norm, so a
#   layer hands on `(output, residual)`. A norm that is given the residual (`post_attention_layernorm`,
#   `model.norm`) adds it and returns two tensors as well: `(normalised sum, sum)`, the sum being the
#   residual stream that goes on (`model.norm` is the last, so the model drops it). Layer 0's
#   `input_layernorm` returns one tensor because no residual exists yet (its input is the
#   embedding itself); from layer 1 on, `input_layernorm` is given the previous layer's residual too.
# * Only the **last** position of the prompt goes through the LM head in prefill, because only it
#   predicts a token we need: `compute_logits` gets `[1, hidden]`, not `[T, hidden]`.
# * The decode pass is the same network with `T = 1`.

# %% [markdown]
# ### Playground
#
# Change `BATCH` (how many copies of the prompt arrive together) and run the cell: it runs one
# engine step, the prefill of all of them, and prints the shapes the first decoder layer and the LM
# head see. Look for: the first dimension `T` becomes the sum of all prompts' tokens (the engine
# flattens a batch into one long sequence), while `compute_logits` gets one row per request and the
# KV cache's shape does not move.

# %% tags=["playground"]
BATCH = 3  # the knob: requests prefilled together in one step
idle_engine(llm)  # only this cell's requests in the step

seen = {}


def note(key):
    def hook(module, args, out):  # a forward hook that returns None leaves the output alone
        seen.setdefault(key, shape_of(out))
    return hook


layer = model.model.layers[0]  # this engine's (see section 2's tracing cell)
hooks = [layer.self_attn.qkv_proj.register_forward_hook(note("qkv_proj out")),
         layer.mlp.register_forward_hook(note("mlp out"))]
real_logits = model.compute_logits
model.compute_logits = lambda h: (seen.setdefault("compute_logits in", list(h.shape)), real_logits(h))[1]
try:
    for b in range(BATCH):
        engine.add_request(f"play{b}", PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    rec = engine.step_with_record().record
    while engine.has_unfinished_requests():
        engine.step()
finally:
    for h in hooks:
        h.remove()
    del model.compute_logits
print(f"{BATCH} request(s) of {n} tokens in one {rec.phase} step: {rec.num_tokens} tokens through the model")
for name, shape in seen.items():
    print(f"  {name:18s} {shape}")
print(f"  {'KV cache (layer 0)':18s} {list(engine.runner.kv_cache[0, 0].shape)}")

# %% [markdown]
# ## 3. The engine's components, in the live object
#
# `LLM` is a thin facade; the work happens in `llm.llm_engine`, which owns the parts below. Each
# line is read from the running engine: the object's class and what it holds right now.

# %%
# NBVAL_CHECK_OUTPUT
runner, bm, sched = engine.runner, engine.block_manager, engine.scheduler
components = [
    ("llm.llm_engine", engine, "the loop: add_request(), step(), abort_request()"),
    ("  .scheduler", sched, f"decides each step's batch: {len(sched.waiting)} waiting, {len(sched.running)} running; "
                            f"budget {sched.config.max_num_batched_tokens} tokens, {sched.config.max_num_seqs} seqs per step"),
    ("  .block_manager", bm, f"bookkeeping of the KV pool: {bm.num_blocks} blocks of {bm.block_size} slots, "
                             f"{bm.num_used_blocks} used, prefix caching {bm.enable_prefix_caching}"),
    ("  .runner", runner, "builds input tensors + attention metadata, runs model and sampler"),
    ("  .runner.model", runner.model, f"the network: {sum(p.numel() for p in runner.model.parameters()):,} parameters"),
    ("  .runner.backend", runner.backend, f"attention over the paged KV cache ({runner.backend.name!r})"),
    ("  .runner.kv_cache", runner.kv_cache, f"the KV pool itself: tensor {list(runner.kv_cache.shape)}, "
                                            f"{runner.kv_cache.dtype}"),
    ("  .runner.sampler", runner.sampler, "logits -> token ids (greedy, temperature, top-k/p, min-p)"),
]
for path, obj, what in components:
    cls = type(obj)
    print(f"{path:20s} {cls.__module__}.{cls.__qualname__}")
    print(f"{'':20s}   {what}")
print(f"{'  .tokenizer':20s} text <-> token ids; the engine's detokenizer turns new ids into text incrementally")

# %% [markdown]
# The KV pool is `[2 (K and V), layers, blocks, block size, kv heads, head dim]`, one tensor for the
# whole engine; each layer gets a `(k_cache, v_cache)` view into it. The block manager never touches
# that tensor: it only decides *which block ids* each request owns. The runner turns those ids into
# slot numbers, and the attention backend reads and writes the tensor at those slots.
#
# ## 4. One request's journey
#
# Now we follow one request. The cell wraps the methods the engine calls in a step (`schedule`,
# `prepare_input`, the model's forward, the attention backend, `compute_logits`, the sampler,
# `update_from_output`) with a small tracer that notes each call, then drives the engine with `step()`
# until the request finishes, and prints what happened in each of its steps.

# %%
idle_engine(llm)  # the journey of one request: nothing else in its steps
trace = []        # (label, what it saw) per call, in call order
patched = []      # (object, attribute, original, was an instance attribute)
attention_calls = [0]


def patch(obj, attr, label, note):
    """Replace obj.attr by a wrapper that calls it, then records note(args, result) under label."""
    real = getattr(obj, attr)
    patched.append((obj, attr, real, attr in vars(obj)))

    def traced(*args, **kwargs):
        result = real(*args, **kwargs)
        text = note(args, result)
        if label:
            trace.append((label, text))
        return result

    setattr(obj, attr, traced)


def count_attention(args, out):
    attention_calls[0] += 1


def after_forward(args, hidden):
    n, attention_calls[0] = attention_calls[0], 0
    return f"hidden {list(hidden.shape)}; attention backend called {n} times (once per layer)"


patch(sched, "schedule", "Scheduler.schedule", lambda a, plan: "plan: " + ", ".join(
    f"{e.seq.request_id} {'prefill' if e.is_prefill else 'decode'} {e.num_tokens} token(s) from position "
    f"{e.start_pos}" for e in plan.scheduled))
patch(runner, "prepare_input", "ModelRunner.prepare_input", lambda a, inp: (
    f"input_ids {inp.input_ids.tolist()}, positions {inp.positions.tolist()}, slot_mapping "
    f"{inp.meta.slot_mapping.tolist()}, block_tables {inp.meta.block_tables.tolist()}"))
patch(runner.backend, "forward", None, count_attention)
patch(runner.model, "forward", "Qwen3ForCausalLM.forward", after_forward)
patch(runner.model, "compute_logits", "compute_logits", lambda a, lg: f"logits {list(lg.shape)}")
patch(runner, "sampler", "Sampler", lambda a, tokens: f"token ids {tokens.tolist()}")
patch(sched, "update_from_output", "Scheduler.update_from_output", lambda a, r: ", ".join(
    f"{e.seq.request_id}: num_computed_tokens -> {e.seq.num_computed_tokens}" for e in a[0].scheduled))
journey = []
try:
    engine.add_request("journey", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        trace.clear()
        result = engine.step_with_record()
        journey.append((list(trace), result))
finally:  # put every original back
    for obj, attr, real, own in reversed(patched):
        if own:
            setattr(obj, attr, real)
        else:
            delattr(obj, attr)

# %%
# NBVAL_CHECK_OUTPUT
print("(step numbers count this engine's steps since it was built, earlier cells' included)")
for calls, result in journey:
    r = result.record
    print(f"step {r.index} ({r.phase})")
    for label, info in calls:
        if label:
            print(f"  {label:26s} {info}")
    for o in result.outputs:
        print(f"  {'detokenizer -> output':26s} text so far {o.outputs[0].text!r}, finished {o.finished}")
    print(f"  {'StepRecord':26s} tokens {r.num_prefill_tokens} prefill + {r.num_decode_tokens} decode, "
          f"KV blocks used {r.kv_blocks_used}, finished {r.finished}")

# %% [markdown]
# That is one request's whole journey, with real values:
#
# `add_request` validates and tokenizes the prompt and queues a `Sequence` → every `step()`:
# `Scheduler.schedule` decides who runs and how many tokens each (and asks the block manager for KV
# blocks) → `ModelRunner.prepare_input` flattens the plan into `input_ids`, `positions` and the
# attention metadata (`slot_mapping`: where each new token's K and V go; `block_tables`: which
# blocks each sequence may read) → the model's forward, calling the attention backend once per layer
# → `compute_logits` for the rows that sample → `Sampler` → `Scheduler.update_from_output` (new
# tokens appended, stop checks on token ids and length, finished requests' blocks freed) →
# `OutputProcessor.process` (the detokenizer, stop strings) → a `RequestOutput`, plus a `StepRecord`.
#
# The slot numbers are the block id times the block size plus the offset in the block: chapter 04
# is about exactly that. In the decode steps only one token enters the model, at the next position,
# into the next slot. The request's block is not block 0: earlier cells' requests used the first
# blocks and gave them back, and a block given back joins the *back* of the free list
# (`BlockManager.release` in `minivllm/engine/block_manager.py`), so the block manager hands out a
# block no request has used yet before any recently freed one.
#
# ### Where the time of each step went
#
# Each `StepRecord` splits the step's wall time into scheduling, building inputs, the forward pass,
# sampling and postprocessing (stop checks, detokenisation, outputs). These are single steps of one
# request, each measured once, so on a busy machine they vary from run to run: the stepper in
# section 5 lets you take more. The tracer's notes (turning tensors into lists, formatting text) run
# inside the timed stages, so the cell also runs the same request once more without the tracer, to
# compare.

# %%
import plotly.graph_objects as go

from widgets import show_figure

stages = ["schedule_ms", "prepare_ms", "model_ms", "sample_ms", "postprocess_ms"]
labels = [f"step {res.record.index} ({res.record.phase})" for _, res in journey]
fig = go.Figure()
for p in stages:
    fig.add_bar(y=labels, x=[getattr(res.record, p) for _, res in journey], name=p.replace("_ms", ""),
                orientation="h")
fig.update_layout(barmode="stack", title=f"Measured time per step of one request, by engine stage<br><sup>tracer "
                  f"attached: its notes count in the stages; enforce_eager: no recorded decode graph</sup>"
                  f"<br><sup>{RUN}</sup>", margin=dict(t=90),
                  xaxis_title="time (ms)", yaxis_title="engine step", height=320, yaxis=dict(autorange="reversed"))
show_figure(fig)
for _, res in journey:
    r = res.record
    print(f"step {r.index} ({r.phase}): {r.wall_ms:.2f} ms, of which forward {r.model_ms:.2f} ms "
          f"({r.model_ms / r.wall_ms:.0%}); everything else {r.wall_ms - r.model_ms:.2f} ms")
shares = [res.record.model_ms / res.record.wall_ms for _, res in journey]
# the same request three more times, without the tracer: what is left outside the forward pass then (per step,
# the run that left the least: a single run can land on a moment another process took)
idle_engine(llm)
untraced_runs = []
for k in range(3):
    engine.add_request(f"untraced{k}", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    untraced_runs.append([])
    while engine.has_unfinished_requests():
        untraced_runs[-1].append(engine.step_with_record().record)
untraced = [min(steps, key=lambda r: r.wall_ms - r.model_ms) for steps in zip(*untraced_runs)]
rest_traced = [res.record.wall_ms - res.record.model_ms for _, res in journey]
rest_untraced = [r.wall_ms - r.model_ms for r in untraced]
ms_list = lambda xs: ", ".join(f"{x:.2f}" for x in xs) + " ms"
_ = render(f"On this run the forward pass, run eagerly (operation by operation, from Python: this chapter's engine "
           f"records no decode graph, so the tracer sees every call; chapter 01's engine replays its decode steps, "
           f"so its decode step times are not comparable with these), took between **{min(shares):.0%} and {max(shares):.0%}** of each traced "
           f"step's wall time; the rest went to the engine's own bookkeeping and to the tracer's notes. Run three "
           f"more times without the tracer, the same request's steps spent at least **{ms_list(rest_untraced)}** "
           f"outside the forward pass, against **{ms_list(rest_traced)}** in the one traced run. Each traced figure is "
           f"one measurement, so a step that another process on the machine slowed down stands out.")
# the traced steps' largest stage against the same stage of the same step untraced: a one-off shows as a ratio
# far above the tracer's own cost (a note per call: microseconds to a millisecond)
worst = max(((getattr(res.record, p) - getattr(u, p), p, res.record, u) for (_, res), u in zip(journey, untraced)
             for p in stages if p != "model_ms"), key=lambda w: w[0])
if worst[0] > 5:
    _ = render(f"One figure stands out: the {worst[1].removesuffix('_ms')} stage of step {worst[2].index} took "
               f"**{getattr(worst[2], worst[1]):.2f} ms** traced, against {getattr(worst[3], worst[1]):.2f} ms untraced. "
               "The tracer's note there costs far less than that, so it is a one-off of this run (another process, "
               "a garbage-collection pause), not that stage's cost: run the two cells again to see it go.")

# %% [markdown]
# Untraced, the rest of each step is the engine's own Python bookkeeping (scheduling, building inputs,
# sampling, detokenising); most of it depends on the number of requests and tokens in the step,
# not on the model's depth or width (sampling also grows with the vocabulary, since it reads a row
# of logits per request). With a real model on a GPU a step's forward pass can be short enough
# that this bookkeeping matters, and the engine's job becomes keeping the GPU fed; later chapters
# measure that.
#
# ## 5. Step it yourself
#
# The stepper runs the same engine loop one `step()` per click, showing for each step the tokens that
# went through the model and the time breakdown above. Try **Add request** twice and step: both
# requests share one forward pass.

# %%
from widgets import EngineStepper

stepper = EngineStepper(llm, prompt=PROMPT, max_tokens=6, show_chart=False)
stepper.reset()  # an idle engine, also when this cell runs again (Reset aborts whatever is left)
stepper.add_request(PROMPT, max_tokens=6)
stepper.step()
stepper.display()

# %%
# NBVAL_CHECK_OUTPUT
if stepper.steps:
    r = stepper.steps[0]
    print(f"the stepper's first step: {r.phase}, {r.num_tokens} tokens, {r.num_seqs} sequence(s), "
          f"KV blocks in use {r.kv_blocks_used}")
else:  # Reset empties the widget's history
    print("the stepper has no steps since its Reset: run the cell above again")

# %% [markdown]
# ## 6. Check yourself

# %%
from widgets import Quiz, Question

Quiz([
    Question(
        "In the shape table, why does compute_logits receive [1, hidden] in the prefill pass, not [T, hidden]?",
        ["The model truncates the prompt to one token", "Only the last position's prediction is needed to "
         "choose the next token, so only that row goes through the LM head",
         "The LM head only supports one row", "Prefill does not produce logits"],
        1,
        ["The embedding and every layer saw all T tokens (their shapes start with T); only the LM head is skipped.",
         "Right: positions before the last predict tokens we already have; the engine saves the V-wide matmul "
         "for them.",
         "In a batched decode step it gets one row per sequence; the row count is the number of sampling sequences.",
         "It does: the sampler chose the first output token from them at the end of the prefill step."],
    ),
    Question(
        "Which object decides which KV blocks a request owns?",
        ["The attention backend", "The model", "The block manager (asked by the scheduler)", "The sampler"],
        2,
        ["The backend reads and writes the KV tensor at the slots it is given; it does not choose them.",
         "The model only sees slot numbers in the attention metadata the runner built.",
         "Right: the scheduler asks the block manager for blocks when it plans a step; the runner turns block "
         "ids into slot numbers.",
         "The sampler only turns logits into token ids."],
    ),
    Question(
        "The K and V projections are narrower than the Q projection in this model. What is that called, "
        "and what does it save?",
        ["Multi-head attention; it saves FLOPs in the MLP",
         "Grouped-query attention; fewer key/value heads mean a smaller KV cache per token",
         "Tied embeddings; it saves the LM head", "RoPE; it saves position embeddings"],
        1,
        ["Plain multi-head attention has as many K/V heads as query heads; the MLP is unaffected either way.",
         "Right: each KV head is shared by a group of query heads, so each token stores fewer K/V vectors "
         "(chapter 03 measures the bytes).",
         "Tied embeddings share the embedding and LM head matrices; they do not change the attention shapes.",
         "RoPE rotates q and k by position; it does not change how many heads there are."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * name the parts of a Qwen3 model: an embedding, a stack of identical decoder layers (RMSNorm,
#   grouped-query attention with per-head q/k norms and RoPE, SwiGLU MLP, residual adds) and an LM
#   head;
# * derive every parameter count from seven numbers in the config (hidden size, vocabulary, MLP
#   width, query heads, KV heads, head dimension, layers) and two flags (tied embeddings, attention
#   bias), and check it against the loaded model or one built on the `meta` device;
# * read the tensor shapes of a forward pass: every layer maps `[T, hidden]` to `[T, hidden]`, and
#   prefill and decode are the same network with different `T`;
# * point at the engine's parts in the live object: scheduler (who runs), block manager (which KV
#   blocks), runner (inputs, model, sampler), attention backend (paged KV reads and writes),
#   detokenizer (ids to text);
# * follow one request through a step and read its `StepRecord`, from which the course's charts are built.
#
# Next: chapter 03, why the KV cache exists and what it costs.
