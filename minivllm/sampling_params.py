"""How to pick each next token, and when to stop: vLLM's ``SamplingParams``."""
from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import logging
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from minivllm.exceptions import VLLMValidationError


class OutputKind(enum.Enum):
    """What ``LLMEngine.step()`` returns for a request (vLLM's ``RequestOutputKind``, also importable
    under that name; vLLM's integer values 0, 1, 2 name the same three)."""

    CUMULATIVE = "cumulative"  # every step: all text and tokens so far
    DELTA = "delta"            # every step: only what is new (LLM.stream)
    FINAL_ONLY = "final_only"  # once, when finished (LLM.generate): no per-step work

    @classmethod
    def _missing_(cls, value):  # vLLM's values are the ints 0, 1, 2 (a script may store or pass those)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 3:
            return list(cls)[value]
        return None


RequestOutputKind = OutputKind

#: The smallest temperature above 0 (vLLM's ``_MAX_TEMP``): below it, logits / temperature overflow.
MIN_TEMPERATURE = 0.01
#: Most samples of one request (vLLM sets none): each is a request of its own in the engine, made when the request
#: is added. A request of 10,000 one-token samples ran in ~4 s on a 2-core CPU; n=2**63 had filled 18 GB of
#: memory making them before anything said no.
MAX_N = 65536


