"""Build (and execute) notebooks/06_prefill_vs_decode.ipynb from the cells below.

    python scripts/build_notebook_06.py            # build and execute in place (stores real outputs)
    python scripts/build_notebook_06.py --no-exec  # build only

Cells whose output is deterministic (greedy tokens, block counts, chunk sizes) start with
``# NBVAL_CHECK_OUTPUT``: ``pytest --nbval-lax`` compares them; the others run but are not
compared (they hold timings measured on the machine that ran them).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "notebooks" / "06_prefill_vs_decode.ipynb"

STEPPER_PROMPT = ("If the object supports len(), the length is returned; otherwise a TypeError is "
                  "raised.")
PROMPT = ("Return a new list containing all items from the iterable in ascending order. A custom key "
          "function can be supplied to customize the sort order.")

CELLS: list[tuple[str, str]] = []


def md(text: str) -> None:
    CELLS.append(("md", text.strip("\n")))


def code(text: str) -> None:
    CELLS.append(("code", text.strip("\n")))


md("""
# 06 · Prefill vs Decode

The same model, the same weights, and yet the first step of a request and every step after it
cost very different amounts. The first step reads the whole prompt (**prefill**); each later
step writes one more token of the answer (**decode**). In this chapter you drive minivllm one
step at a time, watch what each step does to the KV cache, and **measure** on your own machine
why the two phases behave so differently and what that means for latency.

Nothing below is typed in by hand: every time, token count and utilisation figure is produced
when you run the notebook, on the hardware you run it on.

**You will:** step the engine through a request and watch the KV blocks fill · measure step time
against prompt length for both phases · turn those measurements into a latency model (TTFT, TPOT)
and check its predictions · see chunked prefill split a long prompt · test yourself.
""")

md("""
## Setup

The parameters cell chooses the model: the embedded `minivllm-tiny` (a 4M-parameter Qwen3-shaped
model that ships with the repo) unless the environment variable `MINIVLLM_MODEL` names another one
(a Qwen3 checkpoint directory, or `random:qwen3-0.6b`). KV blocks of 16 tokens and a small pool of
64 blocks keep the paging visible. `MINIVLLM_THREADS` sets torch's CPU threads (the stored outputs
were produced with 1 thread on a CPU shared with other work).
""")

code("""
import os
import platform

import torch

from minivllm import LLM, SamplingParams

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available, else CPU (fp32)
BLOCK_SIZE = 16                            # tokens per KV block
# CPU threads for torch; 0 keeps torch's default. On a machine shared with other busy
# processes, 1 avoids threads waiting on each other and makes timings far steadier.
THREADS = int(os.environ.get("MINIVLLM_THREADS", "0"))
if THREADS > 0:
    torch.set_num_threads(THREADS)
""")

code("""
llm = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64,
          max_num_batched_tokens=64, max_num_seqs=8)
engine = llm.llm_engine
cfg, hf = engine.config, engine.source.hf_config
n_params = sum(p.numel() for p in engine.runner.model.parameters())
gpu = f" ({torch.cuda.get_device_name(cfg.device)})" if cfg.device.type == "cuda" else ""
print(f"machine : {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
      f"using {torch.get_num_threads()} thread(s)")
print(f"device  : {cfg.device}{gpu}")
print(f"model   : {engine.source.name}: {n_params / 1e6:.2f} M parameters, {hf.num_hidden_layers} layers, "
      f"hidden size {hf.hidden_size}, vocabulary {hf.vocab_size}")
print(f"dtype   : {cfg.dtype}; attention backend {cfg.attention_backend}; "
      f"KV pool {cfg.num_kv_blocks} blocks of {cfg.block_size} tokens; token budget per step "
      f"{cfg.max_num_batched_tokens}")

from minivllm.telemetry.peaks import get_peaks

# This machine's ceilings, measured now (a large matmul and a large copy), so the MFU / MBU
# figures below compare steps with peaks taken under the same conditions.
peaks = get_peaks(cfg.device, cfg.dtype, refresh=True)
print(f"peaks   : {peaks.flops_per_s / 1e9:.1f} GFLOP/s (matmul), {peaks.bytes_per_s / 1e9:.1f} GB/s (copy)")
""")

md("""
## 1. Two phases in one loop

