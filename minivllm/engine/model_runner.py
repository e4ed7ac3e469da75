"""Runs one scheduled step on the model: build inputs, forward, logits, sample.

The runner owns the model weights, the KV cache tensors, the attention backend and
the sampler. ``run(plan)`` turns a ``SchedulerOutput`` into flat input tensors
(every scheduled sequence's new tokens back to back), an ``AttentionMetadata``
describing where each token's K/V goes and what it attends to, runs the model, and
samples one token for each sequence whose step reached its last known token.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from minivllm.config import DEFAULT_CPU_KV_CACHE_BYTES
from minivllm.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token, num_blocks_for_bytes
from minivllm.engine.runner_config import RunnerConfig
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.layers.attention import get_attention_backend
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.logits_processors import row_processing
from minivllm.layers.logprobs import logprob_entries
from minivllm.layers.sampler import Sampler, SamplingBatch
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
        sampling_seqs: the sequences those rows belong to, in the same order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_seqs: list[Sequence]


@dataclass
class RunnerOutput:
    """What the forward pass and sampler produced, and where the time went (ms).

    Attributes:
        seqs: the sequences that sampled (``ModelInput.sampling_seqs``).
        token_ids: their new token ids, same order.
        failed: those of ``seqs`` whose logits row held NaN or inf (their token is meaningless).
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


