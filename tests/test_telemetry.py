"""Utilisation sampler, peaks microbenchmark cache, and run export."""
import json
import re
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from minivllm.telemetry import peaks as peaks_mod
from minivllm.telemetry.export import load_run_json, run_to_dataframes, run_to_json, save_run_json
from minivllm.telemetry.peaks import Peaks, get_peaks, measure_peaks
from minivllm.telemetry.step_record import ScheduledEntry, StepRecord
from minivllm.telemetry.utilisation import UtilisationSample, UtilisationSampler

TINY = dict(matmul_size=32, copy_bytes=1 << 16, read_bytes=1 << 16, repeats=1)


def _busy(seconds):
    t0 = time.perf_counter()
    x = 0
    while time.perf_counter() - t0 < seconds:
        x += 1
    return x


def test_sampler_samples_on_perf_counter_clock_and_stops():
    s = UtilisationSampler(period_s=0.02, device="cpu")
    t0 = time.perf_counter()
    with s:
        assert s.running
        _busy(0.2)
    t1 = time.perf_counter()
    assert not s.running
    assert not any(t.name == "minivllm-utilisation" for t in threading.enumerate())
    samples = s.samples
    assert len(samples) >= 2
    times = [x.time for x in samples]
    assert times == sorted(times)
    assert t0 <= times[0] and times[-1] <= t1  # perf_counter clock, inside the workload
    for x in samples:
        assert 0.0 <= x.cpu_percent <= 100.0
        assert len(x.per_cpu_percent) >= 1
        assert x.rss_bytes > 0
        assert x.gpu_util_percent is None  # CPU device: no NVML fields
    n = len(samples)
    time.sleep(0.06)
    assert len(s.samples) == n  # nothing sampled after stop
    s.start()
    s.stop()
    assert len(s.samples) >= n + 1  # accumulates across cycles
    s.clear()
    assert s.samples == []


def test_an_interrupt_while_the_sampler_stops_leaves_one_sampling_thread(monkeypatch):
    """Python 3.11's Thread.join, interrupted, marks the thread stopped though it runs: the sampler
    then read as not running, start() cleared the stop event the old thread was about to see and
    started a second thread, and the first sampled on forever."""
    import os
    import signal

    s = UtilisationSampler(period_s=0.01, device="cpu")
    in_sample, take = threading.Event(), s._take

    def slow_take(*args, **kwargs):
        if not kwargs.get("final"):
            in_sample.set()
            time.sleep(1.0)
        return take(*args, **kwargs)

    monkeypatch.setattr(s, "_take", slow_take)
    s.start()
    assert in_sample.wait(5)
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()  # a learner's Interrupt
    with pytest.raises(KeyboardInterrupt):
        s.stop()
    assert s.running  # still inside its sample
    s.start()  # a no-op while it runs
    s.stop()
    assert not s.running
    assert [t for t in threading.enumerate() if t.name == "minivllm-utilisation"] == []


def test_sampler_rejects_bad_args():
    with pytest.raises(ValueError, match="period_s"):
        UtilisationSampler(period_s=0)
    with pytest.raises(ValueError, match="device"):
        UtilisationSampler(device="tpu")
    for bad in ("cudafoo", "cuda:x", "cuda:"):  # "cudafoo" was taken: only startswith("cuda") was checked
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            UtilisationSampler(device=bad)


def test_measure_peaks_tiny():
    p = measure_peaks("cpu", "float32", **TINY)
    assert p.flops_per_s > 0 and p.bytes_per_s > 0
    assert p.device == "cpu" and p.dtype == "float32"
    assert p.info["matmul_size"] == 32 and p.info["copy_bytes"] == 1 << 16 and p.info["read_bytes"] == 1 << 16
    assert p.read_bytes_per_s > 0 and p.mbu_bytes_per_s == p.read_bytes_per_s
    assert p.provenance == "measured now"
    assert p.ridge_intensity == pytest.approx(p.flops_per_s / p.mbu_bytes_per_s)  # the MBU ceiling
    with pytest.raises(ValueError, match="dtype"):
        measure_peaks("cpu", "float13", **TINY)


