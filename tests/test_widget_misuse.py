"""The EngineStepper and friends used the way a learner might: overlapping runs, interrupts
between steps, a step that raises, Stop or Reset at awkward moments, a widget built on a
temporary LLM or kept after ``shutdown()``, mistyped token ids. Each test failed before its fix
(an adversarial review of the widgets, 2026-12-04)."""
from __future__ import annotations

import asyncio
import gc
import re
import signal
import time

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


def test_a_run_clicked_while_an_async_cell_awaited_stops_on_an_interrupt_after_the_cell(llm):
    """The run's handler went in over the async cell's; when the cell ended ipykernel put its idle
    'ignore' back, and Kernel > Interrupt no longer reached the run (it ran to its end)."""
    import os

    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=200, ignore_eos=True)

    async def scenario():
        idle = signal.signal(signal.SIGINT, signal.SIG_IGN)  # an idle kernel ignores SIGINT
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # an async cell starts (pre_handler_hook)
            s.run_button.click()  # during its await
            while len(s.steps) < 2:
                await asyncio.sleep(0.001)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cell ends (post_handler_hook)
            while len(s.steps) < 4:
                await asyncio.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)  # Kernel > Interrupt
            while s.is_running:
                await asyncio.sleep(0.002)
            return signal.getsignal(signal.SIGINT)
        finally:
            signal.signal(signal.SIGINT, idle)

    after = asyncio.run(scenario())
    assert "interrupted" in s.last_message and len(s.steps) < 200, s.last_message
    assert after == signal.SIG_IGN  # the idle kernel's handler is back
    llm.llm_engine.check_invariants()
    s.reset()


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


def test_after_shutdown_the_other_widgets_buttons_and_sliders_say_so(model_path):
    """Chapter 12 shuts its engine down after the utilisation monitor's cell: "Run workload" then did
    nothing visible (add_request's RuntimeError reached only the kernel log), and the latency
    calculator's sliders raised from their callback (update() read the engine's block manager)."""
    from widgets import LatencyCalculator, UtilisationMonitor

    llm = make(model_path)
    monitor = UtilisationMonitor(llm, num_requests=2, prompt_len=8, max_tokens=2)
    calc = LatencyCalculator(llm, sweeps={llm.llm_engine.source.name: _rows_with_r2(True)})
    llm.shutdown()
    monitor.run_button.click()
    assert "shut down" in monitor.readout.value and monitor.records == []
    calc.prompt_slider.value = 9  # redraws the prediction from the fitted model alone
    assert calc.prediction["ttft_ms"] > 0
    calc.measure_button.click()
    assert "shut down" in calc.readout.value and calc.measurements == []


def test_stepper_ids_limits_and_long_outputs(llm):
    """A refused prompt used up a request id (the next was req-5 after four refusals); the max_tokens
    box went to 4096 whatever max_model_len; a long run's outputs were all drawn (1021 spans)."""
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    assert s.max_tokens_box.max == llm.llm_engine.config.max_model_len
    for bad in ("", "[1, 2,", f"[{llm.llm_engine.vocab_size}]"):
        s.prompt_box.value = bad
        s.add_button.click()
        assert s.last_message.startswith("not added:"), bad
    rid = s.add_request(ids(4), max_tokens=600, ignore_eos=True)
    assert rid == "req-0"  # the first id: the refusals took none
    s.run_to_end()
    html = s._requests_html()
    assert html.count("output ") == 512 and "88 earlier outputs" in html
    s.reset()


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


