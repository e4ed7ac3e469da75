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
# # 10 · Parallelism: one model, two processes
#
# **Goal:** understand how tensor parallelism splits a model's weights across ranks, which
# collective operations that costs every step, and how to tell from a measurement whether it pays.
#
# **Prerequisites:** chapter 02 (the Qwen3 layers: attention with `qkv_proj`/`o_proj`, the MLP with
# `gate_up_proj`/`down_proj`, the embedding and LM head) and chapter 05 (the engine step: schedule,
# run the model, sample). A matrix multiply written as dot products.
#
# **Time:** about 45 minutes (reading and running).
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
# a two-process engine and check it produces the same tokens as one process · predict, then count,
# the collective calls of a step and the bytes each carries · predict, then measure, how a
# two-process step's forward compares with one process's here, and how much of it goes to the collective
# calls (their transfers and the waits between the ranks).

# %% [markdown]
# ## Setup
#
# `MODEL` is the embedded `minivllm-tiny` unless `MINIVLLM_MODEL` names another (a Qwen3
# checkpoint directory or `random:qwen3-0.6b`). `TP` is the number of ranks.

# %% tags=["parameters"]
import os

# Threads that finish their share of an operation early spin, by default, waiting for the next
# one. On a machine shared with other busy processes that spinning steals the cores the other
# threads need, and small steps can get several times slower (the README's busy-machine row has
# measured cases). PASSIVE lets waiting threads sleep; it is
# read when torch loads its OpenMP runtime, so it must be set before `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import time

import torch

# minivllm logs its startup (device, backend, KV cache size) at INFO; the course keeps those lines
# out of the cells' outputs unless MINIVLLM_LOGGING_LEVEL says otherwise (set before the import).
os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")
from minivllm import LLM, SamplingParams
from minivllm.utils.env_report import cpu_name, describe

MODEL = os.environ.get("MINIVLLM_MODEL")  # None -> the embedded minivllm-tiny
DEVICE = "auto"                            # CUDA when available (then one GPU per rank), else CPU (gloo)
TP = 2                                     # tensor-parallel ranks

# %%
if DEVICE == "auto" and torch.cuda.is_available() and torch.cuda.device_count() < TP:
    DEVICE = "cpu"  # tensor parallelism on CUDA needs one GPU per rank
    print(f"{torch.cuda.device_count()} GPU(s) for {TP} ranks: running both engines on the CPU (gloo)")
# Eager, like the tensor-parallel engine below (which records no decode graphs: a minivllm limitation;
# vLLM captures CUDA graphs with tensor parallelism too): section 5 compares
# the two step for step, and a graph replay would make the single process faster for a reason that
# has nothing to do with splitting the work (chapter 11 measures what graphs save).
single = LLM(MODEL, device=DEVICE, num_kvcache_blocks=64, max_num_seqs=8, enforce_eager=True)
hf = single.llm_engine.source.hf_config
print(describe(single))
# Names the run in the chart title: model, dtype, device and threads. The single process and rank 0 (this
# process) run torch's thread count; each other rank gets that count divided by the ranks
# (minivllm/executor/tp_runner.py), at least one.
THREADS = torch.get_num_threads()
_dev = single.llm_engine.config.device
RUN = (f"{single.llm_engine.source.name}, {str(single.llm_engine.config.dtype).replace('torch.', '')}, "
       + (f"{_dev} ({cpu_name()}, {os.cpu_count()} cores), " if _dev.type == "cpu" else
          f"{_dev} ({torch.cuda.get_device_name(_dev)}), ")
       + (f"{THREADS} thread(s) per process and rank" if max(1, THREADS // TP) == THREADS else
          f"{THREADS} threads for the single process and rank 0, {max(1, THREADS // TP)} for the other rank(s)"))
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
rank_share = []
for r, m in enumerate(ranks):
    n = sum(p.numel() for p in m.parameters())
    rank_share.append(n / n_full)
    print(f"rank {r}: {n:,} parameters = {n / n_full:.2%} of the full model's {n_full:,}")

# %% [markdown]
# Read the table row by row. `qkv_proj` halves its output rows: each rank gets half the query heads
# *and* half the KV heads (this is why the engine refuses a TP size that does not divide the head
# counts; vLLM instead gives each rank a copy of one KV head when the TP size exceeds the number of KV
# heads, which the TP size must then be a multiple of). `o_proj` and `down_proj` halve their *input* columns: they are the row-parallel layers.
# `gate_up_proj` halves each of its two packed parts. The norms are small and copied whole to every
# rank (replicated), so a rank should hold a little more than half of the parameters:

# %%
from widgets import check_claim, check_prediction, idle_engine, render

_ = check_claim(f"each rank holds a little more than 1/{TP} of the parameters (the replicated norms)",
                all(1 / TP < share < 1 / TP + 0.05 for share in rank_share),
                ", ".join(f"rank {r}: {share:.2%}" for r, share in enumerate(rank_share)))

# %% [markdown]
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
    partial_alone_ok = any(torch.allclose(y, y_full, atol=1e-5) for y in partial)
    partial_sum_ok = torch.allclose(sum(partial), y_full, atol=1e-5)
    print("a partial alone equals the full MLP output:", partial_alone_ok)
    print("sum of the partials equals the full MLP output (atol 1e-5):", partial_sum_ok)

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
    embedding_ok = torch.allclose(sum(parts), full_table[ids])
    print("embedding: sum over ranks (an all-reduce) equals the full lookup:", embedding_ok)
    hid = torch.randn(2, Hd)
    logits = torch.cat([F.linear(hid, h.weight) for h in head_ranks], dim=-1)[:, :V]
    head_ok = torch.allclose(logits, F.linear(hid, src_head.weight.float().cpu()), atol=1e-4)
    print("LM head: logits concatenated over ranks (an all-gather) equal the full logits:", head_ok)

# %% [markdown]
# The partial sums should each be wrong on their own and right together: that is exactly what the
# row-parallel layer's all-reduce repairs. The embedding uses the same idea (each rank looks up the
# ids it owns, zeros elsewhere, an all-reduce adds them) and the LM head gathers each rank's slice of
# the vocabulary. Checked on this run:

# %%
_ = check_claim("each rank's MLP partial sum is wrong alone and the sum of the partials is right",
                partial_sum_ok and not partial_alone_ok,
                f"a partial alone matches: {partial_alone_ok}; the sum matches: {partial_sum_ok}")
_ = check_claim("the embedding (all-reduce) and LM head (all-gather) shards rebuild the full results",
                embedding_ok and head_ok, f"embedding: {embedding_ok}; LM head: {head_ok}")

# %% [markdown]
# ## 3. Two real processes
#
# `tensor_parallel_size=2` makes the engine start one worker process (rank 1); the notebook's own
# process is rank 0. Rank 0 runs the scheduler and the block manager exactly as before, and before
# every step **broadcasts the step's inputs** to the workers, in two broadcasts: a small fixed-size
# header (the command and the sizes of what follows), then one payload tensor packing the token ids,
# positions, slot mapping, sequence lengths, block tables and the rows to compute logits for (`pack_step` in
# `minivllm/executor/worker.py`; a worker needs the header's sizes to allocate the payload before it
# can receive it). Then every rank runs its shard of the model, and only rank 0 samples. Starting a
# fresh Python process that imports torch and builds its shard takes a while (the cell prints how
# long).
#
# Interrupting a cell (Kernel > Interrupt) while this engine runs a step waits until rank 0 has done
# its part of the step's collectives (stopped in the middle of one, the ranks would no longer be in
# step), then rolls the step back as on one process: the engine goes on serving. If a worker fails,
# the engine's next use says so: run this cell again to start a new one (it shuts the old one down
# first), then the cell you were running.

# %%
if "tp_llm" in globals():  # run again: the previous engine's worker goes first (a widget may still hold it)
    tp_llm.shutdown()
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
same_tokens = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(one, two))
print("identical greedy tokens:", same_tokens)

