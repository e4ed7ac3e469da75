"""Engine arguments (vLLM's names) and their resolution into a concrete configuration."""
from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import os
from dataclasses import dataclass

import torch

from minivllm.utils.dtypes import MODEL_DTYPES, canonical_dtype_name, dtype_spellings

logger = logging.getLogger("minivllm")

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20

#: vLLM engine arguments that have no meaning in minivllm. ``LLM(...)`` accepts them (so vLLM
#: scripts run unchanged) and logs one warning listing those given; any other unknown name
#: is still a ``TypeError``.
IGNORED_VLLM_ARGS = frozenset({
    "trust_remote_code",          # checkpoints are loaded by our own model code
    "disable_log_stats", "disable_log_requests",
    "swap_space",                 # preemption recomputes; there is no CPU swap
    "cpu_offload_gb",
    "revision", "tokenizer_revision", "code_revision", "download_dir",  # no downloads
    "disable_custom_all_reduce", "distributed_executor_backend",
    "disable_sliding_window",     # no model here has a sliding window
    "disable_cascade_attn", "cuda_graph_sizes",  # graphs are recorded for the batch sizes that occur
    "max_seq_len_to_capture", "disable_async_output_proc", "use_v2_block_manager",
    "enable_prefix_caching_hash", "enable_sleep_mode", "compilation_config",
    "hf_token", "worker_cls", "served_model_name", "max_parallel_loading_workers",
    "max_loras", "max_lora_rank", "max_cpu_loras",  # LoRA's sizes; LoRA itself is refused (LACKING_VLLM_ARGS)
    "guided_decoding_backend", "structured_outputs_config",  # a request asking for them is refused
    "limit_mm_per_prompt", "mm_processor_kwargs",  # likewise multimodal inputs
    "allowed_local_media_path", "allowed_media_domains",
    "disable_chunked_mm_input",   # no multimodal inputs to chunk
    "cudagraph_capture_sizes", "max_cudagraph_capture_size",  # see cuda_graph_sizes
    "distributed_timeout_seconds",  # tensor parallelism's start-up has its own (README, "Tensor parallelism")
    "ignore_patterns",            # the loader reads the checkpoint's safetensors files only
    "enable_log_requests",
    "optimization_level",         # vLLM's compilation level (-O): graphs here follow enforce_eager
    "offload_group_size", "enable_extensible_kv_cache",  # weight offloading, KV-cache growth: not here
})

