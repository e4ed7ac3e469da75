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
# # 05 · The Scheduler
#
# **Goal:** see how the scheduler chooses, at every step, which sequences run, and measure what
# continuous batching and recompute preemption do to steps, throughput and outputs.
#
# **Prerequisites:** chapter 01 (prefill, then one token per step), chapter 03 (the KV cache) and
# chapter 04 (KV blocks and why paging lets more requests share memory).
#
# **Time:** about 35 minutes.
#
# An inference engine is a loop: each iteration (one `LLMEngine.step()`) runs one forward pass over a
# batch of sequences: a decoding sequence contributes one token and gets one more, a new prompt
# contributes its prompt tokens (or, when it is long, a chunk of them). The **scheduler** decides,
# every iteration, which sequences are in that batch and how many tokens each contributes. Two
# decisions matter most, and this chapter measures both on the real engine:
#
# * **When may a new request join?** Static batching waits until the whole batch has finished.
#   Continuous batching lets a waiting request take a free seat at the very next step.
# * **What if the KV cache runs out?** Sequences grow by one token per step; when no block is
#   free, the scheduler *preempts* a sequence (frees its blocks and recomputes it later) so the
#   others can continue.
#
# **You will:** predict how many engine steps static batching needs, then run the same workload with
# static and continuous batching and measure the throughput of each (and of Hugging Face `generate` on
# padded batches, same weights) and how long each request waits for its first and last token, then again on
# a memory-bound model · see seat
# occupancy step by step · squeeze the KV pool until the
# scheduler must preempt, watch it on the scheduler timeline, and check that the greedy output is unchanged ·
# change the number of seats and watch the two policies converge.

# %% [markdown]
# ## Setup
#
# `MODEL` is the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names another model. Every engine
# here has at most `SEATS = 4` sequences running at once (`max_num_seqs`), so the two batching
# policies compete with the same number of seats. A second limit is the step's token budget,
# `max_num_batched_tokens` (512 here): the tokens of all the sequences in one step together. Each step
# the scheduler first serves the running sequences (one decode token each, or the next chunk of a prompt
# already part-way through its prefill), then admits waiting prompts into the same step while the
# budget, the seats and the free KV blocks allow (a step that had to preempt admits none); a prompt longer than
# what is left of the budget is split into chunks over several steps (**chunked prefill**, on by
# default, as in vLLM's V1 engine). So a step can mix decodes with a prompt's prefill. The scheduler
# of nano-vllm (a minimal engine after vLLM's design, which minivllm is measured against) does not
# mix: its steps are prefill-only or decode-only. With this chapter's short prompts
# nothing is chunked (checked after each section's runs); chapter 07 measures what chunking does to
# latency.

# %% tags=["parameters"]
import os
import time

import pandas as pd
import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.bench import make_workload
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
SEATS = 4                                  # max_num_seqs: sequences in one batch at most

# %%
llm = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=256, max_num_seqs=SEATS,
          max_num_batched_tokens=512)
engine = llm.llm_engine
print(describe(llm))
print(f"torch threads: {torch.get_num_threads()}")


def setting(llm):
    """Model, device, dtype and threads of a live LLM: every chart title carries them."""
    cfg = llm.llm_engine.config
    return (f"{llm.llm_engine.source.name}, {cfg.device}, {str(cfg.dtype).replace('torch.', '')}, "
            f"{torch.get_num_threads()} thread(s)")

# %% [markdown]
# ## 1. A workload with uneven lengths
#
# Twelve requests of random token ids (seeded, so the workload is the same every run), prompts of
# 8 to 48 tokens. Like real chat traffic, most answers are short (4 to 12 tokens) and a few are long
# (a quarter of them, 40 to 48 tokens). Greedy decoding with `ignore_eos=True`, so every request
# generates exactly what it asked for. Uneven output lengths are what static batching handles badly.

# %%
# NBVAL_CHECK_OUTPUT
import random

work = make_workload("cpu", vocab_size=engine.vocab_size, num_requests=12, input_len=(8, 48),
                     output_len=(4, 12), seed=5)
rng = random.Random(5)
for i in rng.sample(range(work.num_requests), 3):    # a quarter of the answers are long
    work.output_lens[i] = rng.randint(40, 48)
print("prompt lengths:", [len(p) for p in work.prompts])
print("output lengths:", work.output_lens)
print(f"{work.num_requests} requests, {work.num_prompt_tokens} prompt tokens, {work.num_output_tokens} output tokens")

# %% [markdown]
# The driver below is all the engine needs: add requests, call `step()` until nothing is left, keep
# each step's `StepRecord` and each request's final output. *Static batching* is the same engine
# driven differently: add four requests, step until **all four** are done, only then add the next
# four. *Continuous batching* adds all twelve at once and lets the scheduler admit a waiting request
# whenever a seat frees up. Each policy runs three times, interleaved, and the fastest run of each
# is kept, its step records with it, so every figure below comes from the same run as its seconds: on
# a shared machine the slower runs measure the neighbours, not the engine.
#
# ### Exercise 1 · How many steps does static batching take?
#
# Static batching runs requests 0-3, then 4-7, then 8-11 (the output lengths are printed above). One
# engine step prefills a whole batch of four prompts and gives each its first token; every later step
# gives each unfinished request one more token. How many engine steps will the static run take in all?

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: engine steps of the static run (a whole number)

# %%
from dataclasses import dataclass

greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@dataclass
class Run:
    """One driven run of the twelve requests. Latencies count from the moment the driver got the whole
    workload (every request "arrives" then, whichever step its policy adds it in); lists in request order."""
    tokens: list        # greedy token ids per request
    records: list       # the run's StepRecords
    seconds: float      # wall time of the whole run
    ttft_ms: list       # per request: milliseconds until its first token
    e2e_ms: list        # per request: milliseconds until its last token (end-to-end latency)
    ttft_steps: list    # per request: engine steps until its first token (that step included)
    e2e_steps: list     # per request: engine steps until its last token


