"""vLLM's ``LoRARequest``, importable so a vLLM script's import line works; minivllm has no LoRA."""
from __future__ import annotations


class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: building one raises, where vLLM's
    would be passed as ``LLM.generate(..., lora_request=...)`` (which only takes None here).

    Raises:
        NotImplementedError: always (minivllm does not serve LoRA adapters).
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("LoRARequest: minivllm does not serve LoRA adapters (a vLLM feature; README, "
                                  "'Coming from vLLM or nano-vllm'): run the base model, or merge the adapter into "
                                  "the checkpoint's weights first (e.g. peft's merge_and_unload) and load that")
