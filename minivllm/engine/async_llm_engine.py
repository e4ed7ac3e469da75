"""vLLM's asynchronous engine names, importable so a vLLM script's import line works; minivllm's
engine is synchronous (``LLM``, ``LLMEngine``; ``LLM.stream`` yields a request's output as it grows)."""
from __future__ import annotations

NO_ASYNC_ENGINE = ("minivllm has no asynchronous engine (asyncio; a vLLM feature: README, 'Coming from vLLM or "
                   "nano-vllm'). Nearest: LLM.stream(prompt, params) yields each request's output as it grows, and "
                   "LLMEngine.add_request(...) with LLMEngine.step() drives requests step by step")


class _Refused:
    """A vLLM class kept importable: building one raises ``NotImplementedError`` naming it."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: {NO_ASYNC_ENGINE}")


def _refusing(name: str) -> classmethod:
    """vLLM's class method ``name``, which a script calls before building anything: it raises as building does."""
    def method(cls, *args, **kwargs):
        raise NotImplementedError(f"{cls.__name__}.{name}: {NO_ASYNC_ENGINE}")

    method.__name__, method.__doc__ = name, f"vLLM's ``{name}``: raises as building one does."
    return classmethod(method)


class AsyncEngineArgs(_Refused):
    """vLLM's ``AsyncEngineArgs``: building one, or its ``add_cli_args`` / ``from_cli_args``, raises
    (the synchronous ``EngineArgs`` is here).

    Raises:
        NotImplementedError: always.
    """

    add_cli_args = _refusing("add_cli_args")
    from_cli_args = _refusing("from_cli_args")


class AsyncLLMEngine(_Refused):
    """vLLM's ``AsyncLLMEngine``: building one, or its ``from_engine_args`` / ``from_vllm_config``, raises.

    Raises:
        NotImplementedError: always.
    """

    from_engine_args = _refusing("from_engine_args")
    from_vllm_config = _refusing("from_vllm_config")


class AsyncLLM(AsyncLLMEngine):
    """vLLM's V1 name for :class:`AsyncLLMEngine`: building one raises the same way."""
