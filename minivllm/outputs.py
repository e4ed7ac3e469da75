"""What the engine returns per request: vLLM's ``RequestOutput`` shape, plus measured timings."""
from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds on the ``time.perf_counter`` clock.

    The derived figures are milliseconds:
      * TTFT (time to first token) = first_token_time - arrival_time
      * TPOT (time per output token) = (last token time - first token time) / (tokens - 1)
      * ITL (inter-token latencies) = gaps between consecutive output tokens; with speculative
        decoding the tokens of one step share its time, so some gaps are 0
      * e2e = finished_time - arrival_time; queue = first_scheduled_time - arrival_time
    A figure that is not defined yet (no first token, a single token) is ``None``, except ITL,
    a list, which is then empty. ``token_times``: each output token's time (the end of the step
    that produced it), seconds on the same clock.

    Every output of a request carries the request's own metrics object, which keeps changing
    while the request runs (vLLM's ``RequestOutput.metrics`` is its live request state too): an
    output kept from an earlier step (``LLM.stream``, ``LLMEngine.step``) reads the latest
    figures, so ``copy.deepcopy(output.metrics)`` is the way to keep the figures of that moment.

    vLLM's names for the same facts, for scripts that read them (seconds, ``None`` where not
    defined yet): V0's ``last_token_time`` and ``time_in_queue``; V1's ``first_token_latency``,
    ``num_generation_tokens`` (an int), ``queued_ts``, ``scheduled_ts``, ``first_token_ts`` and
    ``last_token_ts`` (timestamps on this ``perf_counter`` clock, where vLLM's are
    ``time.monotonic``'s) and ``num_preemptions`` (times the request was preempted and
    recomputed, a field).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    #: Speculative decoding: draft tokens proposed and accepted, and verification steps.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_spec_steps: int = 0
    #: Times the scheduler preempted the request (its KV dropped, to be recomputed): vLLM V1's name.
    num_preemptions: int = 0

    def __repr__(self) -> str:
        # token_times holds a time per output token: its count, so a printed RequestOutput stays short
        shown = (f"token_times=<{len(self.token_times)} times>" if f.name == "token_times" else
                 f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{type(self).__name__}({', '.join(shown)})"

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None before any draft)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification step: 1 + accepted drafts per step (None before any)."""
        return 1 + self.num_accepted_draft_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token, ms (None before it)."""
        if self.first_token_time is None:
            return None
        return (self.first_token_time - self.arrival_time) * 1e3

    @property
    def itl_ms(self) -> list[float]:
        """Inter-token latencies, ms: one per gap between consecutive output tokens."""
        t = self.token_times
        return [(b - a) * 1e3 for a, b in zip(t, t[1:])]

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first, ms (None with fewer than two)."""
        t = self.token_times
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) * 1e3 / (len(t) - 1)

    @property
    def e2e_ms(self) -> float | None:
        """Arrival to finish, ms (None while running)."""
        if self.finished_time is None:
            return None
        return (self.finished_time - self.arrival_time) * 1e3

    @property
    def queue_ms(self) -> float | None:
        """Arrival to first scheduled, ms (None before it)."""
        if self.first_scheduled_time is None:
            return None
        return (self.first_scheduled_time - self.arrival_time) * 1e3

    @property
    def last_token_time(self) -> float | None:
        """vLLM V0's name: the last output token's time (seconds, ``perf_counter`` clock)."""
        return self.token_times[-1] if self.token_times else None

    @property
    def time_in_queue(self) -> float | None:
        """vLLM V0's name: seconds from arrival to first scheduled (``queue_ms / 1e3``)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        """vLLM V1's name: seconds from arrival to the first output token (``ttft_ms / 1e3``)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queued_ts(self) -> float:
        """vLLM V1's name: when the engine queued the request (here its ``arrival_time``)."""
        return self.arrival_time

    @property
    def scheduled_ts(self) -> float | None:
        """vLLM V1's name: when the request was first scheduled (``first_scheduled_time``)."""
        return self.first_scheduled_time

    @property
    def first_token_ts(self) -> float | None:
        """vLLM V1's name: the first output token's time (``first_token_time``)."""
        return self.first_token_time

    @property
    def last_token_ts(self) -> float | None:
        """vLLM V1's name: the latest output token's time (``last_token_time``)."""
        return self.last_token_time

    @property
    def num_generation_tokens(self) -> int:
        """vLLM V1's name: output tokens so far (of one completion: with ``n > 1``, the metrics an
        output carries are those of the completion it reports)."""
        return len(self.token_times)


