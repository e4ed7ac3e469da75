"""Export a run (step records, request outputs, utilisation samples) to JSON or pandas.

A run is three lists: ``StepRecord`` objects (one per engine step),
``RequestOutput`` objects (their ``metrics`` carry the per-request times) and
``UtilisationSample`` objects. All times are ``time.perf_counter`` seconds, so
the three line up on one axis. Already-exported dicts are accepted wherever
objects are, so ``run_to_dataframes(**load_run_json(path))`` works (the JSON's
``meta`` key is ignored there).

JSON needs only the standard library; pandas is imported on first use of
:func:`run_to_dataframes` (it is in the ``lab`` extra).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable

__all__ = ["run_to_json", "save_run_json", "load_run_json", "run_to_dataframes",
           "step_to_dict", "request_to_dict", "sample_to_dict"]

FORMAT_VERSION = 1

# Derived per-request metrics read from RequestMetrics (properties or fields).
_METRIC_NAMES = ("arrival_time", "first_scheduled_time", "first_token_time", "finished_time",
                 "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")


def _plain(x: Any) -> Any:
    """JSON-safe copy: dataclasses -> dicts, tuples -> lists, non-finite floats -> None."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = x.to_dict() if hasattr(x, "to_dict") else dataclasses.asdict(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if hasattr(x, "item"):  # numpy / torch scalars
        return _plain(x.item())
    return str(x)


def step_to_dict(step: Any) -> dict:
    """A ``StepRecord`` (or its dict) as plain JSON data, with ``wall_ms`` and ``phase``."""
    if isinstance(step, dict):
        return _plain(step)
    return _plain(step.to_dict())


def request_to_dict(req: Any) -> dict:
    """A ``RequestOutput`` (or its dict) as plain data: ids, token counts, finish
    reason, cached tokens and every field of its ``metrics`` (times in
    perf_counter seconds, derived figures in ms, ``itl_ms`` a list). The output token count
    and finish reason are the first completion's (``outputs[0]``; with ``n > 1`` the others
    are not counted)."""
    if isinstance(req, dict):
        return _plain(req)
    out0 = req.outputs[0] if getattr(req, "outputs", None) else None
    d: dict[str, Any] = {
        "request_id": getattr(req, "request_id", None),
        "num_prompt_tokens": len(getattr(req, "prompt_token_ids", None) or []),
        "num_output_tokens": len(out0.token_ids) if out0 is not None else 0,
        "finish_reason": getattr(out0, "finish_reason", None),
        "num_cached_tokens": getattr(req, "num_cached_tokens", None),
        "finished": getattr(req, "finished", None),
    }
    m = getattr(req, "metrics", None)
    if m is not None:
        if dataclasses.is_dataclass(m):
            d.update(dataclasses.asdict(m))
        for name in _METRIC_NAMES:
            try:
                d[name] = getattr(m, name)
            except (AttributeError, TypeError, ValueError, ZeroDivisionError):
                d[name] = None  # e.g. tpot of a one-token request
    return _plain(d)


def sample_to_dict(sample: Any) -> dict:
    """A ``UtilisationSample`` (or a dict of one) as plain JSON values."""
    return _plain(sample if isinstance(sample, dict) else dataclasses.asdict(sample))


def run_to_json(steps: Iterable[Any] = (), requests: Iterable[Any] = (), samples: Iterable[Any] = (),
                meta: dict | None = None) -> dict:
    """The run as a JSON-serialisable dict:
    ``{"format_version", "meta", "steps": [...], "requests": [...], "samples": [...]}``."""
    return {
        "format_version": FORMAT_VERSION,
        "meta": _plain(meta or {}),
        "steps": [step_to_dict(s) for s in steps],
        "requests": [request_to_dict(r) for r in requests],
        "samples": [sample_to_dict(s) for s in samples],
    }


