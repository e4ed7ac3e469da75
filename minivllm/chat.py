"""Chat messages as a chat template expects them (for ``LLM.chat``).

vLLM accepts OpenAI-style messages: ``content`` a string, a list of parts such as
``{"type": "text", "text": ...}``, or None (an assistant turn that only calls tools), and
renders most templates (Qwen3's among them) with the text parts joined into one string by
``"\\n"`` and None as ``""``. Templates test ``message.content is string`` and drop anything
else, so passing the parts through would lose the user's words without an error. This engine
is text-only: an image, audio or other part is refused by name.

An assistant message's OpenAI-style ``tool_calls`` carry each call's ``arguments`` as a JSON
string; tool-use templates (transformers' convention, which vLLM follows) expect a dict, so
it is parsed, and an empty ``tool_calls`` list is dropped.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path

from minivllm.exceptions import VLLMValidationError

__all__ = ["load_chat_template", "text_messages", "unused_template_variables"]


def text_messages(conversation, index: int) -> list[dict]:
    """``conversation`` (a list of message mappings) with every ``content`` made a string; the
    other keys (``role``, ``tool_calls``, ``name``, ...) are kept as they are.

    Raises:
        ValueError: an empty conversation, a message that is not a mapping with a string ``role``, or content that is
            neither a string, None, nor a list of text parts (naming conversation ``index``,
            the message and the part).
    """
    if isinstance(conversation, (str, bytes, Mapping)) or not hasattr(conversation, "__iter__"):
        raise VLLMValidationError(f"conversation {index}: must be a list of messages ({{'role': ..., 'content': ...}}), "
                                  f"got {type(conversation).__name__}")
    out = []
    if not conversation:  # the template would fail with its own words, naming no conversation
        raise VLLMValidationError(f"conversation {index}: empty (a conversation needs at least one message)")
    for m, message in enumerate(conversation):
        where = f"conversation {index}, message {m}"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise VLLMValidationError(f"{where}: must be a dict with a 'role' string, got {message!r}")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, (list, tuple)):
            pieces = []
            for p, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise VLLMValidationError(f"{where}, content part {p}: {part!r} is not a text part "
                                              "({'type': 'text', 'text': ...}); this engine's models take text only")
                pieces.append(part["text"])
            text = "\n".join(pieces)
        else:
            raise VLLMValidationError(f"{where}: content must be a str, a list of text parts, or None, "
                                      f"got {type(content).__name__}")
        out.append({**message, "content": text})
        if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
            calls = _tool_calls(message["tool_calls"], where)
            if calls:
                out[-1]["tool_calls"] = calls
            else:
                del out[-1]["tool_calls"]  # an empty list would take templates off the plain assistant turn
    return out


def _tool_calls(calls: list, where: str) -> list:
    """Copies of ``calls`` whose ``function.arguments`` JSON strings are parsed (absent, None or "" -> {})."""
    out = []
    for c, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), (str, type(None))):
            out.append(call)  # already a dict (or not a call at all): as given
            continue
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as e:
            raise VLLMValidationError(f"{where}, tool call {c}: arguments {arguments!r} is not JSON ({e})") from None
        out.append({**call, "function": {**function, "arguments": parsed}})
    return out


def unused_template_variables(template: str, names) -> list[str]:
    """Those of ``names`` (template variables a caller passed) that the Jinja ``template`` source
    never reads, sorted: ``jinja2.meta.find_undeclared_variables``, the names the source uses
    without setting them. A chat template without ``tools`` in it renders the same prompt with or
    without them, and neither transformers nor vLLM says so. [] where the source does not parse
    with jinja2's loop controls (a template using transformers' own tags: not judged)."""
    used = _template_variables(template)
    return [] if used is None else sorted(name for name in names if name not in used)


@functools.lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str] | None:
    """The names ``template`` reads without setting them, or None where it does not parse; cached, as
    LLM.chat asks again on every call with tools and a template takes milliseconds to parse."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)))
    except jinja2.TemplateSyntaxError:
        return None


def load_chat_template(template) -> str | None:
    """``LLM(chat_template=...)`` as a template string, the way vLLM reads it: None stays None; a
    ``str`` or ``os.PathLike`` naming a readable file is that file's text; any other ``str`` with
    Jinja's ``{``, ``}`` or a newline in it is the template itself.

    Raises:
        ValueError: a path that cannot be read (a ``Path``, or a ``str`` with none of those
            characters: it looks like a file name), or a value that is neither (naming it).
    """
    if template is None:
        return None
    if not isinstance(template, (str, os.PathLike)):
        raise ValueError(f"chat_template={template!r}: give a Jinja template string or a template file's path")
    try:
        return Path(template).read_text()
    except (OSError, ValueError) as e:  # ValueError: a NUL in a template string
        if isinstance(template, str) and any(c in template for c in "{}\n"):
            return template
        raise ValueError(f"chat_template={str(template)!r} looks like a file path, but it could not be read "
                         f"({type(e).__name__}: {e})") from None
