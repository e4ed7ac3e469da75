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
# # 10 · Parallelism: one model, two processes
#
# A model too big (or too slow) for one device can be cut into pieces that several devices run
# together. **Tensor parallelism** cuts every weight matrix: each process (a *rank*) holds a slice
# of every layer, all ranks work on every token at once, and they add up their partial results
# with a collective operation, the **all-reduce**, twice per layer.
#
# minivllm does this with `LLM(..., tensor_parallel_size=2)`: on a CPU the two ranks are two
# processes talking over `torch.distributed`'s gloo backend, on GPUs one process per GPU over NCCL.
# Everything below runs the real engine and measures it on the machine you run it on.
#
# **You will:** see how each layer type splits its weights, with the shapes every rank holds ·
# redo the split by hand (no processes) and check that the pieces add up to the full layer · start
# a two-process engine and check it produces the same tokens as one process · count the
# all-reduces per step, from the model's structure and by counting the calls · measure how much
# of a step the communication takes here.

# %% [markdown]
# ## Setup
#
# `MODEL` is the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names another (a Qwen3
# checkpoint directory or `random:qwen3-0.6b`). `TP` is the number of ranks.

# %% tags=["parameters"]
import os

# Threads that finish their share of an operation early spin, by default, waiting for the next
# one. On a machine shared with other busy processes that spinning steals the cores the other
# threads need, and small steps get many times slower. PASSIVE lets waiting threads sleep; it is
# read when torch loads its OpenMP runtime, so it must be set before `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import time

import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available (then one GPU per rank), else CPU (gloo)
TP = 2                                     # tensor-parallel ranks

# %%
if DEVICE == "auto" and torch.cuda.is_available() and torch.cuda.device_count() < TP:
    DEVICE = "cpu"  # tensor parallelism on CUDA needs one GPU per rank
    print(f"{torch.cuda.device_count()} GPU(s) for {TP} ranks: running both engines on the CPU (gloo)")
single = LLM(MODEL, device=DEVICE, num_kvcache_blocks=64, max_num_seqs=8)
hf = single.llm_engine.source.hf_config
print(describe(single))
print(f"layers {hf.num_hidden_layers}, hidden {hf.hidden_size}, query heads {hf.num_attention_heads}, "
      f"KV heads {hf.num_key_value_heads}, head dim {single.llm_engine.runner.model.head_dim}, "
      f"MLP width {hf.intermediate_size}, vocabulary {hf.vocab_size}")

# %% [markdown]
# ## 1. Two ways to split a matrix multiply
#
# A linear layer computes `y = x @ W.T` with `W` of shape `[out, in]`. Split it across two ranks in
# one of two ways:
#
# * **Column-parallel** (split `out`): rank *r* holds rows `r*out/2 ... (r+1)*out/2` of `W` and
#   computes that half of the output features. No communication; the output stays split.
# * **Row-parallel** (split `in`): rank *r* holds columns `r*in/2 ... (r+1)*in/2` of `W` and
#   multiplies them by *its half of the input features*. Each rank gets a partial sum of the full
#   output; adding the ranks' partial sums (an all-reduce) gives `y`, on every rank.
#
# The trick (Megatron-LM, Shoeybi et al. 2019) is to chain them: a column-parallel layer's split
# output is exactly the split input a row-parallel layer wants, and anything in between that works
# feature by feature (attention per head, SiLU per element) runs locally. So attention is
# `qkv_proj` (column: each rank owns whole heads) → attention on its own heads → `o_proj` (row,
# all-reduce), and the MLP is `gate_up_proj` (column) → SiLU-and-multiply → `down_proj` (row,
# all-reduce). The embedding and the LM head are split by vocabulary rows.
#
# The layers read the rank and the number of ranks when they allocate their weights
# (`minivllm.distributed.parallel_state`). So we can build each rank's model **in this process,
# without starting any**, by setting that state with `tp_scope`, and read off the shapes. The
# `meta` device allocates no memory.

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.distributed import tp_scope
from minivllm.models.registry import get_model_class

model_cls = get_model_class(hf)


def build_rank(rank, size, device="meta"):
    """Rank `rank`'s shard of the model, as a tensor-parallel engine of `size` ranks allocates it."""
    with tp_scope(rank, size), torch.device(device):
        return model_cls(hf)