#: vLLM engine arguments that turn on a feature minivllm does not have: ``LLM(...)`` refuses them,
#: naming the feature, when they turn it on (the test), and ignores their off values as it does
#: ``IGNORED_VLLM_ARGS`` (``pipeline_parallel_size=1`` in a vLLM script runs here).
LACKING_VLLM_ARGS = {
    "logits_processors": ("logits processors (callables applied to the logits)", bool),
    "enable_lora": ("LoRA adapters", bool),
    "pipeline_parallel_size": ("pipeline parallelism", lambda v: v not in (None, 1)),
    "data_parallel_size": ("data parallelism", lambda v: v not in (None, 1)),
    "enable_expert_parallel": ("expert parallelism", bool),
    "async_scheduling": ("asynchronous scheduling", bool),
    "skip_tokenizer_init": ("running without a tokenizer", bool),
    "task": ("a task other than generation", lambda v: v not in (None, "auto", "generate")),
    "runner": ("a runner other than generation", lambda v: v not in (None, "auto", "generate")),
    "convert": ("converting the model for pooling (embeddings, classification, rewards)",
                lambda v: v not in (None, "auto", "none")),
    "calculate_kv_scales": ("fp8 KV-cache scales", bool),
    "model_impl": ("another model implementation", lambda v: v not in (None, "auto")),
    "hf_overrides": ("overrides of the Hugging Face config", bool),
    "override_generation_config": ("overrides of the generation config", bool),
    "load_format": ("weights from elsewhere than the checkpoint's safetensors files (random weights: "
                    "model='random:<preset>')",
                    lambda v: v not in (None, "auto", "safetensors")),
    "tokenizer_mode": ("a tokenizer other than the Hugging Face (fast) one", lambda v: v not in (None, "auto", "hf")),
    "scheduling_policy": ("a scheduling policy other than first come, first served", lambda v: v not in (None, "fcfs")),
    "enable_prompt_embeds": ("prompt embeddings as inputs", bool),
    "override_pooler_config": ("pooling models", lambda v: v is not None),
    "pooler_config": ("pooling models", lambda v: v is not None),
    "max_num_partial_prefills": ("several partial prefills at once", lambda v: v not in (None, 1)),
    "max_long_partial_prefills": ("several partial prefills at once", lambda v: v not in (None, 1)),
    "long_prefill_token_threshold": ("a long-prefill threshold", bool),
    "stream_interval": ("streaming several tokens per output", lambda v: v not in (None, 1)),
    "reasoning_parser": ("reasoning parsers", bool),
    "kv_transfer_config": ("KV-cache transfer between engines (disaggregated prefill)", lambda v: v is not None),
    "enable_trace_replay": ("trace replay (to score a known continuation: append it to the prompt and ask for "
                            "SamplingParams(prompt_logprobs=...))", bool),
    "worker_extension_cls": ("worker extensions", bool),
    "attention_config": ("an attention config (the backend is attention_backend=...)", bool),
    "config_format": ("a model config format other than Hugging Face's", lambda v: v not in (None, "auto", "hf")),
    "quantization_config": ("a quantization config (weight-only int8 is quantization='int8')", lambda v: v is not None),
    "enable_return_routed_experts": ("mixture-of-experts routing outputs", bool),
    "return_sampling_mask": ("returning each step's sampling mask", bool),
}

#: vLLM 0.34's top-level shortcuts for ``speculative_config``'s keys (``LLM(spec_method="ngram",
#: spec_tokens=4)``), merged into it as vLLM does (the same key given both ways is refused).
SPEC_SHORTCUTS = {"spec_method": "method", "spec_model": "model", "spec_tokens": "num_speculative_tokens"}

