"""The EngineStepper and friends used the way a learner might: overlapping runs, interrupts
between steps, a step that raises, Stop or Reset at awkward moments, a widget built on a
temporary LLM or kept after ``shutdown()``, mistyped token ids. Each test failed before its fix
(an adversarial review of the widgets, 2026-12-04)."""
from __future__ import annotations

import asyncio
import gc
import signal

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from minivllm import LLM  # noqa: E402

import test_widgets as _widgets  # noqa: E402
from test_widgets import BLOCK, ids  # noqa: E402

# the widget tests' fixtures (embedded model, one shared LLM per module, left idle and unfrozen after each test)
model_path, shared_llm, llm = _widgets.model_path, _widgets.shared_llm, _widgets.llm


def make(model_path) -> LLM:
    """A fresh LLM like the shared one, for tests that shut theirs down or drop it."""
    return LLM(model_path, block_size=BLOCK, num_kvcache_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)


def test_overlapping_async_runs_leave_the_interrupt_handler_as_it_was(llm):
    """Two steppers' runs end in any order; each step's handler is restored before the next
    await, so the kernel's own handler is back afterwards (it stayed the first run's before)."""
    from widgets import EngineStepper

    a, b = EngineStepper(llm, show_chart=False), EngineStepper(llm, show_chart=False)
    a.add_request(ids(10), max_tokens=30, ignore_eos=True)
    before = signal.getsignal(signal.SIGINT)

    async def scenario():
        a.run_button.click()
        await asyncio.sleep(0.01)
        b.add_request(ids(10, 3), max_tokens=30, ignore_eos=True)
        b.run_button.click()
        await asyncio.sleep(0.01)
        a.stop_button.click()
        while a.is_running or b.is_running:
            await asyncio.sleep(0.002)

    asyncio.run(scenario())
    assert signal.getsignal(signal.SIGINT) is before


def test_an_interrupt_between_a_background_runs_steps_stops_every_run(llm):
    """In a kernel a background run spends part of its time between steps (the event loop idle,
    where ipykernel itself ignores SIGINT): an interrupt there must still stop it, and it stops
    every run in progress, then the handler from before the runs is back."""
    import os

    from widgets import EngineStepper

    a, b = EngineStepper(llm, show_chart=False), EngineStepper(llm, show_chart=False)
    a.add_request(ids(10), max_tokens=60, ignore_eos=True)

    async def scenario():
        before = signal.getsignal(signal.SIGINT)
        a.run_button.click()
        await asyncio.sleep(0.01)
        b.add_request(ids(10, 3), max_tokens=60, ignore_eos=True)
        b.run_button.click()
        while len(b.steps) < 2:
            await asyncio.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)  # delivered here, between the runs' steps
        while a.is_running or b.is_running:
            await asyncio.sleep(0.002)
        return before

    before = asyncio.run(scenario())
    assert "interrupted" in a.last_message and "interrupted" in b.last_message
    assert len(a.steps) < 60 and len(b.steps) < 60
    assert before is not None
    llm.llm_engine.check_invariants()


def test_a_step_that_raises_ends_the_run_with_the_error_in_the_status_line(llm):
    from widgets import EngineStepper

    engine = llm.llm_engine
    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=30, ignore_eos=True)
    real, calls = engine.runner.forward_logits, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("simulated device error")
        return real(*a, **k)

    engine.runner.forward_logits = flaky
    try:
        async def scenario():
            s.run_button.click()
            task = s._task
            while s.is_running:
                await asyncio.sleep(0.002)
            await asyncio.sleep(0)
            return task

        task = asyncio.run(scenario())
    finally:
        del engine.runner.forward_logits
    assert task.done() and not task.cancelled() and task.exception() is None  # nothing left unretrieved
    assert "raised RuntimeError: simulated device error" in s.last_message and "done" not in s.last_message
    assert len(s.steps) == 3
    engine.check_invariants()
    assert s.run_to_end() > 0 and not engine.has_unfinished_requests()  # the engine carries on


