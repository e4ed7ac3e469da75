"""The pure-Python parts of scripts/gpu_check.py (the GPU parts run only on a GPU box)."""
from __future__ import annotations

import importlib.util
import json
import os
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
    assert all(0 <= t <= 10000 for p, _ in work for t in p)  # nano-vllm's randint(0, 10000)
    assert work == script.nanovllm_workload(256, seed=0)  # reproducible
    # nano-vllm's own requests: its README's 133,966 output tokens (the script drew a workload of its own)
    assert sum(len(p) for p, _ in work) == 142827 and sum(o for _, o in work) == 133966
    assert script.fmt_ms(None) == "n/a" and script.fmt_ms(1.23456) == "1.235 ms"


def test_nvml_rows_summarise_samples(script):
    assert script.nvml_rows(None)[0].status == "skip"
    samples = [{"gpu_util_percent": 50.0, "mem_util_percent": None, "power_w": 300.0,
                "mem_used_bytes": 2**31},
               {"gpu_util_percent": 100.0, "mem_util_percent": None, "power_w": 500.0,
                "mem_used_bytes": 2**32}]
    rows = {r.check.split(" (")[0]: r for r in script.nvml_rows(samples)}
    assert rows["GPU busy %"].data == {"mean": 75.0, "max": 100.0}
    assert rows["memory used GiB"].data == {"mean": 3.0, "max": 4.0}
    assert "memory busy %" not in rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole check")
def test_script_refuses_to_run_without_cuda():
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "no CUDA device" in res.stderr


