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


class TokensPrompt(TypedDict):
    """A prompt of token ids: ``{"prompt_token_ids": [...]}`` (not tokenized again)."""

    prompt_token_ids: list[int]
    #: Accepted for vLLM compatibility; minivllm has no multimodal models (must be absent or None).
    multi_modal_data: NotRequired[None]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
