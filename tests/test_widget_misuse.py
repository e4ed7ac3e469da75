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


# -- a teacher's review of the widgets, 2026-12-05: each test failed before its fix -----------------

def test_a_refused_measurement_leaves_the_prefix_cache_alone(llm):
    """LatencyCalculator's "measure this point" and PrefixCacheView.run cleared the prefix cache
    before finding the engine busy."""
    from widgets import PrefixCacheView
    from widgets.measure import measure_request_latency

    engine = llm.llm_engine
    system = ids(48, start=3)
    llm.generate([system + ids(4, start=61)], _greedy(2), use_tqdm=False)  # 3 blocks of the system prompt cached
    rid = "busy"
    engine.add_request(rid, system + ids(4, start=71), _greedy(2))
    with pytest.raises(ValueError, match="unfinished"):
        measure_request_latency(llm, 16, 2, 1)
    view = PrefixCacheView(llm, system, [ids(4, start=81), ids(4, start=91)], repeats=1, run=False)
    view.run_button.click()  # the button says so, no exception escapes a click
    assert "unfinished" in view.grid.value
    engine.step()
    assert engine.requests[rid].seq.num_cached_tokens == 48


def _greedy(n):
    from minivllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_a_shut_down_llm_is_named_as_shut_down(model_path):
    from widgets import EngineStepper

    gone = make(model_path)
    gone.shutdown()
    with pytest.raises(ValueError, match="has been shut down"):
        EngineStepper(gone)


def test_reset_gives_new_lists_and_max_run_steps_is_said(llm):
    """Reset emptied the lists a notebook held (pre_steps = stepper.steps); a run capped by
    max_run_steps read "done"."""
    from widgets import EngineStepper

    with pytest.raises(ValueError, match="max_run_steps=0"):
        EngineStepper(llm, max_run_steps=0)
    s = EngineStepper(llm, show_chart=False, max_run_steps=3)
    s.add_request(ids(10), max_tokens=8, ignore_eos=True)
    s.run_to_end()
    assert "max_run_steps=3" in s.last_message and "1 request(s) unfinished" in s.last_message
    kept = s.steps
    s.reset()
    assert len(kept) == 3 and s.steps == []


def test_the_step_chart_names_the_threads_its_steps_ran_with(llm):
    import torch

    from widgets import EngineStepper

    s = EngineStepper(llm)
    s.add_request(ids(10), max_tokens=3, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        s.step()
        torch.set_num_threads(2)
        s.step()
        assert "1-2 CPU threads" in s.chart.layout.title.text
    finally:
        torch.set_num_threads(before)


def test_sampling_explorer_draws_in_chunks_and_says_whose_distribution_it_shows(llm, monkeypatch):
    import widgets.sampling_explorer as se

    ex = se.SamplingExplorer(llm, prompt="[5, 6, 7]", top_n=5)
    assert "[5, 6, 7]" in ex.readout.value
    monkeypatch.setattr(se, "_RACE_FLOATS", ex.probs.numel() * 3)  # three draws a chunk
    seen = []
    race = se.exponential_race
    monkeypatch.setattr(se, "exponential_race", lambda probs, *a: seen.append(probs.shape[0]) or race(probs, *a))
    ex.draw(10)
    assert seen == [3, 3, 3, 1] and ex.num_draws == 10
    ex.prompt_box.value = "[]"
    ex.load()  # refused: the chart keeps the old distribution, and the readout says both
    ex.temperature.value = 0.5  # a slider move used to wipe the error
    assert "[5, 6, 7]" in ex.readout.value and "color:#b00" in ex.readout.value


def test_static_svg_titles_render_the_provenance_line_not_markup():
    import plotly.graph_objects as go

    from widgets._static import figure_svg

    fig = go.Figure(go.Bar(x=["a"], y=[1]))
    fig.update_layout(title="Step times<br><sup>measured on cpu &amp; more</sup>")
    svg = figure_svg(fig)
    assert "&lt;br&gt;" not in svg and "&lt;sup&gt;" not in svg
    assert ">Step times</text>" in svg and ">measured on cpu &amp; more</text>" in svg


def test_chunked_demo_names_the_setting_that_ran_out(llm):
    from widgets.chunked_prefill_demo import itl_around_long_prompt

    with pytest.raises(ValueError, match="decode_tokens=2: the decoders finished within arrive_after=4"):
        itl_around_long_prompt(llm, long_prompt_len=32, num_decoders=1, decode_tokens=2, arrive_after=4)


def test_measure_this_point_warms_its_batch_size_up_first(llm, monkeypatch):
    """The first measurement at a batch size the sweep lacked included recording its CPU graph
    (TPOT 1.37 ms, then 0.53-0.56): now a short unmeasured run of the same batch goes first."""
    import widgets.measure as measure

    calls = []
    real = measure.run_requests
    monkeypatch.setattr(measure, "run_requests", lambda l, prompts, n: calls.append((len(prompts), n)) or
                        real(l, prompts, n))
    measure.measure_request_latency(llm, 16, 3, 3)
    assert calls == [(3, 2), (3, 3)]


def test_utilisation_monitor_draws_its_own_process_beside_the_machine(llm):
    from widgets import UtilisationMonitor

    mon = UtilisationMonitor(llm, num_requests=1, prompt_len=8, max_tokens=2, period_s=0.02)
    own = mon.series.data[-1]
    assert own.name.startswith("this process's CPU") and len(own.y) == len(mon.samples)
    assert mon.series.data[0].name.startswith("machine CPU busy %")


def test_refused_clicks_show_one_message_and_keep_the_last_results(llm, model_path):
    """A second refused click stacked a second error box over the first (PrefixCacheView); a demo
    whose second engine was busy kept a new result beside an old one (ChunkedPrefillDemo); the
    explorer's Draw button lost its refusal to the kernel log."""
    from widgets import ChunkedPrefillDemo, PrefixCacheView, SamplingExplorer

    view = PrefixCacheView(llm, ids(20, start=3), [ids(4, start=81), ids(4, start=91)], repeats=1, run=False)
    llm.llm_engine.add_request("busy", ids(8), _greedy(2))
    view.run_button.click()
    view.run_button.click()
    assert view.grid.value.count("unfinished") == 1
    llm.llm_engine.abort_request("busy")

    demo = ChunkedPrefillDemo.from_model(model_path, budget=32, max_model_len=256, long_prompt_len=40,
                                         num_decoders=1, decode_tokens=12, run=False)
    whole = demo.llms["whole"].llm_engine
    whole.add_request("busy", ids(8), _greedy(2))
    demo.run_button.click()
    assert "busy" in demo.readout.value and demo.results == {}
    whole.abort_request("busy")

    ex = SamplingExplorer(llm, prompt="[]")  # refused at load: nothing to draw from
    ex.draw_button.click()
    assert "no distribution to draw from" in ex.readout.value
