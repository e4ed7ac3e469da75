"""Every chapter teaches by doing (issue 14 §3), checked on its source (``notebooks/NN_name.py``).

* the first cell states the learning goal, the prerequisites and an estimated time;
* at least two "predict, then run, then compare" exercises: a code cell tagged ``exercise`` where
  the learner writes a prediction (left ``None``), a later code cell that compares it with this run's
  measurement (``check_prediction`` / ``check_claim`` from ``widgets.course``), and a worked solution
  in a cell tagged ``solution`` whose text is collapsed (``<details>``);
* one cell tagged ``playground`` that names the knob to turn;
* a closing "You can now" recap.
"""
from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _tags(cell) -> list[str]:
    return cell.metadata.get("tags", [])


def structure_problems(nb) -> list[str]:
    """What a notebook lacks of the course conventions (empty when it has them all)."""
    cells = nb.cells
    problems = []
    head = cells[0].source if cells and cells[0].cell_type == "markdown" else ""
    for field in ("Goal", "Prerequisites", "Time"):
        if not re.search(rf"\*\*{field}s?:?\*\*", head):
            problems.append(f"first cell lacks **{field}:**")
    exercises = [i for i, c in enumerate(cells) if c.cell_type == "code" and "exercise" in _tags(c)]
    if len(exercises) < 2:
        problems.append(f"{len(exercises)} exercise cells (need >= 2)")
    names = {}  # exercise cell -> the name its prediction is written to
    for i in exercises:
        m = re.search(r"^(\w+) = None", cells[i].source, re.M)
        if m:
            names[i] = m.group(1)
    for i in exercises:
        later = cells[i + 1:]
        if i not in names:
            problems.append(f"exercise cell {i} does not leave a prediction to fill in (`= None`)")
        elif list(names.values()).count(names[i]) > 1:  # a check run again read another exercise's guess
            problems.append(f"exercise cell {i} writes {names[i]!r}, as another exercise does")
        elif not any(c.cell_type == "code" and re.search(r"check_(prediction|claim)\(", c.source)
                     and re.search(rf"\b{names[i]}\b", c.source) for c in later):
            problems.append(f"exercise cell {i}: no check after it reads {names[i]!r}")
        if not any(c.cell_type == "code" and re.search(r"check_(prediction|claim)\(", c.source) for c in later):
            problems.append(f"exercise cell {i} has no check after it")
        if not any("solution" in _tags(c) and "<details>" in c.source for c in later):
            problems.append(f"exercise cell {i} has no collapsed solution after it")
    if not any("playground" in _tags(c) for c in cells):
        problems.append("no cell tagged playground")
    if not any(c.cell_type == "markdown" and re.search(r"^#+ You can now", c.source, re.M) for c in cells):
        problems.append("no 'You can now' recap")
    return problems


#: the widgets with buttons: one on an engine that a later cell shuts down is dead after Run All
INTERACTIVE = {"EngineStepper", "UtilisationMonitor", "LatencyCalculator", "SamplingExplorer", "PrefixCacheView",
               "ChunkedPrefillDemo"}


