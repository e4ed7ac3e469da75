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
# # 01 · Inference: from text to the next token
#
# A language model does one thing: given a sequence of tokens, it scores every possible next token.
# Everything an inference engine does (batching, caching, scheduling) is built around calling that
# one function over and over. In this chapter you take the function apart and put it back together
# by hand, with the very model object minivllm has loaded, and then check that the engine produces
# exactly the same tokens.
#
# **Goal:** know what one call of a language model computes, how generation loops over it, and
# why an engine's loop does far less work per token than the obvious one.
#
# **Prerequisites:** Python and a little PyTorch (tensors, `argmax`, `softmax`). No earlier chapter.
#
# **Time:** about 25 minutes (reading and running).
#
# **You will:** turn text into token ids and back · run the model on them and read its logits ·
# pick the next token greedily and loop, writing generation by hand · run the same prompt through
# the engine and check the tokens are identical · count the work each token costs both loops (the
# hand-written one does more work with every token) and compare that with the times measured on
# this machine · predict two of those figures before you see them.

# %% [markdown]
# ## Setup
#
# The parameters cell picks the model: the embedded `minivllm-tiny` (a model of a few million
# parameters with the Qwen3 architecture, trained on Python's documentation; it ships with the repo;
# chapter 02 counts its parameters) unless the
# environment variable `MINIVLLM_MODEL` names another (a Qwen3 checkpoint directory, or
# `random:qwen3-0.6b` for random weights at the real shape). `DEVICE = "auto"` uses a GPU when there
# is one, otherwise the CPU in fp32.
# The stored outputs were produced by `scripts/execute_notebook.py` with one CPU thread
# (`OMP_NUM_THREADS=1`): on a CPU shared with other work one thread gives the steadiest timings. The
# setup cell prints how many threads this run uses. Those stored outputs include the figures the
# exercises ask you to predict: to predict before you see them, clear the outputs first (Edit > Clear
# Outputs of All Cells) and run the cells in order, in this chapter and every later one.

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
from widgets import check_claim, check_prediction, idle_engine, render

llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64)
engine = llm.llm_engine
print(describe(llm))
print("torch threads:", torch.get_num_threads())
# what every chart of this chapter says it measured: model, device, dtype, threads
from minivllm.utils.env_report import chart_provenance

RUN = chart_provenance(llm)  # "measured on cpu (the processor's name) · model · dtype · threads"

# %% [markdown]
# ## 1. Text -> token ids
#
# The model never sees characters. A *tokenizer* cuts text into pieces from a fixed vocabulary and
# replaces each piece by its index. The default model's tokenizer (minivllm-tiny's, like Qwen3's) is
# byte-level BPE (byte-pair encoding): it starts from the 256 byte values and learned, from its training
# text, which adjacent pairs to merge into longer pieces. Frequent words become one token; rare ones, typos included, are
# spelled out in several (the last two lines below show a word and a typo of it).

# %%
# NBVAL_CHECK_OUTPUT
tok = llm.get_tokenizer()
PROMPT = 'The default value of the argument is'
prompt_ids = tok.encode(PROMPT)
print(f"{len(PROMPT)} characters -> {len(prompt_ids)} tokens (vocabulary of {len(tok)})")
for i in prompt_ids:
    print(f"{i:6d}  {tok.decode([i])!r}")
print("decoded back:", repr(tok.decode(prompt_ids)))
for word in (" argument", " arguemnt"):  # a common word of code's prose, and a typo of it
    print(f"{word!r}: {len(tok.encode(word))} token(s)", [tok.decode([i]) for i in tok.encode(word)])

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
# running a language model. The `AttentionMetadata` it builds tells the attention layers where things
# are: `cu_seqlens_q` / `cu_seqlens_k` where each sequence's tokens start in the batch (one sequence here),
# `slot_mapping` the cache slot each new token's keys and values go to, and `block_tables` which cache
# blocks hold each sequence (chapter 04 explains slots and blocks); you can read the cell for its result
# alone.

