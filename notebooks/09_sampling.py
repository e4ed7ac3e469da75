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
# # 09 · Sampling
#
# **Goal:** know what temperature, top-k, top-p, min-p and a seed do to the model's next-token
# distribution, in which order the engine applies them, and why its way of drawing a token is exact.
#
# **Prerequisites:** chapter 01 (logits, softmax, the generation loop) and chapter 05 (requests
# batched together in one step). Basic probability: a distribution, sampling from it.
#
# **Time:** about 40 minutes (reading and running).
#
# Every step, the model hands the engine one vector of scores (logits) per sequence, one score for
# each token in the vocabulary. Turning that vector into *one* token is the sampler's job, and the
# settings you pass in `SamplingParams` (temperature, top-k, top-p, min-p, seed) are instructions to
# it. In this chapter you take the logits the engine really produced for a prompt, reshape them with
# each setting and look at what survives; you check that a seeded request gets the same tokens
# whatever else shares its batch; and you test, with many draws, the trick the engine uses for the
# draw itself, which needs no cumulative sum (the top-p filter before it still does; section 6b).
#
# **You will:** read the model's real next-token distribution · predict, then measure, what
# temperature, top-k, top-p and min-p keep on a confident and on an uncertain prediction · see
# whether the order of the filters matters (minivllm's order against vLLM V1's) · generate with each
# setting · check that seeded sampling does not depend on the batch · verify that the exponential
# race (Gumbel-max) samples from the softmax, and watch a plausible-looking wrong trick fail the
# same test.

# %% [markdown]
# ## Setup
#
# `MODEL` is the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names another model (a Qwen3
# checkpoint directory, or `random:qwen3-0.6b`). `seed=0` seeds the engine-wide random stream used
# by requests that bring no seed of their own, so this notebook draws the same tokens every run.

# %% tags=["parameters"]
import os

import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import cpu_name, describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
SEED = 0                                   # engine-wide sampling seed

# %%
llm = LLM(MODEL, device=DEVICE, seed=SEED, num_kvcache_blocks=256, max_num_seqs=16)
engine = llm.llm_engine
tok = llm.get_tokenizer()
print(describe(llm))
print(f"torch threads: {torch.get_num_threads()}")
# Names the run in every chart title: model, dtype, device and threads.
_dev = engine.config.device
RUN = (f"{engine.source.name}, {str(engine.config.dtype).replace('torch.', '')}, "
       + (f"{_dev} ({cpu_name()}, {os.cpu_count()} cores), " if _dev.type == "cpu" else
          f"{_dev} ({torch.cuda.get_device_name(_dev)}), ")
       + f"{torch.get_num_threads()} thread(s)")


# %% [markdown]
# ## 1. The distribution the sampler receives
#
# The engine's `ModelRunner` runs the forward pass, keeps the last position of every sequence that
# samples this step, multiplies it by the LM head and passes the logits (fp32, one row per sequence,
# `vocab_size` columns) to `minivllm.layers.sampler.Sampler`. To look at *exactly* what the sampler
# sees, we wrap it for one generate call: the wrapper copies each logits matrix it is handed, then
# samples as usual. We do that for a handful of prompts, measure how spread out each next-token
# distribution is (its entropy, in bits), and keep two: the one where the model is most sure what
# comes next, and the one where it is least sure.

# %%
class LogitsTap:
    """Stands in for the engine's sampler: records every logits matrix ([rows, vocab], fp32), then samples."""

    def __init__(self, sampler):
        self.sampler, self.rows = sampler, []

    def __call__(self, logits, batch):
        self.rows.append(logits.detach().float().cpu().clone())
        return self.sampler(logits, batch)


def next_token_logits(prompt: str) -> torch.Tensor:
    """The logits the engine's sampler receives for the token after ``prompt`` ([vocab_size], fp32)."""
    tap = LogitsTap(engine.runner.sampler)
    engine.runner.sampler = tap
    try:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        engine.runner.sampler = tap.sampler
    return tap.rows[0][0]


def entropy_bits(logits: torch.Tensor) -> float:
    p = torch.softmax(logits, -1)
    return float(-(p * p.clamp_min(1e-30).log2()).sum())


CANDIDATES = ["Return a new list containing all items from the", "The", "If the object supports",
              "This module provides", "Raise a", "The default value of the argument is", "See also",
              "Changed in version"]
candidate_logits = {p: next_token_logits(p) for p in CANDIDATES}
ranked = sorted(CANDIDATES, key=lambda p: entropy_bits(candidate_logits[p]))
PROMPTS = {"confident": ranked[0], "uncertain": ranked[-1]}
LOGITS = {name: candidate_logits[p] for name, p in PROMPTS.items()}
for p in ranked:
    print(f"{entropy_bits(candidate_logits[p]):6.2f} bits  {p!r}")


# %% [markdown]
# Softmax turns logits into probabilities, `p_i = exp(z_i) / Σ_j exp(z_j)`. The ten most likely
# next tokens for each prompt (token pieces show spaces as `·`):

# %%
# NBVAL_CHECK_OUTPUT
def piece(t: int) -> str:
    return tok.decode([t]).replace(" ", "·").replace("\n", "↵") or "∅"


for name, logits in LOGITS.items():
    top = torch.softmax(logits, -1).topk(10).indices.tolist()
    print(f"{name:9s} {PROMPTS[name]!r} ->")
    print("           top-10 token ids:", top)
    print("           pieces          :", " | ".join(piece(t) for t in top))

# %%
import pandas as pd

from widgets import check_claim, check_prediction, render

rows = []
for name, logits in LOGITS.items():
    p = torch.softmax(logits, -1)
    vals, idx = p.topk(100)
    rows.append({"prompt": name, "p(top 1)": float(vals[0]), "p(top 10) summed": float(vals[:10].sum()),
                 "p(top 100) summed": float(vals.sum()), "p(100th)": float(vals[99]),
                 "entropy (bits)": entropy_bits(logits)})
TOP = pd.DataFrame(rows).set_index("prompt")
TOP.round({"p(top 1)": 3, "p(top 10) summed": 3, "p(top 100) summed": 3, "p(100th)": 6, "entropy (bits)": 3})

# %%
_ = render(f"The confident prompt gives its favourite token **{TOP.loc['confident', 'p(top 1)']:.0%}** of the "
       f"probability and its ten best **{TOP.loc['confident', 'p(top 10) summed']:.0%}**; the uncertain one "
       f"gives its favourite **{TOP.loc['uncertain', 'p(top 1)']:.1%}** and its ten best "
       f"**{TOP.loc['uncertain', 'p(top 10) summed']:.0%}**, the rest spread over the vocabulary of "
       f"{engine.source.hf_config.vocab_size:,} tokens (entropy {TOP.loc['uncertain', 'entropy (bits)']:.1f} "
       f"bits against {TOP.loc['confident', 'entropy (bits)']:.1f}). Keep that difference in mind: the "
       "filters below treat the two very differently.")