@dataclass(slots=True)
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``).

    Attributes:
        logprob: natural-log probability, fp32 value as a Python float (with the engine argument
            ``logprobs_mode`` "raw_logits" or "processed_logits": the logit itself).
        rank: 1-based rank of the token in its distribution (1 = most likely), or None.
        decoded_token: the token's text (None when ``detokenize=False``); a token whose text alone
            would end in U+FFFD (it holds part of a multi-byte character) reads as the character it
            completes with up to 4 tokens before it, or ``""`` (vLLM's rule).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's log-probabilities: token id -> ``Logprob`` (the chosen token's own entry
#: plus the top-k), as in vLLM.
PositionLogprobs = dict


@dataclass
class CompletionOutput:
    """One generated completion (vLLM's ``CompletionOutput``: its fields in its order, a plain
    dataclass, so ``vars(completion)`` works and scripts may attach their own attributes).

    Attributes:
        index: completion index within the request (0 .. n - 1 with ``SamplingParams.n``).
        text: generated text (for streamed outputs: only the new part).
        token_ids: generated token ids (for streamed outputs: only the new ones).
        finish_reason: None while running, else "stop" (eos, stop string or stop token),
            "length" (max_tokens or max_model_len reached), "abort", or "error" (no token could
            be sampled: the model's logits were NaN or inf, or the request's own parameters
            masked every token; ``RequestOutput.error`` says which and what to try).
        stop_reason: the stop string or stop token id that ended it, else None
            (None also when eos ended it, as in vLLM).
        logprobs: with ``SamplingParams.logprobs=k``: one ``{token_id: Logprob}`` per
            generated token (the sampled token plus the k most likely), else None.
        cumulative_logprob: with ``logprobs``: sum of the sampled tokens' log-probabilities
            (natural log), else None.
        lora_request: vLLM's; always None here (no LoRA).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    lora_request = None  # a class attribute, not a field: vLLM's, never set here

    def finished(self) -> bool:
        """vLLM's ``CompletionOutput.finished()``: whether this completion has ended (a finish reason)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request, as returned by ``LLM.generate`` / ``LLM.stream`` / ``LLMEngine.step``
    (vLLM's ``RequestOutput``; no slots, so ``vars(output)`` works and scripts may attach attributes).

    Attributes:
        request_id: the id given at ``add_request`` (``LLM`` numbers its requests "0", "1", ...,
            counting on across calls: unique within one ``LLM``).
        prompt: the prompt text, or None when the prompt was given as token ids (unless a
            ``{"prompt_token_ids": ..., "prompt": ...}`` prompt gave its text too).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs=k``: per prompt token, None for
            the first and ``{token_id: Logprob}`` (the prompt token plus the k most likely)
            for the others, as in vLLM (from the raw logits: their log-probabilities, or with the
            engine argument ``logprobs_mode`` "raw_logits" / "processed_logits" the logits
            themselves); a delta output after the request's first carries ``[]`` (vLLM 0.34's);
            else None.
        outputs: the ``CompletionOutput``s: one, or ``n`` with ``SamplingParams.n`` (for a delta or
            cumulative output of such a request, as vLLM streams them, the one completion that
            advanced, with its ``index``).
        finished: True once the request has ended.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        metrics: the request's ``RequestMetrics``.
        error: for finish_reason "error", what went wrong and what to try; else None.
        lora_request, encoder_prompt, encoder_prompt_token_ids, kv_transfer_params: vLLM's;
            always None here.

    nano-vllm compatibility: nano-vllm's ``generate`` returns dicts, so scripts written for
    it read ``output["text"]`` and ``output["token_ids"]``. A ``RequestOutput`` answers those
    two keys (of its first completion) as a read-only mapping; any other key raises ``KeyError``.
    """

    # vLLM's fields in vLLM's order (a script may build one positionally), then minivllm's own
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: None = None  # vLLM's LoRA, encoder-decoder and KV-transfer fields: never set here
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params = None  # keyword-only in vLLM: a class attribute

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """vLLM's: fold a later output of the same request into this one, in place, completion by
        completion (matched by ``index``; a new index is appended). ``aggregate=True`` (delta
        outputs): its text, token ids and logprobs are appended to the completion's, its
        cumulative logprob and finish and stop reasons taken; ``False`` (cumulative outputs): the
        completion is replaced. ``finished`` becomes True once either is; ``metrics`` and
        ``num_cached_tokens`` are the later output's."""
        self.finished = self.finished or next_output.finished
        self.metrics = next_output.metrics if next_output.metrics is not None else self.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        self.error = next_output.error or self.error
        mine = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            at = mine.get(new.index)
            if at is None:
                mine[new.index] = len(self.outputs)
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[at] = new
            else:
                old = self.outputs[at]
                old.text += new.text
                old.token_ids = list(old.token_ids) + list(new.token_ids)
                if new.logprobs:
                    old.logprobs = (old.logprobs or []) + list(new.logprobs)
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason

    # -- nano-vllm compatibility: a read-only mapping view {"text", "token_ids"} ------------------
    _MAPPING_KEYS = ("text", "token_ids")

    def keys(self) -> tuple[str, str]:
        """The nano-vllm keys, so ``dict(output)`` gives nano-vllm's output dict."""
        return self._MAPPING_KEYS

    def __getitem__(self, key: str):
        """``output["text"]`` / ``output["token_ids"]``: the first completion's text / token ids."""
        if key == "text":
            return self.outputs[0].text
        if key == "token_ids":
            return self.outputs[0].token_ids
        raise KeyError(f"{key!r}: a RequestOutput answers only {list(self._MAPPING_KEYS)} as a mapping "
                       "(nano-vllm compatibility); use its attributes for the rest")

    def __contains__(self, key: object) -> bool:
        return key in self._MAPPING_KEYS

    def __eq__(self, other):
        # nano-vllm's outputs were dicts: a script comparing one with {"text": ..., "token_ids": ...}
        # compares the mapping view (dataclass equality with a dict was silently False)
        if isinstance(other, Mapping):
            if not self.outputs:  # no completion: no mapping view to compare
                return False
            return dict(self) == dict(other)
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self))

    def items(self) -> list[tuple[str, object]]:
        """``[("text", ...), ("token_ids", ...)]``, as nano-vllm's dict gives them."""
        return [(k, self[k]) for k in self._MAPPING_KEYS]

    def values(self) -> list:
        """``[text, token_ids]`` of the first completion, as nano-vllm's dict gives them."""
        return [self[k] for k in self._MAPPING_KEYS]

    def get(self, key: str, default=None):
        """``self[key]`` for "text" or "token_ids", else ``default`` (nano-vllm's dict's ``get``)."""
        return self[key] if key in self._MAPPING_KEYS else default

    # Not iterable, no len(): with them pandas and numpy took a list of outputs for a table of two
    # keys (pd.DataFrame(outputs) gave 'text' / 'token_ids' strings, not the outputs' fields);
    # dict(output) works through keys(). (None: Python would otherwise try output[0].)
    __iter__ = None