# %%
from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata

runner = engine.runner
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
#
# ### Exercise 1 · How many tokens does the loop feed the model?
#
# The prompt is the handful of tokens printed in section 1, and the loop below generates
# `NEW_TOKENS = 24` tokens, each with one forward pass over the whole sequence so far. Summed over
# those 24 passes, how many tokens go through the model? Write your answer in the next cell before
# running the loop.

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: tokens pushed through the model by the 24 passes, in total

# %%
NEW_TOKENS = 24
REPEATS = 3  # the loop runs 3 times (same tokens each time); a token's time is the median of its 3 runs
runs = []  # per run: (tokens chosen, tokens fed per pass, ms per pass)
for _ in range(REPEATS):
    seq = list(prompt_ids)
    chosen, fed_run, ms = [], [], []
    for _ in range(NEW_TOKENS):
        t0 = time.perf_counter()
        nxt = int(torch.argmax(next_token_logits(seq)))  # greedy
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
        fed_run.append(len(seq))  # tokens that went through the model in this pass
        seq.append(nxt)
        chosen.append(nxt)
    runs.append((chosen, fed_run, ms))
# named once every run is done: an interrupted cell leaves the last whole run's figures, not half a run's
by_hand, fed, _ = runs[-1]
runs_ms = [ms for _, _, ms in runs]
by_hand_ms = [statistics.median(t) for t in zip(*runs_ms)]

# %%
# NBVAL_CHECK_OUTPUT
print("by hand:", by_hand)
print(repr(PROMPT + tok.decode(by_hand)))

# %%
_ = check_prediction(my_prediction_1, sum(fed), rel_tol=0.05, unit="tokens",
                     what="the number of tokens the hand-written loop pushed through the model")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Call the prompt length `p` and the number of new tokens `n`. Pass `i` (counting from 0) runs the
# prompt plus the `i` tokens chosen before it: `p + i` tokens. Summed over the passes:
#
# `p + (p + 1) + ... + (p + n - 1) = n·p + n(n - 1)/2`
#
# With this prompt's `p` and `n = 24`, that is the figure the check cell above compares your answer
# with (it prints it once the exercise cell holds a number; the table of section 5 prints it too):
# the prompt alone is pushed through the model 24 times, and the second term grows with the square
# of the output length.
# </details>

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
# up numbers in a different order, so their logits can differ in the last bits; a greedy choice
# flips only when two candidates are within that rounding of each other, which the line above
# would show.) What it changes is *how much work* each step does.
#
# ## 5. Work and time per token
#
# For each new token the hand-written loop ran one forward pass over the whole sequence so far. The
# engine instead runs one *step* per token: the first is a **prefill** that pushes the whole prompt
# through the model, like the loop's first pass; every later one is a **decode** step that pushes
# only the newest token through, because the keys and values of all earlier tokens are already in
# the engine's KV cache (chapter 03). Below we drive the engine one `step()` at a time, three times
# over like the loop, and keep each step's `StepRecord`: how many tokens went through the model and
# the step's measured wall time.
#
# The *work* of a pass can be counted without a clock: a forward pass costs about 2 FLOPs per
# weight of the layers' matrices per token (one multiply, one add), plus attention's products over the
# earlier tokens. The embedding lookup costs none: it copies one row of its table per token. And the
# output layer, which turns a hidden vector into logits, runs for the last position only (the only
# prediction used), so its 2 FLOPs per weight are paid once per pass, not once per token.
# `minivllm.telemetry.roofline.step_cost` does that count from the model's config.

# %%
from minivllm.telemetry.roofline import step_cost



def stepped_runs(eng, name):
    """REPEATS runs of the prompt through ``eng``, one step() at a time: per run, every step's StepRecord."""
    runs = []
    for r in range(REPEATS):
        eng.add_request(f"{name}{r}", PROMPT, greedy)
        runs.append([])
        while eng.has_unfinished_requests():
            runs[-1].append(eng.step_with_record().record)
    return runs


