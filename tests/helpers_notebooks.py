"""Checks shared by the tests of stored (executed) course notebooks."""
from __future__ import annotations

from pathlib import Path

import nbformat


def executed_code_cells(path: Path, max_bytes: int = 1_000_000) -> list:
    """The code cells of a stored notebook, after asserting it is small (``max_bytes``), every
    code cell was executed, and no output is an error. Returns them for further checks."""
    assert path.stat().st_size <= max_bytes
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "notebook stored without executing"
    for c in code:
        assert not [o for o in c.outputs if o.output_type == "error"], c.source[:80]
    return code


def stream_text(code: list) -> str:
    """Everything the cells printed (stdout/stderr streams), joined."""
    return "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
