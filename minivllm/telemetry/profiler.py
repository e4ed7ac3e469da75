"""``LLM.start_profile()`` / ``stop_profile()``: a ``torch.profiler`` trace of what ran between them.

As in vLLM: the trace directory comes from ``LLM(profiler_config={"profiler": "torch",
"torch_profiler_dir": DIR})`` (vLLM's current spelling) or the ``VLLM_TORCH_PROFILER_DIR``
environment variable (its older one). The trace is a Chrome trace (JSON) that
https://ui.perfetto.dev or ``chrome://tracing`` opens. Only this process is traced: with
``tensor_parallel_size > 1``, rank 0's work and its waits for the other ranks.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import torch

__all__ = ["PROFILER_CONFIG_KEYS", "TorchProfile", "check_profiler_config"]

logger = logging.getLogger("minivllm")

#: profiler_config key -> torch.profiler.profile's keyword (None: not one of its keywords)
PROFILER_CONFIG_KEYS = {
    "profiler": None,
    "torch_profiler_dir": None,
    "torch_profiler_record_shapes": "record_shapes",
    "torch_profiler_with_memory": "profile_memory",
    "torch_profiler_with_stack": "with_stack",
    "torch_profiler_with_flops": "with_flops",
}


def check_profiler_config(config: dict | None) -> None:
    """Raises:
        ValueError: ``config`` not a dict, a key minivllm does not take (named), or a
            ``profiler`` other than ``"torch"`` (vLLM's ``"cuda"``, for Nsight, is not here)."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise ValueError(f"profiler_config={config!r}: must be a dict such as "
                         "{'profiler': 'torch', 'torch_profiler_dir': './trace'}")
    unknown = sorted(set(config) - set(PROFILER_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"profiler_config keys {unknown}: not taken here; valid: {sorted(PROFILER_CONFIG_KEYS)}")
    if config.get("profiler") not in (None, "torch"):
        raise ValueError(f"profiler_config['profiler']={config['profiler']!r}: only 'torch' (torch.profiler)")


class TorchProfile:
    """One engine's profiler: :meth:`start`, then :meth:`stop` writes the trace."""

    _traces = itertools.count()  # two traces in one second get two names

    def __init__(self, config: dict | None, device: torch.device):
        self.config = dict(config or {})
        self.device = device
        self._profile = None

    def trace_dir(self) -> Path:
        """Raises:
            RuntimeError: neither ``profiler_config`` nor ``VLLM_TORCH_PROFILER_DIR`` names one."""
        where = self.config.get("torch_profiler_dir") or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not where:
            raise RuntimeError("start_profile: no trace directory; give LLM(profiler_config={'profiler': 'torch', "
                               "'torch_profiler_dir': DIR}) or set VLLM_TORCH_PROFILER_DIR")
        return Path(where).expanduser()

    def start(self) -> None:
        """Raises:
            RuntimeError: already profiling, or no trace directory (see :meth:`trace_dir`)."""
        if self._profile is not None:
            raise RuntimeError("start_profile: already profiling (call stop_profile first)")
        self.trace_dir()  # refused now, not after the run
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        options = {kw: bool(self.config[key]) for key, kw in PROFILER_CONFIG_KEYS.items()
                   if kw is not None and key in self.config}
        profile = torch.profiler.profile(activities=activities, **options)
        profile.start()
        self._profile = profile

    def stop(self) -> Path:
        """Stop and write ``<dir>/minivllm-<pid>-<time>-<n>.pt.trace.json``; returns its path.

        Raises:
            RuntimeError: not profiling."""
        profile, self._profile = self._profile, None
        if profile is None:
            raise RuntimeError("stop_profile: not profiling (call start_profile first)")
        profile.stop()
        directory = self.trace_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"minivllm-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{next(self._traces)}.pt.trace.json"
        profile.export_chrome_trace(str(path))
        logger.info("profiler trace written to %s (open it in https://ui.perfetto.dev)", path)
        return path

    def discard(self) -> None:
        """Stop a trace still running without writing it (the engine's shutdown)."""
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()