def test_the_bandwidth_ceilings_are_measured_on_the_pages_the_engine_streams_from(monkeypatch):
    """The engine's weight panels and KV pool ask for 2 MiB pages, which the hardware prefetcher streams
    through without stopping at each 4 KiB page's end; a ceiling read over 4 KiB pages came out below the
    decode step it bounds. The copied and read tensors are made the same way (and the info says whether
    Linux granted the pages)."""
    from minivllm.telemetry import peaks as peaks_mod
    from minivllm.utils import hugepages

    made = []
    real = hugepages.zeroed_cpu_tensor

    def spy(shape, dtype):
        made.append(shape)
        return real(shape, dtype)

    monkeypatch.setattr(hugepages, "zeroed_cpu_tensor", spy)
    p = peaks_mod.measure_peaks("cpu", "float32", **{**TINY, "copy_bytes": 4 << 20, "read_bytes": 4 << 20})
    assert made == [((4 << 20) // 4,)] * 3  # the copy's source and destination, the read
    assert p.info["huge_pages"] == (hugepages.transparent_hugepage_mode() in ("madvise", "always"))


@pytest.mark.parametrize("device, dtype, message", [
    ("gpu", "float32", "device='gpu': give 'cpu', 'cuda'"),  # was torch's "Expected one of cpu, cuda, ..."
    ("meta", "float32", "device='meta': peaks are measured on 'cpu' or 'cuda'"),
    (5, "float32", "device=5: give 'cpu'"),  # peaks_cache_key(5): "Cannot access accelerator device"
    ("cpu", "bool", "dtype=torch.bool: peaks are measured for a floating-point dtype"),  # addmm's NotImplementedError
    ("cpu", "int8", "dtype=torch.int8: peaks are measured for a floating-point dtype"),  # was measured as a float peak
])
def test_a_device_or_dtype_peaks_cannot_measure_is_refused_by_name(device, dtype, message):
    from minivllm.telemetry.peaks import peaks_cache_key

    with pytest.raises(ValueError, match=re.escape(message)):
        measure_peaks(device, dtype, **TINY)
    with pytest.raises(ValueError, match=re.escape(message)):
        peaks_cache_key(device, dtype)
    if not torch.cuda.is_available():  # an AssertionError "Torch not compiled with CUDA enabled"
        with pytest.raises(ValueError, match="device='cuda': no CUDA device here"):
            measure_peaks("cuda", "float32", **TINY)


def test_read_ceiling_is_the_faster_of_a_sum_and_a_two_stream_dot(monkeypatch):
    """The read bandwidth was torch.sum's alone (one stream): on a 2-core Xeon it read 12-13 GB/s where the
    engine's decode streamed 16, so a memory-bound model's decode showed MBU above 100%. Now the faster of
    the sum and a dot of the two halves, each figure kept in info."""
    import torch

    p = measure_peaks("cpu", "float32", **TINY)
    info = p.info
    assert info["read_method"] in ("sum", "dot") and info["read_sum_s"] > 0 and info["read_dot_s"] > 0
    assert info["read_best_s"] == min(info["read_sum_s"], info["read_dot_s"])
    assert p.read_bytes_per_s == pytest.approx(info["read_bytes"] / info["read_best_s"])
    slow_dot = torch.dot
    monkeypatch.setattr(torch, "dot", lambda a, b, out: (slow_dot(a, b, out=out), __import__("time").sleep(0.01)))
    assert measure_peaks("cpu", "float32", **TINY).info["read_method"] == "sum"  # a slow dot does not count
    one = measure_peaks("cpu", "float32", **{**TINY, "read_bytes": 4})  # one element: no halves to multiply
    assert one.info["read_method"] == "sum" and "read_dot_s" not in one.info


@pytest.mark.parametrize("size", ["matmul_size", "copy_bytes", "read_bytes"])
def test_a_zero_size_is_refused_not_replaced_by_the_default(size):
    """``matmul_size=0`` (a size computed as 0) silently ran the default 1024 (``x or default``),
    though the docstring promises ValueError for a non-positive size."""
    with pytest.raises(ValueError, match="must be positive"):
        measure_peaks("cpu", "float32", **{**TINY, size: 0})


def test_measure_peaks_names_an_argument_of_the_wrong_type():
    """repeats="2" raised "'<' not supported", matmul_size=2.5 a torch randn TypeError, and dtype=5 reached
    .to(5) as a CUDA device index ("Cannot access accelerator device")."""
    import numpy as np

    for kw, match in ((dict(repeats="2"), "repeats='2': must be an int"), (dict(matmul_size=2.5), "matmul_size=2.5"),
                      (dict(read_bytes=True), "read_bytes=True"), (dict(dtype=5), "unknown dtype 5")):
        with pytest.raises(ValueError, match=match):
            measure_peaks("cpu", **{"dtype": "float32", **TINY, **kw})
    assert measure_peaks("cpu", "float32", **{**TINY, "repeats": np.int64(1)}).flops_per_s > 0


def test_peaks_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    first = get_peaks("cpu", "float32", **TINY)
    path = tmp_path / "peaks.json"
    assert path.exists()
    on_disk = json.loads(path.read_text())
    assert len(on_disk) == 1
    (key, entry), = on_disk.items()
    assert "float32" in key and "torch=" in key
    assert entry["flops_per_s"] == first.flops_per_s

    def no_measure(*a, **k):
        raise AssertionError("cached peaks must not be re-measured")

    monkeypatch.setattr(peaks_mod, "measure_peaks", no_measure)
    again = get_peaks("cpu", "float32", **TINY)
    assert again == first and again.info["matmul_size"] == 32
    assert first.provenance == "measured now"
    assert again.provenance == f"cached, measured {first.info['measured_at']}"

    calls = []
    fresh = Peaks(1.0, 2e30, "cpu", "float32", {"source": "measured", "measured_at": "now", "read_method": "dot"}, 3.0)
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda *a, **k: calls.append(1) or fresh)
    # refresh returns this call's figures (never an older one as "measured now") ...
    refreshed = get_peaks("cpu", "float32", refresh=True, **TINY)
    assert calls == [1] and refreshed == fresh and refreshed.provenance == "measured now"
    # ... and the cache keeps the best of old and new per figure (a loaded machine measures low)
    stored = json.loads(path.read_text())[key]
    assert stored["flops_per_s"] == first.flops_per_s and stored["bytes_per_s"] == 2e30
    assert stored["read_bytes_per_s"] == max(first.read_bytes_per_s, 3.0)
    assert get_peaks("cpu", "float32", **TINY).provenance == (
        f"cached, best of several runs: matmul measured {first.info['measured_at']}, copy measured now, "
        f"read measured {'now' if 3.0 > first.read_bytes_per_s else first.info['measured_at']}")
    overwritten = get_peaks("cpu", "float32", refresh=True, keep_best=False, **TINY)
    assert calls == [1, 1] and overwritten.flops_per_s == 1.0
    assert json.loads(path.read_text())[key]["flops_per_s"] == 1.0


def test_cached_best_figures_say_when_each_was_measured(tmp_path, monkeypatch):
    """The cache keeps each figure's best over several runs, but it stored the newest run's measured_at
    beside them: a chapter printed "cached, measured 07:49:48" for a read ceiling 35% above what the run
    of 07:49:48 had read (its figure came from an earlier run). And each merge nested the previous run's
    info inside the next one's."""
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    runs = iter([Peaks(9e9, 1e9, "cpu", "float32", {"source": "measured", "measured_at": "t0", "read_method": "sum"}, 1e9),
                 Peaks(1e9, 9e9, "cpu", "float32", {"source": "measured", "measured_at": "t1", "read_method": "sum"}, 2e9),
                 Peaks(1e9, 1e9, "cpu", "float32", {"source": "measured", "measured_at": "t2", "read_method": "sum"}, 9e9)])
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda *a, **k: next(runs))
    get_peaks("cpu", "float32", refresh=True)
    get_peaks("cpu", "float32", refresh=True)
    cached = get_peaks("cpu", "float32")
    assert (cached.flops_per_s, cached.bytes_per_s, cached.read_bytes_per_s) == (9e9, 9e9, 2e9)
    assert cached.provenance == "cached, best of several runs: matmul measured t0, copy measured t1, read measured t1"
    assert cached.info["measured_at"] == "t1"
    get_peaks("cpu", "float32", refresh=True)
    cached = get_peaks("cpu", "float32")
    assert cached.provenance == "cached, best of several runs: matmul measured t0, copy measured t1, read measured t2"
    assert cached.info["measured_at"] == "t2" and "previous" not in cached.info["previous"]