def test_measurements_take_every_length_that_fits_and_name_a_bad_one(llm):
    """measure_step_latency refused a prompt that fits (59 + 4 + 1 = 64 tokens in max_model_len=64:
    its check was off by one) without naming decode_steps, and measure_request_latency with batch=0
    failed inside statistics.fmean."""
    from widgets.measure import measure_request_latency, measure_step_latency

    mml = llm.llm_engine.config.max_model_len
    rows = measure_step_latency(llm, prompt_lens=(mml - 5,), decode_steps=4, repeats=1, roofline=False)
    assert {r["phase"] for r in rows} >= {"prefill", "decode"} and rows[-1]["context_len"] == mml - 1
    with pytest.raises(ValueError, match=rf"prompt length {mml - 4} \+ decode_steps=4 \+ 1 .* max_model_len={mml}"):
        measure_step_latency(llm, prompt_lens=(8, mml - 4), decode_steps=4, repeats=1)
    for bad, match in (((0,), "prompt length 0"), ((8.0,), "prompt length 8.0")):
        with pytest.raises(ValueError, match=match):
            measure_step_latency(llm, prompt_lens=bad)
    with pytest.raises(ValueError, match="decode_steps=-1"):
        measure_step_latency(llm, prompt_lens=(8,), decode_steps=-1)
    for args, match in (((8, 4, 0), "batch=0"), ((8, 0, 1), "max_tokens=0"), ((0, 4, 1), "prompt_len=0"),
                        ((mml, 1, 1), f"prompt_len={mml} \\+ max_tokens=1: more than max_model_len")):
        with pytest.raises(ValueError, match=match):
            measure_request_latency(llm, *args)
    assert not llm.llm_engine.has_unfinished_requests()


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

    import numpy as np

    with pytest.raises(ValueError, match="max_run_steps=0"):
        EngineStepper(llm, max_run_steps=0)
    with pytest.raises(ValueError, match="max_run_steps=True"):
        EngineStepper(llm, max_run_steps=True)
    s = EngineStepper(llm, show_chart=False, max_run_steps=np.int64(3))  # a numpy count, as the other widgets take
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


# -- a reviewer's drive through every widget in JupyterLab: each test failed before its fix ------------


def test_chunked_demo_warms_each_engine_up_and_says_so(llm, model_path, monkeypatch):
    """A new engine's first scenario run pays one-off costs (CPU graphs recorded, caches cold): measured
    straight after from_model, its worst gap could be several times a second run's and flip the lesson."""
    import widgets.chunked_prefill_demo as cpd

    whole = LLM(model_path, block_size=BLOCK, num_kvcache_blocks=32, enable_chunked_prefill=False)
    try:
        calls = []

        def fake(llm_, **scenario):  # a first run per engine slower than the rest, as a cold engine's is
            calls.append(llm_)
            first = calls.count(llm_) == 1
            gap = 100.0 if first else 10.0 + len(calls)
            return dict(itl_ms=[[1.0, gap]], token_times_ms=[[0.0, 1.0, 2.0]], long_ttft_ms=gap,
                        prefill_steps=1, max_itl_ms=gap)

        monkeypatch.setattr(cpd, "itl_around_long_prompt", fake)
        demo = cpd.ChunkedPrefillDemo(llm, whole, long_prompt_len=32)
        assert calls == [llm, llm, whole, whole]  # an unrecorded run first on each engine
        assert all(r["max_itl_ms"] != 100.0 for r in demo.results.values())
        assert "warm-up" in demo.readout.value and "one measured run each" in demo.readout.value
        calls.clear()
        demo = cpd.ChunkedPrefillDemo(llm, whole, long_prompt_len=32, repeats=3)
        assert len(calls) == 2 * (1 + 3)
        c = demo.results["chunked"]  # measured gaps 12, 13, 14: the median run is kept and drawn
        assert c["max_itl_ms"] == 13.0 and [r["max_itl_ms"] for r in c["runs"]] == [12.0, 13.0, 14.0]
        assert "medians of 3 measured runs" in demo.readout.value
    finally:
        whole.shutdown()


def test_stepper_says_when_steps_ran_outside_it_and_its_views_catch_up(llm):
    """llm.generate in another cell (or a second stepper on the engine) stepped the engine behind the
    stepper's back: its status said nothing, and on the idle path the KV view and timeline were not redrawn."""
    from widgets import EngineStepper, KVCacheView, SchedulerTimeline

    engine = llm.llm_engine
    s = EngineStepper(llm, show_chart=False)
    kv = KVCacheView(llm, stepper=s)
    tl = SchedulerTimeline(stepper=s)
    s.add_request(ids(10), max_tokens=6, ignore_eos=True)
    s.step()
    assert "outside this widget" not in s.last_message
    before = engine.step_index
    llm.generate([ids(6, start=20)], _greedy(2), use_tqdm=False)  # another cell: steps the stepper's request too
    outside = engine.step_index - before
    assert outside >= 1
    s.step()
    assert f"{outside} engine step{'s' if outside != 1 else ''} ran outside this widget" in s.last_message
    assert s.outside_steps == outside

    other = EngineStepper(llm, show_chart=False)  # a second stepper on the same engine
    s.step()
    other.add_request(ids(4, start=30), max_tokens=1, ignore_eos=True)
    other.step()
    assert "1 engine step ran outside this widget" in other.last_message

    while engine.has_unfinished_requests():
        engine.step()  # the rest of the work done elsewhere: the stepper's next press finds nothing to run
    refreshed = kv.refresh_count
    s.step()
    assert "all requests finished" in s.last_message and "ran outside this widget" in s.last_message
    assert kv.refresh_count > refreshed  # the attached views were redrawn on the idle path
    assert tl.num_steps == len(s.steps)
    assert "mv-tok-chunk" not in s.requests_pane.value.split("</div>", 1)[1]  # no stale chunk from an old step