#: RequestOutput arguments of vLLM 0.34 that minivllm never fills: kept as attributes when given
_VLLM_OUTPUT_EXTRAS = ("kv_transfer_params", "ec_transfer_params", "prompt_token_id_logprobs",
                       "num_cache_creation_tokens")
_output_init = RequestOutput.__init__
_warned_newer_args: list[bool] = []


def _init_ignoring_newer_args(self, *args, **kwargs):
    """The dataclass ``__init__``, also taking the arguments of vLLM's ``RequestOutput`` that minivllm
    never fills (kept as attributes) and, as vLLM does for forward compatibility, ignoring any
    other keyword argument with one warning (code written for a newer vLLM still builds one)."""
    known = RequestOutput.__dataclass_fields__
    extras = {k: kwargs.pop(k) for k in _VLLM_OUTPUT_EXTRAS if k in kwargs and k not in known}
    unknown = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
    if unknown and not _warned_newer_args:
        _warned_newer_args.append(True)
        logging.getLogger("minivllm").warning("RequestOutput: ignoring extra arguments: %s", unknown)
    _output_init(self, *args, **kwargs)
    for k, v in extras.items():
        setattr(self, k, v)


RequestOutput.__init__ = functools.wraps(_output_init)(_init_ignoring_newer_args)


def new_request_output(**fields) -> RequestOutput:
    """A ``RequestOutput`` from its fields by the dataclass ``__init__`` itself: the engine builds one per
    request per step (cumulative and delta outputs), where the wrapper's argument check cost ~1.5 us each."""
    out = RequestOutput.__new__(RequestOutput)
    _output_init(out, **fields)
    return out
