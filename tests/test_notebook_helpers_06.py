"""Course notebooks 06 (prefill vs decode) and 07 (latency): conventions and coverage of the chapters.

Fast checks on the chapters' sources (``notebooks/06_prefill_vs_decode.py``,
``notebooks/07_latency.py``, jupytext-paired with their ``.ipynb``; tests/test_notebooks.py checks
each pair holds the same cells) and on the stored notebooks (nothing is executed here;
``pytest --nbval-lax notebooks/06_prefill_vs_decode.ipynb notebooks/07_latency.ipynb`` executes them).
Chapter 07 was split from chapter 06 (issue 14): 06 keeps the phases, the roofline and the decode
levers, 07 holds TTFT/TPOT, the latency calculator and chunked prefill.
"""
from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest

from helpers_notebooks import executed_code_cells, stream_text

ROOT = Path(__file__).resolve().parent.parent
CH06 = ROOT / "notebooks" / "06_prefill_vs_decode.ipynb"
CH07 = ROOT / "notebooks" / "07_latency.ipynb"
TIMING = re.compile(r"wall_ms|ttft_ms|tpot_ms|itl_ms|perf_counter|seconds|_ms\b|time\.")


def _source(ipynb: Path):
    return jupytext.read(ipynb.with_suffix(".py"))


def _code(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


def _text(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.parametrize("ipynb", [CH06, CH07], ids=lambda p: p.stem)
def test_conventions(ipynb):
    built = _source(ipynb)
    code = [c for c in built.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    assert 'os.environ.get("MINIVLLM_MODEL")' in params[0].source and 'DEVICE = "auto"' in params[0].source
    assert any("print(describe(" in c.source for c in code)
    assert "Quiz(" in code[-1].source
    assert built.cells[-1].cell_type == "markdown" and built.cells[-1].source.startswith("## You can now")
    assert "**Map of this chapter**" in built.cells[0].source


def test_chapter_06_elements_are_measured():
    """Issue 7/13/14, chapter 06: the hand count timed, the stepper, roofline on measured peaks
    (read bandwidth) from StepRecords, MFU/MBU, the side-by-side table, throughput vs batch, the
    weight-read floor with sourced GPU figures, and the three decode levers measured."""
    built = _source(CH06)
    src, text = _code(built), _text(built)
    for needle in ("measure_peaks(refresh=True)", "mbu_bytes_per_s", "r.flops", "r.bytes_moved", "r.mfu", "r.mbu",
                   "random:qwen3-0.6b", "EngineStepper(", "KVCacheView(", "hand_count(", "torch.nn.functional.linear",
                   'quantization="int8"', "speculative_config=SPEC", '"method": "ngram"', "tokens/s",
                   "NVIDIA H100 data sheet", "NVIDIA H200 data sheet"):
        assert needle in src, needle
    assert "## 5. Myths" in text and "## 6. Why it matters" in text
    # the roofline and every memory floor use the read bandwidth, as MBU does
    assert "peaks.bytes_per_s" not in src.replace("peaks.bytes_per_s / 1e9", "")


def test_chapter_07_elements_are_measured():
    """Chapter 07: per-request TTFT/TPOT from RequestOutput.metrics, the latency calculator,
    chunked prefill with and without, the enforce_eager myth."""
    built = _source(CH07)
    src, text = _code(built), _text(built)
    for needle in ("LatencyCalculator(", "ChunkedPrefillDemo", ".metrics", "enforce_eager=True",
                   "enable_chunked_prefill=False", "tokens/s", "itl_around_long_prompt"):
        assert needle in src, needle
    assert "## 4. Myths" in text
    assert "check_ms" not in src  # TTFT + (n-1) x TPOT is an identity, not a check


@pytest.mark.parametrize("ipynb", [CH06, CH07], ids=lambda p: p.stem)
def test_checked_cells_print_no_timings(ipynb):
    built = _source(ipynb)
    checked = [c for c in built.cells if c.cell_type == "code" and c.source.startswith("# NBVAL_CHECK_OUTPUT")]
    assert len(checked) >= 3
    for cell in checked:
        prints = "\n".join(line for line in cell.source.splitlines() if "print(" in line or "f\"" in line)
        assert not TIMING.search(prints), f"checked cell prints a timing:\n{cell.source}"


@pytest.mark.parametrize("ipynb", [CH06, CH07], ids=lambda p: p.stem)
def test_stored_outputs_are_real_and_small(ipynb):
    code = executed_code_cells(ipynb)
    streams = stream_text(code)
    assert "machine:" in streams and "device" in streams
    # every chart has a static rendering for viewers without JavaScript (chapter 07's charts live in widgets)
    plotly = [o for c in code for o in c.outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert all("image/png" in o["data"] for o in plotly)
    if ipynb == CH06:
        assert len(plotly) >= 3
