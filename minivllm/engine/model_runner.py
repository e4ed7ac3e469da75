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
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.layers.attention import get_attention_backend
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.sampler import Sampler, SamplingBatch
from minivllm.models.registry import get_model_class
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
    """Sampled token per sampling sequence (same order as ``ModelInput.sampling_seqs``), and timings in ms."""

    sampled: list[tuple[Sequence, int]]
    prepare_ms: float
    model_ms: float
    sample_ms: float


def build_model(source: ModelSource, device: torch.device, dtype: torch.dtype, seed: int | None,
                quant_config=None) -> torch.nn.Module:
    """The model for ``source`` on ``device`` in ``dtype``, in eval mode: weights loaded from the
    checkpoint, or random (seeded) for ``random:`` presets; then quantised as ``quant_config``
    (a :class:`minivllm.quantization.QuantConfig`, or None) asks."""
    from minivllm.utils.loader import init_random_weights, load_weights

    cls = get_model_class(source.hf_config)
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


class ModelRunner:
    """Holds the model, KV cache, attention backend and sampler for one process.

    Args:
        source: the resolved model.
        device, dtype: where and in which precision the model runs.
        backend_name: attention backend name (resolved).
        block_size: tokens per KV block.
        num_kvcache_blocks / kv_cache_memory_bytes / gpu_memory_utilization: pool size,
            first given wins (see ``EngineArgs``).
        max_num_batched_tokens: largest step, used for the GPU warm-up measurement.
        seed: sampler and random-weight seed.
        tp_size: tensor-parallel ranks the model is sharded over (this runner holds one
            shard: ``num_kv_heads / tp_size`` KV heads per layer in its cache).
        quant_config: weight quantisation (:class:`minivllm.quantization.QuantConfig`) or None.
    """

    def __init__(self, source: ModelSource, device: torch.device, dtype: torch.dtype, backend_name: str,
                 block_size: int, num_kvcache_blocks: int | None, kv_cache_memory_bytes: int | None,
                 gpu_memory_utilization: float, max_num_batched_tokens: int, seed: int | None,
                 tp_size: int = 1, quant_config=None):
        self.source = source
        self.hf_config = source.hf_config
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.tp_size = tp_size
        self.model = build_model(source, device, dtype, seed, quant_config)
        self.backend = get_attention_backend(backend_name, device, block_size, dtype)
        self.sampler = Sampler(seed, device)
        self.num_kv_blocks = self._size_kv_cache(num_kvcache_blocks, kv_cache_memory_bytes,
                                                 gpu_memory_utilization, max_num_batched_tokens)
        self.kv_cache, self.kv_caches = allocate_kv_cache(self.hf_config, self.num_kv_blocks, block_size,
                                                          dtype, device, tp_size)
        self.graph_runner = None  # decode CUDA graphs, see enable_cuda_graphs

    # -- set-up ---------------------------------------------------------------------------
    def _size_kv_cache(self, num_blocks, memory_bytes, gpu_util, max_tokens) -> int:
        cfg, bs, dtype = self.hf_config, self.block_size, self.dtype
        if num_blocks is not None:
            return num_blocks
        if memory_bytes is not None:
            blocks = num_blocks_for_bytes(memory_bytes, cfg, dtype, bs, self.tp_size)
        elif self.device.type == "cuda":
            blocks = self._blocks_from_gpu_memory(gpu_util, max_tokens)
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
            self.model, self.kv_caches, self.backend, max_num_seqs, -(-max_model_len // self.block_size),
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
    def forward_logits(self, inp: ModelInput) -> torch.Tensor:
        """fp32 logits ``[num_sampling, vocab_size]`` for the rows that sample."""
        if self.graph_runner is not None and self.graph_runner.can_run(inp.meta):
            hidden = self.graph_runner.run(inp.input_ids, inp.positions, inp.meta)
        else:
            self.backend.prepare(inp.meta)
            ctx = ForwardContext(inp.meta, self.backend, self.kv_caches)
            hidden = self.model(inp.input_ids, inp.positions, ctx)
        if not inp.sampling_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[inp.logits_indices]).float()

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """Per-row sampling settings; tensors are only built when some row is not greedy."""
        params = [s.params for s in seqs]
        if all(p.temperature == 0 and p.repetition_penalty == 1.0 for p in params):
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
            any_penalty=bool((penalties != 1.0).any()))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        inp = self.prepare_input(plan)
        t1 = time.perf_counter()
        logits = self.forward_logits(inp)
        self._sync()
        t2 = time.perf_counter()
        sampled: list[tuple[Sequence, int]] = []
        if inp.sampling_seqs:
            with torch.inference_mode():
                tokens = self.sampler(logits, self.sampling_batch(inp.sampling_seqs)).tolist()
            sampled = list(zip(inp.sampling_seqs, tokens))
        t3 = time.perf_counter()
        return RunnerOutput(sampled, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)

    def shutdown(self) -> None:
        self.graph_runner = None
        self.kv_caches = []
        self.kv_cache = None
        self.model = None