@dataclass(kw_only=True)  # by name only: vLLM and nano-vllm order their fields differently
class SamplingParams:
    """Per-request sampling and stopping settings (validated at construction).

    Logits are processed in this order: allowed_token_ids, bad_words, min_tokens, logit_bias,
    then the penalties (repetition, frequency, presence), then temperature, top-k, top-p, min-p
    (vLLM V0's filter order; vLLM V1 applies min-p right after temperature, before top-k and
    top-p: chapter 09 compares the two); then a token is drawn from what remains. The
    options beyond the classic five cost nothing to requests that leave them at their
    defaults (a batch of plain greedy requests keeps its argmax fast path).

    Args:
        temperature: softmax temperature; ``0`` means greedy (argmax), and then ``top_p``, ``top_k``
            and ``min_p`` are reset to their defaults at construction, as vLLM does, and on the
            engine's copy of a request's parameters (they cannot change the argmax, and
            with ``logprobs_mode="processed_logprobs"`` a greedy row reports the unfiltered
            distribution whatever else is in its batch). A value in (0, 0.01) becomes 0.01, with a
            warning, as in vLLM (smaller ones overflow the scaled logits).
        top_p: keep the smallest set of tokens whose probability sums to at
            least ``top_p``; in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; ``0`` or ``-1`` disables.
        min_p: drop tokens whose probability is below ``min_p`` times the most
            likely token's; in [0, 1].
        repetition_penalty: > 0; vLLM's definition (from CTRL, Keskar et al. 2019):
            a logit of a token already in the prompt or output is divided by the
            penalty when positive and multiplied by it when negative.
        seed: a per-request seed: the request then samples the same tokens
            whatever else is in the batch (with speculative decoding, only while its drafts
            are not cut by the step's token budget or a short KV pool, which a step rolled back
            after a preemption can change: README, "Interrupting is safe"). In
            ``[-2**63, 2**64 - 1]`` (``torch.Generator``'s range), ``seed + n - 1`` too. ``-1``
            means no seed (as in vLLM: it becomes None).
        max_tokens: most tokens to generate (>= 1; default 16, as vLLM's), or None: until ``max_model_len``.
        ignore_eos: keep generating past the model's end-of-sequence token.
        stop: a string or a list of strings that end generation (held as a list after
            construction, ``[]`` for None, as in vLLM); the returned text ends
            *before* the stop string (unless ``include_stop_str_in_output``). When several
            complete in the same step, the one completing earliest in the text wins, ties
            by list order (so the result does not depend on how the text was tokenized), as
            in vLLM since its PR 49391 (2026-07).
        stop_token_ids: a list of token ids that end generation (always apply, even with
            ``ignore_eos``); the engine checks them against the model's vocabulary. The
            stop token is in ``token_ids``; its text is in ``text`` only with
            ``include_stop_str_in_output`` (as for eos, whose text also needs
            ``skip_special_tokens=False``; as vLLM).
        n: independent completions of the prompt (``RequestOutput.outputs[i]``, index i);
            must be 1 when ``temperature`` is 0 (a ValueError otherwise: greedy completions would all be
            the same; vLLM refuses it too);
            with a ``seed``, completion i is drawn with seed ``seed + i``; their prompt is
            computed once and shared through the prefix cache (see
            ``minivllm/engine/parallel_sampling.py``).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token that
            appears in the output so far (OpenAI's definition; prompt tokens do not count).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per occurrence
            in the output so far (OpenAI's definition:
            ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``).
        min_tokens: >= 0; eos (with ``ignore_eos`` too, as in vLLM) and ``stop_token_ids`` are
            masked for the first ``min_tokens`` tokens, and no stop string ends in their text (one
            may start in it and end after it, as in vLLM).
        logit_bias: ``{token_id: bias}`` added to those logits before sampling, as given (as in
            vLLM's ``LLM``; OpenAI's API and vLLM's server clamp to [-100, 100]); ``-inf`` bans a
            token. Raises ValueError for NaN or a bias above float32's largest value (``+inf``).
        allowed_token_ids: only these token ids can be generated (non-empty list).
        bad_words: words that must not be generated: a word's last token is masked whenever
            the output ends with the word's other tokens (the word is tokenized alone, and after
            a space where that gives as many tokens with another first one, as vLLM does). Held as
            a list (``[]`` for None, as in vLLM).
        include_stop_str_in_output: keep the matched stop string at the end of ``text``.
        skip_special_tokens: leave special tokens' text out of ``text``.
        spaces_between_special_tokens: put spaces between special tokens in ``text`` (only
            slow, non-``tokenizers`` tokenizers distinguish this; fast ones ignore it, as in
            Hugging Face).
        detokenize: False: no ``text`` (empty strings) and no detokenisation cost; stop strings
            then cannot be used.
        truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1), or -1: the last
            ``max_model_len - 1`` (vLLM 0.34's -1, which leaves room for one generated token; vLLM
            0.34 takes it in ``tokenization_kwargs`` rather than here).
        logprobs: return the log-probabilities of the k most likely tokens at every generated
            position, plus the sampled token's own (k >= 0), by default from the raw model
            logits, before any penalty or temperature (vLLM v1's default; the engine argument
            ``logprobs_mode`` selects the processed distribution or the logits instead).
            ``-1``: the whole vocabulary, ``True``: 1, ``False``: 0 (all as vLLM).
        prompt_logprobs: the same for every prompt token (k >= 0, -1, True: 1 or False: 0), from the raw
            logits whatever ``logprobs_mode`` says of processing (their log-probabilities, or in the
            "*_logits" modes the logits). Prompt positions are computed, not read from the prefix
            cache, for such requests.
        output_kind: what ``LLMEngine.step()`` returns for the request (vLLM's
            ``RequestOutputKind``): ``CUMULATIVE`` (all so far, every step), ``DELTA`` (only what
            is new) or ``FINAL_ONLY`` (once, finished); ``LLM.generate`` always gives final
            outputs and ``LLM.stream`` deltas, as in vLLM. An ``OutputKind`` or its value.
        extra_args: a dict kept with the parameters for code of your own that reads it back
            (vLLM's field for custom samplers and plugins); the engine reads none of it.

    Fields may be changed after construction (vLLM's scripts do ``params.max_tokens = 64``):
    each assignment is validated like the constructor's arguments, and an invalid value is
    refused (``ValueError``) and not kept. A request keeps a copy of the parameters it was
    added with (as in vLLM), so a change applies to the requests added after it.

    Raises:
        ValueError: naming the offending field and value.
        TypeError: a vLLM argument for a feature minivllm lacks (``structured_outputs``,
            ``best_of`` other than ``n``, ``logits_processors``, ...; their values that ask for
            nothing are accepted), an unknown argument, or a positional one (vLLM's and
            nano-vllm's orders differ: arguments are given by name).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: OutputKind = OutputKind.CUMULATIVE
    extra_args: dict | None = None
    #: Filled by __post_init__: True when a logits processor beyond the classic five applies
    #: (allowed_token_ids, bad_words, min_tokens, logit_bias, presence/frequency penalties).
    has_logits_processors: bool = field(init=False, repr=False, compare=False)
    #: Filled by __post_init__: greedy, no penalty, no processor, no logprobs: the argmax fast path.
    plain_greedy: bool = field(init=False, repr=False, compare=False)
    #: Filled by __post_init__: sampling may draw random numbers (a temperature above 0) or owns
    #: a generator (a seed), so a step's rollback must save a generator's state.
    draws_random: bool = field(init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value) -> None:
        ready = self.__dict__.get("_validated", False)
        if not ready or name.startswith("_") or name not in _PUBLIC_FIELDS:
            object.__setattr__(self, name, value)
            return
        old = self.__dict__.get(name)
        object.__setattr__(self, name, value)
        object.__setattr__(self, "_validated", False)  # __post_init__'s own assignments go straight in
        try:
            self.__post_init__()  # validate again, refresh the derived fields
        except ValueError:
            object.__setattr__(self, name, old)
            self.__post_init__()
            raise

    def __post_init__(self) -> None:
        def bad(name: str, value, why: str) -> VLLMValidationError:  # a ValueError too
            return VLLMValidationError(f"SamplingParams.{name}={value!r}: {why}", parameter=name, value=value)

        # numpy (or other) scalars, as a sweep over np.linspace gives them: Python numbers from here on
        for name in _INT_FIELDS + _REAL_FIELDS:
            value = getattr(self, name)
            if value is None or type(value) in (bool, int, float):  # (np.float64 is a float subclass: converted)
                continue
            if isinstance(value, numbers.Integral):
                object.__setattr__(self, name, int(value))
            elif isinstance(value, numbers.Real) and name in _REAL_FIELDS:
                object.__setattr__(self, name, float(value))

        # vLLM's spellings: seed=-1 is no seed, logprobs=True is one top token, False none (vLLM's
        # check lets False through as 0: the sampled token's logprob alone)
        if type(self.seed) is int and self.seed == -1:
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                object.__setattr__(self, name, int(getattr(self, name)))

        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # logits / 1e-38 overflow to inf, and the row's draw came out as token 0: vLLM raises such
            # a temperature to 0.01 with a warning, and so do we
            logging.getLogger("minivllm").warning(
                "SamplingParams.temperature=%r is below %s, where dividing the logits by it can overflow; "
                "using %s (use 0 for greedy)", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an int >= 1, or 0 / -1 to disable")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables)")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an int >= 1, or None (up to max_model_len)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", self.seed, "must be an int or None")
        if self.stop is None or isinstance(self.stop, str):
            stop = [] if self.stop is None else [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            stop = list(self.stop)
        else:
            raise bad("stop", self.stop, "must be a str, a list of str, or None")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise bad("stop", self.stop, f"element {i} ({s!r}) is not a non-empty str")
        self.stop = stop
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of int token ids, or None")
        ids = [t if isinstance(t, str) else _token_id(t) for t in self.stop_token_ids or []]  # numpy ints, 2.0
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", self.stop_token_ids, f"element {i} ({t!r}) is not an int >= 0")
        self.stop_token_ids = ids
        self._check_extras(bad)

    def _check_extras(self, bad) -> None:
        """Validate the vLLM options beyond the classic ones; fill the derived flags."""
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"must be an int from 1 to {MAX_N:,} (each sample is a request of its own)")
        if self.n > 1 and self.temperature == 0:
            raise bad("n", self.n, "must be 1 when temperature=0 (greedy sampling would give n identical "
                      "completions; vLLM refuses it too)")
        if self.seed is not None and not -2**63 <= self.seed <= 2**64 - self.n:  # completion i: seed + i
            raise bad("seed", self.seed, "must be in [-2**63, 2**64 - 1] (torch.Generator's range)" +
                      (f", and so must seed + n - 1 (n={self.n}): completion i draws with seed + i"
                       if self.n > 1 else ""))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise bad(name, value, "must be a number in [-2, 2] (0 disables)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "must be a dict {token_id: bias}, or None")
            bias = {}
            for k, v in self.logit_bias.items():
                key = _token_id(k)
                if not is_int(key) or key < 0:
                    raise bad("logit_bias", self.logit_bias, f"key {k!r} is not a token id (int >= 0)")
                # as given, as vLLM's LLM does (only its OpenAI server clamps to [-100, 100]); -inf bans
                # the token; +inf, NaN or a bias past float32's largest (+inf in the logits) would make
                # every probability NaN
                try:
                    value = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
                except OverflowError:  # an int beyond any float
                    value = math.inf if v > 0 else -math.inf
                if math.isnan(value) or value > _FLOAT32_MAX:
                    raise bad("logit_bias", self.logit_bias, f"bias {v!r} of token {k!r} is not a number up to "
                                                             f"float32's largest, {_FLOAT32_MAX:.4g} (-inf bans the token)")
                bias[key] = value
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of token ids, or None")
            ids = [_token_id(t) for t in self.allowed_token_ids]
            for i, t in enumerate(ids):
                if not is_int(t) or t < 0:
                    raise bad("allowed_token_ids", self.allowed_token_ids,
                              f"element {i} ({self.allowed_token_ids[i]!r}) is not an int >= 0")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)):
                raise bad("bad_words", self.bad_words, "must be a list of str, or None")
            for i, w in enumerate(self.bad_words):
                if not isinstance(w, str) or not w.strip():
                    raise bad("bad_words", self.bad_words, f"element {i} ({w!r}) is not a non-blank str")
            self.bad_words = list(self.bad_words)
        else:
            self.bad_words = []
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "must be True or False")
        if not self.detokenize and self.stop_strings:
            raise bad("detokenize", self.detokenize, f"stop strings {self.stop_strings!r} need detokenize=True")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", self.extra_args, "must be a dict or None")
        t = self.truncate_prompt_tokens
        if t is not None and (not is_int(t) or (t < 1 and t != -1)):
            raise bad("truncate_prompt_tokens", t, "must be an int >= 1, -1 (up to max_model_len - 1), or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise bad(name, value, "must be an int >= 0 (how many top tokens), -1 (all), or None")
        if not isinstance(self.output_kind, OutputKind):
            try:
                object.__setattr__(self, "output_kind", OutputKind(self.output_kind))
            except ValueError:
                raise bad("output_kind", self.output_kind,
                          f"choose from RequestOutputKind's {[k.value for k in OutputKind]}") from None
        self.has_logits_processors = bool(
            self.presence_penalty or self.frequency_penalty or self.min_tokens or self.logit_bias
            or self.allowed_token_ids or self.bad_words)
        self.plain_greedy = (self.temperature == 0 and self.repetition_penalty == 1.0
                             and not self.has_logits_processors and self.logprobs is None)
        self.draws_random = self.temperature > 0 or self.seed is not None
        object.__setattr__(self, "_validated", True)

    def _validate_again(self) -> None:
        """The constructor's checks once more (the engine runs them on its copy: a list or dict
        field changed in place, ``params.stop.append(5)``, escapes ``__setattr__``).

        Raises:
            ValueError: as the constructor, naming the field and its value.
        """
        object.__setattr__(self, "_validated", False)
        self.__post_init__()
        self._greedy_without_filters()

    def _greedy_without_filters(self) -> None:
        """At temperature 0, top_p, top_k and min_p back to their defaults (they cannot change the
        argmax), as vLLM's ``SamplingParams.__post_init__`` does: at construction, and on the
        engine's own copy of a request's parameters (an assignment after construction is kept on
        the caller's object, as in vLLM)."""
        if self.temperature == 0:
            for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0)):
                object.__setattr__(self, name, off)

    @staticmethod
    def from_optional(**kwargs) -> "SamplingParams":
        """vLLM's ``SamplingParams.from_optional``: as the constructor, but None for ``n``,
        ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``temperature`` or
        ``top_p`` means that argument's default (what an OpenAI-style request leaves unset);
        None elsewhere keeps its meaning (``max_tokens=None``: up to ``max_model_len``). Each
        ``logit_bias`` value is clamped to [-100, 100], as vLLM 0.34's ``from_optional`` does (an
        OpenAI request's range; a ``-inf`` ban becomes -100 there too); the constructor itself
        keeps any bias it accepts.

        Raises:
            ValueError / TypeError: as the constructor.
        """
        for name in _NONE_MEANS_DEFAULT:
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
        bias = kwargs.get("logit_bias")
        if isinstance(bias, Mapping):  # a NaN or a non-number is left for the constructor to name
            kwargs["logit_bias"] = {t: min(100.0, max(-100.0, float(b))) if isinstance(b, numbers.Real)
                                    and not isinstance(b, bool) and not math.isnan(b) else b for t, b in bias.items()}
        return SamplingParams(**kwargs)

    def clone(self) -> "SamplingParams":
        """An independent copy (vLLM's ``SamplingParams.clone``): its lists and dicts are copied
        too; their items (ints, floats, strings) are immutable, so nothing deeper is: the engine clones
        every request's parameters, and ``copy.deepcopy`` of ``SamplingParams(temperature=0.7,
        stop=["\\n"], max_tokens=32)`` took 16.1 us against this copy's 5.3 us (best of 5 x 2,000,
        ``timeit``; 2-core Xeon dev VM, 2026-12-06), more for a long ``allowed_token_ids`` or
        ``logit_bias``, whose every item a deep copy visits. ``extra_args``, whose values may be
        anything, is deep-copied."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (list, dict)):
                object.__setattr__(new, name, value.copy())
        if self.extra_args:  # the one field whose values may be anything: copied through, as vLLM's clone does
            object.__setattr__(new, "extra_args", copy.deepcopy(self.extra_args))
        return new

    @property
    def greedy(self) -> bool:
        """Whether this request samples greedily (``temperature == 0``: the argmax)."""
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        """Whether top-k filtering is on (``top_k > 0``; 0 and -1 mean off)."""
        return self.top_k > 0

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings (``stop``, a list since construction); assigning sets ``stop``."""
        return self.stop

    @stop_strings.setter
    def stop_strings(self, value) -> None:
        self.stop = value  # validated as an assignment to stop is

    @property
    def max_stop_len(self) -> int:
        """Longest stop string, in characters (text held back while streaming)."""
        return max((len(s) for s in self.stop_strings), default=0)