full = build_rank(0, 1)
ranks = [build_rank(r, TP) for r in range(TP)]
shard_params = [dict(m.named_parameters()) for m in ranks]

print(f"{'parameter (layer 0 shown; every layer alike)':44s} {'layer type':27s} {'full':>12s}  "
      + "  ".join(f"{'rank ' + str(r):>12s}" for r in range(TP)))
for name, p in full.named_parameters():
    if ".layers." in name and ".layers.0." not in name:
        continue
    owner = type(full.get_submodule(name.rsplit(".", 1)[0])).__name__
    shapes = "  ".join(f"{str(tuple(sp[name].shape)):>12s}" for sp in shard_params)
    print(f"{name:44s} {owner:27s} {str(tuple(p.shape)):>12s}  {shapes}")
if getattr(hf, "tie_word_embeddings", False):
    print("(lm_head.weight is tied to embed_tokens.weight: the same shard serves both)")

n_full = sum(p.numel() for p in full.parameters())
for r, m in enumerate(ranks):
    n = sum(p.numel() for p in m.parameters())
    print(f"rank {r}: {n:,} parameters = {n / n_full:.2%} of the full model's {n_full:,}")

# %% [markdown]
# Read the table row by row. `qkv_proj` halves its output rows: each rank gets half the query heads
# *and* half the KV heads (this is why the engine refuses a TP size that does not divide the head
# counts). `o_proj` and `down_proj` halve their *input* columns: they are the row-parallel layers.
# `gate_up_proj` halves each of its two packed parts. The norms are small and copied whole to every
# rank (replicated), which is why a rank holds a little more than half of the parameters.
#
# ## 2. Do the split by hand and check it adds up
#
# Now the same shards on the CPU with real numbers: each rank's parameters are filled by the
# layer's own `weight_loader` from the full model's weights (the same code that shards a
# checkpoint at load time). Outside a multi-process run the all-reduce inside a row-parallel layer
# does nothing, so each rank's MLP returns its **partial sum**; adding the partials by hand is the
# all-reduce.

# %%
# NBVAL_CHECK_OUTPUT
import torch.nn.functional as F

from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.models.qwen3 import Qwen3MLP

full_model = single.llm_engine.runner.model  # the single-process engine's model, real weights


def shard_of(make, source, rank, size):
    """Build a layer as rank `rank` of `size` would (CPU, fp32), filled from the full layer `source`."""
    with tp_scope(rank, size):
        layer = make()
    full_params = dict(source.named_parameters())
    for name, p in layer.named_parameters():
        p.weight_loader(p, full_params[name].data.float().cpu())  # the loader slices this rank's part
    return layer


src_mlp = full_model.model.layers[0].mlp
mlp_full = shard_of(lambda: Qwen3MLP(hf), src_mlp, 0, 1)
mlp_ranks = [shard_of(lambda: Qwen3MLP(hf), src_mlp, r, TP) for r in range(TP)]

torch.manual_seed(0)
x = torch.randn(5, hf.hidden_size)
with torch.inference_mode():
    y_full = mlp_full(x)
    partial = []
    for r, mlp in enumerate(mlp_ranks):
        h = mlp.gate_up_proj(x)            # column-parallel: this rank's features only
        a = mlp.act_fn(h)                  # SiLU(gate) * up, element by element: local
        y = mlp.down_proj(a)               # row-parallel: a partial sum of the full output
        partial.append(y)
        print(f"rank {r}: x {tuple(x.shape)} -> gate_up {tuple(h.shape)} -> act {tuple(a.shape)} "
              f"-> down (partial) {tuple(y.shape)}")
    print("each partial alone equals the full MLP output:", any(torch.allclose(y, y_full, atol=1e-5) for y in partial))
    print("sum of the partials equals the full MLP output (atol 1e-5):", torch.allclose(sum(partial), y_full, atol=1e-5))

    V, Hd = hf.vocab_size, hf.hidden_size
    src_emb, src_head = full_model.model.embed_tokens, full_model.lm_head
    emb_ranks = [shard_of(lambda: VocabParallelEmbedding(V, Hd), src_emb, r, TP) for r in range(TP)]
    head_ranks = [shard_of(lambda: ParallelLMHead(V, Hd), src_head, r, TP) for r in range(TP)]
    ids = torch.tensor([3, 100, V - 1])
    parts = []
    for r, e in enumerate(emb_ranks):
        print(f"rank {r} embedding and LM head own token ids [{e.vocab_start}, {min(e.vocab_end, V)})")
        inside = (ids >= e.vocab_start) & (ids < e.vocab_end)
        parts.append(F.embedding(torch.where(inside, ids - e.vocab_start, 0), e.weight) * inside[:, None])
    full_table = src_emb.weight.float().cpu()
    print("embedding: sum over ranks (an all-reduce) equals the full lookup:",
          torch.allclose(sum(parts), full_table[ids]))
    hid = torch.randn(2, Hd)
    logits = torch.cat([F.linear(hid, h.weight) for h in head_ranks], dim=-1)[:, :V]
    print("LM head: logits concatenated over ranks (an all-gather) equal the full logits:",
          torch.allclose(logits, F.linear(hid, src_head.weight.float().cpu()), atol=1e-4))

