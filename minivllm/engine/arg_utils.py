"""Where vLLM's scripts import the engine arguments from (``vllm.engine.arg_utils``), so that
changing ``vllm`` to ``minivllm`` in the import line is enough; they live in ``minivllm.config``."""
from minivllm.config import EngineArgs

__all__ = ["EngineArgs"]
