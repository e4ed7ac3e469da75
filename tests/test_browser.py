"""Real-browser test: JupyterLab + headless Chromium run notebooks 06 and 07 and press their widgets' buttons.

Starts JupyterLab on localhost (token auth, no browser, a free port) serving temporary copies of
the notebooks with their outputs cleared, opens chapter 06 in Debian's Chromium through Playwright,
runs all cells, then clicks "Add request" and "Step" in the rendered page and checks that the
displayed generated-token count and the KV cache view change; "Run to end" and "Reset" follow.
Then chapter 07 (split from 06: the latency calculator and the chunked-prefill demo) runs in a
workspace of its own, and "measure this point" on the latency calculator measures again.
Screenshots go to the test's temporary directory; with ``MINIVLLM_UPDATE_SCREENSHOTS=1`` they replace
the committed ones in docs/screenshots/ (a plain test run changed tracked files).
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "06_prefill_vs_decode.ipynb"
NOTEBOOK_07 = ROOT / "notebooks" / "07_latency.ipynb"
DOC_SHOTS = ROOT / "docs" / "screenshots"
COUNT = ".mv-engine-stepper .mv-generated-count"
KV = ".mv-kv-cache-view .mv-kv-summary"
STATUS = ".mv-engine-stepper .mv-status"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} not found: apt-get install --no-install-recommends chromium"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip_outputs(src: Path, dst: Path) -> None:
    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    nb["metadata"].pop("widgets", None)
    dst.write_text(json.dumps(nb))


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on a free localhost port serving a copy of notebook 06 (the test adds 07
    when it gets there)."""
    for nb in (NOTEBOOK, NOTEBOOK_07):
        if not nb.is_file():
            pytest.skip(f"{nb} not built yet")
    work = tmp_path / "lab"
    work.mkdir()
    _strip_outputs(NOTEBOOK, work / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"))
    env.setdefault("MINIVLLM_THREADS", "1")  # the notebook's thread parameter: steadier on a shared CPU
    # No virtual scrolling of cells (widgets stay in the DOM), no news prompt.
    settings = tmp_path / "settings"
    (settings / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"}))
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false"}))
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--ServerApp.port_retries=0",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"] + (["--allow-root"] if os.geteuid() == 0 else []),
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                log.close()
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield url, token, work
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _text(locator) -> str:
    return (locator.first.text_content(timeout=10_000) or "").strip()


def _open_and_run_all(sync_api, page, url: str, token: str, path: str) -> None:
    """Open ``path`` in JupyterLab, start its kernel, Run All Cells, wait until the quiz (every
    chapter's last widget) has rendered and the kernel is idle, and check no cell raised."""
    page.goto(f"{url}/{path}?token={token}", wait_until="domcontentloaded")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    select = page.locator(".jp-Dialog button", has_text="Select")
    try:  # JupyterLab may ask which kernel to start
        select.first.click(timeout=10_000)
    except sync_api.TimeoutError:
        pass
    page.locator(".jp-StatusBar-TextItem", has_text="Idle").first.wait_for(timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.locator(".mv-quiz").first.wait_for(timeout=300_000)  # the last widget: every cell has run
    page.locator(".jp-StatusBar-TextItem", has_text="Idle").first.wait_for(timeout=60_000)
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] "
                          ":text('Traceback')")
    assert errors.count() == 0, "a cell raised"