def test_parse_args_out_defaults_to_dollar_out_and_faults(script, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert script.parse_args([]).out == tmp_path / "gpu_check.json"
    monkeypatch.delenv("OUT")
    assert script.parse_args([]).out == Path.cwd() / "gpu_check.json"
    a = script.parse_args(["--smoke", "--inject-fault", "tpot=abort"])
    assert a.faults == {"tpot": "abort"} and a.model == script.SMOKE_MODEL
    for bad in (["--inject-fault", "tpot"], ["--inject-fault", "nope=abort"], ["--budget-s", "0"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)


def test_a_relative_out_is_where_the_sections_write_it(script, tmp_path, monkeypatch):
    """The sections run in the repository's directory: a relative --out (or $OUT) had them write
    their rows under the repository while the run read them from its own directory, found none,
    and passed with an empty table."""
    monkeypatch.chdir(tmp_path)
    assert script.parse_args(["--out", "sub/gc.json"]).out == tmp_path / "sub" / "gc.json"
    monkeypatch.setenv("OUT", "results")
    assert script.parse_args([]).out == tmp_path / "results" / "gpu_check.json"


@pytest.mark.parametrize("worker", ["pass", "import json, sys; open(sys.argv[1], 'w').write(json.dumps("
                                              "{'rows': [], 'environment': {}}))"])
def test_a_section_that_writes_no_rows_is_an_error(script, tmp_path, monkeypatch, worker):
    """No rows file, or (as a worker writes one when it starts) an empty one: nothing was checked."""
    monkeypatch.setattr(script, "_worker_argv", lambda args, name, rows_path: [sys.executable, "-c", worker,
                                                                                str(rows_path)])
    args = script.parse_args(["--smoke", "--sections", "kernels", "--out", str(tmp_path / "gc.json")])
    assert script.run_sections(args) == 1
    payload = json.loads((tmp_path / "gc.json").read_text())
    sec = payload["sections"]["kernels"]
    assert sec["status"] == "error" and "no rows" in sec["error"], sec
    assert payload["rows"][-1]["status"] == "error"


def test_near_tie_agreement(script):
    a = torch.tensor([[1.0, 0.999, -5.0], [3.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    b = torch.tensor([[0.999, 1.0, -5.0], [0.0, 3.0, 0.0], [0.0, 2.0, 0.0]])
    # row 0: a near-tie swapped (agrees), row 1: a real disagreement, row 2: same argmax
    assert script.near_tie_agreement(a, b, 2e-2) == (2, 3)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole check")
def test_smoke_run_of_every_section_survives_a_fault_in_one(tmp_path):
    """The CI dry run: every section in smoke mode, with the process of one section killed
    by SIGABRT (as a sticky CUDA fault would end it) after its first row. That row and
    every other section's rows must be in the JSON."""
    out = tmp_path / "gc.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SCRIPT.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("OUT", None)
    res = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out),
                          "--inject-fault", "prefill=abort", "--inject-fault", "embedded=raise"],
                         capture_output=True, text=True, env=env, timeout=900)
    payload = json.loads(out.read_text())
    assert res.returncode == 1, res.stdout[-3000:]
    assert payload["complete"] and payload["schema"] == 2
    secs = payload["sections"]
    assert secs["prefill"]["status"] == "error" and secs["prefill"]["returncode"] == -6
    assert "SIGABRT" in secs["prefill"]["error"]
    assert secs["embedded"]["status"] == "error" and secs["embedded"]["returncode"] == 1
    others = [s for s in script_sections() if s not in ("prefill", "embedded")]
    bad = {s: (secs[s]["status"], secs[s]["error"]) for s in others if secs[s]["status"] != "ok"}
    assert not bad, bad
    by_section: dict[str, list[dict]] = {}
    for r in payload["rows"]:
        by_section.setdefault(r["section"], []).append(r)
    for s in others:  # every other section's checks came back, none failed
        assert by_section.get(s), s
        assert not [r for r in by_section[s] if r["status"] in ("fail", "error")], by_section[s]
    # the faulted sections kept the row they made before the fault, plus an error row
    for s in ("prefill", "embedded"):
        assert [r["status"] for r in by_section[s]][-1] == "error"
        assert len(by_section[s]) == 2
    log = (tmp_path / "gc.log").read_text()  # one log: a device run returns at most 8 files
    assert all(f"===== section {s} =====" in log for s in script_sections())
    assert not list(tmp_path.glob("gc.*.log"))


def test_graph_expectations_allow_replays_once_a_big_batch_shrinks(script):
    """Batch 300 above the top bucket (256): 256 prompts prefill in one step, 44 in the next, so the last
    44 decode alone for a step by graph replay; that was counted a failure of the eager fallback."""
    assert script.graphs_as_expected({"graph_replays": 1, "eager_decode_steps": 14}, want_graphs=False)
    assert not script.graphs_as_expected({"graph_replays": 15, "eager_decode_steps": 0}, want_graphs=False)
    assert script.graphs_as_expected({"graph_replays": 15, "eager_decode_steps": 0}, want_graphs=True)
    assert not script.graphs_as_expected({"graph_replays": 14, "eager_decode_steps": 1}, want_graphs=True)


def _hanging_kernels_section(tmp_path, *limits: str):
    """The smoke run's kernels section made to hang, under ``limits``: (process, JSON payload)."""
    out = tmp_path / "gc.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SCRIPT.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--sections", "kernels",
                          "--inject-fault", "kernels=hang", *limits],
                         capture_output=True, text=True, env=env, timeout=300)
    return res, json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole check")
def test_a_hanging_section_is_killed_and_recorded(tmp_path):
    res, payload = _hanging_kernels_section(tmp_path, "--section-timeout-s", "12")
    assert res.returncode == 1
    sec = payload["sections"]["kernels"]
    assert sec["status"] == "error" and sec["returncode"] is None and "out of time" in sec["error"]
    assert payload["complete"] and payload["rows"][-1]["status"] == "error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole check")
def test_a_section_the_run_budget_cuts_is_skipped_not_an_error(tmp_path):
    """A section still running when the run's budget ends was reported as an error (exit status 1)
    though nothing failed; its own timeout (a hang) stays an error (the test above)."""
    res, payload = _hanging_kernels_section(tmp_path, "--budget-s", "21")
    sec = payload["sections"]["kernels"]
    assert sec["status"] == "skipped" and "run budget" in sec["error"], sec
    assert res.returncode == 0 and payload["rows"][-1]["status"] == "skip", res.stdout[-2000:]


def script_sections():
    spec = importlib.util.spec_from_file_location("gpu_check_sections", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check_sections"] = mod
    try:
        spec.loader.exec_module(mod)
        return mod.SECTIONS
    finally:
        sys.modules.pop("gpu_check_sections", None)
