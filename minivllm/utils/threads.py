"""How many torch CPU threads to use when other processes may share the CPU.

OpenMP threads of one parallel region wait for each other: when another busy process holds
a core, every region waits for the descheduled thread, and a step slows down by far more
than the share of CPU lost (``python -m minivllm generate`` on the 2-core AMD EPYC development
machine with two other busy processes, 2026-12-01: 13 tokens/s with 2 threads, 183 with 1; the
figures of issue 11, the CPU-speed issue). ``"auto"``
therefore takes the cores the load average leaves free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["MAX_THREADS", "ThreadChoice", "available_cores", "choose_threads"]

#: the most ``--threads`` takes: far above any core count this runs on, below what torch's int32 argument holds
MAX_THREADS = 1024


def available_cores() -> int:
    """The logical cores this process may run on: its CPU affinity mask where the system has one
    (``taskset``, a container's cpuset), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return os.cpu_count() or 1


def _omp_num_threads() -> int | None:
    """``$OMP_NUM_THREADS`` as a positive int, else None (unset or not a number)."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n >= 1 else None


@dataclass(frozen=True)
class ThreadChoice:
    """``threads``: the count to pass to ``torch.set_num_threads``, or ``None`` to keep
    torch's default; ``reason``: one line saying why (for the startup log)."""

    threads: int | None
    reason: str


def choose_threads(value: str | int | None, cores: int | None = None,
                   load: float | None = None, machine_cores: int | None = None) -> ThreadChoice:
    """Resolve a ``--threads`` value.

    Args:
        value: an int from 1 to ``MAX_THREADS`` (used as is), or ``"auto"`` / ``None``:
            ``machine_cores - load`` rounded (the cores other processes leave idle, by the 1-minute
            load average, which counts the whole machine), clamped to ``[1, cores]`` and to
            ``$OMP_NUM_THREADS`` where that is set, or torch's default when the load average is unknown.
        cores / load / machine_cores: the logical cores this process may use, the 1-minute load
            average and the machine's logical cores (default: :func:`available_cores`, the affinity
            mask; ``os.getloadavg()[0]``; ``os.cpu_count()``, or ``cores`` where only that is given;
            parameters for tests).

    Raises:
        ValueError: ``value`` is neither ``"auto"`` nor an int from 1 to ``MAX_THREADS`` (the
            message names it).
    """
    if value is None or value == "auto":
        machine_cores = machine_cores or cores or os.cpu_count() or 1
        cores = cores or available_cores()
        if load is None:
            if not hasattr(os, "getloadavg"):
                return ThreadChoice(None, "load average unavailable: torch's default thread count")
            load = os.getloadavg()[0]
        n = max(1, min(cores, round(machine_cores - load)))
        why = f"load average {load:.1f} on {machine_cores} cores" + (
            f", {cores} of them this process's" if cores < machine_cores else "")
        omp = _omp_num_threads()
        if omp is not None and omp < n:  # the user's own limit for OpenMP threads
            n, why = omp, f"{why}, capped by OMP_NUM_THREADS={omp}"
        return ThreadChoice(n, f"{n} torch thread(s): {why} (--threads auto; pass --threads N to override)")
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or n > MAX_THREADS or (isinstance(value, float) and value != n):
        raise ValueError(f"--threads {value!r}: expected 'auto' or an int from 1 to {MAX_THREADS}")
    cores = cores or available_cores()
    more = (f"; more than the {cores} cores: OpenMP threads then take turns on them and wait for each other, "
            f"which slows a step down" if n > cores else "")
    return ThreadChoice(n, f"{n} torch thread(s) (--threads){more}")
