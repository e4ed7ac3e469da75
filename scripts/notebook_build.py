"""What every ``scripts/build_notebook_NN.py`` shares: turn its list of cells into a notebook,
execute it with nbclient, and write it to ``notebooks/``.

Each build script holds its chapter as ``CELLS`` (``("md" | "code", source)`` pairs); the third
cell is its parameters cell. Usage from a build script::

    def build():
        return notebook_build.build(CELLS)

    if __name__ == "__main__":
        notebook_build.main(CELLS, OUT, __doc__)
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
PARAMETERS_CELL = 2
# stderr lines that say nothing to a reader: the torch profiler's start/stop trace lines and
# transformers' weight-loading progress bar.
_NOISE = re.compile(r"^(USDT:.*SyncActivityProfilerHandler.*|Loading weights:.*)$")


def cell_writers(cells: list[tuple[str, str]]):
    """``md(text)`` and ``code(text)``: append a markdown / code cell (outer blank lines stripped)."""
    def md(text: str) -> None:
        cells.append(("md", text.strip("\n")))

    def code(text: str) -> None:
        cells.append(("code", text.strip("\n")))

    return md, code


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """The unexecuted notebook: stable cell ids, the parameters cell tagged."""
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, src) in enumerate(cells):
        cell = new_markdown_cell(src) if kind == "md" else new_code_cell(src)
        cell["id"] = f"c{i:02d}"
        if kind == "code" and i == PARAMETERS_CELL:
            cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    return nb


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


def main(cells: list[tuple[str, str]], out: Path, description: str | None = None) -> None:
    """Command line of a build script: build, execute (unless ``--no-exec``), write ``out``."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--no-exec", action="store_true", help="write the notebook without executing it")
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    nb = build(cells)
    if not args.no_exec:
        from nbclient import NotebookClient

        # Widget state is not stored (it would be megabytes of chart data); every widget
        # output carries its own static snapshot instead.
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3", store_widget_state=False,
                                resources={"metadata": {"path": str(out.parent)}})
        client.execute()
        drop_noise(nb)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
