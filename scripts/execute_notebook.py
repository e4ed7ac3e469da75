"""Execute course notebooks in place and store their outputs.

Each chapter is a pair: ``notebooks/NN_name.py`` (jupytext percent format, the source you edit and
review) and ``notebooks/NN_name.ipynb`` (the same cells with the outputs of the last run). Usage::

    python scripts/execute_notebook.py notebooks/06_prefill_vs_decode.py   # or the .ipynb; several allowed

The pair is synchronised first (``jupytext --sync``: the file edited last gives the cells), then the
notebook runs top to bottom in a fresh kernel with nbclient and both files are written. The kernel runs
with one CPU thread (``OMP_NUM_THREADS=1``, ``MINIVLLM_THREADS=1``: steadier timings on a shared CPU) and
minivllm's logger at WARNING (``MINIVLLM_LOGGING_LEVEL``), unless the environment already sets them;
library chatter (the torch profiler's trace lines, transformers' loading bar) is removed from the stored
stderr.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
#: Seconds the kernel has to exit when asked, before SIGTERM (at half of it) and SIGKILL: with jupyter_client's
#: 5 s default (SIGTERM after 2.5 s) a kernel slower to exit than that (chapter 10's, before its tensor-parallel
#: workers left the kernel's process group: minivllm/executor/launch.py) skips its exit handlers, leaving
#: kaleido's Chromium profile and page in /tmp (tests/helpers_nbval.py does the same for nbval's kernels)
KERNEL_EXIT_WAIT_S = 60.0

#: The kernel's environment unless already set: one thread, no INFO lines from minivllm's logger.
KERNEL_ENV = {"OMP_NUM_THREADS": "1", "MINIVLLM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
              "MINIVLLM_LOGGING_LEVEL": "WARNING"}
# stderr lines that say nothing to a reader: the torch profiler's start/stop trace lines and
# transformers' weight-loading progress bar.
_NOISE = re.compile(r"^(USDT:.*SyncActivityProfilerHandler.*|Loading weights:.*)$")


def drop_noise(nb: nbformat.NotebookNode) -> None:
    """Remove library chatter (``_NOISE``) from the stored stderr outputs; nothing else changes."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                lines = [ln for ln in re.split(r"(?<=\n)|\r", out["text"]) if ln and not _NOISE.match(ln.strip())]
                if not "".join(lines).strip():
                    continue
                out["text"] = "".join(lines)
            kept.append(out)
        cell["outputs"] = kept


def pair_of(path: Path) -> tuple[Path, Path]:
    """``(NN_name.py, NN_name.ipynb)`` for either file of a chapter."""
    path = path.resolve()
    if path.suffix not in (".py", ".ipynb"):
        raise SystemExit(f"{path}: expected a notebook's .py or .ipynb")
    return path.with_suffix(".py"), path.with_suffix(".ipynb")


def execute(path: Path, timeout: int = 600, store_widget_state: bool = False) -> nbformat.NotebookNode:
    """Synchronise the pair, run the notebook in a fresh kernel, write the .ipynb then the .py."""
    import jupytext
    from jupytext.cli import jupytext as jupytext_cli
    from nbclient import NotebookClient
    from traitlets.config import Config

    py, ipynb = pair_of(path)
    if py.exists() or ipynb.exists():
        jupytext_cli(["--sync", "--quiet", str(py if py.exists() else ipynb)])
    nb = nbformat.read(ipynb, as_version=4)
    for key, value in KERNEL_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # Widget state is not stored by default: every widget output carries its own static snapshot.
    config = Config()
    config.KernelManager.shutdown_wait_time = KERNEL_EXIT_WAIT_S  # (its async subclass, which nbclient makes, reads it)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=store_widget_state,
                            resources={"metadata": {"path": str(ipynb.parent)}}, config=config)
    client.execute()
    drop_noise(nb)
    nbformat.write(nb, ipynb)
    jupytext.write(nb, py, fmt="py:percent")  # written last: the text file is the newer of the pair
    return nb


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python scripts/execute_notebook.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path, help="notebooks/NN_name.py or .ipynb")
    ap.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    for path in args.notebooks:
        t0 = time.perf_counter()
        execute(path, timeout=args.timeout)
        ipynb = pair_of(path)[1]
        print(f"executed {os.path.relpath(ipynb)} in {time.perf_counter() - t0:.0f} s "
              f"({ipynb.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
