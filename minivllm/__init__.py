"""minivllm: a small, fast, readable LLM inference engine for teaching.

The public names are imported lazily so that ``import minivllm`` stays fast
(transformers and the model code load on first use).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from minivllm import logger as _logger

__version__ = "0.1.0"
_logger.configure()  # INFO to stderr by default; MINIVLLM_LOGGING_LEVEL changes it (see minivllm/logger.py)

_EXPORTS = {
    "LLM": "minivllm.llm",
    "SamplingParams": "minivllm.sampling_params",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "Logprob": "minivllm.outputs",
    "TextPrompt": "minivllm.inputs",
    "TokensPrompt": "minivllm.inputs",
    "PromptType": "minivllm.inputs",
    "RequestMetrics": "minivllm.outputs",
    "EngineArgs": "minivllm.config",
    "LLMEngine": "minivllm.engine.llm_engine",
    "StepResult": "minivllm.engine.llm_engine",
    "StepRecord": "minivllm.telemetry.step_record",
    # vLLM's names for features minivllm lacks: their import lines work, building one says so
    "PoolingParams": "minivllm.pooling_params",
    "AsyncEngineArgs": "minivllm.engine.async_llm_engine",
    "AsyncLLMEngine": "minivllm.engine.async_llm_engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy names too, so tab completion in Jupyter offers `minivllm.LLM` before its first use; not this
    # file's own imports (TYPE_CHECKING, annotations, importlib) nor its private names
    own = {name for name in globals()
           if (name.startswith("__") or not name.startswith("_")) and name not in _OWN_IMPORTS}
    return sorted(own | set(_EXPORTS))


_OWN_IMPORTS = {"TYPE_CHECKING", "annotations", "importlib"}


if TYPE_CHECKING:  # pragma: no cover
    from minivllm.config import EngineArgs
    from minivllm.engine.async_llm_engine import AsyncEngineArgs, AsyncLLMEngine
    from minivllm.engine.llm_engine import LLMEngine, StepResult
    from minivllm.inputs import PromptType, TextPrompt, TokensPrompt
    from minivllm.llm import LLM
    from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from minivllm.pooling_params import PoolingParams
    from minivllm.sampling_params import SamplingParams
    from minivllm.telemetry.step_record import StepRecord
