"""Runs one scheduled step on the model: build inputs, forward, logits, sample.

The runner owns the model weights, the KV cache tensors, the attention backend and
the sampler. ``run(plan)`` turns a ``SchedulerOutput`` into flat input tensors
(every scheduled sequence's new tokens back to back), an ``AttentionMetadata``
describing where each token's K/V goes and what it attends to, runs the model, and
samples one token for each sequence whose step reached its last known token.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from itertools import accumulate
from operator import attrgetter, is_

import numpy as np
import torch

from minivllm.config import DEFAULT_CPU_KV_CACHE_BYTES
from minivllm.engine import model_check
from minivllm.engine.decode_tables import DecodeTables, block_table_array
from minivllm.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token, num_blocks_for_bytes
from minivllm.engine.kv_prefault import KVPrefaulter
from minivllm.engine.runner_config import RunnerConfig
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.layers import cpu_graph
from minivllm.layers.attention import get_attention_backend
# the eager step takes the native kernel only for queries this short (longer: gather + SDPA); a graph
# replay must make the same choice to give the same bits
from minivllm.layers.attention.cpu_decode import MAX_QUERY_LEN
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.logits_processors import row_processing
from minivllm.layers.logprobs import logprob_entries
from minivllm.layers.sampler import Sampler, SamplingBatch
from minivllm.models.hf_config import get_head_dim
from minivllm.models.registry import get_model_class
from minivllm.utils import cdiv
from minivllm.utils.model_source import ModelSource

logger = logging.getLogger("minivllm")


@dataclass
class ModelInput:
    """Flat inputs of one step.

    Attributes:
        input_ids: int64 ``[num_tokens]``.
        positions: int64 ``[num_tokens]``.
        meta: the step's ``AttentionMetadata``.
        logits_indices: int64 ``[num_sampling]``: rows of the hidden states to sample from.
        sampling_seqs: the sequences those rows belong to, in the same order (a speculative
            decode has one row per scored token: the last known token and each draft).
        drafts: speculative decodes: sequence -> (its first row, its draft token ids, the
            distributions they were drawn from or None; see ``minivllm/spec_decode/proposal.py``).
        graph_rows: set when the step was staged into the decode graphs' static
            buffers (``input_ids``/``positions``/``meta`` are then views of them, valid until
            the next stage; see :class:`StagedModelInput`): replay with
            ``graph_runner.replay(graph_rows)``.
        host: the step's host arrays, views of what was uploaded: int64 ``input_ids``,
            ``positions``, ``slot_mapping``, ``logits rows`` and the int32 block table
            ``[num_seqs, width]`` (what tensor parallelism sends to its workers without
            reading the device copies back).
        greedy: set by ``run`` when every sampled row is plain greedy and the stock sampler
            samples: :meth:`ModelRunner.forward_logits` then asks the LM head for each row's
            greedy token too (``compute_logits_and_greedy``).
        greedy_ids: what it got: int64 ``[num_sampling]`` (-1: a row with a non-finite logit), or
            ``None`` (the sampler makes its own pass over the logits).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_seqs: list[Sequence]
    drafts: dict = field(default_factory=dict)
    graph_rows: int | None = None
    host: tuple[np.ndarray, ...] | None = None
    greedy: bool = False
    greedy_ids: np.ndarray | None = None


