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
# # 12 · Benchmarks: measuring the whole engine
#
# **Goal:** run a benchmark whose number means something: the same workload through minivllm and a
# peer on the same machine, with latency distributions and each step placed on this machine's
# measured roofline, and know how to compare it with nano-vllm's published benchmark.
#
# **Prerequisites:** chapter 05 (continuous batching, the token budget), 06 (arithmetic intensity,
# the roofline, MFU and MBU) and 07 (TTFT and TPOT).
#
# **Time:** about 35 minutes (reading and running).
#
# Every earlier chapter measured one mechanism. A benchmark measures the engine as a user meets
# it: a batch of requests in, tokens out, and a number to compare. The number only means something
# beside a **peer run on the same machine, model, prompts and output lengths**, and beside the
# latencies each request saw. minivllm's harness (`minivllm/bench/`, `python -m minivllm bench`)
# does exactly that; this notebook runs it inline and reads what it prints.
#
# **You will:** run the harness on a small workload and read its report · measure minivllm's
# throughput against Hugging Face transformers' `generate` and check the greedy outputs agree ·
# look at the distribution of TTFT and TPOT over every request, not just their averages · put this
# machine's measured steps on its measured roofline · get the command that reproduces nano-vllm's
# benchmark workload on a GPU.

# %% [markdown]
# ## Setup
#
# `BIG` is the random-weight model at Qwen3-0.6B's shapes (section 4 prints what its weights weigh
# in the dtype they are held in), used for the roofline section: the embedded model is small (chapter 02
# counts its layers and parameters): its steps carry fixed costs a real model amortises, and its few MB of weights
# can sit in a CPU's last-level cache (chapter 07 measures that on its run), so it cannot show where a real model's
# steps sit.

# %% tags=["parameters"]
import os

# Threads that finish their share of an operation early spin, by default, waiting for the next
# one. On a machine shared with other busy processes that spinning steals the cores the other
# threads need, and small steps get many times slower. PASSIVE lets waiting threads sleep; it is
# read when torch loads its OpenMP runtime, so it must be set before `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import statistics

import pandas as pd
import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import describe
from widgets import check_claim, check_prediction, idle_engine, render

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
BIG = "random:qwen3-0.6b"                  # for the roofline: a model of real size

# %%
llm = LLM(MODEL, device=DEVICE, max_num_seqs=32, max_num_batched_tokens=256)
engine = llm.llm_engine
print(describe(llm))
print(f"token budget per step {engine.config.max_num_batched_tokens}, at most {engine.config.args.max_num_seqs} "
      f"sequences per step, KV pool {engine.config.num_kv_blocks} blocks of {engine.config.block_size} tokens")

# %% [markdown]
# ## 1. The workload
#
# A benchmark workload fixes what is asked, so that two engines (or two versions of one) do the same
# work. The harness draws it reproducibly from a seed: prompts of random token ids, and for each
# request its own output length; generation is greedy and ignores end-of-sequence tokens, so every
# request produces exactly its number of tokens whatever the model says. Two presets exist: `nano`,
# nano-vllm's benchmark (256 requests, prompt and output lengths uniform in 100..1024), and `cpu`, a
# CPU-sized one. Here, a smaller cut of the `cpu` preset keeps the notebook quick:

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.bench import WORKLOADS, make_workload

print("presets:", WORKLOADS)
wl = make_workload("cpu", engine.vocab_size, num_requests=16, input_len=(16, 128), output_len=(8, 64), seed=0)
print(wl.describe())
print("first three requests: prompt lengths", [len(p) for p in wl.prompts[:3]], "output lengths", wl.output_lens[:3])

# %% [markdown]
# ## 2. The harness, inline
#
# `run_throughput` is what `python -m minivllm bench` calls. It builds its own engine, measures this
# machine's peak matmul FLOP/s and memory bandwidth (a copy and a read; MFU and MBU are computed
# against the matmul and the **read** figure), warms each engine up off the clock (the workload's
# prompt lengths with two output tokens each), runs the workload with a utilisation sampler
# alongside, then runs the **same prompts with the same weights** through transformers `generate`
# (padded batches) in the same process. While it runs it prints the peaks and the throughput table
# (seconds, requests and tokens per second, and the ratio); `print_throughput`, which the command
# line calls next, prints the rest of the report: latency percentiles, the roofline over the run,
# where the step time went ("time in steps"), CPU or GPU utilisation, and whether the greedy
# outputs are identical.

# %%
from minivllm.bench import run_throughput
from minivllm.bench.report import print_throughput

