"""``speculative_config`` (vLLM v1's engine argument), validated."""
from __future__ import annotations

from dataclasses import dataclass

_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    Attributes:
        method: "ngram" (prompt lookup: propose the tokens that followed the latest earlier
            occurrence of the context's last n tokens, n from ``prompt_lookup_max`` down to
            ``prompt_lookup_min``). vLLM's "draft_model" is not implemented yet.
        num_speculative_tokens: most draft tokens proposed per sequence per step (k >= 1).
        prompt_lookup_max / prompt_lookup_min: the n-gram sizes tried, longest first.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    @classmethod
    def from_dict(cls, config: dict) -> "SpeculativeConfig":
        """Raises ``ValueError`` naming the offending key or value."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config={config!r}: expected a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        unknown = sorted(set(config) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        method = config.get("method")
        if method == "draft_model":
            raise ValueError("speculative_config method='draft_model' is not implemented in minivllm yet; "
                             "use method='ngram'")
        if method != "ngram":
            raise ValueError(f"speculative_config method={method!r}: choose 'ngram'")
        values = {"num_speculative_tokens": config.get("num_speculative_tokens"),
                  "prompt_lookup_max": config.get("prompt_lookup_max", cls.prompt_lookup_max),
                  "prompt_lookup_min": config.get("prompt_lookup_min", cls.prompt_lookup_min)}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {key}={value!r}: must be an int >= 1")
        if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
            raise ValueError(f"speculative_config prompt_lookup_min={values['prompt_lookup_min']} > "
                             f"prompt_lookup_max={values['prompt_lookup_max']}")
        return cls(method=method, **values)