def test_stepper_says_its_request_was_aborted_elsewhere_not_finished(llm):
    """Chapter 10's timing cell aborted the stepper's half-done request (idle_engine); the stepper's next
    Step then said "all requests finished", which the request had not."""
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.reset()
    rid = s.add_request(ids(8), max_tokens=6, ignore_eos=True)
    s.step()
    llm.llm_engine.abort_request(rid)  # another cell
    s.step()
    assert f"{rid} aborted outside this widget" in s.last_message and "finished" not in s.last_message
    s.reset()


def test_stepper_idle_message_names_what_finished_beside_what_was_aborted_or_failed(llm):
    """After a request aborted elsewhere, a later request run to its end through the stepper was left
    out: every idle Step still said only "req-0 aborted outside this widget", as if nothing had
    finished since (chapter 10: its timing cell aborts the stepper's request, the learner goes on)."""
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.reset()
    first = s.add_request(ids(8), max_tokens=6, ignore_eos=True)
    s.step()
    llm.llm_engine.abort_request(first)  # another cell
    second = s.add_request(ids(6, start=40), max_tokens=2, ignore_eos=True)
    failed = s.add_request(ids(5, start=60), max_tokens=3, ignore_eos=True, temperature=0.01, seed=3,
                           repetition_penalty=1e-37)  # every logit overflows: no token can be sampled
    while llm.llm_engine.has_unfinished_requests():
        s.step()
    s.step()
    msg = s.last_message
    assert msg.startswith("nothing left to run: ")
    assert f"{second} finished" in msg and f"{first} aborted outside this widget" in msg
    assert f"{failed} ended with an error" in msg and f"{failed} finished" not in msg
    s.reset()


def test_stepper_names_a_recompute_after_preemption_and_marks_the_recomputed_outputs(model_path):
    """A request recomputed after a preemption was labelled "prefilled: first token", and only its
    prompt positions were coloured as this step's chunk."""
    import re

    from widgets import EngineStepper

    small = LLM(model_path, block_size=BLOCK, num_kvcache_blocks=4, max_model_len=64, max_num_batched_tokens=32)
    try:
        s = EngineStepper(small, show_chart=False)
        for k in range(3):
            s.add_request(ids(12, start=3 + k), max_tokens=12, ignore_eos=True)
        seen = 0
        while small.llm_engine.has_unfinished_requests():
            s.step()
            for e in s.steps[-1].scheduled:
                seq = s.sequence(e.request_id)
                if not (e.is_prefill and e.first_position + e.num_tokens > seq.num_prompt_tokens):
                    continue  # not a prefill that reaches into the outputs: not a recompute
                seen += 1
                row = re.search(rf"data-request='{e.request_id}'.*?</div>", s.requests_pane.value, re.S).group(0)
                badge = re.search(r"class='mv-badge'[^>]*>([^<]*)<", row).group(1)
                assert "recomput" in badge and "prefilled: first token" not in badge, badge
                outputs = row.split("output:", 1)[1]
                assert "mv-tok-chunk" in outputs  # the recomputed output tokens are this step's chunk
        assert seen, "no step recomputed a preempted request"
    finally:
        small.shutdown()