#: Other engines' spellings of our arguments (nano-vllm's ``kvcache_block_size``, vLLM's
#: ``num_gpu_blocks_override``).
ARG_ALIASES = {"kvcache_block_size": "block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}


@dataclass
class EngineArgs:
    """Everything ``LLM(model, **engine_args)`` accepts.

    Args:
        model: None (embedded model or ``$MINIVLLM_MODEL``), ``"minivllm-tiny"``, a local
            checkpoint directory, or ``"random:<preset>"``.
        max_num_seqs: most sequences in one step (None: 256, as vLLM's scripts pass its default).
        max_num_batched_tokens: token budget per step (prefill + decode tokens). Default
            8192 with chunked prefill, else max(8192, max_model_len).
        max_model_len: longest sequence (prompt + output), tokens. Default: the model's
            ``max_position_embeddings`` capped at what the KV pool holds (also for -1, vLLM's
            "fit it to memory").
        block_size: tokens per KV block (16 for torch/triton, 256 for flash_attn).
        num_kvcache_blocks: KV pool size in blocks of ``block_size`` tokens (overrides the byte
            budgets); None or -1 (nano-vllm's default): sized from the budgets.
        kv_cache_memory_bytes: KV pool size in bytes (CPU default 512 MiB).
        gpu_memory_utilization: on CUDA, fraction of device memory the engine may use
            (weights + activations + KV), measured after a warm-up pass (None: 0.9).
        enable_prefix_caching: reuse the KV of prompt prefixes already computed
            (``minivllm/engine/block_manager.py``).
        enable_chunked_prefill: split a prompt that does not fit a step's remaining token budget
            over several steps, mixed with the running sequences' decodes.
        prefix_caching_hash_algo: "xxhash" (default: fast, 64-bit) or "sha256" (collision
            resistant, for engines shared between tenants). Either way every prefix-cache hit
            is verified against the block's stored tokens and parent chain, so a collision
            costs a cache miss, never wrong KV; sha256 also makes crafting collisions (to
            evict or probe other users' cached prefixes) infeasible.
        enforce_eager: disable decode graphs: CUDA graphs on a GPU, CPU graphs on a CPU
            (``minivllm/layers/cpu_graph.py``); every step then runs the model's forward.
        tensor_parallel_size: processes the model is sharded over.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1".
        dtype: "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16", "float16".
        attention_backend: "auto", "torch", "triton", "flash_attn".
        seed: seed of the engine-wide sampling generator (and of random weights): an int in
            [0, 2**32 - 1], as vLLM takes it, or None.
        compile: torch.compile the small fused ops; None = on for CUDA, off on CPU.
        speculative_config: vLLM v1's speculative decoding settings, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}`` or ``{"method": "draft_model", "model": "minivllm-tiny-draft",
            "num_speculative_tokens": 4}`` (see ``minivllm/spec_decode``); None: off.
        logprobs_mode: what ``SamplingParams.logprobs`` report (vLLM's): "raw_logprobs"
            (default), "raw_logits", "processed_logprobs" or "processed_logits"; see
            ``minivllm/layers/logprobs.py``.
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's
            argument and default, 20); -1: no cap (a request may then ask for the whole
            vocabulary, ``-1``, at every token). A request over it is refused when added.
        init_method: torch.distributed rendezvous for tensor parallelism across machines
            (e.g. ``"env://"`` under torchrun, ``"tcp://host:port"``); None = the engine
            starts its workers on this machine.
        quantization: None (weights in ``dtype``) or ``"int8"``: per-output-channel
            symmetric int8 weights computed at load for every linear layer
            (:mod:`minivllm.quantization`); embeddings stay in ``dtype``.
        quantize_lm_head: with ``quantization="int8"``, quantise the LM head too (default;
            it is the largest single weight read of a small model).
        tokenizer: the tokenizer to use in place of the model's (vLLM's argument): None (the
            model's), a local directory holding Hugging Face tokenizer files, or an embedded
            model's name.
        kv_cache_dtype: vLLM's argument: ``"auto"`` (the KV cache holds the model's dtype) or
            ``"bfloat16"``. With a float32 model on the CPU, a bfloat16 cache halves the KV bytes:
            twice the blocks in the same memory, and half the bytes a decode step reads (the
            attention still computes in float32, from the cached values widened exactly; each
            K and V is rounded to bfloat16 once, when written, so the logits move away from an
            fp32 cache's by about bfloat16's precision). Another dtype than the model's needs the
            torch attention backend (``resolve_kv_cache_dtype``); vLLM's fp8 formats are refused.
        generation_config: vLLM's: where ``generate()`` without ``sampling_params`` takes its defaults
            from (``LLM.get_default_sampling_params()``): ``"auto"`` (default) the checkpoint's
            ``generation_config.json``, ``"vllm"`` ``SamplingParams()``' own defaults (the file ignored),
            or a directory holding a ``generation_config.json``.
        profiler_config: vLLM's: where ``LLM.start_profile()`` / ``stop_profile()`` write a
            ``torch.profiler`` trace, e.g. ``{"profiler": "torch", "torch_profiler_dir": "./trace"}``
            (``minivllm/telemetry/profiler.py``); None: ``$VLLM_TORCH_PROFILER_DIR``.

    Raises:
        ValueError: a bad value (the message names the argument and the value); whether CUDA is
            there, and what a combination of valid values allows (a backend on a device, a KV cache
            dtype with a backend, a ``max_model_len`` the KV pool cannot hold), is checked when the
            engine is built (``LLMEngine``), with the same kind of message.
        TypeError: an argument minivllm does not know, a vLLM one for a feature it lacks (naming
            the feature), or one given under both its name and an alias (``from_kwargs``).
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
    prefix_caching_hash_algo: str = "xxhash"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int | None = 0
    compile: bool | None = None
    init_method: str | None = None
    speculative_config: dict | None = None
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    quantization: str | None = None
    quantize_lm_head: bool = True
    tokenizer: str | None = None
    kv_cache_dtype: str = "auto"
    profiler_config: dict | None = None
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.num_kvcache_blocks == -1 and not isinstance(self.num_kvcache_blocks, bool):
            self.num_kvcache_blocks = None  # nano-vllm's "not given"
        if self.max_model_len == -1 and not isinstance(self.max_model_len, bool):
            self.max_model_len = None  # vLLM's "the longest that fits in memory": the default's capping
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs", "gpu_memory_utilization"):
            if getattr(self, name) is None:  # vLLM's spelling of "the engine's default" (argparse defaults pass it)
                setattr(self, name, _FIELD_DEFAULTS[name])
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        for f in dataclasses.fields(self):  # numpy integers, as a sweep gives them: Python ints
            value = getattr(self, f.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                setattr(self, f.name, int(value))
        for name in ("model", "tokenizer"):  # Path(5) would fail later with a TypeError naming neither
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name}={value!r}: must be a model name, a directory path or None")
        positive = ["max_num_seqs", "tensor_parallel_size"]
        optional_positive = ["max_num_batched_tokens", "max_model_len", "block_size",
                             "num_kvcache_blocks", "kv_cache_memory_bytes"]
        for name in positive + optional_positive:
            value = getattr(self, name)
            if value is None and name in optional_positive:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive int")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "quantize_lm_head"):
            if not isinstance(getattr(self, name), bool):  # 'no' and 'false' are truthy strings
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r}: must be True, False or None (on for CUDA only)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= 2**32 - 1):
            raise ValueError(f"seed={self.seed!r}: must be an int in [0, 2**32 - 1] (vLLM's range, numpy's "
                             "seeds) or None")
        if not isinstance(self.dtype, (str, torch.dtype)):
            raise ValueError(f"dtype={self.dtype!r}: choose 'auto' or one of {dtype_spellings(MODEL_DTYPES)}")
        resolve_dtype(self.dtype, torch.device("cpu"))  # the name's check (the device only decides what "auto" is)
        if not isinstance(self.device, str) or (self.device != "auto" and _device_type(self.device) not in ("cpu",
                                                                                                        "cuda")):
            raise ValueError(f"device={self.device!r}: choose 'auto', 'cpu', 'cuda' or 'cuda:N'")
        from minivllm.layers.attention import BACKEND_NAMES

        if self.attention_backend not in ("auto",) + BACKEND_NAMES:
            raise ValueError(f"attention_backend={self.attention_backend!r}: choose one of "
                             f"{['auto', *BACKEND_NAMES]}")
        if self.speculative_config is not None:
            from minivllm.spec_decode.config import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)  # raises ValueError naming the problem
        if self.prefix_caching_hash_algo not in ("xxhash", "sha256"):
            raise ValueError(f"prefix_caching_hash_algo={self.prefix_caching_hash_algo!r}: "
                             "choose 'xxhash' or 'sha256'")
        modes = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
        if self.logprobs_mode not in modes:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: choose one of {list(modes)}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: must be an int >= 0, or -1 (no cap)")
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, numbers.Real) or not 0 < gmu <= 1:
            raise ValueError(f"gpu_memory_utilization={gmu!r}: must be a number in (0, 1]")
        from minivllm.quantization.layer import check_quantization

        check_quantization(self.quantization)
        from minivllm.telemetry.profiler import check_profiler_config

        check_profiler_config(self.profiler_config)
        from minivllm.executor.launch import check_init_method

        check_init_method(self.init_method)
        if self.init_method is not None and self.tensor_parallel_size == 1:
            raise ValueError(f"init_method={self.init_method!r}: only tensor parallelism (tensor_parallel_size > 1) "
                             "joins a process group; with one process it would be ignored")
        gen = self.generation_config
        if isinstance(gen, os.PathLike):
            self.generation_config = gen = os.fspath(gen)
        if gen is None:  # vLLM's spelling of the default
            self.generation_config = gen = "auto"
        if not isinstance(gen, str) or (gen not in ("auto", "vllm")
                                        and not os.path.isfile(os.path.join(gen, "generation_config.json"))):
            raise ValueError(f"generation_config={gen!r}: choose 'auto' (the checkpoint's generation_config.json), "
                             "'vllm' (SamplingParams' defaults) or a directory holding a generation_config.json")
        if not isinstance(self.kv_cache_dtype, str):  # a list is unhashable; a torch.dtype is not vLLM's spelling
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of {list(KV_CACHE_DTYPES)} "
                             "(vLLM's names, as strings)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of {list(KV_CACHE_DTYPES)} "
                             "(minivllm has no fp8 KV cache)")

    @property
    def quant_config(self):
        """The :class:`minivllm.quantization.QuantConfig` these arguments ask for, or None."""
        if self.quantization is None:
            return None
        from minivllm.quantization.layer import QuantConfig

        return QuantConfig(self.quantization, self.quantize_lm_head)

    @classmethod
    def add_cli_args(cls, parser):
        """vLLM's: add every argument to ``parser`` (an ``argparse`` parser or argument group) as
        ``--kebab-case`` with its default, and return ``parser``, so that ``LLM(**vars(args))``
        or :meth:`from_cli_args` takes what it parsed (``minivllm/utils/argparse_utils.py``)."""
        from minivllm.utils.argparse_utils import add_cli_args

        return add_cli_args(cls, parser)

    @classmethod
    def from_cli_args(cls, args) -> "EngineArgs":
        """vLLM's: the arguments in a namespace parsed after :meth:`add_cli_args` (vLLM-only ones
        given are warned about or refused as in :meth:`from_kwargs`).

        Raises:
            ValueError: a bad value (the message names the argument and the value).
            TypeError: a vLLM argument for a feature minivllm lacks, naming the feature."""
        from minivllm.utils.argparse_utils import from_cli_args

        return from_cli_args(cls, args)

    @classmethod
    def from_kwargs(cls, model, kwargs: dict) -> "EngineArgs":
        """Build from ``LLM(model, **kwargs)``: vLLM arguments in ``IGNORED_VLLM_ARGS`` are
        dropped with one warning listing them; ``ARG_ALIASES`` are renamed.

        Raises:
            TypeError: an argument that is neither ours nor a known vLLM one (naming it), a vLLM
                argument for a feature minivllm lacks (naming the feature), or an argument given
                under both its name and an alias.
            ValueError: an argument's bad value (naming it; the class docstring's checks).
        """
        return cls(model=model, **kwargs)


def _vllm_args_taken(kwargs: dict) -> dict:
    """``kwargs`` with ``ARG_ALIASES`` renamed and the vLLM arguments that change nothing here
    dropped (one warning lists them); raises TypeError as :meth:`EngineArgs.from_kwargs` says."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    known = set(defaults)
    kwargs = dict(kwargs)
    for alias, name in ARG_ALIASES.items():
        if alias in kwargs:
            # at its default the field was not given: LLM(**vars(args)) of a parser with both options
            if name in kwargs and kwargs[name] != defaults[name]:
                raise TypeError(f"engine argument {name!r} given twice (also as {alias!r})")
            kwargs[name] = kwargs.pop(alias)
    shortcuts = {k: v for k in SPEC_SHORTCUTS if k in kwargs and (v := kwargs.pop(k)) is not None}
    if shortcuts:
        spec = kwargs.get("speculative_config")
        if spec is not None and not isinstance(spec, dict):
            raise ValueError(f"speculative_config={spec!r}: expected a dict such as {{'method': 'ngram'}}")
        spec = dict(spec or {})  # a copy: the caller's dict stays as it was
        for name, value in shortcuts.items():
            if SPEC_SHORTCUTS[name] in spec:
                raise ValueError(f"{name}={value!r} and speculative_config[{SPEC_SHORTCUTS[name]!r}] are mutually "
                                 "exclusive (as in vLLM): give one")
            spec[SPEC_SHORTCUTS[name]] = value
        kwargs["speculative_config"] = spec
    lacking = sorted(k for k in kwargs if k in LACKING_VLLM_ARGS and k not in known)
    turned_on = [k for k in lacking if LACKING_VLLM_ARGS[k][1](kwargs[k])]
    if turned_on:
        raise TypeError("; ".join(f"{k}={kwargs[k]!r}: {LACKING_VLLM_ARGS[k][0]} is a vLLM feature minivllm "
                                  "does not have" for k in turned_on) + " (README, 'Coming from vLLM or nano-vllm')")
    ignored = sorted(k for k in kwargs if (k in IGNORED_VLLM_ARGS or k in lacking) and k not in known)
    unknown = sorted(set(kwargs) - known - set(ignored))
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(known)}")
    if ignored:
        logger.warning("ignoring vLLM engine argument(s) that change nothing in minivllm: %s",
                       ", ".join(f"{k}={kwargs[k]!r}" for k in ignored))
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            logger.warning("distributed_executor_backend='external_launcher': under torchrun minivllm joins the "
                           "job without it, but unlike vLLM only rank 0's LLM(...) returns (with the outputs); "
                           "on the other ranks it serves as the worker and then exits (README, 'Launching')")
    return {k: v for k, v in kwargs.items() if k not in ignored}