def save_run_json(path: str | Path, steps: Iterable[Any] = (), requests: Iterable[Any] = (),
                  samples: Iterable[Any] = (), meta: dict | None = None) -> Path:
    """Write :func:`run_to_json` to ``path`` (strict JSON: no NaN/inf). Returns the path."""
    path = Path(path)
    data = run_to_json(steps, requests, samples, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, allow_nan=False)
    return path


def load_run_json(path: str | Path) -> dict:
    """Read a file written by :func:`save_run_json`.

    Raises:
        ValueError: the file is JSON but not a run export (no ``steps``), or not JSON
            (``json.JSONDecodeError``, a ValueError).
        OSError: the file cannot be read."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "steps" not in data:
        raise ValueError(f"{path} is not a minivllm run export (no 'steps' key)")
    return data


_STEP_COLUMNS = ["index", "start_time", "end_time", "wall_ms", "phase", "num_prefill_tokens",
                 "num_decode_tokens", "num_seqs", "num_prefill_chunks", "num_preempted",
                 "num_finished", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached",
                 "prefix_cache_hit_tokens", "attention_backend", "schedule_ms", "prepare_ms",
                 "model_ms", "sample_ms", "postprocess_ms", "flops", "bytes_moved", "mfu", "mbu"]
_SCHED_COLUMNS = ["step", "request_id", "num_tokens", "is_prefill", "first_position", "sampled"]
_REQ_COLUMNS = ["request_id", "num_prompt_tokens", "num_output_tokens", "finish_reason",
                "num_cached_tokens", "finished", *_METRIC_NAMES]
_SAMPLE_COLUMNS = ["time", "cpu_percent", "per_cpu_percent", "process_cpu_percent", "rss_bytes",
                   "gpu_util_percent", "mem_util_percent", "mem_used_bytes", "power_w", "sm_clock_mhz"]


def run_to_dataframes(steps: Iterable[Any] = (), requests: Iterable[Any] = (),
                      samples: Iterable[Any] = (), **_ignored) -> dict:
    """The run as pandas DataFrames, keyed ``"steps"``, ``"scheduled"``, ``"requests"``,
    ``"samples"``.

    * ``steps``: one row per step; lists are replaced by counts (``num_preempted``,
      ``num_finished``); ``extra`` keys become ``extra.<key>`` columns.
    * ``scheduled``: one row per (step, request) entry, ``step`` = step index.
    * ``requests``: one row per request (``itl_ms`` stays a list per row).
    * ``samples``: one row per utilisation sample, plus ``cpu<i>_percent`` per core.
    """
    import pandas as pd

    data = run_to_json(steps, requests, samples)
    step_rows, sched_rows = [], []
    for s in data["steps"]:
        row = {k: v for k, v in s.items() if k not in ("scheduled", "preempted", "finished", "extra")}
        row["num_preempted"] = len(s.get("preempted") or [])
        row["num_finished"] = len(s.get("finished") or [])
        for k, v in (s.get("extra") or {}).items():
            row[f"extra.{k}"] = v
        step_rows.append(row)
        for e in s.get("scheduled") or []:
            sched_rows.append({"step": s.get("index"), **e})
    sample_rows = []
    for s in data["samples"]:
        row = dict(s)
        for i, p in enumerate(s.get("per_cpu_percent") or []):
            row[f"cpu{i}_percent"] = p
        sample_rows.append(row)

    def frame(rows, columns):
        if not rows:
            return pd.DataFrame(columns=columns)
        df = pd.DataFrame(rows)
        first = [c for c in columns if c in df.columns]
        return df[first + [c for c in df.columns if c not in first]]

    return {
        "steps": frame(step_rows, _STEP_COLUMNS),
        "scheduled": frame(sched_rows, _SCHED_COLUMNS),
        "requests": frame(data["requests"], _REQ_COLUMNS),
        "samples": frame(sample_rows, _SAMPLE_COLUMNS),
    }