def run(batches, engine=None, work=None):
    """Add each group of request indices, step until the engine is idle, then add the next group
    (on this chapter's `engine` and `work` unless others are given)."""
    engine = globals()["engine"] if engine is None else engine
    work = globals()["work"] if work is None else work
    finished, first_step, last_step, records, added = {}, {}, {}, [], []
    t0 = time.perf_counter()
    try:
        for group in batches:
            for i in group:
                added.append(f"r{i}")
                engine.add_request(f"r{i}", work.prompts[i], greedy(work.output_lens[i]))
            while engine.has_unfinished_requests():
                result = engine.step_with_record()
                records.append(result.record)
                for out in result.outputs:  # every request that got a token this step
                    i = int(out.request_id[1:])
                    first_step.setdefault(i, len(records))
                    if out.finished:
                        finished[i], last_step[i] = out, len(records)
        seconds = time.perf_counter() - t0
    finally:  # after an interrupt (Kernel > Interrupt) too: nothing of this run stays queued
        for rid in added:
            engine.abort_request(rid)  # a finished request's id: nothing to do
        engine.reset_prefix_cache()  # so the next run starts from the same cold cache
    order = sorted(finished)
    outs = [finished[i] for i in order]  # metrics: timestamps on the perf_counter clock, as t0
    return Run([o.outputs[0].token_ids for o in outs], records, seconds,
               [(o.metrics.first_token_time - t0) * 1e3 for o in outs],
               [(o.metrics.finished_time - t0) * 1e3 for o in outs],
               [first_step[i] for i in order], [last_step[i] for i in order])


ids = list(range(work.num_requests))
static_batches = [ids[i:i + SEATS] for i in range(0, len(ids), SEATS)]
run([ids[:2]])  # warm-up (first calls allocate buffers)
REPEATS = 3     # each policy three times, interleaved; the fastest run counts (a shared machine has hiccups)
timed = {"static": [], "continuous": []}
for _ in range(REPEATS):
    timed["static"].append(run(static_batches))
    timed["continuous"].append(run([ids]))
# keep each policy's fastest run whole: its tokens, step records, seconds and latencies belong together
static_run = min(timed["static"], key=lambda r: r.seconds)
cont_run = min(timed["continuous"], key=lambda r: r.seconds)
static_tokens, static_steps, static_s = static_run.tokens, static_run.records, static_run.seconds
cont_tokens, cont_steps, cont_s = cont_run.tokens, cont_run.records, cont_run.seconds


# %%
# NBVAL_CHECK_OUTPUT
def occupancy(records):
    return sum(r.num_seqs for r in records) / (SEATS * len(records))


for name, records in (("static", static_steps), ("continuous", cont_steps)):
    print(f"{name:10s}: {len(records):4d} engine steps, seats in use {occupancy(records):.0%} on average")
print("same greedy tokens for every request:", static_tokens == cont_tokens)

# %%
from widgets import check_claim, check_prediction, render

check_prediction(my_prediction_1, len(static_steps), rel_tol=0, unit="steps", what="engine steps of the static run");
# a prefill chunk that stops short of the end of its prompt samples no token (ScheduledEntry.sampled)
prefills = lambda records: [e for r in records for e in r.scheduled if e.is_prefill]
chunks = lambda records: [e for e in prefills(records) if not e.sampled]
check_claim("no prompt was split into chunks: every prefill of both runs reached the end of its prompt",
            not chunks(static_steps + cont_steps),
            f"{len(prefills(static_steps + cont_steps))} prefills, {len(chunks(static_steps + cont_steps))} of them "
            "chunks");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# A static batch lasts as long as its longest request: its first step (the prefill) produces one token
# for every member, and each further step one more, so a batch whose longest output is `n` tokens takes
# `n` steps, however short its other members are. The total is the sum, over the three batches, of
# each batch's longest output length: read the three maxima off the printed output lengths and add
# them. The check above compares your sum with the steps the engine recorded; continuous batching
# needs fewer because a freed seat is refilled at the next step instead of idling until its batch ends.
# </details>

# %% [markdown]
# ### Exercise 2 · Fewer steps: how does throughput compare?
#
# You now know both step counts (printed above). Both runs produce the same output tokens. The cell
# below prints what a decode-only step of these runs cost with 1 and with 4 sequences, and how many
# sequences the steps of each run served in all. Suppose every step costs a fixed part `a` plus `b` for
# each sequence it serves, and draw that line through the two decode costs. Predict continuous
# batching's throughput (output tokens per second) divided by static batching's. (The check compares
# your figure with the measured ratio; the sentence under it works out the line's figure and says how
# far the measurement landed from it, and why where it misses.)

# %%
import statistics

decode_ms = {}
for r in static_steps + cont_steps:  # decode-only steps of the two fastest runs, by number of sequences
    if r.num_prefill_tokens == 0:
        decode_ms.setdefault(r.num_seqs, []).append(r.wall_ms)
d1, d4 = statistics.median(decode_ms[1]), statistics.median(decode_ms[SEATS])
served = {name: sum(r.num_seqs for r in records) for name, records in (("static", static_steps),
                                                                        ("continuous", cont_steps))}
print(f"median decode-only step: 1 sequence {d1:.3f} ms ({len(decode_ms[1])} steps), {SEATS} sequences "
      f"{d4:.3f} ms ({len(decode_ms[SEATS])} steps)")
print(f"sequences served, summed over the steps: static {served['static']} in {len(static_steps)} steps, "
      f"continuous {served['continuous']} in {len(cont_steps)} steps")

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: continuous / static output tokens per second (a ratio, x)

# %%
rows = []  # one row per policy, all figures from its fastest run; mean step ms = seconds / steps
for name, records, secs in (("static (engine, batches of 4)", static_steps, static_s),
                            ("continuous (engine, 4 seats)", cont_steps, cont_s)):
    rows.append({"policy": name, "steps": len(records), "ms": secs * 1e3,
                 "output tokens/s": work.num_output_tokens / secs,
                 "mean step ms": secs * 1e3 / len(records)})
pd.DataFrame(rows).set_index("policy").round(2)