# %% [markdown]
# The partial sums are each wrong on their own and right together: that is exactly what the
# row-parallel layer's all-reduce repairs. The embedding uses the same idea (each rank looks up the
# ids it owns, zeros elsewhere, an all-reduce adds them) and the LM head gathers each rank's slice of
# the vocabulary.
#
# ## 3. Two real processes
#
# `tensor_parallel_size=2` makes the engine start one worker process (rank 1); the notebook's own
# process is rank 0. Rank 0 runs the scheduler and the block manager exactly as before, and before
# every step **broadcasts the step's inputs** (token ids, positions, slot mapping, block tables) to
# the workers; then every rank runs its shard of the model, and only rank 0 samples. Starting a
# fresh Python process that imports torch and builds its shard takes a few seconds:

# %%
t0 = time.perf_counter()
tp_llm = LLM(MODEL, device=DEVICE, num_kvcache_blocks=64, max_num_seqs=8, tensor_parallel_size=TP)
start_s = time.perf_counter() - t0
runner = tp_llm.llm_engine.runner
print(describe(tp_llm))
print(f"started {TP} ranks in {start_s:.1f} s; worker process ids {runner.worker_pids}; "
      f"KV cache {runner.num_kv_blocks} blocks per rank")

# %%
# NBVAL_CHECK_OUTPUT
PROMPTS = ["The module provides", "Return a new list containing", "If the object supports len()"]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
one = single.generate(PROMPTS, greedy, use_tqdm=False)
two = tp_llm.generate(PROMPTS, greedy, use_tqdm=False)
for a, b in zip(one, two):
    print(f"{a.prompt!r}")
    print(f"   1 process : {a.outputs[0].token_ids}")
    print(f"  {TP} processes: {b.outputs[0].token_ids}")
print("identical greedy tokens:", all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(one, two)))

# %% [markdown]
# Same tokens. Not a coincidence of a tiny model: the split computes the same sums, only in a
# different order (two halves added at the end instead of one long dot product), so the logits
# differ by rounding at most, and the greedy choice is the same unless two tokens are nearly tied.
#
# ### Step it yourself
#
# The stepper drives the two-process engine one `step()` at a time. Nothing in it knows about the
# second process: the engine loop, the scheduler and the KV block bookkeeping are rank 0's alone,
# and each step's time includes the communication with rank 1.

# %%
from widgets import EngineStepper

stepper = EngineStepper(tp_llm, prompt="The module provides", max_tokens=8)
stepper.add_request("Return a new list containing", max_tokens=8)
stepper.step()  # the prefill
stepper.step()  # one decode step
stepper.display()

# %%
# NBVAL_CHECK_OUTPUT
for i, r in enumerate(stepper.steps[:2]):
    print(f"stepper step {i}: {r.phase}, {r.num_tokens} tokens, KV blocks in use {r.kv_blocks_used}")
stepper.reset()

# %% [markdown]
# ## 4. How many all-reduces per step?
#
# **From the structure.** Each decoder layer has two row-parallel layers (`o_proj`, `down_proj`),
# so two all-reduces; the vocabulary-split embedding adds one; the LM head adds one all-gather in
# each step that samples. Counting the modules of rank 0's shard:

