"""Architecture name (``config.architectures[0]``) -> model class."""
from __future__ import annotations

from torch import nn

from minivllm.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture) -> type[nn.Module]:
    """The class for an architecture name, or for a HF config (its first ``architectures`` entry).

    Raises:
        ValueError: unknown architecture (the message names it and lists the supported ones).
    """
    if not isinstance(architecture, str):
        archs = getattr(architecture, "architectures", None) or []
        if not archs:
            raise ValueError("model config has no 'architectures' entry; supported: "
                             f"{sorted(MODEL_REGISTRY)}")
        architecture = archs[0]
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{sorted(MODEL_REGISTRY)}") from None