# %%
fixed_share = (d1 - (d4 - d1) / (SEATS - 1)) / d1  # a step's cost as fixed + per sequence, through the two medians
split = {}  # per policy: (steps, ms) of the steps that carried prompt tokens, and of the decode-only steps
for name, records in (("static", static_steps), ("continuous", cont_steps)):
    with_prompt = [r.wall_ms for r in records if r.num_prefill_tokens]
    decode_only = [r.wall_ms for r in records if not r.num_prefill_tokens]
    split[name] = (len(with_prompt), sum(with_prompt), len(decode_only), sum(decode_only))
    print(f"{name:10s}: {len(with_prompt):3d} steps with prompt tokens {sum(with_prompt):6.1f} ms, "
          f"{len(decode_only):3d} decode-only steps {sum(decode_only):6.1f} ms")
render(f"Both runs computed the same tokens (checked above). Continuous batching needed **{len(cont_steps)}** "
       f"steps where static batching needed **{len(static_steps)}**, with seats in use "
       f"**{occupancy(cont_steps):.0%}** against **{occupancy(static_steps):.0%}** on average per step: static batching "
       f"spent many steps with seats empty, waiting for the longest request of its batch. The median decode step "
       f"with {SEATS} sequences took **{d4:.2f} ms**, with 1 sequence **{d1:.2f} ms** ({d4 / d1:.2f}x): "
       + (f"less than its seats' worth, because part of a step's cost (launching operations, bookkeeping and, on "
          f"larger models, reading the weights) is paid once per step, however many sequences it serves (chapter "
          f"06). Drawn as a line through these two medians, that fixed part is **{fixed_share:.0%}** of a "
          f"1-sequence step here."
          if fixed_share > 0 else
          "no less than its seats' worth on this run, so no part of the step looked fixed (a busy machine can "
          "slow single steps; run the cell again)."))
check_claim(f"a decode step with {SEATS} sequences costs less than {SEATS} steps with 1 (its seats' worth)",
            d4 < SEATS * d1,
            f"median {d4:.3f} ms vs {SEATS} x {d1:.3f} = {SEATS * d1:.3f} ms, over {len(decode_ms[SEATS])} and "
            f"{len(decode_ms[1])} steps",
            why_it_may_not="On a busy machine single steps can be slowed by neighbours; a model large enough "
                           "to be compute-bound also breaks it.");
check_prediction(my_prediction_2, static_s / cont_s, rel_tol=0.35, unit="x",
                 what="continuous / static throughput");
# the line through the two decode costs: b a sequence, a a step (each at least 0: noise can tilt the line)
per_seq = min(max(0.0, (d4 - d1) / (SEATS - 1)), d1)
per_step = d1 - per_seq
line = ((len(static_steps) * per_step + served["static"] * per_seq)
        / (len(cont_steps) * per_step + served["continuous"] * per_seq))
render(f"The line through the two decode costs (a = {per_step:.3f} ms a step, b = {per_seq:.3f} ms a sequence) "
       f"predicts **{line:.2f}x**; measured: **{static_s / cont_s:.2f}x**, the line "
       f"{abs(line / (static_s / cont_s) - 1):.0%} {'above' if line > static_s / cont_s else 'below'} it."
       + (" What the line leaves out is the steps that carried prompt tokens (the split by kind of step)."
          if line > static_s / cont_s else ""))
spread = {k: (min(r.seconds for r in v) * 1e3, max(r.seconds for r in v) * 1e3) for k, v in timed.items()}
gain = static_s / cont_s
check_claim("continuous batching's throughput gain is smaller than its step ratio",
            gain < len(static_steps) / len(cont_steps),
            f"throughput {gain:.2f}x (fastest runs), steps {len(static_steps) / len(cont_steps):.2f}x",
            why_it_may_not="Each policy's fastest of a few short runs is compared; on a loaded machine noise can "
                           "exceed the difference.");


def all_runs_won(runs_by_policy):
    """The policy each of whose runs was faster than every run of the other, or None where they overlap."""
    fastest = {k: min(r.seconds for r in v) for k, v in runs_by_policy.items()}
    slowest = {k: max(r.seconds for r in v) for k, v in runs_by_policy.items()}
    return ("continuous" if slowest["continuous"] < fastest["static"] else
            "static" if slowest["static"] < fastest["continuous"] else None)


separated = all_runs_won(timed)
(ps_n, ps_ms, ds_n, ds_ms), (pc_n, pc_ms, dc_n, dc_ms) = split["static"], split["continuous"]
split_text = (f"Split by kind of step (printed above): continuous batching's {dc_n} decode-only steps took "
              f"**{abs(ds_ms - dc_ms):.1f} ms {'less' if dc_ms < ds_ms else 'more'}** than static batching's {ds_n}, "
              f"while its {pc_n} steps that carried prompt tokens took **{abs(pc_ms - ps_ms):.1f} ms "
              f"{'more' if pc_ms > ps_ms else 'less'}** than static batching's {ps_n}: the same prompt tokens"
              + (", but continuous batching prefills newcomers as seats free up, spread over more steps that also "
                 "carry the running sequences' decodes, where static batching prefills a whole batch of prompts in "
                 "one step. Each extra step pays a step's fixed cost again, a prefill of a few prompts' rows usually "
                 "gets less arithmetic done per millisecond than one of a whole batch's, and the decodes riding in a "
                 "step with prompt tokens run eagerly, where a decode-only step can replay a recorded graph "
                 "(chapter 11). "
                 if pc_ms > ps_ms and pc_n > ps_n else
                 f", spread over {pc_n} steps against {ps_n}; on this run that did not cost the prompts extra time. "
                 if pc_ms <= ps_ms else ". "))
render(f"Throughput: continuous batching **{gain:.2f}x** static batching's (fastest of {REPEATS} runs each; "
       f"continuous {spread['continuous'][0]:.0f}-{spread['continuous'][1]:.0f} ms, static "
       f"{spread['static'][0]:.0f}-{spread['static'][1]:.0f} ms). "
       + ("Every continuous run beat every static run, so the gain is larger than this machine's run-to-run noise. "
          if separated == "continuous" else
          "Every static run beat every continuous run: on this run continuous batching was slower, by more than "
          "this machine's run-to-run noise. " if separated == "static" else
          "The two policies' runs overlap, so on this run the difference is within the noise. ")
       + split_text
       + "How much continuous batching pays depends on how little an extra sequence adds to a step: the end "
         "of this section runs both policies on a model where it adds little, and chapter 07 measures it "
         "against the batch size.");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# With the line: `b = (d4 - d1) / 3` per sequence and `a = d1 - b` per step. Each run then costs
