"""All-reduce time against message size between local processes (gloo, CPU tensors).

A collective's time is modelled as a fixed cost per call plus its bytes over a bandwidth
(Hockney's "alpha-beta" model: ``t = alpha + bytes / beta``; R. Hockney, "The communication
challenge for MPP", Parallel Computing 20, 1994). A tensor-parallel decode step makes many small
all-reduces, where ``alpha`` dominates; a long prefill makes large ones, where ``beta`` does. This
measures both on the machine: ``world_size`` processes (this one is rank 0, the others are fresh
interpreters running ``python -m minivllm.bench.collectives``) meet on a store at a free port,
and for each size, after a barrier, every rank issues ``calls`` all-reduces back to back, so a
call's time is a transfer and the ranks' own skew, not one rank's wait for another to arrive
(what a timed call inside an engine step includes).
"""
from __future__ import annotations

import argparse
import datetime
import math
import numbers
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minivllm.executor.launch import _worker_env, kill_workers, wait_ready, worker_failure

#: default message sizes: 1 KiB to 4 MiB, 4x apart (a decode step's all-reduce of one token's
#: hidden state is 4 KiB in fp32 for a 1024-wide model; a 512-token prefill's is 2 MiB)
DEFAULT_SIZES = tuple(1024 * 4 ** i for i in range(7))
_READY = "allreduce-ready/{rank}"


@dataclass
class AllReduceTimes:
    """What :func:`all_reduce_times` measured.

    Attributes:
        world_size: processes taking part.
        backend: "gloo".
        sizes_bytes: bytes of the all-reduced fp32 tensor, one per size measured.
        us_per_call: median over the rounds of one call's time (a round's time / ``calls``), µs.
        us_min, us_max: the fastest and slowest round's per-call time, µs.
        calls, rounds: all-reduces per round, rounds per size.
    """

    world_size: int
    backend: str
    sizes_bytes: list[int]
    us_per_call: list[float]
    us_min: list[float]
    us_max: list[float]
    calls: int
    rounds: int

    def alpha_beta(self, fastest: bool = True) -> tuple[float, float]:
        """Hockney's two terms, ``t = alpha + bytes / beta``, fitted by least squares over every size:
        ``alpha`` in µs, ``beta`` in bytes per µs (MB/s). ``fastest``: fit each size's fastest round
        (``us_min``: load from other processes only ever slows a round), else its median
        (``us_per_call``). Where the fitted time does not grow with the bytes, ``beta`` is ``inf``
        and ``alpha`` the mean time; where the line would meet zero bytes below zero, ``alpha`` is 0
        and the line goes through the origin. Two ends of a noisy sweep gave a "fixed cost" above
        the median of the calls timed inside engine steps (chapter 10)."""
        x = [float(b) for b in self.sizes_bytes]
        y = list(self.us_min if fastest else self.us_per_call)
        n, mx, my = len(x), statistics.fmean(x), statistics.fmean(y)
        sxx = sum((v - mx) ** 2 for v in x)
        slope = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx if n > 1 and sxx > 0 else 0.0
        if slope <= 0:
            return my, float("inf")
        alpha = my - slope * mx
        if alpha < 0:
            slope = sum(u * v for u, v in zip(x, y)) / sum(u * u for u in x)
            return 0.0, 1.0 / slope
        return alpha, 1.0 / slope

    def grows_with_bytes(self, tolerance: float = 0.25) -> bool:
        """Whether the fastest rounds' times never fell, from one size to the next larger, by more
        than ``tolerance`` (a fraction): the alpha-beta model's shape, within the noise of a shared
        2-core machine, where the small sizes' fastest rounds (all near alpha) moved by up to ~20%
        between neighbours in a quiet run. On a machine whose load moved during the sweep they can
        fall further, and then :meth:`alpha_beta` fits noise."""
        pairs = sorted(zip(self.sizes_bytes, self.us_min))
        return all(b[1] >= (1 - tolerance) * a[1] for a, b in zip(pairs, pairs[1:]))

    def to_dict(self) -> dict:
        """Every field (``dataclasses.asdict``): JSON-ready."""
        return asdict(self)


