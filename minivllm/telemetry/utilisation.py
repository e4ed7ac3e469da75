"""Background sampling of device utilisation, on the same clock as the step records.

``UtilisationSampler`` runs a daemon thread that samples every ``period_s``
seconds, stamping each sample with ``time.perf_counter()`` (the clock of
``StepRecord.start_time`` / ``end_time``), so samples and steps can be drawn on
one time axis.

* CPU (always): busy percentage per core and overall, computed from the deltas
  of ``psutil.cpu_times(percpu=True)`` between samples (so other callers of
  ``psutil.cpu_percent`` do not disturb it); this process's CPU percentage (can
  exceed 100 with several threads) and resident memory (RSS).
* CUDA (when the device is a GPU and ``nvidia-ml-py`` is installed): NVML's GPU
  busy percentage (``utilization.gpu``: the time at least one kernel ran, not how
  many SMs it used) and memory-controller busy percentage, memory used (bytes),
  power draw (W) and SM clock (MHz).

NVML's utilisation rates are the fraction of time *over a sample window of
between 1/6 s and 1 s* (depending on the product) during which one or more
kernels ran / device memory was read or written (NVML API reference,
``nvmlDeviceGetUtilizationRates``). A step lasts milliseconds, so these figures
are context over time and must never be read as a per-step figure; per-step
compute and bandwidth use come from the roofline (``minivllm.telemetry.roofline``).
"""
from __future__ import annotations

import os
import re
import numbers
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["UtilisationSample", "UtilisationSampler", "check_period"]


@dataclass
class UtilisationSample:
    """One sample. ``time`` is ``time.perf_counter()`` seconds; the GPU fields are
    None on CPU or when NVML is unavailable.

    Attributes:
        time: when the sample was taken (perf_counter seconds).
        cpu_percent: mean busy percent over the cores since the previous sample (0..100); None
            when no clock tick had passed on any core (see :class:`UtilisationSampler`).
        per_cpu_percent: busy percent per core since the previous sample (None for a core
            whose counters had not moved).
        process_cpu_percent: this process's CPU use since the previous sample
            (100 = one core fully busy).
        rss_bytes: this process's resident memory.
        gpu_util_percent: NVML's GPU busy percentage (``utilization.gpu``: time with at least one
            kernel running; windowed average, see module doc).
        mem_util_percent: NVML memory-controller utilisation (windowed average).
        mem_used_bytes: device memory in use (all processes).
        power_w: board power draw in watts.
        sm_clock_mhz: current SM clock.
    """

    time: float
    cpu_percent: float | None
    per_cpu_percent: list[float | None] = field(default_factory=list)
    process_cpu_percent: float | None = None
    rss_bytes: int | None = None
    gpu_util_percent: float | None = None
    mem_util_percent: float | None = None
    mem_used_bytes: int | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None

    def to_dict(self) -> dict:
        """Every field (``dataclasses.asdict``): JSON-ready."""
        return asdict(self)


def _busy(prev, cur) -> float | None:
    """Busy percent of one core between two ``psutil`` cpu_times tuples; None when no clock tick
    separates them (the counters advance in ticks of 1/USER_HZ s: a shorter interval measured
    nothing, which is not 0 % busy)."""
    idle_fields = ("idle", "iowait")
    total = sum(cur) - sum(prev)
    if total <= 0:
        return None
    idle = sum(getattr(cur, f, 0.0) - getattr(prev, f, 0.0) for f in idle_fields)
    return max(0.0, min(100.0, 100.0 * (total - idle) / total))


def check_period(period_s: Any) -> float:
    """``period_s`` as a float of seconds between samples.

    Raises:
        ValueError: not a real number (bools are not), or not in ``(0, threading.TIMEOUT_MAX]``
            (a sampler thread waits that long between samples: inf overflows its clock)."""
    if not isinstance(period_s, numbers.Real) or isinstance(period_s, bool) \
            or not 0 < period_s <= threading.TIMEOUT_MAX:
        raise ValueError(f"period_s must be a positive, finite number of seconds, got {period_s!r}")
    return float(period_s)