#: ``from_optional``'s arguments whose None is the default (vLLM's list)
_NONE_MEANS_DEFAULT = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p")

_PUBLIC_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)


class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, importable so a vLLM script's import line works; building one
    raises, as ``LLM.beam_search`` does.

    Raises:
        NotImplementedError: always (minivllm has no beam search; see ``LLM.beam_search``).
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"BeamSearchParams: {NO_BEAM_SEARCH}")


class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams`` (``GuidedDecodingParams`` in older vLLM), importable so
    a vLLM script's import line works; building one raises, naming the feature.

    Raises:
        NotImplementedError: always (minivllm has no structured outputs).
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: {NO_STRUCTURED_OUTPUTS}")


class GuidedDecodingParams(StructuredOutputsParams):
    """Older vLLM's name for :class:`StructuredOutputsParams`; building one raises the same way."""


NO_STRUCTURED_OUTPUTS = ("minivllm has no structured outputs (decoding constrained to a JSON schema, regex, grammar or "
                         "choice; a vLLM feature: README, 'Coming from vLLM or nano-vllm'). Nearest alternatives: "
                         "allowed_token_ids or logit_bias for a fixed set of tokens, or stop strings")

#: What ``LLM.beam_search`` and ``BeamSearchParams`` say.
NO_BEAM_SEARCH = ("minivllm has no beam search (a vLLM feature; README, 'Coming from vLLM or nano-vllm'). Nearest "
                  "alternatives: greedy decoding (temperature=0), or SamplingParams(n=k, temperature>0, logprobs=0) "
                  "and rank the completions by their cumulative_logprob")


