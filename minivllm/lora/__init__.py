"""vLLM's ``vllm.lora`` import path, so a script's ``from vllm.lora.request import LoRARequest`` line
resolves here; minivllm serves no LoRA adapters (``minivllm.lora.request``)."""
