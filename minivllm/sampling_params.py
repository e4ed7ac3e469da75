"""How to pick each next token, and when to stop: vLLM's ``SamplingParams``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings (validated at construction).

    Filters apply in this order (vLLM's): repetition penalty, temperature,
    top-k, top-p, min-p; then a token is drawn from what remains.

    Args:
        temperature: softmax temperature; ``0`` means greedy (argmax).
        top_p: keep the smallest set of tokens whose probability sums to at
            least ``top_p``; in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; ``0`` or ``-1`` disables.
        min_p: drop tokens whose probability is below ``min_p`` times the most
            likely token's; in [0, 1].
        repetition_penalty: > 0; vLLM's definition (from CTRL, Keskar et al. 2019):
            a logit of a token already in the prompt or output is divided by the
            penalty when positive and multiplied by it when negative.
        seed: a per-request seed: the request then samples the same tokens
            whatever else is in the batch.
        max_tokens: most tokens to generate (>= 1).
        ignore_eos: keep generating past the model's end-of-sequence token.
        stop: a string or a list of strings that end generation; the returned text ends
            *before* the stop string.
        stop_token_ids: a list of token ids that end generation (always apply, even with
            ``ignore_eos``); the engine checks them against the model's vocabulary.

    Raises:
        ValueError: naming the offending field and value.
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
    # Filled by __post_init__: ``stop`` as a list.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, value, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r}: {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an int >= 1, or 0 / -1 to disable")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an int >= 1")
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
        self.stop_strings = stop
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of int token ids, or None")
        ids = list(self.stop_token_ids or [])
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", self.stop_token_ids, f"element {i} ({t!r}) is not an int >= 0")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def max_stop_len(self) -> int:
        """Longest stop string, in characters (text held back while streaming)."""
        return max((len(s) for s in self.stop_strings), default=0)
