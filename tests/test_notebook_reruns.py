"""Chapter cells a learner runs again: the exercise checks still judge the state the exercise asked
about. The chapter's own cells run here in one namespace, in order, as a kernel would (no kernel: the
widgets' display falls back to text)."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cells(chapter: str) -> list[str]:
    nb = jupytext.read(ROOT / "notebooks" / f"{chapter}.py")
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _run(source: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<cell>", "exec"), namespace)
    return out.getvalue()


def _chapter_04_exercise_1():
    """Chapter 04's code cells and the indices of section 1's build cell, exercise 1's step and check
    cells and section 2's first cell."""
    cells = _cells("04_paged_attention")
    build = next(i for i, c in enumerate(cells) if "all three prompts are prefilled together" in c)
    step = next(i for i, c in enumerate(cells) if c.startswith("my_prediction_1 = None")) + 1
    check = next(i for i, c in enumerate(cells) if "check_prediction(my_prediction_1" in c)
    section_2 = next(i for i, c in enumerate(cells) if "captured = []" in c)
    return cells, build, step, check, section_2


def test_chapter_04_exercise_1_judges_the_state_after_12_steps_when_its_cells_run_again():
    # its step cell stepped 12 more times when run again (as its hint said to), and the check read the live
    # block count: the right answer, 4 blocks, was judged "2 blocks (100% off: not close)"; later, run again
    # after section 2 had stepped on, it read the pool after 13 decode steps (again "2 blocks")
    cells, build, step, check, section_2 = _chapter_04_exercise_1()
    ns: dict = {}
    for source in cells[:step + 1]:
        _run(source, ns)
    ns["my_prediction_1"] = 4
    first = _run(cells[check], ns)
    _run(cells[step], ns)  # run again
    again = _run(cells[check], ns)
    assert "is 4 blocks (0% off: close" in first and again == first
    for source in cells[check + 1:section_2 + 1]:
        _run(source, ns)  # section 2 steps the engine once more
    _run(cells[step], ns)  # the learner goes back to the exercise
    assert _run(cells[check], ns) == first
    ns["llm"].shutdown()


def test_chapter_04_exercise_1_counts_the_stepper_button_presses_toward_its_12_steps():
    # two presses of the stepper's Step button before the exercise's cells made the 12 steps 14: "2 blocks";
    # a Run to end pressed before them left section 2 failing with IndexError on captured[0]
    cells, build, step, check, section_2 = _chapter_04_exercise_1()
    ns: dict = {}
    for source in cells[:build + 1]:
        _run(source, ns)
    ns["stepper"].step()
    ns["stepper"].step()  # two presses of Step
    for source in cells[build + 1:step + 1]:
        _run(source, ns)
    ns["my_prediction_1"] = 4
    assert "is 4 blocks (0% off: close" in _run(cells[check], ns)

    _run(cells[build], ns)  # section 1 again, then Add request: its blocks would count in the pool
    ns["stepper"].add_request("The module provides", max_tokens=12)
    with pytest.raises(RuntimeError, match="holds a request besides A, B and C"):
        _run(cells[step], ns)

    _run(cells[build], ns)  # section 1 again, then Run to end
    ns["stepper"].run_to_end()
    with pytest.raises(RuntimeError, match="already run 29 decode steps, more than the exercise's 12"):
        _run(cells[step], ns)
    with pytest.raises(RuntimeError, match="nothing left to run .*run section 1's first code cell"):
        _run(cells[section_2], ns)
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


def test_chapter_05_preemption_cell_run_again_prints_the_same_run_on_a_fresh_engine():
    # run again, it kept the first run's engine (step numbers and request ids counting on: "step 151 ...
    # req-11" where the text said "step 9 ... req-3") and the cell building the engines leaked the last pair
    cells = _cells("05_scheduler")
    run = next(i for i, c in enumerate(cells) if "stepper.run_to_end()" in c and "POOL_BLOCKS" in c)
    build = next(i for i, c in enumerate(cells) if "big = LLM(" in c)
    ns: dict = {}
    for source in cells[:run]:
        _run(source, ns)
    first_big = ns["big"]
    first = _run(cells[run], ns)
    first_tiny = ns["tiny"]
    again = _run(cells[run], ns)
    assert again == first and "step   9: preempted ['req-3']" in first
    assert first_tiny.llm_engine.is_shut_down and not ns["tiny"].llm_engine.is_shut_down
    _run(cells[build], ns)
    assert first_big.llm_engine.is_shut_down and not ns["big"].llm_engine.is_shut_down
    for name in ("tiny", "big", "llm"):
        if name in ns:
            ns[name].shutdown()


def test_engine_stepper_reset_numbers_requests_from_req_0_again():
    from minivllm import LLM
    from widgets import EngineStepper

    with LLM("minivllm-tiny", num_kvcache_blocks=16) as llm:
        stepper = EngineStepper(llm, show_chart=False)
        assert [stepper.add_request([1, 2, 3], max_tokens=2) for _ in range(2)] == ["req-0", "req-1"]
        stepper.step()
        stepper.reset()
        assert stepper.add_request([4, 5], max_tokens=2) == "req-0"
        stepper.run_to_end()
        assert stepper.request_ids == ["req-0"]


