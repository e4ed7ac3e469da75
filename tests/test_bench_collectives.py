"""minivllm.bench.collectives: all-reduce time against bytes over local processes (chapter 10)."""
from __future__ import annotations

import math

import pytest

from minivllm.bench.collectives import AllReduceTimes, all_reduce_times


def test_two_processes_time_each_size():
    r = all_reduce_times([16, 4096], world_size=2, calls=3, rounds=2, timeout_s=60)
    assert r.sizes_bytes == [16, 4096] and (r.world_size, r.backend, r.calls, r.rounds) == (2, "gloo", 3, 2)
    for lo, med, hi in zip(r.us_min, r.us_per_call, r.us_max):
        assert 0 < lo <= med <= hi
    alpha, beta = r.alpha_beta()
    assert alpha >= 0 and beta > 0  # (inf where 4 KiB took no longer than 16 B)
    assert r.to_dict()["sizes_bytes"] == [16, 4096]


def test_alpha_beta_is_a_least_squares_fit_of_the_fastest_rounds():
    """The two ends of a noisy sweep (medians 1997, 1593, ..., 977, ... µs) made alpha the slowest
    small call; every size's fastest round now enters a least-squares line."""
    sizes = [1000, 11000, 101000, 1001000]
    exact = [100.0 + b / 1000.0 for b in sizes]  # alpha 100 µs, beta 1000 bytes/µs
    noisy_medians = [400.0, 150.0, 900.0, 1200.0]
    r = AllReduceTimes(2, "gloo", sizes, noisy_medians, exact, [2e3] * 4, 1, 1)
    alpha, beta = r.alpha_beta()
    assert alpha == pytest.approx(100.0) and beta == pytest.approx(1000.0)
    assert r.alpha_beta(fastest=False) != (alpha, beta) and r.grows_with_bytes()
    falling = AllReduceTimes(2, "gloo", [4, 8], [50.0, 30.0], [50.0, 30.0], [60.0, 60.0], 1, 1)
    assert falling.alpha_beta() == (40.0, math.inf) and not falling.grows_with_bytes()
    assert AllReduceTimes(2, "gloo", [4, 8], [50.0, 40.0], [50.0, 40.0], [60.0] * 2, 1, 1).grows_with_bytes()
    steep = AllReduceTimes(2, "gloo", [100, 200, 300], [0.0] * 3, [1.0, 10.0, 20.0], [30.0] * 3, 1, 1)
    alpha, beta = steep.alpha_beta()  # a line meeting zero bytes below zero: through the origin instead
    assert alpha == 0.0 and beta == pytest.approx((100**2 + 200**2 + 300**2) / (100 + 2000 + 6000))


@pytest.mark.parametrize("kwargs, match", [
    (dict(sizes_bytes=[6]), r"sizes_bytes=\[6\]"), (dict(sizes_bytes=[]), "sizes_bytes=\\[\\]"),
    (dict(world_size=1), "world_size=1"), (dict(calls=0), "calls=0"), (dict(rounds=0), "rounds=0"),
    # 1024.5 ran as 1024; "abc" failed in int(); NaN and -1 timeouts failed in torch (a C++ stack dump)
    (dict(sizes_bytes=[1024.5]), r"sizes_bytes=\[1024.5\]"), (dict(sizes_bytes="abc"), "sizes_bytes='abc'"),
    (dict(timeout_s=float("nan")), "timeout_s=nan"), (dict(timeout_s=-1), "timeout_s=-1"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        all_reduce_times(**kwargs)


def test_a_helper_that_exits_at_start_is_reported_at_once(monkeypatch):
    # building the gloo group waited out the whole timeout (120 s by default) for a helper that had died
    import sys
    import time

    monkeypatch.setattr(sys, "executable", "/bin/false")  # the helper's interpreter: exits with status 1
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"all-reduce helper failed to start: rank 1 \(pid \d+\) exited with status 1"):
        all_reduce_times([16], world_size=2, calls=1, rounds=1, timeout_s=60)
    assert time.monotonic() - t0 < 30


def test_ctrl_c_for_the_process_group_reaches_only_the_caller(tmp_path):
    # Jupyter's Interrupt reached the helper too, which printed its own traceback above the cell's
    import os
    import signal
    import subprocess
    import sys
    import time

    # (Ctrl-C's handler set explicitly: a process started in the background inherits SIGINT ignored, and so
    # would its helpers, hiding what this checks)
    script = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from minivllm.bench.collectives import all_reduce_times\n"
              "all_reduce_times([4096, 1 << 20], calls=20, rounds=2000, timeout_s=60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(4.0)  # the helper started and connected (its import of torch included)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err and err.count("Traceback (most recent call last)") == 1, err