# `steps x a + sequences served x b`, and the ratio is
# `(static steps x a + static served x b) / (continuous steps x a + continuous served x b)`. Both runs
# serve about the same sequences (every request needs its tokens either way), so only the `a` part
# shrinks with the steps: the larger `b` is against `a`, the less of the step ratio is left. The sentence
# after the check works it out for this run and says how far the measurement landed from it.
#
# If every step cost the same, the time would be proportional to the number of steps, and the gain
# would equal the ratio of static to continuous steps. Two things pull the measured gain below that.
# Steps are not equally expensive: continuous batching's steps carry more sequences on average (its
# seat occupancy is higher), and a step with more sequences costs no less, usually more (the
# 4-sequence against 1-sequence decode step ratio printed with the check; the table's `mean step ms`,
# seconds over steps of the same run, compares whole runs). And the prompts' prefill is the same number
# of tokens in both runs but not the same time: continuous batching prefills newcomers a few at a time,
# in more steps that also carry the running sequences' decodes, and each of those steps pays a step's
# fixed cost again (the split by kind of step, printed and rendered above, shows what the steps that
# carried prompt tokens cost under each policy on this run). So expect a gain smaller than the step ratio, and
# on a model whose step cost grows quickly with its sequences, possibly none; the table above, the
# check and the sentence after it give this run's figures.
# </details>

# %% [markdown]
# ### What each request waits for
#
# Throughput is the operator's view: tokens per second over the whole run. A user sees their own request:
# how long until its first token (TTFT) and until its answer is complete (end-to-end latency). All twelve
# requests were handed to the driver at once, so each one's clock starts there, also for the requests static
# batching only adds to the engine when an earlier batch has finished. Latency is counted two ways, from the
# same fastest runs as the table above: in engine steps (the schedule alone, the same on every machine) and in
# milliseconds (each request's `RequestOutput.metrics` timestamps: the schedule times what each step cost here).

# %%
from IPython.display import display

lat_rows = {}
for name, r in (("static", static_run), ("continuous", cont_run)):
    lat_rows[name] = {"mean TTFT steps": statistics.mean(r.ttft_steps), "mean latency steps": statistics.mean(r.e2e_steps),
                      "mean TTFT ms": statistics.mean(r.ttft_ms), "mean latency ms": statistics.mean(r.e2e_ms),
                      "max latency ms": max(r.e2e_ms)}
lat = pd.DataFrame(lat_rows).T
lat.index.name = "policy (fastest run)"
display(lat.round(1))
x = {col: lat.loc["static", col] / lat.loc["continuous", col] for col in lat.columns}  # static / continuous
render(f"Counted in steps, continuous batching gave a request its first token after **{lat.loc['continuous', 'mean TTFT steps']:.1f}** "
       f"steps on average against **{lat.loc['static', 'mean TTFT steps']:.1f}** (static batching: **{x['mean TTFT steps']:.2f}x** "
       f"as many), and its last after **{lat.loc['continuous', 'mean latency steps']:.1f}** against "
       f"**{lat.loc['static', 'mean latency steps']:.1f}** (**{x['mean latency steps']:.2f}x** as many): static batching makes a waiting request sit out every earlier batch to its "
       f"longest answer (requests {static_batches[-1][0]}-{static_batches[-1][-1]} start only after {len(static_batches) - 1} of them), however "
       f"short its own answer, where continuous batching gives it the next free seat.")
check_claim("continuous batching's mean end-to-end latency in engine steps is lower than static batching's",
            x["mean latency steps"] > 1, f"{lat.loc['continuous', 'mean latency steps']:.1f} vs "
            f"{lat.loc['static', 'mean latency steps']:.1f} steps, mean over {work.num_requests} requests");
# the direction over every run of each policy, not the fastest runs' one difference: a side only where the runs separate
def side(metric, what):
    per_run = {k: [statistics.mean(getattr(r, metric)) for r in v] for k, v in timed.items()}
    if max(per_run["continuous"]) < min(per_run["static"]):
        return f"saved time to {what} (every continuous run below every static one)"
    if min(per_run["continuous"]) > max(per_run["static"]):
        return f"cost time to {what} (every continuous run above every static one)"
    return f"made no difference to {what} beyond the runs' spread (they overlap)"


over_runs = (f"Over all {REPEATS} runs of each policy (mean over the requests, run by run), continuous batching "
             f"{side('ttft_ms', 'the first token')} and {side('e2e_ms', 'the whole answer')}. ")
render(f"In milliseconds the mean latency was **{lat.loc['continuous', 'mean latency ms']:.1f} ms** with continuous batching "
       f"against **{lat.loc['static', 'mean latency ms']:.1f} ms** with static batching ("
       + (f"**{x['mean latency ms']:.2f}x shorter**" if x["mean latency ms"] >= 1 else
          f"**{1 / x['mean latency ms']:.2f}x longer**")
       + f" with continuous batching; mean "
       f"TTFT {lat.loc['continuous', 'mean TTFT ms']:.1f} against {lat.loc['static', 'mean TTFT ms']:.1f} ms). "
       + over_runs
       + f"Steps are not equally expensive: continuous batching's steps are fuller, and a decode step with {SEATS} sequences "
       f"cost **{d4 / d1:.2f}x** one with 1 here (above), while static batching finishes each batch with a tail of cheap "
       f"steps of one or two long answers. The nearer that ratio is to 1 (a step that is mostly a fixed cost, like the "
       f"weight read of a memory-bound decode on a real model, chapter 06), the more the milliseconds follow the steps; "
       f"the nearer it is to {SEATS}, the less a fuller step saves. And the steps that carry prompt tokens cost the most: "
       f"continuous batching admits a request whenever a seat frees, so its prompts came in **{split['continuous'][0]}** "
       f"such steps ({split['continuous'][1]:.1f} ms) against static batching's **{split['static'][0]}** "
       f"({split['static'][1]:.1f} ms).");