def test_latency_model_fits_decode_to_warm_steps_only():
    """measure_step_latency's decode rows are the first decodes after a prefill (cold, slower): they
    were fitted as batch 1 beside measure_decode_batch's warm ones and set the median."""
    from widgets import LatencyModel

    rows = [dict(phase="prefill", tokens=n, wall_ms=2.0 + 0.01 * n) for n in (16, 64, 256)]
    cold = [dict(phase="decode", tokens=1, prompt_len=16, wall_ms=3.0) for _ in range(5)]
    warm = [dict(phase="decode", batch=b, wall_ms=1.0 + 0.25 * b) for b in (1, 2, 4)]
    m = LatencyModel.fit(rows + cold + warm)
    assert m.decode_base_ms == pytest.approx(1.0) and m.ms_per_decode_seq == pytest.approx(0.25)
    assert not m.cold_decode and "cold" not in m.describe()
    only_cold = LatencyModel.fit(rows + cold)  # nothing warmer to fit: used, and said
    assert only_cold.cold_decode and "cold" in only_cold.describe()


def _rows_with_r2(good: bool) -> list[dict]:
    """Sweep rows (made up) whose fit is exact, or scattered far from any line."""
    if good:
        pre = [(n, 1.0 + 0.1 * n) for n in (8, 16, 32, 64)]
    else:
        pre = [(8, 9.0), (16, 1.0), (32, 12.0), (64, 2.0)]
    rows = [dict(phase="prefill", tokens=n, wall_ms=ms) for n, ms in pre]
    return rows + [dict(phase="decode", batch=b, wall_ms=2.0 + 0.2 * b) for b in (1, 2)]


def test_latency_calculator_sweeps_repeats_and_warns_of_a_poor_fit(llm, monkeypatch):
    """The default sweep ran each prefill size once (a per-shape median of one), and an R² of 0.54
    was shown only in grey small print."""
    import widgets.latency_calculator as lc

    asked = {}
    monkeypatch.setattr(lc, "measure_step_latency",
                        lambda llm_, lens, **kw: asked.update(kw) or _rows_with_r2(False)[:4])
    monkeypatch.setattr(lc, "measure_decode_batch", lambda llm_, sizes, **kw: _rows_with_r2(False)[4:])
    calc = lc.LatencyCalculator(llm)
    assert asked["repeats"] == 3
    model = next(iter(calc.models.values()))
    assert model.r2 < lc.LatencyCalculator.MIN_R2
    assert "fits its own measurements poorly" in calc.readout.value
    note = re.search(r"<div class='([^']*)'[^>]*>⚠ the cost model fits", calc.readout.value)
    assert note and "mv-small" not in note.group(1)  # at the readout's size, not in small print
    good = lc.LatencyCalculator(llm, sweeps={llm.llm_engine.source.name: _rows_with_r2(True)})
    assert "fits its own measurements poorly" not in good.readout.value


def test_latency_calculator_fits_a_short_max_model_len_and_says_why(model_path):
    """max_model_len <= 130 made the prompt slider's top fall below its bottom (TraitError)."""
    from widgets import LatencyCalculator

    short = LLM(model_path, block_size=BLOCK, num_kvcache_blocks=16, max_model_len=64, max_num_batched_tokens=64)
    try:
        calc = LatencyCalculator(short, sweeps={short.llm_engine.source.name: _rows_with_r2(True)})
        assert calc.prompt_slider.max + calc.response_slider.max <= 64
        assert calc.prompt_slider.min <= calc.prompt_slider.value <= calc.prompt_slider.max
        assert "max_model_len=64" in calc.limit_note.value
    finally:
        short.shutdown()


def test_latency_calculator_labels_without_exponents_and_one_error_per_refusal(llm):
    """Bar labels read "1.87e+3 ms"; each refused "measure this point" click added another copy of the error."""
    from widgets import LatencyCalculator

    slow = [dict(phase="prefill", tokens=n, wall_ms=1000.0 + n) for n in (8, 64)]  # every TTFT over a second
    slow += [dict(phase="decode", batch=b, wall_ms=2.0 + 0.2 * b) for b in (1, 2)]
    calc = LatencyCalculator(llm, sweeps={llm.llm_engine.source.name: slow})
    calc.prompt_slider.value = calc.prompt_slider.max
    labels = list(calc.chart.data[0].text)
    assert calc.prediction["ttft_ms"] >= 1000 and all(labels) and not any("e+" in t for t in labels), labels
    llm.llm_engine.add_request("busy", ids(8), _greedy(2))
    try:
        calc.measure_button.click()
        calc.measure_button.click()
        assert calc.readout.value.count("unfinished") == 1
    finally:
        llm.llm_engine.abort_request("busy")


