"""A checkpoint's recommended sampling settings (``generation_config.json``) as ``SamplingParams``.

vLLM's ``LLM.get_default_sampling_params()`` reads the same keys (vLLM 0.34,
``ModelConfig.get_diff_sampling_param``): ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``skip_special_tokens`` and
``max_new_tokens`` (as ``max_tokens``); a key the file lacks keeps ``SamplingParams``' default.
``do_sample`` is not read (nor is it by vLLM).
"""
from __future__ import annotations

from pathlib import Path

from minivllm.sampling_params import SamplingParams
from minivllm.utils.model_source import read_json_file

#: generation_config.json key -> SamplingParams field.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "skip_special_tokens": "skip_special_tokens",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(checkpoint_dir: Path | None) -> dict:
    """The sampling fields ``checkpoint_dir/generation_config.json`` sets (empty when there is
    no such file, e.g. for random-weight models).

    Raises:
        ValueError: the file is not a JSON object (naming it)."""
    if checkpoint_dir is None:
        return {}
    path = Path(checkpoint_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = read_json_file(path)
    return {field: config[key] for key, field in GENERATION_CONFIG_KEYS.items() if config.get(key) is not None}


def default_sampling_params(checkpoint_dir: Path | None) -> SamplingParams:
    """``SamplingParams`` with the checkpoint's recommended settings applied.

    Raises:
        ValueError: the file holds a value ``SamplingParams`` refuses (naming the file, the field
            and the value).
    """
    defaults = generation_defaults(checkpoint_dir)
    try:
        return SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{str(Path(checkpoint_dir) / 'generation_config.json')!r}: {e} (the checkpoint's "
                         "recommended sampling settings, used when generate() is given no sampling_params; "
                         "correct the file)") from None