# %% [markdown]
# ## 2. What each setting does to the distribution
#
# minivllm's sampler (`minivllm/layers/sampler.py`, `Sampler.__call__` and `filtered_probs`)
# applies, in this order: the per-request logits processors (allowed tokens, bad words, logit
# bias, ...), the repetition penalty, the frequency and presence penalties, then **temperature**,
# **top-k**, **top-p**, **min-p**, and one draw from what is left. (The penalties, as in vLLM: the
# repetition penalty divides the positive logit, or multiplies the negative one, of every token seen
# in the prompt or the output by the penalty; the frequency penalty subtracts the penalty times the
# number of times a token appears in the output; the presence penalty subtracts it once for any token
# that appears in the output. This chapter leaves them off.)
#
# * **temperature** `T` divides the logits before the softmax: `softmax(z / T)`. `T < 1` sharpens
#   the distribution (towards greedy), `T > 1` flattens it. `T = 0` is special-cased as greedy:
#   the argmax, no randomness.
# * **top-k** keeps the `k` most likely tokens, whatever their probabilities.
# * **top-p** (nucleus) keeps the smallest set of most likely tokens whose probability reaches `p`.
# * **min-p** keeps tokens whose probability is at least `min_p` times the most likely token's.
#
# That filter order (top-k, top-p, then min-p) is the one of vLLM's original sampler (the V0
# engine, `vllm/model_executor/layers/sampler.py`). vLLM's V1 engine (in vLLM 0.34,
# `vllm/v1/worker/gpu/sample/sampler.py`, `apply_sampling_params`) applies min-p in place right
# after temperature, *before* top-k and top-p. Section 2b measures whether that difference changes anything.
#
# The cell below runs the engine's own filter code (`filtered_probs`) on the real logits from above,
# one `SamplingParams` at a time, and counts the tokens that keep a non-zero probability. Before you
# run it, predict one of the counts.

# %% [markdown]
# ### Exercise 1 · How many tokens does top-p 0.9 keep on the confident prompt?
#
# The table above gives the confident prompt's favourite token, its ten best and its hundred best
# tokens their share of the probability. With `top_p=0.9` the sampler keeps the smallest set of most
# likely tokens whose probability reaches 90%. How many tokens is that, for the confident prompt?
# (Within 50% counts as close. The table bounds the answer from below: if the hundred best hold less than
# 90%, each token after the hundredth holds at most `p(100th)`, the hundredth's probability, so at least
# `(0.9 - p(top 100) summed) / p(100th)` more are needed; the tail's shape decides the rest.)

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: number of tokens top_p=0.9 keeps on the confident prompt (tokens)

# %%
from minivllm.layers.sampler import SamplingBatch, filtered_probs


def one_row_batch(params: SamplingParams) -> SamplingBatch:
    """The sampler's per-row settings for a single request with these params."""
    col = lambda x, dt=torch.float32: torch.tensor([x], dtype=dt)
    return SamplingBatch(col(params.temperature), col(params.top_k, torch.int64), col(params.top_p),
                         col(params.min_p), col(params.repetition_penalty), [None], [None],
                         all_greedy=False, any_top_k=params.top_k > 0, any_top_p=params.top_p < 1,
                         any_min_p=params.min_p > 0, any_penalty=False)


def probs_under(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after the engine's temperature/top-k/top-p/min-p filters ([vocab_size])."""
    return filtered_probs(logits[None].clone(), one_row_batch(params))[0]


SETTINGS = {
    "T=1 (plain softmax)": SamplingParams(temperature=1.0),
    "T=0.5": SamplingParams(temperature=0.5),
    "T=1.5": SamplingParams(temperature=1.5),
    "top_k=10": SamplingParams(temperature=1.0, top_k=10),
    "top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "min_p=0.1": SamplingParams(temperature=1.0, min_p=0.1),
}
PROBS = {(name, s): probs_under(LOGITS[name], params) for name in LOGITS for s, params in SETTINGS.items()}

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'setting':22s}" + "".join(f"{name + ': tokens kept':>28s}" for name in LOGITS))
for s in SETTINGS:
    print(f"{s:22s}" + "".join(f"{int((PROBS[(name, s)] > 0).sum()):>28d}" for name in LOGITS))
print(f"{'greedy (T=0): argmax':22s}" + "".join(f"{'1 (by definition)':>28s}" for _ in LOGITS))

# %%
VOCAB = engine.source.hf_config.vocab_size
KEPT = {(name, s): int((PROBS[(name, s)] > 0).sum()) for name in LOGITS for s in SETTINGS}
_ = check_prediction(my_prediction_1, KEPT[("confident", "top_p=0.9")], rel_tol=0.5, unit="tokens",
                 what="the number of tokens top_p=0.9 keeps on the confident prompt")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Start from the table above. If the ten best tokens together hold less than 90%
# (`p(top 10) summed`), top-p must go past the tenth token, and the missing mass has to come from
# tokens ranked 11th and lower; `p(top 100) summed` says whether the hundredth is reached. A prompt that is confident about *one* token spreads what it does
# not give that token thinly over a long tail, each token holding a small fraction of a percent, so
# collecting even a few percent takes many of them: expect tens or hundreds, not two or three. With
# the table's figures: where the hundred best hold less than 90%, top-p keeps at least
# `100 + (0.9 - p(top 100) summed) / p(100th)` tokens, and about that many while the tail just past the
# hundredth token falls slowly. The count table (row `top_p=0.9`, confident column) has the exact figure. The lesson: "confident" (a
# large top-1 probability) does not mean "a short nucleus"; top-p's count
# depends on how the *last* few percent are spread.
#
# </details>

# %% [markdown]
# What the table shows. Two rules hold on any model (the next cell checks them on this run):
# temperature alone never removes a token, it only changes their sizes (in exact arithmetic: in fp32,
# a token whose logit, divided by the temperature, lies more than about 104 below the favourite's gets
# a probability under e^-104 of the favourite's, and float32 rounds that to exactly 0, so a very low
# temperature does empty the far tail); top-k keeps exactly `k`
# tokens on both prompts, even where the confident prompt's tenth token is negligible or the
# uncertain prompt has many more reasonable choices. Top-p and min-p *adapt*: how many tokens they keep
# depends on the distribution, which is why they are the usual choice for open-ended text. On these two
# prompts each keeps fewer tokens when the model is sure than when it is not (the next cell checks it), the
# usual case but not a rule: a prompt with a clear favourite and a thinly spread tail can keep *more* under
# top-p than a flat one (exercise 1 showed why), and a 50/50 split keeps two tokens under min-p where a
# favourite holding little of the mass but far above each of many tail tokens (say 3% against 0.02%
# each) keeps one. They adapt differently, too: min-p keeps only the tokens within a factor of `1 / min_p` of
# the favourite, however the tail is spread, while top-p must collect its 90% from wherever the mass
# is.

# %%
_ = check_claim("temperature alone keeps every token",
            all(KEPT[(n, s)] == VOCAB for n in LOGITS for s in SETTINGS if s.startswith("T=")),
            f"T=0.5/1/1.5 keep {sorted({KEPT[(n, s)] for n in LOGITS for s in SETTINGS if s.startswith('T=')})} "
            f"of {VOCAB:,} tokens")
