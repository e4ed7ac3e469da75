"""The engine loop: requests in, one ``step()`` at a time, outputs and step records out.

    add_request -> [ step: Scheduler.schedule -> ModelRunner.run (inputs, model,
    attention backend, sampler) -> Scheduler.postprocess -> stop checks ->
    detokenize -> RequestOutput ] -> ...
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from minivllm.config import EngineArgs, EngineConfig, resolve_device, resolve_dtype, resolve_lengths
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.output_processor import OutputKind, RequestState, make_output, update_text
from minivllm.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.layers.attention import default_block_size, resolve_backend_name
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.telemetry.peaks import Peaks, get_peaks
from minivllm.telemetry.roofline import ModelCost, fill_step_record
from minivllm.telemetry.step_record import ScheduledEntry, StepRecord
from minivllm.utils.model_source import resolve_model

logger = logging.getLogger("minivllm")


@dataclass
class StepResult:
    """What one ``LLMEngine.step()`` produced.

    Attributes:
        outputs: ``RequestOutput`` of every request that got a token or finished this step.
        record: the step's measured ``StepRecord``.
    """

    outputs: list[RequestOutput]
    record: StepRecord


class LLMEngine:
    """Owns the scheduler, block manager, model runner and tokenizer.

    Build with ``LLMEngine(EngineArgs(...))`` or ``LLMEngine.from_engine_args``.
    """

    def __init__(self, args: EngineArgs):
        from transformers import AutoTokenizer

        self.args = args
        self.source = resolve_model(args.model)
        hf = self.source.hf_config
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        backend_name = resolve_backend_name(args.attention_backend, device, args.block_size, dtype)
        block_size = args.block_size or default_block_size(backend_name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.source.tokenizer_dir)
        budget_hint = args.max_num_batched_tokens or 8192
        runner_args = (self.source, device, dtype, backend_name, block_size, args.num_kvcache_blocks,
                       args.kv_cache_memory_bytes, args.gpu_memory_utilization, budget_hint, args.seed)
        if args.tensor_parallel_size > 1:  # rank 0 of a sharded model; see minivllm/distributed/tp_runner.py
            from minivllm.distributed.tp_runner import TPModelRunner

            self.runner = TPModelRunner(*runner_args, tp_size=args.tensor_parallel_size,
                                        init_method=args.init_method, quant_config=args.quant_config)
        else:
            self.runner = ModelRunner(*runner_args, quant_config=args.quant_config)
        try:
            max_model_len, budget = resolve_lengths(args, hf.max_position_embeddings, self.runner.num_kv_blocks,
                                                    block_size)
            self.config = EngineConfig(args, device, dtype, self.runner.backend.name, block_size,
                                       self.runner.num_kv_blocks, max_model_len, budget)
            self._optimise(args, device)
        except BaseException:
            # A refused config must not leave the KV cache (or tensor-parallel workers) alive
            # until garbage collection, which a notebook's saved traceback can delay for long.
            self.runner.shutdown()
            raise
        self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, budget, max_model_len,
                                                   args.enable_chunked_prefill), self.block_manager)
        self.eos_token_ids = set(self.source.eos_token_ids)
        self.vocab_size = hf.vocab_size
        self.requests: dict[str, RequestState] = {}
        self.step_index = 0
        # Roofline accounting: FLOPs and bytes of every step from the config; MFU/MBU
        # once peaks are measured (``measure_peaks``), since that takes a moment.
        self.model_cost = ModelCost.from_config(hf, dtype, tp_size=args.tensor_parallel_size,  # per rank
                                                quantization=args.quantization,
                                                quantize_lm_head=args.quantize_lm_head)
        self.peaks: Peaks | None = None
        logger.info("minivllm engine: model=%s device=%s dtype=%s attention_backend=%s block_size=%d "
                    "kv_blocks=%d max_model_len=%d max_num_batched_tokens=%d", self.source.name, device,
                    dtype, self.config.attention_backend, block_size, self.runner.num_kv_blocks,
                    max_model_len, budget)

    def _optimise(self, args: EngineArgs, device: torch.device) -> None:
        """torch.compile of the small fused ops (default: on CUDA only, where it pays for its
        start-up time) and decode CUDA graphs (CUDA, ``enforce_eager=False``, tp=1)."""
        if args.compile if args.compile is not None else device.type == "cuda":
            self.runner.enable_compile()
        if device.type != "cuda" or args.enforce_eager:
            return
        if args.tensor_parallel_size > 1 or not getattr(self.runner.backend, "supports_cuda_graphs", False):
            logger.info("CUDA graphs off: attention backend %s / tensor_parallel_size=%d",
                        self.runner.backend.name, args.tensor_parallel_size)
            return
        self.runner.enable_cuda_graphs(args.max_num_seqs, self.config.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # -- requests ----------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Validate one prompt; returns (text or None, token ids).

        Accepts a ``str``, a ``list[int]`` of token ids, or ``{"prompt_token_ids": [...]}``
        / ``{"prompt": "..."}``.

        Raises:
            ValueError: empty prompt, ids outside ``[0, vocab_size)``, or a prompt with no
                room to generate (``len >= max_model_len``); the message names the value.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt dict {prompt!r} needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:  # a tokenizer larger than the model (e.g. a random model with a small vocab)
                raise ValueError(f"prompt text {prompt[:40]!r} encodes to token id {bad[0]}, outside the "
                                 f"model's vocabulary [0, {self.vocab_size})")
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError(f"prompt {prompt!r}: expected str, list[int] or {{'prompt_token_ids': [...]}}")
        if not ids:
            raise ValueError(f"empty prompt {prompt!r}: nothing to condition on")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate: "
                             f"max_model_len={self.config.max_model_len}")
        return text, ids

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None,
                    *, output_kind: OutputKind | str = OutputKind.CUMULATIVE) -> None:
        """Validate and queue a request (raises ``ValueError`` at once on bad input).

        ``output_kind``: "cumulative" (default: every step returns all text so far),
        "delta" (only what is new, as ``LLM.stream`` uses) or "final_only" (one output when
        finished, as ``LLM.generate`` uses).
        """
        try:
            kind = OutputKind(output_kind)
        except ValueError:
            raise ValueError(f"output_kind={output_kind!r}: choose from {[k.value for k in OutputKind]}") from None
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params {params!r} is not a SamplingParams")
        text, ids = self.encode_prompt(prompt)
        seq = Sequence(request_id, text, ids, params)
        detok = IncrementalDetokenizer(self.tokenizer, ids)
        self.requests[request_id] = RequestState(seq, detok, kind)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (finish_reason "abort"), freeing its KV blocks.

        Returns its final output, or None if no such unfinished request exists.
        """
        state = self.requests.pop(str(request_id), None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, "abort")
        update_text(state)  # final flush (a final-only request has not been decoded yet)
        return make_output(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one iteration: schedule, forward, sample, stop checks, outputs."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        outputs: list[RequestOutput] = []
        finished: list[str] = []
        prepare_ms = model_ms = sample_ms = 0.0
        if not plan.is_empty:
            result = self.runner.run(plan)
            prepare_ms, model_ms, sample_ms = result.prepare_ms, result.model_ms, result.sample_ms
            post_start = time.perf_counter()
            self.scheduler.postprocess(plan)
            now = time.perf_counter()
            requests = self.requests
            for seq, token in result.sampled:
                seq.append_token(token, now)
                self._check_stop(seq, token)
                state = requests[seq.request_id]
                if state.text_every_step or seq.is_finished:
                    stop = update_text(state)
                    if stop is not None:
                        if seq.is_finished:  # the stop string showed up in the last token's text
                            seq.finish_reason, seq.stop_reason = "stop", stop
                        else:
                            self.scheduler.finish(seq, "stop", stop)
                if seq.is_finished:
                    outputs.append(make_output(state))
                    finished.append(seq.request_id)
                    del requests[seq.request_id]
                elif state.kind is not OutputKind.FINAL_ONLY:
                    outputs.append(make_output(state))
        else:
            post_start = time.perf_counter()
        end = time.perf_counter()
        record = self._record(plan, start, end, finished, (scheduled_at - start) * 1e3, prepare_ms, model_ms,
                              sample_ms, (end - post_start) * 1e3)
        self.step_index += 1
        return StepResult(outputs, record)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif token in self.eos_token_ids and not p.ignore_eos:
            self.scheduler.finish(seq, "stop", None)
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.config.max_model_len:
            self.scheduler.finish(seq, "length")

    def _record(self, plan: SchedulerOutput, start, end, finished, schedule_ms, prepare_ms, model_ms, sample_ms,
                post_ms) -> StepRecord:
        bm = self.block_manager
        entries = [ScheduledEntry(e.seq.request_id, e.num_tokens, e.is_prefill, e.start_pos, e.samples)
                   for e in plan.scheduled]
        record = StepRecord(
            index=self.step_index, start_time=start, end_time=end,
            num_prefill_tokens=plan.num_prefill_tokens, num_decode_tokens=plan.num_decode_tokens,
            num_seqs=len(plan.scheduled), num_prefill_chunks=sum(1 for e in plan.scheduled if e.is_prefill),
            scheduled=entries, preempted=[s.request_id for s in plan.preempted], finished=finished,
            kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_blocks, prefix_cache_hit_tokens=plan.prefix_cache_hit_tokens,
            attention_backend=self.config.attention_backend, schedule_ms=schedule_ms, prepare_ms=prepare_ms,
            model_ms=model_ms, sample_ms=sample_ms, postprocess_ms=post_ms)
        if entries:
            fill_step_record(record, self.model_cost, self.peaks)
        return record

    def measure_peaks(self, refresh: bool = False) -> Peaks:
        """Measure (or read from the per-machine cache) this device's peak matmul FLOP/s and
        copy bandwidth, so later ``StepRecord``s carry MFU and MBU."""
        self.peaks = get_peaks(self.config.device, self.config.dtype, refresh=refresh)
        return self.peaks

    # -- maintenance -------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget all prefix-cache hashes. Returns True (blocks in use keep their KV)."""
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

    def shutdown(self) -> None:
        """Abort everything and free the KV cache and model."""
        for rid in list(self.requests):
            self.abort_request(rid)
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
