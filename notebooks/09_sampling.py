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
# # 09 · Sampling
#
# Every step, the model hands the engine one vector of scores (logits) per sequence, one score for
# each token in the vocabulary. Turning that vector into *one* token is the sampler's job, and the
# settings you pass in `SamplingParams` (temperature, top-k, top-p, min-p, seed) are instructions to
# it. In this chapter you take the logits the engine really produced for a prompt, reshape them with
# each setting and look at what survives; you check that a seeded request gets the same tokens
# whatever else shares its batch; and you test, with many draws, the trick the engine uses to draw
# a token without ever computing a cumulative sum.
#
# **You will:** read the model's real next-token distribution · see what temperature, top-k, top-p
# and min-p keep, on a confident and on an uncertain prediction · generate with each setting ·
# prove seeded sampling does not depend on the batch · verify the exponential race (Gumbel-max)
# samples from the softmax, and watch a plausible-looking wrong trick fail the same test.

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
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
SEED = 0                                   # engine-wide sampling seed

# %%
llm = LLM(MODEL, device=DEVICE, seed=SEED, num_kvcache_blocks=256, max_num_seqs=16)
engine = llm.llm_engine
tok = llm.get_tokenizer()
print(describe(llm))
print(f"torch threads: {torch.get_num_threads()}")


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

rows = []
for name, logits in LOGITS.items():
    p = torch.softmax(logits, -1)
    vals, idx = p.topk(10)
    ent_bits = entropy_bits(logits)
    rows.append({"prompt": name, "p(top 1)": float(vals[0]), "p(top 10) summed": float(vals.sum()),
                 "entropy (bits)": ent_bits, "tokens for 90% of the mass": int((p.sort(descending=True).values.cumsum(0) < 0.9).sum()) + 1})
pd.DataFrame(rows).set_index("prompt").round(3)

# %% [markdown]
# The confident prompt puts a large share of the probability on a handful of tokens; the uncertain
# one spreads it over many (higher entropy). Keep that difference in mind: the filters below treat
# the two very differently.
#
# ## 2. What each setting does to the distribution
#
# `SamplingParams` applies its filters in a fixed order (vLLM's): repetition penalty, then
# **temperature**, **top-k**, **top-p**, **min-p**, then one draw from what is left.
#
# * **temperature** `T` divides the logits before the softmax: `softmax(z / T)`. `T < 1` sharpens
#   the distribution (towards greedy), `T > 1` flattens it. `T = 0` is special-cased as greedy:
#   the argmax, no randomness.
# * **top-k** keeps the `k` most likely tokens, whatever their probabilities.
# * **top-p** (nucleus) keeps the smallest set of most likely tokens whose probability reaches `p`.
# * **min-p** keeps tokens whose probability is at least `min_p` times the most likely token's.
#
# The cell below runs the engine's own filter code (`minivllm.layers.sampler.filtered_probs`) on the
# real logits from above, one `SamplingParams` at a time, and counts the tokens that keep a non-zero
# probability.

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
print(f"{'greedy (T=0)':22s}" + "".join(f"{1:>28d}" for _ in LOGITS))

# %% [markdown]
# Temperature alone never removes a token: every probability stays above zero, only their sizes
# change. Top-k keeps exactly `k` tokens on both prompts, even where the confident prompt's tenth
# token is negligible or the uncertain prompt has many more reasonable choices. Top-p and min-p
# *adapt*: they keep few tokens when the model is sure and many when it is not. That is why they
# are the usual choice for open-ended text. They adapt differently, too: look at the confident prompt
# in the table. Top-p must collect 90% of the mass, and the last part of it is spread thinly over a
# long tail, so it can still keep many tokens; min-p keeps only the tokens within a factor of
# `1 / min_p` of the favourite, however the tail is spread.
#
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
fig.update_layout(height=560, title=f"Next-token probabilities after {PROMPTS[name]!r}, measured "
                  f"({engine.source.name}, {engine.config.device})")