A request arrives as a list of prompt tokens. Before the model can say anything it must compute,
in every layer, the key and value vectors of **all** those tokens and store them in the KV cache
(chapter 03). They are all known up front, so the engine pushes them through the model together:
each layer multiplies a tall matrix (one row per prompt token) by its weights. That is prefill,
and it ends by sampling the first output token from the last position's logits.

From then on the engine runs decode steps: one row per sequence goes through the model (the token
sampled last), its key and value are appended to the cache, and attention reads every earlier
key and value back. One step, one new token per sequence.

Both phases read **every weight matrix once per step**. What differs is how much arithmetic each
weight read pays for: a prefill step of 500 tokens does 500 multiply-adds per weight, a decode
step of one sequence does one. Arithmetic per byte moved (the *arithmetic intensity*) is what
decides whether a step waits on the arithmetic units or on memory.

Here is one request run by hand through `LLMEngine.step()`, greedy, with the step records the
engine produces:
""")

code(f"""
# NBVAL_CHECK_OUTPUT
PROMPT = {PROMPT!r}
tok = llm.get_tokenizer()
print(f"prompt: {{len(tok.encode(PROMPT))}} tokens -> {{-(-len(tok.encode(PROMPT)) // BLOCK_SIZE)}} KV blocks of {{BLOCK_SIZE}}")
engine.add_request("by-hand", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
n = 0
while engine.has_unfinished_requests():
    result = engine.step()
    r = result.record
    new = result.outputs[0].outputs[0].token_ids[-1] if result.outputs else None
    print(f"step {{n}}: {{r.phase:7s}} tokens in the forward pass {{r.num_tokens:3d}}   "
          f"KV blocks in use after it {{r.kv_blocks_used}}   sampled token {{new}}")
    n += 1
final = result.outputs[0]
print("generated:", final.outputs[0].token_ids, repr(final.outputs[0].text))
""")

md("""
One prefill step carried the whole prompt; each decode step carried a single token. The block
count goes up when the sequence crosses a multiple of 16 tokens, and drops to zero when the
request finishes and its blocks return to the pool (they stay in the prefix cache, reusable,
until something else needs the space: chapter 07).

### Step it yourself

The stepper below drives the same engine. It has already added a request and run two steps (the
prefill, then one decode). Press **Step** to run one more engine step, **Run to end** to step until
every request finishes (**Stop** halts it between steps), **Reset** to abort everything and free
the cache. Type a prompt (text, or token ids like `[1, 2, 3]`) and press **Add request** while
another request is decoding: the next step is *mixed*, a prefill chunk and decodes in one forward
pass. Under the stepper, the KV cache view shows every physical block, coloured by its owner;
hover a block to see the tokens whose keys and values it holds.
""")

code(f"""
from widgets import EngineStepper, KVCacheView

STEPPER_PROMPT = {STEPPER_PROMPT!r}
stepper = EngineStepper(llm, prompt="The module provides", max_tokens=12)
kv_view = KVCacheView(llm, stepper=stepper)
stepper.add_request(STEPPER_PROMPT, max_tokens=12)
stepper.step()  # the prefill
stepper.step()  # the first decode step
stepper.display()
kv_view.display()
""")

code("""
# NBVAL_CHECK_OUTPUT
for i, r in enumerate(stepper.steps[:2]):
    print(f"stepper step {i}: {r.phase}, {r.num_prefill_tokens} prefill + {r.num_decode_tokens} decode tokens, "
          f"KV blocks in use {r.kv_blocks_used}")
print("generated tokens after these steps:", stepper.generated_token_count)
""")

md("""
## 2. Measured: step time against prompt length

Now a sweep. For several prompt lengths, one request is prefilled in one step and then decoded
for four steps; each length is repeated three times and the median kept (a shared machine has
hiccups). A separate engine instance with a larger token budget is used so the widget above keeps
its state.
""")

code("""
import pandas as pd

from widgets import measure_step_latency

bench = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=256,
            max_num_batched_tokens=1024, max_num_seqs=16)
