"""Live instruments for the minivllm course: ipywidgets + plotly components that drive the
real engine and show what it measured.

Each is one class, usable in a notebook with one line, e.g. ``EngineStepper(llm).display()``,
or as an ipywidgets container (they are ``VBox`` subclasses):

* :class:`EngineStepper` - add requests, step the engine, see each step's tokens and time.
* :class:`KVCacheView` - the physical KV block grid, block tables and slot mapping.
* :class:`SchedulerTimeline` - each request's state over steps; prefill/decode tokens per step.
* :class:`LatencyCalculator` - TTFT/TPOT/total from a cost model fitted to measurements here.
* :class:`UtilisationMonitor` - utilisation sampler series and a per-step roofline.
* :class:`SamplingExplorer` - the model's real next-token distribution under sampling filters.
* :class:`PrefixCacheView` - shared system prompt: per-block hits and the TTFT saved.
* :class:`ChunkedPrefillDemo` - inter-token latency of decoding requests with and without chunking.
* :class:`Quiz` - multiple choice, where each wrong answer explains the slip.
* :func:`check_prediction`, :func:`check_claim`, :func:`render` - exercises and claims checked
  against this run's measurements (``widgets/course.py``).
* :func:`idle_engine` - abort what a widget or an earlier cell left running, before a cell's own steps.
* :func:`quiet_profile` - ``torch.profiler.profile`` without its start/stop lines on stderr.

Names are imported lazily so ``import widgets`` stays cheap.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineStepper": "widgets.engine_stepper",
    "KVCacheView": "widgets.kv_cache_view",
    "SchedulerTimeline": "widgets.scheduler_timeline",
    "LatencyCalculator": "widgets.latency_calculator",
    "LatencyModel": "widgets.latency_model",
    "UtilisationMonitor": "widgets.utilisation_monitor",
    "SamplingExplorer": "widgets.sampling_explorer",
    "PrefixCacheView": "widgets.prefix_cache_view",
    "ChunkedPrefillDemo": "widgets.chunked_prefill_demo",
    "Quiz": "widgets.quiz",
    "check_prediction": "widgets.course",
    "check_claim": "widgets.course",
    "render": "widgets.course",
    "quiet_profile": "widgets.profiling",
    "Question": "widgets.quiz",
    "measure_step_latency": "widgets.measure",
    "figure_html": "widgets._static",
    "show_figure": "widgets._static",
    "measure_decode_batch": "widgets.measure",
    "measure_request_latency": "widgets.measure",
    "idle_engine": "widgets._engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'widgets' has no attribute {name!r}")