def test_chapter_02_tracing_cells_follow_the_engine_cell_when_it_runs_again():
    # `layer` was bound once, in section 1: after the engine's cell ran again, the shape tracer hooked the old
    # model's layer (IndexError: list index out of range) and the playground silently lost its qkv/mlp lines
    cells = _cells("02_architecture")
    engine_cell = next(i for i, c in enumerate(cells) if "llm = LLM(MODEL" in c)
    play = next(i for i, c in enumerate(cells) if "hooks = [layer" in c)
    ns: dict = {}
    for source in cells[:play + 1]:
        _run(source, ns)
    old = ns["llm"]
    _run(cells[engine_cell], ns)
    assert ns["llm"] is not old
    trace = next(i for i, c in enumerate(cells) if 'watched = {"model.embed_tokens"' in c)
    outs = [_run(source, ns) for source in cells[trace:play + 1]]  # the tracer, its table, the playground
    assert "mlp out" in outs[-1] and "qkv_proj out" in outs[-1], outs[-1]
    assert "model.layers.0" in "".join(outs) or "layers.0" in "".join(outs)
    for llm in (old, ns["llm"]):
        llm.shutdown()


def test_chapter_05_preemption_comparison_runs_again_after_the_whole_chapter():
    # the section's last check cell shut `tiny` and `big` down: after Run All, running the comparison again
    # (big.generate) raised "this LLM has been shut down" (a teacher's browser pass)
    cells = _cells("05_scheduler")
    compare = next(i for i, c in enumerate(cells) if "big_outs = big.generate(" in c)
    ns: dict = {}
    for source in cells:
        _run(source, ns)
    again = _run(cells[compare], ns)
    assert "identical with 10 and with 64 KV blocks: True" in again
    for name in ("tiny", "big", "hand", "llm"):
        if name in ns:
            ns[name].shutdown()


@pytest.mark.slow
def test_chapter_06_exercise_2_cells_run_again_after_the_big_model_is_shut_down():
    # after Run All, a learner back at exercise 2 re-ran its check cell: AttributeError on big_engine (set to None
    # where section 4 shuts the model down); the sweep cell said only "run the cell that built the LLM again"
    cells = _cells("06_prefill_vs_decode")
    sweep = next(i for i, c in enumerate(cells) if "warm_up(big)" in c)
    shutdown = next(i for i, c in enumerate(cells) if c.startswith("big.shutdown()"))
    ns: dict = {}
    for source in cells[:shutdown + 1]:
        _run(source, ns)
    ns["my_prediction_2"] = 3
    for source in cells[sweep + 1:shutdown]:  # the table, the charts and the check read what the sweep kept
        _run(source, ns)
    assert "my_prediction_2" in ns and "You predicted 3" in _run(
        next(c for c in cells if "check_prediction(my_prediction_2" in c), ns)
    with pytest.raises(RuntimeError, match="shut down at the end of section 4: run the cell that builds it"):
        _run(cells[sweep], ns)
    for name in ("llm", "bench"):
        if name in ns:
            ns[name].shutdown()


def test_chapter_11_profiles_the_steppers_one_request_after_a_click_added_another():
    # one press of the stepper's "Add request" before the profiling cell: it profiled "a mixed step of 2
    # sequences and a decode step of 5" and printed the batch-1 and batch-4 operations as different
    cells = _cells("11_optimizations")
    profile = next(i for i, c in enumerate(cells) if "rec, ops, c_calls, kernels = profile_call" in c)
    ns: dict = {}
    for source in cells[:profile]:
        _run(source, ns)
    ns["stepper"].add_request("The module provides", max_tokens=12)  # the form's defaults, as the button sends
    _run(cells[profile], ns)
    out = _run(cells[profile + 1], ns)
    assert "a decode step of 1 sequence and a decode step of 4" in out and "the same" in out
    ns["stepper"].reset()  # Reset, then Add request: one request, not yet prefilled (it profiled a prefill step)
    ns["stepper"].add_request("The module provides", max_tokens=12)
    _run(cells[profile], ns)
    out = _run(cells[profile + 1], ns)
    assert "a decode step of 1 sequence and a decode step of 4" in out and "the same" in out
    ns["llm"].shutdown()


def test_chapter_01_stepper_cell_after_a_reset_says_so():
    # Reset pressed on the stepper before the cell that reads it: IndexError on stepper.request_ids[0]
    cells = _cells("01_inference")
    build = next(i for i, c in enumerate(cells) if "stepper = EngineStepper(step_llm" in c)
    ns: dict = {}
    for source in cells[:build + 1]:
        _run(source, ns)
    ns["stepper"].reset()
    assert "no request since its Reset: run the cell above again" in _run(cells[build + 1], ns)
    for name in ("llm", "step_llm"):
        ns[name].shutdown()