show_figure(fig)

# %% [markdown]
# ## 3. The same settings, generating text
#
# Now through the engine end to end: each setting generates 12 tokens for the same prompt, three
# times. Greedy must give the same text every time. The sampled runs carry seeds 1, 2 and 3, so
# they are reproducible too (more on seeds in section 5); without a seed they would differ on every
# run.

# %%
# NBVAL_CHECK_OUTPUT
PROMPT = PROMPTS["uncertain"]
RUNS = {"greedy": dict(temperature=0.0), "T=0.7": dict(temperature=0.7), "T=1.3": dict(temperature=1.3),
        "top_k=10": dict(top_k=10), "top_p=0.9": dict(top_p=0.9), "min_p=0.1": dict(min_p=0.1)}
requests, params = [], []
for label, kw in RUNS.items():
    for seed in (1, 2, 3):
        requests.append(PROMPT)
        params.append(SamplingParams(max_tokens=12, ignore_eos=True, seed=seed, **kw))
outs = llm.generate(requests, params, use_tqdm=False)
for i, label in enumerate(RUNS):
    texts = [outs[3 * i + j].outputs[0].text for j in range(3)]
    print(f"{label:10s}", " || ".join(repr(t) for t in texts))

# %% [markdown]
# Greedy gives the same text every time. Low temperature stays closer to the likely tokens; high
# temperature wanders into rare ones (on a 4M-parameter model, quickly into nonsense). The filtered
# settings sample, but only among the tokens the previous section showed them keeping.

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
print(f"explorer, top_p=0.9 on {PROMPTS['confident']!r}: {explorer.kept} tokens kept "
      f"(section 2 counted {int((PROBS[('confident', 'top_p=0.9')] > 0).sum())})")

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
# requests around it (a greedy one, unseeded ones, other seeds, other filters, and a longer prompt
# that forces mixed prefill/decode steps), added both before and after it.

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
crowd = llm.generate(batch_prompts, batch_params, use_tqdm=False)
in_batch = crowd[3].outputs[0].token_ids

print("A alone     :", alone)
print("A in a batch:", in_batch)
print("identical   :", alone == in_batch)
other_seed = crowd[batch_params.index(others[4][1])].outputs[0].token_ids
print("same prompt and settings, seed 99 instead of 1234: shares", sum(a == b for a, b in zip(alone, other_seed)),
      "of 24 positions with A")
no_seed = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
no_seed_alone = llm.generate(PROMPT, no_seed, use_tqdm=False)[0].outputs[0].token_ids
no_seed_batch = crowd[4].outputs[0].token_ids
print("A without a seed, alone vs in the batch: shares", sum(a == b for a, b in zip(no_seed_alone, no_seed_batch)),
      "of 24 positions")

# %% [markdown]
# Request A's 24 tokens are identical alone and in a crowd of eight, while the same prompt and
# filters with another seed go elsewhere. A request *without* a seed draws from the engine-wide
# generator, whose numbers are handed out row by row to whoever is in the step, so its tokens do
# depend on the batch; that is fine for a request that asked for no reproducibility.
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
# Why the engine likes it: no sort and no cumulative sum (one elementwise divide and an argmax, which
# parallelise trivially on a GPU), and each row needs only its own noise, which is what makes
# per-request seeds independent of the batch (section 5).
#
# A proof is one thing; a measurement is another. Below, the engine's own `exponential_race` draws
# 100,000 tokens from the real distribution of the uncertain prompt under top-k 24, and a chi-square
# goodness-of-fit test compares the counts with the softmax probabilities. Tokens outside the top 24
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
print(f"{'torch.multinomial (reference)':27s} total variation {0.5 * float((ref.double() / N - q.double()).abs().sum()):.4f}")

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
fig.update_layout(title=f"{N:,} draws per sampler vs the softmax (top-{K} of the uncertain prompt)",
                  xaxis_title="token", yaxis_title="probability / frequency", height=440,
                  xaxis_tickangle=-60, legend=dict(orientation="h", y=1.12))