# %%
# NBVAL_CHECK_OUTPUT
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import RowParallelLinear

shard = runner.model
n_row = sum(isinstance(m, RowParallelLinear) for m in shard.modules())
n_emb = sum(type(m) is VocabParallelEmbedding for m in shard.modules())
n_head = sum(isinstance(m, ParallelLMHead) for m in shard.modules())
L = hf.num_hidden_layers
print(f"RowParallelLinear modules: {n_row} ({n_row // L} per layer x {L} layers)")
print(f"all-reduces per forward pass: {n_row} + {n_emb} (embedding) = {n_row + n_emb} = 2 x {L} + 1")
print(f"all-gathers per sampling step: {n_head} (LM head)")

# %% [markdown]
# **By counting the calls.** The layers call `tensor_model_parallel_all_reduce` and
# `tensor_model_parallel_all_gather` through their module's global names, and rank 0 sends each
# step's inputs with `minivllm.executor.launch.broadcast`. Wrapping those three names in this
# process counts every call on rank 0 and times it (every rank makes the same calls; a collective
# only completes when all ranks join it). The wrappers are removed afterwards.

# %%
import contextlib
from collections import defaultdict

import minivllm.executor.launch as launch_mod
import minivllm.layers.embedding as embedding_mod
import minivllm.layers.linear as linear_mod

calls = defaultdict(list)  # kind -> [(seconds, bytes), ...] since the last reset


def timed(kind, fn, tensor_arg=0):
    """`fn` wrapped to record (seconds, bytes of its tensor argument) in calls[kind]."""
    def wrapper(*args, **kwargs):
        t = args[tensor_arg]
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        calls[kind].append((time.perf_counter() - t0, t.numel() * t.element_size()))
        return out
    return wrapper


@contextlib.contextmanager
def counting_collectives():
    # (module, global name, what it is, position of the tensor argument)
    patched = [(linear_mod, "tensor_model_parallel_all_reduce", "all-reduce", 0),
               (embedding_mod, "tensor_model_parallel_all_reduce", "all-reduce", 0),
               (embedding_mod, "tensor_model_parallel_all_gather", "all-gather", 0),
               (launch_mod, "broadcast", "broadcast (inputs)", 1)]  # broadcast(group, tensor, root)
    originals = [getattr(mod, name) for mod, name, _, _ in patched]
    for (mod, name, kind, arg), fn in zip(patched, originals):
        setattr(mod, name, timed(kind, fn, arg))
    try:
        yield
    finally:
        for (mod, name, _, _), fn in zip(patched, originals):
            setattr(mod, name, fn)


engine = tp_llm.llm_engine
steps = []
with counting_collectives():
    engine.add_request("count", PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while engine.has_unfinished_requests():
        calls.clear()
        rec = engine.step_with_record().record
        steps.append((rec, {k: list(v) for k, v in calls.items()}))
print(f"{len(steps)} steps recorded")

# %%
# NBVAL_CHECK_OUTPUT
for rec, c in steps[:3]:
    counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(c.items()))
    sizes = ", ".join(f"{k} {v[0][1]:,} B" for k, v in sorted(c.items()) if k != "broadcast (inputs)")
    print(f"{rec.phase:7s} step of {rec.num_tokens:2d} tokens: {counts}")
    print(f"        bytes per call: {sizes}")
print("every decode step:", {k: len(v) for k, v in steps[-1][1].items()})

# %% [markdown]
# The count matches the structure: `2 x layers + 1` all-reduces per forward pass, one all-gather
# when a token is sampled, and two broadcasts (a small header, then the payload) for the inputs.
# The bytes per all-reduce are `tokens x hidden size x bytes per value`: a prefill step moves a
# whole prompt's activations per call, a decode step one token's worth per sequence.
#
# ## 5. What share of a step is communication?
#
# Same wrapper, now a small batch of requests so the steps have some work, timing every collective
# on rank 0 and comparing with the step's model time (`StepRecord.model_ms`: on rank 0 of a
# tensor-parallel engine, the broadcast of the inputs and the forward pass with its collectives) and
# with the same workload on the single process.

# %%
import pandas as pd

import itertools

BATCH = [f"{p} and" for p in PROMPTS] + PROMPTS
work = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
request_ids = itertools.count()


