"""``LLM.start_profile()`` / ``stop_profile()``: a ``torch.profiler`` trace of what ran between them.

As in vLLM: the trace directory comes from ``LLM(profiler_config={"profiler": "torch",
"torch_profiler_dir": DIR})`` (vLLM's current spelling; its other keys below) or the
``VLLM_TORCH_PROFILER_DIR`` environment variable (its older one). The trace is a Chrome trace
(JSON, gzipped unless ``torch_profiler_use_gzip`` is False) that https://ui.perfetto.dev or
``chrome://tracing`` opens. Only this process is traced: with ``tensor_parallel_size > 1``, rank
0's work and its waits for the other ranks. One profile runs in a process at a time (torch's
profiler is process-wide).
"""
from __future__ import annotations

import contextlib
import gzip
import itertools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

__all__ = ["PROFILER_OPTIONS", "TorchProfile", "check_profiler_config"]

logger = logging.getLogger("minivllm")

#: vLLM's ProfilerConfig keys taken here as booleans -> (default, torch.profiler.profile's keyword,
#: or None where the key changes nothing here). Defaults are vLLM's.
PROFILER_OPTIONS = {
    "torch_profiler_with_stack": (True, "with_stack"),
    "torch_profiler_with_flops": (False, "with_flops"),
    "torch_profiler_record_shapes": (False, "record_shapes"),
    "torch_profiler_with_memory": (False, "profile_memory"),
    "torch_profiler_use_gzip": (True, None),              # the trace is written .json.gz
    "torch_profiler_dump_cuda_time_total": (True, None),  # vLLM's summary table; none written here
    "capture_torch_profiler": (False, None),              # vLLM profiles its CUDA graph capture
    "detailed_trace_annotation": (False, None),
    "ignore_frontend": (False, None),
}
#: vLLM's keys that trace a window of engine steps: only their defaults (the whole span) are taken.
_STEP_WINDOW = {"delay_iterations": 0, "max_iterations": 0, "warmup_iterations": 0, "wait_iterations": 0,
                "active_iterations": 5}