# %% [markdown]
# The two engines should give the same tokens, and not by a coincidence of a tiny model: the split
# computes the same sums, only in a different order (two halves added at the end instead of one long
# dot product), so the logits differ by rounding at most, and the greedy choice is the same unless
# two tokens are nearly tied.

# %%
_ = check_claim(f"{TP} processes give the same greedy tokens as one", same_tokens,
                f"{len(PROMPTS)} prompts x 12 tokens compared",
                why_it_may_not="A near-tie between the two most likely tokens can flip under a different "
                               "summation order; a bigger model in bf16 makes that more likely.")

# %% [markdown]
# ### Step it yourself
#
# The stepper drives the two-process engine one `step()` at a time. Nothing in it knows about the
# second process: the engine loop, the scheduler and the KV block bookkeeping are rank 0's alone,
# and each step's time includes the communication with rank 1. The two steps shown are single
# steps, each timed once, so one slow moment (another process, or a first call that prepares what
# later calls reuse) shows in full: section 5 times many steps and compares their medians and fastest ones.

# %%
from widgets import EngineStepper

# prompt= and max_tokens= only fill the widget's form; add_request below submits the one request.
stepper = EngineStepper(tp_llm, prompt="The module provides", max_tokens=8)
stepper.reset()  # an idle engine, also when this cell runs again (Reset aborts whatever is left)
stepper.add_request("Return a new list containing", max_tokens=8)
stepper.step()  # the prefill
stepper.step()  # one decode step
stepper.display()

# %%
# NBVAL_CHECK_OUTPUT
for i, r in enumerate(stepper.steps[:2]):  # (the chart's x axis counts the engine's steps since it started)
    print(f"the stepper's step {i + 1} of 2: {r.phase}, {r.num_tokens} tokens, KV blocks in use {r.kv_blocks_used}")

# %% [markdown]
# ## 4. How many collectives per step?
#
# Every rank must join every collective, so their number per step is a fixed cost that no amount
# of work saved can hide. Predict it before counting.
#
# ### Exercise 1 · Collective calls in one decode step
#
# From what you know so far (sections 1 to 3): how many collective calls (all-reduces, all-gathers
# and broadcasts together) does rank 0 make in one decode step of this model? The setup cell printed
# its number of layers.

# %% tags=["exercise"]
my_prediction_1 = None  # your guess: collective calls per decode step on rank 0 (calls)

# %% [markdown]
# ### Exercise 2 · Bytes in one all-reduce
#
# The counting run below prefills one prompt (the next cell prints its length in tokens). How many
# bytes does one all-reduce carry in that prefill step? The setup cell printed the hidden size; the
# activations are in the model's dtype.

# %% tags=["exercise"]
count_prompt_tokens = len(tp_llm.llm_engine.encode_prompt(PROMPTS[1])[1])
print(f"{PROMPTS[1]!r}: {count_prompt_tokens} tokens; hidden size {hf.hidden_size}; "
      f"dtype {str(single.llm_engine.config.dtype).replace('torch.', '')}")
my_prediction_2 = None  # your guess: bytes carried by one all-reduce in that prefill step (B)

# %% [markdown]
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
# only completes when all ranks join it). The wrappers are removed afterwards. The cell first aborts
# whatever the stepper above still has running (its request, unless you ran it to the end), so that
# the counted steps hold only the cell's own request; it prints the ids it aborted.

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


idle_engine(tp_llm)  # what the stepper above (or a click in it) left running would join these steps
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

