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
# # 01 · Inference: from text to the next token
#
# A language model does one thing: given a sequence of tokens, it scores every possible next token.
# Everything an inference engine does (batching, caching, scheduling) is built around calling that
# one function over and over. In this chapter you take the function apart and put it back together
# by hand, with the very model object minivllm has loaded, and then check that the engine produces
# exactly the same tokens.
#
# **You will:** turn text into token ids and back · run the model on them and read its logits ·
# pick the next token greedily and loop, writing generation by hand · run the same prompt through
# the engine and check the tokens are identical · measure the time per token of both, and see why
# the hand-written loop gets slower with every token.

# %% [markdown]
# ## Setup
#
# The parameters cell picks the model: the embedded `minivllm-tiny` (a 4M-parameter model with the
# Qwen3 architecture, trained on Python's documentation; it ships with the repo) unless the
# environment variable `MINIVLLM_MODEL` names another (a Qwen3 checkpoint directory, or
# `random:qwen3-0.6b` for random weights at the real shape). `DEVICE = "auto"` uses a GPU when there
# is one, otherwise the CPU in fp32.

# %% tags=["parameters"]
import os
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
print(describe(llm))
print("torch threads:", torch.get_num_threads())

# %% [markdown]
# ## 1. Text -> token ids
#
# The model never sees characters. A *tokenizer* cuts text into pieces from a fixed vocabulary and
# replaces each piece by its index. minivllm-tiny's tokenizer is byte-level BPE (byte-pair
# encoding): it starts from the 256 byte values and learned, from its training text, which adjacent
# pairs to merge into longer pieces. Frequent words become one token; rare ones are spelled out in
# several. Below, `·` marks a space that belongs to a token.

# %%
# NBVAL_CHECK_OUTPUT
tok = llm.get_tokenizer()
PROMPT = 'The default value of the argument is'
prompt_ids = tok.encode(PROMPT)
print(f"{len(PROMPT)} characters -> {len(prompt_ids)} tokens (vocabulary of {len(tok)})")
for i in prompt_ids:
    print(f"{i:6d}  {tok.decode([i])!r}")
print("decoded back:", repr(tok.decode(prompt_ids)))

# %% [markdown]
# ## 2. Token ids -> logits
#
# Now the model. `llm.llm_engine.runner.model` is the `torch.nn.Module` the engine runs: a Qwen3
# decoder (chapter 02 opens it up). Its forward pass takes token ids and their positions and returns
# one hidden vector per token; `compute_logits` turns a hidden vector into one score per vocabulary
# entry, the **logits**.
#
# minivllm's model is written for the engine, so every attention layer stores each token's keys and
# values in a KV cache as it goes, at slots the caller chooses (chapters 03 and 04 are about exactly
# that). The function below gives it a small private cache that it throws away afterwards, so each
# call is a complete, independent forward pass over the whole sequence: the textbook definition of
# running a language model.

# %%
from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata

runner = llm.llm_engine.runner
model = runner.model  # the engine's own Qwen3ForCausalLM