class UtilisationSampler:
    """Sample utilisation in a background thread while a workload runs.

    Args:
        period_s: seconds between samples (default 0.1).
        device: "cpu", "cuda", "cuda:N", a ``torch.device``, or None / "auto"
            (CUDA when available). On CUDA the GPU is sampled through NVML in
            addition to the CPU.

    Use as a context manager (``with sampler: run()``) or call ``start()`` /
    ``stop()``. ``stop()`` takes a final sample, so even a workload shorter
    than one period yields at least one sample; samples accumulate across
    start/stop cycles until ``clear()``. The CPU counters advance in clock
    ticks (1/USER_HZ s): a sample less than a tick after the previous one
    measured nothing and is skipped (the next measures from the same start),
    except a run's only sample, kept with ``cpu_percent`` None.

    Raises:
        ValueError: ``period_s`` is not a positive, finite number (:func:`check_period`), or
            ``device`` is not one of the above.
    """

    def __init__(self, period_s: float = 0.1, device: Any = None):
        self.period_s = check_period(period_s)
        self.device = self._resolve_device(device)
        self.nvml_error: str | None = None
        self._samples: list[UtilisationSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set by the sampling thread as it ends. Not Thread.is_alive: Python 3.11's Thread.join,
        # interrupted (a learner's Interrupt during stop()), marks a thread that still runs stopped.
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._nvml_handle = None
        self._proc = None
        self._prev_times = None
        self._taken_this_run = False

    @staticmethod
    def _resolve_device(device: Any) -> str:
        if device is None or str(device) == "auto":
            try:
                import torch

                return "cuda" if torch.cuda.is_available() else "cpu"
            except ImportError:
                return "cpu"
        s = str(device)
        if s not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", s):  # "cudafoo" is no device
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        return s

    # --- lifecycle ---
    @property
    def running(self) -> bool:
        """Whether the sampling thread is alive."""
        return self._thread is not None and not self._done.is_set()

    def start(self) -> "UtilisationSampler":
        """Start sampling every ``period_s`` in a daemon thread (no-op if running); returns self."""
        if self.running:
            return self
        import psutil

        self._proc = psutil.Process(os.getpid())
        self._proc.cpu_percent(None)  # prime: the next call measures from here
        self._prev_times = psutil.cpu_times(percpu=True)
        self._taken_this_run = False  # stop() keeps a final sample only when the run has none
        if self.device.startswith("cuda"):
            self._init_nvml()
        # each thread its own events: clearing a shared one would revive a thread still ending
        self._stop, self._done = threading.Event(), threading.Event()
        thread = threading.Thread(target=self._run, args=(self._stop, self._done), name="minivllm-utilisation",
                                  daemon=True)
        thread.start()
        self._thread = thread  # only once it runs: stop() waits for what _thread names to end
        return self

    def stop(self) -> None:
        """Stop the thread and take a final sample (covering the run's tail); no-op when not started."""
        self._stop.set()  # first: also ends a thread an interrupted start() left unrecorded
        if self._thread is None:
            return
        self._done.wait()  # an interrupt here leaves the sampler as it was: stop() again finishes it
        self._thread.join()  # only its exit is left
        self._thread = None
        self._take(final=True)  # final sample covers the tail of the workload
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutdown failure must not mask the workload's result
                pass
            self._nvml = self._nvml_handle = None

    def __enter__(self) -> "UtilisationSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        # A forgotten sampler must not keep a thread alive forever.
        try:
            self._stop.set()
        except Exception:  # noqa: BLE001
            pass

    # --- samples ---
    @property
    def samples(self) -> list[UtilisationSample]:
        """A copy of the samples taken so far, oldest first."""
        with self._lock:
            return list(self._samples)

    def clear(self) -> None:
        """Forget the samples taken so far."""
        with self._lock:
            self._samples.clear()

    # --- internals ---
    def _run(self, stop: threading.Event, done: threading.Event) -> None:
        try:
            while not stop.wait(self.period_s):
                self._take()
        finally:
            done.set()

    def _init_nvml(self) -> None:
        try:
            import pynvml  # from nvidia-ml-py

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - missing library or driver: CPU samples only
            self.nvml_error = f"NVML unavailable: {e}"
            return
        self._nvml = pynvml
        try:
            self._nvml_handle = self._nvml_handle_for(pynvml)
        except Exception as e:  # noqa: BLE001
            self.nvml_error = f"NVML device lookup failed: {e}"
            pynvml.nvmlShutdown()
            self._nvml = None

    def _nvml_handle_for(self, pynvml):
        # NVML numbers GPUs physically; torch numbers them after CUDA_VISIBLE_DEVICES.
        # The UUID identifies the same board in both.
        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        try:
            import torch

            if torch.cuda.is_available():
                if ":" not in self.device:
                    index = torch.cuda.current_device()
                uuid = str(torch.cuda.get_device_properties(index).uuid)
                if uuid:
                    if not uuid.startswith("GPU-"):
                        uuid = "GPU-" + uuid
                    return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:  # noqa: BLE001 - fall back to the visible-device list below
            pass
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if ids and index < len(ids) and ids[index].isdigit():
            index = int(ids[index])
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def _take(self, final: bool = False) -> None:
        import psutil

        now = time.perf_counter()
        times = psutil.cpu_times(percpu=True)
        per = [_busy(p, c) for p, c in zip(self._prev_times, times)]
        measured = [p for p in per if p is not None]
        if not measured and not (final and not self._taken_this_run):
            # no tick since the last sample: skipped, and the next one measures from the same baseline
            return
        self._prev_times = times
        self._taken_this_run = True
        try:
            proc_cpu = self._proc.cpu_percent(None)
            rss = self._proc.memory_info().rss
        except psutil.Error:
            proc_cpu, rss = None, None
        s = UtilisationSample(
            time=now,
            # None when no core's counters moved (only a final sample of a run with no other can be so)
            cpu_percent=sum(measured) / len(measured) if measured else None,
            per_cpu_percent=per,
            process_cpu_percent=proc_cpu,
            rss_bytes=rss,
        )
        if self._nvml is not None:
            nv, h = self._nvml, self._nvml_handle
            for attr, fn in (
                ("gpu_util_percent", lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu)),
                ("mem_util_percent", lambda: float(nv.nvmlDeviceGetUtilizationRates(h).memory)),
                ("mem_used_bytes", lambda: int(nv.nvmlDeviceGetMemoryInfo(h).used)),
                ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1e3),
                ("sm_clock_mhz", lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
            ):
                try:
                    setattr(s, attr, fn())
                except Exception:  # noqa: BLE001 - some boards do not report every field
                    pass
        with self._lock:
            self._samples.append(s)