# %%
decode_counts = {k: len(v) for k, v in steps[-1][1].items()}
CALLS_PER_STEP = sum(decode_counts.values())
N_AR, N_AG, N_BC = (decode_counts.get(k, 0) for k in ("all-reduce", "all-gather", "broadcast (inputs)"))
prefill_rec, prefill_calls = steps[0]
prefill_ar_bytes = prefill_calls["all-reduce"][0][1]
value_bytes = full_model.model.embed_tokens.weight.element_size()
_ = check_prediction(my_prediction_1, CALLS_PER_STEP, rel_tol=0, unit="calls",
                     what="collective calls per decode step on rank 0")
_ = check_prediction(my_prediction_2, prefill_ar_bytes, rel_tol=0.05, unit="B",
                     what=f"bytes per all-reduce in the {prefill_rec.num_tokens}-token prefill step")
_ = check_claim("the all-reduces per forward pass are 2 x layers + 1", N_AR == 2 * L + 1,
                f"{N_AR} counted, 2 x {L} + 1 = {2 * L + 1}")
_ = check_claim("an all-reduce carries tokens x hidden size x bytes per value",
                all(b == r.num_tokens * hf.hidden_size * value_bytes for r, c in steps for _, b in c["all-reduce"]),
                f"prefill: {prefill_rec.num_tokens} x {hf.hidden_size} x {value_bytes} = {prefill_ar_bytes:,} B")
prefill_counts = {k: len(v) for k, v in prefill_calls.items()}
_ = check_claim("prefill and decode steps make the same collective calls", prefill_counts == decode_counts,
                f"prefill {prefill_counts}, decode {decode_counts}")
_ = render(f"So one step of this {L}-layer model costs rank 0 **{CALLS_PER_STEP} collective calls**: "
           f"{N_AR} all-reduces (2 x {L} + 1), {N_AG} all-gather of the logits and {N_BC} broadcasts of the "
           f"step's inputs{', in prefill and decode steps alike' if prefill_counts == decode_counts else ''}. "
           "What changes with the step is the bytes: a prefill step moves "
           "a whole prompt's activations per all-reduce, a decode step one token's worth per sequence.")

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# **Exercise 1.** Count the places where ranks must meet. Each decoder layer has two row-parallel
# layers, `o_proj` and `down_proj`, and each ends in an all-reduce: `2L`. The vocabulary-split
# embedding adds one all-reduce (each rank looks up only the ids it owns): `2L + 1` for the forward
# pass. A step that samples adds the LM head's all-gather, since sampling needs every rank's slice
# of the logits. And before any of that, rank 0 broadcasts the step's inputs; minivllm sends them
# as two broadcasts (a small header with the sizes, then the payload), as section 3 said. With the
# layer count printed by the setup cell that gives the figure measured above. The count does not
# depend on the batch size or the prompt's length: every step that samples makes the same calls. (A
# step that samples nothing, such as one computing only a first chunk of a long prompt under chunked
# prefill, computes no logits and so skips the all-gather.)
#
# **Exercise 2.** A row-parallel layer's all-reduce adds the ranks' partial outputs, one row of
# `hidden_size` values per token in the step. In a prefill step every prompt token is in the step,
# so one all-reduce carries `tokens x hidden_size x bytes per value` (4 bytes in fp32, 2 in bf16).
# With the numbers printed by the exercise cell that is the measured figure. A decode step of one
# sequence carries a single token's row: the same call, smaller by the prompt's length in tokens.
#
# </details>
#
# ## 5. What share of a step is spent in collectives?
#
# Same wrapper, now a small batch of requests so the steps have some work, timing every collective
# on rank 0 and comparing with the step's model time (`StepRecord.model_ms`: on rank 0 of a
# tensor-parallel engine, the broadcast of the inputs and the forward pass with its collectives) and
# with the same workload on the single process. Both engines run every step eagerly (a
# tensor-parallel engine records no decode graphs in minivllm, and `single` was made with
# `enforce_eager=True`),
# so the comparison is of the split alone.
#
# ### Exercise 3 · Two processes against one
#
# Each rank holds half of every weight matrix, so it reads half the weights and does half the
# multiply-adds; but it still issues every operation of the forward, each with the host's fixed cost
# (chapter 11), which the split does not halve. And a decode step makes the collective calls you just
# counted. On this machine, how
# long does a decode step's forward pass take with two processes, as a multiple of the single
# process's (1.0 = as fast, 0.5 = twice as fast, 2 = twice as slow)? The check compares your figure
# with the ratio of the two engines' *median* decode forwards and with the ratio of their *fastest*
# steps, whichever it is nearer, with a wide tolerance: how long the ranks wait for each other moves
# from run to run, and a busy machine can pull the two ratios far apart. The
# exercise cell prints what section 4's run measured of the collective calls, and the single process's
# decode forward on this batch and at batch 1 (medians, as the check; what does not grow with the
# batch is mostly that fixed cost): weigh the time saved against the time added.

# %% tags=["exercise"]
import statistics

ar_in_decode = [s for rec, c in steps if rec.phase == "decode" for s, _ in c.get("all-reduce", [])]
print(f"section 4's run: {CALLS_PER_STEP} collective calls per decode step; one all-reduce took "
      f"{1e6 * min(ar_in_decode):.0f} µs at the fastest, {1e6 * statistics.median(ar_in_decode):.0f} µs at the median "
      "(the wait for the other rank included)")
