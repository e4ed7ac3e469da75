"""A notebook run under nbval (helpers_nbval) or by scripts/execute_notebook.py leaves nothing in the
temporary directory."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

CELL = """\
import atexit
import time
import plotly.graph_objects as go
from widgets._static import figure_png
png = figure_png(go.Figure(go.Bar(x=[1, 2], y=[3, 4])))
assert png, "no PNG: kaleido did not start"
# a kernel slow to exit (more than jupyter_client's default 2.5 s before SIGTERM): this handler runs
# before kaleido's (last registered, first run)
atexit.register(time.sleep, 4)
"""

CONFTEST = f"""\
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers_nbval import shut_kernels_down_gracefully
assert shut_kernels_down_gracefully()
"""


@pytest.mark.slow
def test_a_notebook_kernel_stopped_by_nbval_leaves_no_temporary_files(tmp_path):
    pytest.importorskip("nbval")
    pytest.importorskip("kaleido")
    from widgets._static import find_chrome

    if find_chrome() is None:
        pytest.skip("no Chrome/Chromium for kaleido")
    work = tmp_path / "work"
    work.mkdir()
    # a short path: Chromium cannot start under a long one (its sockets' paths have a length limit)
    tmp = Path(tempfile.mkdtemp(prefix="mv-"))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nbformat.write(nb, work / "chart.ipynb")
    (work / "conftest.py").write_text(CONFTEST)
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                              "chart.ipynb"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
        # kaleido's Chromium profile and page directories: left behind when nbval killed the kernel
        assert sorted(p.name for p in tmp.iterdir()) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_a_notebook_run_by_execute_notebook_leaves_no_temporary_files(tmp_path):
    """scripts/execute_notebook.py's kernel had jupyter_client's 5 s to exit (SIGTERM after 2.5 s): chapter
    10's left kaleido's two directories in /tmp at every run. (Chromium's own ``.org.chromium.Chromium.*``
    scratch directory is left now and then when kaleido's exit handler has to kill the browser: not these.)"""
    pytest.importorskip("kaleido")
    from widgets._static import find_chrome

    if find_chrome() is None:
        pytest.skip("no Chrome/Chromium for kaleido")
    tmp = Path(tempfile.mkdtemp(prefix="mv-"))  # short: Chromium's socket paths have a length limit
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nbformat.write(nb, tmp_path / "chart.ipynb")
    env = dict(os.environ, TMPDIR=str(tmp))
    try:
        res = subprocess.run([sys.executable, "scripts/execute_notebook.py", str(tmp_path / "chart.ipynb")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
        # kaleido's Chromium profile (a directory with Default/) and its page (a directory with index.html)
        assert [p.name for p in tmp.iterdir() if (p / "Default").exists() or (p / "index.html").exists()] == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_course_notebooks_conftest_installs_it():
    """``pytest --nbval-lax notebooks/`` loads notebooks/conftest.py alone (not tests/conftest.py):
    the graceful stop must come from there."""
    pytest.importorskip("nbval")
    code = ("import runpy; runpy.run_path('notebooks/conftest.py'); "
            "from nbval.kernel import RunningKernel; print('GRACEFUL', getattr(RunningKernel.stop, '_graceful', False))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "GRACEFUL True" in res.stdout, res.stderr[-2000:]


def test_no_test_imports_from_conftest_by_name():
    """notebooks/conftest.py and tests/conftest.py are both the module ``conftest``: in a run that
    loads both, the name means whichever loaded last, and a test's ``from conftest import ...`` read
    the notebooks' (an ImportError in CI). Shared helpers live in tests/helpers_*.py."""
    pattern = re.compile(r"^\s*(from conftest import|import conftest\b)", re.M)
    assert [p.name for p in sorted(TESTS.glob("*.py")) if pattern.search(p.read_text())] == []