def test_no_chart_legend_sits_over_its_title_and_every_title_has_room(llm, model_path):
    """A legend above the plot (y=1.02, anchored at its bottom) covered the provenance line under the
    title (EngineStepper, SamplingExplorer); at 560 and 620 px that line was cut off (LatencyCalculator,
    PrefixCacheView)."""
    charts, whole = _widgets._charts_of_every_widget(llm, model_path)
    try:
        for name, fig, _ in charts:
            legend = fig.layout.legend
            assert legend.y is None or legend.y <= 1, f"{name}: legend in the title's band (y={legend.y})"
            assert fig.layout.width >= 760, name
    finally:
        whole.shutdown()


def test_empty_charts_start_at_zero_and_legend_colours_are_distinct(llm):
    """Empty charts showed axes from -1 (negative times, steps and token counts); the scheduler
    timeline's legend had two entries of each colour ("prefill" and "prefill tokens")."""
    from widgets import EngineStepper, SchedulerTimeline

    s = EngineStepper(llm)
    assert s.chart.layout.yaxis.rangemode == "nonnegative" and s.chart.layout.xaxis.range[0] > -1
    tl = SchedulerTimeline()
    assert tl.chart.layout.yaxis2.rangemode == "nonnegative" and tl.chart.layout.xaxis2.range[0] > -1
    shown = [t for t in tl.chart.data if t.showlegend is not False and t.name]
    colours = [t.marker.color for t in shown]
    assert len(colours) == len(set(colours)), colours
    s.add_request(ids(6), max_tokens=1, ignore_eos=True)
    s.step()
    assert s.chart.layout.xaxis.range is None  # with steps, plotly's own range (a bar's half-width shows)


def test_labels_are_not_cut(llm):
    """"temperature" showed as "temperat…" and the explorer's button as "Next-token dis…"."""
    from widgets import EngineStepper, SamplingExplorer

    s = EngineStepper(llm, show_chart=False)
    assert s.temperature_box.style.description_width == "initial"
    assert s.max_tokens_box.style.description_width == "initial"
    ex = SamplingExplorer(llm, prompt="[5, 6]", top_n=3)
    assert ex.load_button.layout.width == "auto"


def test_cpu_busy_without_a_clock_tick_is_not_zero_percent(monkeypatch):
    """Two readings with no clock tick between them gave 0 % busy: such a sample measured nothing."""
    import psutil

    from minivllm.telemetry import utilisation

    t = psutil.cpu_times(percpu=True)
    assert utilisation._busy(t[0], t[0]) is None
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: t)  # the counters never move
    s = utilisation.UtilisationSampler(period_s=0.001, device="cpu")
    s.start()
    time.sleep(0.02)  # some periods of the thread: each of its samples finds no tick and is skipped
    s.stop()
    samples = s.samples
    assert len(samples) == 1 and samples[0].cpu_percent is None  # the run's only sample, kept, unmeasured


def test_utilisation_monitor_warns_of_few_samples_and_says_it_was_interrupted(llm, monkeypatch):
    from widgets import UtilisationMonitor

    mon = UtilisationMonitor(llm, num_requests=1, prompt_len=8, max_tokens=2, period_s=60.0)  # only stop()'s sample
    mon.run()
    assert len(mon.samples) == 1 and "only 1 utilisation sample" in mon.readout.value
    engine = llm.llm_engine
    real, calls = engine.step_with_record, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Kernel > Interrupt during the second step
        return real()

    monkeypatch.setattr(engine, "step_with_record", interrupted_step)
    mon = UtilisationMonitor(llm, num_requests=1, prompt_len=8, max_tokens=4, period_s=0.02)
    with pytest.raises(KeyboardInterrupt):
        mon.run()
    assert mon.interrupted and "interrupted (Kernel &gt; Interrupt) after 1 step: the charts show a partial" \
        in mon.readout.value
    assert not engine.requests
    calls[:] = [1]  # interrupted in its first step: "the charts show a partial workload" of nothing read oddly
    mon = UtilisationMonitor(llm, num_requests=1, prompt_len=8, max_tokens=4, period_s=0.02)
    with pytest.raises(KeyboardInterrupt):
        mon.run()
    assert "after 0 steps: no step had finished, so the charts show no step" in mon.readout.value
    assert not engine.requests