_ = check_claim("top-k keeps exactly k tokens on both prompts",
            KEPT[("confident", "top_k=10")] == KEPT[("uncertain", "top_k=10")] == 10,
            f"{KEPT[('confident', 'top_k=10')]} and {KEPT[('uncertain', 'top_k=10')]} with k = 10")
for s in ("top_p=0.9", "min_p=0.1"):
    _ = check_claim(f"{s} keeps fewer tokens on the confident prompt than on the uncertain one",
                KEPT[("confident", s)] < KEPT[("uncertain", s)],
                f"{KEPT[('confident', s)]} vs {KEPT[('uncertain', s)]}",
                why_it_may_not="Not a rule: it depends on how each prompt's tail is spread (a clear favourite over "
                               "a long thin tail can need more tokens to reach top_p than a flatter distribution; "
                               "min-p keeps every token within a factor of 1 / min_p of the favourite, however little mass it holds).")
_ = check_claim("on the confident prompt min_p=0.1 keeps fewer tokens than top_p=0.9",
            KEPT[("confident", "min_p=0.1")] < KEPT[("confident", "top_p=0.9")],
            f"{KEPT[('confident', 'min_p=0.1')]} vs {KEPT[('confident', 'top_p=0.9')]}",
            why_it_may_not="Another model can have a confident prediction with a short tail, where top-p "
                           "stops early too.")

# %% [markdown]
# ### Exercise 2 · Temperature 0.5 on the confident prompt
#
# At `T = 1` the confident prompt's favourite token has the probability in the first table
# (`p(top 1)`). What probability does the same token get at `T = 0.5`? (No token is removed; only
# the sizes change.)

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: the favourite token's probability at T=0.5 (a number between 0 and 1)

# %%
p_top_cold = float(PROBS[("confident", "T=0.5")].max())
_ = check_prediction(my_prediction_2, p_top_cold, rel_tol=0.05,
                     what="the favourite's probability on the confident prompt at temperature 0.5")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Dividing the logits by `T = 0.5` doubles them, and `exp(2 z_i) = exp(z_i)^2`, so every
# probability is squared before renormalising: `p'_i = p_i^2 / Σ_j p_j^2`. The favourite's `p_1^2`
# stays large, while every other token, already small, becomes much smaller (a token at 1% goes to
# 0.01% before renormalising). The denominator is therefore `p_1^2` plus a little, and the favourite
# ends close to 1: neglecting the other tokens' squares gives exactly 1, and the exact value,
# `p_1^2 / Σ_j p_j^2`, is a little below it. The measured value the check cell above compares your
# answer with (it prints it once the exercise cell holds a number) is that ratio on the real logits. Temperature below 1 makes a
# confident model almost greedy, without ever making another token impossible.
#
# </details>

# %% [markdown]
# ### 2b. Does the order of the filters matter?
#
# minivllm applies min-p after top-k and top-p; vLLM V1 applies it before them. Top-k and min-p
# each keep a prefix of the ranked tokens, so with those two the order cannot matter (both orders
# keep the shorter prefix). Top-p is different: it measures mass on whatever distribution it is
# handed.
#
# ### Exercise 3 · minivllm's order against vLLM V1's
#
# Take the uncertain prompt with `top_p=0.9` and `min_p=0.05` together. Compared with minivllm's
# order, does vLLM V1's order (min-p first, then top-p on what min-p left) keep **fewer**, **as
# many** or **more** tokens?

# %% tags=["exercise"]
my_prediction_3 = None  # your guess: "fewer", "as many" or "more" tokens kept in vLLM V1's order


# %%
def kept_v1_order(logits: torch.Tensor, top_p: float, min_p: float) -> int:
    """Tokens kept at T=1 when min-p runs first and top-p then sees min-p's survivors (vLLM V1's order)."""
    p = torch.softmax(logits, -1)
    survivors = logits.masked_fill(p < min_p * p.max(), float("-inf"))
    return int((probs_under(survivors, SamplingParams(temperature=1.0, top_p=top_p)) > 0).sum())


ORDER = {}
for name in LOGITS:
    ours = int((probs_under(LOGITS[name], SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05)) > 0).sum())
    ORDER[name] = (ours, kept_v1_order(LOGITS[name], 0.9, 0.05))
    print(f"{name:9s} top_p=0.9 + min_p=0.05: minivllm's order keeps {ORDER[name][0]}, "
          f"vLLM V1's order keeps {ORDER[name][1]} tokens")
ours, v1 = ORDER["uncertain"]
measured = "fewer" if v1 < ours else ("more" if v1 > ours else "as many")
CHOICES = ("fewer", "as many", "more")
answer = str(my_prediction_3).strip().lower() if my_prediction_3 is not None else None
if answer is None:
    print('No prediction yet: write "fewer", "as many" or "more" in the exercise cell above, run it, then run '
          "this cell again.")
elif answer not in CHOICES:
    print(f'Your prediction should be one of "fewer", "as many" or "more", not {my_prediction_3!r}: change the '
          "exercise cell and run both again.")
else:
    _ = check_claim(f"your prediction: V1's order keeps {answer!r} tokens", answer == measured,
                    f"V1's order {v1}, minivllm's {ours}")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Min-p's test compares each token with the favourite, `p_i >= min_p * p_max`, and renormalising a
# distribution scales every probability by the same factor, so that test gives the same answer
# before or after top-p. In minivllm's order a token therefore survives exactly when it passes both
# tests on the original distribution.
#
# In V1's order, top-p receives the distribution *renormalised over min-p's survivors*: each
# survivor's probability is divided by the survivors' total mass, which is less than 1. The running
# sum reaches 90% sooner, after fewer tokens. Every token V1 keeps also passes both original tests,
# so V1 can keep fewer tokens, never more. The two orders agree when top-p, run on min-p's
# renormalised survivors, still needs all of them: then both keep exactly min-p's survivors (the
# extreme case is min-p keeping a single token, where there is nothing left to cut). As soon as
# the renormalised survivors reach 90% before the last of them, V1 stops there, while minivllm's
# top-p, counting on the original, smaller probabilities, usually has to go further. The cell
# after this solution prints, for both prompts, what min-p keeps alone and what each order keeps:
# compare them with this reasoning.
# Both are reasonable definitions; they are not the same sampler, and settings tuned on one engine
# can sample differently on the other.
#
# </details>

# %%
MINP_ALONE = {name: int((probs_under(LOGITS[name], SamplingParams(temperature=1.0, min_p=0.05)) > 0).sum())
              for name in LOGITS}
_ = render("On this run, with `top_p=0.9` and `min_p=0.05`: " + "; ".join(
    f"the {name} prompt's min-p alone keeps **{MINP_ALONE[name]}** token(s), minivllm's order "
    f"**{ORDER[name][0]}**, vLLM V1's **{ORDER[name][1]}** "
    f"({'the orders agree' if ORDER[name][0] == ORDER[name][1] else 'V1 keeps fewer' if ORDER[name][1] < ORDER[name][0] else 'V1 keeps more, which the reasoning above rules out: a bug to report'})"
    for name in LOGITS) + ".")

# %% [markdown]
# ### Playground · temperature before the filters
#
# The filters run *after* temperature, so temperature changes what top-p and min-p see. Change
# `TEMPERATURE` (try 0.5, 0.8, 1.5, 2) and run the cell: watch top-p and min-p keep more tokens
# (or as many) as the distribution flattens and fewer (or as many) as it sharpens, while top-k's
# count does not move.