# %% [markdown]
# The chart shows the seats in use at every step:

# %%
import plotly.graph_objects as go

from widgets import show_figure

fig = go.Figure()
for name, records, colour in (("static", static_steps, "#e45756"), ("continuous", cont_steps, "#4c78a8")):
    fig.add_scatter(x=list(range(len(records))), y=[r.num_seqs for r in records], mode="lines",
                    line=dict(color=colour, shape="hv"), name=f"{name}: {len(records)} steps")
fig.update_layout(title=f"Sequences in each engine step (StepRecord.num_seqs)<br><sub>{setting(llm)}</sub>",
                  xaxis_title="engine step", yaxis_title="sequences in the batch", yaxis_range=[0, SEATS + 0.5],
                  height=340)
show_figure(fig)

# %% [markdown]
# ### The classic static batcher: Hugging Face `generate`
#
# The engine emulation above is generous to static batching: a finished request stops costing
# compute even though its seat stays empty. A classic static batcher is stricter. Hugging Face
# `generate` pads the prompts of a batch to the same length and runs every row until the batch's
# longest output is done; the extra tokens are computed and thrown away. Here it runs the same
# twelve requests in batches of four, on the **same weights** (copied from the engine's model into
# a transformers `Qwen3ForCausalLM`); only the tokens each request asked for count as throughput.

# %%
import transformers

from minivllm.bench import load_hf_model, run_hf_generate

transformers.utils.logging.disable_progress_bar()
hf = load_hf_model(engine)
pad_id = min(engine.eos_token_ids, default=0)
run_hf_generate(hf, make_workload("cpu", vocab_size=engine.vocab_size, num_requests=2, input_len=(8, 16),
                                  output_len=(2, 4), seed=1), SEATS, pad_id, engine.config.device)  # warm-up
passes = [0]  # a forward hook counts the model's forward passes
hook = hf.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
try:
    hf_run = min((run_hf_generate(hf, work, SEATS, pad_id, engine.config.device) for _ in range(REPEATS)),
                 key=lambda r: r["seconds"])
finally:
    hook.remove()
computed = sum(len(b) * max(work.output_lens[i] for i in b) for b in static_batches)
hf_steps = passes[0] // REPEATS  # forward passes per run, counted
hf_entry = {"policy": "static (transformers generate, padded)", "steps": hf_steps, "ms": hf_run["seconds"] * 1e3,
          "output tokens/s": work.num_output_tokens / hf_run["seconds"],
          "mean step ms": hf_run["seconds"] * 1e3 / hf_steps}
table = pd.DataFrame(rows + [hf_entry]).set_index("policy")  # rows itself unchanged: this cell can run again
table["vs continuous"] = table["output tokens/s"] / table.loc["continuous (engine, 4 seats)", "output tokens/s"]
table.round(2)

# %%
same = sum(a == b for a, b in zip(hf_run["outputs"], cont_tokens))
print(f"transformers generate computed {computed} output tokens to deliver the {work.num_output_tokens} requested: "
      f"{1 - work.num_output_tokens / computed:.0%} of the output tokens it computed were thrown away")
print(f"greedy outputs identical to the engine's for {same} of {work.num_requests} requests")
static_row, hf_row = table.loc["static (engine, batches of 4)"], table.loc["static (transformers generate, padded)"]
per_step = hf_row["mean step ms"] / static_row["mean step ms"]
render(f"transformers ran **{hf_row['steps']:.0f}** forward passes per run (counted with a forward hook), "
       + ("as many as" if hf_row["steps"] == static_row["steps"] else "against")
       + f" the engine's static batches' **{static_row['steps']:.0f}** steps, each **{hf_row['mean step ms']:.2f} ms** "
       f"on average against **{static_row['mean step ms']:.2f} ms** (**{per_step:.2f}x**). "
       + (f"So padding explains little of it: a padded step costs at most what a full step of {SEATS} rows costs, "
          f"**{d4 / d1:.2f}x** a step of 1 here (above), far from {per_step:.2f}x; the rest of the difference per step is "
          "the implementations themselves, which this chapter does not take apart (chapter 11 measures what the "
          "engine's C kernels and recorded graphs save against eager PyTorch operations)." if per_step > 1.5 * (d4 / d1) else
          "Its throughput against the engine's static batches follows from those two figures; the padded rows' "
          "share of its work is printed above."));

# %% [markdown]
# (`steps` for transformers is its number of forward passes, counted: each batch runs to its longest
# output. Where an output differs from the engine's, the cause is floating-point rounding between two
# different implementations at a near-tie of the top two logits, not a different model; the
# engine's test suite, `tests/test_engine_vs_hf.py`, compares the two implementations directly.)
#
# ### Where continuous batching pays in milliseconds
#
# A saved step saves only the part of a step that is paid once: the part paid for each sequence is
# paid anyway, by whichever step serves it. On the tiny model the decode step with 4 sequences cost
# the ratio printed above against one with 1 (the comparison of the two policies turned it into the
# step's fixed share): the larger the per-sequence share of a step, the less time saving steps by
# filling seats saves. A decode step that is mostly one read of the weights from memory (chapter 06 measures that) should cost nearly the same with 4 sequences as
# with 1, so there nearly every step saved should be time saved; the next cell's last sentence says
# whether this run bears that out. The next cell
# runs both policies again on `random:qwen3-0.6b` (random weights at Qwen3-0.6B's shapes, the course's
# memory-bound model) with a shorter workload of the same kind: twelve requests, prompts of 4 to 8
# tokens, answers of 2 to 6 tokens and a quarter of them 16 to 20. Each policy runs three times,
# interleaved, the fastest run counting; on a CPU this is the chapter's slowest cell.

# %%
t_mem = time.perf_counter()
mem_llm = LLM("random:qwen3-0.6b", device=DEVICE, block_size=16, num_kvcache_blocks=64, max_num_seqs=SEATS,
              max_num_batched_tokens=512)