_dataclass_init = EngineArgs.__init__
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


def _init_taking_vllm_args(self, *args, **kwargs):
    """The dataclass ``__init__``, also taking vLLM's engine arguments as ``LLM(...)`` does: a vLLM
    script builds ``EngineArgs(model=..., trust_remote_code=True)`` for ``LLMEngine.from_engine_args``."""
    _dataclass_init(self, *args, **_vllm_args_taken(kwargs))


# functools.wraps: help() and Jupyter's Shift+Tab show the dataclass's own signature (via __wrapped__)
EngineArgs.__init__ = functools.wraps(_dataclass_init)(_init_taking_vllm_args)


def _device_type(device: str) -> str | None:
    """The type of a device string (``"cuda:1"`` -> ``"cuda"``), or None where torch cannot parse it."""
    try:
        return torch.device(device).type
    except (RuntimeError, ValueError):
        return None


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


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> bf16 on CUDA, fp32 on CPU (bf16/fp16 matmuls are far slower on CPUs); a
    name of ``MODEL_DTYPES`` in any spelling of ``minivllm.utils.dtypes`` -> that dtype.

    Raises:
        ValueError: any other value (the message lists the accepted names).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = canonical_dtype_name(dtype)
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose 'auto' or one of {dtype_spellings(MODEL_DTYPES)}")
    return getattr(torch, name)


