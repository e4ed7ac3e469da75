"""The engine loop: requests in, one ``step()`` at a time, outputs and step records out.

    add_request -> [ step: Scheduler.schedule -> ModelRunner.run (inputs, model,
    attention backend, sampler) -> Scheduler.update_from_output (tokens, stop checks,
    frees) -> OutputProcessor.process (detokenize, stop strings) -> RequestOutput ] -> ...

A step is a transaction (``minivllm/engine/transaction.py``): if anything in it raises,
KeyboardInterrupt included, every request is left as it was before the step. Steps are
serialised by a lock, so threads sharing one engine (a widget running in the background
while a cell calls ``generate``) interleave whole steps.
"""
from __future__ import annotations

import logging
import math
import numbers
import operator
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import torch

from minivllm.config import (EngineArgs, EngineConfig, ModelConfig, resolve_device, resolve_dtype,
                             resolve_kv_cache_dtype, resolve_lengths)
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.delivery import OutputDelivery
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.kv_cache import kv_bytes_per_token
from minivllm.engine.model_runner import ModelRunner, RunnerConfig, RunnerOutput
from minivllm.engine.parallel_sampling import ParentRequest, ParentRequests, child_params
from minivllm.engine.output_processor import OutputKind, OutputProcessor, RequestState, make_output, update_text
from minivllm.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.engine.transaction import StepTransaction
from minivllm.exceptions import VLLMValidationError
from minivllm.generation_config import default_sampling_params, generation_defaults
from minivllm.inputs import cache_salt_of, check_tokenization_kwargs, prompt_truncation
from minivllm.layers.attention import default_block_size, resolve_backend_name
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import NgramProposer
from minivllm.telemetry.peaks import Peaks, get_peaks
from minivllm.telemetry.profiler import TorchProfile
from minivllm.telemetry.roofline import engine_cost, fill_step_record
from minivllm.telemetry.step_record import PlannedEntries, StepRecord, entries_of
from minivllm.utils.heap_trim import trim_heap
from minivllm.utils.model_source import load_tokenizer, resolve_model, with_tokenizer

logger = logging.getLogger("minivllm")

_START_POS = attrgetter("start_pos")


def _token_id(t) -> int:
    """A prompt's token id as a Python int: ints and integer scalars (numpy's, a 0-d integer torch
    tensor: what ``list(array)`` gives) are taken; anything else (bool, float, str) is refused.

    Raises:
        ValueError: naming the value and its type.
    """
    if not isinstance(t, bool):  # numpy's bool has no __index__
        try:
            return operator.index(t)
        except TypeError:
            pass
    raise VLLMValidationError(f"token id {t!r} ({type(t).__name__}) is not an integer")


@dataclass
class StepResult:
    """What one step produced (``LLMEngine.step_with_record()``).

    Attributes:
        outputs: ``RequestOutput`` of every request that got a token or finished this step.
        record: the step's measured ``StepRecord``.
    """

    outputs: list[RequestOutput]
    record: StepRecord


#: vLLM's engine internals that scripts reach for -> where the same thing is here
_VLLM_ENGINE_ATTRIBUTES = {
    "model_executor": "vLLM's executor of worker processes; here the model is in this process: "
                      "llm.llm_engine.runner.model (with tensor parallelism, rank 0's shard)",
    "vllm_config": "vLLM's bundle of configs; here llm.llm_engine.config (an EngineConfig: device, dtype, "
                   "block_size, num_kv_blocks, max_model_len, max_num_batched_tokens, and the arguments as .args) "
                   "and llm.llm_engine.model_config",
    "cache_config": "vLLM's KV-cache config; here llm.llm_engine.config.num_kv_blocks blocks of "
                    "llm.llm_engine.config.block_size tokens (llm.llm_engine.config.kv_cache_dtype: their dtype)",
    "scheduler_config": "here llm.llm_engine.scheduler.config (max_num_seqs, max_num_batched_tokens, "
                        "max_model_len, ...)",
    "parallel_config": "here llm.llm_engine.config.args.tensor_parallel_size (no pipeline or data parallelism)",
    # nano-vllm's engine
    "is_finished": "nano-vllm's; here not llm.llm_engine.has_unfinished_requests()",
    "exit": "nano-vllm's; here llm.shutdown() (on the LLM) frees the engine",
    "model_runner": "nano-vllm's; here llm.llm_engine.runner (its model: .runner.model)",
}


def _refuse_encoding(value, name: str) -> None:
    """A tokenizer's output (transformers' ``BatchEncoding``, or a dict with ``input_ids``) given as
    a prompt: refused with the fix. transformers 5's ``apply_chat_template(..., tokenize=True)``
    returns one where 4.x returned the ids, so the vLLM idiom ``TokensPrompt(prompt_token_ids=
    tok.apply_chat_template(...))`` lands here.

    Raises:
        ValueError: naming the value's type and what to pass instead.
    """
    if isinstance(value, Mapping) and "input_ids" in value and "prompt_token_ids" not in value:
        raise VLLMValidationError(f"{name}: got a {type(value).__name__} with keys {list(value.keys())} (what a tokenizer call "
                                  f"returns, and transformers 5's apply_chat_template with tokenize=True): pass its "
                                  f"['input_ids'], a list of token ids")


class StepTimer:
    """Milliseconds spent in each phase of a step, from ``time.perf_counter`` marks."""

    __slots__ = ("start", "last", "schedule_ms", "postprocess_ms")

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.schedule_ms = self.postprocess_ms = 0.0

    def lap(self) -> float:
        """Milliseconds since the previous mark (or the start)."""
        now = time.perf_counter()
        ms, self.last = (now - self.last) * 1e3, now
        return ms


def refuse_lora(lora_request) -> None:
    """vLLM's ``lora_request`` argument: only None is accepted (ValueError naming anything else)."""
    if lora_request is not None:
        raise VLLMValidationError(f"lora_request={lora_request!r}: minivllm does not support LoRA adapters "
                                  "(only lora_request=None is accepted)")