def test_an_entry_merged_before_figures_kept_their_times_says_by_when(tmp_path, monkeypatch):
    """A cache entry written by the earlier merge (best figures, the newest run's measured_at, no per-figure
    times) was read as all three figures measured at that time; its figures are from then or earlier."""
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    key = peaks_mod.peaks_cache_key("cpu", "float32")
    legacy = Peaks(9e9, 9e9, "cpu", "float32", {"measured_at": "t5", "read_method": "sum", "previous": {}}, 9e9)
    (tmp_path / "peaks.json").write_text(json.dumps({key: legacy.to_dict()}))
    assert get_peaks("cpu", "float32").provenance == "cached, best of several runs, measured by t5"
    new = Peaks(1e9, 1e9, "cpu", "float32", {"source": "measured", "measured_at": "t6", "read_method": "sum"}, 10e9)
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda *a, **k: new)
    get_peaks("cpu", "float32", refresh=True)
    cached = get_peaks("cpu", "float32")
    assert cached.provenance == "cached, best of several runs: matmul measured by t5, copy measured by t5, read measured t6"
    assert cached.info["measured_at"] == "t6"


def test_a_cached_sum_only_read_ceiling_is_measured_again(tmp_path, monkeypatch):
    """Figures cached before the read ceiling became the faster of two reductions (no read_method) kept
    the sum's lower figure, and with it MBU above 100%, on every machine that had run a notebook before."""
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    key = peaks_mod.peaks_cache_key("cpu", "float32")
    old = Peaks(1e9, 1e9, "cpu", "float32", {"measured_at": "2026-12-05T00:00:00Z"}, 1e9)
    (tmp_path / "peaks.json").write_text(json.dumps({key: old.to_dict()}))
    new = Peaks(2e9, 2e9, "cpu", "float32", {"source": "measured", "measured_at": "now", "read_method": "dot"}, 3e9)
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda *a, **k: new)
    got = get_peaks("cpu", "float32")
    assert got == new and got.provenance == "measured now"
    assert get_peaks("cpu", "float32").provenance.startswith("cached") and get_peaks("cpu", "float32").read_bytes_per_s == 3e9