BATCH = [f"{p} and" for p in PROMPTS] + PROMPTS  # the batch the next cell times
idle_engine(single)
for i, p in enumerate(BATCH):
    single.llm_engine.add_request(f"probe-{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
probe = []
while single.llm_engine.has_unfinished_requests():
    probe.append(single.llm_engine.step_with_record().record)
print(f"1 process, a decode step of {probe[-1].num_tokens} sequences: forward "
      f"{statistics.median(r.model_ms for r in probe if r.phase == 'decode'):.2f} ms at the median "
      f"({min(r.model_ms for r in probe if r.phase == 'decode'):.2f} ms at the fastest)")
single.llm_engine.add_request("probe-b1", BATCH[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
probe_b1 = []
while single.llm_engine.has_unfinished_requests():
    probe_b1.append(single.llm_engine.step_with_record().record)
one_b1_ms = statistics.median(r.model_ms for r in probe_b1[4:] if r.phase == "decode")  # past the first steps
print(f"1 process, a decode step of 1 sequence: forward {one_b1_ms:.2f} ms at the median")
my_prediction_3 = None  # your guess: 2-process decode forward time / 1-process decode forward time (x)

# %%
import pandas as pd

import itertools

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


idle_engine(tp_llm)  # only this cell's requests in the steps it times
run_records(single)  # warm-up
one_steps, tp_steps = [], []
with counting_collectives():
    run_records(tp_llm)  # warm-up
for rep in range(8):  # interleaved, so both engines see the same background load
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
# rank 0's own work in each step: its forward minus the time it spent inside collective calls
df["rest_ms"] = df.model_ms - df.all_reduce_ms - df.all_gather_ms - df.broadcast_ms
summary = df.groupby(["engine", "phase"])[["tokens", "wall_ms", "model_ms", "all_reduce_ms",
                                           "all_gather_ms", "broadcast_ms"]].median()
summary.round(3).T  # one column per engine and phase

# %% [markdown]
# Each figure in the table is a median over that engine's steps of that phase, taken column by
# column, so the medians of the parts need not add up to the median of the whole (they can come from
# different steps). `wall_ms` is the whole step; `model_ms` its forward pass (with two processes it
# includes the broadcast of the inputs and every collective); the last three columns are the time rank
# 0 spent in each kind of collective call (zero for the single process, which makes none).

# %%
import plotly.graph_objects as go

from widgets import show_figure

tp_rows = df[df.engine == f"{TP} processes"]
med = tp_rows.groupby("phase")[["model_ms", "all_reduce_ms", "all_gather_ms", "broadcast_ms", "rest_ms"]].median()
one_med = df[df.engine == "1 process"].groupby("phase").model_ms.median()
fig = go.Figure()
# model_ms times TPModelRunner.forward_logits: the broadcast of the inputs, then the forward pass.
# The blue bar is the median over steps of each step's forward minus its collectives (rest_ms), so
# the stacked bar need not equal the forward's median exactly.
fig.add_bar(x=med.index, y=med.rest_ms, name="rank 0: forward pass minus collectives", marker_color="#4c78a8")
fig.add_bar(x=med.index, y=med.all_reduce_ms, name="all-reduce", marker_color="#e4572e")
fig.add_bar(x=med.index, y=med.all_gather_ms, name="all-gather (logits)", marker_color="#f0a202")
fig.add_bar(x=med.index, y=med.broadcast_ms, name="broadcast of the step's inputs", marker_color="#9c755f")
fig.add_scatter(x=one_med.index, y=one_med.values, mode="markers", marker=dict(symbol="diamond", size=14,
                color="black"), name="1 process: forward pass (median)")
# Every step's forward, to show the spread behind the medians.
fig.add_scatter(x=tp_rows.phase, y=tp_rows.model_ms, mode="markers", name=f"{TP} processes: each step",
                marker=dict(color="#333333", size=5, symbol="line-ew-open"))
one_rows = df[df.engine == "1 process"]
fig.add_scatter(x=one_rows.phase, y=one_rows.model_ms, mode="markers", name="1 process: each step",
                marker=dict(color="#999999", size=5, symbol="circle-open"))
fig.update_layout(barmode="stack", height=420, yaxis_title="ms per step (bars: medians)",
                  xaxis_title="step phase",
                  title=f"Where a tensor-parallel step's time goes ({TP} ranks vs 1 process)<br>"
                        f"<sup>measured: {RUN}</sup>")
show_figure(fig)
COMM_SHARE, MEDIAN_RATIO = {}, {}
# Each engine's fastest step per phase: the one least disturbed by other processes on a shared
# machine (where two processes also get a larger share of the cores than one, which flatters TP).
fastest = df.groupby(["engine", "phase"]).model_ms.min()
TP_RATIO = {ph: fastest[(f"{TP} processes", ph)] / fastest[("1 process", ph)] for ph in med.index}
for phase in med.index:
    r = med.loc[phase]
    comm = r.all_reduce_ms + r.all_gather_ms + r.broadcast_ms
    COMM_SHARE[phase] = comm / r.model_ms
    MEDIAN_RATIO[phase] = r.model_ms / one_med[phase]
    print(f"{phase:8s}: in collective calls {comm:.2f} ms (sum of the medians) of a {r.model_ms:.2f} ms forward "
          f"({COMM_SHARE[phase]:.0%}); the single process's forward: {one_med[phase]:.2f} ms")
ar_decode = [s for rec, c in steps if rec.phase == "decode" for s, _ in c.get("all-reduce", [])]
ar_prefill = [s for rec, c in steps if rec.phase == "prefill" for s, _ in c.get("all-reduce", [])]
# The fastest call of each kind is the least disturbed by other processes; the median is printed beside it.
AR_US = {"decode": 1e6 * min(ar_decode), "prefill": 1e6 * min(ar_prefill)}
print(f"one all-reduce on this machine (section 4's run), fastest / median of the calls: "
      f"{AR_US['decode']:.0f} / {1e6 * pd.Series(ar_decode).median():.0f} µs in decode steps "
      f"({steps[-1][1]['all-reduce'][0][1]:,} B), {AR_US['prefill']:.0f} / {1e6 * pd.Series(ar_prefill).median():.0f} µs "
      f"in the prefill ({prefill_ar_bytes:,} B)")
for phase in med.index:
    print(f"{phase:8s}: {TP}-process forward / 1-process forward = {TP_RATIO[phase]:.2f} (fastest steps), "
          f"{MEDIAN_RATIO[phase]:.2f} (medians)")
# both ratios measure the same thing under different noise: the prediction is set against the nearer one, by the
# check's own measure (|prediction - ratio| / ratio)
import math

try:
    p3 = None if isinstance(my_prediction_3, (bool, str, bytes)) else float(my_prediction_3)
except (TypeError, ValueError):
    p3 = None  # not a number: check_prediction says what to write
targets = {"fastest steps": TP_RATIO["decode"], "medians": MEDIAN_RATIO["decode"]}
nearer = (min(targets, key=lambda k: abs(p3 - targets[k]) / targets[k])
          if p3 is not None and math.isfinite(p3) else "medians")
_ = check_prediction(my_prediction_3, targets[nearer], rel_tol=0.5, unit="x",
                     what=f"the {TP}-process decode forward as a multiple of the 1-process one "
                          f"({nearer}, the nearer of the two)")

# %% [markdown]
# Read the ratios printed above (the fastest steps' ratio is the one least disturbed by other
# processes; the next cell says whether the medians' ratio told the same story on this
# run). With the embedded model on a CPU, expect the two-process step
# to be *slower* than the single process, and the chart shows where the time goes. Each all-reduce
# is a round trip between two processes through the operating system (gloo over local TCP), whose
# cost depends little on how few bytes it carries (measured apart at the end of this section), and a step makes
# `2 x layers + 1` of them one after the other, each waiting for the slower rank. The work saved by
# halving each matrix (half the weights to read, half the multiply-adds) is small for a model this
# size, so communication and synchronisation weigh heavily. On a machine with few cores the two ranks
# (each with its communication threads) share them with each other and with anything else running, and a timed collective
# includes the wait for the other rank to arrive, so these figures swing from run to run; the counts
# above do not. The next cell checks the direction of each of these claims on this run.

# %%
_ = check_claim(f"with {single.llm_engine.source.name} on {single.llm_engine.config.device}, the {TP}-process forward "
                f"is slower than 1 process (fastest steps)",
                all(r > 1 for r in TP_RATIO.values()),
                ", ".join(f"{ph}: {r:.2f}x" for ph, r in TP_RATIO.items()),
                why_it_may_not="On a machine loaded by other processes, two processes get a larger share of the "
                               "cores than one, which flatters the two-process engine (compare the single "
                               "process's forward with a quiet run); with a larger model (MINIVLLM_MODEL) or on "
                               "GPUs the halved work per rank (weights to read, multiply-adds) can genuinely win.")
AR_MEDIAN_US = {"decode": 1e6 * pd.Series(ar_decode).median(), "prefill": 1e6 * pd.Series(ar_prefill).median()}
wire_share = CALLS_PER_STEP * AR_US["decode"] / 1e3 / fastest[(f"{TP} processes", "decode")]  # fastest with fastest
wire_share_med = CALLS_PER_STEP * AR_MEDIAN_US["decode"] / 1e3 / med.loc["decode", "model_ms"]
_ = render(f"Time inside collective calls (all-reduces, the all-gather and the broadcasts) was **{COMM_SHARE['decode']:.0%}** "
           f"of a decode step's forward and **{COMM_SHARE['prefill']:.0%}** of a prefill step's on this run. That time "
           f"includes each call's wait for the other rank to arrive: at the fastest all-reduce of section 4 "
           f"({AR_US['decode']:.0f} µs, the least delayed of {len(ar_decode)} calls) the step's {CALLS_PER_STEP} calls "
           f"would take **{wire_share:.0%}** of the fastest decode forward, at their median "
           f"({AR_MEDIAN_US['decode']:.0f} µs, a wait included) **{wire_share_med:.0%}** of the median one, "
           + ("so most of the time in collectives was waiting. " if wire_share_med < COMM_SHARE["decode"] / 2 else
              "so by the fastest call much of the time in collectives was waiting, by the median call less "
              "clearly. " if wire_share < COMM_SHARE["decode"] / 2 else
              "about what they took here. ")
           + f"The {TP}-process decode forward took **{TP_RATIO['decode']:.2f}x** the single process's (fastest steps; "
           f"{MEDIAN_RATIO['decode']:.2f}x by the medians).")
# The two ratios "agree" here when they fall on the same side of 1 and within 20% of each other.
RATIOS_AGREE = {ph: (TP_RATIO[ph] > 1) == (MEDIAN_RATIO[ph] > 1)
                and abs(MEDIAN_RATIO[ph] / TP_RATIO[ph] - 1) < 0.2 for ph in TP_RATIO}
_ = render("The fastest steps' ratio and the medians' ratio "
           + ("**agreed** on this run" if all(RATIOS_AGREE.values()) else "**did not agree** on this run")
           + " (agreeing means on the same side of 1 and within 20% of each other: "
           + ", ".join(f"{ph} {TP_RATIO[ph]:.2f}x vs {MEDIAN_RATIO[ph]:.2f}x" for ph in TP_RATIO) + ")"
           + ("." if all(RATIOS_AGREE.values()) else
              "; the medians include the most delayed steps (waits between the ranks, other processes), so the "
              "fastest steps' ratio is the cleaner figure."))
# Section 4's all-reduces (its run's decode steps, each call timed) against those inside the timed steps above.
calls_per_decode = len(steps[-1][1]["all-reduce"])
ar_in_steps_us = 1e3 * med.loc["decode", "all_reduce_ms"] / calls_per_decode
ar_alone_us = 1e6 * pd.Series(ar_decode).median()
_ = render(f"Inside the timed decode steps an all-reduce took **{ar_in_steps_us:.0f} µs** on average "
           f"({med.loc['decode', 'all_reduce_ms']:.2f} ms over {calls_per_decode} calls, medians), against "
           f"**{ar_alone_us:.0f} µs** (median) in section 4's run of one prompt. Both were timed inside engine "
           f"steps (section 4's at batch 1, these at batch {len(BATCH)}), so both include the wait for the other "
           f"rank to reach the same call; that wait moves with the work between the calls and with the load on "
           f"the machine, and the counts do not.")
fixed_ms = min(one_b1_ms, one_med["decode"])  # the part of the forward that does not grow with the batch
halved_ms = fixed_ms + 0.5 * (one_med["decode"] - fixed_ms)
estimate = (halved_ms + CALLS_PER_STEP * ar_alone_us / 1e3) / one_med["decode"]
miss = MEDIAN_RATIO["decode"] / estimate
estimate_in_steps = (halved_ms + CALLS_PER_STEP * ar_in_steps_us / 1e3) / one_med["decode"]
_ = render(f"The worked solution's rough model below, ({fixed_ms:.2f} ms + 0.5 x ({one_med['decode']:.2f} - "
           f"{fixed_ms:.2f}) ms + {CALLS_PER_STEP} calls x {ar_alone_us:.0f} µs) / {one_med['decode']:.2f} ms, "
           f"estimates **{estimate:.2f}x** for the decode "
           f"forward. It is built from medians, so the measured figure to set it against is the medians' ratio, "
           f"**{MEDIAN_RATIO['decode']:.2f}x** (fastest steps: {TP_RATIO['decode']:.2f}x): the estimate is "
           + (f"**{miss:.1f}x too low**. With the all-reduce's time inside the timed steps as the round trip "
              f"({ar_in_steps_us:.0f} µs instead of section 4's {ar_alone_us:.0f} µs) the same formula gives "
              f"**{estimate_in_steps:.2f}x**. That is not an independent check, since it takes the all-reduces' "
              f"time from the very steps it is compared with; it says where the estimate's shortfall lies: the "
              f"calls in these steps waited longer for the other rank than section 4's batch-1 calls did."
              if miss > 1.25 else
              f"within {abs(miss - 1):.0%} of it." if miss >= 0.8 else
              f"**{1 / miss:.1f}x too high** on this run; the round trip it plugged in was section 4's "
              f"{ar_alone_us:.0f} µs, against {ar_in_steps_us:.0f} µs inside these steps"
              + (" (slower: the calls here waited less)." if ar_alone_us > ar_in_steps_us else
                 ", so the rest of the forward, not the collectives, came out below the formula's half.")))
rest_ratio = med.loc["decode", "rest_ms"] / one_med["decode"]
_ = render(f"Rank 0's own work in a decode step (its forward minus its time inside collectives, median over steps: "
           f"the chart's blue bar) took **{med.loc['decode', 'rest_ms']:.2f} ms**, **{rest_ratio:.2f}x** the single "
           f"process's whole forward ({one_med['decode']:.2f} ms, the diamond)"
           + (", not the half that splitting the matrices would suggest. This chapter does not time its parts "
              "apart; what it holds besides the halved work: the host's fixed cost per operation, which the split "
              "does not halve (each rank makes every call on its half; chapter 11 measures that cost), rank 0's "
              "packing of the step's inputs for the broadcast (the broadcast itself is the brown bar, not in this "
              "one), and, on a machine with few cores, the time a rank waits for a core the other rank or anything "
              "else running holds."
              if rest_ratio > 0.75 else "."))

# %% [markdown] tags=["solution"]
# <details><summary>Worked solution</summary>
#
# Split the two-process step into what it still computes and what it adds. Each rank reads half of
# the weights and does half of the multiply-adds, but it issues every operation, so the part of the
# single process's forward that does not grow with the batch (its batch-1 forward, printed above:
# mostly the host's fixed cost per operation) stays whole, and only the rest halves. On top of it come
# the collective calls you counted in section 4 (all-reduces, the all-gather and the broadcasts),
# one after the other, each costing about one all-reduce's round trip (the times printed above)
# whatever the bytes, plus the wait for the slower rank. A rough model:
#
#     ratio ≈ (batch-1 forward + 0.5 x (forward - batch-1 forward) + calls x round trip) / forward
#
# The ratio is above 1 whenever the calls cost more than the half of the work they save; a
# small model on a CPU, whose whole forward takes milliseconds, is that case, and the check
# cell above says whether it held here. The cell above plugged section 4's median all-reduce (as the
# round trip of every call) and the single process's median decode forwards into the formula. It is
# rough: that round trip was measured in another run, under whatever load the machine had then, and
# the formula leaves out the time a rank waits for the other (on a shared machine the two ranks also
# take turns on the cores); and it takes the batch-1 forward for the fixed part, which also holds some
# work that does halve (reading the weights). Compare the chart's "forward minus collectives" bar with
# the diamond to see what rank 0's own work came to.
# For the ratio to fall below 1 the halved work must outweigh the calls: bigger matrices, or a
# faster link.
#
# </details>
#
# Tensor parallelism pays when the other side of the balance is big: a model that does not fit one
# device at all, or layers whose matrix multiplies take much longer than an all-reduce over a fast
# link (GPUs joined by NVLink, with NCCL's all-reduce, instead of two processes talking through the
# operating system). In the decode step of a large model, which is bound by reading memory (chapter
# 06), what the split halves per rank is above all the bytes it reads: half the weights, and the KV
# cache of half the KV heads. The ranks add up their memory bandwidth, and since each rank stores only
# its heads' keys and values (while the ranks do not outnumber the KV heads: beyond that vLLM copies
# KV heads onto several ranks, and minivllm refuses to start), the same memory per device holds the KV
# cache of more tokens, with the memory the halved weights free on top. Run this
# notebook on a machine with two GPUs and a real checkpoint
# (`MINIVLLM_MODEL=/path/to/Qwen3-8B`) to measure that side. The engine's multi-node launch with
# `torchrun` is described in `docs/tensor_parallel.md`.
#
# ### An all-reduce alone: a fixed cost plus its bytes
#
# A collective's time is commonly modelled as a fixed cost per call plus its bytes over a bandwidth,
# `t = α + bytes / β` (Hockney's "alpha-beta" model). The calls timed inside engine steps above also
# hold each rank's wait for the other, which hides how the time grows with the bytes. So here two
# fresh processes do nothing but all-reduce float32 tensors of 1 KiB to 4 MiB (gloo over local TCP,
# as the CPU engine's ranks do), back to back after a barrier, the sizes taking turns so that a slow
# moment of the machine falls on all of them. The two dotted lines mark the bytes of section 4's
# decode-step and prefill all-reduces.

# %%
import math

from minivllm.bench.collectives import all_reduce_times

ar = all_reduce_times(world_size=TP, rounds=9, calls=30)
# fitted to every size's fastest round (load from other processes only ever slows a round), least squares
alpha_us, beta_bytes_per_us = ar.alpha_beta()
decode_ar_bytes = steps[-1][1]["all-reduce"][0][1]
fig = go.Figure([
    go.Scatter(x=ar.sizes_bytes, y=ar.us_per_call, mode="lines+markers", name="median of the rounds",
               error_y=dict(type="data", symmetric=False, array=[hi - m for hi, m in zip(ar.us_max, ar.us_per_call)],
                            arrayminus=[m - lo for lo, m in zip(ar.us_min, ar.us_per_call)])),
    go.Scatter(x=ar.sizes_bytes, y=ar.us_min, mode="markers", name="fastest round", marker_symbol="diamond"),
    go.Scatter(x=ar.sizes_bytes, y=[alpha_us + b / beta_bytes_per_us for b in ar.sizes_bytes], mode="lines",
               line_dash="dash", name="α + bytes / β fitted to the fastest rounds")])
for x, label in ((decode_ar_bytes, "decode step"), (prefill_ar_bytes, "prefill")):
    fig.add_vline(x=x, line_dash="dot")  # (its annotation_text would sit at x on a log axis: off the chart)
    fig.add_annotation(x=math.log10(x), y=1, yref="paper", text=label, showarrow=False, yanchor="bottom")
fig.update_layout(height=400, xaxis_type="log", yaxis_type="log", xaxis_title="bytes all-reduced (float32)",
                  yaxis_title="µs per call (bars: fastest and slowest round)",
                  title=f"One all-reduce's time against its bytes: gloo, {ar.world_size} local processes<br>"
                        f"<sup>measured: {ar.rounds} rounds of {ar.calls} calls per size, "
                        f"{cpu_name()}, {os.cpu_count()} cores, float32 tensors, "
                        f"{torch.get_num_threads()} torch thread(s) in this process</sup>")
show_figure(fig)
small, mid = ar.sizes_bytes[0], ar.sizes_bytes[3]
growth = ar.us_min[3] / ar.us_min[0]
# the model's shape: no fall between sizes beyond the noise, and a fixed cost and a bandwidth both found
shaped = ar.grows_with_bytes() and alpha_us > 0 and math.isfinite(beta_bytes_per_us)
decode_alpha_share = alpha_us / (alpha_us + decode_ar_bytes / beta_bytes_per_us)
_ = render(f"From {small:,} to {mid:,} B ({mid // small}x the bytes) the fastest round of an all-reduce took "
           f"**{growth:.2f}x** the time ({ar.us_min[0]:.0f} to {ar.us_min[3]:.0f} µs; medians {ar.us_per_call[0]:.0f} to "
           f"{ar.us_per_call[3]:.0f} µs); at {ar.sizes_bytes[-1] / 2**20:.0f} MiB it took {ar.us_min[-1] / 1e3:.1f} ms. "
           + (f"A least-squares line through the fastest rounds gives **α ≈ {alpha_us:.0f} µs** a call and "
              f"**β ≈ {beta_bytes_per_us:.0f} MB/s**, so a decode step's all-reduce ({decode_ar_bytes:,} B) is "
              f"**{decode_alpha_share:.0%}** fixed cost by this model. Section 4's decode all-reduces, timed inside "
              f"engine steps, took {AR_US['decode']:.0f} µs at the fastest and {AR_MEDIAN_US['decode']:.0f} µs at the "
              "median, each with its wait for the other rank: "
              + ("the fixed cost fitted here lies between the two."
                 if AR_US["decode"] <= alpha_us <= AR_MEDIAN_US["decode"] else
                 "the fixed cost fitted here is below even their fastest: the calls inside steps also waited."
                 if alpha_us < AR_US["decode"] else
                 "the fixed cost fitted here is above even their median, so on this run the machine's load set "
                 "these figures more than the round trip did.")
              if shaped else
              "**Inconclusive on this run**: the fastest rounds' times "
              + ("fell from one size to a larger one" if not ar.grows_with_bytes() else
                 "give no fixed cost and bandwidth both above zero")
              + ", which no fixed cost plus bytes over a bandwidth can fit, so the load on the machine moved during "
              "the sweep more than the bytes did. Run the cell again on a quieter machine before reading α and β "
              "from it.")
           + " On a machine with few cores each figure also holds the time a process waited for a core.")
_ = check_claim("the fastest round's time never falls by more than 25% from one size to a larger one",
                ar.grows_with_bytes(), ", ".join(f"{b:,} B {t:.0f} µs" for b, t in zip(ar.sizes_bytes, ar.us_min)),
                why_it_may_not="A busy machine can slow one size's rounds more than another's; run the cell again.")
_ = check_claim(f"an all-reduce's time grows much less than its bytes while they are few ({small:,} -> {mid:,} B)",
                growth < (mid / small) / 4, f"{mid // small}x the bytes, {growth:.2f}x the fastest round's time",
                why_it_may_not="A busy machine can slow one size's rounds more than another's; run the cell again.")

# %% [markdown]
# ### Playground · how an all-reduce's cost grows with its bytes
#
# A prefill step's all-reduces carry `prompt tokens x hidden size x bytes per value`. Change
# `PROMPT_TOKENS` (try 8, 64, 256, 700; the cell prints how many tokens the KV cache holds) and run the cell: it
# prefills one prompt of that length on the two-process engine and times its all-reduces against
# those of a one-token decode step. Look for where the time per all-reduce starts to grow with the
# bytes, i.e. where the link's bandwidth, not its round trip, starts to set the cost.

# %% tags=["playground"]
PROMPT_TOKENS = 256  # the knob: length of the prompt prefilled on the 2-process engine (tokens)

print(f"KV cache: {runner.num_kv_blocks * tp_llm.llm_engine.config.block_size} tokens; prompt: {PROMPT_TOKENS}")
prompt_ids = [(7 * i) % 1000 + 100 for i in range(PROMPT_TOKENS)]  # any ids of the vocabulary will do
idle_engine(tp_llm)
# a longer prompt starts with every shorter one: without this, a second run would prefill only the uncached rest
tp_llm.llm_engine.reset_prefix_cache()
per_phase = defaultdict(list)
with counting_collectives():
    tp_llm.llm_engine.add_request(f"play-{next(request_ids)}", prompt_ids,
                                  SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while tp_llm.llm_engine.has_unfinished_requests():
        calls.clear()
        rec = tp_llm.llm_engine.step_with_record().record
        per_phase[rec.phase] += calls["all-reduce"]
for phase, recorded in per_phase.items():
    times = pd.Series([s for s, _ in recorded]) * 1e6
    print(f"{phase:8s}: {recorded[0][1]:>9,} B per all-reduce, fastest {times.min():6.0f} µs, "
          f"median {times.median():6.0f} µs over {len(recorded)} calls")

# %% [markdown]
# `LLM.shutdown()` ends the worker processes too. Seen on an engine of its own, so that `tp_llm` stays up
# for the stepper and the playground above after Run All (`tp_llm.shutdown()`, or restarting the kernel,
# frees it when you are done):

# %%
spare = LLM(MODEL, device=DEVICE, num_kvcache_blocks=16, max_num_seqs=1, tensor_parallel_size=TP)
spare_pids = spare.llm_engine.runner.worker_pids
spare.shutdown()
print(f"worker processes {spare_pids}; still alive after shutdown:",
      [pid for pid in spare_pids if os.path.exists(f"/proc/{pid}")])

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
         "all-reduced before the activation, and down_proj's output, now split by feature, all-gathered: two "
         "collectives instead of one.",
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
        f"On this run the two-process decode forward took {TP_RATIO['decode']:.2f}x the single process's "
        "(fastest steps). "
        "What makes tensor parallelism pay off?",
        ["More threads per process", "Bigger matrices per layer and a faster link between ranks",
         "A larger KV cache", "Sampling on every rank"],
        1,
        [f"Threads speed up arithmetic only; they do not shorten the collectives' round trips: time inside "
         f"collective calls, the wait for the other rank included, was {COMM_SHARE['decode']:.0%} of a two-process "
         f"decode step's forward here.",
         f"Right: TP wins when the work it halves per rank (in decode above all the weight and KV bytes each "
         f"rank reads, so the ranks add up their memory bandwidth) is much larger than the fixed cost of its "
         f"collective calls ({CALLS_PER_STEP} per step here: {N_AR} all-reduces, {N_AG} all-gather, {N_BC} "
         "broadcasts); large models on GPUs joined by NVLink are that case.",
         "The KV cache size sets how many tokens fit, not how long a step takes.",
         "Sampling is a tiny part of a step, and it needs the full logits, which is why it happens once on "
         "rank 0."],
    ),
]).display()

# %% [markdown]
# ## You can now
#
# * split a linear layer column-wise (outputs) or row-wise (inputs), say which one needs an
#   all-reduce, and why chaining column → row needs a single collective per block;
# * read a tensor-parallel shard's shapes: heads and MLP width halved, norms replicated, embedding
#   and LM head split by vocabulary;
# * count a step's collective calls in minivllm: `2L + 1` all-reduces per forward pass, one
#   all-gather of the logits when sampling, and two broadcasts of the step's inputs from rank 0
#   (counted above from the modules and from the calls);
# * compute the bytes one all-reduce carries (`tokens x hidden size x bytes per value`);
# * explain why the engine loop is unchanged (rank 0 schedules, broadcasts and samples) and why the
#   greedy tokens match the single process;
# * decide from a measurement whether tensor parallelism pays: the halved work per rank (weights and
#   KV read, multiply-adds) against the fixed cost of the collectives on this link.
#
# Next: chapter 11, optimizations: CUDA graphs, torch.compile and attention kernels.