PROMPT_LENS = [16, 64, 128, 256, 512]
rows = measure_step_latency(bench, PROMPT_LENS, decode_steps=3, repeats=3)
df = pd.DataFrame(rows)
steps = df[df.phase.isin(["prefill", "decode"])]
table = steps.groupby(["phase", "prompt_len"])[["wall_ms", "intensity", "mfu", "mbu"]].median()
table.round(4)
""")

code("""
import plotly.graph_objects as go

from widgets import show_figure

med = steps.groupby(["phase", "prompt_len"]).wall_ms.median()
fig = go.Figure()
for phase, colour in (("prefill", "#e4572e"), ("decode", "#f0a202")):
    pts = steps[steps.phase == phase]
    fig.add_scatter(x=pts.prompt_len, y=pts.wall_ms, mode="markers", marker=dict(color=colour, opacity=0.35),
                    name=f"{phase}: every step", showlegend=True)
    fig.add_scatter(x=med[phase].index, y=med[phase].values, mode="lines+markers",
                    line=dict(color=colour, width=3), name=f"{phase}: median")
fig.update_layout(title=f"Measured step time by phase ({engine.source.name}, {cfg.device}, {cfg.dtype})",
                  xaxis_title="prompt length (tokens)", yaxis_title="step wall time (ms)", height=380)
show_figure(fig)
""")

code("""
longest = PROMPT_LENS[-1]
pre_ms = med["prefill"][longest]
dec_ms = med["decode"][longest]
print(f"prefill of {longest} tokens: {pre_ms:.2f} ms, i.e. {1e3 * pre_ms / longest:.1f} µs per prompt token")
print(f"one decode step after that prompt: {dec_ms:.2f} ms for one token")
print(f"per token, the prefill was {dec_ms / (pre_ms / longest):.0f}x cheaper than a decode step")
ai = table["intensity"]
print(f"arithmetic intensity: prefill of {longest} tokens {ai['prefill'][longest]:.1f} FLOP/byte, "
      f"decode {ai['decode'][longest]:.2f} FLOP/byte")
print(f"ridge point of this machine: {peaks.ridge_intensity:.1f} FLOP/byte")
""")

md("""
Read the chart from left to right. The prefill line climbs with the prompt: more rows to multiply,
more arithmetic. The decode line hardly moves: a decode step does the same work whatever came
before it, apart from attention reading a slightly longer cache.

The intensity figures come from the roofline model in `minivllm.telemetry.roofline` (FLOPs and
bytes a step *must* do, from the model's shape), and MFU / MBU divide them by the measured step
time and by this machine's measured peak FLOP/s and copy bandwidth. A long prefill step does on the
order of a hundred FLOPs or more per byte moved. A decode step at batch 1 does 2 FLOPs per weight it
reads: half a FLOP per byte in fp32 (one in bf16), a little less once the KV cache reads are counted.
The *ridge point* printed above (peak FLOP/s divided by peak bytes/s, both measured here) is the
intensity a step needs before arithmetic, not memory, limits it; decode sits far below it, so its
time is set by how fast the weights stream from memory.

Look for that pattern in the MFU and MBU columns of the table: prefill steps reach a sizeable share
of the measured matmul peak while moving few bytes per FLOP; decode steps use a small fraction of the
arithmetic, and what they do use is mostly memory traffic. Decode's MBU stays well short of 100 % on
the embedded model because it is tiny: a step lasts a few milliseconds, fixed per-step costs (Python,
scheduling, building input tensors) take a good part of that, and its 17 MB of weights partly fit
in the CPU's caches. With a bigger model (`MINIVLLM_MODEL=random:qwen3-0.6b`, or a real checkpoint on
a GPU) decode's MBU climbs towards the memory ceiling.
""")

md("""
## 3. TTFT and TPOT

Two latencies describe what a user of a served model feels:

* **TTFT**, time to first token: from the request's arrival to its first output token. Waiting in
  the queue plus every prefill step of its prompt.
* **TPOT**, time per output token: the mean gap between later tokens, i.e. the decode step time of
  whatever batch the request shares.