idle_engine(engine)  # what an interrupted run of this cell left queued would join its steps
engine_runs = stepped_runs(engine, "timed")  # per run: the StepRecord of every step
records = engine_runs[-1]
engine_ms = [statistics.median(rs[i].wall_ms for rs in engine_runs) for i in range(NEW_TOKENS)]
engine_fed = [rec.num_tokens for rec in records]  # step 0 is the prefill; each step samples one token

p = len(prompt_ids)
lengths = [p + i for i in range(NEW_TOKENS)]  # sequence length when token i is chosen
hand_mflop = [step_cost(engine.model_cost, [(L, L)], 1)[0] / 1e6 for L in lengths]
engine_mflop = [step_cost(engine.model_cost, [(n, L)], 1)[0] / 1e6 for n, L in zip(engine_fed, lengths)]
print(f"{'token':>5} {'sequence':>9} {'tokens through the model':>25} {'MFLOP of the pass':>20}")
print(f"{'':>5} {'length':>9} {'by hand':>12} {'engine':>12} {'by hand':>10} {'engine':>9}")
for i in (0, 1, NEW_TOKENS // 2, NEW_TOKENS - 1):
    print(f"{i:5d} {lengths[i]:9d} {fed[i]:12d} {engine_fed[i]:12d} {hand_mflop[i]:10.1f} {engine_mflop[i]:9.1f}")
print(f"total {'':9s} {sum(fed):12d} {sum(engine_fed):12d} {sum(hand_mflop):10.1f} {sum(engine_mflop):9.1f}")

# %%
token_ratio = sum(fed) / sum(engine_fed)
_ = render(f"Over the {NEW_TOKENS} tokens the hand-written loop pushed **{token_ratio:.1f}x** as many tokens through "
           f"the model as the engine, and did **{sum(hand_mflop) / sum(engine_mflop):.1f}x** its FLOPs. The loop's "
           f"work per token grew from {hand_mflop[0]:.1f} to {hand_mflop[-1]:.1f} MFLOP "
           f"({hand_mflop[-1] / hand_mflop[0]:.1f}x) between its first and last token; the engine's decode steps "
           f"went from {engine_mflop[1]:.2f} to {engine_mflop[-1]:.2f} MFLOP.")
_ = check_claim("the hand-written loop does more work (FLOPs) for every new token",
                all(b > a for a, b in zip(hand_mflop, hand_mflop[1:])),
                f"{hand_mflop[0]:.1f} MFLOP for the first token, {hand_mflop[-1]:.1f} MFLOP for the last")

# %% [markdown]
# ### Exercise 2 · Does the time follow the work?
#
# The cell above counted how many times more tokens (and FLOPs) the hand-written loop needed than
# the engine. Both loops timed every token, three times over; the cell below prints a few of those
# times. Predict the ratio of their **total times** for the 24 tokens: hand-written loop divided by
# engine. A way to a number: the loop's passes grow about evenly from its first to its last, so its
# total is about 24 times the mean of the two; the engine's is its prefill step plus 23 decode steps.

# %%
print(f"by hand: the first pass ({lengths[0]} tokens) {by_hand_ms[0]:.2f} ms, the last ({lengths[-1]} tokens) "
      f"{by_hand_ms[-1]:.2f} ms; engine: the prefill step {engine_ms[0]:.2f} ms, the median decode step "
      f"{statistics.median(engine_ms[1:]):.2f} ms (each the median of {REPEATS} runs)")

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: total time by hand / total time through the engine (a ratio, x)

# %%
time_ratio = sum(by_hand_ms) / sum(engine_ms)
print(f"{'token':>5} {'sequence length':>16} {'by hand (ms)':>13} {'engine step (ms)':>17}   (medians of {REPEATS} runs)")
for i in (0, 1, NEW_TOKENS // 2, NEW_TOKENS - 1):
    print(f"{i:5d} {lengths[i]:16d} {by_hand_ms[i]:13.2f} {engine_ms[i]:17.2f}   "
          f"({records[i].phase}, {records[i].num_tokens} token(s) in the forward pass)")
print(f"total for {NEW_TOKENS} tokens: by hand {sum(by_hand_ms):.1f} ms, engine {sum(engine_ms):.1f} ms")
_ = check_prediction(my_prediction_2, time_ratio, rel_tol=0.3, unit="x", what="the time ratio (by hand / engine)",
                     hint="Compare the time of the hand loop's first pass with its last in the table: does a pass "
                          "with many more tokens take that many times longer? Then open the solution.")
flop_ratio = sum(hand_mflop) / sum(engine_mflop)
_ = check_claim("the time ratio is below the work ratio", time_ratio < flop_ratio,
                f"time {time_ratio:.1f}x, FLOPs {flop_ratio:.1f}x",
                why_it_may_not="On a large model, or one whose passes are long enough for the arithmetic to dominate, "
                               "time follows work more closely.")
# Inside the hand-written loop every pass takes the same code path, only longer: its first and last
# passes compare like with like.
hand_time_growth = by_hand_ms[-1] / by_hand_ms[0]
hand_flop_growth = hand_mflop[-1] / hand_mflop[0]
_ = check_claim("from the hand-written loop's first pass to its last, the time grows by less than the FLOPs",
                hand_time_growth < hand_flop_growth,
                f"last / first pass: time {hand_time_growth:.2f}x, FLOPs {hand_flop_growth:.1f}x",
                why_it_may_not="Where arithmetic dominates a pass (a large model, a long prompt), time follows FLOPs.")
# The engine's decode steps replay a recorded graph of the forward's operations (chapter 11). The same engine
# run eagerly (every operation dispatched one by one, as in the loop's passes) splits the time ratio in two.
eager_llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64, enforce_eager=True)
try:
    eager_llm.generate([PROMPT], greedy, use_tqdm=False)  # warm-up
    eager_runs = stepped_runs(eager_llm.llm_engine, "eager")
finally:
    eager_llm.shutdown()
eager_total = statistics.median(sum(rec.wall_ms for rec in run) for run in eager_runs)
_ = render(f"How much of that is the KV cache, and how much the engine's recorded graph? The same engine run eagerly "
           f"(`enforce_eager=True`: every operation dispatched one by one, as in the loop's passes) took "
           f"**{eager_total:.1f} ms** for the {NEW_TOKENS} tokens (median of {REPEATS} runs): by hand / eager "
           f"**{sum(by_hand_ms) / eager_total:.1f}x**, what the cache's fewer tokens save when both dispatch every "
           f"operation; eager / with the graph **{eager_total / sum(engine_ms):.1f}x**, what replaying the decode "
           "steps' operations without the Python around them saves (chapter 11).")

# %%
import plotly.graph_objects as go

from widgets import show_figure


def spread(runs, centre):
    """Error bars from the repeats: distance from the median to the fastest and slowest run."""
    cols = list(zip(*runs))
    return dict(type="data", symmetric=False, array=[max(c) - m for c, m in zip(cols, centre)],
                arrayminus=[m - min(c) for c, m in zip(cols, centre)])


fig = go.Figure()
fig.add_scatter(x=lengths, y=by_hand_ms, error_y=spread(runs_ms, by_hand_ms), mode="lines+markers",
                name="by hand: whole sequence every token")
fig.add_scatter(x=lengths, y=engine_ms, error_y=spread([[rec.wall_ms for rec in rs] for rs in engine_runs], engine_ms),
                mode="lines+markers", name="engine: one step per token")
fig.update_layout(title=f"Measured time per generated token (median of {REPEATS}, bars: fastest to slowest)"
                        f"<br><sup>{RUN}</sup>",
                  xaxis_title="sequence length when the token is chosen (tokens)", yaxis_title="time per token (ms)",
                  height=400, yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.25))