def test_log_axes_use_si_prefixes(llm):
    """The roofline's FLOP/s axis read "100B / 10B" (plotly's B for billion); the static SVG's log
    ticks read "1e+11"."""
    import plotly.graph_objects as go

    from widgets import UtilisationMonitor
    from widgets._static import figure_svg

    mon = UtilisationMonitor(llm)
    assert mon.roofline.layout.yaxis.exponentformat == "SI" == mon.roofline.layout.xaxis.exponentformat
    fig = go.Figure(go.Scatter(x=[1, 10], y=[2e9, 9e10], mode="markers"))
    fig.update_layout(yaxis_type="log")
    svg = figure_svg(fig)
    assert ">100G<" in svg and ">1G<" in svg and "e+" not in svg


def test_idle_engine_aborts_what_a_stepper_left_before_a_cells_own_steps(llm, capsys):
    """Chapters 02 and 10: a stepper widget's request, left mid-decode (a learner's clicks add more), joined
    later cells' own steps: a 7-token prefill counted as an 8-token mixed step, a correct prediction marked
    wrong, section 5 ending in min() of an empty sequence."""
    from widgets import EngineStepper, idle_engine

    stepper = EngineStepper(llm, show_chart=False)
    stepper.reset()
    stepper.add_request(ids(8, start=3), max_tokens=20, ignore_eos=True)
    stepper.step()
    stepper.step()
    engine = llm.llm_engine
    left = list(engine.requests)
    assert idle_engine(llm) == left and not engine.has_unfinished_requests()
    assert f"aborted 1 unfinished request(s) left on the engine by a widget or an earlier cell: {left}" in \
        capsys.readouterr().out
    engine.add_request("own", ids(7, start=40), _greedy(2))
    assert engine.step_with_record().record.num_tokens == 7  # the cell's prefill alone
    while engine.has_unfinished_requests():
        engine.step()
    assert idle_engine(llm) == [] and capsys.readouterr().out == ""  # idle: says nothing
    engine.check_invariants()


def test_bounded_number_boxes_say_their_range(model_path):
    """A number typed past a box's bound was set to the bound with nothing saying why (ipywidgets'
    bounded boxes clamp): each box's tooltip now gives its range."""
    from widgets import EngineStepper, SamplingExplorer, UtilisationMonitor

    llm = make(model_path)
    try:
        monitor = UtilisationMonitor(llm, num_requests=2, prompt_len=8, max_tokens=2)
        for box in (monitor.num_requests, monitor.prompt_len, monitor.max_tokens):
            assert f"to {box.max}" in box.tooltip
        stepper = EngineStepper(llm, show_chart=False)
        assert f"max_model_len = {stepper.max_tokens_box.max}" in stepper.max_tokens_box.tooltip
        assert "to 5" in stepper.temperature_box.tooltip
        explorer = SamplingExplorer(llm)
        assert "100,000" in explorer.n_draws.tooltip and explorer.n_draws.max == 100_000
    finally:
        llm.shutdown()


@pytest.mark.parametrize("period_s", [-1, 0, float("inf"), float("nan"), "0.1"])
def test_a_bad_sampling_period_is_refused_before_any_request_is_queued(llm, period_s):
    """``period_s`` was read first by the sampler, built after the workload was queued: its
    ValueError left the requests on the engine, and every later measurement refused "the engine is
    busy". Now refused when the monitor is built, and (set afterwards) before a request is queued."""
    from widgets import UtilisationMonitor

    with pytest.raises(ValueError, match="period_s must be a positive, finite number of seconds"):
        UtilisationMonitor(llm, num_requests=2, prompt_len=8, max_tokens=2, period_s=period_s)
    mon = UtilisationMonitor(llm, num_requests=2, prompt_len=8, max_tokens=2)
    mon.period_s = period_s
    with pytest.raises(ValueError, match="period_s"):
        mon.run()
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_the_png_and_the_svg_fallback_take_the_same_size(monkeypatch):
    """The PNG let the figure's own width win over the ``width`` argument and the SVG the argument,
    so ``figure_html(fig, width=W)`` differed with and without Chrome."""
    import plotly.graph_objects as go

    import widgets._static as static
    from widgets._static import figure_png, figure_svg, image_size

    asked = []
    monkeypatch.setattr(static, "_ensure_server", lambda: True)  # no Chrome needed: the export call is recorded
    monkeypatch.setattr(go.Figure, "to_image", lambda self, **kw: asked.append((kw["width"], kw["height"])) or b"")
    figure_png(go.Figure(layout=dict(width=500, height=300)), 900)
    figure_png(go.Figure(layout=dict(width=500, height=300)))
    assert asked == [(900, 300), (500, 300)]

    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]), layout=dict(width=500, height=300))
    assert image_size(fig) == (500, 300) and image_size(fig, 900) == (900, 300)
    assert image_size(go.Figure()) == (760, 360)
    assert "width='900' height='300'" in figure_svg(fig, 900) and "width='500' height='300'" in figure_svg(fig)