def test_a_blocking_run_whose_step_raises_says_so_and_raises(llm):
    from widgets import EngineStepper

    engine = llm.llm_engine
    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=10, ignore_eos=True)
    engine.runner.forward_logits = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            s.run_to_end()
    finally:
        del engine.runner.forward_logits
    assert "raised RuntimeError: boom" in s.last_message
    s.step_button.click()  # a click that fails is reported, not lost in the kernel's log
    engine.runner.forward_logits = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("again"))
    try:
        s.step_button.click()
    finally:
        del engine.runner.forward_logits
    assert "raised RuntimeError: again" in s.last_message
    engine.check_invariants()


def test_stop_pressed_before_the_run_first_steps_is_kept(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=30, ignore_eos=True)

    async def scenario():
        s.run_button.click()
        s.stop_button.click()  # before the task's first tick
        while s.is_running:
            await asyncio.sleep(0.002)

    asyncio.run(scenario())
    assert len(s.steps) <= 1 and "stopped" in s.last_message


def test_reset_during_a_run_keeps_its_own_message(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=40, ignore_eos=True)

    async def scenario():
        s.run_button.click()
        await asyncio.sleep(0.01)
        s.reset_button.click()
        await asyncio.sleep(0.05)  # the cancelled task finishes here

    asyncio.run(scenario())
    assert s.last_message.startswith("reset:") and not llm.llm_engine.has_unfinished_requests()


def test_a_widget_keeps_a_temporary_llm_alive(model_path):
    """``EngineStepper(LLM(...))``: the LLM shuts its engine down when collected, so the widget
    holds it."""
    from widgets import EngineStepper, KVCacheView

    s = EngineStepper(make(model_path), show_chart=False)
    view = KVCacheView(make(model_path))
    gc.collect()
    s.add_request(ids(6), max_tokens=3, ignore_eos=True)
    assert s.run_to_end() == 3 and view.engine.runner is not None
    s.llm.shutdown()
    view.llm.shutdown()


def test_after_shutdown_the_buttons_say_so(model_path):
    from widgets import EngineStepper

    llm = make(model_path)
    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(6), max_tokens=3, ignore_eos=True)
    llm.shutdown()
    for button in (s.step_button, s.run_button, s.reset_button):
        button.click()
        assert "shut down" in s.last_message, button.description
    s.prompt_box.value = "[1, 2, 3]"
    s.add_button.click()
    assert s.last_message.startswith("not added:") and "shut down" in s.last_message


def test_parallel_samples_are_refused_before_anything_is_queued(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    with pytest.raises(ValueError, match="n=2"):
        s.add_request(ids(10), max_tokens=4, n=2, temperature=0.8, seed=1)
    assert not llm.llm_engine.requests and not s.request_ids


@pytest.mark.parametrize("typed", ["[-1]", "[1, 2,", "[1 2]", "[1,,2]"])
def test_mistyped_token_ids_are_refused_not_read_as_text(llm, typed):
    from widgets import EngineStepper
    from widgets._engine import parse_prompt

    with pytest.raises(ValueError, match="not a list of token ids"):
        parse_prompt(typed)
    s = EngineStepper(llm, show_chart=False)
    s.prompt_box.value = typed
    s.add_button.click()
    assert s.last_message.startswith("not added:") and not llm.llm_engine.requests
    assert parse_prompt("[1, 2, 3]") == [1, 2, 3] and parse_prompt("[a, b]") == "[a, b]"


def test_utilisation_monitor_reports_a_prompt_too_long_and_queues_nothing(llm):
    from widgets import UtilisationMonitor

    mon = UtilisationMonitor(llm, num_requests=3, prompt_len=64, max_tokens=4)
    mon.prompt_len.value = llm.llm_engine.config.max_model_len + 10
    assert mon.run() == []
    assert "prompt" in mon.readout.value and not llm.llm_engine.requests
