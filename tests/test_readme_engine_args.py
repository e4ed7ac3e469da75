"""README's engine-arguments table is the rendering of ``EngineArgs``: every field, its default
and its docstring entry, so the README cannot fall behind the code."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from minivllm.config import EngineArgs
from minivllm.utils.argparse_utils import _help_by_name

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- engine-args:start -->", "<!-- engine-args:end -->"


def render_table() -> str:
    helps = _help_by_name(EngineArgs)
    rows = ["| argument | default | what it sets |", "|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        text = helps[f.name].replace("``", "`").replace(":mod:", "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{f.default!r}` | {text} |")
    return "\n".join(rows)


def test_every_engine_argument_has_a_docstring_entry():
    helps = _help_by_name(EngineArgs)
    assert [f.name for f in dataclasses.fields(EngineArgs) if f.name not in helps] == []


def test_readme_table_is_the_rendering_of_engine_args():
    match = re.search(re.escape(START) + r"\n(.*?)\n?" + re.escape(END), README.read_text(), re.S)
    assert match, f"README.md has no {START} ... {END} block"
    assert match.group(1).strip() == render_table(), "regenerate: python tests/test_readme_engine_args.py"


if __name__ == "__main__":  # rewrite the README's table from EngineArgs
    text = README.read_text()
    text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda m: f"{START}\n{render_table()}\n{END}", text,
                  flags=re.S)
    README.write_text(text)