#: vLLM ``SamplingParams`` arguments (v0 and v1) for features minivllm does not implement: the
#: feature, and whether a value (given the other arguments) turns it on. As ``config.LACKING_VLLM_ARGS``
#: for the engine: an off value (None, vLLM's default; a script's ``x if cond else None``) is accepted.
_VLLM_ONLY = {
    "structured_outputs": ("structured outputs (decoding constrained to a JSON schema, regex, grammar or choice)",
                           lambda v, kw: v is not None),
    "guided_decoding": ("guided decoding (structured outputs)", lambda v, kw: v is not None),
    "best_of": ("best_of (sampling more candidates than returned: vLLM's V0 engine had it, its V1 engine dropped it; "
                "sample n=k and rank by cumulative_logprob instead)",
                lambda v, kw: v is not None and v != kw.get("n", 1)),
    "use_beam_search": ("beam search", lambda v, kw: bool(v)),
    "length_penalty": ("beam search's length penalty", lambda v, kw: v != 1.0),
    "early_stopping": ("beam search's early stopping", lambda v, kw: bool(v)),
    "logits_processors": ("logits_processors (per-request callables applied to the logits)", lambda v, kw: bool(v)),
    "flat_logprobs": ("flat_logprobs (logprobs as FlatLogprobs)", lambda v, kw: bool(v)),
    "logprob_token_ids": ("logprob_token_ids (logprobs of chosen tokens)", lambda v, kw: v is not None),
    "prompt_logprob_token_ids": ("prompt_logprob_token_ids (prompt logprobs of chosen tokens)",
                                 lambda v, kw: v is not None),
    "prompt_logprob_start": ("prompt_logprob_start (prompt logprobs from a chosen row)",
                             lambda v, kw: v not in (None, 0)),  # 0: from the first row, what minivllm gives
    "stream_interval": ("stream_interval (streaming several tokens per output)", lambda v, kw: v not in (None, 1)),
    "thinking_token_budget": ("thinking_token_budget (a cap on reasoning tokens)",
                              lambda v, kw: v is not None and (isinstance(v, bool) or v != -1)),  # -1: unlimited
    "repetition_detection": ("repetition_detection (ending on repeated n-grams)", lambda v, kw: v is not None),
    "skip_reading_prefix_cache": ("skip_reading_prefix_cache (a request that bypasses the prefix cache)",
                                  lambda v, kw: bool(v)),
    "trace_decode_token_ids": ("trace_decode_token_ids (forced decode tokens; to score a known continuation, "
                               "append it to the prompt and ask for prompt_logprobs)", lambda v, kw: v is not None),
    "routed_experts_prompt_start": ("routed_experts_prompt_start (mixture-of-experts routing data)",
                                    lambda v, kw: bool(v)),
    "skip_clone": ("skip_clone", lambda v, kw: False),  # vLLM's internal copy flag: nothing to turn on here
    "watermarking": ("watermarking (marking generated text)", lambda v, kw: bool(v)),  # vLLM 0.34: bool | None
}
#: the largest finite float32: a logit bias beyond it is +inf in the engine's float32 logits
_FLOAT32_MAX = 3.4028234663852886e38
#: numeric fields a numpy scalar may be given for (converted to int / float before validation)
_INT_FIELDS = ("top_k", "max_tokens", "seed", "n", "min_tokens", "truncate_prompt_tokens", "logprobs",
               "prompt_logprobs")