class StagedModelInput(ModelInput):
    """A ``ModelInput`` staged into the decode graphs' static buffers (``graph_rows`` rows).
    Its ``meta`` is built when first read (views of the buffers, valid until the next stage;
    ``CudaGraphDecodeRunner.staged_meta``): a replay reads the buffers, not metadata, so a
    step nobody inspects does not build it (``staged_meta(1)`` took 4.3 us, best of 5 x 5,000;
    embedded model, CPU graphs, 2-core Xeon dev VM, 2026-12-06). Read after
    a later step was staged, it raises ``ValueError`` rather than describe that step.
    Compared by identity (the fields are views of buffers every step reuses)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(self, graph, n: int, sampling_seqs: list[Sequence], logits_indices: torch.Tensor | None = None,
                 drafts: dict | None = None):
        # every field set here, not through the dataclass __init__ (which also goes through the meta
        # property): ~0.8 -> ~0.4 us of every decode step (tests/test_cpu_graph.py holds the field list)
        self._graph, self._stage, self._meta = graph, graph.num_stages, None
        self.input_ids, self.positions = graph.static_input_ids(n), graph.static_positions(n)
        self.logits_indices, self.sampling_seqs = logits_indices, sampling_seqs
        self.drafts = {} if drafts is None else drafts
        self.graph_rows, self.host, self.greedy, self.greedy_ids = n, None, False, None

    @property
    def meta(self) -> AttentionMetadata:
        meta = self._meta
        if meta is None:
            meta = self._meta = self._graph.staged_meta(self.graph_rows, self._stage)
        return meta

    @meta.setter
    def meta(self, value: AttentionMetadata | None) -> None:
        self._meta = value

    def __repr__(self) -> str:
        meta = "<built when read>" if self._meta is None else self._meta
        return (f"StagedModelInput(graph_rows={self.graph_rows}, stage={self._stage}, input_ids={self.input_ids!r}, "
                f"positions={self.positions!r}, meta={meta!r}, logits_indices={self.logits_indices!r}, "
                f"sampling_seqs=[{len(self.sampling_seqs)} sequences], drafts={self.drafts!r})")


@dataclass
class RunnerOutput:
    """What the forward pass and sampler produced, and where the time went (ms).

    Attributes:
        seqs: the sequences that sampled, once each.
        token_ids: their (first) new token ids, same order.
        failed: those of ``seqs`` with no token to sample: their logits held NaN or inf, or (the
            sampler's -1) their own parameters masked every token or overflowed a logit.
        more_token_ids: speculative decodes: the tokens emitted after the first (accepted
            drafts' successors); absent for a sequence that emits one token.
        logprobs: aligned with ``seqs``: each new token's logprob entry
            (``minivllm/layers/logprobs.py``) or None; None when no sequence wants them.
        prompt_logprobs: sequence -> (first prompt position, entries) for the prompt positions
            computed this step by requests with ``prompt_logprobs``; None when there are none.
    """

    seqs: list[Sequence]
    token_ids: list[int]
    failed: set[Sequence]
    prepare_ms: float
    model_ms: float
    sample_ms: float
    logprobs: list | None = None
    prompt_logprobs: dict | None = None
    more_token_ids: dict = field(default_factory=dict)

    @classmethod
    def empty(cls) -> "RunnerOutput":
        """A step that scheduled nothing."""
        return cls([], [], set(), 0.0, 0.0, 0.0)


def _prompt_logprob_rows(plan: SchedulerOutput):
    """For requests with ``prompt_logprobs``: the input rows whose logits give prompt-token
    logprobs this step (the logits at position p score prompt token p + 1), and per such
    sequence ``(seq, first prompt position, count)``; None when there are none (the usual case).
    Rows follow ``ModelRunner.prepare_input``'s layout: the plan's entries back to back."""
    rows, spans, offset = None, None, 0
    for entry in plan.scheduled:
        seq = entry.seq
        if seq.prompt_logprobs is not None and entry.is_prefill and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            first = entry.start_pos + 1
            last = min(entry.start_pos + entry.num_tokens, seq.num_prompt_tokens - 1)  # exclusive
            if last > first - 1 and first <= seq.num_prompt_tokens - 1:
                count = last - first + 1
                if rows is None:
                    rows, spans = [], []
                rows.extend(range(offset, offset + count))
                spans.append((seq, first, count))
        offset += entry.num_tokens
    return None if rows is None else (rows, spans)


#: torch's default dtype is process-wide: builds take turns at setting it (another thread's own tensors
#: made meanwhile still see it, as in vLLM's builds; its engine runs in its own process)
_DEFAULT_DTYPE_LOCK = threading.Lock()


def build_model(source: ModelSource, device: torch.device, dtype: torch.dtype, seed: int | None,
                quant_config=None) -> torch.nn.Module:
    """The model for ``source`` on ``device`` in ``dtype``, in eval mode: weights loaded from the
    checkpoint, or random (seeded) for ``random:`` presets; then quantised as ``quant_config``
    (a :class:`minivllm.quantization.QuantConfig`, or None) asks."""
    from minivllm.utils.loader import init_random_weights, load_weights

    cls = get_model_class(source.hf_config)
    with _DEFAULT_DTYPE_LOCK:  # process-wide: two builds at once must not restore each other's dtype
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = cls(source.hf_config)
        finally:
            torch.set_default_dtype(previous)
    model.quant_config = quant_config  # read by the loader's post-load step
    if source.checkpoint_dir is None:
        init_random_weights(model, seed or 0)
    else:
        load_weights(model, source.checkpoint_dir)
    return model.eval()


def kv_budget_bytes(total: int, free: int, reserved: int, peak_allocated: int, scratch_bytes: int,
                    graph_reserve: int, gpu_util: float) -> int:
    """Bytes the KV cache may take on a device of ``total`` bytes at ``gpu_util``.

    ``gpu_util * total`` less: memory outside PyTorch's allocator (CUDA context, cuBLAS/NCCL
    workspaces, other processes: ``total - free - reserved``, measured after the profile
    with the cache emptied), the profile's peak of allocated memory (weights, activations,
    logits and sampler buffers) without the scratch KV it used, and ``graph_reserve`` (the
    CUDA-graph memory pool, about one decode step's activations).

    Args:
        total, free: ``torch.cuda.mem_get_info()`` after the profile (bytes).
        reserved: ``torch.cuda.memory_reserved()`` at the same moment.
        peak_allocated: ``torch.cuda.max_memory_allocated()`` over the profile.
        scratch_bytes: the profile's temporary KV cache (part of ``peak_allocated``).
        graph_reserve: bytes held back for CUDA-graph capture.
        gpu_util: fraction in (0, 1].

    Returns:
        Bytes, possibly negative (the caller reports that the budget is too small).
    """
    if not 0 < gpu_util <= 1:
        raise ValueError(f"gpu_util must be in (0, 1], got {gpu_util}")
    outside_torch = max(0, total - free - reserved)
    return int(total * gpu_util - outside_torch - (peak_allocated - scratch_bytes) - graph_reserve)


def select_device(device: torch.device) -> torch.device:
    """Make ``device`` the current CUDA device (Triton launches and ``torch.cuda.graph``
    capture use the current device, not the tensors'); returns it with its index filled in.
    CPU devices are returned unchanged."""
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


_SAMPLES, _SEQ, _START_POS = attrgetter("samples"), attrgetter("seq"), attrgetter("start_pos")
_BLOCK_TABLE, _TABLE_VERSION = attrgetter("block_table"), attrgetter("table_version")
_PARAMS, _PLAIN_GREEDY, _GENERATOR = attrgetter("params"), attrgetter("plain_greedy"), attrgetter("generator")

#: Plain decode steps with at least this many sequences take ``ModelRunner._decode_input``
#: (measured: slower than the general loop at 4-8 sequences, faster from 12 up; tests raise
#: it to compare the two paths).
_VECTOR_DECODE_MIN = 9
#: Up to this many rows, an eager decode step's slot mapping is a list comprehension; more, numpy
#: indexing into the block-table array (measured crossover ~32 rows on this project's CPU).
_LIST_SLOTS_MAX = 32


class _PinnedStaging:
    """Reusable pinned host memory for a step's uploads: ``upload`` copies a host array into
    it and starts a non-blocking copy to the device. ``begin_step`` waits for the previous
    step's copies (already done when that step read its sampled tokens) and rewinds; a
    caller that never calls it (a tensor-parallel worker) wraps around after the same wait."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buf: torch.Tensor | None = None
        self.offset = 0
        self.done = torch.cuda.Event()

    def begin_step(self) -> None:
        self.done.synchronize()
        self.offset = 0

    def upload(self, array: np.ndarray) -> torch.Tensor:
        start = -(-self.offset // 16) * 16  # 16-byte aligned: Triton specialises on pointer alignment
        end = start + array.nbytes
        if self.buf is None or 2 * array.nbytes > self.buf.numel():
            # the old buffer stays alive while copies from it are in flight (PyTorch's pinned
            # allocator records them); continue in a larger one
            self.buf = torch.empty(max(4 * array.nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            start, end = 0, array.nbytes
        elif end > self.buf.numel():  # wrap around once the copies from the start are done
            self.done.synchronize()
            start, end = 0, array.nbytes
        view = self.buf[start:end].view(torch.from_numpy(array[:0]).dtype).view(array.shape)
        np.copyto(view.numpy(), array)
        out = view.to(self.device, non_blocking=True)
        self.done.record()
        self.offset = end
        return out


_COMPILED: dict = {}


def _compiled(fn, backend: str):
    """One ``torch.compile`` wrapper per function and backend for the whole process."""
    key = (fn, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=True, backend=backend)
    return _COMPILED[key]


class ModelRunner:
    """Holds the model, KV cache, attention backend and sampler for one process.

    ``logprobs_mode`` (set by the engine from ``EngineArgs``): what logprobs report; see
    ``minivllm/layers/logprobs.py``.

    Args:
        config: what to build (model, device, dtype, attention backend, KV pool size, seed,
            tensor-parallel shard count, max_num_seqs, weight quantisation); see ``RunnerConfig``.

    Raises:
        ValueError: the KV cache budget does not hold one block.
    """

    def __init__(self, config: RunnerConfig):
        device = select_device(config.device)  # the current CUDA device too: Triton and graphs use it
        self.config = config
        self.source = config.source
        self.hf_config = config.source.hf_config
        self.device, self.dtype, self.block_size = device, config.dtype, config.block_size
        self.kv_dtype = config.kv_cache_dtype or config.dtype  # the KV cache's (EngineArgs.kv_cache_dtype)
        self.tp_size = config.tp_size
        self.max_num_seqs = config.max_num_seqs
        self._staging = _PinnedStaging(device) if device.type == "cuda" else None
        self.model = build_model(config.source, device, config.dtype, config.seed, config.quant_config)
        heads = (self.hf_config.num_attention_heads // self.tp_size, max(1, self.hf_config.num_key_value_heads // self.tp_size),
                 get_head_dim(self.hf_config))
        self.backend = get_attention_backend(config.attention_backend, device, config.block_size, config.dtype, heads)
        self.sampler = Sampler(config.seed, device)
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache, self.kv_caches = allocate_kv_cache(self.hf_config, self.num_kv_blocks, self.block_size,
                                                          self.kv_dtype, self.device, self.tp_size)
        #: CPU pools: makes the pool's pages ahead of the blocks in use (see kv_prefault.py); the
        #: engine connects it to its block manager
        self.kv_prefaulter = KVPrefaulter.for_pool(self.kv_cache)
        self.graph_runner = None  # decode graphs (CUDA or CPU), see enable_cuda_graphs
        self._decode_tables = DecodeTables()  # the eager decode steps' block tables, kept across steps
        #: the last sampled batch's rows (their sequences and generators) and its SamplingBatch, which a
        #: step over the very same rows reuses (see sampling_batch)
        self._last_sampling: tuple[list, list, SamplingBatch] | None = None
        self.cpu_fused_ops = False  # set by the engine (enable_cpu_fused_ops)

    # -- set-up ---------------------------------------------------------------------------
    def _size_kv_cache(self) -> int:
        """KV pool size in blocks: ``num_kvcache_blocks``, else what ``kv_cache_memory_bytes``
        holds, else (CUDA) what ``gpu_memory_utilization`` leaves after a warm-up, else (CPU)
        ``DEFAULT_CPU_KV_CACHE_BYTES``."""
        c = self.config
        cfg, bs, dtype = self.hf_config, self.block_size, self.kv_dtype
        if c.num_kvcache_blocks is not None:
            return c.num_kvcache_blocks
        if c.kv_cache_memory_bytes is not None:
            blocks = num_blocks_for_bytes(c.kv_cache_memory_bytes, cfg, dtype, bs, self.tp_size)
        elif self.device.type == "cuda":
            blocks = self._blocks_from_gpu_memory(c.gpu_memory_utilization, c.max_num_batched_tokens)
        else:
            blocks = num_blocks_for_bytes(DEFAULT_CPU_KV_CACHE_BYTES, cfg, dtype, bs, self.tp_size)
        if blocks < 1:
            need = kv_bytes_per_token(cfg, dtype, self.tp_size) * bs
            which = (f"kv_cache_memory_bytes={c.kv_cache_memory_bytes}" if c.kv_cache_memory_bytes is not None
                     else "the KV cache budget")
            raise ValueError(f"{which}: too small for one block of {bs} tokens ({need} bytes; give at least that)")
        return blocks

    def _profile_pass(self, q_lens: list[int], sample: bool) -> None:
        """One forward of ``len(q_lens)`` fresh sequences over a scratch KV cache (caller
        holds it in ``self._scratch``), then logits of the last token of each, and with
        ``sample`` the sampler in its costliest mode (temperature, top-k, top-p, min-p)."""
        from minivllm.layers.sampler import SamplingBatch

        bs, dev = self.block_size, self.device
        tables, nxt = [], 0
        for n in q_lens:
            nb = cdiv(n, bs)
            tables.append(list(range(nxt, nxt + nb)))
            nxt += nb
        total = sum(q_lens)
        slots = np.concatenate([np.asarray(t, dtype=np.int64).repeat(bs)[:n] * bs + np.arange(n) % bs
                                for t, n in zip(tables, q_lens)])
        pos = np.concatenate([np.arange(n) for n in q_lens])
        meta = self._metadata(list(q_lens), list(q_lens), torch.from_numpy(slots).to(dev), tables)
        with torch.inference_mode():
            self.backend.prepare(meta)
            hidden = self.model(torch.zeros(total, dtype=torch.long, device=dev), torch.from_numpy(pos).to(dev),
                                ForwardContext(meta, self.backend, self._scratch))
            last = torch.from_numpy(np.cumsum(q_lens) - 1).to(dev)
            logits = self.model.compute_logits(hidden[last]).float()
            del hidden
            if sample:
                rows = len(q_lens)
                f32 = lambda x: torch.full((rows,), x, dtype=torch.float32, device=dev)  # noqa: E731
                batch = SamplingBatch(temperatures=f32(1.0), top_k=torch.full((rows,), 50, device=dev),
                                      top_p=f32(0.9), min_p=f32(0.05), repetition_penalties=f32(1.0),
                                      seen_token_ids=[None] * rows, generators=[None] * rows, all_greedy=False,
                                      any_top_k=True, any_top_p=True, any_min_p=True, any_penalty=False)
                self.sampler(logits, batch)

    def _blocks_from_gpu_memory(self, gpu_util: float, max_tokens: int) -> int:
        """Blocks that fit in ``gpu_util`` of device memory (``kv_budget_bytes``), profiled
        with one prefill of ``max_tokens`` tokens (the resolved step budget) and one decode
        step of ``max_num_seqs`` sequences that samples every row."""
        cuda = torch.cuda
        per_token = kv_bytes_per_token(self.hf_config, self.kv_dtype, self.tp_size)
        scratch_blocks = cdiv(max_tokens, self.block_size) + self.max_num_seqs
        _, self._scratch = allocate_kv_cache(self.hf_config, scratch_blocks, self.block_size, self.kv_dtype,
                                             self.device, self.tp_size)
        scratch_bytes = scratch_blocks * self.block_size * per_token
        try:
            cuda.synchronize(self.device)
            cuda.reset_peak_memory_stats(self.device)
            self._profile_pass([max_tokens], sample=False)
            cuda.synchronize(self.device)
            peak = cuda.max_memory_allocated(self.device)
            # the decode step a CUDA graph records: its activations stay in the graph pool
            base = cuda.memory_allocated(self.device)
            cuda.reset_peak_memory_stats(self.device)
            self._profile_pass([1] * self.max_num_seqs, sample=True)
            cuda.synchronize(self.device)
            decode_peak = cuda.max_memory_allocated(self.device)
        finally:
            self._scratch = None
        peak = max(peak, decode_peak)
        graph_reserve = max(0, decode_peak - base)
        cuda.empty_cache()
        free, total = cuda.mem_get_info(self.device)
        reserved = cuda.memory_reserved(self.device)
        budget = kv_budget_bytes(total, free, reserved, peak, scratch_bytes, graph_reserve, gpu_util)
        blocks = int(budget // (per_token * self.block_size))
        logger.info("KV cache: %d blocks (%.2f GiB) from gpu_memory_utilization=%.2f of %.1f GiB; profile peak "
                    "%.2f GiB (%d-token prefill, %d-row sampling), outside PyTorch %.2f GiB, graph reserve %.2f GiB",
                    blocks, blocks * self.block_size * per_token / 2**30, gpu_util, total / 2**30,
                    (peak - scratch_bytes) / 2**30, max_tokens, self.max_num_seqs,
                    max(0, total - free - reserved) / 2**30, graph_reserve / 2**30)
        return blocks

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, emulate: bool = False) -> None:
        """Capture decode CUDA graphs for batch-size buckets up to ``max_num_seqs``, with block
        tables wide enough for ``max_model_len`` (see ``minivllm/engine/cuda_graph.py``); on a
        CPU, CPU graphs (``minivllm/layers/cpu_graph.py``), recorded at each bucket's first step.
        ``emulate=True`` replays eagerly through the same static buffers (tests on CPU)."""
        from minivllm.engine.cuda_graph import CudaGraphDecodeRunner

        t0 = time.perf_counter()
        self.graph_runner = CudaGraphDecodeRunner(
            self.model, self.kv_caches, self.backend, max_num_seqs, cdiv(max_model_len, self.block_size),
            self.hf_config.hidden_size, self.device, self.dtype, emulate=emulate)
        self.graph_runner.capture()
        if self.graph_runner.kind == "cpu":
            logger.info("CPU graphs: decode steps of up to %d sequences are recorded at the first step of "
                        "each batch size (no padded rows) and replayed %s; model check before each replay: %s",
                        self.graph_runner.buckets[-1], cpu_graph.describe_replay(), model_check.describe())
        else:
            logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.graph_runner.buckets,
                        time.perf_counter() - t0)

    def enable_compile(self, backend: str = "inductor") -> None:
        """``torch.compile`` the small elementwise-heavy ops (RMSNorm + residual, SiLU-and-mul,
        rotary embedding), where kernel fusion saves memory round trips. Each op is compiled
        once and shared by every module using it (one Dynamo cache, shapes dynamic), so a
        model's dozens of norm layers and a second engine in the process do not exhaust
        Dynamo's recompile limit. They replace the CPU fused C ops where those were on
        (``enable_cpu_fused_ops``), and switch CPU graphs off. ``backend``: torch.compile's (tests use "eager")."""
        from minivllm.layers import norm
        from minivllm.layers.activation import SiluAndMul
        from minivllm.layers.rotary import RotaryEmbedding

        if self.graph_runner is not None and self.graph_runner.kind == "cpu":
            self.graph_runner = None  # CPU graphs record our C calls, which compiled modules no longer make
        norm_fn = _compiled(norm.rms_norm, backend)
        add_norm_fn = _compiled(norm.add_rms_norm, backend)
        for module in self.model.modules():
            if isinstance(module, norm.RMSNorm):
                module.norm_fn, module.add_norm_fn = norm_fn, add_norm_fn
                module.fused = None
            elif isinstance(module, (SiluAndMul, RotaryEmbedding)):
                module.fused = None  # a ctypes call inside a compiled frame would break its graph
                module.forward = torch.compile(module.forward, dynamic=True, backend=backend)

    def enable_cpu_fused_ops(self) -> bool:
        """Run RMSNorm, the rotary embedding, SiLU-and-multiply and the token embedding's lookup
        as one C call each (``minivllm.layers.cpu_fused``). Returns whether they are on: only for a float32 model
        on the CPU, with the C ops loaded; the modules keep their torch path for anything the C
        code does not take."""
        from minivllm.layers import cpu_fused
        from minivllm.layers.activation import SiluAndMul
        from minivllm.layers.embedding import VocabParallelEmbedding
        from minivllm.layers.norm import RMSNorm
        from minivllm.layers.rotary import RotaryEmbedding

        ops = cpu_fused.load() if self.device.type == "cpu" and self.dtype == torch.float32 else None
        if ops is None:
            return False
        for module in self.model.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul)) or type(module) is VocabParallelEmbedding:
                module.fused = ops
        if isinstance(self.sampler, Sampler):
            self.sampler.fused = ops  # greedy rows' argmax
        return True

    # -- one step ---------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> tensor on the model's device (zero-copy on CPU; on CUDA through the
        reusable pinned staging buffer, non-blocking)."""
        if self._staging is not None:
            return self._staging.upload(np.ascontiguousarray(array))
        return torch.from_numpy(array)

    def _upload_parts(self, host: np.ndarray, *bounds: tuple[int, int]) -> list[torch.Tensor]:
        """Tensors of ``host[a:b]`` for each ``(a, b)``: one upload and device views on CUDA;
        on CPU zero-copy views of the numpy parts (cheaper than slicing a tensor)."""
        if self._staging is None and self.device.type == "cpu":
            return [torch.from_numpy(host[a:b]) for a, b in bounds]
        dev = self._to_device(host)
        return [dev[a:b] for a, b in bounds]

    def _metadata(self, q_lens: list[int], context_lens: list[int], slot_mapping: torch.Tensor,
                  tables: list[list[int]] | np.ndarray) -> AttentionMetadata:
        num_seqs = len(q_lens)
        if isinstance(tables, np.ndarray):
            table_arr = tables.astype(np.int32, copy=False)
        else:
            table_arr = block_table_array(tables)
        # One int32 host buffer, one transfer: [cu_seqlens_q | cu_seqlens_k | context_lens], each
        # part on a 16-byte boundary (Triton specialises kernels on pointer alignment: an
        # unaligned part would compile a second variant in the middle of serving).
        stride = cdiv(num_seqs + 1, 4) * 4
        pad = [0] * (stride - num_seqs - 1)
        host = np.array(list(accumulate(q_lens, initial=0)) + pad + list(accumulate(context_lens, initial=0))
                        + pad + context_lens, dtype=np.int32)
        cu_q, cu_k, ctx_lens = self._upload_parts(host, (0, num_seqs + 1), (stride, stride + num_seqs + 1),
                                                  (2 * stride, len(host)))
        return AttentionMetadata(
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            context_lens=ctx_lens,
            slot_mapping=slot_mapping,
            block_tables=self._to_device(table_arr),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(context_lens), block_size=self.block_size,
            is_decode_only=max(q_lens) == 1, q_lens_cpu=q_lens, context_lens_cpu=context_lens)

    def prepare_input(self, plan: SchedulerOutput) -> ModelInput:
        """Flatten the plan: each sequence's new tokens back to back, with their positions
        and cache slots (``block_table[p // block_size] * block_size + p % block_size``)."""
        bs = self.block_size
        if self._staging is not None:
            self._staging.begin_step()
        g = self.graph_runner
        if plan.all_plain_decodes and (len(plan.scheduled) >= _VECTOR_DECODE_MIN or (g is not None and g.captured)):
            fast = self._decode_input(plan)
            if fast is not None:
                return fast
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens, context_lens, tables, logits_rows, sampling = [], [], [], [], []
        drafts = {}
        chunked = False  # some entry brings several tokens that are not drafts (a prefill chunk)
        for entry in plan.scheduled:
            seq, start, n = entry.seq, entry.start_pos, entry.num_tokens
            table = seq.block_table
            if entry.draft_token_ids:  # the last known token, then the drafts; score every one
                input_ids.append(seq.token_ids[start])
                input_ids.extend(entry.draft_token_ids)
                pos = np.arange(start, start + n)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
                drafts[seq] = (len(logits_rows), entry.draft_token_ids, entry.draft_probs)
                logits_rows.extend(range(len(input_ids) - n, len(input_ids)))
                sampling.extend([seq] * n)
                q_lens.append(n)
                context_lens.append(start + n)
                tables.append(table)
                continue
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                chunked = True
                input_ids.extend(seq.token_ids[start:start + n])
                pos = np.arange(start, start + n)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            q_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if entry.samples:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        t = len(input_ids)
        # decodes (and, for CPU graphs, draft verifications): one graph row per token, padded on the host
        # into the graphs' static buffers
        if not chunked and self._replays_as_decode_rows(q_lens, t, tables):
            return self._stage_as_decode_rows(g, input_ids, positions, slots, q_lens, tables, logits_rows,
                                              sampling, drafts)
        # One int64 host buffer, one transfer: [input_ids | positions | slot_mapping | logits rows],
        # each part starting on a 16-byte boundary (Triton specialises on pointer alignment).
        # Built from one Python list: a single numpy call is cheapest at small batches.
        stride = cdiv(t, 2) * 2
        pad = [0] * (stride - t)
        flat_host = np.array(input_ids + pad + positions + pad + slots + pad + logits_rows, dtype=np.int64)
        table_arr = block_table_array(tables)
        ids_t, pos_t, slots_t, rows_t = self._upload_parts(flat_host, (0, t), (stride, stride + t),
                                                           (2 * stride, 2 * stride + t), (3 * stride, len(flat_host)))
        return ModelInput(
            input_ids=ids_t, positions=pos_t,
            meta=self._metadata(q_lens, context_lens, slots_t, table_arr),
            logits_indices=rows_t, sampling_seqs=sampling, drafts=drafts,
            host=(flat_host[:t], flat_host[stride:stride + t], flat_host[2 * stride:2 * stride + t],
                  flat_host[3 * stride:], table_arr))

    def _replays_as_decode_rows(self, q_lens: list[int], num_tokens: int, tables: list) -> bool:
        """Whether a step of ``num_tokens`` tokens (``q_lens`` per sequence) can replay the decode
        graphs one row per token: CUDA graphs take plain decodes only, CPU graphs also sequences of
        up to ``MAX_QUERY_LEN`` tokens (the longest query the eager step gives the same kernel)."""
        g = self.graph_runner
        return (g is not None and max(q_lens) <= (MAX_QUERY_LEN if g.kind == "cpu" else 1)
                and g.can_run_step(num_tokens, num_tokens, True, self.block_size, max(map(len, tables))))

    def _stage_as_decode_rows(self, g, input_ids, positions, slots, q_lens, tables, logits_rows, sampling,
                              drafts) -> ModelInput:
        """A step of decodes, and on a CPU of draft verifications too, staged for the decode graphs
        one graph row per token: token ``i`` at position ``p`` becomes a decode row with its
        sequence's block table and a context of ``p + 1`` keys. Every token's K and V are written
        before any row's attention reads the cache, so each row sees the tokens before it in its own
        sequence, as the eager step's causal rows do (the same kernel, the same keys, the same bits;
        the caller sends only steps whose sequences score at most ``MAX_QUERY_LEN`` tokens, those the
        eager step gives the kernel too)."""
        row_tables = [table for table, n in zip(tables, q_lens) for _ in range(n)]
        context_lens = [p + 1 for p in positions]
        n = g.stage(np.asarray(input_ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                    np.asarray(slots, dtype=np.int64), np.asarray(context_lens, dtype=np.int32), row_tables)
        rows = None if logits_rows == list(range(n)) else self._to_device(np.array(logits_rows, dtype=np.int64))
        return StagedModelInput(g, n, sampling, rows, drafts)

    def _decode_input(self, plan: SchedulerOutput) -> ModelInput | None:
        """``prepare_input`` for a step of plain decodes (one token each, no drafts): C-level
        gathers (``map`` over attribute getters) and one list comprehension per input instead
        of a loop of appends, then the one numpy call and uploads of the general path, or the
        decode graphs' staging when they take the step. None if
        some entry does not sample (never expected for a decode; the general path handles it)."""
        scheduled = plan.scheduled
        bs, g = self.block_size, self.graph_runner
        # batch 1, the interactive case: one entry without maps and lists (prepare_input 6.5 -> 4.7 us, Xeon)
        if len(scheduled) == 1 and g is not None:
            entry = scheduled[0]
            seq, p = entry.seq, entry.start_pos
            table = seq.block_table
            if entry.samples and g.can_run_step(1, 1, True, bs, len(table)):
                g.stage([seq.token_ids[-1]], [p], [table[p // bs] * bs + p % bs], [p + 1], [table],
                        [seq.table_version])
                return StagedModelInput(g, 1, [seq])
        if not all(map(_SAMPLES, scheduled)):
            return None  # some entry is not at its last token (it would not sample)
        n = len(scheduled)
        sampling = list(map(_SEQ, scheduled))
        positions = list(map(_START_POS, scheduled))
        input_ids = [seq.token_ids[-1] for seq in sampling]
        tables = list(map(_BLOCK_TABLE, sampling))
        if g is not None and g.can_run_step(n, n, True, bs, max(map(len, tables))):
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
            # into the graphs' static buffers; a row keeps its staged table while its version holds
            g.stage(input_ids, positions, slots, [p + 1 for p in positions], tables,
                    list(map(_TABLE_VERSION, sampling)))
            return StagedModelInput(g, n, sampling)
        stride = cdiv(n, 2) * 2  # parts on 16-byte boundaries, as in prepare_input
        table_arr = self._decode_tables.build(tables, list(map(_TABLE_VERSION, sampling)))
        if n <= _LIST_SLOTS_MAX:  # one numpy call over Python lists: cheapest for few rows
            pad = [0] * (stride - n)
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
            flat_host = np.array(input_ids + pad + positions + pad + slots + pad + list(range(n)), dtype=np.int64)
        else:  # the slots from the block-table array in numpy (~43 -> ~15 us for 256 rows)
            flat_host = np.zeros(3 * stride + n, dtype=np.int64)
            flat_host[:n] = input_ids
            pos = flat_host[stride:stride + n]
            pos[:] = positions
            block_index, offset = np.divmod(pos, bs)
            rows = flat_host[3 * stride:]
            rows[:] = np.arange(n)
            slots = flat_host[2 * stride:2 * stride + n]
            np.multiply(table_arr[rows, block_index], bs, out=slots)
            if slots.min() < 0:  # a -1 past a table's blocks (a list would have raised IndexError)
                raise RuntimeError(f"a block table covers fewer blocks than its position needs "
                                   f"(row {int(slots.argmin())}): block manager state is corrupt")
            slots += offset
        ids_t, pos_t, slots_t, rows_t = self._upload_parts(flat_host, (0, n), (stride, stride + n),
                                                           (2 * stride, 2 * stride + n), (3 * stride, len(flat_host)))
        return ModelInput(
            input_ids=ids_t, positions=pos_t,
            meta=self._decode_metadata(flat_host[stride:stride + n], slots_t, table_arr),
            logits_indices=rows_t, sampling_seqs=sampling,
            host=(flat_host[:n], flat_host[stride:stride + n], flat_host[2 * stride:2 * stride + n],
                  flat_host[3 * stride:], table_arr))

    def _decode_metadata(self, positions: np.ndarray, slot_mapping: torch.Tensor,
                         table_arr: np.ndarray) -> AttentionMetadata:
        """``_metadata`` for one token per sequence at ``positions`` (int64 ``[n]``): the same
        int32 host buffer ``[cu_seqlens_q | cu_seqlens_k | context_lens]``, from numpy calls
        (``cu_seqlens_q`` is ``0..n``) instead of Python lists."""
        n = len(positions)
        stride = cdiv(n + 1, 4) * 4
        host = np.zeros(2 * stride + n, dtype=np.int32)
        host[:n + 1] = np.arange(n + 1, dtype=np.int32)
        ctx = host[2 * stride:]
        np.add(positions, 1, out=ctx, casting="unsafe")
        np.add.accumulate(ctx, out=host[stride + 1:stride + n + 1])  # np.cumsum without its wrapper
        cu_q, cu_k, ctx_lens = self._upload_parts(host, (0, n + 1), (stride, stride + n + 1), (2 * stride, len(host)))
        context_lens = ctx.tolist()
        return AttentionMetadata(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, context_lens=ctx_lens, slot_mapping=slot_mapping,
            block_tables=self._to_device(table_arr), max_seqlen_q=1, max_seqlen_k=max(context_lens),
            block_size=self.block_size, is_decode_only=True, q_lens_cpu=[1] * n, context_lens_cpu=context_lens)

    @torch.inference_mode()
    def forward_logits(self, inp: ModelInput, extra_rows: torch.Tensor | None = None):
        """fp32 logits ``[num_sampling, vocab_size]`` for the rows that sample; with
        ``extra_rows`` (int64 indices of input tokens), a tuple of those and the fp32 logits
        ``[len(extra_rows), vocab_size]`` of the extra rows (prompt logprobs)."""
        if inp.graph_rows is not None:
            hidden = self.graph_runner.replay(inp.graph_rows)
        elif self.graph_runner is not None and self.graph_runner.can_run(inp.meta):
            hidden = self.graph_runner.run(inp.input_ids, inp.positions, inp.meta)
        else:
            self.backend.prepare(inp.meta)
            ctx = ForwardContext(inp.meta, self.backend, self.kv_caches)
            hidden = self.model(inp.input_ids, inp.positions, ctx)
        if extra_rows is not None:
            rows = torch.cat([inp.logits_indices, extra_rows])
            logits = self.model.compute_logits(hidden[rows]).float()
            n = len(inp.logits_indices)
            return logits[:n], logits[n:]
        if not inp.sampling_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        rows = hidden if inp.logits_indices is None else hidden[inp.logits_indices]
        head = getattr(self.model, "compute_logits_and_greedy", None) if inp.greedy else None
        if head is not None:
            logits, inp.greedy_ids = head(rows)
            return logits.float()
        return self.model.compute_logits(rows).float()

    @torch.inference_mode()
    def logits_at(self, input_ids: list[int], positions: list[int], slots: list[int], q_lens: list[int],
                  context_lens: list[int], tables: list[list[int]], rows: list[int]) -> torch.Tensor:
        """One forward over tokens placed by the caller (a draft model's proposer, which keeps
        its own block tables): each sequence's new tokens back to back (``q_lens``), their
        ``positions`` and KV cache ``slots``, each sequence's KV length after the step
        (``context_lens``) and block table. Replays the CPU decode graphs, one row per token, when
        every sequence brings at most ``MAX_QUERY_LEN`` tokens (as ``prepare_input`` does for draft
        verification), else runs eagerly. Returns fp32 logits ``[len(rows), vocab_size]`` of the
        token rows ``rows``."""
        if self._staging is not None:
            self._staging.begin_step()
        t = len(input_ids)
        g = self.graph_runner
        if self._replays_as_decode_rows(q_lens, t, tables):
            inp = self._stage_as_decode_rows(g, input_ids, positions, slots, q_lens, tables, rows, [], {})
            with torch.inference_mode():
                hidden = g.replay(inp.graph_rows)
                return self.model.compute_logits(
                    hidden if inp.logits_indices is None else hidden[inp.logits_indices]).float()
        stride = cdiv(t, 2) * 2  # int64 parts on 16-byte boundaries, as prepare_input
        pad = [0] * (stride - t)
        host = np.array(input_ids + pad + positions + pad + slots + pad + rows, dtype=np.int64)
        ids_t, pos_t, slots_t, rows_t = self._upload_parts(host, (0, t), (stride, stride + t),
                                                           (2 * stride, 2 * stride + t), (3 * stride, len(host)))
        meta = self._metadata(q_lens, context_lens, slots_t, tables)
        self.backend.prepare(meta)
        hidden = self.model(ids_t, pos_t, ForwardContext(meta, self.backend, self.kv_caches))
        return self.model.compute_logits(hidden[rows_t]).float()

    def sampling_batch(self, seqs: list[Sequence], all_plain_greedy: bool = False) -> SamplingBatch:
        """Per-row sampling settings; tensors are only built when some row is not greedy.
        ``all_plain_greedy``: the caller knows every row is (``SchedulerOutput.all_plain_greedy``)."""
        if all_plain_greedy or all(map(_PLAIN_GREEDY, map(_PARAMS, seqs))):  # one C-level pass: every step
            return SamplingBatch.greedy(len(seqs))
        # Decode steps of an unchanged batch ask for the same settings every step: building them took
        # ~50 us for one sampled row (embedded model, Zen 4, 2026-12-04), a tenth of its step. Reused
        # only on a CPU (on CUDA the tensors live in staging memory that later steps overwrite) and
        # when every row is the same sequence with the same generator as last time (a rolled-back
        # step can drop a generator it made); a batch with logits processors or penalties reads
        # per-step token lists, so it is never kept.
        last = self._last_sampling
        if (last is not None and len(last[0]) == len(seqs) and all(map(is_, last[0], seqs))
                and all(map(is_, last[1], map(_GENERATOR, seqs)))):
            return last[2]
        batch = self._new_sampling_batch(seqs)
        keep = self._staging is None and batch.processing is None and not batch.any_penalty
        self._last_sampling = (list(seqs), [s.generator for s in seqs], batch) if keep else None
        return batch

    def _new_sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        params = list(map(_PARAMS, seqs))
        dev = self.device
        gens = []
        for s in seqs:
            if s.params.seed is not None and s.generator is None:
                s.generator = torch.Generator(device=dev)
                s.generator.manual_seed(s.params.seed)
            gens.append(s.generator)
        table = np.array([(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) for p in params],
                         dtype=np.float32)
        cols = self._to_device(table)
        penalties = table[:, 4]
        return SamplingBatch(
            temperatures=cols[:, 0], top_k=cols[:, 1].long(), top_p=cols[:, 2], min_p=cols[:, 3],
            repetition_penalties=cols[:, 4],
            seen_token_ids=[s.token_ids if p != 1.0 else None for s, p in zip(seqs, penalties)],
            generators=gens,
            all_greedy=bool((table[:, 0] == 0).all()),
            any_top_k=bool((table[:, 1] > 0).any()),
            any_top_p=bool((table[:, 2] < 1.0).any()),
            any_min_p=bool((table[:, 3] > 0).any()),
            any_penalty=bool((penalties != 1.0).any()),
            processing=([row_processing(p, s.output_token_ids, s.bad_words_token_ids, s.min_tokens_stop_ids)
                         if p.has_logits_processors else None for s, p in zip(seqs, params)]
                        if any(p.has_logits_processors for p in params) else None),
            num_logprobs=[p.logprobs for p in params] if any(p.logprobs is not None for p in params) else None)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        """One step's forward and sampling: inputs from ``plan``, the model (a CPU or CUDA graph's
        replay where one applies), the logits of the rows that sample, the sampler (with drafts:
        their verification). Returns a ``RunnerOutput``: the sequences that got tokens and their
        token ids (-1 for a row that could not sample, also listed in ``failed``), logprobs, and
        the prepare / model / sample times in ms. Changes no request state (the scheduler
        applies the output)."""
        t0 = time.perf_counter()
        inp = self.prepare_input(plan)
        t1 = time.perf_counter()
        # No synchronize here: the host queues the forward and the sampler, and waits once,
        # when it reads the sampled tokens. On CUDA model_ms is therefore launch time and
        # sample_ms includes waiting for the GPU.
        prompt_rows = _prompt_logprob_rows(plan)
        if prompt_rows is None:
            inp.greedy = plan.all_plain_greedy and isinstance(self.sampler, Sampler)
            logits = self.forward_logits(inp)
        else:
            logits, prompt_logits = self.forward_logits(inp, self._to_device(np.array(prompt_rows[0], dtype=np.int64)))
        t2 = time.perf_counter()
        tokens, failed, seqs, more, logprobs, prompt_logprobs = [], set(), inp.sampling_seqs, {}, None, None
        if inp.sampling_seqs:
            with torch.inference_mode():
                batch = self.sampling_batch(inp.sampling_seqs, plan.all_plain_greedy)
                processed = self.logprobs_mode.startswith("processed")
                batch.keep_processed = processed and batch.num_logprobs is not None
                # A plain greedy CPU batch's ids without torch calls; a sampler a caller put in the
                # stock one's place (a notebook's logits tap, tensor parallelism's vocabulary mask)
                # is always called.
                tokens = (self.sampler.greedy_token_ids(logits, batch, inp.greedy_ids)
                          if isinstance(self.sampler, Sampler) else None)
                if tokens is None:
                    sampled = self.sampler(logits, batch)
                    # A row with NaN/inf logits samples garbage (argmax of NaN): mark it -1. A row's
                    # fp32 sum is non-finite iff an entry is (finite logits are far from overflowing
                    # it); one reduction, ~15x cheaper on a CPU than isfinite().all() over the row.
                    sampled = sampled.masked_fill(~torch.isfinite(logits.sum(dim=-1, dtype=torch.float32)), -1)
                    if batch.num_logprobs is not None:
                        values = self.sampler.processed_logits if processed else logits
                        logprobs = self._logprobs(values, sampled, batch.num_logprobs)
                    tokens = sampled.tolist()
                if inp.drafts:  # requests with logprobs get no drafts: their entries are first rows
                    seqs, tokens, more, first_rows = self._verify_drafts(inp, logits, batch, tokens)
                    if logprobs is not None:
                        logprobs = [logprobs[r] for r in first_rows]
            if -1 in tokens:
                failed = {seq for seq, t in zip(seqs, tokens) if t == -1}
        if prompt_rows is not None:
            with torch.inference_mode():
                prompt_logprobs = self._prompt_logprobs(prompt_logits, prompt_rows[1])
        t3 = time.perf_counter()
        return RunnerOutput(seqs, tokens, failed, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                            logprobs, prompt_logprobs, more)

    def _verify_drafts(self, inp: ModelInput, logits: torch.Tensor, batch: SamplingBatch, row_tokens: list[int]):
        """Collapse each speculative decode's rows into the tokens it emits (see
        ``minivllm/spec_decode/verify.py``); returns (seqs, first tokens, more tokens,
        each sequence's first row)."""
        from minivllm.layers.sampler import filtered_probs
        from minivllm.spec_decode.verify import verify_greedy, verify_sampled

        seqs, tokens, more, first_rows = [], [], {}, []
        row = 0
        while row < len(inp.sampling_seqs):
            seq = inp.sampling_seqs[row]
            spec = inp.drafts.get(seq)
            first_rows.append(row)
            if spec is None or spec[0] != row:
                seqs.append(seq)
                tokens.append(row_tokens[row])
                row += 1
                continue
            drafts = spec[1]
            rows = slice(row, row + len(drafts) + 1)
            if -1 in row_tokens[rows]:
                emitted = [-1]  # non-finite logits: the request fails (see LLMEngine)
            elif seq.params.temperature == 0:
                emitted = verify_greedy(drafts, row_tokens[rows])
            else:
                probs = filtered_probs(logits[rows].float(), batch.rows(rows))
                emitted = verify_sampled(drafts, probs, seq.generator or self.sampler.generator, spec[2])
            seqs.append(seq)
            tokens.append(emitted[0])
            more[seq] = emitted[1:]
            row = rows.stop
        return seqs, tokens, more, first_rows

    def _logprobs(self, logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]) -> list:
        """Logprob entries of the rows that want them (None elsewhere, and for failed rows)."""
        rows = [i for i, k in enumerate(num_logprobs) if k is not None]
        idx = torch.tensor(rows, device=logits.device)
        chosen = sampled[idx]
        ok = chosen >= 0
        entries = logprob_entries(logits[idx], chosen.clamp(min=0), [num_logprobs[i] for i in rows],
                                  normalize=self.logprobs_mode.endswith("logprobs"))
        out: list = [None] * len(num_logprobs)
        for i, entry, good in zip(rows, entries, ok.tolist()):
            out[i] = entry if good else None
        return out

    def _prompt_logprobs(self, prompt_logits: torch.Tensor, spans: list) -> dict:
        """Entries of every prompt position computed this step, per requesting sequence."""
        targets, ks = [], []
        for seq, first, count in spans:
            targets.extend(seq.prompt_token_ids[first:first + count])
            ks.extend([seq.params.prompt_logprobs] * count)
        # from the raw logits (no processing applies to prompt positions): their log-probabilities, or in the
        # "*_logits" modes the logits themselves (vLLM 0.34's v1/worker/gpu/sample/prompt_logprob.py, logits_mode)
        entries = logprob_entries(prompt_logits, torch.tensor(targets, device=prompt_logits.device), ks,
                                  normalize=self.logprobs_mode.endswith("logprobs"))
        out, at = {}, 0
        for seq, first, count in spans:
            out[seq] = (first, entries[at:at + count])
            at += count
        return out

    def shutdown(self) -> None:
        """Free the KV cache, the graphs and the model (the engine's ``shutdown`` calls it)."""
        if getattr(self, "kv_prefaulter", None) is not None:
            self.kv_prefaulter.close()
            self.kv_prefaulter = None
        if self.graph_runner is not None:
            self.graph_runner.release()  # its graphs refer back to it: freed now, not at the next gc pass
        self.graph_runner = None
        if self.model is not None:  # a parameter's weight_loader is its module's bound method: a cycle
            for param in self.model.parameters():
                param.__dict__.pop("weight_loader", None)
            release_weights(self.model)
        self.kv_caches = []
        self.kv_cache = None
        self.model = None


def release_weights(model: torch.nn.Module) -> int:
    """Give back the memory of ``model``'s weights now (parameters, buffers, packed copies, int8
    weights), also where something else still holds the module: a Jupyter cell interrupted in
    the middle of a step keeps its traceback, whose frames hold the model, so a shut-down engine's
    weights (gigabytes for a 0.6B model) stayed in memory until the next error replaced it.

    Each tensor the module holds is pointed at an empty one (``tensor.data = ...``), so the module
    is unusable afterwards (its weights hold no elements) and its old storage goes as soon as no
    other tensor shares it; one that does (a ``state_dict()`` taken before, a view a frame kept)
    stays valid and keeps that storage alive. (Shrinking the storage itself would free it in every
    case, and crash a process that then read such a tensor.) oneDNN's packed ``mkldnn`` weights are
    left to be freed with their last reference. Returns the bytes of the tensors emptied."""
    released, seen = 0, set()
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        int8 = getattr(module, "int8", None)  # an Int8Weight: its int8 values and panels
        if int8 is not None:
            tensors += [v for v in vars(int8).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is None or t.is_mkldnn or id(t) in seen or not t.numel():
                continue
            seen.add(id(t))
            released += t.numel() * t.element_size()
            with torch.no_grad():
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return released