show_figure(fig)

# %% [markdown]
# The engine's race lands on the grey bars, token by token; its total variation distance from the
# softmax is the size you get from `torch.multinomial`, i.e. pure sampling noise at this number of
# draws. The wrong trick over-picks the most likely token and starves the tail: multiplying by a
# uniform is not the same as dividing by an exponential, and with 100,000 draws the chi-square test
# has no trouble telling them apart.
#
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
         "Right: top-k keeps exactly k tokens; the 49 unlikely ones just share the remaining 3% (section 2 "
         "measured the same count on both prompts).",
         "Temperature changes the probabilities but not their order, and never sets any to zero, so the same "
         "50 tokens survive."],
    ),
    Question(
        "Two users send the same prompt with seed=42 to a server that batches requests. Do they get the same "
        "tokens?",
        ["Only if they land in the same batch", "Yes: each seeded request has its own generator, so its noise "
         "does not depend on the batch", "No: batching always changes the random numbers",
         "Only with temperature 0"],
        1,
        ["Section 5 measured the opposite: the same seeded request alone and in a batch of eight gave identical "
         "tokens.",
         "Right: the noise for a seeded row comes only from that request's generator, seeded with 42 the first "
         "time it samples.",
         "That holds for requests without a seed (they share the engine-wide stream), not for seeded ones.",
         "Greedy needs no random numbers at all; the question is about sampling with a seed."],
    ),
    Question(
        "Why does the engine draw with argmax(p / E), E exponential, instead of a cumulative-sum lookup?",
        ["It is an approximation that is faster", "It is exact, needs no sort or cumulative sum, and each "
         "row uses only its own noise", "It samples more diverse tokens than the softmax",
         "It is needed for top-p"],
        1,
        ["It is not an approximation: the first of independent exponential clocks with rates p_i is j with "
         "probability p_j, and the chi-square test agreed.",
         "Right: an elementwise divide and an argmax, per row, which parallelises well and lets each request "
         "bring its own generator.",
         "Its frequencies matched the softmax within sampling noise; it is the same distribution, not a "
         "flatter one.",
         "Top-p is applied before the draw by zeroing probabilities; any exact sampler works after it."],
    ),
    Question(
        "What does temperature 0.5 do to a distribution?",
        ["Removes the tokens below 50%", "Squares the probability ratios: softmax(z / 0.5) makes "
         "likely tokens more likely, unlikely ones rarer, none impossible", "Halves every probability",
         "Makes sampling greedy half of the time"],
        1,
        ["No token is removed by temperature; the table in section 2 shows the full vocabulary kept at T=0.5.",
         "Right: dividing logits by 0.5 doubles their gaps, so p_i/p_j becomes (p_i/p_j)^2 before renormalising.",
         "Probabilities are renormalised after dividing the logits; they still sum to one.",
         "Temperature reshapes one distribution that is always sampled; greedy is only T = 0."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * The sampler sees one fp32 logits row per sequence per step; every setting in `SamplingParams`
#   reshapes that row before a single draw.
# * Temperature changes how peaked the distribution is but keeps every token; top-k keeps a fixed
#   count; top-p and min-p keep a number that adapts to how sure the model is.
# * Greedy (`temperature=0`) is deterministic; sampling is reproducible with a per-request `seed`, and
#   in minivllm a seeded request's tokens do not depend on the rest of the batch (checked above).
# * The engine draws with an exponential race, `argmax p_i / E_i`: exact (the measured frequencies
#   match the softmax to within sampling noise), sort-free, and per row. Not every argmax-of-noise
#   trick is exact: `argmax p_i * U_i` fails the same test.
#
# Next: chapter 10 splits the model itself across processes.
