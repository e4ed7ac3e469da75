"""Where a measurement came from: machine, device, model, dtype, threads (one line, or a chart subtitle)."""
from __future__ import annotations

import os
import platform
from pathlib import Path


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


_SIZE_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The largest CPU cache Linux reports for CPU 0 (``index*/size`` under ``sysfs``, e.g. ``"260M"``
    -> 272629760), in bytes: the size a working set must exceed for its reads to come from main
    memory. None where there is no such directory (not Linux) or nothing readable in it. A virtual
    machine reports what its hypervisor passes on, which may not be the host's whole cache."""
    sizes = []
    for index in Path(sysfs).glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if text[-1:].upper() in _SIZE_SUFFIX and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * _SIZE_SUFFIX[text[-1].upper()])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None


def device_name(device) -> str:
    """What a ``torch.device`` is: the GPU's name for CUDA, else the CPU model (:func:`cpu_name`)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


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


def chart_provenance(llm, threads=None) -> str:
    """Where a chart's measurements come from, for its subtitle:
    ``"measured on cpu (AMD EPYC 9R14) · minivllm-tiny · float32 · 1 CPU thread"`` (device with the
    processor's or GPU's name, model and dtype of the live engine, its ``tensor_parallel_size``
    where above 1, and torch's CPU thread count: this process's, rank 0's).
    ``llm``: an ``LLM`` or its ``LLMEngine``. ``threads``: the thread count(s) the chart's data were
    measured with (an int, or a collection of them: "1-2 CPU threads"), default torch's count now."""
    import torch

    engine = getattr(llm, "llm_engine", llm)
    cfg = engine.config
    counts = sorted({torch.get_num_threads()} if threads is None else
                    {threads} if isinstance(threads, int) else set(threads)) or [torch.get_num_threads()]
    n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    tp = getattr(cfg.args, "tensor_parallel_size", 1)
    return (f"measured on {cfg.device} ({device_name(cfg.device)}) · {engine.source.name} · {str(cfg.dtype).replace('torch.', '')} · "
            + (f"tensor_parallel_size={tp} · " if tp > 1 else "")
            + f"{n} CPU thread{'s' if n != '1' else ''}")


def chart_title(title: str, llm, threads=None) -> str:
    """A plotly title: ``title`` with :func:`chart_provenance` (``threads`` as there) in small print
    under it."""
    import html

    return f"{title}<br><sup>{html.escape(chart_provenance(llm, threads))}</sup>"
