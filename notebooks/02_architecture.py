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
# # 02 · Architecture: the Qwen3 model and the engine around it
#
# Chapter 01 called the model as one function. This chapter opens it: what a Qwen3 decoder layer is
# made of, how many parameters sit in each part (counted on the loaded model, and checked against the
# formula from its config), and what shape every tensor has as one real forward pass goes through it.
# Then the same for the engine: which objects make it up in the running `LLM`, and the path one
# request takes through them, step by step, as the engine records it.
#
# **You will:** count the parameters of every module of the loaded model and derive the counts from
# the config · watch tensor shapes through one prefill and one decode pass with forward hooks · name
# the engine's components in the live object · trace one request through scheduler, runner, model,
# attention backend, sampler and detokenizer · read its step records.

# %% [markdown]
# ## Setup
#
# As in every chapter, the model is the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names a Qwen3
# checkpoint directory or a `random:` preset; the device is chosen automatically.

# %% tags=["parameters"]
import os
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
# enforce_eager: every step runs the model eagerly (on a GPU, no CUDA-graph replay), so the
# hooks and tracers below see every pass. On a CPU it changes nothing.
llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64, enforce_eager=True)
engine = llm.llm_engine
model = engine.runner.model
hf = model.config
print(describe(llm))
print("torch threads:", torch.get_num_threads())

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
# minivllm packs q/k/v into one matrix and gate/up into another (one big matmul is faster than
# three small ones); the loader splits Hugging Face checkpoints' separate `q_proj`, `k_proj`, ...
# into them. Grouped-query attention (GQA): there are fewer key/value heads than query heads, and
# each key/value head serves a group of query heads, which shrinks the KV cache (chapter 03).
#
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
share = {name: got / total_unique for name, (got, _) in parts.items()}
attn = len(model.model.layers) * (expected["self_attn.qkv_proj"] + expected["self_attn.o_proj"])
mlp = len(model.model.layers) * (expected["mlp.gate_up_proj"] + expected["mlp.down_proj"])
print(f"embedding table: {share['embed_tokens']:.0%} of all parameters; attention matmuls {attn / total_unique:.0%}; "
      f"MLP matmuls {mlp / total_unique:.0%}; norms {1 - share['embed_tokens'] - (attn + mlp) / total_unique:.2%}")
bytes_per = torch.empty((), dtype=engine.config.dtype).element_size()
print(f"weights in memory: {total_unique * bytes_per / 2**20:.1f} MiB in {engine.config.dtype}")

# %% [markdown]
# In a model this small the embedding table is a large share (its vocabulary is 4,096 entries and
# its layers are narrow); in Qwen3-0.6B it is about a quarter, and in large models a few percent:
# the decoder layers' matmuls dominate, and within each layer the MLP holds the larger share. Norm gains
# are a rounding error. When weights are **tied** (`tie_word_embeddings`), the LM head reuses the
# embedding matrix, so it adds no parameters.
#
# ## 2. Tensor shapes along one forward pass
#
# Forward hooks are callbacks PyTorch runs after a module's forward. We register one on every
# module of layer 0 (and on the embedding and final norm), wrap the attention backend and the LM
# head the same way, and then let **the engine** run a request: one prefill step of the whole
# prompt, and one decode step of a single token. Every shape below was recorded during those two
# real steps.

# %%
PROMPT = 'Return the number of items in the container'
shapes = defaultdict(list)  # module name -> [shapes in the prefill pass, shapes in the decode pass]


