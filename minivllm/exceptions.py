"""vLLM's exception classes (``vllm.exceptions``), for scripts that catch them.

minivllm raises :class:`VLLMValidationError` where a request is refused for its input: a bad
prompt, bad ``SamplingParams``, a ``priority`` or ``lora_request`` it cannot serve. Unlike vLLM's
(a ``VLLMClientError`` only), it is also a ``ValueError``, which minivllm has always raised there:
``except ValueError`` and ``except VLLMValidationError`` both catch it. The engine's own
configuration errors (``LLM(...)`` arguments) stay plain ``ValueError``, as in vLLM.
"""
from __future__ import annotations

import pickle
from typing import Any

__all__ = ["VLLMError", "VLLMClientError", "VLLMServerError", "VLLMValidationError"]


class VLLMError(Exception):
    """Base class of vLLM's own errors (``vllm.exceptions.VLLMError``)."""


class VLLMClientError(VLLMError):
    """An error caused by the request (vLLM maps these to HTTP 4xx)."""


class VLLMServerError(VLLMError):
    """An error of the server itself (vLLM maps these to HTTP 5xx)."""


class VLLMValidationError(VLLMClientError, ValueError):
    """A request refused for its input.

    Args:
        message: what is wrong; minivllm's messages name the offending value.
        parameter / value: vLLM's optional fields naming the parameter and the value (None where
            the message alone says it). ``str()`` is the message alone.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __reduce__(self):
        # pickled with the value's repr where the value itself does not pickle (a lock given as a seed): an
        # error sent between processes must not fail to pickle
        try:
            pickle.dumps(self.value)
            value = self.value
        except Exception:
            value = repr(self.value)
        return _rebuild, (type(self), self.args, self.parameter, value)


def _rebuild(cls, args, parameter, value):
    return cls(*args, parameter=parameter, value=value)
