"""Engine arguments (vLLM's names) and their resolution into a concrete configuration."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("minivllm")

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


@dataclass
class EngineArgs:
    """Everything ``LLM(model, **engine_args)`` accepts.

    Args:
        model: None (embedded model or ``$MINIVLLM_MODEL``), ``"minivllm-tiny"``, a local
            checkpoint directory, or ``"random:<preset>"``.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget per step (prefill + decode tokens). Default
            8192 with chunked prefill, else max(8192, max_model_len).
        max_model_len: longest sequence (prompt + output), tokens. Default: the model's
            ``max_position_embeddings`` capped at what the KV pool holds.
        block_size: tokens per KV block (16 for torch/triton, 256 for flash_attn).
        num_kvcache_blocks: KV pool size in blocks (overrides the byte budgets).
        kv_cache_memory_bytes: KV pool size in bytes (CPU default 512 MiB).
        gpu_memory_utilization: on CUDA, fraction of device memory the engine may use
            (weights + activations + KV), measured after a warm-up pass.
        enable_prefix_caching / enable_chunked_prefill: the two scheduler features.
        enforce_eager: disable CUDA graphs.
        tensor_parallel_size: processes the model is sharded over.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1".
        dtype: "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16", "float16".
        attention_backend: "auto", "torch", "triton", "flash_attn".
        seed: seed of the engine-wide sampling generator (and of random weights).
        compile: torch.compile the small fused ops; None = on for CUDA, off on CPU.
        init_method: torch.distributed rendezvous for tensor parallelism across machines
            (e.g. ``"env://"`` under torchrun, ``"tcp://host:port"``); None = the engine
            starts its workers on this machine.
        quantization: None (weights in ``dtype``) or ``"int8"``: per-output-channel
            symmetric int8 weights computed at load for every linear layer
            (:mod:`minivllm.quantization`); embeddings stay in ``dtype``.
        quantize_lm_head: with ``quantization="int8"``, quantise the LM head too (default;
            it is the largest single weight read of a small model).

    Raises:
        ValueError: a bad value (the message names the argument and the value).
    """

    model: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_kvcache_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int | None = 0
    compile: bool | None = None
    init_method: str | None = None
    quantization: str | None = None
    quantize_lm_head: bool = True

    def __post_init__(self) -> None:
        positive = ["max_num_seqs", "tensor_parallel_size"]
        optional_positive = ["max_num_batched_tokens", "max_model_len", "block_size",
                             "num_kvcache_blocks", "kv_cache_memory_bytes"]
        for name in positive + optional_positive:
            value = getattr(self, name)
            if value is None and name in optional_positive:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive int")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r}: must be in (0, 1]")
        from minivllm.quantization.layer import check_quantization

        check_quantization(self.quantization)
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head={self.quantize_lm_head!r}: must be a bool")

    @property
    def quant_config(self):
        """The :class:`minivllm.quantization.QuantConfig` these arguments ask for, or None."""
        if self.quantization is None:
            return None
        from minivllm.quantization.layer import QuantConfig

        return QuantConfig(self.quantization, self.quantize_lm_head)

    @classmethod
    def from_kwargs(cls, model, kwargs: dict) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(known)}")
        return cls(model=model, **kwargs)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: only 'cpu' and 'cuda' are supported")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> bf16 on CUDA, fp32 on CPU (bf16/fp16 matmuls are far slower on CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    """Resolved, concrete settings the engine runs with (see ``EngineArgs`` for meanings)."""

    args: EngineArgs
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_batched_tokens: int


def resolve_lengths(args: EngineArgs, max_position_embeddings: int, num_kv_blocks: int,
                    block_size: int) -> tuple[int, int]:
    """(max_model_len, max_num_batched_tokens) for a pool of ``num_kv_blocks`` blocks.

    Raises:
        ValueError: an explicit max_model_len larger than the pool or the model's
            positions, or chunked prefill off with a budget below max_model_len.
    """
    pool_tokens = num_kv_blocks * block_size
    if args.max_model_len is not None:
        max_model_len = args.max_model_len
        if max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds what the KV pool holds ({num_kv_blocks} blocks x "
                f"{block_size} tokens = {pool_tokens} tokens): raise the pool size or lower max_model_len")
        if max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_position_embeddings}")
    else:
        max_model_len = min(max_position_embeddings, pool_tokens)
        if max_model_len < max_position_embeddings:
            logger.info("max_model_len capped at %d tokens (the KV pool: %d blocks x %d); the model allows %d",
                        max_model_len, num_kv_blocks, block_size, max_position_embeddings)
    if args.max_num_batched_tokens is not None:
        budget = args.max_num_batched_tokens
        if not args.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} < max_model_len={max_model_len} with "
                f"enable_chunked_prefill=False: without chunking each prompt is scheduled whole")
    else:
        budget = 8192 if args.enable_chunked_prefill else max(8192, max_model_len)
    return max_model_len, budget