def run_all_problems(nb) -> list[str]:
    """A displayed widget with buttons, or an exercise's check cell (run again once the prediction is
    written, as it says), on an engine that a later cell shuts down (at its top level, or in a top-level
    ``for`` / ``while`` / ``with`` / ``try``; a rerun guard, ``if "x" in globals(): x.shutdown()``, is an
    ``if``): after Run All the widget's every button, or the check, said the engine had been shut down
    (chapters 10 and 12, and chapter 04's exercise 2, found by teachers' browser passes, 2026-12-07). An
    engine is any name among the widget call's arguments (keyword ones and those inside a dict or list
    included); a name bound again at a cell's top level is a new object, no longer held."""
    import ast

    trees = []
    for cell in nb.cells:
        try:
            trees.append(ast.parse(cell.source) if cell.cell_type == "code" else None)
        except SyntaxError:  # IPython magics: not this check's concern
            trees.append(None)
    shown = {n.func.value.id for t in trees if t for n in ast.walk(t) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "display" and isinstance(n.func.value, ast.Name)}

    def widget_class(call) -> str | None:  # Widget(...) or Widget.from_model(...)
        f = call.func
        name = f.id if isinstance(f, ast.Name) else f.value.id if (
            isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)) else None
        return name if name in INTERACTIVE else None

    def top_level(body):  # the statements a cell runs whatever it finds (an if's body excluded)
        for stmt in body:
            yield stmt
            if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
                for part in ("body", "orelse", "finalbody"):
                    yield from top_level(getattr(stmt, part, []))
                for handler in getattr(stmt, "handlers", []):
                    yield from top_level(handler.body)

    problems, held = [], {}  # engine name -> (cell, what uses it)
    for i, tree in enumerate(trees):
        if tree is None:
            continue
        for stmt in top_level(tree.body):
            call = stmt.value if isinstance(stmt, ast.Expr) else None
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "shutdown"
                    and isinstance(call.func.value, ast.Name) and call.func.value.id in held):
                cell, kind = held[call.func.value.id]
                problems.append(f"cell {i}: {call.func.value.id}.shutdown() ends the engine of the {kind} in "
                                f"cell {cell} (dead after Run All)")
            if isinstance(stmt, ast.Assign):  # bound again: a new object from here on
                for target in stmt.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            held.pop(n.id, None)
        for stmt in ast.walk(tree):
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and stmt.targets[0].id in shown and isinstance(stmt.value, ast.Call) and widget_class(stmt.value)):
                call = stmt.value
                for arg in call.args + [k.value for k in call.keywords]:
                    for n in ast.walk(arg):
                        if isinstance(n, ast.Name):
                            held[n.id] = (i, widget_class(call) + " shown")
        if re.search(r"check_prediction\(my_prediction", nb.cells[i].source):  # names it reads, not binds
            bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for n in ast.walk(tree):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound:
                    held.setdefault(n.id, (i, "exercise check"))
    return problems


def test_the_run_all_check_sees_a_widget_whose_engine_a_later_cell_shuts_down():
    nb = jupytext.reads("# %%\nm = UtilisationMonitor(big)\nm.display()\n\n# %%\nbig.shutdown()\n"
                        "\n# %%\nif 'big' in globals():\n    big.shutdown()\n"
                        "\n# %%\ns = EngineStepper(tiny)\n\n# %%\ntiny.shutdown()\n", fmt="py:percent")
    assert run_all_problems(nb) == ["cell 1: big.shutdown() ends the engine of the UtilisationMonitor shown in cell 0 "
                                    "(dead after Run All)"]
    exercise = jupytext.reads("# %%\nr = measure(work)\ncheck_prediction(my_prediction_2, r)\n\n# %%\nwork.shutdown()\n"
                              "\n# %%\nx = LLM()\ncheck_prediction(my_prediction_3, x.f())\n\n# %%\nx.shutdown()\n",
                              fmt="py:percent")
    assert run_all_problems(exercise) == ["cell 1: work.shutdown() ends the engine of the exercise check in cell 0 "
                                          "(dead after Run All)"]
    forms = jupytext.reads("# %%\nc = LatencyCalculator({'e': bench})\nc.display()\n"
                           "\n# %%\nd = ChunkedPrefillDemo.from_model(m, whole=w2)\nd.display()\n"
                           "\n# %%\ntry:\n    pass\nfinally:\n    bench.shutdown()\n"
                           "\n# %%\nfor e in (w2,):\n    w2.shutdown()\n"
                           "\n# %%\ns = EngineStepper(big)\ns.display()\n\n# %%\nbig = LLM()\n\n# %%\nbig.shutdown()\n",
                           fmt="py:percent")
    assert [p.split(":")[0] + ":" + p.split(":")[1].split(".")[0] for p in run_all_problems(forms)] == [
        "cell 2: bench", "cell 3: w2"], run_all_problems(forms)


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_chapter_teaches_by_doing_and_runs_again(src):
    """The conventions above, every cell runnable twice (``rerun_problems``: found by driving every
    chapter's cells twice and out of order, 2026-12-05), and every widget usable after Run All."""
    nb = jupytext.read(src)
    problems = structure_problems(nb) + rerun_problems(nb) + run_all_problems(nb)
    assert not problems, f"{src.name}: " + "; ".join(problems)


