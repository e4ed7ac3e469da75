"""Course notebooks 05 (scheduler), 08 (prefix caching) and 09 (sampling): conventions.

Fast checks on the chapters' sources (``notebooks/NN_name.py``, jupytext-paired with the ``.ipynb``;
tests/test_notebooks.py checks each pair holds the same cells) and the stored notebooks (nothing is
executed here; ``pytest --nbval-lax notebooks/`` executes them):

* the parameters cell reads ``MINIVLLM_MODEL`` and sets ``DEVICE = "auto"``; the run prints
  ``describe(...)``; a widget from ``widgets`` is used live; the notebook ends with a quiz and
  a recap (takeaways, or "You can now");
* checked cells (``# NBVAL_CHECK_OUTPUT``) never print timings, and every stored output is from a
  real run (no error outputs) in a file of at most 1 MB.
"""
from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest

from helpers_notebooks import executed_code_cells, stream_text

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = {"05": "05_scheduler", "08": "08_prefix_caching", "09": "09_sampling"}
WIDGETS = {"05": "SchedulerTimeline", "08": "PrefixCacheView", "09": "SamplingExplorer"}
TIMING = re.compile(r"wall_ms|ttft_ms|perf_counter|seconds|_ms\b|time\.")


@pytest.fixture(params=sorted(CHAPTERS), ids=lambda n: CHAPTERS[n])
def chapter(request):
    """``(number, the cells of notebooks/NN_name.py, notebooks/NN_name.ipynb)``."""
    num = request.param
    path = ROOT / "notebooks" / f"{CHAPTERS[num]}.ipynb"
    return num, jupytext.read(path.with_suffix(".py")), path


def test_conventions(chapter):
    num, nb, _ = chapter
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    assert 'os.environ.get("MINIVLLM_MODEL")' in params[0].source and 'DEVICE = "auto"' in params[0].source
    assert any("print(describe(" in c.source for c in code)
    assert any("from widgets import" in c.source and WIDGETS[num] in c.source for c in code)
    assert "Quiz(" in code[-1].source
    # The closing recap: "## Takeaways" before the course conventions, "## You can now" after (issue 14).
    assert nb.cells[-1].cell_type == "markdown" and nb.cells[-1].source.startswith(("## Takeaways", "## You can now"))


def test_checked_cells_print_no_timings(chapter):
    _, nb, _ = chapter
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("# NBVAL_CHECK_OUTPUT"):
            prints = "\n".join(line for line in cell.source.splitlines() if "print(" in line or "f\"" in line)
            assert not TIMING.search(prints), f"checked cell prints a timing:\n{cell.source}"


def test_stored_outputs_are_real_and_small(chapter):
    _, _, path = chapter
    first_output = stream_text(executed_code_cells(path))
    assert "machine:" in first_output and "device:" in first_output