result = run_throughput(MODEL, workload=wl, peers=("hf_generate",), device=DEVICE, max_num_seqs=32)
print_throughput(result)
h = result["minivllm"]
print(f"the harness's engine: a token budget of {h['max_num_batched_tokens']} per step and at most "
      f"{h['max_num_seqs']} sequences; {h['num_prefill_steps']} of its {h['num_steps']} steps carried prompt tokens")
check_claim("every prompt fit in the harness engine's first step (section 3 refers to it)", h["num_prefill_steps"] == 1,
            f"{wl.num_prompt_tokens} prompt tokens, a budget of {h['max_num_batched_tokens']}");

# %%
import plotly.graph_objects as go

from widgets import show_figure

mine, peer = result["minivllm"], result["peers"]["hf_generate"]
rows = [{"engine": "minivllm", "seconds": mine["seconds"], "output tok/s": mine["output_tokens_per_s"],
         "total tok/s": mine["total_tokens_per_s"]}]
if peer.get("available"):
    rows.append({"engine": peer["label"], "seconds": peer["seconds"], "output tok/s": peer["output_tokens_per_s"],
                 "total tok/s": peer["total_tokens_per_s"]})
table = pd.DataFrame(rows).set_index("engine")
# device (with CPU threads), model, dtype: in every chart's title
CHART_CONTEXT = f"{result['device']}, model {engine.source.name}, {str(engine.config.dtype).removeprefix('torch.')}"
WORKLOAD_NOTE = f"{wl.num_requests} requests, {wl.num_output_tokens} output tokens"
fig = go.Figure(go.Bar(x=table.index, y=table["output tok/s"], marker_color=["#4c78a8", "#9c755f"][:len(table)],
                       text=[f"{v:.0f}" for v in table["output tok/s"]], textposition="outside"))
fig.update_layout(title=f"Output tokens per second, same workload and weights<br><sup>{CHART_CONTEXT}</sup>"
                        f"<br><sup>{WORKLOAD_NOTE}, one timed run each</sup>",
                  xaxis_title="engine", yaxis_title="output tokens / s", height=380, margin=dict(t=100))
show_figure(fig)
if peer.get("available"):
    print(f"minivllm / transformers generate: {peer['speedup']:.2f}x; greedy outputs identical in "
          f"{peer['agreement']['identical_requests']} of {peer['agreement']['num_requests']} requests")
    # generate runs each batch of requests until its longest one is done: one forward pass per token of that one
    bs, outs_ = peer["batch_size"], wl.output_lens
    batches = [outs_[i:i + bs] for i in range(0, len(outs_), bs)]
    hf_passes, hf_rows = sum(max(b) for b in batches), sum(len(b) * max(b) for b in batches)
    render(f"minivllm ran **{mine['num_steps']} engine steps**, {mine['seconds'] / mine['num_steps'] * 1e3:.2f} ms each "
           f"on average; `generate` ran **{hf_passes} forward passes** ({len(batches)} batch{'es' if len(batches) > 1 else ''} "
           f"of up to {bs} requests, each until its longest request's last token), "
           f"{peer['seconds'] / hf_passes * 1e3:.2f} ms each, and computed {hf_rows} output tokens for the "
           f"{wl.num_output_tokens} the workload asked for.")
table.round(2)

# %% [markdown]
# How to read the ratio. `generate` runs each padded batch until its **longest** request is done: the
# shortest request rides along, computing padding, until the longest one finishes, and no new request
# can take its place. minivllm schedules per step: a finished request leaves at
# once and costs nothing more, its KV blocks go back to the pool, and when more requests wait than
# a step can hold, a waiting one takes its slot (continuous batching, chapter 05; in this workload
# every request fits in the first batch, so none waits). The padding a batch of `generate` computes is,
# summed over its requests, how many tokens each is short of the batch's longest, so it grows with the
# spread of the output lengths (and `generate` pads the prompts to the longest too); this notebook
# measures one workload.
#
# Padding is not the only difference. The line under the chart counts the forward passes each engine
# made and what one cost on average. When every request sits in one batch of `generate` and every
# prompt fits in minivllm's first step, the two make about the same number of passes (one per token of
# the longest request), and the ratio is then the ratio of what one pass costs: `generate`'s passes carry
# the padded rows and run transformers' model operation by operation in PyTorch, minivllm's carry only
# the requests still running, through its own kernels (on a CPU, the C calls of chapter 11); the
# report's "time in steps" line shows where minivllm's time went. Scale the workload up (`--scale`,
# `--num-requests`) or use a real model to see other regimes. The ratio printed above is the one
# measured here, nothing else.
#
# ### One run is one sample
#
# The harness timed each engine once. On a machine shared with other processes one run can land in a
# slow moment for either engine, so a single ratio says little about the next one. The cell below
# runs the same harness, same workload, twice more (its printing switched off) and puts the three
# ratios side by side; `python -m minivllm bench` run several times does the same from a shell.