A response of `R` tokens takes about `TTFT + (R - 1) * TPOT`. The calculator below predicts these
from a cost model **fitted to the steps you just measured** (plus a short sweep of decode steps at
batch sizes 1 to 8): a fixed cost per step plus a cost per prefill token, and a fixed cost per
decode step plus a cost per sequence in the batch. It replays the scheduler's policy (decodes
first, then prompt chunks up to the token budget). Move the sliders, then press **measure this
point** to run that exact workload on the engine and plot the measurement beside the prediction.
""")

code("""
from widgets import LatencyCalculator, measure_decode_batch

decode_rows = measure_decode_batch(bench, batch_sizes=[1, 2, 4, 8], prompt_len=32, decode_steps=5)
calc = LatencyCalculator({engine.source.name: bench}, sweeps={engine.source.name: rows + decode_rows})
calc.prompt_slider.value, calc.response_slider.value, calc.batch_slider.value = 128, 12, 4
calc.measure()
calc.display()
""")

code("""
m = calc.measurements[-1]
for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "total")):
    print(f"{name:5s}: predicted {m['predicted'][key]:8.2f} ms   measured {m[key]:8.2f} ms")
dec = pd.DataFrame(decode_rows).groupby("batch").wall_ms.median()
for b, ms in dec.items():
    print(f"decode batch {b}: step {ms:6.2f} ms -> {b / ms * 1e3:8.0f} tokens/s")
""")

md("""
Two things to notice in the decode lines. The step time grows far more slowly than the batch, so
**decode throughput grows almost in proportion to the batch**: the weights are read once per step
and shared by every sequence in it. That lasts until the step has enough rows to become limited by
arithmetic, which for a large model on a GPU takes a batch in the hundreds. Batching is therefore
the first tool for decode throughput; others are quantisation (fewer bytes per weight) and
speculative decoding (several tokens checked per weight read); faster memory helps too.

For scale on real hardware: a 7B-parameter model in fp16 is 14 GB of weights. An H100's HBM3 moves
about 3.35 TB/s, so a decode step cannot take less than about 14 / 3350 s, roughly 4 ms, at any
batch size up to where arithmetic takes over.
""")

md("""
## 4. Chunked prefill

A prompt longer than the step's token budget (`max_num_batched_tokens`) is split into chunks, one
per step. The point is not the long prompt's own latency; it is everybody else's. Requests already
decoding get their token in *every* step, mixed in with the chunk, instead of waiting for the whole
prompt. (Chunking is a scheduler setting, `enable_chunked_prefill`; it has nothing to do with
`enforce_eager`, which switches CUDA graphs off.) Here a request decodes while an 80-token prompt
arrives at an engine whose budget is 32 tokens per step:
""")

code("""
# NBVAL_CHECK_OUTPUT
small = LLM(MODEL, device=DEVICE, block_size=BLOCK_SIZE, num_kvcache_blocks=64, max_num_batched_tokens=32)
e = small.llm_engine
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
e.add_request("chatting", "The module provides", greedy)
e.step()  # its prefill
long_prompt = list(range(1, 81))  # 80 token ids
e.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
for i in range(5):
    r = e.step().record
    parts = ", ".join(f"{x.request_id}: {x.num_tokens} {'prefill' if x.is_prefill else 'decode'}" for x in r.scheduled)
    print(f"step {i}: {r.phase:7s} [{parts}]")
while e.has_unfinished_requests():
    e.step()
small.shutdown()
""")

md("""
The 80-token prompt took three steps (31 + 31 + 18 tokens), and the decoding request got a token in
each of them: 1 decode token plus a prefill chunk fills the 32-token budget. Without chunking the
whole prompt runs in one long step and the decoding requests wait for it. Measured: below, three
requests decode while a 384-token prompt arrives, once on an engine that chunks (64-token budget)
and once on one that schedules the prompt whole. Each point is one token of a decoding request: how
long after its previous token it came.
""")

code("""
from widgets import ChunkedPrefillDemo

demo = ChunkedPrefillDemo.from_model(MODEL, budget=64, max_model_len=512, long_prompt_len=384,
                                     num_decoders=3, decode_tokens=20, device=DEVICE)