_REAL_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _token_id(v):
    """v as a Python int where it is a whole number (numpy ints, 5.0, "5": vLLM takes int(v)), else v."""
    if isinstance(v, bool):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().isdigit():  # JSON object keys are strings
        return int(v)
    return v


_dataclass_init = SamplingParams.__init__


def _init_with_vllm_only(self, *args, **kwargs):
    """The dataclass ``__init__``, keyword arguments only, also taking vLLM's arguments for features
    minivllm lacks: one at a value that asks for nothing (None, vLLM's default) is dropped; otherwise
    a TypeError says it is a vLLM feature, rather than Python's bare "unexpected keyword argument"."""
    if args:  # vLLM's field order starts n, ..., nano-vllm's temperature, max_tokens: either would be misread
        raise TypeError(f"SamplingParams{args!r}: give its arguments by name (temperature=..., max_tokens=...); "
                        "positional arguments would be read in another order than vLLM's (n, ...) or "
                        "nano-vllm's (temperature, max_tokens, ignore_eos)")
    lacking = [name for name in kwargs if name in _VLLM_ONLY and _VLLM_ONLY[name][1](kwargs[name], kwargs)]
    if lacking:
        raise TypeError("; ".join(f"SamplingParams({name}=...): {_VLLM_ONLY[name][0]} is a vLLM feature minivllm "
                                  "does not have" for name in lacking) + " (README, 'Coming from vLLM or nano-vllm')")
    for name in [n for n in kwargs if n in _VLLM_ONLY]:
        del kwargs[name]
    _dataclass_init(self, *args, **kwargs)
    self._greedy_without_filters()


# functools.wraps: help() and Jupyter's Shift+Tab show the dataclass's own signature (via __wrapped__)
SamplingParams.__init__ = functools.wraps(_dataclass_init)(_init_with_vllm_only)
