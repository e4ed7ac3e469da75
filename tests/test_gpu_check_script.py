"""The pure-Python parts of scripts/gpu_check.py (the GPU parts run only on a GPU box)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("gpu_check", None)


def test_parse_args_defaults_and_errors(script, tmp_path):
    a = script.parse_args([])
    assert a.scale == 1.0 and a.sections == list(script.SECTIONS) and a.device == "cuda"
    a = script.parse_args(["--scale", "0.25", "--sections", "tpot,kernels", "--out", str(tmp_path / "x.json")])
    assert a.scale == 0.25 and a.sections == ["kernels", "tpot"]  # run in the fixed order
    assert script.parse_args(["--smoke"]).device == "cpu"
    for bad in (["--scale", "0"], ["--sections", "kernels,nope"], ["--hf-batch", "0"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)


def test_format_table_aligns_columns(script):
    rows = [script.Row("kernels", "decode fp32 max abs err", "1.2e-07", "<= 1e-4", "pass"),
            script.Row("tpot", "batch 1 cuda graphs", "1.234 ms", "<= 1.5 ms", "fail")]
    text = script.format_table(rows)
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1  # every line the same width
    assert "PASS" in lines[3] and "FAIL" in lines[4] and "section" in lines[1]


def test_nanovllm_workload_shape(script):
    work = script.nanovllm_workload(256, seed=0)
    assert len(work) == 256
    assert all(100 <= len(p) <= 1024 and 100 <= o <= 1024 for p, o in work)
    assert all(0 <= t < 10000 for p, _ in work for t in p)
    assert work == script.nanovllm_workload(256, seed=0)  # reproducible
    assert script.fmt_ms(None) == "n/a" and script.fmt_ms(1.23456) == "1.235 ms"


def test_nvml_rows_summarise_samples(script):
    assert script.nvml_rows(None)[0].status == "skip"
    samples = [{"gpu_util_percent": 50.0, "mem_util_percent": None, "power_w": 300.0,
                "mem_used_bytes": 2**31},
               {"gpu_util_percent": 100.0, "mem_util_percent": None, "power_w": 500.0,
                "mem_used_bytes": 2**32}]
    rows = {r.check.split(" (")[0]: r for r in script.nvml_rows(samples)}
    assert rows["SM busy %"].data == {"mean": 75.0, "max": 100.0}
    assert rows["memory used GiB"].data == {"mean": 3.0, "max": 4.0}
    assert "memory busy %" not in rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole check")
def test_script_refuses_to_run_without_cuda():
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "no CUDA device" in res.stderr
