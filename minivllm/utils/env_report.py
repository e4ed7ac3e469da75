"""One line saying where a measurement came from: machine, device, model, dtype."""
from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else what ``platform`` knows."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def machine_summary() -> str:
    """CPU model and core count, RAM, and the GPU name when CUDA is available."""
    import psutil
    import torch

    parts = [f"{cpu_name()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name()}")
    return "; ".join(parts)


def describe(llm) -> str:
    """``machine | device | model | dtype | attention backend | torch version`` of a live ``LLM``."""
    import torch

    engine = llm.llm_engine
    cfg = engine.config
    return (f"machine: {machine_summary()} | device: {cfg.device} | model: {engine.source.name} | "
            f"dtype: {str(cfg.dtype).replace('torch.', '')} | attention: {cfg.attention_backend} | "
            f"torch {torch.__version__}")
