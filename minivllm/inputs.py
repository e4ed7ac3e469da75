"""Prompt types (vLLM's ``vllm.inputs``): a prompt is a ``str``, a ``list[int]`` of token
ids, or one of these typed dicts. They are plain dicts at run time; the types document
the keys for editors and type checkers."""

from typing import TypedDict, Union

try:
    from typing import NotRequired  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.10 (typing_extensions comes with torch)
    from typing_extensions import NotRequired


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
        raise ValueError(f"cache_salt={salt!r}: must be a non-empty str (or left out)")
    return salt