def run_records(llm):
    e = llm.llm_engine
    for i, p in enumerate(BATCH):
        e.add_request(f"share-{next(request_ids)}", p, work)
    out = []
    while e.has_unfinished_requests():
        calls.clear()
        rec = e.step_with_record().record
        out.append((rec, {k: sum(s for s, _ in v) * 1e3 for k, v in calls.items()}))
    return out


run_records(single)  # warm-up
one_steps, tp_steps = [], []
with counting_collectives():
    run_records(tp_llm)  # warm-up
for rep in range(2):  # interleaved, so both engines see the same background load
    with counting_collectives():
        tp_steps += run_records(tp_llm)
    one_steps += run_records(single)

rows = []
for label, recs in (("1 process", one_steps), (f"{TP} processes", tp_steps)):
    for rec, c in recs:
        rows.append(dict(engine=label, phase=rec.phase, tokens=rec.num_tokens, wall_ms=rec.wall_ms,
                         model_ms=rec.model_ms, all_reduce_ms=c.get("all-reduce", 0.0),
                         all_gather_ms=c.get("all-gather", 0.0), broadcast_ms=c.get("broadcast (inputs)", 0.0)))
df = pd.DataFrame(rows)
df["comm_ms"] = df.all_reduce_ms + df.all_gather_ms + df.broadcast_ms
summary = df.groupby(["engine", "phase"])[["tokens", "wall_ms", "model_ms", "comm_ms", "all_reduce_ms",
                                           "all_gather_ms", "broadcast_ms"]].median()
summary.round(3)

# %%
import plotly.graph_objects as go

from widgets import show_figure

tp_rows = df[df.engine == f"{TP} processes"]
med = tp_rows.groupby("phase")[["model_ms", "all_reduce_ms", "all_gather_ms", "broadcast_ms"]].median()
one_med = df[df.engine == "1 process"].groupby("phase").model_ms.median()
fig = go.Figure()
# model_ms times TPModelRunner.forward_logits: the broadcast of the inputs, then the forward pass.
compute = (med.model_ms - med.all_reduce_ms - med.all_gather_ms - med.broadcast_ms).clip(lower=0)
fig.add_bar(x=med.index, y=compute, name="rank 0: forward pass minus collectives", marker_color="#4c78a8")
fig.add_bar(x=med.index, y=med.all_reduce_ms, name="all-reduce", marker_color="#e4572e")
fig.add_bar(x=med.index, y=med.all_gather_ms, name="all-gather (logits)", marker_color="#f0a202")
fig.add_bar(x=med.index, y=med.broadcast_ms, name="broadcast of the step's inputs", marker_color="#9c755f")
fig.add_scatter(x=one_med.index, y=one_med.values, mode="markers", marker=dict(symbol="diamond", size=14,
                color="black"), name="1 process: forward pass")
fig.update_layout(barmode="stack", height=380, yaxis_title="median ms per step",
                  title=f"Where a tensor-parallel step's time goes (measured, {TP} ranks, "
                        f"{single.llm_engine.source.name}, {single.llm_engine.config.device})")
show_figure(fig)
for phase in med.index:
    r = med.loc[phase]
    comm = r.all_reduce_ms + r.all_gather_ms + r.broadcast_ms
    print(f"{phase:8s}: communication {comm:.2f} ms of a {r.model_ms:.2f} ms forward "
          f"({comm / r.model_ms:.0%}); the single process's forward: {one_med[phase]:.2f} ms")
ar = [s for _, c in steps for s, _ in c.get("all-reduce", [])]
print(f"one all-reduce on this machine: median {1e6 * pd.Series(ar).median():.0f} µs")
for phase in med.index:
    print(f"{phase:8s}: {TP}-process forward / 1-process forward = {med.model_ms[phase] / one_med[phase]:.2f}")