show_figure(fig)

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# If time followed the work, the time ratio would equal the FLOP ratio from the cell before the
# exercise. The first check under the table compares the two on this run: on a small model the time
# ratio falls short of the work ratio. Every forward pass, whatever its length, pays a fixed price:
# dozens of small operations each launched separately (norms, projections, attention, for each
# layer) and, in the hand-written loop, Python code in every module and a fresh scratch KV cache each
# call. For a model this small, that price is a large part of a pass, so a longer pass takes far less
# longer than its extra FLOPs would say. The second check tests this where the comparison is fair,
# inside the hand-written loop (the same code for every pass, only longer): from its first pass to its
# last, the FLOPs grow by more than the time does. Comparing an engine step with a hand-written pass
# mixes in other differences: an engine step also schedules, samples and detokenises, and its decode
# steps replay a recorded graph of the forward's operations without the Python around them (chapter
# 11; the last sentence under the check splits the time ratio into the cache's part and the graph's on
# this run), while its prefill step runs them one by one, with the engine's own work around them (the table
# shows how its prefill step compares with the hand-written pass over the same tokens on this run). A
# bigger model shrinks the fixed part's share, but time still need not follow FLOPs: a short pass over
# many weights is bound by reading them (chapter 03 measures both at longer lengths, chapter 06 draws
# the roofline, and chapter 11 takes the fixed costs apart).
# </details>

