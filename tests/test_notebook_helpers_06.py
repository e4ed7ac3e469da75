"""Course notebook 06 (prefill vs decode): conventions and coverage of the chapter.

Fast checks on the chapter's source (``notebooks/06_prefill_vs_decode.py``, jupytext-paired with the
``.ipynb``; tests/test_notebooks.py checks the pair holds the same cells) and on the stored notebook
(nothing is executed here; ``pytest --nbval-lax notebooks/06_prefill_vs_decode.ipynb`` executes it).
"""
from __future__ import annotations

import re
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "06_prefill_vs_decode.ipynb"
SOURCE = NOTEBOOK.with_suffix(".py")
TIMING = re.compile(r"wall_ms|ttft_ms|tpot_ms|perf_counter|seconds|_ms\b|time\.")


@pytest.fixture(scope="module")
def built():
    """The chapter's cells as its source file holds them."""
    return jupytext.read(SOURCE)


def test_conventions(built):
    code = [c for c in built.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    assert 'os.environ.get("MINIVLLM_MODEL")' in params[0].source and 'DEVICE = "auto"' in params[0].source
    assert any("print(describe(" in c.source for c in code)
    assert any("EngineStepper(" in c.source for c in code)
    assert "Quiz(" in code[-1].source
    assert built.cells[-1].cell_type == "markdown" and built.cells[-1].source.startswith("## Takeaways")


def test_chapter_elements_are_measured(built):
    """Issue 7, chapter 6: roofline on measured peaks from StepRecords, MFU/MBU, throughput vs batch,
    per-request TTFT/TPOT, chunked prefill, the latency calculator, the myths section."""
    src = "\n".join(c.source for c in built.cells if c.cell_type == "code")
    text = "\n".join(c.source for c in built.cells if c.cell_type == "markdown")
    for needle in ("measure_peaks(refresh=True)", "r.flops", "r.bytes_moved", "r.mfu", "r.mbu", "random:qwen3-0.6b",
                   "LatencyCalculator(", "ChunkedPrefillDemo", ".metrics", "enforce_eager=True",
                   "enable_chunked_prefill=False", "tokens/s"):
        assert needle in src, needle
    assert "## 6. Myths" in text


def test_checked_cells_print_no_timings(built):
    checked = [c for c in built.cells if c.cell_type == "code" and c.source.startswith("# NBVAL_CHECK_OUTPUT")]
    assert len(checked) >= 5
    for cell in checked:
        prints = "\n".join(line for line in cell.source.splitlines() if "print(" in line or "f\"" in line)
        assert not TIMING.search(prints), f"checked cell prints a timing:\n{cell.source}"


def test_stored_outputs_are_real_and_small():
    assert NOTEBOOK.stat().st_size <= 1_000_000
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "notebook stored without executing"
    for c in code:
        assert not [o for o in c.outputs if o.output_type == "error"], c.source[:80]
    streams = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "machine:" in streams and "device:" in streams
    # every chart has a static rendering for viewers without JavaScript
    plotly = [o for c in code for o in c.outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert plotly and all("image/png" in o["data"] for o in plotly)
