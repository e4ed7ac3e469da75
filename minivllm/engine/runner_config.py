"""What a model runner is built from: one frozen, picklable record.

The engine fills it from ``EngineArgs`` once the device, dtype, attention backend and block
size are resolved; tensor-parallel rank 0 sends the same record to every worker (each
replaces only ``device`` and ``tp_size``), so every rank builds its shard from identical
settings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.utils.model_source import ModelSource


@dataclass(frozen=True)
class RunnerConfig:
    """Settings of one ``ModelRunner``.

    Attributes:
        source: the resolved model (config, checkpoint directory or ``random:`` preset).
        device: where this runner's model and KV cache live.
        dtype: weight, activation and KV cache dtype.
        attention_backend: resolved backend name ("torch", "triton", "flash_attn").
        block_size: tokens per KV block.
        num_kvcache_blocks: KV pool size in blocks; None: size it from the next two.
        kv_cache_memory_bytes: KV pool budget in bytes (per rank); None: from
            ``gpu_memory_utilization`` on CUDA, ``DEFAULT_CPU_KV_CACHE_BYTES`` on CPU.
        gpu_memory_utilization: fraction of GPU memory for weights, activations and KV cache.
        max_num_batched_tokens: tokens of the largest step, used for the warm-up forward
            that measures peak activation memory on CUDA.
        seed: sampler seed and random-weight seed (``random:`` presets); None: unseeded
            sampling, weight seed 0.
        tp_size: tensor-parallel ranks the model is sharded over; the runner holds one shard
            (``num_key_value_heads / tp_size`` KV heads per layer in its cache).
        max_num_seqs: most sequences per step: the GPU memory profile samples this many rows
            (logits ``[max_num_seqs, vocab]`` fp32 and the sampler's buffers).
        quant_config: weight quantisation (``minivllm.quantization.QuantConfig``) or None.
        kv_cache_dtype: the KV cache's dtype; None: ``dtype`` (see ``EngineArgs.kv_cache_dtype``).
    """

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    block_size: int
    num_kvcache_blocks: int | None
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    seed: int | None
    tp_size: int = 1
    max_num_seqs: int = 256
    quant_config: object = None
    kv_cache_dtype: torch.dtype | None = None