# %% [markdown]
# The work per token of the hand-written loop grows with every token, by construction. Whether its
# *time* per token visibly grows over only 24 tokens depends on the machine: where fixed costs per
# pass dominate, the extra arithmetic of a slightly longer sequence hides in the noise. The cell
# below fits a straight line through the medians and says which way it went on this run.

# %%
fit = statistics.linear_regression(lengths, by_hand_ms)
# the engine's decode steps from the sixth on: the first few after a prefill run slower (the first stages the
# batch the later steps reuse, the next run with caches the prefill left cold), whatever their length
fit_engine = statistics.linear_regression(lengths[6:], engine_ms[6:])
_ = render(f"On this run the hand-written loop's median time per token went from {by_hand_ms[0]:.2f} ms (sequence of "
           f"{lengths[0]}) to {by_hand_ms[-1]:.2f} ms (sequence of {lengths[-1]}); a straight line through all "
           f"{NEW_TOKENS} medians changes by **{fit.slope * 1e3:+.1f} µs per extra token** of sequence. The engine's "
           f"decode steps from the sixth on (its first ones after the prefill run slower, {engine_ms[1]:.2f} ms for "
           f"the first: it stages the batch the later ones reuse, and the next few run with caches the prefill "
           f"left cold): {fit_engine.slope * 1e3:+.1f} µs per extra token, "
           f"{fit_engine.slope * (lengths[-1] - lengths[6]) * 1e3:+.0f} µs from the sixth decode step to the last"
           + (", under a tenth of such a step: over 24 tokens their extra attention is a few keys a step."
              if abs(fit_engine.slope * (lengths[-1] - lengths[6])) < 0.1 * statistics.median(engine_ms[6:]) else
              ": the steps got faster, so the warm-up after the prefill lasted past the sixth step here and hid "
              "whatever the extra keys added." if fit_engine.slope < 0 else
              ": more than a tenth of such a step, from a few more keys a step; the machine's load moves these "
              "sub-millisecond steps by as much, so one run does not settle it."))
_ = check_claim("the hand-written loop's time per token rises with the sequence length", fit.slope > 0,
                f"fitted slope {fit.slope * 1e3:+.1f} µs per token, first {by_hand_ms[0]:.2f} ms, "
                f"last {by_hand_ms[-1]:.2f} ms",
                why_it_may_not="Over a sequence this short, on a model this small, the fixed cost of each pass hides "
                               "the extra arithmetic; a busy machine adds noise. Chapter 03 measures much longer "
                               "sequences.")

