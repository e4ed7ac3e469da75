"""vLLM's asynchronous engine names, importable so a vLLM script's import line works; minivllm's
engine is synchronous (``LLM``, ``LLMEngine``; ``LLM.stream`` yields a request's output as it grows)."""
from __future__ import annotations

NO_ASYNC_ENGINE = ("minivllm has no asynchronous engine (asyncio; a vLLM feature: README, 'Coming from vLLM or "
                   "nano-vllm'). Nearest: LLM.stream(prompt, params) yields each request's output as it grows, and "
                   "LLMEngine.add_request(...) with LLMEngine.step() drives requests step by step")


class AsyncEngineArgs:
    """vLLM's ``AsyncEngineArgs``: building one raises (the synchronous ``EngineArgs`` is here).

    Raises:
        NotImplementedError: always.
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"AsyncEngineArgs: {NO_ASYNC_ENGINE}")

    @classmethod
    def add_cli_args(cls, *args, **kwargs):
        """vLLM's: raises, as building one does (``EngineArgs.add_cli_args`` is here)."""
        raise NotImplementedError(f"AsyncEngineArgs.add_cli_args: {NO_ASYNC_ENGINE}")

    @classmethod
    def from_cli_args(cls, *args, **kwargs):
        """vLLM's: raises, as building one does (``EngineArgs.from_cli_args`` is here)."""
        raise NotImplementedError(f"AsyncEngineArgs.from_cli_args: {NO_ASYNC_ENGINE}")


class AsyncLLMEngine:
    """vLLM's ``AsyncLLMEngine`` (``AsyncLLM`` in its V1 engine): building one raises.

    Raises:
        NotImplementedError: always.
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: {NO_ASYNC_ENGINE}")

    @classmethod
    def from_engine_args(cls, *args, **kwargs):
        """vLLM's constructor of the same name: raises as building one does."""
        raise NotImplementedError(f"{cls.__name__}.from_engine_args: {NO_ASYNC_ENGINE}")

    @classmethod
    def from_vllm_config(cls, *args, **kwargs):
        """vLLM's constructor of the same name: raises as building one does."""
        raise NotImplementedError(f"{cls.__name__}.from_vllm_config: {NO_ASYNC_ENGINE}")


class AsyncLLM(AsyncLLMEngine):
    """vLLM's V1 name for :class:`AsyncLLMEngine`: building one raises the same way."""