def test_small_buffer_peaks_never_become_the_default_ceiling(tmp_path, monkeypatch):
    """A test's 1 MiB buffers sit in the CPU's caches and read far faster than memory; with
    keep_best they once raised the cached read ceiling of the default sizes (44 GB/s on one core),
    halving every MBU computed against it."""
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    fast = Peaks(1e15, 1e15, "cpu", "float32", {"source": "measured", "measured_at": "t0", "read_method": "sum"}, 1e15)
    slow = Peaks(1e9, 1e9, "cpu", "float32", {"source": "measured", "measured_at": "t1", "read_method": "sum"}, 1e9)
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda *a, **k: fast if k else slow)
    get_peaks("cpu", "float32", refresh=True, **TINY)
    default = get_peaks("cpu", "float32")
    assert default.read_bytes_per_s == 1e9 and default.provenance == "measured now"
    assert get_peaks("cpu", "float32").read_bytes_per_s == 1e9  # cached, and still the memory figure
    assert len(json.loads((tmp_path / "peaks.json").read_text())) == 2


def test_peaks_cache_survives_corrupt_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    (tmp_path / "peaks.json").write_text("{not json")
    p = get_peaks("cpu", "float32", **TINY)
    assert p.flops_per_s > 0
    assert json.loads((tmp_path / "peaks.json").read_text())


