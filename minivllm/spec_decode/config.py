"""``speculative_config`` (vLLM v1's engine argument), validated."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "enforce_eager", "max_model_len", "draft_tensor_parallel_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    Attributes:
        method: "ngram" (prompt lookup: propose the tokens that followed the latest earlier
            occurrence of the context's last n tokens, n from ``prompt_lookup_max`` down to
            ``prompt_lookup_min``) or "draft_model" (a smaller model with the target's
            vocabulary proposes k tokens autoregressively; ``minivllm/spec_decode/draft_model.py``).
        num_speculative_tokens: most draft tokens proposed per sequence per step (k >= 1). For
            "draft_model" it defaults, as in vLLM, to the draft checkpoint's own
            ``num_speculative_tokens`` in its config.json when that names one
            (``minivllm-tiny-draft`` does).
        prompt_lookup_max / prompt_lookup_min: the n-gram sizes tried, longest first ("ngram");
            vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
        model: "draft_model": the draft checkpoint, as ``LLM(model=...)`` takes it (a local
            Hugging Face directory, or the embedded ``"minivllm-tiny-draft"``).
        enforce_eager: "draft_model": True runs every draft forward eagerly; None (default)
            follows the target's ``enforce_eager``; False replays the draft's forwards from CPU
            graphs where the draft can (a float32 draft on a CPU; on CUDA a draft runs eagerly).
        max_model_len: "draft_model": the longest sequence the draft proposes for (default: its
            ``max_position_embeddings``); longer sequences decode without drafts, as in vLLM.
        draft_tensor_parallel_size: vLLM's; minivllm runs the draft unsharded in the target's
            rank-0 process, so only None or 1 is accepted.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    model: str | None = None
    enforce_eager: bool | None = None
    max_model_len: int | None = None

    @classmethod
    def from_dict(cls, config: dict) -> "SpeculativeConfig":
        """The config from vLLM's dict. Without a ``method``, vLLM's rule picks it from ``model``:
        ``"ngram"`` (or ``"[ngram]"``) means "ngram", any other model "draft_model".

        Raises ``ValueError`` naming the offending key or value."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config={config!r}: expected a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        unknown = sorted(set(config) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        method, model = config.get("method"), config.get("model")
        if method is None and model is not None:  # vLLM's inference: older configs name only the model
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method == "ngram" and model in ("ngram", "[ngram]"):
            model = None  # the method's own name in the model slot, as vLLM takes it
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config method={method!r}: choose 'ngram' or 'draft_model'")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config model={model!r}: method 'draft_model' needs the draft "
                             "checkpoint, e.g. 'minivllm-tiny-draft' or a local directory")
        if method == "ngram" and model is not None:
            raise ValueError(f"speculative_config model={model!r}: method 'ngram' takes no model")
        k = config.get("num_speculative_tokens")
        if k is None and method == "draft_model":
            k = draft_config_k(model)
        lookup_max, lookup_min = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:  # vLLM's rule (its SpeculativeConfig.__post_init__)
            lookup_max, lookup_min = cls.prompt_lookup_max, cls.prompt_lookup_min
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        values = {"num_speculative_tokens": k, "prompt_lookup_max": lookup_max, "prompt_lookup_min": lookup_min}
        for key, value in values.items():  # numpy's integers too (a sweep over np.arange), never a bool
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"speculative_config {key}={value!r}: must be an int >= 1")
            values[key] = int(value)
        if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
            raise ValueError(f"speculative_config prompt_lookup_min={values['prompt_lookup_min']} > "
                             f"prompt_lookup_max={values['prompt_lookup_max']}")
        eager, max_len, draft_tp = (config.get(k) for k in ("enforce_eager", "max_model_len",
                                                            "draft_tensor_parallel_size"))
        if eager is not None and not isinstance(eager, bool):
            raise ValueError(f"speculative_config enforce_eager={eager!r}: must be True, False or None")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral)
                                    or max_len < 1):
            raise ValueError(f"speculative_config max_model_len={max_len!r}: must be an int >= 1 or None")
        if draft_tp is not None and (isinstance(draft_tp, bool) or draft_tp != 1):
            raise ValueError(f"speculative_config draft_tensor_parallel_size={draft_tp!r}: minivllm runs the draft "
                             "unsharded in the target's rank-0 process; give 1 or leave it out")
        if method == "ngram" and (eager is not None or max_len is not None):
            given = [k for k in ("enforce_eager", "max_model_len") if config.get(k) is not None]
            raise ValueError(f"speculative_config {given}: settings of a draft model; method 'ngram' has none")
        return cls(method=method, model=model, enforce_eager=eager,
                   max_model_len=None if max_len is None else int(max_len), **values)


def draft_config_k(model: str):
    """``num_speculative_tokens`` named in the draft checkpoint's config.json, or None (no such
    key, or no such checkpoint: loading the draft reports that)."""
    import json
    from pathlib import Path

    from minivllm.utils.model_source import EMBEDDED_CHECKPOINTS

    path = (EMBEDDED_CHECKPOINTS.get(model) or Path(model).expanduser()) / "config.json"
    try:
        return json.loads(path.read_text()).get("num_speculative_tokens")
    except (OSError, ValueError):
        return None
