"""Where vLLM's scripts import the engine arguments from (``vllm.engine.arg_utils``), so that
changing ``vllm`` to ``minivllm`` in the import line is enough; they live in ``minivllm.config``.
``AsyncEngineArgs`` imports too, and building one says there is no asynchronous engine here."""
from minivllm.config import EngineArgs
from minivllm.engine.async_llm_engine import AsyncEngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