# %%
extra = [run_throughput(MODEL, workload=wl, peers=("hf_generate",), device=DEVICE, max_num_seqs=32,
                        log=lambda *a, **k: None) for _ in range(2)]
ratios = [r["peers"]["hf_generate"]["speedup"] for r in (result, *extra) if r["peers"]["hf_generate"].get("available")]
if len(ratios) == 3:
    spread = max(ratios) / min(ratios)
    render("Three runs of the harness: minivllm / transformers `generate` = "
           + ", ".join(f"**{x:.2f}x**" for x in ratios)
           + " (minivllm " + ", ".join(f"{r['minivllm']['seconds']:.2f}" for r in (result, *extra)) + " s; transformers "
           + ", ".join(f"{r['peers']['hf_generate']['seconds']:.2f}" for r in (result, *extra))
           + f" s). Median **{statistics.median(ratios):.2f}x**; the largest ratio is {spread:.2f}x the smallest, "
           "so a difference between two engines smaller than that spread is not one a single run can show.")
else:
    print("transformers is not available here: no ratio to repeat")

# %% [markdown]
#
# ## 3. Latency: distributions, not averages
#
# Throughput says how fast the batch finished; users feel per-request latency. The harness reports
# percentiles (its ITL, inter-token latency, is the time between two consecutive tokens of one
# request, over every gap of every request; TPOT is a request's mean gap). Here is every request of the
# same workload on the notebook's engine, with the token budget per step set in the setup cell (the
# harness built an engine of its own, with the budget printed under its report: there every prompt fit
# in its first step, so every request's first token came from that one step), with its TTFT (time to first token) and
# TPOT (mean time per output token after the first).
#
# ### Exercise 1 · How many steps until everyone has a first token?
#
# The sixteen requests' prompts hold the number of tokens printed in section 1 (`num_prompt_tokens`),
# and each engine step may carry at most the token budget printed in the setup cell. Predict how many
# engine steps carry prefill tokens before every request has its first token.

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: number of engine steps that carry prefill tokens (a count)

# %%
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
llm.generate(wl.prompts[:2], params[:2], use_tqdm=False)  # warm-up
# The workload once step by step, to count the steps that carry prefill tokens ...
idle_engine(engine)  # what an interrupted run of this cell left queued would join its steps
llm.reset_prefix_cache()  # no prompt finds its blocks cached from an earlier run
for i, (p, sp) in enumerate(zip(wl.prompts, params)):
    engine.add_request(f"count-{i}", {"prompt_token_ids": p}, sp)
step_records = []
while engine.has_unfinished_requests():
    step_records.append(engine.step_with_record().record)
prefill_steps = [r for r in step_records if r.num_prefill_tokens > 0]
print(f"{len(prefill_steps)} of {len(step_records)} steps carried prefill tokens; prefill tokens per step: "
      f"{[r.num_prefill_tokens for r in prefill_steps]}, decode tokens in the same steps: "
      f"{[r.num_decode_tokens for r in prefill_steps]}")
check_prediction(my_prediction_1, len(prefill_steps), rel_tol=0, unit="steps",
                 what="the number of steps carrying prefill tokens",
                 hint="The scheduler's count is exact: start from the prompts' tokens over the budget, rounded up, "
                      "then ask whether the decodes of the requests already running push the last prompt into one "
                      "more step (the printed per-step counts show it). Then open the solution.");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# The scheduler fills each step up to the token budget, first with the decodes of the requests already
# running (one token each), then with prompt tokens of the waiting requests in arrival order, chunking
# a prompt that does not fit (chapter 07). So the prompts need at least `num_prompt_tokens / budget`
# steps, rounded up; every request whose prompt is done starts decoding and takes one token of each
# later step's budget, which can push the last prompt's tokens into one more step. Compare that bound
# with the per-step prefill and decode token counts printed above, and see whether every step but the
# last was filled to the budget.
#
# </details>

# %% [markdown]
# ... and the workload again through `generate`, each request's latency from its `RequestOutput.metrics`:

# %%
idle_engine(llm)  # what an interrupted cell left queued would join these steps and their latencies
llm.reset_prefix_cache()
outs = llm.generate(wl.prompts, params, use_tqdm=False)
lat = pd.DataFrame({"request": range(len(outs)), "prompt_len": [len(p) for p in wl.prompts],
                    "output_len": wl.output_lens,
                    "ttft_ms": [o.metrics.ttft_ms for o in outs], "tpot_ms": [o.metrics.tpot_ms for o in outs],
                    "e2e_ms": [o.metrics.e2e_ms for o in outs]})
pct = lat[["ttft_ms", "tpot_ms", "e2e_ms"]].quantile([0.5, 0.9, 0.99]).rename(index=lambda q: f"p{round(q * 100)}")
pct.round(2)

# %%
from plotly.subplots import make_subplots

fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT per request", "TPOT per request",
                                                    "TTFT vs arrival order"))
fig.add_histogram(x=lat.ttft_ms, nbinsx=16, marker_color="#e4572e", name="TTFT", row=1, col=1)
fig.add_histogram(x=lat.tpot_ms, nbinsx=16, marker_color="#f0a202", name="TPOT", row=1, col=2)
fig.add_scatter(x=lat.request, y=lat.ttft_ms, mode="markers", marker=dict(color="#e4572e",
                size=6 + lat.prompt_len / 12), name="TTFT (marker size: prompt length)", row=1, col=3)
for col, key in ((1, "ttft_ms"), (2, "tpot_ms")):
    for q in ("p50", "p90"):
        fig.add_vline(x=pct.loc[q, key], line_dash="dot", annotation_text=q, row=1, col=col)
fig.update_xaxes(title_text="TTFT (ms)", row=1, col=1)
fig.update_xaxes(title_text="TPOT (ms)", row=1, col=2)
fig.update_xaxes(title_text="request index (all arrive at once)", row=1, col=3)
fig.update_yaxes(title_text="requests", row=1, col=1)
fig.update_yaxes(title_text="requests", row=1, col=2)
fig.update_yaxes(title_text="TTFT (ms)", row=1, col=3)
fig.update_layout(height=400, showlegend=False,
                  title=f"Latency of every request, {len(lat)} requests, token budget "
                        f"{engine.config.max_num_batched_tokens}<br><sup>{CHART_CONTEXT}</sup>")
show_figure(fig, width=1000)
print(f"TTFT spread: fastest {lat.ttft_ms.min():.1f} ms, slowest {lat.ttft_ms.max():.1f} ms; "
      f"TPOT spread: {lat.tpot_ms.min():.2f} to {lat.tpot_ms.max():.2f} ms")

# %%
rank_corr = lat.request.corr(lat.ttft_ms.rank())  # Pearson on ranks = Spearman's rank correlation
cv = {k: lat[k].std() / lat[k].mean() for k in ("ttft_ms", "tpot_ms")}
check_claim("requests that arrived together still got their first tokens at different times",
            lat.ttft_ms.max() > 1.5 * lat.ttft_ms.min(),
            f"TTFT {lat.ttft_ms.min():.1f} to {lat.ttft_ms.max():.1f} ms")
check_claim("TTFT rises with arrival order (the staircase)", rank_corr > 0.8,
            f"rank correlation of TTFT with request index {rank_corr:.2f}",
            why_it_may_not="Requests prefilled in the same step share one TTFT, up to the moment each was added.")
check_claim("TPOT varies less across requests than TTFT (relative spread)", cv["tpot_ms"] < cv["ttft_ms"],
            f"coefficient of variation: TPOT {cv['tpot_ms']:.2f}, TTFT {cv['ttft_ms']:.2f}",
            why_it_may_not="On a loaded machine a few slow steps can spread TPOT as much as the queue spreads TTFT.");

# %% [markdown]
# All the requests arrived at the same instant, and the checks above say what this run shows: the
# step's token budget (set in the setup cell) admits prompts in order, as many as fit per step, so
# later prompts wait for earlier prefills (the staircase on the right). With a budget larger than all
# the prompts together, every prompt would be prefilled in the first step and the TTFTs would be
# nearly equal, and that first step would be long (the playground below lets you try).
# TPOT depends on something else: each request's decode steps are shared with whoever else is running
# at that moment, so it follows how full the batch was during the request's life, and how many prefill
# tokens shared those steps (the first requests' early decodes ride in steps that also carry later
# prompts' chunks: the prefill and decode counts printed in Exercise 1). This is why serving
# systems quote p90 or p99 latencies: the mean hides the request that waited. A percentile needs
# enough requests behind it, though: with the 16 here, p99 is in effect the slowest request (pandas
# interpolates between the two slowest), and a p99 means something only over hundreds of requests.