def shape_of(x):
    if isinstance(x, torch.Tensor):
        return list(x.shape)
    if isinstance(x, (tuple, list)):
        return [shape_of(t) for t in x if isinstance(t, (torch.Tensor, tuple, list))]
    return None


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
# * The embedding turns `T` ids into `T` vectors of the hidden size. Everything up to the final
#   norm keeps that `[T, hidden]` shape: a decoder layer maps a sequence of vectors to a sequence of
#   vectors.
# * `qkv_proj` widens each token to `(query heads + 2 x kv heads) x head_dim` columns; the attention
#   backend receives them split per head: q `[T, query heads, head_dim]`, k and v
#   `[T, kv heads, head_dim]`.
# * The layer's KV cache is `[num_blocks, block_size, kv heads, head_dim]`: the same shape in both
#   passes, because it is a preallocated pool (chapter 04); each step writes its `T` new keys and
#   values into it and attention reads back every earlier one.
# * `gate_up_proj` is twice the MLP width (gate and up side by side); `act_fn` (SiLU(gate) x up)
#   halves it again; `down_proj` returns to the hidden size.
# * The decoder layer returns two tensors: minivllm fuses the residual add into the next norm, so a
#   layer hands on `(output, residual)`.
# * Only the **last** position of the prompt goes through the LM head in prefill, because only it
#   predicts a token we need: `compute_logits` gets `[1, hidden]`, not `[T, hidden]`.
# * The decode pass is the same network with `T = 1`.
#
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
# That is the whole journey from the design brief, with real values:
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
# into the next slot.
#
# ### Where the time of each step went
#
# Each `StepRecord` splits the step's wall time into scheduling, building inputs, the forward pass,
# sampling and postprocessing (stop checks, detokenisation, outputs):

# %%
import plotly.graph_objects as go

from widgets import show_figure

parts = ["schedule_ms", "prepare_ms", "model_ms", "sample_ms", "postprocess_ms"]
labels = [f"step {res.record.index} ({res.record.phase})" for _, res in journey]
fig = go.Figure()
for p in parts:
    fig.add_bar(y=labels, x=[getattr(res.record, p) for _, res in journey], name=p.replace("_ms", ""),
                orientation="h")
fig.update_layout(barmode="stack", title=f"Measured time per step of one request ({engine.config.device})",
                  xaxis_title="ms", height=300, yaxis=dict(autorange="reversed"))
show_figure(fig)
for _, res in journey:
    r = res.record
    print(f"step {r.index} ({r.phase}): {r.wall_ms:.2f} ms, of which forward {r.model_ms:.2f} ms "
          f"({r.model_ms / r.wall_ms:.0%}); everything else {r.wall_ms - r.model_ms:.2f} ms")

# %% [markdown]
# The lines above give, for each step, the forward pass's share of the wall time; the rest is the
# engine's own Python bookkeeping (scheduling, building inputs, sampling, detokenising), which costs
# about the same per step whatever the model. With a real model on a GPU a step's forward pass can be
# short enough that this bookkeeping matters, and the engine's job becomes keeping the GPU fed; later
# chapters measure that.
#
# ## 5. Step it yourself
#
# The stepper runs the same engine loop one `step()` per click, showing for each step the tokens that
# went through the model and the time breakdown above. Try **Add request** twice and step: both
# requests share one forward pass.

# %%
from widgets import EngineStepper

stepper = EngineStepper(llm, prompt=PROMPT, max_tokens=6, show_chart=False)
stepper.add_request(PROMPT, max_tokens=6)
stepper.step()
stepper.display()

# %%
# NBVAL_CHECK_OUTPUT
r = stepper.steps[-1]
print(f"the stepper's first step: {r.phase}, {r.num_tokens} tokens, {r.num_seqs} sequence(s), "
      f"KV blocks in use {r.kv_blocks_used}")

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
# ## Takeaways
#
# * A Qwen3 model is an embedding, a stack of identical decoder layers (RMSNorm, grouped-query
#   attention with per-head q/k norms and RoPE, SwiGLU MLP, residual adds) and an LM head; every
#   parameter count follows from six numbers in the config.
# * Every layer maps `[T, hidden]` to `[T, hidden]`; prefill and decode are the same network with
#   different `T`.
# * The engine is a loop over a few objects with one job each: scheduler (who runs), block manager
#   (which KV blocks), runner (inputs, model, sampler), attention backend (paged KV reads and writes),
#   detokenizer (ids to text).
# * Every step leaves a `StepRecord`; the course's charts are built from them.
#
# Next: chapter 03, why the KV cache exists and what it costs.