@dataclass
class _Metrics:
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    token_times: list = field(default_factory=list)

    @property
    def ttft_ms(self):
        return (self.first_token_time - self.arrival_time) * 1e3

    @property
    def itl_ms(self):
        return [(b - a) * 1e3 for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class _Completion:
    token_ids: list
    finish_reason: str


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list
    outputs: list
    metrics: _Metrics
    num_cached_tokens: int = 0
    finished: bool = True


def _run():
    steps = [
        StepRecord(index=0, start_time=10.0, end_time=10.02, num_prefill_tokens=5,
                   num_decode_tokens=0, num_seqs=1, num_prefill_chunks=1,
                   scheduled=[ScheduledEntry("r0", 5, True, 0, True)], preempted=[], finished=[],
                   kv_blocks_used=1, kv_blocks_free=7, kv_blocks_cached=0,
                   prefix_cache_hit_tokens=0, attention_backend="torch", flops=123.0,
                   extra={"note": "x"}),
        StepRecord(index=1, start_time=10.02, end_time=10.03, num_prefill_tokens=0,
                   num_decode_tokens=1, num_seqs=1, num_prefill_chunks=0,
                   scheduled=[ScheduledEntry("r0", 1, False, 5, True)], preempted=[],
                   finished=["r0"], kv_blocks_used=1, kv_blocks_free=7, kv_blocks_cached=0,
                   prefix_cache_hit_tokens=0, attention_backend="torch"),
    ]
    req = _Request("r0", [1, 2, 3, 4, 5], [_Completion([7, 8], "length")],
                   _Metrics(9.99, 10.0, 10.02, 10.03, [10.02, 10.03]))
    samples = [UtilisationSample(time=10.01, cpu_percent=50.0, per_cpu_percent=[40.0, 60.0],
                                 rss_bytes=1000)]
    return steps, [req], samples


def test_export_json_round_trip(tmp_path):
    steps, reqs, samples = _run()
    data = run_to_json(steps, reqs, samples, meta={"model": "tiny"})
    path = save_run_json(tmp_path / "run.json", steps, reqs, samples, meta={"model": "tiny"})
    loaded = load_run_json(path)
    assert loaded == data
    assert loaded["meta"] == {"model": "tiny"}
    s0 = loaded["steps"][0]
    assert s0["phase"] == "prefill" and s0["wall_ms"] == pytest.approx(20.0)
    assert s0["scheduled"][0] == {"request_id": "r0", "num_tokens": 5, "is_prefill": True,
                                  "first_position": 0, "sampled": True}
    r = loaded["requests"][0]
    assert r["num_prompt_tokens"] == 5 and r["num_output_tokens"] == 2
    assert r["ttft_ms"] == pytest.approx(30.0) and r["itl_ms"] == [pytest.approx(10.0)]
    assert r["tpot_ms"] is None  # not provided by this metrics object
    assert loaded["samples"][0]["per_cpu_percent"] == [40.0, 60.0]
    with pytest.raises(ValueError, match="run export"):
        (tmp_path / "bad.json").write_text("[]")
        load_run_json(tmp_path / "bad.json")


def test_export_dataframes_columns(tmp_path):
    pytest.importorskip("pandas")
    steps, reqs, samples = _run()
    dfs = run_to_dataframes(steps, reqs, samples)
    assert set(dfs) == {"steps", "scheduled", "requests", "samples"}
    st = dfs["steps"]
    assert list(st["phase"]) == ["prefill", "decode"]
    assert list(st["num_finished"]) == [0, 1]
    for col in ("wall_ms", "num_prefill_tokens", "kv_blocks_used", "model_ms", "flops", "mfu",
                "extra.note"):
        assert col in st.columns
    assert list(dfs["scheduled"]["step"]) == [0, 1]
    assert list(dfs["scheduled"]["is_prefill"]) == [True, False]
    rq = dfs["requests"]
    for col in ("request_id", "ttft_ms", "e2e_ms", "queue_ms", "num_output_tokens"):
        assert col in rq.columns
    sm = dfs["samples"]
    assert list(sm["cpu1_percent"]) == [60.0]
    # from the JSON file: same frames
    path = save_run_json(tmp_path / "run.json", steps, reqs, samples)
    again = run_to_dataframes(**load_run_json(path))
    assert again["steps"].equals(st)
    empty = run_to_dataframes()
    assert "wall_ms" in empty["steps"].columns and len(empty["steps"]) == 0


class _FakeNVML:
    """Stands in for ``pynvml`` so the GPU sampling path runs without a GPU."""

    NVML_CLOCK_SM = 1

    def __init__(self):
        self.calls = []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("handle", uuid)

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 87, "memory": 41})()

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"used": 5 << 30})()

    def nvmlDeviceGetPowerUsage(self, h):
        return 312_500  # milliwatts

    def nvmlDeviceGetClockInfo(self, h, which):
        assert which == self.NVML_CLOCK_SM
        return 1980