# %% tags=["playground"]
TEMPERATURE = 1.5  # the knob: the temperature applied before the filters

if TEMPERATURE == 0:  # greedy: the sampler takes the argmax and never runs the filters
    print("T=0 is greedy: the engine takes the most likely token (1 kept) and skips top-k, top-p and min-p; "
          "try a temperature above 0.")
else:
    for name in LOGITS:
        counts = {label: int((probs_under(LOGITS[name], SamplingParams(temperature=TEMPERATURE, **kw)) > 0).sum())
                  for label, kw in (("top_k=10", dict(top_k=10)), ("top_p=0.9", dict(top_p=0.9)),
                                    ("min_p=0.1", dict(min_p=0.1)))}
        print(f"T={TEMPERATURE}, {name:9s}: " + ", ".join(f"{k} keeps {v}" for k, v in counts.items())
              + f"   (at T=1: top_p=0.9 keeps {KEPT[(name, 'top_p=0.9')]}, min_p=0.1 keeps {KEPT[(name, 'min_p=0.1')]})")

# %% [markdown]
# The chart shows the 25 most likely tokens of the uncertain prompt under each setting (the same
# tokens, in the same order, in every panel):

# %%
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from widgets import show_figure

name = "uncertain"
order = torch.softmax(LOGITS[name], -1).topk(25).indices.tolist()
labels = [f"{piece(t)} ({t})" for t in order]
fig = make_subplots(rows=2, cols=3, subplot_titles=list(SETTINGS), shared_yaxes=True,
                    vertical_spacing=0.28, horizontal_spacing=0.04)
for i, s in enumerate(SETTINGS):
    p = PROBS[(name, s)][order].tolist()
    fig.add_bar(x=labels, y=p, row=i // 3 + 1, col=i % 3 + 1, showlegend=False,
                marker_color=["#4c78a8" if v > 0 else "#d0d0d0" for v in p])
fig.update_xaxes(tickangle=-60, tickfont=dict(size=8))
fig.update_yaxes(title_text="probability", row=1, col=1)
fig.update_yaxes(title_text="probability", row=2, col=1)
fig.update_xaxes(title_text="token (id)", row=2)
fig.update_layout(height=600, title=f"Next-token probabilities after {PROMPTS[name]!r} under each setting<br>"
                  f"<sup>measured: {RUN}</sup>")
show_figure(fig)

# %% [markdown]
# ## 3. The same settings, generating text
#
# Now through the engine end to end: each setting generates 12 tokens for the same prompt, three
# times. The sampled runs carry seeds 1, 2 and 3, so they are reproducible too (more on seeds in
# section 5); without a per-request seed the three runs would still differ from each other, and
# their tokens would depend on what else shares their steps. Each request also asks for
# `logprobs=0`: the log-probability, under the model's raw distribution (before temperature or any
# filter), of every token it generated, so we can measure how likely the chosen tokens were. A
# log-probability is a natural logarithm, so its unit is the *nat* (1 nat = 1/ln 2, about 1.44 bits).

# %%
# NBVAL_CHECK_OUTPUT
PROMPT = PROMPTS["uncertain"]
RUNS = {"greedy": dict(temperature=0.0), "T=0.7": dict(temperature=0.7), "T=1.3": dict(temperature=1.3),
        "top_k=10": dict(top_k=10), "top_p=0.9": dict(top_p=0.9), "min_p=0.1": dict(min_p=0.1)}
requests, params = [], []
for label, kw in RUNS.items():
    for seed in (1, 2, 3):
        requests.append(PROMPT)
        params.append(SamplingParams(max_tokens=12, ignore_eos=True, seed=seed, logprobs=0, **kw))
outs = llm.generate(requests, params, use_tqdm=False)
TEXTS, MEAN_LOGPROB = {}, {}
for i, label in enumerate(RUNS):
    runs = [outs[3 * i + j].outputs[0] for j in range(3)]
    TEXTS[label] = [o.text for o in runs]
    MEAN_LOGPROB[label] = sum(o.cumulative_logprob for o in runs) / sum(len(o.token_ids) for o in runs)
    print(f"{label:10s}", " || ".join(repr(t) for t in TEXTS[label]))

# %%
for label, lp in MEAN_LOGPROB.items():
    print(f"{label:10s} mean log-probability of a generated token (raw model): {lp:6.2f} nats")
_ = check_claim("greedy gives the same text for every seed", len(set(TEXTS["greedy"])) == 1,
            f"{len(set(TEXTS['greedy']))} distinct text(s) out of 3")
_ = check_claim("low temperature picks likelier tokens than high temperature",
            MEAN_LOGPROB["T=0.7"] > MEAN_LOGPROB["T=1.3"],
            f"mean log-probability {MEAN_LOGPROB['T=0.7']:.2f} at T=0.7, {MEAN_LOGPROB['T=1.3']:.2f} at T=1.3",
            why_it_may_not="Three 12-token samples are few; more seeds would settle it.")

# %% [markdown]
# Greedy always takes the single most likely token. Low temperature stays closer to the likely
# tokens, high temperature wanders into rare ones (the mean log-probabilities above). The filtered
# settings sample, but only among the tokens each filter keeps at every step. How likely each token
# was does not say how readable a 12-token sample is, least of all from a model as small as the embedded
# one: compare the texts above.
# Runs with the same seed can share their first tokens across settings: a seed fixes the noise `E_i`
# of every draw (section 6 shows how the draw uses it), and the same noise often wins the race for the
# same token under two settings that reshape the probabilities only a little, until one draw differs
# and the texts part.

# %% [markdown]
# ## 4. The sampling explorer
#
# The explorer below is driven by the same engine. It runs a prompt through a real engine step and
# shows the model's next-token distribution (light bars); its sliders apply temperature, top-k,
# top-p and min-p with the engine's own filter code (dark bars), and **Draw samples** draws tokens
# with the engine's exponential race and plots their frequencies (diamonds). It starts on the
# confident prompt with top-p 0.9 and 2,000 draws. Type the uncertain prompt, press
# **Next-token distribution**, and compare how many tokens survive the same top-p, and how much of
# the mass the 20 tokens shown still hold.

# %%
from widgets import SamplingExplorer

explorer = SamplingExplorer(llm, prompt=PROMPTS["confident"], top_n=20)
explorer.top_p.value = 0.9   # the same filter as in section 2
explorer.draw(2000)
explorer.display()

# %%
# NBVAL_CHECK_OUTPUT
# the explorer as it is now (after your own prompts and slider moves too), against section 2's count for its setting
setting = {k: round(getattr(explorer, k).value, 6) for k in ("temperature", "top_k", "top_p", "min_p")}
print(f"explorer, {', '.join(f'{k}={v:g}' for k, v in setting.items())} on {explorer.loaded_prompt!r}: "
      f"{explorer.kept} tokens kept")
if explorer.loaded_prompt == PROMPTS["confident"] and setting == dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0):
    print(f"(section 2 counted {int((PROBS[('confident', 'top_p=0.9')] > 0).sum())} for the same prompt and filter)")