class LLMEngine:
    """Owns the scheduler, block manager, model runner and tokenizer.

    Build with ``LLMEngine(EngineArgs(...))`` or ``LLMEngine.from_engine_args``.

    Args:
        args: the engine arguments (``minivllm.config.EngineArgs``; its docstring gives each).

    Raises:
        ValueError: an argument's bad value, naming it (dtype, device, block size, a
            max_model_len the KV pool cannot hold, a speculative config, ...).
        FileNotFoundError: a model or tokenizer path that does not exist.
        TypeError: ``args`` is not an ``EngineArgs`` (nano-vllm's ``LLMEngine(model, ...)``).
    """

    def __init__(self, args: EngineArgs = None, **kwargs):
        if kwargs or not isinstance(args, EngineArgs):  # nano-vllm's LLMEngine(model, **kwargs) is its LLM
            given = ", ".join([repr(args)] * (args is not None) + [f"{k}={v!r}" for k, v in kwargs.items()])
            raise TypeError(f"LLMEngine({given}): takes EngineArgs(model=..., ...), one (or use "
                            "LLMEngine.from_engine_args); nano-vllm's LLMEngine(model, **kwargs) is LLM(model, **kwargs) "
                            "here, its engine llm.llm_engine")
        self.args = args
        self.source = with_tokenizer(resolve_model(args.model), args.tokenizer)
        #: the checkpoint's recommended sampling settings (generation_config.json): a bad value is
        #: named now, before the weights load, not at the first generate() without sampling_params
        gen_dir = {"auto": self.source.checkpoint_dir, "vllm": None}.get(args.generation_config,
                                                                         args.generation_config)
        self.default_sampling_params = default_sampling_params(gen_dir)
        hf = self.source.hf_config
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        backend_name = resolve_backend_name(args.attention_backend, device, args.block_size, dtype)
        block_size = args.block_size or default_block_size(backend_name)
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, backend_name)
        self.tokenizer = load_tokenizer(self.source.tokenizer_dir)
        # the largest step resolve_lengths can allow (the memory profile runs one this long)
        positions = hf.max_position_embeddings  # an explicit max_model_len above it is capped to it
        budget_hint = args.max_num_batched_tokens or (
            8192 if args.enable_chunked_prefill else max(8192, min(args.max_model_len or positions, positions)))
        runner_config = RunnerConfig(
            source=self.source, device=device, dtype=dtype, attention_backend=backend_name, block_size=block_size,
            num_kvcache_blocks=args.num_kvcache_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_batched_tokens=budget_hint,
            seed=args.seed, tp_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs,
            quant_config=args.quant_config, kv_cache_dtype=kv_dtype)
        if args.tensor_parallel_size > 1:  # rank 0 of a sharded model; see minivllm/executor/tp_runner.py
            from minivllm.executor.tp_runner import TPModelRunner

            self.runner = TPModelRunner(runner_config, init_method=args.init_method)
        else:
            self.runner = ModelRunner(runner_config)
        try:
            block_bytes = kv_bytes_per_token(hf, kv_dtype, args.tensor_parallel_size) * block_size
            self._kv_block_bytes = block_bytes  # (what a larger pool takes: _longer_hint)
            max_model_len, budget = resolve_lengths(args, hf.max_position_embeddings, self.runner.num_kv_blocks,
                                                    block_size, block_bytes)
            self.config = EngineConfig(args, device, dtype, self.runner.backend.name, block_size,
                                       self.runner.num_kv_blocks, max_model_len, budget, kv_dtype)
            self._optimise(args, device)
        except BaseException:
            # A refused config must not leave the KV cache (or tensor-parallel workers) alive
            # until garbage collection, which a notebook's saved traceback can delay for long.
            self.runner.shutdown()
            raise
        self.model_config = ModelConfig(self.source.name, str(self.source.tokenizer_dir), dtype, args.seed,
                                        max_model_len, hf)
        self.runner.logprobs_mode = args.logprobs_mode
        self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size, args.enable_prefix_caching,
                                          args.prefix_caching_hash_algo)
        prefaulter = getattr(self.runner, "kv_prefaulter", None)
        if prefaulter is not None:  # the CPU pool's first pages are made now, in the background
            self.block_manager.on_fresh_block = prefaulter.note
            prefaulter.note(-1)
        # As vLLM: the tokenizer's eos ends a request as an eos (stop_reason None), and a generation
        # config's other eos ids end it as stop tokens (stop_reason: the id); both unless ignore_eos.
        self.eos_token_id = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(self.source.eos_token_ids) | (
            frozenset() if self.eos_token_id is None else {self.eos_token_id})
        self.profiler = TorchProfile(args.profiler_config, device)  # LLM.start_profile / stop_profile
        self.speculative_config = (SpeculativeConfig.from_dict(args.speculative_config)
                                   if args.speculative_config is not None else None)
        try:
            propose = self._proposer(runner_config, self.runner.num_kv_blocks * block_size)
        except BaseException:
            self.runner.shutdown()
            raise
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, budget, max_model_len,
                                                   args.enable_chunked_prefill, self.eos_token_ids, propose,
                                                   self.eos_token_id),
                                   self.block_manager)
        self.output_processor = OutputProcessor(self.scheduler.finish)
        self.scheduler.stop_string_cut = self.output_processor.stop_string_cut
        self.requests = self.output_processor.states  # request id -> RequestState, unfinished ones
        self.vocab_size = hf.vocab_size
        self.step_index = 0
        self.last_step_record: StepRecord | None = None
        self._lock = threading.RLock()
        self._delivery = OutputDelivery()  # outputs to the callers waiting for them (delivery.py)
        self._sinks = self._delivery.sinks  # request id -> callable receiving its outputs
        self._stepping = False  # a step in flight: an abort re-entering from inside it waits for its end
        #: (request id, its parent or state then) of the aborts asked for from inside a step
        self._deferred_aborts: deque[tuple[str, object]] = deque()
        self._warned_max_tokens = False
        self.parents = ParentRequests()  # requests with n > 1
        # Roofline accounting: FLOPs and bytes of every step from the config; MFU/MBU
        # once peaks are measured (``measure_peaks``), since that takes a moment.
        #: bytes per element of the linears' weights as held (16-bit panels: 2), or None
        self.weight_storage = self._weight_storage()
        self.model_cost = engine_cost(self, tp_size=args.tensor_parallel_size)  # per rank
        self.peaks: Peaks | None = None
        logger.info("minivllm engine: model=%s device=%s dtype=%s attention_backend=%s block_size=%d "
                    "kv_blocks=%d max_model_len=%d max_num_batched_tokens=%d", self.source.name, device,
                    dtype, self.config.attention_backend, block_size, self.runner.num_kv_blocks,
                    max_model_len, budget)
        defaults = generation_defaults(gen_dir)
        if defaults:  # as vLLM says: a generate() without sampling_params does not get SamplingParams()'s defaults
            where = "the checkpoint's" if gen_dir == self.source.checkpoint_dir else f"{str(gen_dir)!r}:"
            logger.info("default sampling parameters from %s generation_config.json (used when generate() gets no "
                        "sampling_params): %s", where, ", ".join(f"{k}={v!r}" for k, v in defaults.items()))

    def _proposer(self, runner_config: RunnerConfig, kv_tokens: int):
        """The speculative proposer ``speculative_config`` asks for (None: no speculation)."""
        config = self.speculative_config
        if config is None:
            return None
        if config.num_speculative_tokens >= self.config.max_model_len:  # (a draft pool sized for it, or nothing)
            raise ValueError(f"speculative_config num_speculative_tokens={config.num_speculative_tokens}: a "
                             f"sequence holds at most max_model_len={self.config.max_model_len} tokens, so fewer "
                             "drafts than that")
        if config.method == "ngram":
            return NgramProposer(config)
        from minivllm.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, self.source.hf_config.vocab_size, runner_config, kv_tokens)
        g = self.runner.graph_runner
        # the draft follows the target's graphs unless speculative_config's enforce_eager says otherwise
        wants_graphs = (g is not None and g.kind == "cpu") if config.enforce_eager is None else not config.enforce_eager
        if wants_graphs and proposer.enable_cpu_graphs(self.config.args.max_num_seqs, self.config.max_model_len):
            logger.info("draft model: its forwards replay CPU graphs too")
        elif config.enforce_eager is False:
            logger.info("draft model: speculative_config enforce_eager=False, but its forwards run eagerly (CPU "
                        "graphs need a float32 draft on a CPU with the C ops; a draft on CUDA runs eagerly)")
        return proposer

    def _optimise(self, args: EngineArgs, device: torch.device) -> None:
        """torch.compile of the small fused ops (default: on CUDA only, where it pays for its
        start-up time; a float32 CPU model gets our C versions of them instead) and decode graphs
        (``enforce_eager=False``, tp=1): CUDA graphs on CUDA; CPU graphs on a CPU for a float32,
        unquantised model with the C ops and the native decode kernel."""
        if args.compile if args.compile is not None else device.type == "cuda":
            self.runner.enable_compile()
        elif device.type == "cpu":
            from minivllm.layers import cpu_fused
            self.runner.cpu_fused_ops = self.runner.enable_cpu_fused_ops()  # float32 models only
            logger.info("CPU norms, rotary, SiLU, embedding lookup and greedy argmax: %s",
                        cpu_fused.describe(self.config.dtype))
        if device.type == "cpu":
            from minivllm.layers import top_p_native
            logger.info("CPU sampler, top-p without a sort: %s", top_p_native.describe())
        if device.type not in ("cuda", "cpu"):
            return
        kind = "CUDA" if device.type == "cuda" else "CPU"
        if args.enforce_eager:
            logger.info("%s graphs off: enforce_eager=True (every step runs eagerly)", kind)
            return
        # every condition that rules graphs out, named in the log (listing the settings alone left a reader
        # with fused C ops switched off nothing to see)
        why = []
        if not getattr(self.runner.backend, f"supports_{kind.lower()}_graphs", False):
            if kind == "CPU" and hasattr(self.runner.backend, "native_kernel"):  # torch: graphs need its C kernel
                from minivllm.layers.attention import cpu_decode
                reason = cpu_decode.unavailable_reason()
                if reason is not None:
                    why.append(f"the torch backend's C decode kernel is off ({reason})")
                elif self.config.dtype == torch.float32:  # (else the dtype, named below, is why it is not used)
                    why.append("the torch backend does not use its C decode kernel")
            else:
                why.append(f"attention backend {self.runner.backend.name} has no {kind} graph support")
        if kind == "CPU":  # the torch paths (and int8's ops) allocate fresh tensors each call: nothing to replay
            if self.config.dtype != torch.float32:
                why.append(f"dtype {self.config.dtype} (CPU graphs need float32)")
            if not self.runner.cpu_fused_ops and self.config.dtype == torch.float32:
                from minivllm.layers import cpu_fused
                why.append("torch.compile replaced the fused C ops (compile=True)" if args.compile else
                           f"the fused C ops are off ({cpu_fused.unavailable_reason()})")
            if args.quantization is not None:
                from minivllm.quantization.layer import quantized_layers
                kernels = {m.int8.kernel for m in quantized_layers(self.runner.model)}
                if kernels - {"panel-int8"}:  # our int8 panels are C calls a graph records; torch's ops are not
                    why.append(f"quantization {args.quantization!r} through {', '.join(sorted(kernels))}")
        if args.tensor_parallel_size > 1:
            why.append(f"tensor_parallel_size={args.tensor_parallel_size}")
        if why:
            logger.info("%s graphs off: %s", kind, "; ".join(why))
            return
        self.runner.enable_cuda_graphs(args.max_num_seqs, self.config.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """vLLM's constructor: ``LLMEngine(args)`` (raises as the class does)."""
        return cls(args)

    def get_model_config(self) -> ModelConfig:
        """vLLM's ``LLMEngine.get_model_config()``: ``self.model_config``."""
        return self.model_config

    # -- requests ----------------------------------------------------------------------------
    def encode_prompt(self, prompt, truncate_prompt_tokens: int | None = None,
                      add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Validate one prompt; returns (text or None, token ids).

        Accepts a ``str``, a ``list[int]`` of token ids, or ``{"prompt_token_ids": [...]}``
        / ``{"prompt": "..."}`` (both keys: the ids are the prompt and the text is returned as its
        ``RequestOutput.prompt``, as vLLM's ``TokensPrompt``). ``truncate_prompt_tokens`` (``SamplingParams``'): keep the
        last k tokens (-1: the last ``max_model_len - 1``). ``add_special_tokens``: the
        tokenizer's, for a text prompt.

        Raises:
            ValueError: empty prompt, ids outside ``[0, vocab_size)``, a prompt with no room to
                generate (``len >= max_model_len``), or ``truncate_prompt_tokens`` not an int
                >= 1, -1 or None, or above ``max_model_len``; the message names the value.
        """
        t = truncate_prompt_tokens
        if t is not None and (not isinstance(t, numbers.Integral) or isinstance(t, bool) or not (t >= 1 or t == -1)):
            raise VLLMValidationError(f"truncate_prompt_tokens={t!r}: must be an int >= 1, -1 (up to max_model_len - 1), "
                                      "or None")
        if t is not None and t > self.config.max_model_len:  # vLLM refuses it whatever the prompt's length
            raise VLLMValidationError(f"truncate_prompt_tokens={t} is more than max_model_len={self.config.max_model_len}: "
                                      f"give at most max_model_len - 1 = {self.config.max_model_len - 1} (room to "
                                      "generate), or -1 for exactly that", parameter="truncate_prompt_tokens", value=t)
        given_text = None
        _refuse_encoding(prompt, "prompt")
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None:
                raise VLLMValidationError("multi_modal_data: minivllm serves text-only models (give None or leave it out)")
            if prompt.get("prompt_embeds") is not None:  # not the tensor in the message: it can be megabytes
                raise VLLMValidationError("prompt_embeds: prompt embeddings as inputs are a vLLM feature minivllm does not "
                                          "have (README, 'Coming from vLLM or nano-vllm'): give token ids or text")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                _refuse_encoding(ids, "prompt_token_ids")
                if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                    raise VLLMValidationError(f"prompt_token_ids={ids!r}: must be a list of token ids")
                given_text = prompt.get("prompt")
                if given_text is not None and not isinstance(given_text, str):
                    raise VLLMValidationError(f"prompt={given_text!r} beside prompt_token_ids: must be the prompt's text (a str)")
                prompt = list(ids)
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise VLLMValidationError(f"prompt dict {prompt!r} needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            # verbose=False: the tokenizer would otherwise log its own "longer than the
            # maximum sequence length" warning before our length check below says it clearly
            # (and warn wrongly when max_model_len exceeds the tokenizer's model_max_length).
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens, verbose=False)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:  # a tokenizer larger than the model (e.g. a random model with a small vocab)
                raise VLLMValidationError(f"prompt text {prompt[:40]!r} encodes to token id {bad[0]}, outside the "
                                          f"model's vocabulary [0, {self.vocab_size})")
        elif isinstance(prompt, (list, tuple)):
            text, ids = given_text, [_token_id(t) for t in prompt]
            for t in ids:
                if not 0 <= t < self.vocab_size:
                    hint = ("; ids drawn for a real model (nano-vllm's bench.py draws them below 10,000) need one of "
                            "its vocabulary, e.g. model='random:qwen3-0.6b'" if t >= 0 and self.vocab_size < 10_000
                            else "")
                    raise VLLMValidationError(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size}) of "
                                              f"{self.source.name}{hint}")
        else:
            raise VLLMValidationError(f"prompt {prompt!r}: expected str, list[int] or {{'prompt_token_ids': [...]}}")
        if not ids:
            raise VLLMValidationError(f"empty prompt {prompt!r}: nothing to condition on")
        if truncate_prompt_tokens is not None:
            keep = self.config.max_model_len - 1 if truncate_prompt_tokens == -1 else int(truncate_prompt_tokens)
            ids = ids[-keep:]
        if len(ids) >= self.config.max_model_len and truncate_prompt_tokens is not None:
            raise VLLMValidationError(f"truncate_prompt_tokens={truncate_prompt_tokens} keeps {len(ids)} tokens of the prompt: "
                                      f"at most max_model_len - 1 = {self.config.max_model_len - 1} leave room to generate "
                                      f"(give at most that, or -1 for exactly that)")
        if len(ids) >= self.config.max_model_len:
            raise VLLMValidationError(f"prompt of {len(ids)} tokens leaves no room to generate: "
                                      f"max_model_len={self.config.max_model_len} (keep its last tokens with "
                                      f"SamplingParams(truncate_prompt_tokens=N), or {self._longer_hint(len(ids) + 1)})")
        return text, ids

    def _longer_hint(self, need: int) -> str:
        """What lets a sequence of ``need`` tokens fit: a model with more positions, where the
        model's are too few; else a ``max_model_len`` of at least ``need`` where one was given
        smaller, and a larger KV pool (the argument and size, :func:`~minivllm.config.pool_fix`)
        where the pool holds fewer tokens (without a given ``max_model_len`` it follows the pool)."""
        from minivllm.config import pool_fix
        from minivllm.utils import cdiv

        positions, bm = self.source.hf_config.max_position_embeddings, self.block_manager
        if need > positions:
            return f"a model with more positions ({self.source.name} has {positions})"
        fixes = []
        if self.args.max_model_len is not None and need > self.config.max_model_len:
            fixes.append(f"a max_model_len of at least {need}")
        if need > bm.num_blocks * bm.block_size:
            fixes.append(f"a larger KV pool ({pool_fix(self.args, cdiv(need, bm.block_size), self._kv_block_bytes)})")
        return " and ".join(fixes) or f"a max_model_len of at least {need}"

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Checks of ``params`` that need the model (``SamplingParams`` checks the rest).

        Raises:
            ValueError: ``params`` is not a ``SamplingParams``; a token id in
                ``stop_token_ids``, ``logit_bias`` or ``allowed_token_ids`` is outside the
                model's vocabulary ``[0, vocab_size)`` (naming the field and the id); or more
                ``logprobs`` / ``prompt_logprobs`` than the engine's ``max_logprobs`` (-1 asking
                for the whole vocabulary; vLLM's ``SamplingParams._validate_logprobs``); or
                ``prompt_logprobs`` with ``tensor_parallel_size > 1``.
        """
        if not isinstance(params, SamplingParams):
            raise VLLMValidationError(f"sampling_params {params!r} is not a SamplingParams")
        if params.prompt_logprobs is not None and self.args.tensor_parallel_size > 1:
            raise VLLMValidationError(f"prompt_logprobs={params.prompt_logprobs}: not supported with "
                                      f"tensor_parallel_size={self.args.tensor_parallel_size} (use 1)")
        cap = self.vocab_size if self.args.max_logprobs == -1 else self.args.max_logprobs
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(params, name)
            wanted = self.vocab_size if asked == -1 else asked
            if asked and wanted > cap:  # (None and 0 are within any cap)
                if self.args.max_logprobs == -1:
                    raise VLLMValidationError(f"{name}={asked}: requested {kind} logprobs of {wanted}, more than the "
                                              f"vocabulary's {self.vocab_size} tokens (-1 asks for all of them)")
                raise VLLMValidationError(f"{name}={asked}: requested {kind} logprobs of {wanted}, more than the engine's "
                                          f"max_logprobs={self.args.max_logprobs} allows (give LLM(max_logprobs=...) a "
                                          f"larger value, or -1 for no cap)")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            for t in ids:
                if t >= self.vocab_size:
                    raise VLLMValidationError(f"{name}={getattr(params, name)!r}: token id {t} is outside the "
                                              f"model's vocabulary [0, {self.vocab_size})")

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word tokenized alone, and after a space where that makes another word of as many
        tokens (vLLM's ``SamplingParams.update_from_tokenizer`` rule: " word" as a new first token,
        not a space token before the word's own); variants holding ids outside the model's
        vocabulary cannot be generated and are dropped."""
        out = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            variants = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
            for ids in variants:
                if ids and ids not in out and max(ids) < self.vocab_size:
                    out.append(ids)
        return out

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                    trace_headers=None, priority: int = 0, *, output_kind: OutputKind | str | None = None,
                    sink=None, sampling_params: SamplingParams | None = None) -> str:
        """Validate and queue a request (raises ``ValueError`` at once on bad input); returns its id
        as a str (vLLM 0.34's ``add_request`` returns the id to abort it by; there it carries a
        random suffix, here it is the id given: outputs and ``abort_request`` use the same).

        ``params``: its ``SamplingParams`` (vLLM's name; ``sampling_params=`` is accepted too),
        None for ``SamplingParams()``. ``tokenization_kwargs``: vLLM's, see
        :func:`minivllm.inputs.check_tokenization_kwargs`.
        ``arrival_time``, ``lora_request``, ``trace_headers`` and ``priority`` are vLLM's (in
        vLLM's order): ``arrival_time`` is a ``time.time()`` timestamp (default: now), moved onto
        the metrics' ``time.perf_counter`` clock; only ``lora_request=None``,
        ``trace_headers=None`` (no request tracing here) and ``priority=0`` (first come, first
        served) are accepted.

        ``output_kind``: "cumulative" (every step returns all text so far), "delta" (only what
        is new, as ``LLM.stream`` uses) or "final_only" (one output when finished, as
        ``LLM.generate`` uses); None (default): the parameters' ``output_kind`` (vLLM's way to ask
        the engine for deltas), itself cumulative by default. ``sink``: a callable that also receives each
        of the request's outputs once its step is applied (``LLM`` collects its own
        requests' outputs this way, whoever steps the engine). The request keeps a copy of
        ``params``: changing the object afterwards does not change it.

        Raises:
            RuntimeError: the engine has been shut down (see :meth:`shutdown`).
            TypeError: ``prompt`` is a ``SamplingParams`` (nano-vllm's argument order), both
                ``params`` and ``sampling_params`` are given, or ``request_id`` is neither a str
                nor an int.
            ValueError: a bad prompt, request id already in use, bad parameters (naming the
                value; the parameters are checked as they are now, lists changed in place included),
                an ``output_kind`` not among the three, an ``arrival_time`` that is not a finite
                number, a ``priority`` other than 0, a ``lora_request`` or ``trace_headers`` other
                than None, or bad ``tokenization_kwargs``.
        """
        self._require_live()
        if isinstance(prompt, SamplingParams):  # nano-vllm's add_request(prompt, sampling_params)
            raise TypeError(f"add_request(request_id, prompt, sampling_params): the prompt came as {prompt!r}; "
                            "nano-vllm's order is (prompt, sampling_params), vLLM's and minivllm's put a "
                            "request id first")
        try:
            kind = None if output_kind is None else OutputKind(output_kind)
        except ValueError:
            raise VLLMValidationError(f"output_kind={output_kind!r}: choose from {[k.value for k in OutputKind]}") from None
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise TypeError(f"request_id={request_id!r}: must be a str (or an int), as abort_request takes it")
        request_id = str(request_id)
        refuse_lora(lora_request)
        if trace_headers is not None:
            raise VLLMValidationError(f"trace_headers={trace_headers!r}: minivllm has no request tracing (vLLM's "
                                      "OpenTelemetry spans); leave it None")
        if priority != 0:
            raise VLLMValidationError(f"priority={priority!r}: minivllm schedules first come, first served "
                                      "(only priority=0 is accepted)")
        if arrival_time is not None:
            if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)) \
                    or not math.isfinite(arrival_time):
                raise VLLMValidationError(f"arrival_time={arrival_time!r}: must be a time.time() timestamp (seconds)")
            arrival_time = time.perf_counter() - (time.time() - arrival_time)
        if sampling_params is not None:
            if params is not None:
                raise TypeError("add_request() got both params and sampling_params: give one")
            params = sampling_params
        tokenization = check_tokenization_kwargs(tokenization_kwargs)
        params = params if params is not None else SamplingParams()
        # The request keeps the parameters it was added with (vLLM copies them too): the engine
        # fixes what it derives from them (stop rule, sampling flags) when a request is queued,
        # and a changed object applies to the requests added after the change. The copy is
        # checked again: a list or dict changed in place since the constructor was not.
        if isinstance(params, SamplingParams):
            params = params.clone()
            params._validate_again()
        self.check_sampling_params(params)
        kind = params.output_kind if kind is None else kind
        text, ids = self.encode_prompt(prompt, prompt_truncation(tokenization, params),
                                       tokenization.get("add_special_tokens", True))
        self.check_min_tokens_room(params, len(ids))
        salt = cache_salt_of(prompt)
        self._warn_if_max_tokens_capped(params, len(ids))
        with self._lock:
            self._require_live()  # again: a shutdown in another thread may have come since the check above
            if request_id in self.requests or request_id in self.parents:
                raise VLLMValidationError(f"request_id {request_id!r} is already in use by an unfinished request "
                                          f"(abort_request({request_id!r}) ends it, or step the engine until it "
                                          "finishes; an id is free again once its request has ended)")
            parent = ParentRequest(request_id, params.n, kind) if params.n > 1 else None
            if parent is not None:
                clash = [c for c in parent.child_ids if c in self.requests or c in self.parents]
                if clash:
                    raise VLLMValidationError(f"request_id {request_id!r}: child id {clash[0]!r} is already in use")
            try:
                if parent is None:
                    self._queue(request_id, text, ids, params, kind, arrival_time, salt)
                else:  # n samples: n child requests (minivllm/engine/parallel_sampling.py)
                    leader = None
                    for i, cid in enumerate(parent.child_ids):
                        seq = self._queue(cid, text, ids, child_params(params, i), kind, arrival_time, salt)
                        seq.prefix_leader, leader = leader, leader or seq
                    self.parents.add(parent)
                if sink is not None:
                    self._sinks[request_id] = sink
                return request_id  # inside the try: an interrupt on this line still queues nothing
            except BaseException:  # an interrupt part-way (a learner's "interrupt kernel"): queue nothing
                self._unqueue(request_id, [request_id] if parent is None else parent.child_ids)
                raise

    def _unqueue(self, request_id: str, ids: list[str]) -> None:
        """Take back whatever an interrupted ``add_request`` recorded of ``request_id`` (its
        queue ids ``ids``), in any part: the request is then as if never added. The ids were
        checked unused before anything was recorded, so all that is found under them is its."""
        self._sinks.pop(request_id, None)
        self.parents.parents.pop(request_id, None)
        sched = self.scheduler
        for rid in ids:
            link = self.parents.child_of.get(rid)
            if link is not None and link[0].request_id == request_id:
                del self.parents.child_of[rid]
            state = self.requests.get(rid)
            self.output_processor.every_step.discard(rid)
            if state is None:  # _queue records the state first: nothing else of rid was
                continue
            del self.requests[rid]
            seq = state.seq
            sched.random_seqs.discard(seq)
            sched.non_greedy_seqs.discard(seq)
            if seq in sched.waiting:  # identity: Sequence compares by identity (eq=False)
                sched.waiting.remove(seq)

    def _queue(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
               kind: OutputKind, arrival_time: float | None = None, cache_salt: str | None = None) -> Sequence:
        seq = Sequence(request_id, text, ids, params, cache_salt=cache_salt,
                       **({} if arrival_time is None else {"arrival_time": arrival_time}))
        if params.bad_words:
            seq.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.min_tokens:
            # eos too with ignore_eos, as vLLM masks it (its all_stop_token_ids always hold eos)
            seq.min_tokens_stop_ids = sorted(set(params.stop_token_ids) | set(self.eos_token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                       params.spaces_between_special_tokens) if params.detokenize else None
        self.output_processor.add_request(RequestState(seq, detok, kind))
        self.scheduler.add(seq)
        return seq

    def check_min_tokens_room(self, params: SamplingParams, prompt_len: int) -> None:
        """Refuse a request whose ``min_tokens`` cannot be met: with ``max_tokens=None`` it may
        generate ``max_model_len - prompt_len`` tokens (as vLLM's input processor resolves it,
        and refuses a larger ``min_tokens`` the same way).

        Raises:
            VLLMValidationError: naming ``min_tokens``, the prompt's length and the room left.
        """
        room = self.config.max_model_len - prompt_len
        if params.max_tokens is None and params.min_tokens > room:
            raise VLLMValidationError(
                f"min_tokens={params.min_tokens} with max_tokens=None: a {prompt_len}-token prompt leaves room for "
                f"{room} tokens under max_model_len={self.config.max_model_len}, so it could never be met "
                f"(give min_tokens <= {room}, a shorter prompt, or {self._longer_hint(prompt_len + params.min_tokens)})",
                parameter="min_tokens", value=params.min_tokens)

    def _warn_if_max_tokens_capped(self, params: SamplingParams, prompt_len: int) -> None:
        """Once per engine: a request's ``max_tokens`` will be cut short by ``max_model_len``
        (the request then ends with finish_reason "length" early)."""
        if self._warned_max_tokens or params.max_tokens is None:
            return
        room = self.config.max_model_len - prompt_len
        if params.max_tokens > room:
            self._warned_max_tokens = True
            logger.warning("max_tokens=%d with a %d-token prompt exceeds max_model_len=%d: generation stops at "
                           "%d tokens (this warning is shown once per engine)", params.max_tokens, prompt_len,
                           self.config.max_model_len, room)

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's ``LLMEngine.get_tokenizer``)."""
        return self.tokenizer

    def abort_request(self, request_id) -> RequestOutput | None:
        """End a request now (finish_reason "abort"), freeing its KV blocks; for a request
        with ``n > 1``, all its unfinished samples. ``request_id`` may also be an iterable
        of ids (as vLLM accepts).

        Returns its final output (the last one's for several ids; for ``n > 1``, every sample's
        latest completion in index order, though its outputs stream one sample at a time), or
        None if no such unfinished request exists, or if called from inside a step (a finalizer
        a garbage collection runs, a sink): the abort is then made when the step is over, and
        that step returns its output.

        Raises:
            TypeError: ``request_id`` is neither a str, an int nor an iterable of them, or is a bool
                (which ``add_request`` refuses: ``True`` would abort a request named "True"), naming it.
        """
        if isinstance(request_id, bool):
            raise TypeError(f"abort_request({request_id!r}): give a request id (str) or an iterable of them")
        if not isinstance(request_id, (str, int)):
            try:
                ids = list(request_id)
            except TypeError:
                raise TypeError(f"abort_request({request_id!r}): give a request id (str) or an iterable of them") from None
            result = None
            for rid in ids:
                result = self.abort_request(rid) or result
            return result
        with self._lock:
            request_id = str(request_id)
            if self._stepping:  # re-entered from inside a step (a stream's finalizer run by a collection):
                which = self.parents.parents.get(request_id) or self.requests.get(request_id)
                if which is not None:  # done when the step is over, not under its feet; that step returns its output
                    self._deferred_aborts.append((request_id, which))
                return None
            self._delivery.deliver_pending()  # (what an interrupt left) before this request's last output
            parent = self.parents.parents.get(request_id)
            if parent is None and request_id not in self.requests:
                # finished (or never queued): a sink left behind by a delivery an interrupt cut short goes too
                self._sinks.pop(request_id, None)
                return None
            ids = [c for c in parent.child_ids if c in self.requests] if parent is not None else [request_id]
            merged = self._abort(ids)
            self._delivery.deliver_pending()  # a request aborted by someone else still reaches its caller
            result = merged[-1] if merged else None
            if parent is not None and result is not None:
                result = parent.every_sample(result)
            return result

    def _abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort unfinished (child) requests, all or none (an ``n > 1`` request's samples together);
        returns their outputs after the n > 1 merge. The merge and the request table's entries are
        inside the transaction: were it interrupted after a child finished, the parent would never
        learn of it and never be forgotten, or a finished request would stay in the table."""
        states = [self.requests[rid] for rid in request_ids]
        with StepTransaction(self.scheduler, self.output_processor, only=[st.seq for st in states]) as txn:
            outputs = []
            for state in states:
                txn.protect_state(state)
                self.scheduler.finish(state.seq, "abort")
                update_text(state)  # final flush (a final-only request has not been decoded yet)
                outputs.append(make_output(state))
            merged = self.parents.merge(outputs, txn.undo)
            for state in states:
                self.output_processor.drop(state.seq.request_id)
            self._delivery.stage(merged, txn.undo)
        return merged

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: the tasks this engine serves, ``("generate",)`` (no pooling models here)."""
        return ("generate",)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (vLLM's; ``step()`` until it is False)."""
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Unfinished requests as the engine runs them: each completion of an ``n > 1`` request
        counts as one (its samples are requests of their own, sharing the prompt's cache)."""
        return len(self.requests)

    # -- the step ----------------------------------------------------------------------------
    def __getattr__(self, name: str):
        # only for names the engine lacks: vLLM's internals that scripts reach for say where they are here
        hint = _VLLM_ENGINE_ATTRIBUTES.get(name)
        if hint is not None:  # (name="": no "Did you mean" guess at a private name after the hint)
            raise AttributeError(f"LLMEngine.{name}: {hint} (README, 'Coming from vLLM or nano-vllm')", name="")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, forward, sample, apply, outputs (vLLM's ``step``).

        Returns the ``RequestOutput`` of every request that got a token or finished (per
        its output kind); the step's ``StepRecord`` is then at ``last_step_record``.
        All or nothing: if anything raises, every request is as it was before the call.

        Raises:
            RuntimeError: the engine has been shut down (see :meth:`shutdown`).
        """
        with self._lock:  # checked inside: a shutdown in another thread waits for a step in flight, and after it
            self._require_live()
            early = self._catch_up()
            timer = StepTimer()  # the transaction's snapshots count as scheduling time
            try:
                self._stepping = True
                with StepTransaction(self.scheduler, self.output_processor, self._engine_generator()) as txn:
                    plan = self.scheduler.schedule()
                    txn.protect(plan)
                    timer.schedule_ms = timer.lap()
                    result = self.runner.run(plan) if plan.scheduled else RunnerOutput.empty()
                    timer.lap()
                    finished = self.scheduler.update_from_output(plan, result.seqs, result.token_ids, result.failed,
                                                                 result.logprobs, result.prompt_logprobs,
                                                                 more_token_ids=result.more_token_ids)
                    outputs = self.output_processor.process(result.seqs, self._errors(result.failed), finished)
                    outputs = self.parents.merge(outputs, txn.undo)
                    timer.postprocess_ms = timer.lap()
                    record = self._record(plan, result, timer, outputs)
                    self._delivery.stage(outputs, txn.undo)
            finally:
                self._stepping = False
            self.last_step_record, self.step_index = record, self.step_index + 1
            late = self._catch_up()
            return early + outputs + late if early or late else outputs

    def _catch_up(self) -> list[RequestOutput]:
        """Hand over the outputs an interrupt left pending, and make the aborts asked for while a step
        was in flight (each taken off its queue only once done: an interrupt leaves it queued, for the
        next step); returns the aborted requests' final outputs. An abort is made only if its request
        is still the one it was asked for (its id may have finished, and been given to another, since)."""
        self._delivery.deliver_pending()
        aborts, outputs = self._deferred_aborts, []
        while aborts:
            request_id, which = aborts[0]
            if (self.parents.parents.get(request_id) or self.requests.get(request_id)) is which:
                out = self.abort_request(request_id)
                if out is not None:
                    outputs.append(out)
            aborts.popleft()
        return outputs

    def step_with_record(self) -> StepResult:
        """``step()``, returning its outputs together with its ``StepRecord`` (what widgets use)."""
        with self._lock:
            outputs = self.step()
            return StepResult(outputs, self.last_step_record)

    def _weight_storage(self) -> tuple[float, float] | None:
        """:func:`~minivllm.layers.prepack.matmul_bytes_per_weight` of this process's model, ``None``
        without one. With tensor parallelism, rank 0's: the other ranks pack their shards by the
        same rule, but each shard's own values decide whether it holds 16 bits."""
        from minivllm.layers.prepack import matmul_bytes_per_weight

        model = getattr(self.runner, "model", None)
        return matmul_bytes_per_weight(model) if isinstance(model, torch.nn.Module) else None

    def _engine_generator(self):
        sampler = getattr(self.runner, "sampler", None)
        return getattr(sampler, "generator", None)

    def _errors(self, failed) -> dict:
        errors = {}
        for seq in failed:
            params = seq.params
            if params.has_logits_processors or params.repetition_penalty != 1.0:
                errors[seq] = (f"request {seq.request_id!r}: no token could be sampled at step {self.step_index}: "
                               f"its own parameters (allowed_token_ids, bad_words, logit_bias, min_tokens against "
                               f"its stop tokens, penalties) masked every token, or a logit was NaN or inf (a "
                               f"penalty's overflow, or the model's own logits"
                               + (")" if self.config.dtype == torch.float32 else
                                  f": in {self.config.dtype} activations can overflow, try dtype='float32')")
                               + "; its output so far is kept and it was ended.")
                logger.warning(errors[seq])
                continue
            errors[seq] = (f"request {seq.request_id!r}: the model produced non-finite logits (NaN or inf) at "
                           f"step {self.step_index}; its output so far is kept and it was ended. "
                           + (f"The model runs in dtype={self.config.dtype}, so this is not a low-precision "
                              f"overflow: look for NaN/inf in the weights or inputs."
                              if self.config.dtype == torch.float32 else
                              f"This usually means activations overflowed in {self.config.dtype}: try "
                              f"dtype='float32' (or 'bfloat16' instead of 'float16')."))
            logger.warning(errors[seq])
        return errors

    def _record(self, plan: SchedulerOutput, result: RunnerOutput, timer: StepTimer,
                outputs: list[RequestOutput]) -> StepRecord:
        bm = self.block_manager
        scheduled = plan.scheduled
        n = len(scheduled)
        if plan.all_plain_decodes:  # every step of a decode batch: entries built when read, counts from the plan
            entries = PlannedEntries(scheduled)
            keys = sum(map(_START_POS, scheduled)) + n  # a token at position p reads p + 1 keys
            sums = (n, keys, keys, len(result.seqs))  # fill_step_record's (T, A, K, S): the rows that sampled
            num_prefill_tokens, num_decode_tokens, num_decodes, num_drafts = 0, n, n, 0
        else:  # a prefill or speculative step: built now (a plan with drafts holds their probabilities)
            entries, sums = entries_of(scheduled), None
            num_prefill_tokens, num_decode_tokens = plan.num_prefill_tokens, plan.num_decode_tokens
            num_decodes = plan.num_decodes  # the scheduler's counts spare passes over a large batch
            if num_decodes is None:
                num_decodes = sum(1 for e in scheduled if not e.is_prefill)
            num_drafts = plan.num_draft_tokens
            if num_drafts is None:
                num_drafts = sum(len(e.draft_token_ids) for e in scheduled)
        num_free = bm.num_free_blocks
        # Positional, in StepRecord's field order (tests/test_telemetry.py holds it): 22 keywords
        # cost ~0.9 us more a step, a fifth of a batch-1 step's telemetry.
        record = StepRecord(
            self.step_index, timer.start, timer.last,  # index, start_time, end_time
            num_prefill_tokens, num_decode_tokens, n, n - num_decodes,  # ..., num_seqs, num_prefill_chunks
            entries,  # scheduled
            [s.request_id for s in plan.preempted] if plan.preempted else [],  # preempted
            [o.request_id for o in outputs if o.finished] if outputs else [],  # finished
            bm.num_blocks - num_free, num_free, bm.num_cached_blocks,  # kv_blocks_used / _free / _cached
            plan.prefix_cache_hit_tokens, self.config.attention_backend,
            timer.schedule_ms, result.prepare_ms, result.model_ms, result.sample_ms, timer.postprocess_ms,
            num_drafts,  # num_draft_tokens
            sum(map(len, result.more_token_ids.values())) if result.more_token_ids else 0)  # num_accepted_draft_tokens
        if entries:
            fill_step_record(record, self.model_cost, self.peaks, sums=sums)
        return record

    def measure_peaks(self, refresh: bool = False) -> Peaks:
        """Measure (or read from the per-machine cache) this device's peak matmul FLOP/s and
        memory bandwidth (copy and read; MBU divides by the read figure), so later
        ``StepRecord``s carry MFU and MBU (``minivllm.telemetry.peaks.get_peaks``). ``refresh``:
        measure now even where a cached figure exists (this call then returns the new figures;
        the cache keeps the larger of each)."""
        self.peaks = get_peaks(self.config.device, self.config.dtype, refresh=refresh)
        return self.peaks

    # -- maintenance -------------------------------------------------------------------------
    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: trace this process with ``torch.profiler`` until :meth:`stop_profile`
        (``minivllm/telemetry/profiler.py``); ``profile_prefix`` begins the trace's file name.

        Raises:
            RuntimeError: the engine has been shut down, it is already profiling, another torch
                profiler runs in this process, or no trace directory (``profiler_config`` or
                ``$VLLM_TORCH_PROFILER_DIR``).
            ValueError: a ``profile_prefix`` that is not a plain file-name start (a path)."""
        self._require_live()
        self.profiler.start(profile_prefix)

    def stop_profile(self) -> Path:
        """Stop the trace :meth:`start_profile` began and write it (Chrome trace JSON, gzipped
        unless ``profiler_config`` says otherwise, for https://ui.perfetto.dev); returns its path.

        Raises:
            RuntimeError: not profiling, or the trace could not be written (naming why; the trace
                is then lost)."""
        return self.profiler.stop()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget all prefix-cache hashes. Returns True.

        vLLM's signature. ``reset_running_requests=True``, as in vLLM: first preempt every running
        request (recompute preemption: its blocks are freed, it goes back to the front of the
        waiting queue in its running order, and its ``metrics.num_preemptions`` counts it; no
        ``StepRecord`` does, as no step made them), so no block of the KV cache keeps KV from
        before the reset (a draft model's own pool is checked against its tokens before use). The
        preemptions are all or none under an interrupt; the hashes are forgotten after them.
        Without it, running requests keep their blocks and KV, which only lose their hashes (vLLM
        instead returns False and resets nothing while requests hold KV). ``reset_connector``:
        minivllm has no KV connector.

        Raises:
            ValueError: either flag not a bool.
        """
        for name, flag in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r}: must be True or False")
        with self._lock:  # not in the middle of another thread's step
            if reset_running_requests and self.scheduler.running:
                # all or none (an interrupt rolls the preemptions back), as a step's preemptions
                with StepTransaction(self.scheduler, self.output_processor):
                    for seq in reversed(list(self.scheduler.running)):  # each goes first: the order is kept
                        self.scheduler.requeue(seq)
            self.block_manager.reset_prefix_cache()
        return True

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if block bookkeeping is inconsistent (tests call this)."""
        live = self.scheduler.live_sequences()
        self.block_manager.check_invariants(live)
        for seq in self.scheduler.waiting:
            if seq.block_table:
                raise RuntimeError(f"waiting request {seq.request_id} holds blocks {seq.block_table}")
        if set(self.requests) != {s.request_id for s in live}:
            raise RuntimeError("request table and scheduler queues disagree")
        sched = self.scheduler
        for listed, needs, what in ((sched.random_seqs, lambda p: p.draws_random, "draw random numbers"),
                                    (sched.non_greedy_seqs, lambda p: not p.plain_greedy, "are not plain greedy")):
            unlisted = {s for s in live if needs(s.params)} - listed
            if unlisted:
                raise RuntimeError(f"requests {sorted(s.request_id for s in unlisted)} {what} but are not listed")
        every_step = {rid for rid, state in self.requests.items() if state.text_every_step}
        missing = every_step - self.output_processor.every_step
        if missing:
            raise RuntimeError(f"requests {sorted(missing)} want work every step but are not listed for it")
        check_proposer = getattr(self.scheduler.config.propose, "check_invariants", None)
        if check_proposer is not None:
            check_proposer()

    @property
    def is_shut_down(self) -> bool:
        """True once :meth:`shutdown` has run (its model and KV cache are gone)."""
        return self.runner is None

    def _require_live(self) -> None:
        if self.is_shut_down:
            raise RuntimeError(
                "this engine has been shut down (LLM.shutdown(), or the LLM that made it was garbage-collected: "
                "keep a reference to the LLM for as long as you use llm.llm_engine)")

    def shutdown(self) -> None:
        """Abort everything and free the KV cache and model. An ``LLM`` shuts its engine down when it
        is shut down or garbage-collected; later calls to :meth:`add_request` or :meth:`step` raise
        ``RuntimeError``. A step running in another thread finishes first (the engine's lock)."""
        with self._lock:
            for rid in list(self.requests):
                self.abort_request(rid)
            self.profiler.discard()  # a trace never stopped would keep recording this process
            if self.runner is not None:
                self.runner.shutdown()
                self.runner = None
            proposer_shutdown = getattr(self.scheduler.config.propose, "shutdown", None)
            if proposer_shutdown is not None:
                proposer_shutdown()
        trim_heap()  # the freed weights go back to the OS, not only to this process's C heap
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