def test_sampler_nvml_path_with_fake_library(monkeypatch):
    import sys

    fake = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = UtilisationSampler(period_s=0.02, device="cuda:0")
    with s:
        _busy(0.05)
    assert s.nvml_error is None
    assert fake.calls[0] == "init" and fake.calls[-1] == "shutdown"
    x = s.samples[-1]
    assert x.gpu_util_percent == 87.0 and x.mem_util_percent == 41.0
    assert x.mem_used_bytes == 5 << 30 and x.power_w == 312.5 and x.sm_clock_mhz == 1980.0


def test_sampler_without_nvml_reports_why(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    s = UtilisationSampler(period_s=0.02, device="cuda")
    with s:
        pass
    assert "NVML unavailable" in s.nvml_error
    assert s.samples and s.samples[-1].gpu_util_percent is None


def test_step_record_field_order_the_engine_relies_on():
    """``LLMEngine._record`` builds StepRecord positionally (keywords cost ~0.9 us a step):
    reordering or inserting a field before these must update that call."""
    from dataclasses import fields

    assert [f.name for f in fields(StepRecord)][:22] == [
        "index", "start_time", "end_time", "num_prefill_tokens", "num_decode_tokens", "num_seqs",
        "num_prefill_chunks", "scheduled", "preempted", "finished", "kv_blocks_used", "kv_blocks_free",
        "kv_blocks_cached", "prefix_cache_hit_tokens", "attention_backend", "schedule_ms", "prepare_ms",
        "model_ms", "sample_ms", "postprocess_ms", "num_draft_tokens", "num_accepted_draft_tokens"]


def test_engine_step_records_carry_each_value_in_its_field(tiny_ckpt):
    from helpers_engine import greedy, make_llm, prompts_of

    llm = make_llm(tiny_ckpt, num_kvcache_blocks=64)
    engine = llm.llm_engine
    for i, p in enumerate(prompts_of([5, 9], seed=4)):
        engine.add_request(f"r{i}", p, greedy(3))
    records = []
    while engine.has_unfinished_requests():
        engine.step()
        records.append(engine.last_step_record)
    bm = engine.block_manager
    assert [r.index for r in records] == list(range(records[0].index, records[0].index + len(records)))
    assert records[0].num_prefill_tokens == 14 and records[0].num_decode_tokens == 0
    assert records[0].num_seqs == 2 and records[0].num_prefill_chunks == 2
    assert records[1].num_decode_tokens == 2 and records[1].num_prefill_chunks == 0
    assert records[-1].finished == ["r0", "r1"] and records[0].preempted == []
    assert records[-1].kv_blocks_free == bm.num_free_blocks != records[-1].kv_blocks_used
    for r in records:
        assert r.start_time <= r.end_time and r.attention_backend == engine.config.attention_backend
        assert r.kv_blocks_used + r.kv_blocks_free == bm.num_blocks and r.kv_blocks_cached >= 0
        assert r.prefix_cache_hit_tokens == 0 and r.num_draft_tokens == r.num_accepted_draft_tokens == 0
        assert all(isinstance(getattr(r, k), float) for k in ("schedule_ms", "prepare_ms", "model_ms",
                                                                   "sample_ms", "postprocess_ms"))
        assert r.model_ms > 0 and r.flops > 0


def test_a_merge_that_keeps_one_runs_figures_says_that_runs_time(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    runs = iter([Peaks(9e9, 9e9, "cpu", "float32", {"source": "measured", "measured_at": "t0", "read_method": "sum"}, 9e9),
                 Peaks(1e9, 1e9, "cpu", "float32", {"source": "measured", "measured_at": "t1", "read_method": "sum"}, 1e9)])
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda *a, **k: next(runs))
    get_peaks("cpu", "float32", refresh=True)
    assert get_peaks("cpu", "float32", refresh=True).provenance == "measured now"  # this call's own, lower figures
    assert get_peaks("cpu", "float32").provenance == "cached, measured t0"


def test_a_damaged_figure_times_entry_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    key = peaks_mod.peaks_cache_key("cpu", "float32")
    bad = Peaks(9e9, 9e9, "cpu", "float32", {"measured_at": "t0", "read_method": "sum",
                                              "figures_measured_at": {"matmul": "t0"}}, 9e9)
    (tmp_path / "peaks.json").write_text(json.dumps({key: bad.to_dict()}))
    new = Peaks(1e9, 1e9, "cpu", "float32", {"source": "measured", "measured_at": "t1", "read_method": "sum"}, 1e9)
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda *a, **k: new)
    assert get_peaks("cpu", "float32").provenance == "measured now"  # a KeyError in the merge before
    assert get_peaks("cpu", "float32").provenance == "cached, measured t1"


