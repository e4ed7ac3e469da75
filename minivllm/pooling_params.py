"""vLLM's ``PoolingParams``, importable so a vLLM pooling script's import line works; minivllm
serves generative models only (``LLM.embed`` / ``classify`` / ``score`` say so too)."""
from __future__ import annotations

NO_POOLING = ("minivllm serves generative models only: pooling (embeddings, classification, scores; a vLLM feature) "
              "is not here (README, 'Coming from vLLM or nano-vllm')")


class PoolingParams:
    """vLLM's ``PoolingParams``: building one raises.

    Raises:
        NotImplementedError: always (no pooling models here).
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"PoolingParams: {NO_POOLING}")