demo.display()
""")

code("""
c, w = demo.results["chunked"], demo.results["whole"]
print(f"chunked: the long prompt took {c['prefill_steps']} steps; worst gap between a decoding request's tokens "
      f"{c['max_itl_ms']:.1f} ms; the long prompt's TTFT {c['long_ttft_ms']:.1f} ms")
print(f"whole  : the long prompt took {w['prefill_steps']} step;  worst gap {w['max_itl_ms']:.1f} ms; "
      f"the long prompt's TTFT {w['long_ttft_ms']:.1f} ms")
""")

md("""
Chunking trades a little of the long prompt's own TTFT (its chunks share steps with the decodes)
for a much smaller worst-case stall for everyone already streaming.

## 5. Check yourself
""")

code("""
from widgets import Quiz, Question

Quiz([
    Question(
        "A request has a 2,000-token prompt and gets a 20-token answer. What sets its time to first token?",
        ["The decode steps", "Queueing plus the prefill steps of its prompt",
         "Prefill and decode equally", "The sampler"],
        1,
        ["Decode starts only after the first token exists; it sets the pace of the tokens that follow.",
         "Right: the first token is sampled at the end of the step that finishes the prompt, so TTFT is the "
         "wait in the queue plus every prefill step (chunks included).",
         "The 20 decode steps all come after the first token; they add to the total time, not to TTFT.",
         "Sampling one token from the logits is a tiny part of any step; the chart above shows where the time goes."],
    ),
    Question(
        "Why does a decode step for 8 sequences take little longer than one for a single sequence?",
        ["Decode uses a different, faster kernel for batches",
         "Each weight is read once per step, whatever the batch; 8 rows of arithmetic add little to that",
         "The KV cache is empty during decode",
         "The sequences run one after another, and each is very short"],
        1,
        ["The kernels are the same matrix multiplies; the batch just adds rows to them.",
         "Right: eight rows instead of one barely changes the bytes moved, so the time barely changes and "
         "throughput grows almost eightfold.",
         "Decode reads the KV cache of every earlier token; it is the prefill that starts with it empty.",
         "They run together in one forward pass: that is what batching means here."],
    ),
    Question(
        "With chunked prefill, who benefits when a long prompt arrives?",
        ["The long prompt's own TTFT drops a lot", "Requests already decoding: a token every step",
         "Nobody; it only changes memory use", "It is what enforce_eager=False turns on"],
        1,
        ["The long prompt still needs every chunk computed before its first token, so its TTFT stays about "
         "the same (slightly longer, as it shares steps).",
         "Right: the token budget caps each step, so decodes are never stalled for a whole long prefill.",
         "The chunked run above shows the decoding request getting a token in every step; that is a latency "
         "change for it.",
         "enforce_eager switches CUDA graphs off; chunking is the scheduler's enable_chunked_prefill."],
    ),
]).display()
""")

md("""
## Takeaways

* Prefill processes every prompt token in one pass (or one pass per chunk): high arithmetic
  intensity, time grows with the prompt. It sets TTFT.
* Decode produces one token per sequence per step: every weight read for a few rows of arithmetic,
  so memory traffic and fixed overhead set its time. It sets TPOT.
* Batching is what makes decode efficient: the measured step time above grows much more slowly than
  the batch.
* A cost model fitted to a handful of measured steps predicts TTFT and TPOT well enough to reason
  with; measure the point you care about to check it.
* Chunked prefill bounds every step's size, so a long prompt cannot freeze everyone else's stream.

Next: chapter 07, prefix caching, skips prefill for tokens the cache has already seen.
""")


def build() -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, src) in enumerate(CELLS):
        cell = new_markdown_cell(src) if kind == "md" else new_code_cell(src)
        cell["id"] = f"c{i:02d}"
        if kind == "code" and i == 2:
            cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    return nb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-exec", action="store_true", help="write the notebook without executing it")
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    nb = build()
    if not args.no_exec:
        from nbclient import NotebookClient

        # Widget state is not stored (it would be megabytes of chart data); every widget
        # output carries its own static snapshot instead.
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3", store_widget_state=False,
                                resources={"metadata": {"path": str(OUT.parent)}})
        client.execute()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    main()