def _time_sizes(group, sizes: list[int], calls: int, rounds: int) -> list[list[float]]:
    """Every rank runs this: per size, ``rounds`` per-call times in µs. The sizes take turns
    within each round, so a slow moment of the machine falls on all of them alike."""
    tensors = [torch.ones(max(1, size // 4), dtype=torch.float32) for size in sizes]
    for t in tensors:  # warm-up: gloo's connections and buffers for each size
        for _ in range(3):
            group.allreduce([t]).wait()
    per_size = [[] for _ in sizes]
    for _ in range(rounds):
        # untimed calls first: without them a round's first timed size came out slower than the same
        # size timed again right after it (1.2-2.8x in three runs on the 2-core dev machine)
        group.barrier().wait()
        for _ in range(calls):
            group.allreduce([tensors[0]]).wait()
        for times, t in zip(per_size, tensors):
            group.barrier().wait()
            t0 = time.perf_counter()
            for _ in range(calls):
                group.allreduce([t]).wait()
            times.append((time.perf_counter() - t0) / calls * 1e6)
    return per_size


def all_reduce_times(sizes_bytes=DEFAULT_SIZES, world_size: int = 2, calls: int = 20,
                     rounds: int = 5, timeout_s: float = 120.0) -> AllReduceTimes:
    """Time fp32 all-reduces of each size over ``world_size`` local processes (gloo over TCP).

    Args:
        sizes_bytes: message sizes in bytes (multiples of 4; each >= 4).
        world_size: processes, >= 2 (this one and ``world_size - 1`` started for the run).
        calls: back-to-back all-reduces per round; rounds: rounds per size.
        timeout_s: how long the other processes may take to start and to finish.

    Raises:
        ValueError: a size not an int that is a positive multiple of 4, world_size < 2, calls or
            rounds < 1, or ``timeout_s`` not a positive, finite number.
        RuntimeError: a helper process failed to start or failed during the run (its exit status
            is given), or did not connect within ``timeout_s``.
    """
    sizes = list(sizes_bytes) if not isinstance(sizes_bytes, (str, bytes)) else [sizes_bytes]
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 4 or s % 4]
    if bad or not sizes:  # 1024.5 ran as 1024 through int()
        raise ValueError(f"sizes_bytes={sizes_bytes!r}: each must be a positive multiple of 4 (fp32 values), an int")
    sizes = [int(s) for s in sizes]
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s={timeout_s!r}: must be a positive, finite number of seconds")
    if world_size < 2:
        raise ValueError(f"world_size={world_size!r}: an all-reduce needs at least 2 processes")
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls={calls!r}, rounds={rounds!r}: each must be >= 1")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)
    args = ["--sizes", *map(str, sizes), "--calls", str(calls), "--rounds", str(rounds),
            "--world-size", str(world_size), "--store", f"127.0.0.1:{store.port}", "--timeout", str(timeout_s)]
    procs = []
    try:
        for r in range(1, world_size):
            # a session of its own: a Ctrl-C (Jupyter's Interrupt) for the caller's process group reaches only
            # the caller, which then stops the helpers, instead of printing their tracebacks too
            procs.append(subprocess.Popen([sys.executable, "-m", "minivllm.bench.collectives", "--rank", str(r), *args],
                                          env=_worker_env(), stdin=subprocess.DEVNULL, start_new_session=True))
        wait_ready(store, procs, _READY, timeout_s, "all-reduce helper")
        group = dist.ProcessGroupGloo(dist.PrefixStore("allreduce", store), 0, world_size, timeout)
        try:
            per_size = _time_sizes(group, sizes, calls, rounds)
        except RuntimeError as e:  # gloo's "connection closed": say which helper ended and how
            failure = worker_failure(store, procs) or "the helpers still run"
            raise RuntimeError(f"all-reduce helper failed during the run ({failure}): {e}") from None
        for p in procs:
            code = p.wait(timeout=timeout_s)
            if code:
                raise RuntimeError(f"all-reduce helper process exited with status {code}")
    except BaseException:
        kill_workers(procs, grace_s=0.5)  # a helper blocked in an all-reduce would wait out a longer grace
        raise
    return AllReduceTimes(world_size, "gloo", sizes, [statistics.median(t) for t in per_size],
                          [min(t) for t in per_size], [max(t) for t in per_size], calls, rounds)


def _main(argv: list[str] | None = None) -> int:
    """A helper rank (started by :func:`all_reduce_times`)."""
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.collectives")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--sizes", type=int, nargs="+", required=True)
    p.add_argument("--calls", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    host, _, port = a.store.rpartition(":")
    timeout = datetime.timedelta(seconds=a.timeout)
    store = dist.TCPStore(host, int(port), a.world_size, False, timeout=timeout)
    store.set(_READY.format(rank=a.rank), b"1")
    group = dist.ProcessGroupGloo(dist.PrefixStore("allreduce", store), a.rank, a.world_size, timeout)
    _time_sizes(group, a.sizes, a.calls, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