def build_model(source: ModelSource, device: torch.device, dtype: torch.dtype, seed: int | None) -> torch.nn.Module:
    """The model for ``source`` on ``device`` in ``dtype``, in eval mode: weights loaded from the
    checkpoint, or random (seeded) for ``random:`` presets."""
    from minivllm.utils.loader import init_random_weights, load_weights

    cls = get_model_class(source.hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(source.hf_config)
    finally:
        torch.set_default_dtype(previous)
    if source.checkpoint_dir is None:
        init_random_weights(model, seed or 0)
    else:
        load_weights(model, source.checkpoint_dir)
    return model.eval()


class ModelRunner:
    """Holds the model, KV cache, attention backend and sampler for one process.

    ``logprobs_mode`` (set by the engine from ``EngineArgs``): what logprobs report; see
    ``minivllm/layers/logprobs.py``.

    Args:
        config: what to build (model, device, dtype, attention backend, KV pool size, seed,
            tensor-parallel shard count); see ``RunnerConfig``.

    Raises:
        ValueError: the KV cache budget does not hold one block.
    """

    def __init__(self, config: RunnerConfig):
        self.config = config
        self.source = config.source
        self.hf_config = config.source.hf_config
        self.device, self.dtype, self.block_size = config.device, config.dtype, config.block_size
        self.tp_size = config.tp_size
        self.model = build_model(config.source, config.device, config.dtype, config.seed)
        self.backend = get_attention_backend(config.attention_backend, config.device, config.block_size,
                                             config.dtype)
        self.sampler = Sampler(config.seed, config.device)
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache, self.kv_caches = allocate_kv_cache(self.hf_config, self.num_kv_blocks, self.block_size,
                                                          self.dtype, self.device, self.tp_size)
        self.graph_runner = None  # decode CUDA graphs, see enable_cuda_graphs

    # -- set-up ---------------------------------------------------------------------------
    def _size_kv_cache(self) -> int:
        """KV pool size in blocks: ``num_kvcache_blocks``, else what ``kv_cache_memory_bytes``
        holds, else (CUDA) what ``gpu_memory_utilization`` leaves after a warm-up, else (CPU)
        ``DEFAULT_CPU_KV_CACHE_BYTES``."""
        c = self.config
        cfg, bs, dtype = self.hf_config, self.block_size, self.dtype
        if c.num_kvcache_blocks is not None:
            return c.num_kvcache_blocks
        if c.kv_cache_memory_bytes is not None:
            blocks = num_blocks_for_bytes(c.kv_cache_memory_bytes, cfg, dtype, bs, self.tp_size)
        elif self.device.type == "cuda":
            blocks = self._blocks_from_gpu_memory(c.gpu_memory_utilization, c.max_num_batched_tokens)
        else:
            blocks = num_blocks_for_bytes(DEFAULT_CPU_KV_CACHE_BYTES, cfg, dtype, bs, self.tp_size)
        if blocks < 1:
            raise ValueError(f"KV cache budget too small for one block of {bs} tokens "
                             f"({kv_bytes_per_token(cfg, dtype, self.tp_size) * bs} bytes)")
        return blocks

    def _blocks_from_gpu_memory(self, gpu_util: float, max_tokens: int) -> int:
        """Blocks that fit in ``gpu_util`` of device memory after weights and the peak
        activation memory of a warm-up forward of ``max_tokens`` tokens."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(max_tokens, 8192)
        # Warm-up: one sequence of n tokens, KV written to a scratch block table
        # over a small temporary cache.
        scratch_blocks = -(-n // self.block_size)
        _, scratch = allocate_kv_cache(self.hf_config, scratch_blocks, self.block_size, self.dtype, self.device,
                                       self.tp_size)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        meta = self._metadata([n], [n], torch.arange(n, device=self.device), [list(range(scratch_blocks))])
        with torch.inference_mode():
            self.backend.prepare(meta)
            hidden = self.model(ids, pos, ForwardContext(meta, self.backend, scratch))
            self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_for_kv = total * gpu_util - peak
        per_token = kv_bytes_per_token(self.hf_config, self.dtype, self.tp_size)
        blocks = int(free_for_kv // (per_token * self.block_size))
        logger.info("KV cache: %d blocks (%.2f GiB) from gpu_memory_utilization=%.2f, peak activation+weights %.2f GiB",
                    blocks, blocks * self.block_size * per_token / 2**30,
                    gpu_util, peak / 2**30)
        return blocks

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, emulate: bool = False) -> None:
        """Capture decode CUDA graphs for batch-size buckets up to ``max_num_seqs``, with block
        tables wide enough for ``max_model_len`` (see ``minivllm/engine/cuda_graph.py``).
        ``emulate=True`` replays eagerly through the same static buffers (tests on CPU)."""
        from minivllm.engine.cuda_graph import CudaGraphDecodeRunner

        t0 = time.perf_counter()
        self.graph_runner = CudaGraphDecodeRunner(
            self.model, self.kv_caches, self.backend, max_num_seqs, cdiv(max_model_len, self.block_size),
            self.hf_config.hidden_size, self.device, self.dtype, emulate=emulate)
        self.graph_runner.capture()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.graph_runner.buckets,
                    time.perf_counter() - t0)

    def enable_compile(self) -> None:
        """``torch.compile`` the small elementwise-heavy ops (RMSNorm + residual, SiLU-and-mul,
        rotary embedding), where kernel fusion saves memory round trips."""
        from minivllm.layers.activation import SiluAndMul
        from minivllm.layers.norm import RMSNorm
        from minivllm.layers.rotary import RotaryEmbedding

        for module in self.model.modules():
            if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
                module.forward = torch.compile(module.forward, dynamic=True)

    # -- one step ---------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> tensor on the model's device (zero-copy on CPU)."""
        t = torch.from_numpy(array)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _metadata(self, q_lens: list[int], context_lens: list[int], slot_mapping: torch.Tensor,
                  tables: list[list[int]]) -> AttentionMetadata:
        num_seqs = len(q_lens)
        width = max(len(t) for t in tables)
        table_arr = np.full((num_seqs, width), -1, dtype=np.int32)
        for i, t in enumerate(tables):
            table_arr[i, :len(t)] = t
        # One int32 host buffer, one transfer: [cu_seqlens_q | cu_seqlens_k | context_lens].
        lens = self._to_device(np.array(list(accumulate(q_lens, initial=0)) + list(accumulate(context_lens, initial=0))
                                        + context_lens, dtype=np.int32))
        return AttentionMetadata(
            cu_seqlens_q=lens[:num_seqs + 1],
            cu_seqlens_k=lens[num_seqs + 1:2 * num_seqs + 2],
            context_lens=lens[2 * num_seqs + 2:],
            slot_mapping=slot_mapping,
            block_tables=self._to_device(table_arr),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(context_lens), block_size=self.block_size,
            is_decode_only=max(q_lens) == 1, q_lens_cpu=q_lens, context_lens_cpu=context_lens)

    def prepare_input(self, plan: SchedulerOutput) -> ModelInput:
        """Flatten the plan: each sequence's new tokens back to back, with their positions
        and cache slots (``block_table[p // block_size] * block_size + p % block_size``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens, context_lens, tables, logits_rows, sampling = [], [], [], [], []
        for entry in plan.scheduled:
            seq, start, n = entry.seq, entry.start_pos, entry.num_tokens
            table = seq.block_table
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
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
        # One int64 host buffer, one transfer: [input_ids | positions | slot_mapping | logits rows].
        t = len(input_ids)
        flat = self._to_device(np.array(input_ids + positions + slots + logits_rows, dtype=np.int64))
        return ModelInput(
            input_ids=flat[:t], positions=flat[t:2 * t],
            meta=self._metadata(q_lens, context_lens, flat[2 * t:3 * t], tables),
            logits_indices=flat[3 * t:], sampling_seqs=sampling)

    @torch.inference_mode()
    def forward_logits(self, inp: ModelInput, extra_rows: torch.Tensor | None = None):
        """fp32 logits ``[num_sampling, vocab_size]`` for the rows that sample; with
        ``extra_rows`` (int64 indices of input tokens), a tuple of those and the fp32 logits
        ``[len(extra_rows), vocab_size]`` of the extra rows (prompt logprobs)."""
        if self.graph_runner is not None and self.graph_runner.can_run(inp.meta):
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
        return self.model.compute_logits(hidden[inp.logits_indices]).float()

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """Per-row sampling settings; tensors are only built when some row is not greedy."""
        params = [s.params for s in seqs]
        if all(p.plain_greedy for p in params):
            return SamplingBatch.greedy(len(seqs))
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
        t0 = time.perf_counter()
        inp = self.prepare_input(plan)
        t1 = time.perf_counter()
        prompt_rows = _prompt_logprob_rows(plan)
        if prompt_rows is None:
            logits = self.forward_logits(inp)
        else:
            logits, prompt_logits = self.forward_logits(inp, self._to_device(np.array(prompt_rows[0], dtype=np.int64)))
        self._sync()
        t2 = time.perf_counter()
        tokens, failed, logprobs, prompt_logprobs = [], set(), None, None
        if inp.sampling_seqs:
            with torch.inference_mode():
                batch = self.sampling_batch(inp.sampling_seqs)
                processed = self.logprobs_mode.startswith("processed")
                batch.keep_processed = processed and batch.num_logprobs is not None
                sampled = self.sampler(logits, batch)
                # A row with NaN/inf logits samples garbage (argmax of NaN): mark it -1.
                sampled = sampled.masked_fill(~torch.isfinite(logits).all(dim=-1), -1)
                if batch.num_logprobs is not None:
                    values = self.sampler.processed_logits if processed else logits
                    logprobs = self._logprobs(values, sampled, batch.num_logprobs)
                tokens = sampled.tolist()
            if -1 in tokens:
                failed = {seq for seq, t in zip(inp.sampling_seqs, tokens) if t == -1}
        if prompt_rows is not None:
            with torch.inference_mode():
                prompt_logprobs = self._prompt_logprobs(prompt_logits, prompt_rows[1])
        t3 = time.perf_counter()
        return RunnerOutput(inp.sampling_seqs, tokens, failed, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                            logprobs, prompt_logprobs)

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
        entries = logprob_entries(prompt_logits, torch.tensor(targets, device=prompt_logits.device), ks,
                                  normalize=self.logprobs_mode.endswith("logprobs"))
        out, at = {}, 0
        for seq, first, count in spans:
            out[seq] = (first, entries[at:at + count])
            at += count
        return out

    def shutdown(self) -> None:
        self.graph_runner = None
        self.kv_caches = []
        self.kv_cache = None
        self.model = None