def test_widget_arguments_that_gave_no_rows_or_a_deep_error_are_refused_by_name(llm):
    """From a docstring review: repeats=0 and batch size 0 returned no rows without a word; a string of
    prompts became one prompt per letter; top_n=-1 showed 4095 tokens; max_blocks=-1 hid the last block;
    num_decoders=0 blamed decode_tokens; an unknown request id was a bare KeyError."""
    from widgets import EngineStepper, KVCacheView, PrefixCacheView, SamplingExplorer
    from widgets.chunked_prefill_demo import itl_around_long_prompt
    from widgets.measure import measure_decode_batch, measure_step_latency

    cases = [
        (lambda: measure_step_latency(llm, (8,), repeats=0), "repeats=0 must be a positive int"),
        (lambda: measure_decode_batch(llm, (0,)), "batch size 0 must be a positive int"),
        (lambda: measure_decode_batch(llm, ("2",)), "batch size '2' must be a positive int"),
        (lambda: measure_decode_batch(llm, (1,), decode_steps=-3), "decode_steps=-3: must be an int >= 0"),
        (lambda: PrefixCacheView(llm, "system", "ab", run=False), "user_prompts='ab': give a list"),
        (lambda: PrefixCacheView(llm, "system", ["a", "b"], repeats=1.5, run=False), "repeats=1.5 must be an int"),
        (lambda: SamplingExplorer(llm, top_n=-1), "top_n=-1: show at least one token"),
        (lambda: KVCacheView(llm, max_blocks=-1), "max_blocks=-1: draw at least one block"),
        (lambda: itl_around_long_prompt(llm, num_decoders=0), "num_decoders=0: must be an int >= 1"),
        (lambda: itl_around_long_prompt(llm, decode_tokens=1), "decode_tokens=1: must be an int >= 2"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    assert not llm.llm_engine.has_unfinished_requests()
    explorer = SamplingExplorer(llm, top_n=5)
    for bad in ("a", 2.7, 0):
        with pytest.raises(ValueError, match=re.escape(f"n={bad!r}: draw a whole number")):
            explorer.draw(bad)
    stepper = EngineStepper(llm)
    with pytest.raises(KeyError, match="request 'nope' was not added through this widget"):
        stepper.sequence("nope")
    # numpy integers (a sweep's np.arange) and a whole float draw count are counts as before
    import numpy as np

    assert [r["batch"] for r in measure_decode_batch(llm, 2 ** np.arange(2), prompt_len=np.int64(4),
                                                     decode_steps=np.int64(1), warmup_steps=0)] == [1, 2]
    assert measure_step_latency(llm, (np.int64(4),), decode_steps=1, repeats=np.int64(1), roofline=False)
    assert KVCacheView(llm, max_blocks=np.int64(8)).max_blocks == 8
    assert sum(explorer.draw(3.0).values()) == 3


def test_latency_model_refuses_a_bool_count():
    from widgets.latency_model import LatencyModel

    model = LatencyModel(prefill_base_ms=1.0, ms_per_prefill_token=0.01, decode_base_ms=1.0, ms_per_decode_seq=0.1,
                         r2=1.0, n_points=4)
    with pytest.raises(ValueError, match="batch=True: must be a positive int"):
        model.predict(4, 8, batch=True)


# -- interrupts at the widgets' slow or unguarded points (an interrupt audit, 2026-12-07) --------------


def _interrupt_on_call(monkeypatch, owner, name: str, n: int) -> None:
    """Make ``owner.name`` raise KeyboardInterrupt on its ``n``-th call (a learner's Interrupt there)."""
    real, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def test_an_interrupt_in_a_first_steps_peaks_measurement_runs_no_step(llm, monkeypatch):
    """The stepper measured the machine's peaks (seconds, the first time) after the step: an interrupt
    there said "rolled back" while the step had run, and it was missing from the widget's history."""
    import minivllm.telemetry.peaks as peaks_mod
    from widgets import EngineStepper

    engine = llm.llm_engine
    monkeypatch.setattr(engine, "peaks", None)
    _interrupt_on_call(monkeypatch, peaks_mod, "get_peaks", 1)  # Kernel > Interrupt while the peaks are measured
    s = EngineStepper(llm)
    s.add_request(ids(8), max_tokens=3, ignore_eos=True)
    before = engine.step_index
    s.step_button.click()
    assert "rolled back" in s.last_message and engine.step_index == before and s.steps == []
    s.step_button.click()
    assert [r.index for r in s.steps] == [before] and s.steps[0].mfu is not None
    s.reset()


def test_an_interrupt_after_the_step_ran_keeps_it_and_says_so(llm, monkeypatch):
    from widgets import EngineStepper

    s = EngineStepper(llm)
    s.add_request(ids(8), max_tokens=3, ignore_eos=True)
    s.step()  # the peaks are resolved: what is slow now is redrawing the views
    engine = llm.llm_engine

    def interrupted(record):
        raise KeyboardInterrupt

    monkeypatch.setattr(s, "_notify", interrupted)
    s.step_button.click()
    assert s.steps[-1].index == engine.step_index - 1
    assert f"interrupted after engine step {engine.step_index - 1} ran (it is recorded" in s.last_message
    monkeypatch.undo()
    s.reset()


def test_an_interrupt_between_a_measurements_adds_leaves_nothing_queued(llm, monkeypatch):
    """run_requests and the chunked-prefill demo added their requests before their cleanup's try:
    an interrupt between two adds left the first queued, and every later measurement refused."""
    from widgets.chunked_prefill_demo import itl_around_long_prompt
    from widgets.measure import run_requests

    engine = llm.llm_engine
    _interrupt_on_call(monkeypatch, engine, "add_request", 2)
    with pytest.raises(KeyboardInterrupt):
        run_requests(llm, [ids(8), ids(8, start=3)], max_tokens=2)
    assert not engine.has_unfinished_requests()
    monkeypatch.undo()
    _interrupt_on_call(monkeypatch, engine, "add_request", 2)
    with pytest.raises(KeyboardInterrupt):
        itl_around_long_prompt(llm, num_decoders=2, decoder_prompt_len=8, decode_tokens=4, long_prompt_len=16,
                               arrive_after=1)
    assert not engine.has_unfinished_requests()


def test_an_interrupt_while_the_utilisation_monitor_starts_leaves_no_request_or_sampler(llm, monkeypatch):
    import threading

    from minivllm.telemetry.utilisation import UtilisationSampler
    from widgets import UtilisationMonitor

    engine = llm.llm_engine
    mon = UtilisationMonitor(llm, num_requests=3, prompt_len=8, max_tokens=2, period_s=0.02)
    _interrupt_on_call(monkeypatch, engine, "add_request", 2)
    with pytest.raises(KeyboardInterrupt):
        mon.run()
    assert not engine.has_unfinished_requests()
    monkeypatch.undo()
    real_start = UtilisationSampler.start

    def start_then_interrupt(self):
        real_start(self)
        raise KeyboardInterrupt  # at the end of start(): the thread runs

    monkeypatch.setattr(UtilisationSampler, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        mon.run()
    assert not engine.has_unfinished_requests()
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name == "minivllm-utilisation"]
    monkeypatch.undo()
    assert mon.run()  # and the next run works


def test_an_interrupt_while_a_button_disables_itself_does_not_leave_it_disabled(llm, monkeypatch):
    """The latency calculator and the chunked-prefill demo disabled their button before their try:
    an interrupt while the change reached the browser left it disabled for good."""
    from widgets import LatencyCalculator

    calc = LatencyCalculator(llm, sweeps={llm.llm_engine.source.name: _rows_with_r2(True)})

    def interrupt_on_disable(change):
        if change["new"]:
            raise KeyboardInterrupt

    calc.measure_button.observe(interrupt_on_disable, "disabled")
    with pytest.raises(KeyboardInterrupt):
        calc.measure()
    assert calc.measure_button.disabled is False