def test_an_interrupted_peaks_measurement_frees_its_buffers(monkeypatch):
    """An interrupt's traceback (IPython keeps the last one) holds measure_peaks' frame: its 1 GiB
    read buffer stayed allocated (RSS 1250 MiB against 226 once the traceback was dropped)."""
    real = peaks_mod._timer

    def timer(dev):
        time_it, calls = real(dev), []

        def interrupted_on_the_read(fn):
            calls.append(fn.__name__)
            if fn.__name__ == "rd_sum":
                raise KeyboardInterrupt
            return time_it(fn)

        return interrupted_on_the_read

    monkeypatch.setattr(peaks_mod, "_timer", timer)
    with pytest.raises(KeyboardInterrupt) as caught:
        measure_peaks("cpu", "float32", **TINY)
    tb, frames = caught.value.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    frame = next(f for f in frames if f.f_code.co_name == "measure_peaks")
    held = {name: frame.f_locals[name] for name in ("a", "b", "out", "src", "dst", "big", "first", "second")}
    assert all(v is None for v in held.values()), {k: type(v) for k, v in held.items()}


def test_an_interrupted_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))

    def interrupted_dump(*args, **kwargs):
        raise KeyboardInterrupt  # mid-write

    monkeypatch.setattr(peaks_mod.json, "dump", interrupted_dump)
    with pytest.raises(KeyboardInterrupt):
        get_peaks("cpu", "float32", **TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_interrupt_as_the_profiler_starts_leaves_it_off(tmp_path, monkeypatch):
    """torch enables its profiler inside profile.start(): an interrupt after that left it on with no
    handle, and every later start_profile refused ("a torch profiler is already running")."""
    from minivllm.telemetry.profiler import TorchProfile

    real_start = torch.profiler.profile.start

    def start_then_interrupt(self):
        real_start(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.profiler.profile, "start", start_then_interrupt)
    prof = TorchProfile(device=torch.device("cpu"), config={"torch_profiler_dir": str(tmp_path)})
    with pytest.raises(KeyboardInterrupt):
        prof.start()
    assert not torch.autograd._profiler_enabled()