#: ``kv_cache_dtype`` values: vLLM's names, and the dtype each gives (None: the model's)
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, attention_backend: str) -> torch.dtype:
    """The KV cache's dtype: the model's ``dtype`` for ``"auto"``, else the one named.

    Args:
        kv_cache_dtype: a key of ``KV_CACHE_DTYPES``.
        dtype: the model's (resolved) dtype.
        attention_backend: the resolved backend name: a cache of another dtype than the model's is
            read by the torch backend only (its CPU kernel and its reference path widen it to
            float32); the Triton and flash-attn kernels take the model's dtype.

    Raises:
        ValueError: an unknown name, or another dtype than the model's on another backend than torch.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: choose one of {list(KV_CACHE_DTYPES)}")
    kv = KV_CACHE_DTYPES[kv_cache_dtype] or dtype
    if kv != dtype and attention_backend != "torch":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} with dtype={str(dtype).removeprefix('torch.')}: a KV "
                         f"cache in another dtype than the model's needs attention_backend='torch', got "
                         f"{attention_backend!r}")
    return kv


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
    kv_cache_dtype: torch.dtype | None = None  #: the KV cache's dtype (None: ``dtype``)


@dataclass(frozen=True)
class ModelConfig:
    """The model as the engine runs it, under vLLM's name (``llm.llm_engine.model_config``,
    ``LLMEngine.get_model_config()``, ``LLM.model_config``), for scripts that read it.

    Fields: ``model`` (the name or path given), ``tokenizer`` (its directory), ``dtype`` (a
    ``torch.dtype``), ``seed``, ``max_model_len`` (tokens, after capping to the pool and the
    model's positions), ``hf_config`` (the transformers config).
    """

    model: str
    tokenizer: str
    dtype: torch.dtype
    seed: int | None
    max_model_len: int
    hf_config: object

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_config.hidden_size


def resolve_lengths(args: EngineArgs, max_position_embeddings: int, num_kv_blocks: int,
                    block_size: int, block_bytes: int | None = None) -> tuple[int, int]:
    """(max_model_len, max_num_batched_tokens) for a pool of ``num_kv_blocks`` blocks.

    An explicit ``max_model_len`` above the model's ``max_position_embeddings`` is capped
    there with a warning (nano-vllm's behaviour; vLLM refuses). ``block_bytes``: bytes of
    one KV block, to say how large a pool the refused ``max_model_len`` needs.

    Raises:
        ValueError: an explicit max_model_len larger than the KV pool (the message names the
            engine argument that enlarges the pool and the size needed), or chunked prefill
            off with a budget below max_model_len.
    """
    pool_tokens = num_kv_blocks * block_size
    if args.max_model_len is not None:
        max_model_len = args.max_model_len
        if max_model_len > max_position_embeddings:
            logger.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d: capped at %d",
                           max_model_len, max_position_embeddings, max_position_embeddings)
            max_model_len = max_position_embeddings
        if max_model_len > pool_tokens:
            raise ValueError(_pool_too_small(args, max_model_len, num_kv_blocks, block_size, block_bytes))
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


def _pool_too_small(args: EngineArgs, max_model_len: int, num_kv_blocks: int, block_size: int,
                    block_bytes: int | None) -> str:
    """The refusal of a ``max_model_len`` the KV pool cannot hold: what to enlarge, by how much."""
    from minivllm.utils import cdiv

    pool_tokens = num_kv_blocks * block_size
    need = cdiv(max_model_len, block_size)
    msg = (f"max_model_len={max_model_len} exceeds what the KV pool holds ({num_kv_blocks} blocks x "
           f"{block_size} tokens = {pool_tokens} tokens); one sequence of that length needs {need} blocks")
    return f"{msg}: set {pool_fix(args, need, block_bytes)}, or lower max_model_len"


def pool_fix(args: EngineArgs, need: int, block_bytes: int | None) -> str:
    """What makes the KV pool ``need`` blocks (of ``block_bytes`` each, None if unknown): the engine
    argument that sizes it (``num_kvcache_blocks`` wins where given), and its value."""
    if args.num_kvcache_blocks is not None or block_bytes is None:
        return f"num_kvcache_blocks>={need}"
    need_bytes = need * block_bytes
    fix = f"kv_cache_memory_bytes>={need_bytes} ({need_bytes / 2**20:.1f} MiB) or num_kvcache_blocks>={need}"
    if args.kv_cache_memory_bytes is None and args.device != "cpu" and torch.cuda.is_available():
        fix += ", or raise gpu_memory_utilization"
    return fix


class ProfilerConfig(dict):
    """vLLM's ``ProfilerConfig`` (``from vllm.config import ProfilerConfig``): the
    ``profiler_config`` engine argument, a dict here, built with keyword arguments and checked at
    once: ``ProfilerConfig(profiler="torch", torch_profiler_dir="./trace")``.

    Raises:
        ValueError: what ``LLM(profiler_config=...)`` refuses
            (:func:`minivllm.telemetry.profiler.check_profiler_config`: an unknown key, a profiler
            other than ``"torch"``, ...), naming it.
    """

    def __init__(self, *args, **kwargs):  # as dict's: dataclasses.asdict rebuilds it from (key, value) pairs
        from minivllm.telemetry.profiler import check_profiler_config

        super().__init__(*args, **kwargs)
        check_profiler_config(dict(self))