# %% tags=["playground"]
# Playground. Knob: TOKEN_BUDGET, the most tokens one step may carry (max_num_batched_tokens).
# Try 64, 256, 1024, 2048. Look at the TTFT of the first and the last request (a larger budget
# admits more prompts per step: a flatter staircase, but longer steps), and at the TPOT (decodes wait
# behind the prefill chunks that share their steps).
TOKEN_BUDGET = 2048
pg = LLM(MODEL, device=DEVICE, max_num_seqs=32, max_num_batched_tokens=TOKEN_BUDGET)
pg.generate(wl.prompts, params, use_tqdm=False)  # warm-up on the workload itself: its steps' shapes off the record
pg.reset_prefix_cache()
pg_outs = pg.generate(wl.prompts, params, use_tqdm=False)
ttfts = [o.metrics.ttft_ms for o in pg_outs]
print(f"budget {TOKEN_BUDGET} ({sum(len(o.prompt_token_ids) for o in pg_outs)} prompt tokens in all): "
      f"TTFT first request {ttfts[0]:.1f} ms, last {ttfts[-1]:.1f} ms, slowest {max(ttfts):.1f} ms; "
      f"median TPOT {statistics.median(o.metrics.tpot_ms for o in pg_outs):.2f} ms")
pg.shutdown()

# %% [markdown]
# ## 4. The roofline, with this machine's points
#
# Chapter 06 built the roofline: a step's attainable FLOP/s is `min(peak FLOP/s, intensity x peak
# bytes/s)`, where intensity is the step's FLOPs per byte moved. The peaks are measured on this machine
# (`minivllm.telemetry.peaks`): a matrix multiply for FLOP/s, and for bytes/s the **read** bandwidth
# (a sum over at least 1 GiB), because a decode step mostly reads (weights, KV cache); the same figure
# is the ceiling for MBU, so the roof and MBU agree. (The copy bandwidth, which the harness also
# prints, counts the bytes written as well as those read: a different measure, printed for reference.) Every step's FLOPs and bytes come
# from the model's shape (`minivllm.telemetry.roofline`). The monitor below runs two requests of 16
# prompt tokens and 3 new tokens each on `BIG` and puts one point per step under the measured
# ceilings; the time series shows CPU utilisation sampled alongside.
#
# ### Exercise 2 · Where does a decode step sit?
#
# `BIG` has Qwen3-0.6B's shapes, held in the engine's dtype for this device (fp32 on a CPU, bf16 on a
# GPU; the cell below prints it). Its random fp32 values need all 32 bits; the released bf16 checkpoint
# would be held in 2 bytes a weight on a CPU too (chapter 11), but this is `BIG`. Predict the
# **arithmetic intensity** (FLOPs per byte moved) of one of its decode steps with 2 sequences, counting
# the weights as the bytes that matter.

# %% tags=["exercise"]
my_prediction_2 = None  # your guess: FLOPs per byte of a 2-sequence decode step of BIG, in FLOP/byte

# %%
from minivllm.bench.report import weights_summary
from widgets import UtilisationMonitor

if "big" in globals():  # run again: free the last run's engine (its monitor widget keeps the object alive)
    big.shutdown()