def check_profiler_config(config: dict | None) -> None:
    """Check ``profiler_config`` (vLLM's ``ProfilerConfig`` keys, as a dict; None: no profiler).

    Raises:
        ValueError: ``config`` not a dict; a key vLLM's ``ProfilerConfig`` lacks (named); a
            ``profiler`` other than ``"torch"`` (vLLM's ``"cuda"``, for Nsight, is not here); a
            directory without ``profiler="torch"`` or the reverse (as vLLM refuses them); a
            non-boolean option; a step-window key away from its default (not supported here)."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise ValueError(f"profiler_config={config!r}: must be a dict such as "
                         "{'profiler': 'torch', 'torch_profiler_dir': './trace'}")
    known = {"profiler", "torch_profiler_dir", *PROFILER_OPTIONS, *_STEP_WINDOW}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"profiler_config keys {unknown}: not vLLM ProfilerConfig keys; valid: {sorted(known)}")
    kind, where = config.get("profiler"), config.get("torch_profiler_dir")
    if kind not in (None, "torch"):
        raise ValueError(f"profiler_config['profiler']={kind!r}: only 'torch' (torch.profiler) here")
    if where and kind != "torch":
        raise ValueError(f"profiler_config['torch_profiler_dir']={where!r} needs 'profiler': 'torch'")
    if kind == "torch" and not where:
        raise ValueError("profiler_config['profiler']='torch' needs a 'torch_profiler_dir'")
    for key in PROFILER_OPTIONS:
        if key in config and not isinstance(config[key], bool):
            raise ValueError(f"profiler_config[{key!r}]={config[key]!r}: must be True or False")
    for key, default in _STEP_WINDOW.items():
        if key in config and config[key] != default:
            raise ValueError(f"profiler_config[{key!r}]={config[key]!r}: tracing a window of engine steps is a "
                             f"vLLM feature minivllm does not have (leave it at {default}); start_profile and "
                             "stop_profile around the steps you want do the same")


class TorchProfile:
    """One engine's profiler: :meth:`start`, then :meth:`stop` writes the trace."""

    _traces = itertools.count()  # two traces in one second get two names

    def __init__(self, config: dict | None, device: torch.device):
        self.config = dict(config or {})
        self.device = device
        self._profile = None
        self._where: Path | None = None
        self._prefix = "minivllm"

    def option(self, key: str) -> bool:
        """The profiler option ``key`` (one of ``PROFILER_OPTIONS``) as configured, else its default."""
        return self.config.get(key, PROFILER_OPTIONS[key][0])

    def _trace_dir(self) -> Path:
        where = self.config.get("torch_profiler_dir") or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not where:
            raise RuntimeError("start_profile: no trace directory; give LLM(profiler_config={'profiler': 'torch', "
                               "'torch_profiler_dir': DIR}) or set VLLM_TORCH_PROFILER_DIR")
        return Path(where).expanduser().absolute()

    def start(self, profile_prefix: str | None = None) -> None:
        """Start tracing; ``profile_prefix`` begins the trace's file name (default "minivllm").

        Raises:
            ValueError: a ``profile_prefix`` that is not a plain file-name part (a path).
            RuntimeError: this engine is already profiling, another torch profiler is running in
                this process (another engine's, or a script's own), or no trace directory."""
        if profile_prefix is not None and (not isinstance(profile_prefix, str) or not profile_prefix
                                           or Path(profile_prefix).name != profile_prefix
                                           or profile_prefix in (".", "..")):
            raise ValueError(f"profile_prefix={profile_prefix!r}: give a plain name for the start of the trace's "
                             "file name (the directory comes from profiler_config or VLLM_TORCH_PROFILER_DIR)")
        if self._profile is not None:
            raise RuntimeError("start_profile: already profiling (call stop_profile first)")
        if torch.autograd._profiler_enabled():  # stopping one of two overlapping profiles crashes torch
            raise RuntimeError("start_profile: a torch profiler is already running in this process (another "
                               "LLM's start_profile, or a torch.profiler.profile of your own); stop it first")
        where = self._trace_dir()  # fixed now: an environment changed before stop_profile loses nothing
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        options = {kw: self.option(key) for key, (_, kw) in PROFILER_OPTIONS.items() if kw is not None}
        profile = torch.profiler.profile(activities=activities, **options)
        try:
            profile.start()
        except BaseException:  # an interrupt after torch enabled it: no profiler left on without a handle
            with contextlib.suppress(Exception):
                if torch.autograd._profiler_enabled():
                    profile.stop()
            raise
        self._profile, self._where, self._prefix = profile, where, profile_prefix or "minivllm"

    def stop(self) -> Path:
        """Stop and write ``<dir>/<prefix>-<pid>-<time>-<n>.pt.trace.json[.gz]``; returns its path.

        Raises:
            RuntimeError: not profiling, or the trace could not be written (its directory cannot
                be made, or torch failed to write it); the trace is then lost."""
        profile, self._profile = self._profile, None
        if profile is None:
            raise RuntimeError("stop_profile: not profiling (call start_profile first)")
        profile.stop()
        try:
            self._where.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RuntimeError(f"stop_profile: the trace directory {self._where} cannot be made ({e}); "
                               "the trace is lost") from None
        name = f"{self._prefix}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{next(self._traces)}.pt.trace.json"
        path = self._where / name
        profile.export_chrome_trace(str(path))
        if not path.exists():  # torch logs a failed write and returns
            raise RuntimeError(f"stop_profile: the trace could not be written to {path}")
        if self.option("torch_profiler_use_gzip"):
            with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            path.unlink()
            path = path.with_name(name + ".gz")
        logger.info("profiler trace written to %s (open it in https://ui.perfetto.dev)", path)
        return path

    def discard(self) -> None:
        """Stop a trace still running without writing it (the engine's shutdown)."""
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()