try:
    mem_engine = mem_llm.llm_engine
    mem_work = make_workload("cpu", vocab_size=mem_engine.vocab_size, num_requests=len(ids), input_len=(4, 8),
                             output_len=(2, 6), seed=5)
    rng = random.Random(5)
    for i in rng.sample(range(mem_work.num_requests), 3):  # a quarter of the answers are long, as before
        mem_work.output_lens[i] = rng.randint(16, 20)
    run([ids[:1]], mem_engine, mem_work)  # warm-up
    mem_timed = {"static": [], "continuous": []}
    for _ in range(REPEATS):
        mem_timed["static"].append(run(static_batches, mem_engine, mem_work))
        mem_timed["continuous"].append(run([ids], mem_engine, mem_work))
    mem_setting = setting(mem_llm)
    mem_weight_gb = (mem_engine.model_cost.body_weight_bytes + mem_engine.model_cost.lm_head_bytes) / 1e9
finally:
    mem_llm.shutdown()  # its weights and KV cache go back now: nothing below uses this engine
mem_static = min(mem_timed["static"], key=lambda r: r.seconds)
mem_cont = min(mem_timed["continuous"], key=lambda r: r.seconds)
mem_decode = {}
for r in mem_static.records + mem_cont.records:  # decode-only steps, by number of sequences
    if r.num_prefill_tokens == 0:
        mem_decode.setdefault(r.num_seqs, []).append(r.wall_ms)
m1, m4 = statistics.median(mem_decode[1]), statistics.median(mem_decode[SEATS])
mem_gain = mem_static.seconds / mem_cont.seconds
mem_steps = len(mem_static.records) / len(mem_cont.records)
mem_lat = statistics.mean(mem_static.e2e_ms) / statistics.mean(mem_cont.e2e_ms)
mem_won = all_runs_won(mem_timed)
print(f"{mem_setting}: {mem_weight_gb:.2f} GB of weights read by every step; "
      f"{mem_work.num_prompt_tokens} prompt and {mem_work.num_output_tokens} output tokens; "
      f"cell took {time.perf_counter() - t_mem:.0f} s")
print(f"static    : {len(mem_static.records):3d} steps, {mem_static.seconds * 1e3:7.0f} ms "
      f"(runs: {', '.join(f'{r.seconds * 1e3:.0f}' for r in mem_timed['static'])})")
print(f"continuous: {len(mem_cont.records):3d} steps, {mem_cont.seconds * 1e3:7.0f} ms "
      f"(runs: {', '.join(f'{r.seconds * 1e3:.0f}' for r in mem_timed['continuous'])})")
render(f"Here a decode step with {SEATS} sequences took **{m4:.1f} ms** against **{m1:.1f} ms** with 1 "
       f"(**{m4 / m1:.2f}x**, where the tiny model's was **{d4 / d1:.2f}x**). Static batching needed **{mem_steps:.2f}x** "
       f"as many steps ({len(mem_static.records)} against {len(mem_cont.records)}), and continuous batching's throughput "
       f"was **{mem_gain:.2f}x** static batching's (on the tiny model: {len(static_steps) / len(cont_steps):.2f}x as many "
       f"steps, {gain:.2f}x the throughput: of the step ratio, **{mem_gain / mem_steps:.0%}** became throughput here "
       f"against **{gain * len(cont_steps) / len(static_steps):.0%}** there); the mean "
       f"request's end-to-end latency was "
       + (f"**{mem_lat:.2f}x shorter**" if mem_lat >= 1 else f"**{1 / mem_lat:.2f}x longer**")
       + " with continuous batching. "
       + ("Every continuous run beat every static run, so the gain is larger than this machine's run-to-run noise; "
          if mem_won == "continuous" else
          "Every static run beat every continuous run, by more than this machine's run-to-run noise; "
          if mem_won == "static" else
          "The two policies' runs overlap, so on this run the difference is within the noise (other processes on "
          "the machine slow single runs: run the cell again when it is quieter); ")
       + ("the less an extra sequence adds to a step, the more of the steps saved is time saved."
          if mem_won == "continuous" and m4 / m1 < d4 / d1 and mem_gain / mem_steps > gain * len(cont_steps) / len(static_steps)
          else "this run does not show how the time saved follows the steps saved."))
check_claim("on the memory-bound model continuous batching gave the same greedy tokens and a higher throughput",
            mem_static.tokens == mem_cont.tokens and mem_gain > 1,
            f"tokens identical: {mem_static.tokens == mem_cont.tokens}; throughput {mem_gain:.2f}x; static batching "
            f"took {mem_steps:.2f}x as many steps",
            why_it_may_not=f"Each policy's fastest of {REPEATS} runs is compared; other processes on the machine can "
                           "slow one run by more than the difference.");

# %% [markdown]
# ## 2. Preemption: when the KV cache runs out
#
# A decoding sequence needs a new KV block every `block_size` tokens. The scheduler admits requests
# while their *prompts* fit, because how long each answer will be is unknown. So with a small pool
# the running sequences can outgrow it. When a running sequence needs a block and none is free, the
# scheduler **preempts** the most recently admitted running sequence: it releases that sequence's
# blocks, puts it back at the front of the waiting queue, and later **recomputes** it (its prompt
# plus the tokens it already generated, as one prefill) when blocks are free again. The tokens it
# already produced are kept; only their KV has to be rebuilt. With prefix caching on (the default),
# a released block keeps its contents until someone else takes it, so when the victim comes back
# its full blocks that survived are found in the prefix cache and only the rest is recomputed. Which
# ones survive follows from two rules of the block manager (`minivllm/engine/block_manager.py`): a
# sequence's blocks are released last block first, and a new block is taken from the free blocks
# released longest ago (a partly filled block, which the cache cannot serve, goes first of all). So the
# victim's last blocks are the first to be handed to the others, and what comes back, if anything, is
# the start of its sequence. (Chapter 08 is about the prefix cache itself.)
#
# Here four requests of 24 prompt tokens each ask for 40 tokens (the run's cell below prints the counts):
# each will need `ceil((24 + 40 - 1) / 16) = 4` blocks (the last token's KV is never stored, so 63
# slots), 16 in all, but the pool has only `POOL_BLOCKS = 10` blocks.