def test_notebooks_06_and_07_in_jupyterlab(jupyterlab):
    sync_api = pytest.importorskip("playwright.sync_api")
    url, token, work = jupyterlab
    shots = DOC_SHOTS if os.environ.get("MINIVLLM_UPDATE_SCREENSHOTS") == "1" else work / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-extensions", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            _open_and_run_all(sync_api, page, url, token, f"lab/tree/{NOTEBOOK.name}")
            stepper = page.locator(".mv-engine-stepper").first

            count = page.locator(COUNT)
            kv_summary = page.locator(KV)
            count0, kv0 = int(_text(count)), _text(kv_summary)
            assert count0 == 2  # the notebook ran the prefill and one decode step
            assert page.locator(".mv-kv-cache-view .mv-kv-used").count() > 0

            stepper.scroll_into_view_if_needed()
            stepper.locator("button.mv-add-request").click()
            stepper.locator("button.mv-step").click()
            # widgets replace their HTML on update, so wait on selectors, not element handles
            page.wait_for_function(f"n => parseInt(document.querySelector('{COUNT}').textContent) > n",
                                   arg=count0, timeout=30_000)
            count1 = int(_text(count))
            assert count1 >= count0 + 2  # one decode token for the first request, one first token for the new one
            page.wait_for_function(f"t => document.querySelector('{KV}').textContent !== t", arg=kv0,
                                   timeout=30_000)
            assert _text(kv_summary) != kv0
            assert stepper.locator(".js-plotly-plot").count() >= 1  # the live chart (plotly JSON in an Output widget) rendered
            stepper.screenshot(path=str(shots / "engine_stepper.png"))
            page.locator(".mv-kv-cache-view").first.screenshot(path=str(shots / "kv_cache_view.png"))

            stepper.locator("button.mv-run-to-end").click()
            page.wait_for_function(f"() => document.querySelector('{STATUS}').textContent.includes('engine idle')",
                                   timeout=60_000)
            # the status line and the step count are two widget updates: the count can arrive after the status
            # (a CI run read 4 > 4 between them)
            page.wait_for_function(f"n => parseInt(document.querySelector('{COUNT}').textContent) > n",
                                   arg=count1, timeout=30_000)
            # A kernel interrupt halts "Run to end" between steps: a long request, run, interrupt.
            stepper.locator(".widget-text input[type='number']").first.fill("900")
            stepper.locator(".widget-checkbox input").first.check()
            stepper.locator("button.mv-add-request").click()
            page.wait_for_function(f"() => document.querySelector('{STATUS}').textContent.includes('added')",
                                   timeout=30_000)
            stepper.locator("button.mv-run-to-end").click()
            page.wait_for_function(f"n => parseInt(document.querySelector('{COUNT}').textContent) > n + 5",
                                   arg=int(_text(count)), timeout=30_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Interrupt Kernel").first.click()
            page.wait_for_function(f"() => document.querySelector('{STATUS}').textContent.includes('interrupted')",
                                   timeout=30_000)
            halted = int(_text(count))
            page.wait_for_timeout(1000)
            assert int(_text(count)) == halted  # nothing runs after the interrupt
            stepper.locator("button.mv-reset").click()
            page.wait_for_function(f"() => document.querySelector('{KV}').textContent.startsWith('0 used')",
                                   timeout=30_000)
            page.wait_for_function(f"() => document.querySelector('{COUNT}').textContent.trim() === '0'",
                                   timeout=30_000)

            # Chapter 07, in a workspace of its own (only that notebook open): the latency calculator.
            page.close()
            _strip_outputs(NOTEBOOK_07, work / NOTEBOOK_07.name)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _open_and_run_all(sync_api, page, url, token, f"lab/workspaces/ch07/tree/{NOTEBOOK_07.name}")
            calc = page.locator(".mv-latency-calculator").first
            calc.scroll_into_view_if_needed()
            assert calc.locator(".js-plotly-plot").count() >= 1  # its live chart rendered
            table = ".mv-latency-calculator .mv-table"
            before = _text(page.locator(table))
            assert "–" not in before  # the notebook measured the sliders' point once
            calc.locator("button.mv-measure").click()  # measure it again: new measured figures
            page.wait_for_function(f"t => document.querySelector('{table}').textContent.trim() !== t",
                                   arg=before, timeout=60_000)
            calc.screenshot(path=str(shots / "latency_calculator.png"))
            demo = page.locator(".mv-chunked-prefill-demo").first
            demo.scroll_into_view_if_needed()
            assert demo.locator(".js-plotly-plot").count() >= 1
        except Exception:
            shot = work.parent / "browser_failure.png"
            page.screenshot(path=str(shot), full_page=False)
            print(f"failure screenshot: {shot}")
            raise
        finally:
            browser.close()