def test_the_check_sees_a_bare_notebook():
    nb = jupytext.reads("# %% [markdown]\n# # A chapter\n\n# %%\nx = 1\n", fmt="py:percent")
    assert len(structure_problems(nb)) >= 5


def test_the_check_sees_two_exercises_sharing_a_prediction():
    """Every chapter's exercises all wrote `my_prediction`: run again after the second exercise, the first
    check judged the second guess (a right answer marked wrong; found driving chapters 01/03/07/12)."""
    def chapter(second: str) -> str:
        return ('# %% tags=["exercise"]\nmy_prediction = None\n\n# %%\ncheck_prediction(my_prediction, 1)\n\n'
                f'# %% tags=["exercise"]\n{second} = None\n\n# %%\ncheck_prediction({second}, 2)\n')

    shared = [p for p in structure_problems(jupytext.reads(chapter("my_prediction"), fmt="py:percent"))
              if "as another exercise does" in p]
    assert len(shared) == 2, shared
    own = structure_problems(jupytext.reads(chapter("my_prediction_2"), fmt="py:percent"))
    assert not [p for p in own if "another exercise" in p or "reads" in p], own


def rerun_problems(nb) -> list[str]:
    """Cells a learner cannot run twice, read from their code: a top-level ``del`` of a name the cell
    does not bind itself (NameError the second time), and an ``EngineStepper`` built without a
    Reset in the same cell (a second run left the first run's requests in the engine, in the next
    step's batch and in the printed counts)."""
    import ast

    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # IPython magics: not this check's concern
            continue
        bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for stmt in tree.body:
            if isinstance(stmt, ast.Delete):
                for target in stmt.targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for n in names:
                        if isinstance(n, ast.Name) and n.id not in bound:
                            problems.append(f"cell {i}: del {n.id} (bound in another cell: NameError when run again)")
        fresh_engine = re.search(r"\bLLM\(", cell.source)  # a stepper on an engine this cell builds starts idle
        if re.search(r"^\w+ = EngineStepper\(", cell.source, re.M) and ".reset()" not in cell.source and not fresh_engine:
            problems.append(f"cell {i}: builds an EngineStepper without a Reset (a second run keeps the first's "
                            "requests)")
        big = re.search(r"^(\w+) = LLM\(BIG", cell.source, re.M)  # a Qwen3-0.6B-sized engine: GBs
        if big and f"{big.group(1)}.shutdown()" not in cell.source.split(big.group(0))[0]:
            problems.append(f"cell {i}: builds {big.group(1)} = LLM(BIG...) without shutting the last run's down first "
                            "(a widget holding it keeps its GBs alive, every run again)")
        adds = re.search(r"\b(?!stepper\b)\w+\.add_request\(", cell.source)
        steps = re.search(r"\.step(_with_record)?\(", cell.source)
        cleared = any(s in cell.source for s in ("idle_engine(", "abort_request(", "finally:"))
        if adds and steps and not cleared and not fresh_engine:
            problems.append(f"cell {i}: adds requests and steps the engine without clearing what an interrupted run "
                            "left (idle_engine, abort_request or a finally): run again, 'request_id already in use'")
    return problems


def test_the_rerun_check_sees_each_hazard():
    nb = jupytext.reads("# %%\nstepper = EngineStepper(llm)\nstepper.add_request('x')\n\n# %%\ndel stepper\n"
                        "\n# %%\nw = 1\ndel w\n"
                        "\n# %%\nengine.add_request('a', 'x', sp)\nwhile engine.has_unfinished_requests():\n    engine.step()\n"
                        "\n# %%\nidle_engine(engine)\nengine.add_request('a', 'x', sp)\nengine.step()\n"
                        "\n# %%\nbig = LLM(BIG, kv_cache_memory_bytes=1 << 26)\nmonitor = UtilisationMonitor(big)\n"
                        "\n# %%\nif 'big' in globals():\n    big.shutdown()\nbig = LLM(BIG)\n",
                        fmt="py:percent")
    problems = rerun_problems(nb)
    assert len(problems) == 4, problems
    assert problems[3].startswith("cell 5: builds big = LLM(BIG") and "GBs" in problems[3], problems
    assert "without a Reset" in problems[0] and "del stepper" in problems[1], problems
    assert problems[2].startswith("cell 3: adds requests") and "interrupted" in problems[2], problems