# %%
from widgets import EngineStepper, SchedulerTimeline

POOL_BLOCKS = 10
PRE_MAX_TOKENS = 40  # each request's output length
PRE_PROMPTS = make_workload("cpu", vocab_size=engine.vocab_size, num_requests=4, input_len=(24, 24),
                            output_len=(PRE_MAX_TOKENS, PRE_MAX_TOKENS), seed=11).prompts
if "big" in globals():  # run again: free the last run's engine first
    big.shutdown()
big = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=64, max_num_seqs=SEATS)

# %%
# NBVAL_CHECK_OUTPUT
# A new engine each time this cell runs (the last one shut down first), so a rerun prints the same steps.
if "tiny" in globals():
    tiny.shutdown()
tiny = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=POOL_BLOCKS, max_num_seqs=SEATS)
stepper = EngineStepper(tiny, show_chart=False)
timeline = SchedulerTimeline(stepper=stepper)  # redraws after every step of the stepper
rids = [stepper.add_request(p, max_tokens=PRE_MAX_TOKENS, ignore_eos=True) for p in PRE_PROMPTS]
need = [-(-(len(p) + PRE_MAX_TOKENS - 1) // 16) for p in PRE_PROMPTS]  # KV slots over 16-token blocks, rounded up
print(f"{len(PRE_PROMPTS)} requests of {sorted({len(p) for p in PRE_PROMPTS})} prompt tokens and {PRE_MAX_TOKENS} "
      f"output tokens each need {need} blocks, {sum(need)} in all; the pool has {POOL_BLOCKS}")
stepper.run_to_end()
pre_steps = stepper.steps
small_tokens = [stepper.sequence(r).output_token_ids for r in rids]
victims, resumes = set(), 0
for r in pre_steps:
    if r.preempted:
        victims.update(r.preempted)
        print(f"step {r.index:3d}: preempted {r.preempted}; KV blocks in use after the step: "
              f"{r.kv_blocks_used}/{POOL_BLOCKS}")
    for e in r.scheduled:
        if e.is_prefill and e.request_id in victims:
            resumes += 1
            print(f"step {r.index:3d}: {e.request_id} resumes: prefills positions {e.first_position}.."
                  f"{e.first_position + e.num_tokens - 1} ({e.first_position} tokens' KV found in the prefix cache)")
print("total steps:", len(pre_steps))

# %%
timeline.display()

# %% [markdown]
# That timeline is the record of a whole run. To watch one unfold, step it yourself: the same four
# requests on a pool of their own, again `POOL_BLOCKS` blocks. **Step** runs one engine step and the
# timeline under the stepper redraws; **Run to end** goes on to the end. Watch the KV blocks in use climb
# to the pool's size, then a request drop out and come back with its recompute. **Reset** empties the
# pool; the stepper's text box adds a request of your own.

# %% tags=["playground"]
if "hand" in globals():  # run again: free the last run's engine first
    hand.shutdown()
hand = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=POOL_BLOCKS, max_num_seqs=SEATS)
hand_stepper = EngineStepper(hand, show_chart=False)
hand_timeline = SchedulerTimeline(stepper=hand_stepper)
for prompt in PRE_PROMPTS:
    hand_stepper.add_request(prompt, max_tokens=PRE_MAX_TOKENS, ignore_eos=True)
hand_stepper.display()
hand_timeline.display()

# %% [markdown]
# Read the timeline row by row: a preempted request drops out (its blocks go to the others), waits,
# then comes back with one prefill step that rebuilds the KV of its prompt *and* of the tokens it had
# generated: the printout above shows how much of that came back from the prefix cache, and the next
# cell counts the tokens recomputed.
#
# Now the check that preemption changes the timing and not the result: the same four requests on a
# pool large enough that nobody is preempted, greedy, compared token by token.

# %%
# NBVAL_CHECK_OUTPUT
big_outs = big.generate(PRE_PROMPTS, greedy(PRE_MAX_TOKENS), use_tqdm=False)
big_tokens = [o.outputs[0].token_ids for o in big_outs]
for rid, a, b in zip(rids, small_tokens, big_tokens):
    print(f"{rid}: {PRE_MAX_TOKENS} greedy tokens identical with {POOL_BLOCKS} and with 64 KV blocks: {a == b}")
through = sum(r.num_tokens for r in pre_steps)
needed = sum(len(p) + PRE_MAX_TOKENS - 1 for p in PRE_PROMPTS)  # unpreempted: each prompt once, then one-token decodes
resumed = sum(r.num_prefill_tokens for r in pre_steps) - sum(len(p) for p in PRE_PROMPTS)
recomputed = through - needed
print(f"tokens through the model: {through}, against {needed} without preemption: {recomputed} recomputed because "
      f"of preemption")
print(f"(the {resumes} resumes prefilled {resumed} tokens; the last of each is the token its request was about to "
      f"decode, whose KV it never had: a decode step would have computed it anyway)")
tiny.llm_engine.check_invariants()

# %%
pre_ms = sum(r.wall_ms for r in pre_steps)
print(f"{POOL_BLOCKS} blocks: {len(pre_steps)} steps, {pre_ms:.0f} ms of steps; the price of preemption is the "
      f"{recomputed} recomputed tokens and the waiting")
check_claim("preemption changed no greedy token", small_tokens == big_tokens,
            f"{sum(a == b for a, b in zip(small_tokens, big_tokens))} of {len(rids)} requests identical, "
            f"{sum(len(r.preempted) for r in pre_steps)} preemptions");
check_claim("no prefill was split into chunks in this run either (resumes included)", not chunks(pre_steps),
            f"{len(prefills(pre_steps))} prefills, {len(chunks(pre_steps))} of them chunks");

# %% [markdown]
# The check above compares the greedy tokens of the two runs. Recomputing the KV is the same
# computation (same tokens, same positions, same weights), so the KV is equal up to floating-point
# rounding (a prefill and a run of decode steps group the arithmetic differently), and the greedy
# tokens match unless two top logits are within that rounding of each other; the check says whether
# they matched on this run. Preemption costs time (recomputed prefill tokens, and the preempted
# request waits), not correctness.
#
# Two other ways to handle a full pool exist. *Swapping* copies the victim's KV blocks to host memory
# and back instead of recomputing them (vLLM's V0 engine offered swapping and recomputation; its V1
# engine, like minivllm, recomputes, which needs no host memory and no copy machinery, and lets the
# prefix cache return whatever survived, as above). And *reserving* the
# worst case up front (`max_model_len` worth of blocks per request) never preempts but admits far
# fewer requests: chapter 04 measured that waste.

# %% [markdown]
# ## Playground
#
# `PLAY_SEATS` is the scheduler's `max_num_seqs`: how many sequences may run in one step. Change it
# (try 1, 2, 8, 12) and rerun: the cell replays the twelve requests with both policies on a fresh engine
# and counts steps and seat occupancy (no timing). Look at how the gap between the two policies
# changes: with one seat they are the same policy, and with twelve seats every request starts at once,
# so there is nothing left for continuous batching to refill.

# %% tags=["playground"]
PLAY_SEATS = 2  # max_num_seqs for this replay

play = LLM(MODEL, device=DEVICE, block_size=16, num_kvcache_blocks=256, max_num_seqs=PLAY_SEATS,
           max_num_batched_tokens=512)


def replay(groups):
    """Step counts and mean seat occupancy of a run that adds each group once the engine is idle."""
    eng, n_steps, seats_used = play.llm_engine, 0, 0
    for group in groups:
        for i in group:
            eng.add_request(f"p{i}", work.prompts[i], greedy(work.output_lens[i]))
        while eng.has_unfinished_requests():
            seats_used += eng.step_with_record().record.num_seqs
            n_steps += 1
    eng.reset_prefix_cache()
    return n_steps, seats_used / (PLAY_SEATS * n_steps)


for name, groups in (("static", [ids[i:i + PLAY_SEATS] for i in range(0, len(ids), PLAY_SEATS)]),
                     ("continuous", [ids])):
    n, occ = replay(groups)
    print(f"{PLAY_SEATS} seats, {name:10s}: {n:4d} steps, seats in use {occ:.0%} on average")
play.shutdown()

# %% [markdown]
# ## 3. Check yourself

# %%
from widgets import Question, Quiz

pre_match = "matched" if small_tokens == big_tokens else "did not match"  # section 2's check, for the quiz
Quiz([
    Question(
        "Four requests in a static batch ask for 5, 5, 5 and 100 tokens. What happens to three of the seats "
        "after step 5?",
        ["They are given to waiting requests", "They sit idle (or compute padding) until the 100-token request "
         "finishes", "The batch is split in two", "The long request is preempted"],
        1,
        ["That is continuous batching: it is exactly what static batching does not do.",
         "Right: the batch is fixed until its last member finishes; the occupancy chart above shows the "
         "staircase of empty seats.",
         "Static batching does not reshape a running batch; it just runs it to the end.",
         "Preemption is about KV memory, not about batch composition; nothing ran out here."],
    ),
    Question(
        f"Why did continuous batching finish the same work in {len(cont_steps)} engine steps, where static "
        f"batching took {len(static_steps)}?",
        ["Its steps generate several tokens per sequence", "It fills freed seats at once, so each step "
         "produces more tokens",
         "It skips the prefill of some requests", "It uses a smaller model"],
        1,
        ["Every decode step still gives each sequence one token; the gain is in how many sequences are in it.",
         "Right: same tokens, same seats, but fewer steps with empty seats; measured occupancy shows it. (And "
         + (f"a fuller step costs less than its seats' worth of small steps: a {SEATS}-sequence decode step cost "
            f"{d4 / d1:.2f}x a 1-sequence step here, not {SEATS}x.)" if d4 / d1 < SEATS else
            f"on this run a {SEATS}-sequence decode step cost {d4 / d1:.2f}x a 1-sequence step, no less than its "
            f"seats' worth: the check above says so.)"),
         "Every prompt was prefilled in both runs (the tokens are identical, so the KV must have been computed).",
         "Same engine, same weights; only the driving policy changed."],
    ),
    Question(
        "A request is preempted after generating 30 tokens. When it resumes, what does the engine compute?",
        ["Nothing: its KV was kept in GPU memory", "The KV of its prompt and its 30 generated tokens, in one prefill "
         "(less whatever the prefix cache still holds), then it continues decoding", "It starts again from scratch and generates different tokens",
         "Only the 30 generated tokens"],
        1,
        ["Preemption exists precisely to free those blocks for others; minivllm releases them.",
         "Right: recompute preemption rebuilds the KV of everything the sequence had (whatever the prefix "
         "cache still holds is reused, the rest is recomputed), then continues; its greedy output "
         f"{pre_match} the large-pool run's on this run (checked above).",
         "Its generated tokens are kept, not regenerated; the check above compared the greedy output with the "
         "large-pool run's token for token.",
         "The prompt's blocks were released too, and attention needs their KV: whatever the prefix cache "
         "still holds is reused, the rest of the prompt is recomputed with the generated tokens."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * explain what the scheduler decides at every step: which sequences run, and how many tokens each
#   contributes, within three limits (`max_num_seqs`, `max_num_batched_tokens`, the KV pool);
# * count the steps a static batch needs from its longest output, and explain why continuous batching,
#   which refills a freed seat at the next step, needs fewer;
# * measure the throughput of both policies (and of padded `generate`), say why the gain is smaller
#   than the step ratio, and why it is larger on a model whose decode step is mostly a weight read;
# * measure what each request waits for (TTFT and end-to-end latency, from the moment the workload
#   arrives) and explain why continuous batching shortens it in engine steps, and when those steps saved are
#   also time saved;
# * explain recompute preemption: why the scheduler can run out of KV blocks mid-decode, what a
#   preempted request recomputes when it resumes (and what the prefix cache gives back), and why its
#   greedy output is unchanged;
# * read a run's `StepRecord`s (each step's sequences, prefill and decode tokens, preemptions and KV
#   blocks in use) to follow what the scheduler did, step by step.
#
# Next: chapter 06 looks inside one step at why prefill and decode cost so differently.
