"""Every course notebook is one source in two files, and a saved notebook stays small.

* ``notebooks/NN_name.py`` (jupytext percent format: what you edit and review) and
  ``notebooks/NN_name.ipynb`` (the same cells with the outputs of the last run) hold the same
  cells, checked with jupytext's own comparison; no builder script generates them any more.
* pytest collects the ``.ipynb`` (nbval) and never the paired ``.py`` as test modules.
* A widget-heavy notebook executed and saved *with* its widget state (what JupyterLab's save or
  ``jupyter nbconvert --execute`` store) stays under 2 MB: live charts do not embed plotly.js.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupytext.compare import NotebookDifference, compare_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SAVED_LIMIT = 2_000_000  # bytes


def test_the_course_is_there():
    assert len(NOTEBOOKS) >= 11
    assert not list((ROOT / "scripts").glob("build_notebook_*.py")), "notebooks are edited, not generated"


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_paired_script_holds_the_same_cells(ipynb):
    py = ipynb.with_suffix(".py")
    assert py.is_file(), f"{py.name} missing: jupytext --set-formats ipynb,py:percent {ipynb.relative_to(ROOT)}"
    stored = nbformat.read(ipynb, as_version=4)
    assert stored.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent"
    try:
        compare_notebooks(jupytext.read(py), jupytext.read(ipynb), fmt="py:percent")
    except NotebookDifference as e:
        pytest.fail(f"{py.name} and {ipynb.name} differ (run jupytext --sync {py.relative_to(ROOT)}):\n{e}")


def test_the_pairing_check_sees_an_edit():
    """The comparison above is not vacuous: one changed line in the script is a difference."""
    ipynb = NOTEBOOKS[0]
    edited = jupytext.read(ipynb.with_suffix(".py"))
    cell = next(c for c in edited.cells if c.cell_type == "code")
    cell.source += "\nprint('edited in the .py only')"
    with pytest.raises(NotebookDifference):
        compare_notebooks(edited, jupytext.read(ipynb), fmt="py:percent")


LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[", re.M)  # minivllm/logger.py


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_hold_no_engine_log_lines(ipynb):
    """minivllm logs at INFO by default; a chapter quiets it before importing minivllm, and
    scripts/execute_notebook.py runs the kernel with MINIVLLM_LOGGING_LEVEL=WARNING."""
    nb = nbformat.read(ipynb, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    src = params[0].source
    assert 'os.environ.setdefault("MINIVLLM_LOGGING_LEVEL", "WARNING")' in src
    assert src.index("MINIVLLM_LOGGING_LEVEL") < src.index("from minivllm")
    streams = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                      if o.output_type == "stream")
    assert not LOG_LINE.search(streams), LOG_LINE.search(streams).group(0)


def test_paired_scripts_are_not_collected_as_tests():
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--nbval-lax", "-p", "no:cacheprovider",
                          "notebooks/"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    items = [ln for ln in res.stdout.splitlines() if "::" in ln]
    assert items and all(ln.split("::")[0].endswith(".ipynb") for ln in items), res.stdout[-3000:]
    assert {ln.split("::")[0] for ln in items} == {f"notebooks/{p.name}" for p in NOTEBOOKS}


@pytest.mark.slow
def test_notebook_saved_with_widget_state_is_small(tmp_path):
    """Execute chapter 07 (the latency calculator and the chunked-prefill demo, two live charts, and the
    quiz; before chapter 06 was split, these and the engine stepper made 15.7 MB when the charts were
    plotly FigureWidgets) with nbclient, store the widget state, save it: under 2 MB. Chapter 07 holds
    the most live charts of any chapter since the split (06 keeps one, in the stepper)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import execute_notebook
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    src = ROOT / "notebooks" / "07_latency.ipynb"
    for suffix in (".py", ".ipynb"):
        shutil.copy(src.with_suffix(suffix), tmp_path / src.with_suffix(suffix).name)
    saved = tmp_path / src.name
    env = {k: os.environ.get(k) for k in execute_notebook.KERNEL_ENV}
    try:
        nb = execute_notebook.execute(saved, timeout=900, store_widget_state=True)
    finally:
        for k, v in env.items():  # execute() sets the kernel's defaults in this process's environment
            if v is None:
                os.environ.pop(k, None)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    charts = [m for m in state.values() if m["model_name"] == "OutputModel"
              and any("application/vnd.plotly.v1+json" in o.get("data", {}) for o in m["state"].get("outputs", []))]
    assert len(charts) >= 2, "the live charts are stored with the widget state"
    biggest = max(len(json.dumps(m)) for m in state.values())
    assert biggest < 200_000, f"a widget model of {biggest} bytes (a JavaScript bundle?)"
    print(f"saved with widget state: {saved.stat().st_size / 1e6:.2f} MB, {len(state)} widget models, "
          f"{len(charts)} live charts")
    assert saved.stat().st_size < SAVED_LIMIT, f"{saved.stat().st_size / 1e6:.1f} MB saved"