big = LLM(BIG, device=DEVICE, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
print(describe(big))
print(weights_summary(big.llm_engine.model_cost.to_dict(),
                      str(big.llm_engine.config.dtype).removeprefix("torch.")))
# a warm-up off the record: on a CPU the first decode step at a batch size records the graph that the
# later ones replay (chapter 11), a slower step that is not the decode steps' pace
big.generate([[7] * 16, [8] * 16], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
monitor = UtilisationMonitor(big, num_requests=2, prompt_len=16, max_tokens=3)
records = monitor.run()
monitor.display()

# %%
peaks = monitor.peaks
print(f"peaks ({peaks.provenance}): {peaks.flops_per_s / 1e9:.1f} GFLOP/s (matmul); read "
      f"{peaks.mbu_bytes_per_s / 1e9:.1f} GB/s (the roof and MBU's ceiling); copy {peaks.bytes_per_s / 1e9:.1f} GB/s "
      f"(read + written, for reference); ridge at {peaks.ridge_intensity:.1f} FLOP/byte (against the read bandwidth)")
steps = pd.DataFrame([{"phase": r.phase, "tokens": r.num_tokens, "wall_ms": r.wall_ms,
                       "intensity (FLOP/B)": r.flops / r.bytes_moved, "GFLOP/s": r.flops / r.wall_ms / 1e6,
                       "GB/s": r.bytes_moved / r.wall_ms / 1e6, "MFU": r.mfu, "MBU (vs read)": r.mbu}
                      for r in records if r.flops])
display(steps.round(3))
decode_intensity = steps[steps.phase == "decode"]["intensity (FLOP/B)"].median()
check_prediction(my_prediction_2, decode_intensity, rel_tol=0.2, unit="FLOP/byte",
                 what="the intensity of a 2-sequence decode step");

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Each weight is read once per step (4 bytes in fp32) and used once per sequence in a multiply-add
# (2 FLOPs). With 2 sequences that is 4 FLOPs per 4 bytes: about 1 FLOP per byte. The KV cache and the
# activations add a few bytes and attention a few FLOPs, all small beside the weights at a context of
# 17 and 18 tokens (the monitor's 16-token prompts, one more token a step), so the measured median above sits close to that. In bf16 the same step would do
# 2 FLOPs per byte; in int8, 4.
#
# </details>

# %%
prefill_i = steps[steps.phase == "prefill"]["intensity (FLOP/B)"].max()
prefill_f = steps[steps.phase == "prefill"]["GFLOP/s"].max()
decode_f = steps[steps.phase == "decode"]["GFLOP/s"].median()
check_claim("the prefill step, with more FLOPs per byte, achieves more FLOP/s than the decode steps",
            prefill_f > decode_f,
            f"prefill {prefill_i:.1f} FLOP/byte at {prefill_f:.1f} GFLOP/s, decode {decode_intensity:.2f} FLOP/byte "
            f"at {decode_f:.1f} GFLOP/s (median)",
            why_it_may_not="Load from other processes during the prefill step alone can slow it below the decode steps.")
check_claim("the decode steps sit below the ridge point (memory-bound side of the roof)",
            decode_intensity < peaks.ridge_intensity,
            f"decode {decode_intensity:.2f} vs ridge {peaks.ridge_intensity:.1f} FLOP/byte");
# the roof at the prefill step's intensity: the lower of the compute ceiling and intensity x read bandwidth
prefill_roof = min(peaks.flops_per_s, prefill_i * peaks.mbu_bytes_per_s) / 1e9
render(f"The prefill step did {prefill_i:.1f} FLOP per byte against a ridge at {peaks.ridge_intensity:.1f}: "
       + ("past the ridge, where the roof is the compute ceiling, " if prefill_i >= peaks.ridge_intensity else
          "still below the ridge, where the roof is the read bandwidth's slope, ")
       + f"**{prefill_roof:.0f} GFLOP/s** at its intensity; it reached {prefill_f:.1f} GFLOP/s, **{prefill_f / prefill_roof:.0%}** "
       "of that roof (`bench --sweep` places prefills of up to 512 tokens on the same roof).");
harness_read, harness_flops = result["peaks"]["mbu_bytes_per_s"], result["peaks"]["flops_per_s"]
harness_rf = result["minivllm"]["roofline"]
same_read = abs(harness_read - peaks.mbu_bytes_per_s) <= 0.02 * peaks.mbu_bytes_per_s
same_flops = abs(harness_flops - peaks.flops_per_s) <= 0.02 * peaks.flops_per_s
agree = same_read and same_flops
rescaled = ([f"MFU of {harness_rf['mfu']:.1%} would be "
             f"{harness_rf['mfu'] * harness_flops / peaks.flops_per_s:.1%} against the monitor's matmul peak"]
            if harness_rf.get("mfu") is not None and not same_flops else []) + \
           ([f"MBU of {harness_rf['mbu']:.1%} would be {harness_rf['mbu'] * harness_read / peaks.mbu_bytes_per_s:.1%} "
             "against the monitor's read bandwidth"] if harness_rf.get("mbu") is not None and not same_read else [])
render(f"Two sets of ceilings appear in this notebook. Section 2's harness measures its peaks at the start of each "
       f"of its runs, under whatever else is running then; the run whose report this section reads measured "
       f"**{harness_flops / 1e9:.1f} GFLOP/s** matmul and "
       f"**{harness_read / 1e9:.1f} GB/s** read, the ceilings of the MFU and MBU in its report. The roofline and "
       f"the MFU and MBU columns in this section use the monitor's peaks ({peaks.provenance}): "
       f"**{peaks.flops_per_s / 1e9:.1f} GFLOP/s** and **{peaks.mbu_bytes_per_s / 1e9:.1f} GB/s**, the best figures "
       "minivllm's stored peaks (`minivllm.telemetry.peaks`, a file on disk) have kept, because a ceiling measured "
       "while other processes share the machine reads low, and a utilisation measured against it reads high"
       + (f" (the harness's {' and its '.join(rescaled)})" if rescaled else "") + ". "
       + ("On this run the two sets of ceilings agree, so the utilisations differ only by their steps, which belong "
          "to different models: compare each with its own roof, not the two with each other."
          if agree else
          "Utilisations measured against different ceilings (and of different models' steps) are not comparable; "
          "only those measured against the same peaks are."));

# %% [markdown]
# The prefill step sits to the right of the decode steps: it multiplies every weight by all the
# prompt's tokens, so it does many more FLOPs per byte. Where that puts it past the ridge point (the
# sentence above says whether it did here), its roof is the compute ceiling and its figure of merit MFU;
# below the ridge, it is still under the memory slope. The
# decode steps do a few FLOPs per byte at most (the figure measured in exercise 2) and sit under the
# sloped, memory-bound part of the roof, as the checks above test;
# their figure of merit is MBU, the share of the measured read bandwidth they use. `python -m minivllm
# bench --sweep` runs the full version of this measurement (by default on a CPU, decode at batch 1 to 32
# and prefill at 16 to 512 tokens; larger on CUDA), and `--html PATH` writes its roofline as an HTML file.
#
# ## 5. Reproducing nano-vllm's benchmark on a GPU
#
# nano-vllm's `bench.py` (read at commit bb823b3) draws 256 requests with prompt and
# output lengths from `random.randint(100, 1024)` and prompt token ids from `random.randint(0, 10000)`.
# Python's `randint` includes both ends, so its ids run from 0 to 10,000 inclusive. It seeds Python's
# generator with 0 and draws each prompt's length and then its ids, prompt after prompt, and then the
# 256 output lengths. The harness's `nano` preset (the default on a GPU) makes the same draws in the
# same order, so with seed 0 it is nano-vllm's very workload: the cell below checks its output tokens
# against the total nano-vllm's README reports for it (133,966 output tokens, with 1434.13 output
# tokens/s for nano-vllm and 1361.84 for vLLM, on an RTX 4070 Laptop GPU with 8 GB and Qwen3-0.6B: their
# figures, not measured here). nano-vllm ignores
# end-of-sequence tokens, times one `generate` call, and prints `Total` (the sum of the requests'
# `max_tokens`: output tokens only) and `Throughput` (that total divided by the time). So its
# throughput is **output tokens per second**: compare it with the harness's `out tok/s` column, not
# `total tok/s`, which adds the prompt tokens. Its README reports the figure for Qwen3-0.6B, the model
# the script loads (from `~/huggingface/Qwen3-0.6B/`, with `max_model_len=4096`): set that path to the
# checkpoint you compare with. The exact workload of the `nano` preset:

# %%
# NBVAL_CHECK_OUTPUT
nano = make_workload("nano", 151936, seed=0)
d = nano.describe()
print(f"{d['num_requests']} requests; prompt tokens {nano.num_prompt_tokens:,} "
      f"(lengths {d['prompt_len_min']}..{d['prompt_len_max']}), output tokens {nano.num_output_tokens:,} "
      f"(lengths {d['output_len_min']}..{d['output_len_max']})")
NANO_README_OUTPUT_TOKENS = 133_966  # nano-vllm's README, "Output Tokens" of its Qwen3 benchmark table
_ = check_claim("the nano preset asks for the output tokens nano-vllm's README reports for its benchmark",
                nano.num_output_tokens == NANO_README_OUTPUT_TOKENS,
                f"{nano.num_output_tokens:,} here, {NANO_README_OUTPUT_TOKENS:,} in nano-vllm's README")

# %% [markdown]
# On a GPU box with the repository installed (`environment.yml`) and a downloaded Qwen3-0.6B
# checkpoint, from the repository root:
#
# ```bash
# # minivllm and transformers generate on the same requests, in one process, with the ratio
# python -m minivllm bench --model /path/to/Qwen3-0.6B --workload nano --json nano_bench.json
#
# # the same at real shapes without downloading weights (random weights, same cost per token)
# python -m minivllm bench --model random:qwen3-0.6b --workload nano
#
# # the decode/prefill sweep with its roofline as HTML
# python -m minivllm bench --model /path/to/Qwen3-0.6B --sweep --html roofline.html
#
# # the project's one-command GPU check: kernels, CUDA graphs, TPOT, prefill, the nano workload vs
# # transformers, NVML utilisation, all written to one JSON file
# python scripts/gpu_check.py --model /path/to/Qwen3-0.6B --out gpu_check.json
# ```
#
# and, for nano-vllm itself, in its repository: set the model path in `bench.py` to the same
# checkpoint and run `python bench.py`. Two differences to keep in mind when putting the numbers side
# by side: nano-vllm samples at temperature 0.6 while the harness is greedy (with end-of-sequence
# ignored, both produce exactly the requested number of tokens, so the work is the same apart from
# the sampler), and its requests are the `nano` preset's, draw for draw (the same prompts and output
# lengths; the cell above checks their total). Compare its `Throughput` with the `out tok/s` column. Report the GPU, the driver,
# the torch version and both commands with the numbers. Its usage line (`python -m minivllm bench
# --help` explains every option):

# %%
from minivllm.bench import build_parser

os.environ["COLUMNS"] = "110"  # argparse wraps the usage to the terminal width
print(build_parser().format_usage())

# %% [markdown]
# ## 6. Check yourself

# %%
from widgets import Question, Quiz

DEVICE_WORD = "GPU" if engine.config.device.type == "cuda" else "CPU"
Quiz([
    Question(
        "Engine A reports 2x the output tokens/s of engine B. What else do you need before believing A is faster?",
        ["Nothing: throughput is throughput",
         "That both ran the same prompts, output lengths, model, weights and precision on the same machine, "
         "and that their outputs agree",
         "Only the GPU model", "The mean TTFT of A"],
        1,
        ["A different workload (shorter outputs, shorter prompts) or another machine changes tokens/s by "
         "itself; the ratio is only meaningful for the same work.",
         "Right: that is why the harness runs the peer in the same process on the same requests and checks "
         "that the greedy outputs are identical.",
         "The machine matters, but so do the workload and the model: any of them changes the number.",
         "A latency figure does not tell you whether the two did the same work."],
    ),
    Question(
        "In section 3, all requests arrived at once at the notebook's engine. Why did their TTFTs differ?",
        ["Random noise", "Each step's token budget admits prompts in turn, so later ones wait for earlier prefills",
         "Longer prompts always get their first token first", "TTFT only measures decode"],
        1,
        ["The staircase in the scatter follows arrival order: a pattern, not noise.",
         "Right: the queue is served step by step; a request's TTFT includes the prefill steps of the "
         "prompts scheduled before it.",
         "A longer prompt needs more prefill work, so it is later, not earlier, other things equal.",
         "TTFT is the time to the first token: queueing plus prefill."],
    ),
    Question(
        f"A decode step's point sits far below the compute ceiling on the roofline. Is the engine wasting the "
        f"{DEVICE_WORD}?",
        ["Yes, MFU should be near 100% for every step",
         "Not necessarily: decode is memory-bound, so compare its bandwidth use (MBU) with the sloped part of "
         "the roof",
         "Yes, because prefill is higher", "The roofline does not apply to CPUs"],
        1,
        ["Only steps whose intensity is past the ridge point can reach the compute ceiling.",
         "Right: at one or two FLOPs per byte the ceiling is intensity x bandwidth; how close the point gets "
         "to that is the question.",
         "Prefill has a much higher arithmetic intensity; comparing its MFU with decode's compares different "
         "limits.",
         f"The roofline needs only a peak FLOP/s and a peak bandwidth, both measured on this {DEVICE_WORD} above."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * run `python -m minivllm bench` (or `run_throughput`) and read its report: throughput beside a peer
#   run on the same machine, model, weights and requests, with the greedy outputs checked to agree;
# * say where a throughput ratio against `generate` comes from: how many forward passes each engine
#   made (padding keeps a batch running until its longest request is done) and what one pass cost;
# * read latency as distributions (p50, p90, p99 of TTFT and TPOT) and trace a TTFT staircase back to
#   the token budget and the order of arrival;
# * place a step on this machine's roofline from its FLOPs and bytes, against the measured read
#   bandwidth that MBU also uses, and predict a decode step's intensity from the weights' dtype;
# * set up the comparison with nano-vllm's benchmark: the same requests, and its throughput
#   (output tokens per second) against the `out tok/s` column.
#
# The utilisation monitor's engine (`big`, Qwen3-0.6B's shapes) stays loaded, so that its widget still
# runs after Run All; `big.shutdown()`, or restarting the kernel, frees its memory.