@torch.inference_mode()
def next_token_logits(token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [vocab_size] for the token after `token_ids`: one forward pass over all of them."""
    n, bs, dev = len(token_ids), runner.block_size, runner.device
    blocks = -(-n // bs)
    _, scratch_kv = allocate_kv_cache(model.config, blocks, bs, runner.dtype, dev)  # thrown away after
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(  # one sequence of n new tokens, stored in slots 0..n-1, attending causally
        cu_seqlens_q=i32([0, n]), cu_seqlens_k=i32([0, n]), context_lens=i32([n]),
        slot_mapping=torch.arange(n, device=dev), block_tables=i32([list(range(blocks))]),
        max_seqlen_q=n, max_seqlen_k=n, block_size=bs, is_decode_only=n == 1,
        q_lens_cpu=[n], context_lens_cpu=[n])
    runner.backend.prepare(meta)
    ids = torch.tensor(token_ids, device=dev)
    hidden = model(ids, torch.arange(n, device=dev), ForwardContext(meta, runner.backend, scratch_kv))
    return model.compute_logits(hidden[-1:])[0]  # only the last position predicts the next token


# %%
# NBVAL_CHECK_OUTPUT
logits = next_token_logits(prompt_ids)
print("logits:", tuple(logits.shape), logits.dtype, "- one score per vocabulary entry")
top = torch.topk(logits, 5)
print("the 5 highest-scoring next tokens:", [tok.decode([i]) for i in top.indices.tolist()])

# %%
probs = torch.softmax(logits, dim=-1)
print("softmax turns scores into a distribution: they sum to", round(float(probs.sum()), 4))
for p, i in zip(*torch.topk(probs, 5)):
    print(f"  {float(p):6.1%}  {tok.decode([int(i)])!r}")

# %% [markdown]
# The logits are not probabilities: they are unnormalised scores. `softmax` (exponentiate, divide
# by the sum) turns them into a probability distribution over the vocabulary. Which token to take
# from that distribution is the *sampler's* decision (chapter 09). The simplest rule is **greedy**:
# take the highest-scoring token.
#
# ## 3. The loop, by hand
#
# Generation is that one step in a loop: append the chosen token to the sequence, score again,
# choose again. Every pass below recomputes the whole sequence from scratch, prompt included: that
# is what "call the model on the sequence" means when nothing is remembered between calls.

# %%
NEW_TOKENS = 24
seq = list(prompt_ids)
by_hand, by_hand_ms = [], []
for _ in range(NEW_TOKENS):
    t0 = time.perf_counter()
    nxt = int(torch.argmax(next_token_logits(seq)))  # greedy
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    by_hand_ms.append((time.perf_counter() - t0) * 1e3)
    seq.append(nxt)
    by_hand.append(nxt)

# %%
# NBVAL_CHECK_OUTPUT
print("by hand:", by_hand)
print(repr(PROMPT + tok.decode(by_hand)))

# %% [markdown]
# ## 4. The same prompt through the engine
#
# `LLM.generate` does the same job as a service would: it queues the request, and the engine loop
# runs it step by step (scheduler, model runner, sampler, detokenizer). `temperature=0` asks for
# greedy sampling, `ignore_eos=True` makes it produce exactly `max_tokens` tokens like our loop.

# %%
greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
out = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
engine_tokens = list(out.outputs[0].token_ids)

# %%
# NBVAL_CHECK_OUTPUT
print("engine :", engine_tokens)
print("by hand:", by_hand)
print("identical greedy tokens:", engine_tokens == by_hand)
print("engine text:", repr(out.outputs[0].text), "| finish_reason:", out.outputs[0].finish_reason)

# %% [markdown]
# Identical, token for token. The engine is not doing anything different in kind from the loop
# above: it runs the same model on the same tokens and takes the same argmax. (The two routes add
# up numbers in a different order, so their logits can differ in the last bits; in fp32 that never
# flips a greedy choice here, while in bf16 on a GPU a near-tie between two candidates can, rarely,
# go the other way.) What it changes is
# *how much work* each step does, which the timings show.
#
# ## 5. Time per token
#
# For each new token, the hand-written loop timed one forward pass over the whole sequence so far.
# For the engine, each step's `StepRecord` carries its measured wall time; here we drive the engine
# one `step()` at a time to collect them.

# %%
engine = llm.llm_engine
engine.add_request("timed", PROMPT, greedy)
records = []
while engine.has_unfinished_requests():
    records.append(engine.step_with_record().record)
engine_ms = [r.wall_ms for r in records]  # step 0 is the prefill; each step samples one token
print(f"{'token':>5} {'sequence length':>16} {'by hand (ms)':>13} {'engine step (ms)':>17}")
for i in (0, 1, NEW_TOKENS // 2, NEW_TOKENS - 1):
    print(f"{i:5d} {len(prompt_ids) + i:16d} {by_hand_ms[i]:13.2f} {engine_ms[i]:17.2f}   "
          f"({records[i].phase}, {records[i].num_tokens} tokens in the forward pass)")
print(f"total for {NEW_TOKENS} tokens: by hand {sum(by_hand_ms):.1f} ms, engine {sum(engine_ms):.1f} ms")

# %%
import plotly.graph_objects as go

from widgets import show_figure

positions = [len(prompt_ids) + i for i in range(NEW_TOKENS)]
fig = go.Figure()
fig.add_scatter(x=positions, y=by_hand_ms, mode="lines+markers", name="by hand: whole sequence every token")
fig.add_scatter(x=positions, y=engine_ms, mode="lines+markers", name="engine: one step per token")
fig.update_layout(title=f"Measured time per generated token ({engine.source.name}, {engine.config.device})",
                  xaxis_title="sequence length when the token is chosen", yaxis_title="ms per token",
                  height=380, yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.25))
show_figure(fig)

# %% [markdown]
# The first engine step is a *prefill*: it pushes the whole prompt through the model, like the
# first pass of our loop. Every later engine step is a *decode* step: only **one** token goes
# through the model, because the keys and values of all earlier tokens are already in the engine's
# KV cache. The hand-written loop instead pays for the whole sequence every time, so its *work* per
# token grows with the sequence. On a model this small on a CPU, fixed overheads (Python, launching
# many tiny operations) take most of each step, so over these few tokens the measured times above
# need not rise visibly; chapter 03 measures the growth over longer sequences and shows where it
# comes from.
#
# ## 6. Watch the engine loop
#
# The stepper below drives the same engine one `step()` at a time. It has queued the prompt and run
# the prefill plus two decode steps. Press **Step** to run one more step, **Run to end** to finish.
# Each step shows which tokens went through the model and the token it sampled.

# %%
from widgets import EngineStepper

stepper = EngineStepper(llm, prompt=PROMPT, max_tokens=8, show_chart=False)  # step times: the chart above
stepper.add_request(PROMPT, max_tokens=8)
for _ in range(3):
    stepper.step()
stepper.display()

# %%
# NBVAL_CHECK_OUTPUT
for r in stepper.steps:
    print(f"step {r.index}: {r.phase:7s} {r.num_tokens} token(s) through the model")
so_far = stepper.sequence(stepper.request_ids[0]).output_token_ids
print("tokens so far:", so_far, "| the same as the first ones by hand:", so_far == by_hand[:len(so_far)])

# %% [markdown]
# ## 7. Check yourself

# %%
from widgets import Quiz, Question

Quiz([
    Question(
        "What does one forward pass of the model return for the last position of the sequence?",
        ["The next token", "A score (logit) for every token in the vocabulary",
         "A probability for the next token only", "The rest of the answer"],
        1,
        ["Choosing a token is a separate step, the sampler's job: greedy took the argmax here, "
         "chapter 09 shows other rules.",
         "Right: one number per vocabulary entry; softmax turns them into a distribution and the sampler picks.",
         "Logits are unnormalised scores for every candidate, not one probability; softmax over all of them "
         "gives the probabilities.",
         "One pass gives one position's prediction; an answer of n tokens needs n passes (n steps)."],
    ),
    Question(
        "The engine and the hand-written loop produced identical greedy tokens. Why is the engine's "
        "decode step so much cheaper per token?",
        ["It uses a smaller model for decoding",
         "It keeps the keys and values of earlier tokens (the KV cache), so only the new token goes "
         "through the model",
         "It samples several tokens per step",
         "It skips layers once the prompt is processed"],
        1,
        ["It is the same model object: the identical tokens show the computation is the same.",
         "Right: each decode step processes one token and reads the earlier tokens' keys and values from the "
         "cache instead of recomputing them (chapter 03).",
         "Each engine step sampled exactly one token per request: the step records list one token per decode step.",
         "Every step runs every layer; what shrinks is the number of tokens fed through them."],
    ),
    Question(
        "With no cache, how does the total work of generating n tokens after a prompt of p tokens grow?",
        ["Linearly in n", "About quadratically: step i processes p + i tokens",
         "It stays constant", "Exponentially"],
        1,
        ["Each single step's work already grows with the sequence (step i processes p + i tokens), so the "
         "sum grows faster than n.",
         "Right: the sum of p, p+1, ..., p+n-1 tokens is about n*p + n^2/2 token-passes.",
         "The work per step grows with the sequence length (chapter 03 measures it), so the total cannot stay flat.",
         "Each step adds one token to the work, not a multiple of it: the growth is polynomial."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * Text becomes token ids through the tokenizer; the model maps token ids to one logit per
#   vocabulary entry at every position; the sampler turns the last position's logits into the next
#   token.
# * Generation is a loop around that function. A loop that calls the model on the whole sequence
#   works, and produces exactly what the engine produces with greedy sampling.
# * What an inference engine adds is doing *less work per token* (the KV cache: chapter 03) and
#   sharing each step among many requests (chapters 04 to 06), without changing the result.
# * minivllm's model is the same `torch.nn.Module` you can call yourself:
#   `llm.llm_engine.runner.model`.
#
# Next: chapter 02 opens the model and the engine and names every part.