# %% [markdown]
# ## 6. Watch the engine loop
#
# The stepper below drives an engine one `step()` at a time: one of its own, built as `llm` was, so that the
# playground below (which generates on `llm`) leaves the stepper's request where it is. It has queued the prompt and
# run the prefill plus two decode steps. Press **Step** to run one more step, **Run to end** to finish.
# Each step shows which tokens went through the model and the token it sampled. Its summary also
# carries figures later chapters explain: the step's tokens against the **token budget** (the most
# tokens one step may carry, chapter 05) and **MFU / MBU** bars (the share of this machine's measured
# arithmetic rate and memory bandwidth the step used, chapter 06). Its engine is new, and a new engine's
# first decode steps also record its CPU graph and run with cold caches, so the step times it shows can
# sit well above the chart's.

# %%
from widgets import EngineStepper

if "step_llm" in globals():  # run again: the last run's engine goes first
    step_llm.shutdown()
step_llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64)
stepper = EngineStepper(step_llm, prompt=PROMPT, max_tokens=8, show_chart=False)  # step times: the chart above
stepper.add_request(PROMPT, max_tokens=8)
for _ in range(3):
    stepper.step()
stepper.display()

# %%
# NBVAL_CHECK_OUTPUT
for i, r in enumerate(stepper.steps):
    print(f"stepper step {i}: {r.phase:7s} {r.num_tokens} token(s) through the model")
if stepper.request_ids:
    so_far = stepper.sequence(stepper.request_ids[0]).output_token_ids
    print("tokens so far:", so_far, "| the same as the first ones by hand:", so_far == by_hand[:len(so_far)])
else:  # Reset empties the widget's requests and history
    print("the stepper has no request since its Reset: run the cell above again")

# %% [markdown]
# ## 7. Playground
#
# Change `PLAY_PROMPT` and run the cell. Look for: words that the tokenizer splits into several
# tokens (try a rare word, a typo or a name), how sure the model is of its top candidate (one token
# near 100%, or a flat top five), and how a greedy continuation tends to repeat itself.

# %% tags=["playground"]
PLAY_PROMPT = "To open a file for reading, call"  # the knob: any text

play_ids = tok.encode(PLAY_PROMPT)
if not play_ids:
    raise ValueError(f"PLAY_PROMPT={PLAY_PROMPT!r} has no tokens: write some text to continue")
print(f"{len(play_ids)} tokens:", " | ".join(repr(tok.decode([i])) for i in play_ids))
play_probs = torch.softmax(next_token_logits(play_ids), dim=-1)
for p_, i in zip(*torch.topk(play_probs, 5)):
    print(f"  {float(p_):6.1%}  {tok.decode([int(i)])!r}")
play = llm.generate([PLAY_PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
print("greedy continuation:", repr(play.outputs[0].text))

# %% [markdown]
# ## 8. Check yourself

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
        "The engine and the hand-written loop produced identical greedy tokens. Why does the engine's "
        "decode step do so much less work per token?",
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
        ["Linearly in n", "About quadratically in n", "It stays constant", "Exponentially"],
        1,
        ["Each single step's work already grows with the sequence (step i processes p + i tokens), so the "
         "sum grows faster than n.",
         "Right: the sum of p, p+1, ..., p+n-1 tokens is n*p + n(n-1)/2 token-passes (exercise 1), whose "
         "second term dominates once n passes about 2p; attention adds a term that grows faster still "
         "at long lengths.",
         "The work per step grows with the sequence length (the FLOP count in section 5), so the total cannot "
         "stay flat.",
         "Each step adds one token to the work, not a multiple of it: the growth is polynomial."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * turn text into token ids and back, and say why a rare word costs several tokens;
# * call the engine's model yourself (`llm.llm_engine.runner.model`) and read its logits: one score
#   per vocabulary entry, turned into probabilities by softmax and into a token by the sampler;
# * write generation as a loop around one forward pass, and check it against the engine token for token;
# * count the work of a forward pass (about 2 FLOPs per matrix weight per token) and explain why a loop
#   without a cache does more work with every token, while the engine's decode steps stay nearly
#   constant in work;
# * tell work from time: on a small model fixed costs per pass hide much of the difference, and
#   you can check on your own machine how much.
#
# Next: chapter 02 opens the model and the engine and names every part.