# %% [markdown]
# Read the two ratios last printed. With the embedded model on a CPU, expect the two-process step
# to be *slower* than the single process, and the chart shows where the time goes. Each all-reduce
# is a round trip between two processes through the operating system (gloo over local TCP), whose
# cost (the median printed above) hardly depends on how few bytes it carries, and a step makes `2 x layers + 1`
# of them one after the other, each waiting for the slower rank. The arithmetic saved by halving
# each matrix is small for a 4M-parameter model, so communication and synchronisation weigh heavily.
# On a shared 2-core machine the two ranks also compete with each other (and with anything else
# running) for the same cores, and a timed collective includes the wait for the other rank to
# arrive, so these figures swing from run to run; the counts above do not.
#
# Tensor parallelism pays when the other side of the balance is big: a model that does not fit one
# device at all, or layers whose matrix multiplies take much longer than an all-reduce over a fast
# link (GPUs joined by NVLink, with NCCL's all-reduce, instead of two processes talking through the
# operating system). Run this notebook on a machine with two GPUs and a real checkpoint
# (`MINIVLLM_MODEL=/path/to/Qwen3-8B`) to measure that side. The engine's multi-node launch with
# `torchrun` is described in `docs/tensor_parallel.md`.

# %%
tp_llm.shutdown()
print("worker processes still alive after shutdown:",
      [pid for pid in runner.worker_pids if os.path.exists(f"/proc/{pid}")])

# %% [markdown]
# ## 6. Check yourself

# %%
from widgets import Question, Quiz

Quiz([
    Question(
        "In the MLP, why is gate_up_proj column-parallel and down_proj row-parallel, and not the other way round?",
        ["It does not matter; any pairing needs the same communication",
         "Column then row leaves the intermediate split by feature, which SiLU can process locally, "
         "so only one all-reduce is needed at the end",
         "Row-parallel layers are faster, so the larger matrix must be row-parallel",
         "The checkpoint stores gate_up transposed"],
        1,
        ["Row first would give partial sums after gate_up; SiLU is not linear, so they would have to be "
         "all-reduced before the activation, and then again after down_proj: two collectives instead of one.",
         "Right: the column-parallel output is already split the way the row-parallel input needs it, and "
         "the activation works element by element, so nothing crosses ranks until down_proj's all-reduce.",
         "Both splits do the same arithmetic per rank (half of the multiply-adds); what differs is where the "
         "communication falls.",
         "The weight layout in the checkpoint is sliced at load time either way (weight_loader); it does not "
         "decide the pairing."],
    ),
    Question(
        "A model has 28 decoder layers. How many all-reduces does one forward pass make at TP=2 in minivllm?",
        ["2", "28", "57", "112"],
        2,
        ["Two per layer, not two per model: every layer has its own o_proj and down_proj.",
         "Each layer has two row-parallel layers (o_proj and down_proj), each with its own all-reduce.",
         "Right: 2 x 28 for the row-parallel layers plus 1 for the vocabulary-split embedding (the LM head "
         "uses an all-gather, counted separately).",
         "The count does not grow with the number of ranks or of heads: one collective per row-parallel layer."],
    ),
    Question(
        "On this CPU the two-process engine was slower than one process. What would change that?",
        ["More threads per process", "Bigger matrices per layer and a faster link between ranks",
         "A larger KV cache", "Sampling on every rank"],
        1,
        ["Threads help arithmetic, and the embedded model's arithmetic is already a small part of a step: "
         "the time went to the collectives.",
         "Right: TP wins when the compute it halves is much larger than the fixed cost of 2L+1 collectives; "
         "large models on GPUs joined by NVLink are that case.",
         "The KV cache size sets how many tokens fit, not how long a step takes.",
         "Sampling is a tiny part of a step, and it needs the full logits, which is why it happens once on "
         "rank 0."],
    ),
]).display()

# %% [markdown]
# ## Takeaways
#
# * Tensor parallelism splits every weight matrix: column-parallel layers split their outputs,
#   row-parallel layers split their inputs and all-reduce the partial sums. Chained column → row,
#   a layer needs a single collective.
# * In minivllm each decoder layer makes 2 all-reduces, plus one for the embedding and an
#   all-gather of the logits: `2L + 1` collectives per step, counted above from the modules and
#   from the calls.
# * The engine loop is unchanged: rank 0 schedules, broadcasts the step's inputs, and samples; the
#   two-process engine produced the same greedy tokens as one process.
# * Whether it pays is a measurement: on a CPU with a tiny model the collectives dominate each
#   step; on GPUs with large layers and fast links the halved compute wins.
#
# Next: chapter 11, optimizations: CUDA graphs, torch.compile and attention kernels.
