"""Chapter cells a learner runs again: the exercise checks still judge the state the exercise asked
about. The chapter's own cells run here in one namespace, in order, as a kernel would (no kernel: the
widgets' display falls back to text)."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent


def _cells(chapter: str) -> list[str]:
    nb = jupytext.read(ROOT / "notebooks" / f"{chapter}.py")
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _run(source: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<cell>", "exec"), namespace)
    return out.getvalue()


def test_chapter_04_exercise_1_judges_the_state_after_12_steps_when_its_cells_run_again():
    # its step cell stepped 12 more times when run again (as its hint said to), and the check read the live
    # block count: the right answer, 4 blocks, was judged "2 blocks (100% off: not close)"
    cells = _cells("04_paged_attention")
    step = next(i for i, c in enumerate(cells) if "stepper.step()" in c and "show_tables()" in c and i > 2)
    check = next(i for i, c in enumerate(cells) if "check_prediction(my_prediction_1" in c)
    ns: dict = {}
    for source in cells[:step + 1]:
        _run(source, ns)
    ns["my_prediction_1"] = 4
    first = _run(cells[check], ns)
    _run(cells[step], ns)  # run again
    again = _run(cells[check], ns)
    assert "is 4 blocks (0% off: close" in first and again == first
    ns["llm"].shutdown()


def test_chapter_09_playground_at_temperature_0_says_greedy():
    # it printed "top_k=10 keeps 4096, top_p=0.9 keeps 4096" at T=0, where the engine samples the argmax
    cells = _cells("09_sampling")
    play = next(i for i, c in enumerate(cells) if c.startswith("TEMPERATURE = "))
    ns: dict = {}
    for source in cells[:play]:
        _run(source, ns)
    rest = cells[play].split("\n", 1)[1]
    out = _run("TEMPERATURE = 0\n" + rest, ns)
    assert "T=0 is greedy" in out and "keeps 4096" not in out
    assert "top_p=0.9 keeps" in _run("TEMPERATURE = 1.5\n" + rest, ns)
    ns["llm"].shutdown()