else:
    print("(section 2's count was for top_p=0.9 alone on the confident prompt: run the cell above again to compare)")

# %% [markdown]
# ## 5. Seeds: the same tokens, whatever else is in the batch
#
# A seeded request should be reproducible, and not only when it runs alone: a server batches
# unrelated requests together, and the answer to yours must not depend on who else showed up.
# minivllm gives every seeded request its **own** `torch.Generator`, created from its seed when the
# request first samples. Each step, the sampler fills that request's row of random noise from its
# own generator, so no other row can consume or shift its random numbers.
#
# Test: request A (seed 1234, temperature 1, top-p 0.95) runs alone; then again with seven other
# requests around it (a greedy one, unseeded ones, other seeds, other filters, and a longer prompt),
# added both before and after it. One of the seven is A's prompt and settings *without* a seed: the
# control. Requests without a seed draw from the engine-wide stream, which moves on with every draw,
# so two of their runs would differ even if nothing else changed; to compare like with like, the cell
# puts that stream back to the same state (`manual_seed`) before the batch and before each run of
# the control alone.

# %%
# NBVAL_CHECK_OUTPUT
A = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
alone = llm.generate(PROMPT, A, use_tqdm=False)[0].outputs[0].token_ids

others = [("The module", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
          ("If the object", SamplingParams(temperature=1.2, max_tokens=10, ignore_eos=True)),
          ("Return", SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=24, ignore_eos=True)),
          (PROMPT, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)),  # A, no seed
          (PROMPT, SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)),
          (" ".join(["The function returns a new list."] * 8), SamplingParams(temperature=1.0, max_tokens=4)),
          ("Raise", SamplingParams(temperature=0.5, min_p=0.2, max_tokens=16, ignore_eos=True))]
batch_prompts = [p for p, _ in others[:3]] + [PROMPT] + [p for p, _ in others[3:]]
batch_params = [s for _, s in others[:3]] + [A] + [s for _, s in others[3:]]
STREAM = engine.runner.sampler.generator  # the engine-wide stream of the requests without a seed
STREAM.manual_seed(SEED)
crowd = llm.generate(batch_prompts, batch_params, use_tqdm=False)
in_batch = crowd[3].outputs[0].token_ids

print("A alone     :", alone)
print("A in a batch:", in_batch)
print("identical   :", alone == in_batch)
other_seed = crowd[batch_params.index(others[4][1])].outputs[0].token_ids
shared_other_seed = sum(a == b for a, b in zip(alone, other_seed))
print("same prompt and settings, seed 99 instead of 1234: shares", shared_other_seed, "of 24 positions with A")
no_seed = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
no_seed_alone = []
for _ in range(2):
    STREAM.manual_seed(SEED)  # the same stream state as before the batch
    no_seed_alone.append(llm.generate(PROMPT, no_seed, use_tqdm=False)[0].outputs[0].token_ids)
no_seed_batch = crowd[4].outputs[0].token_ids
shared_no_seed = sum(a == b for a, b in zip(no_seed_alone[0], no_seed_batch))
print("A without a seed, alone twice from the same stream state: identical:", no_seed_alone[0] == no_seed_alone[1])
print("A without a seed, alone vs in the batch, same stream state: shares", shared_no_seed, "of 24 positions")

# %%
_ = check_claim("a seeded request gets the same 24 tokens alone and in a batch of eight", alone == in_batch,
            f"identical: {alone == in_batch}")
_ = check_claim("the same prompt and filters with another seed give other tokens", other_seed != alone,
            f"seed 99 shares {shared_other_seed} of 24 positions with seed 1234")
_ = check_claim("without a seed, from the same stream state, the request alone gets the same tokens twice",
            no_seed_alone[0] == no_seed_alone[1], f"identical: {no_seed_alone[0] == no_seed_alone[1]}")
_ = check_claim("without a seed, from the same stream state, the tokens alone and in the batch differ",
            no_seed_alone[0] != no_seed_batch, f"{shared_no_seed} of 24 positions shared",
            why_it_may_not="Two unseeded runs can coincide by chance on a very confident prompt.")

# %% [markdown]
# The seed pins a request's tokens whatever shares its steps (first check), and the seed is what
# decides them (second). A request *without* a seed draws from the engine-wide stream, whose
# numbers are handed out row by row to whoever is in the step: from the same stream state it repeats
# its tokens when it runs alone (third), and gets other tokens in the batch, where other rows take
# their share of the stream's numbers before and beside it (fourth). In a server the stream's state
# also depends on everything sampled earlier; that is fine for a request that asked for no
# reproducibility.
#
# ## 6. Why the exponential race samples from the softmax
#
# To draw from `p` the textbook way, you sort or cumulatively sum the probabilities and look up a
# uniform random number in that table. The engine does something else
# (`minivllm/layers/sampler.py`, `exponential_race`):
#
#     E_i ~ Exp(1), independent for every token i;   token = argmax_i  p_i / E_i
#
# Why that is a draw from `p`: `E_i / p_i` is exponential with rate `p_i`, and among independent
# exponential clocks with rates `p_i`, the one that rings first is clock `j` with probability
# `p_j / Σ_i p_i = p_j`. The smallest `E_i / p_i` is the largest `p_i / E_i`. Taking logs,
# `log p_i - log E_i = log p_i + G_i` with `G_i = -log E_i` a standard Gumbel variable: this is the
# **Gumbel-max trick**.
#
# Why the engine likes it: the draw needs no sort and no cumulative sum (one elementwise divide and an
# argmax, which parallelise trivially on a GPU). (What makes a seeded request's draws independent of
# the batch, section 5, is not the race: it is that such a row takes its random numbers from its own
# generator, which a cumulative-sum lookup could do as well.) The price is the noise itself: one
# random number per token of the vocabulary, turned into an exponential, for every row at every step,
# where a cumulative-sum lookup needs one random number per row. What that costs depends on the
# machine; the docstring of `exponential_noise_` in `minivllm/layers/sampler.py` records what it cost
# on one CPU, and how the engine made it cheaper.
#
# A proof is one thing; a measurement is another. Below, the engine's own `exponential_race` draws
# 100,000 tokens from the real distribution of the uncertain prompt under top-k 24, and a chi-square
# goodness-of-fit test compares the counts with the softmax probabilities. (The test sums, over the
# tokens, (count - expected count)² / expected count; its p-value is the chance that draws from the
# softmax itself would give a sum at least this large, so a p-value below 0.01 rejects the sampler "at
# the 1% level", and one above it says the counts fit. The total variation distance is half the summed
# absolute differences between the drawn frequencies and the probabilities: the largest difference
# between the two in the probability of any set of tokens.) Tokens outside the top 24
# have probability exactly 0 and can never win the race (`0 / E = 0`), so the draws use the 24
# surviving tokens only. As a control that the test can fail, a plausible-looking wrong trick,
# `argmax_i p_i * U_i` with `U_i` uniform, goes through the same test.

# %%
from scipy.stats import chisquare

from minivllm.layers.sampler import exponential_race

