"""Prompt types (vLLM's ``vllm.inputs``): a prompt is a ``str``, a ``list[int]`` of token
ids, or one of these typed dicts. They are plain dicts at run time; the types document
the keys for editors and type checkers."""

import sys
from typing import Union

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10: typing's TypedDict ignores typing_extensions' NotRequired
    from typing_extensions import NotRequired, TypedDict  # (the keys would all be required)

from minivllm.exceptions import VLLMValidationError  # (a ValueError too)


class TextPrompt(TypedDict):
    """A text prompt: ``{"prompt": "..."}`` (tokenized by the model's tokenizer)."""

    prompt: str
    #: Accepted for vLLM compatibility; minivllm has no multimodal models (must be absent or None).
    multi_modal_data: NotRequired[None]
    #: Prefix-cache salt: the prompt's cached blocks are shared only with prompts of the same salt.
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt of token ids: ``{"prompt_token_ids": [...]}`` (not tokenized again)."""

    prompt_token_ids: list[int]
    #: Accepted for vLLM compatibility; minivllm has no multimodal models (must be absent or None).
    multi_modal_data: NotRequired[None]
    #: Prefix-cache salt: the prompt's cached blocks are shared only with prompts of the same salt.
    cache_salt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]


def cache_salt_of(prompt) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's: requests with different salts, or a salt and none,
    never share prefix-cache blocks, so one user's prompts cannot be probed through another's
    cache hits), None where there is none.

    Raises:
        ValueError: a salt that is not a non-empty ``str``, naming it.
    """
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise VLLMValidationError(f"cache_salt={salt!r}: must be a non-empty str (or left out)")
    return salt


#: The keys of vLLM's ``tokenization_kwargs`` that minivllm applies.
TOKENIZATION_KEYS = ("truncate_prompt_tokens", "add_special_tokens")


def check_tokenization_kwargs(kwargs: dict | None) -> dict:
    """vLLM's ``tokenization_kwargs`` (of ``LLM.generate`` / ``chat``, ``LLMEngine.add_request``),
    checked: ``truncate_prompt_tokens`` (keep a prompt's last k tokens, -1: the last
    ``max_model_len - 1``; over ``SamplingParams.truncate_prompt_tokens``) and
    ``add_special_tokens`` (bool, for text prompts; default True). Returns a new dict.

    Raises:
        ValueError: not a dict, another key (naming it), or a bad value (naming it).
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise VLLMValidationError(f"tokenization_kwargs={kwargs!r}: must be a dict (or None)")
    other = sorted(set(kwargs) - set(TOKENIZATION_KEYS), key=str)
    if other:
        raise VLLMValidationError(f"tokenization_kwargs key(s) {other}: minivllm applies only {list(TOKENIZATION_KEYS)}")
    t = kwargs.get("truncate_prompt_tokens")
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
        raise VLLMValidationError(f"tokenization_kwargs['truncate_prompt_tokens']={t!r}: must be an int >= 1, -1 "
                                  "(up to max_model_len - 1), or None")
    special = kwargs.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise VLLMValidationError(f"tokenization_kwargs['add_special_tokens']={special!r}: must be True or False")
    return dict(kwargs)


def prompt_truncation(tokenization: dict, params) -> int | None:
    """The ``truncate_prompt_tokens`` a prompt gets: ``tokenization_kwargs``' (checked), else the
    ``SamplingParams``' (also where the kwargs give None)."""
    value = tokenization.get("truncate_prompt_tokens")
    return params.truncate_prompt_tokens if value is None else value