K, N, CHUNK = 24, 100_000, 20_000
full = probs_under(LOGITS["uncertain"], SamplingParams(temperature=1.0, top_k=K))
support = full.nonzero().flatten()
support = support[full[support].argsort(descending=True)]  # most likely first
q = full[support]                                  # the 24 surviving probabilities, summing to 1
gen = torch.Generator().manual_seed(2024)


def draw(sampler, n: int) -> torch.Tensor:
    """Counts per token of ``n`` draws of ``sampler(rows)`` over rows of q."""
    counts = torch.zeros(K, dtype=torch.long)
    for _ in range(n // CHUNK):
        rows = q.expand(CHUNK, K).contiguous()
        counts += torch.bincount(sampler(rows), minlength=K)
    return counts


race = draw(lambda rows: exponential_race(rows, [None] * len(rows), gen), N)
wrong = draw(lambda rows: (rows * torch.rand(rows.shape, generator=gen)).argmax(-1), N)
expected = q.double() / q.double().sum() * N  # float64, so it sums to N exactly like the counts
results = {}
for name, counts in (("exponential race (engine)", race), ("argmax p*U (wrong trick)", wrong)):
    stat, pvalue = chisquare(counts.double().numpy(), expected.numpy())
    tv = 0.5 * float((counts.double() / N - q.double()).abs().sum())
    results[name] = (stat, pvalue, tv)
    print(f"{name:27s} chi-square {stat:10.1f} (df {K - 1})   p-value {pvalue:.3g}   total variation {tv:.4f}")
ref = torch.multinomial(q, N, replacement=True, generator=gen).bincount(minlength=K)
ref_tv = 0.5 * float((ref.double() / N - q.double()).abs().sum())
print(f"{'torch.multinomial (reference)':27s} total variation {ref_tv:.4f}")
_, race_p, race_tv = results["exponential race (engine)"]
_, wrong_p, wrong_tv = results["argmax p*U (wrong trick)"]

# %%
# NBVAL_CHECK_OUTPUT
for name, (stat, pvalue, tv) in results.items():
    verdict = "consistent with the softmax" if pvalue > 0.01 else "REJECTED: not the softmax"
    print(f"{name:27s} at the 1% level: {verdict}")

# %%
fig = go.Figure()
labels = [f"{piece(t)} ({t})" for t in support.tolist()]
fig.add_bar(x=labels, y=q.tolist(), name="softmax probability", marker_color="#bbbbbb")
fig.add_scatter(x=labels, y=(race.double() / N).tolist(), mode="markers", name="exponential race, frequency",
                marker=dict(color="#4c78a8", size=9))
fig.add_scatter(x=labels, y=(wrong.double() / N).tolist(), mode="markers", name="argmax p*U, frequency",
                marker=dict(color="#e45756", size=9, symbol="x"))
fig.update_layout(title=f"{N:,} draws per sampler vs the softmax (top-{K} of {PROMPTS['uncertain']!r})<br>"
                        f"<sup>measured: {RUN}</sup>",
                  xaxis_title="token", yaxis_title="probability / frequency", height=440,
                  xaxis_tickangle=-60, legend=dict(orientation="h", y=1.12))
show_figure(fig)

# %% [markdown]
# The engine's race should land on the grey bars token by token: the chi-square test should not
# reject it, and its total variation distance from the softmax should be of the size
# `torch.multinomial` gets (pure sampling noise at this number of draws; one sample of each, so "of
# the size" here means within a factor of two). The wrong trick over-picks the most likely token and
# starves the tail: multiplying by a uniform is not the same as dividing by an exponential, and with
# this many draws the chi-square test tells them apart easily. The next cell checks each of these on
# this run.

# %%
half = K // 2
_ = check_claim("the chi-square test does not reject the exponential race at the 1% level", race_p > 0.01,
            f"p-value {race_p:.3g}",
            why_it_may_not="A sampler that is exact still fails a 1% test in one run out of a hundred; rerun "
                           "with another generator seed.")
_ = check_claim("the exponential race's total variation from the softmax is within 2x of torch.multinomial's",
            race_tv < 2 * ref_tv, f"{race_tv:.4f} against {ref_tv:.4f}",
            why_it_may_not="Each is a single noisy sample, so an exact sampler can still land outside by chance: "
                           "rarely for a spread-out distribution like this one, more often when a few tokens "
                           "hold almost all the mass.")
_ = check_claim("argmax p*U over-picks the most likely token",
            float(wrong[0]) / N > float(q[0]), f"{float(wrong[0]) / N:.3f} of the draws against p = {float(q[0]):.3f}")
_ = check_claim(f"argmax p*U starves the tail (the {K - half} least likely tokens)",
            float(wrong[half:].sum()) / N < float(q[half:].sum()),
            f"{float(wrong[half:].sum()) / N:.4f} of the draws against their probability {float(q[half:].sum()):.4f}")
_ = check_claim("the chi-square test rejects the wrong trick", wrong_p < 1e-6, f"p-value {wrong_p:.3g}")

# %% [markdown]
# ### 6b. The filters without a sort
#
# The race needs no sort, but top-k and top-p are *defined* on the sorted row: keep the `k` most
# likely tokens, or the most likely ones until their mass reaches `top_p`. (Exactly: a token is kept
# while the mass of the tokens ranked before it is below `top_p` less a small slack,
# `TOP_P_TOLERANCE`, whose value the table below prints. It is there so that a mass that reaches
# `top_p` exactly on paper still counts as reaching it when fp32 rounding leaves it a hair short. The
# float64 reference below subtracts the same slack, so the slack only fixes where the rule puts the
# cut; it cannot hide a path's rounding errors in the comparison.) On a GPU the engine
# keeps the sort (one batched sort call). On a CPU, sorting a whole vocabulary for every sampled row
# at every step is slow (the table below times it), so there the engine finds the same tokens, up to
# rounding at top-p's cut (the table counts them), another way (`minivllm/layers/cpu_sampling.py`):
#
# * **top-k** only needs to know which `k` tokens are largest. A *partial selection* (torch's
#   `topk`, one call for every row of the batch) finds the `k` largest logits without ordering the
#   rest of the row. Ties at the `k`-th value go to the lowest ids, as a *stable* sort (one that
#   keeps equal values in their original order) would order them: `topk` also returns the next
#   value, so a row with a tie across the cut is seen and settled by id. When `k` is a quarter of
#   the vocabulary or more, the selection would save little, and the whole row is sorted.
# * **top-p** needs no softmax to rank the tokens: a token's log-probability minus the favourite's
#   equals its logit minus the largest logit. The path splits a range below the favourite (its width
#   in nats, the number of buckets and the crowding limit are printed after this list, read from the
#   module; anything further down goes in the last bucket) into equal buckets. Placing every token in its bucket and adding up each bucket's
#   probability takes linear time too (a few passes over the row, no sort). Each bucket holds a
#   *run of the sorted order*: every token in it ranks after every token of the bucket above and
#   before every token of the bucket below. So adding up the buckets' mass from the top finds the
#   bucket where the mass reaches `top_p`: the buckets above it are kept whole, the ones below it
#   dropped, and only that one bucket's tokens are sorted to place the cut. A crowded bucket is first
#   split into buckets again, the same way.
# * **both**: top-k runs first, and top-p then works over the `k` tokens it kept, sorted (a sort of
#   only `k` values; no buckets).
#
# The cell below times the sorting rule (`sorted_drop_mask`, what a GPU runs) against the CPU path
# (`drop_mask`) on CPU tensors: this model's real logits, a row of random logits as long as Qwen3's
# vocabulary (its size read from the packaged Qwen3-0.6B config), and that row's first 4,096 values
# (as many as this model's vocabulary). It also works the rule out
# in float64 (numpy, sorting; not timed) and counts, for each path, the tokens it keeps or drops
# against that exact answer: both paths add up fp32 probabilities, in a different order, so a token
# whose mass sits on top-p's cut within rounding can land on either side.

# %%
import math

from minivllm.layers import cpu_sampling

_ = render(f"The CPU top-p path in this build (`minivllm/layers/cpu_sampling.py`): the range spans "
           f"**{cpu_sampling._SPAN_NATS:g} nats** below the favourite (a probability ratio of "
           f"{math.exp(-cpu_sampling._SPAN_NATS):.1e}), split into **{cpu_sampling._BUCKETS:,}** buckets; a bucket "
           f"of more than **{cpu_sampling._SORT_AT_MOST:,}** tokens is split again.")

# %%
import time

import numpy as np

from minivllm.layers.sampler import TOP_P_TOLERANCE, drop_mask, sorted_drop_mask
from minivllm.models.presets import load_preset_config


def median_ms(fn, repeats: int = 7) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls (milliseconds)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def exact_drop(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k then top-p at temperature 1 worked in float64: True where a token is dropped ([vocab])."""
    assert params.temperature == 1.0, "the rule is worked on the logits as they are"
    y = row.double().numpy()
    order = np.lexsort((np.arange(y.size), -y))  # most likely first, ties by id
    order = order[:params.top_k] if 0 < params.top_k < y.size else order
    keep = np.zeros(y.size, dtype=bool)
    keep[order] = True
    if np.float32(params.top_p) < 1:  # as the engine holds top_p
        e = np.exp(y[order] - y[order[0]])
        p = e / e.sum()
        keep[order] = np.cumsum(p) - p < float(np.float32(params.top_p)) - TOP_P_TOLERANCE
        keep[order[0]] = True
    return torch.from_numpy(~keep)


QWEN3_VOCAB = load_preset_config("qwen3-0.6b").vocab_size
long_row = torch.randn(QWEN3_VOCAB, generator=torch.Generator().manual_seed(0)) * 3
ROWS = {f"{engine.source.name}, uncertain prompt": LOGITS["uncertain"].float().cpu(),
        "random logits, Qwen3's vocabulary": long_row,
        "random logits, its first 4,096": long_row[:4096].clone()}
FILTERS = {"top_k=50": SamplingParams(temperature=1.0, top_k=50),
           "top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9)}
TIMES, OFF = {}, {}
print(f"{'row':36s} {'vocab':>7s} {'filter':>9s} {'kept':>5s} {'sort ms':>8s} {'no-sort ms':>10s} "
      f"{'off exact: sort':>15s} {'no-sort':>7s}")
for row_name, row in ROWS.items():
    exact = {f: exact_drop(row, params) for f, params in FILTERS.items()}
    for f_name, params in FILTERS.items():
        x, batch = row[None].contiguous(), one_row_batch(params)
        by_sort, no_sort = sorted_drop_mask(x, batch)[0], drop_mask(x, batch)[0]
        TIMES[(row_name, f_name)] = (median_ms(lambda: sorted_drop_mask(x, batch)),
                                     median_ms(lambda: drop_mask(x, batch)))
        OFF[(row_name, f_name)] = (int((by_sort != exact[f_name]).sum()), int((no_sort != exact[f_name]).sum()))
        print(f"{row_name.split(',')[0]:36s} {x.shape[1]:7,d} {f_name:>9s} {int((~no_sort).sum()):5d} "
              f"{TIMES[(row_name, f_name)][0]:8.2f} {TIMES[(row_name, f_name)][1]:10.2f} "
              f"{OFF[(row_name, f_name)][0]:15d} {OFF[(row_name, f_name)][1]:7d}")
print(f"off exact: tokens kept or dropped against the float64 rule (with the same slack, TOP_P_TOLERANCE = "
      f"{TOP_P_TOLERANCE:.0e}). Timed: one call per row, median of 7; {RUN}")

# %%
_ = check_claim("the CPU path keeps exactly the tokens of the float64 rule, on every row and filter above",
                all(cpu == 0 for _, cpu in OFF.values()),
                ", ".join(f"{r.split(',')[0]} ({ROWS[r].numel():,}) {f}: {cpu} off" for (r, f), (_, cpu) in OFF.items()),
                why_it_may_not="A token whose mass sits on top-p's cut within fp32 rounding can land on either side.")
long_name, short_name = "random logits, Qwen3's vocabulary", "random logits, its first 4,096"
speedup = {(r, f): TIMES[(r, f)][0] / TIMES[(r, f)][1] for r in ROWS for f in FILTERS}
_ = check_claim("on a random row as long as Qwen3's vocabulary the CPU path is faster than the sort for both filters",
                min(speedup[(long_name, f)] for f in FILTERS) > 1,
                ", ".join(f"{f}: {speedup[(long_name, f)]:.1f}x" for f in FILTERS),
                why_it_may_not="Timings on a machine loaded by other processes can swing either way.")
_ = check_claim("on the random rows, the saving grows with the row's length, for both filters",
                all(speedup[(long_name, f)] > speedup[(short_name, f)] for f in FILTERS),
                ", ".join(f"{f}: {speedup[(short_name, f)]:.1f}x at {ROWS[short_name].numel():,} tokens, "
                          f"{speedup[(long_name, f)]:.1f}x at {ROWS[long_name].numel():,}" for f in FILTERS),
                why_it_may_not="Timings on a machine loaded by other processes can swing either way.")

# %% [markdown]
# Where the sort's column is not 0, its kept set departs from the exact rule. The reason is in how
# the probabilities add up: the cell below sums, in float64, the fp32 probabilities each path
# computes for the long row (the sort run here, on a CPU; a GPU's softmax adds up in another order).
# Torch's CPU softmax adds a row up in vector lanes, a few running totals each adding one term at a
# time (as vectorised sums do; this chapter does not take torch's kernel apart), so every small term
# lands on a total far larger than itself and loses its low bits; over
# the *sorted* row the largest terms come first, which the cell shows makes it worse. The CPU path's
# sums are numpy's pairwise ones (add neighbours, then neighbouring sums, and so on), whose error
# grows with the logarithm of the row's length rather than with the length. An error in the total
# moves every cumulative mass along the row, and with it the place where the mass reaches `top_p`.

# %%
sorted_probs = long_row.sort(descending=True, stable=True).values.softmax(dim=-1)
e = (long_row - long_row.max()).exp().numpy()
cpu_probs = e / np.float32(e.sum())  # as cpu_sampling computes them for top-p: a numpy sum
SUM_OFF = {"sort (torch softmax of the sorted row)": float(sorted_probs.double().sum()) - 1,
           "CPU path (numpy pairwise sums)": float(cpu_probs.astype(np.float64).sum()) - 1,
           "torch softmax of the unsorted row": float(long_row.softmax(dim=-1).double().sum()) - 1}
for name, off in SUM_OFF.items():
    print(f"{name:40s} probabilities sum to 1 {off:+.1e}")
print(f"top-p's slack TOP_P_TOLERANCE = {TOP_P_TOLERANCE:.0e}; {long_row.numel():,} tokens; {RUN}")
sort_off, cpu_off, unsorted_off = SUM_OFF.values()
_ = check_claim("the CPU path's probabilities add up to 1 more closely than the sort's", abs(cpu_off) < abs(sort_off),
                f"{cpu_off:+.1e} against {sort_off:+.1e}")
_ = check_claim("torch's CPU softmax adds up the sorted row less closely than the unsorted one",
                abs(sort_off) > abs(unsorted_off), f"{sort_off:+.1e} against {unsorted_off:+.1e}")

# %% [markdown]
# Either way the race uses the same uniform random numbers, so on the same device and generator a
# seed draws the same token on both paths wherever they keep the same tokens, up to ties within fp32
# rounding. The cell below draws 300 seeded tokens from this model's row with `top_p=0.9` both ways:
# the sampler's CPU path (`sample_rows`), and the sort's probabilities (`filtered_probs` with
# `drop=sorted_drop_mask`) followed by the race (`exponential_race`).

# %%
from minivllm.layers.cpu_sampling import sample_rows

model_row = next(iter(ROWS))
x, batch = ROWS[model_row][None].contiguous(), one_row_batch(FILTERS["top_p=0.9"])
same = sum(int(sample_rows(x, batch, torch.Generator().manual_seed(seed))[0])
           == int(exponential_race(filtered_probs(x, batch, drop=sorted_drop_mask), [None],
                                   torch.Generator().manual_seed(seed))[0])
           for seed in range(300))
_ = check_claim("with the same generator seed both paths draw the same token", same == 300,
                f"{same} of 300 seeds on {model_row.split(',')[0]}'s row at top_p=0.9 (tokens off the exact "
                f"rule: sort {OFF[(model_row, 'top_p=0.9')][0]}, CPU path {OFF[(model_row, 'top_p=0.9')][1]})",
                why_it_may_not="The paths' kept sets differ on this row, or two tokens tie within fp32 rounding.")

# %% [markdown]
# ## 7. Check yourself

# %%
from widgets import Question, Quiz

Quiz([
    Question(
        "You set top_k=50. On a prompt where the model puts 97% of its probability on one token, how many "
        "tokens can be sampled?",
        ["1", "About as many as needed to reach 97%", "50", "It depends on the temperature"],
        2,
        ["That would be greedy (or a very small top-p or high min-p); top-k does not look at the probabilities.",
         "That describes top-p, which adapts to the distribution; top-k is a fixed count.",
         "Right: top-k keeps exactly k tokens; the 49 others keep their small probabilities (part of the "
         "remaining 3%), renormalised over the 50 (section 2 "
         "measured the same count on both prompts).",
         "For any temperature above 0, temperature changes the probabilities but not their order, and never "
         "sets any to zero (in exact arithmetic; in fp32 a very low temperature can round the far tail to 0), "
         "so the same 50 tokens survive (temperature 0 is greedy: one token)."],
    ),
    Question(
        "Two users send the same prompt with seed=42 to a server that batches requests. Do they get the same "
        "tokens?",
        ["Only if they land in the same batch", "Yes: each seeded request has its own generator, so its noise "
         "does not depend on the batch", "No: batching always changes the random numbers",
         "Only with temperature 0"],
        1,
        [f"Section 5 ran the same seeded request alone and in a batch of eight: identical tokens on this run: "
         f"{alone == in_batch}.",
         "Right: the noise for a seeded row comes only from that request's generator, seeded with 42 the first "
         "time it samples. On GPUs, kernels that are not batch-invariant can still give slightly different "
         "logits in another batch and flip a near-tied token; section 5 checked the seeded request on this "
         f"run: identical alone and in a batch: {alone == in_batch}.",
         "That holds for requests without a seed (they share the engine-wide stream), not for seeded ones.",
         "Greedy needs no random numbers at all; the question is about sampling with a seed."],
    ),
    Question(
        "Why does the engine draw with argmax(p / E), E exponential, instead of a cumulative-sum lookup?",
        ["It is an approximation that is faster", "It is exact, and the draw needs no sort or cumulative sum: "
         "an elementwise divide and an argmax", "It samples more diverse tokens than the softmax",
         "It is needed for top-p"],
        1,
        ["It is not an approximation: the first of independent exponential clocks with rates p_i is j with "
         f"probability p_j (and section 6's chi-square test gave p-value {race_p:.2g} on this run).",
         "Right: an elementwise divide and an argmax, per row, which parallelises well (per-request seeds come "
         "from each seeded request's own generator, which either method could use). The price: one random number per vocabulary entry per row, where a "
         "cumulative-sum lookup needs one per row.",
         f"It is the same distribution, not a flatter one: section 6 measured a total variation of {race_tv:.4f} "
         f"from the softmax, against {ref_tv:.4f} for torch.multinomial.",
         "Top-p is applied before the draw by zeroing probabilities; any exact sampler works after it."],
    ),
    Question(
        "What does temperature 0.5 do to a distribution?",
        ["Removes the tokens below 50%", "Squares the probability ratios: softmax(z / 0.5) makes "
         "likely tokens more likely, unlikely ones rarer, none impossible", "Halves every probability",
         "Makes sampling greedy half of the time"],
        1,
        [f"No token is removed by temperature: section 2 counted {KEPT[('uncertain', 'T=0.5')]:,} of {VOCAB:,} "
         "tokens kept at T=0.5.",
         "Right: dividing logits by 0.5 doubles their gaps, so p_i/p_j becomes (p_i/p_j)^2 before renormalising.",
         "Probabilities are renormalised after dividing the logits; they still sum to one.",
         "Temperature reshapes one distribution that is always sampled; greedy is only T = 0."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * say what the sampler receives (one fp32 logits row per sequence per step) and in which order
#   minivllm applies penalties, temperature, top-k, top-p and min-p, and how vLLM V1's order differs
#   (min-p before top-k/top-p);
# * predict what each filter keeps: temperature keeps every token, top-k a fixed count, top-p and
#   min-p a number that adapts to how sure the model is, and why top-p can keep a long tail on a
#   confident prediction;
# * compute what a temperature does to a distribution (`T = 0.5` squares the probabilities, then
#   renormalises);
# * make sampling reproducible with a per-request `seed`, and explain why in minivllm a seeded
#   request's tokens do not depend on the rest of the batch;
# * explain why `argmax p_i / E_i` with exponential `E_i` is an exact, sort-free draw, and test a
#   sampler with a chi-square goodness-of-fit test (which caught `argmax p_i * U_i`);
# * say how a CPU applies top-k (a partial selection) and top-p (buckets of log-probability) without
#   sorting the vocabulary, and why a sorted fp32 sum can move top-p's cut.
#
# Next: chapter 10 splits the model itself across processes.
