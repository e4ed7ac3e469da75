"""Headless tests of the course widgets: buttons pressed through ``Button.click()``, sliders
moved through their ``value``, against the real engine (embedded model; a tiny random model
with the same tokenizer when the embedded one is absent)."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from minivllm import LLM  # noqa: E402
from minivllm.utils import cdiv  # noqa: E402
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR  # noqa: E402

BLOCK = 16
ROOT = Path(__file__).resolve().parents[1]


def _model_path(tmp_path_factory) -> str:
    if (EMBEDDED_MODEL_DIR / "config.json").is_file():
        return "minivllm-tiny"
    tok_dir = Path(os.environ.get("TMPTOK", EMBEDDED_MODEL_DIR))
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.skip("neither the embedded model nor a tokenizer ($TMPTOK) is available")
    import shutil

    from helpers_models import make_hf_checkpoint

    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    ckpt = make_hf_checkpoint(tmp_path_factory.mktemp("widgets"), vocab_size=vocab, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, ckpt / name)
    return str(ckpt)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return _model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def shared_llm(model_path):
    llm = LLM(model_path, block_size=BLOCK, num_kvcache_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    yield llm
    llm.shutdown()


@pytest.fixture
def llm(shared_llm):
    """The module's LLM, left idle and consistent after each test."""
    yield shared_llm
    engine = shared_llm.llm_engine
    engine.check_invariants()
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.reset_prefix_cache()
    assert engine.block_manager.num_used_blocks == 0
    assert gc.get_freeze_count() == 0  # no widget leaves the heap frozen


def ids(n: int, start: int = 5) -> list[int]:
    """``n`` distinct-ish token ids (no eos risk with ignore_eos)."""
    return [start + (i * 7) % 50 for i in range(n)]


def chart_points(stepper) -> int:
    return sum(len(t.x) for t in stepper.chart.data)


# -- EngineStepper ---------------------------------------------------------------------------


def test_stepper_step_button_runs_prefill_then_decodes(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm)
    engine = llm.llm_engine
    s.prompt_box.value = "[" + ", ".join(map(str, ids(20))) + "]"
    s.max_tokens_box.value = 5
    s.add_button.click()
    assert s.request_ids == ["req-0"], s.last_message
    seq = s.sequence("req-0")
    assert seq.num_prompt_tokens == 20
    assert s.generated_token_count == 0 and s.kv_blocks_used == 0

    s.step_button.click()  # the whole prompt fits the 64-token budget: one prefill step
    first = s.steps[-1]
    assert first.phase == "prefill" and first.num_prefill_tokens == 20
    assert s.processed_prompt_tokens == 20
    assert s.generated_token_count == 1
    assert s.kv_blocks_used == 2 == cdiv(20, BLOCK)
    assert chart_points(s) == 1
    assert "mv-tok-chunk" in s.requests_pane.value  # this step's chunk is highlighted
    engine.check_invariants()

    s.step_button.click()
    assert s.steps[-1].phase == "decode" and s.steps[-1].num_decode_tokens == 1
    assert s.generated_token_count == 2
    assert chart_points(s) == 2
    assert "<span class='mv-generated-count'>2</span>" in s.step_pane.value
    assert s.steps[-1].mfu is not None and s.steps[-1].mfu > 0  # roofline figures filled
    engine.check_invariants()


def test_stepper_names_the_engines_own_peaks_when_they_filled_the_record(llm):
    """An engine that measured its peaks (``LLMEngine.measure_peaks``) fills its records' MFU and
    MBU itself; the stepper's MBU line then names those peaks (it printed "(... moved; )")."""
    from minivllm.telemetry.peaks import Peaks
    from widgets import EngineStepper

    engine = llm.llm_engine
    saved = engine.peaks
    engine.peaks = Peaks(1e11, 2e10, "cpu", "float32", {"source": "measured", "measured_at": "t0"}, 2.5e10)
    try:
        s = EngineStepper(llm)
        s.add_request("[" + ", ".join(map(str, ids(8))) + "]", max_tokens=2)
        s.step()
        assert s.steps[-1].mfu is not None
        assert "moved; peaks on this device" in s.step_pane.value and "; )" not in s.step_pane.value
        s.step()
    finally:
        engine.peaks = saved


def test_stepper_says_whose_work_its_mfu_counts_on_a_tensor_parallel_engine(llm, monkeypatch):
    """On chapter 10's two-rank engine the stepper's MFU and MBU counted the whole model's work (engine_cost)
    against one device's peaks without saying so; where the engine fills them, they are rank 0's share."""
    from minivllm.telemetry.peaks import Peaks
    from widgets import EngineStepper

    engine = llm.llm_engine
    monkeypatch.setattr(engine.config.args, "tensor_parallel_size", 2)  # only the label reads it here
    s = EngineStepper(llm, show_chart=False)
    s.reset()
    s.add_request(ids(8), max_tokens=2, ignore_eos=True)
    s.step()
    assert "the whole model's FLOPs and bytes, which its 2 ranks share, against one device's peaks" in s.step_pane.value
    monkeypatch.setattr(engine, "peaks", Peaks(1e11, 2e10, "cpu", "float32", {"source": "measured"}, 2.5e10))
    s2 = EngineStepper(llm, show_chart=False)
    s2.step()
    assert "rank 0's share of the FLOPs and bytes, against one device's peaks" in s2.step_pane.value
    s.reset()


def test_stepper_chunks_a_long_prompt_and_mixes_decodes(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=8, ignore_eos=True)
    s.step()                                             # short prompt's prefill
    s.add_request(ids(100, start=9), max_tokens=2, ignore_eos=True)
    r = s.step()
    assert r.phase == "mixed"
    assert r.num_decode_tokens == 1 and r.num_prefill_tokens == 63  # budget 64 = 1 decode + 63 chunk
    assert s.sequence("req-1").num_computed_tokens == 63
    assert s.generated_token_count == 2  # the chunk samples nothing
    llm.llm_engine.check_invariants()


def test_run_to_end_generates_every_token_and_reset_frees_blocks(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm)
    s.add_request(ids(30), max_tokens=7, ignore_eos=True)
    s.add_request(ids(12, start=3), max_tokens=4, ignore_eos=True)
    s.run_button.click()  # no event loop here: runs to the end synchronously
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert s.generated_token_count == 11
    assert not s.is_running and "done" in s.last_message
    assert chart_points(s) == len(s.steps)
    engine.check_invariants()
    assert engine.block_manager.num_cached_blocks > 0  # finished prompts stay in the prefix cache
    s.reset_button.click()
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_cached_blocks == 0
    assert s.steps == [] and s.generated_token_count == 0 and chart_points(s) == 0


def test_reset_mid_flight_aborts_everything(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(40), max_tokens=20, ignore_eos=True)
    s.add_request(ids(25, start=2), max_tokens=20, ignore_eos=True)
    s.step()
    s.step()
    engine = llm.llm_engine
    assert engine.block_manager.num_used_blocks > 0
    s.reset_button.click()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    engine.check_invariants()


def test_out_of_order_presses_never_raise(llm):
    from widgets import EngineStepper

    engine = llm.llm_engine
    s = EngineStepper(llm)
    presses = [s.step_button, s.run_button, s.stop_button, s.reset_button, s.reset_button]
    for b in presses:  # nothing queued yet
        b.click()
        engine.check_invariants()
    assert s.steps == []
    s.add_request(ids(8), max_tokens=2, ignore_eos=True)
    for b in (s.run_button, s.run_button, s.step_button, s.stop_button, s.run_button):  # run, then finished
        b.click()
        engine.check_invariants()
    assert s.generated_token_count == 2
    assert "finished" in s.last_message or "nothing" in s.last_message
    s.reset_button.click()
    s.reset_button.click()
    engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0


def test_bad_input_is_reported_not_raised(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.prompt_box.value = ""
    s.add_button.click()
    assert s.request_ids == [] and s.last_message.startswith("not added") and "empty prompt" in s.last_message
    s.prompt_box.value = "[1, 2, 99999999]"
    s.add_button.click()
    assert s.request_ids == [] and "outside the vocabulary" in s.last_message
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request("hello", max_tokens=0)
    llm.llm_engine.check_invariants()


def test_stop_halts_run_between_steps(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=10, ignore_eos=True)
    s.on_step(lambda st, rec: st.stop() if rec is not None and len(st.steps) == 3 else None)
    taken = s.run_to_end()
    assert taken == 3 and len(s.steps) == 3 and not s.is_running
    assert llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_invariants()
    s._observers.clear()
    s.run_to_end()
    assert s.generated_token_count == 10


def test_kernel_interrupt_halts_run_between_steps(llm):
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=10, ignore_eos=True)
    s.on_step(lambda st, rec: os.kill(os.getpid(), signal.SIGINT) if len(st.steps) == 2 else None)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        s.run_to_end()
    assert len(s.steps) == 2 and not s.is_running
    assert signal.getsignal(signal.SIGINT) is before  # handler restored
    llm.llm_engine.check_invariants()
    assert llm.llm_engine.has_unfinished_requests()


def test_async_run_button_and_stop_button(llm):
    """Inside a running event loop (as in a kernel) "Run to end" steps in the background and
    "Stop" takes effect between steps."""
    from widgets import EngineStepper

    s = EngineStepper(llm, show_chart=False)
    s.add_request(ids(10), max_tokens=40, ignore_eos=True)

    async def scenario():
        s.run_button.click()
        assert s.is_running
        s.run_button.click()  # a second press while running is ignored
        while len(s.steps) < 3:
            await asyncio.sleep(0.001)
        s.stop_button.click()
        while s.is_running:
            await asyncio.sleep(0.001)

    asyncio.run(scenario())
    assert 3 <= len(s.steps) < 40
    assert "stopped" in s.last_message
    llm.llm_engine.check_invariants()

    async def reset_while_running():
        s.run_button.click()
        await asyncio.sleep(0.01)
        s.reset_button.click()
        await asyncio.sleep(0.01)

    asyncio.run(reset_while_running())
    assert not s.is_running
    assert llm.llm_engine.block_manager.num_used_blocks == 0
    llm.llm_engine.check_invariants()


# -- KVCacheView ---------------------------------------------------------------------------------


def _used_cells(view) -> int:
    return len(re.findall(r"class='mv-kv mv-kv-used", view.grid.value))


def test_kv_view_follows_the_stepper_and_shows_sharing(llm):
    from widgets import EngineStepper, KVCacheView

    s = EngineStepper(llm, show_chart=False)
    kv = KVCacheView(llm, stepper=s)
    assert _used_cells(kv) == 0
    prompt = ids(40)
    s.add_request(prompt, max_tokens=6, ignore_eos=True)
    s.step()
    assert kv.num_used_blocks == 3 == _used_cells(kv)
    assert set(kv.block_owners) == set(s.sequence("req-0").block_table)
    # hover text holds the block's tokens; the table shows block table and slot mapping
    first = s.sequence("req-0").block_table[0]
    assert f"tokens {prompt[:BLOCK]}" in kv.grid.value
    assert f"{first * BLOCK}–{first * BLOCK + BLOCK - 1}" in kv.tables.value
    # the same prompt again: its two full blocks are prefix-cache hits, shared by both
    s.add_request(prompt, max_tokens=2, ignore_eos=True)
    s.step()
    assert kv.num_shared_blocks == 2
    assert kv.grid.value.count("mv-kv-shared") == 2 and "×2" in kv.grid.value
    assert s.sequence("req-1").num_cached_tokens == 32
    assert "mv-tok-cached" in s.requests_pane.value
    llm.llm_engine.check_invariants()
    s.reset()
    assert kv.num_used_blocks == 0 == _used_cells(kv) and kv.num_cached_blocks == 0


def test_kv_view_marks_cached_free_blocks(llm):
    from widgets import EngineStepper, KVCacheView

    s = EngineStepper(llm, show_chart=False)
    kv = KVCacheView(llm, stepper=s)
    s.add_request(ids(35), max_tokens=1, ignore_eos=True)
    s.run_to_end()
    assert kv.num_used_blocks == 0
    assert kv.grid.value.count("mv-kv-cachedfree") == 2  # two full prompt blocks stay cached
    count = kv.refresh_count
    kv.refresh()
    assert kv.refresh_count == count + 1


# -- latency model and calculator -------------------------------------------------------------


def test_latency_model_recovers_a_known_linear_cost_and_replays_scheduling():
    from widgets import LatencyModel

    truth = dict(prefill_base_ms=2.0, decode_base_ms=1.5, per_tok=0.01, per_seq=0.25)
    rows = [dict(phase="prefill", tokens=n, wall_ms=truth["prefill_base_ms"] + truth["per_tok"] * n)
            for n in (16, 64, 256)]
    rows += [dict(phase="decode", batch=b, wall_ms=truth["decode_base_ms"] + truth["per_seq"] * b) for b in (1, 4)]
    m = LatencyModel.fit(rows)
    assert m.prefill_base_ms == pytest.approx(2.0) and m.ms_per_prefill_token == pytest.approx(0.01)
    assert m.decode_base_ms == pytest.approx(1.5) and m.ms_per_decode_seq == pytest.approx(0.25)
    assert m.r2 == pytest.approx(1.0)
    p = m.predict(prompt_len=100, max_tokens=5, batch=1, budget=1000)
    assert p["ttft_ms"] == pytest.approx(2.0 + 1.0)
    assert p["tpot_ms"] == pytest.approx(1.75)
    assert p["e2e_ms"] == pytest.approx(3.0 + 4 * 1.75)
    # budget 60: a 100-token prompt takes two chunks (60 + 40)
    assert m.predict(100, 1, 1, budget=60)["ttft_ms"] == pytest.approx((2 + 0.6) + (2 + 0.4))
    with pytest.raises(ValueError, match="batch"):
        m.predict(10, 10, 0)
    with pytest.raises(ValueError, match="prefill"):
        LatencyModel.fit(rows[3:])


def test_latency_model_slopes_are_never_negative():
    """Two decode batch sizes whose noisy steps came out faster at batch 2 than at 1 gave a
    negative cost per sequence, and predictions that fell with the batch."""
    from widgets import LatencyModel

    rows = [dict(phase="prefill", tokens=n, wall_ms=2.0 + 0.01 * n) for n in (16, 64)]
    rows += [dict(phase="decode", batch=1, wall_ms=1.30), dict(phase="decode", batch=2, wall_ms=1.245)]
    m = LatencyModel.fit(rows)
    assert m.ms_per_decode_seq == 0.0 and m.decode_base_ms == pytest.approx((1.30 + 1.245) / 2)
    assert m.ms_per_prefill_token == pytest.approx(0.01)
    assert m.predict(16, 8, batch=8)["tpot_ms"] >= m.predict(16, 8, batch=1)["tpot_ms"] > 0


def test_latency_model_fixed_costs_are_never_negative():
    """Prefill steps growing faster than linear (the attention's share rises with the prompt) put the
    least-squares line's intercept below 0: chapter 07's calculator printed "prefill step = -1.07 ms +
    104.3 us/token" and predicted a TTFT of -0.97 ms for a 1-token prompt."""
    from widgets import LatencyModel

    rows = [dict(phase="prefill", tokens=n, wall_ms=0.05 * n + 0.0004 * n * n) for n in (16, 64, 256, 512)]
    rows += [dict(phase="decode", batch=b, wall_ms=0.3 + 0.1 * b) for b in (1, 4)]
    assert np.linalg.lstsq(np.c_[np.ones(4), [16, 64, 256, 512]], [r["wall_ms"] for r in rows[:4]],
                           rcond=None)[0][0] < 0  # the unconstrained line's intercept
    m = LatencyModel.fit(rows)
    assert m.prefill_base_ms == 0.0 and m.ms_per_prefill_token > 0
    assert min(m.prefill_base_ms, m.decode_base_ms, m.ms_per_prefill_token, m.ms_per_decode_seq) >= 0
    p = m.predict(prompt_len=1, max_tokens=1, batch=1)
    assert p["ttft_ms"] > 0 and p["e2e_ms"] > 0


def test_latency_model_refit_ends_when_both_fixed_costs_are_zeroed():
    """Zeroing a column left lstsq's answer for it at -7e-18, which the refit loop zeroed again, forever
    (both intercepts below 0: long prefills, large decode batches)."""
    import signal

    from widgets import LatencyModel

    toks, yp = [829, 1178, 1401, 1544, 1957], [12.62980261, 25.73130421, 31.75804667, 36.26428461, 51.97631847]
    bs, yd = [19, 45, 64], [1.84697407, 5.67954498, 10.15381881]
    rows = [dict(phase="prefill", tokens=t, wall_ms=w) for t, w in zip(toks, yp)]
    rows += [dict(phase="decode", batch=b, wall_ms=w) for b, w in zip(bs, yd)]

    def hung(*_):
        raise TimeoutError("LatencyModel.fit still refitting after 10 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        m = LatencyModel.fit(rows)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert m.prefill_base_ms == 0.0 and m.decode_base_ms == 0.0
    assert m.ms_per_prefill_token > 0 and m.ms_per_decode_seq > 0


@pytest.mark.slow
def test_measure_decode_batch_leaves_out_the_warm_up_steps(llm, monkeypatch):
    """The first decode steps after a prefill (a graph recorded, caches the prefill left cold) took
    2-3x the steady step and were half of what chapter 07 fitted its latency model to: they are
    run, then left out."""
    from widgets import measure

    real, runs = measure.run_requests, []

    def spy(llm_, prompts, max_tokens):
        out = real(llm_, prompts, max_tokens)
        runs.append((len(prompts), max_tokens, [r for r in out[1] if r.phase == "decode"]))
        return out

    monkeypatch.setattr(measure, "run_requests", spy)
    rows = measure.measure_decode_batch(llm, batch_sizes=(1, 2), prompt_len=8, decode_steps=3, warmup_steps=2)
    assert [max_tokens for _, max_tokens, _ in runs] == [2 + 3 + 1] * 2
    for b, _, decodes in runs:
        assert len(decodes) == 2 + 3
        assert [r["wall_ms"] for r in rows if r["batch"] == b] == [r.wall_ms for r in decodes[2:]]
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        measure.measure_decode_batch(llm, batch_sizes=(1,), warmup_steps=-1)


def test_latency_calculator_sliders_and_measure_button(llm):
    from widgets import LatencyCalculator

    calc = LatencyCalculator(llm, prompt_lens=(8, 16, 32), batch_sizes=(1, 2))
    engine = llm.llm_engine
    name = next(iter(calc.models))
    assert {r["phase"] for r in calc.sweeps[name]} >= {"prefill", "decode"}
    calc.prompt_slider.value, calc.response_slider.value, calc.batch_slider.value = 20, 3, 1
    p1 = dict(calc.prediction)
    calc.response_slider.value = 6
    p2 = dict(calc.prediction)
    assert p2["e2e_ms"] != p1["e2e_ms"] and p2["ttft_ms"] == p1["ttft_ms"]
    assert list(calc.chart.data[0].y)[2] == pytest.approx(p2["e2e_ms"])
    assert all(v is None for v in calc.chart.data[1].y)  # nothing measured yet
    calc.measure_button.click()
    assert len(calc.measurements) == 1
    m = calc.measurements[0]
    assert m["point"] == (name, 20, 6, 1) and m["ttft_ms"] > 0 and m["tpot_ms"] > 0 and m["steps"] == 6
    assert list(calc.chart.data[1].y) == pytest.approx([m["ttft_ms"], m["tpot_ms"], m["e2e_ms"]])
    calc.batch_slider.value = 2  # a point not measured: the measured bars clear
    assert all(v is None for v in calc.chart.data[1].y)
    engine.check_invariants()
    assert not engine.has_unfinished_requests()


# -- quiz -------------------------------------------------------------------------------------


def test_quiz_explains_wrong_answers():
    from widgets import Question, Quiz

    q = Quiz([Question("2 + 2?", ["3", "4"], 1, ["off by one", "yes"]),
              dict(prompt="Sky?", choices=["blue", "green"], correct=0, explanations=["right", "no: grass"])])
    assert q.check(0) is None and "Pick" in q.feedback[0].value
    q.radios[0].value = 0
    q.buttons[0].click()
    assert "Not quite" in q.feedback[0].value and "off by one" in q.feedback[0].value
    assert q.check(0, 1) is True and q.score == 1
    assert q.check(1, 1) is False and "grass" in q.feedback[1].value and q.score == 1
    with pytest.raises(ValueError, match="correct=5"):
        Question("x", ["a", "b"], 5, ["", ""])
    # a str choice raised "'<=' not supported", 1.5 a traitlets TraitError nine frames deep
    for bad in ("a", 1.5, True, 2):
        with pytest.raises(ValueError, match=f"choice={bad!r} is not an answer index of question 0"):
            q.check(0, bad)
    # a string of choices was taken letter by letter; no list of questions failed inside iteration
    with pytest.raises(ValueError, match="choices must be a list of strings, got 'ab'"):
        Question("x", "ab", 0, ["", ""])
    with pytest.raises(ValueError, match="Quiz takes a list of questions"):
        Quiz(None)


def test_quiz_says_right_once():
    """The feedback read "Right. Right: 20 // 16 = 1 ...": the chapters' explanations of a right answer
    start with "Right:" and the widget put its own "Right." before them (a teacher's report)."""
    from widgets import Question, Quiz

    q = Quiz([Question("Blocks?", ["1", "2"], 0, ["Right: 20 // 16 = 1.", "Not quite: one block holds 16."]),
              Question("Sky?", ["blue", "green"], 0, ["it scatters blue light", "no: grass"])])
    for i, choice in ((0, 0), (0, 1), (1, 0), (1, 1)):
        q.check(i, choice)
        text = q.feedback[i].value
        assert text.count("Right") + text.count("Not quite") == 1, text
    with pytest.raises(ValueError, match="explanations"):
        Question("x", ["a", "b"], 0, [""])
    # a str index raised "'<=' not supported", a question index past the end a bare IndexError
    with pytest.raises(ValueError, match="correct='1' is not a choice index"):
        Question("x", ["a", "b"], "1", ["", ""])
    for bad in (2, -1, "0"):
        with pytest.raises(ValueError, match=f"i={bad!r} is not a question index"):
            q.check(bad, 0)


# -- static snapshots ---------------------------------------------------------------------------


def test_mimebundle_carries_a_static_snapshot(llm):
    from widgets import EngineStepper, KVCacheView

    s = EngineStepper(llm, show_chart=False)
    kv = KVCacheView(llm, stepper=s)
    s.add_request(ids(20), max_tokens=3, ignore_eos=True)
    s.step()
    for w in (s, kv):
        bundle = w._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert "<style>" in bundle["text/html"]
    assert "mv-generated-count'>1<" in s._repr_mimebundle_()["text/html"]
    assert "mv-kv-used" in kv._repr_mimebundle_()["text/html"]


@pytest.mark.slow
def test_static_chart_is_a_png_when_chromium_exists(llm):
    from widgets import EngineStepper
    from widgets._static import find_chrome

    if find_chrome() is None:
        pytest.skip("no Chrome/Chromium for kaleido")
    s = EngineStepper(llm)
    s.add_request(ids(8), max_tokens=2, ignore_eos=True)
    s.run_to_end()
    assert "data:image/png;base64," in s.static_html()


HUNG_EXPORT = """\
import time
import plotly.graph_objects as go
from widgets import _static
t0 = time.monotonic()
first = _static.figure_png(go.Figure(go.Bar(x=[1, 2], y=[3, 4])))
second = _static.figure_png(go.Figure(go.Bar(x=[1, 2], y=[3, 4])))
print("RESULT", first is None, second is None, time.monotonic() - t0)
"""


@pytest.mark.slow
def test_a_browser_that_cannot_start_costs_a_text_snapshot_not_a_hung_kernel(tmp_path):
    """kaleido's server thread dies when its browser fails to start, and its export then waits
    forever: a chart's snapshot hung the kernel (found with a temporary directory whose path was
    too long for Chromium). figure_png falls back within seconds and says why in one line."""
    pytest.importorskip("kaleido")
    fails = tmp_path / "chromium"
    fails.write_text("#!/bin/sh\nexit 1\n")
    fails.chmod(0o755)
    env = dict(os.environ, BROWSER_PATH=str(fails), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", HUNG_EXPORT], env=env, capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT"))
    assert line.split()[1:3] == ["True", "True"]
    assert "kaleido could not export a chart" in res.stderr
    assert "Traceback" not in res.stderr  # the server thread's failure is the warning's one line


def test_an_export_left_running_by_an_interrupt_is_waited_for_before_the_next(monkeypatch):
    """kaleido hands results back in order (a task queue, then the next result): an export an
    interrupt left running, then another, gave the second call the first figure's image."""
    import queue
    import threading
    import time

    import plotly.graph_objects as go

    from widgets import _static

    tasks, results, release = queue.Queue(), queue.Queue(), threading.Event()

    def server():  # kaleido's server thread, one export at a time
        while True:
            name = tasks.get()
            if name == "A":
                release.wait(30)
            results.put(name.encode())
            tasks.task_done()

    threading.Thread(target=server, daemon=True).start()

    def to_image(self, **kw):  # kaleido's call_function: queue the task, wait for every task, take the next result
        name = self.layout.title.text
        tasks.put(name)
        tasks.join()
        if name == "A":
            time.sleep(0.5)  # which waiting export takes the next result is up to the scheduler: A comes late
        return results.get()

    monkeypatch.setattr(go.Figure, "to_image", to_image)
    monkeypatch.setattr(_static, "_ensure_server", lambda: True)
    monkeypatch.setattr(_static, "_server_thread_dead", lambda: False)
    monkeypatch.setattr(_static, "_last_export", None, raising=False)
    monkeypatch.setattr(_static, "_disabled", False)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()  # a learner's Interrupt
    with pytest.raises(KeyboardInterrupt):
        _static.figure_png(go.Figure(layout_title_text="A"))
    threading.Timer(0.3, release.set).start()
    assert _static.figure_png(go.Figure(layout_title_text="B")) == b"B"


# -- scheduler timeline ---------------------------------------------------------------------------


@pytest.mark.slow
def test_scheduler_timeline_shows_chunks_preemption_and_finish(model_path):
    from widgets import EngineStepper, SchedulerTimeline

    small = LLM(model_path, block_size=BLOCK, num_kvcache_blocks=4, max_model_len=64, max_num_batched_tokens=32)
    try:
        s = EngineStepper(small, show_chart=False)
        tl = SchedulerTimeline(stepper=s)
        for k in range(3):
            s.add_request(ids(12, start=3 + k), max_tokens=12, ignore_eos=True)  # 1 block, growing to 2
        s.run_to_end()
        engine = small.llm_engine
        engine.check_invariants()
        assert tl.num_steps == len(s.steps) and set(tl.states) == set(s.request_ids)
        flat = [st for row in tl.states.values() for st in row]
        assert "preempted" in flat  # 4 blocks cannot hold three growing sequences
        assert "prefill" in flat and "decode" in flat and "waiting" in flat
        for rid, row in tl.states.items():
            assert [x for x in row if x][-1] == "finished" and row.count("finished") == 1, rid
        assert list(tl.chart.data[0].z[0]) == [["", "waiting", "prefill", "decode", "preempted", "finished"].index(x)
                                               for x in tl.states[s.request_ids[0]]]
        assert list(tl.chart.data[-2].y) == [r.num_prefill_tokens for r in s.steps]
        assert list(tl.chart.data[-1].y) == [r.num_decode_tokens for r in s.steps]
        assert s.generated_token_count == 36  # preemption loses no token
        s.reset()
        assert tl.num_steps == 0
    finally:
        small.shutdown()


# -- sampling explorer --------------------------------------------------------------------------


def test_sampling_explorer_real_distribution_filters_and_draws(llm):
    import torch

    from minivllm import SamplingParams
    from widgets import SamplingExplorer

    prompt = "[" + ", ".join(map(str, ids(12))) + "]"
    ex = SamplingExplorer(llm, prompt=prompt, top_n=10)
    greedy = llm.generate(ids(12), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert int(ex.logits.argmax()) == greedy.outputs[0].token_ids[0]  # the engine's own logits
    assert float(ex.model_probs.sum()) == pytest.approx(1.0, abs=1e-5)
    assert ex.kept == ex.probs.numel()  # T=1, no filter: nothing removed
    ex.top_k.value = 5
    assert ex.kept == 5
    assert set(torch.nonzero(ex.probs).flatten().tolist()) == set(ex.order[:5])
    ex.top_k.value, ex.temperature.value = 0, 0.0
    assert ex.kept == 1 and float(ex.probs[int(ex.logits.argmax())]) == 1.0
    ex.temperature.value, ex.min_p.value = 1.0, 0.2
    assert all(float(ex.probs[t]) == 0 or float(ex.model_probs[t]) >= 0.2 * float(ex.model_probs.max()) - 1e-7
               for t in range(ex.probs.numel()))
    ex.min_p.value, ex.top_p.value = 0.0, 0.5
    ex.n_draws.value = 4000
    ex.draw_button.click()
    assert ex.num_draws == 4000 and sum(ex.counts.values()) == 4000
    assert all(float(ex.probs[t]) > 0 for t in ex.counts)  # never a filtered-out token
    tv = 0.5 * sum(abs(ex.counts.get(t, 0) / 4000 - float(ex.probs[t])) for t in range(ex.probs.numel()))
    assert tv < 0.06, tv
    assert len(ex.chart.data[2].y) == 10
    ex.temperature.value = 0.7  # new settings: old draws are cleared
    assert ex.num_draws == 0 and len(ex.chart.data[2].y) == 0
    llm.llm_engine.check_invariants()
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_explorer_says_an_interrupted_draw_and_shortens_a_long_prompt(llm, monkeypatch):
    """A kernel interrupt during "Draw samples" left the readout as before, saying nothing; a 1,100-word
    prompt filled ~30 lines of the readout above the chart (a teacher's report)."""
    import widgets.sampling_explorer as se
    from widgets import SamplingExplorer

    ex = SamplingExplorer(llm, prompt="word " * 300, top_n=5)
    assert "characters)" in ex.readout.value and len(ex.readout.value) < 600
    ex.n_draws.value = 50
    ex.draw_button.click()
    assert ex.num_draws == 50

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(se, "exponential_race", interrupted)
    ex.draw_button.click()
    assert ex.num_draws == 50 and sum(ex.counts.values()) == 50  # nothing of the interrupted draw counted
    assert "interrupted (Kernel &gt; Interrupt): none of the draw of" in ex.readout.value and "50 draws" in ex.readout.value


# -- prefix cache view ----------------------------------------------------------------------------


@pytest.mark.slow
def test_prefix_cache_view_counts_hits_per_block(llm):
    from widgets import PrefixCacheView

    system = ids(48)  # three full blocks
    view = PrefixCacheView(llm, system, [ids(10, start=11), ids(7, start=13), ids(20, start=17)], repeats=1)
    r0, r1, r2 = view.results
    assert r0["hit_blocks"] == 0 and r0["miss_blocks"] == 4
    assert r1["hit_blocks"] == 3 and r1["cached_tokens"] == 48 and r1["miss_blocks"] == 1
    assert r2["hit_blocks"] == 3 and r2["miss_blocks"] == 2
    assert all(r["ttft_cold_ms"] > 0 for r in view.results) and r1["ttft_warm_ms"] > 0 and r2["ttft_warm_ms"] > 0
    assert r1["saved_ms"] == pytest.approx(r1["ttft_cold_ms"] - r1["ttft_warm_ms"])
    assert view.grid.value.count(">hit<") == 6
    assert len(view.chart.data[1].y) == 3
    # request 0 fills the cache: it had no warm run, so no green bar and no "saved" (it read a noise
    # difference of two cold runs, negative at times, beside a green "warm (system prompt cached)" bar)
    assert r0["ttft_warm_ms"] is None and r0["saved_ms"] is None
    assert list(view.chart.data[1].y)[0] is None and "– (fills the cache)" in view.grid.value
    llm.llm_engine.check_invariants()
    with pytest.raises(ValueError, match="at least 2"):
        PrefixCacheView(llm, system, [ids(3)], run=False)


# -- chunked prefill demo --------------------------------------------------------------------------


@pytest.mark.slow
def test_chunked_prefill_demo_measures_both_engines(model_path):
    from widgets import ChunkedPrefillDemo

    demo = ChunkedPrefillDemo.from_model(model_path, budget=32, max_model_len=256, long_prompt_len=100,
                                         num_decoders=2, decode_tokens=12)
    try:
        c, w = demo.results["chunked"], demo.results["whole"]
        assert c["prefill_steps"] == 4  # 30 + 30 + 30 + 10: two decode tokens share every 32-token step
        assert w["prefill_steps"] == 1
        for r in (c, w):
            assert [len(x) for x in r["itl_ms"]] == [11, 11]
            assert r["long_ttft_ms"] > 0 and r["max_itl_ms"] == max(max(x) for x in r["itl_ms"])
        assert len(demo.chart.data[0].x) == 22 == len(demo.chart.data[1].y)
        for llm in demo.llms.values():
            llm.llm_engine.check_invariants()
            assert llm.llm_engine.block_manager.num_used_blocks == 0
    finally:
        for llm in demo.llms.values():
            llm.shutdown()


# -- utilisation monitor -------------------------------------------------------------------------


def test_utilisation_monitor_runs_a_workload(llm):
    from widgets import UtilisationMonitor

    mon = UtilisationMonitor(llm, num_requests=2, prompt_len=24, max_tokens=4, period_s=0.02)
    assert mon.records == []
    mon.run_button.click()
    assert len(mon.records) >= 4 and len(mon.samples) >= 1
    assert sum(r.num_decode_tokens for r in mon.records) == 2 * 3
    pts = sum(len(t.x) for t in mon.roofline.data[1:])
    assert pts == sum(1 for r in mon.records if r.flops)
    assert len(mon.roofline.data[0].x) == 3
    assert len(mon.series.data[0].x) == len(mon.samples)
    llm.llm_engine.check_invariants()
    assert llm.llm_engine.block_manager.num_used_blocks == 0


def test_utilisation_monitor_says_where_its_peaks_come_from(llm):
    """The readout said "peaks measured here" for figures read from the cache (chapter 12 printed
    it beside "cached, measured 2026-12-03T17:10:05Z"): it gives the peaks' own provenance."""
    from dataclasses import replace

    from minivllm.telemetry.peaks import Peaks
    from widgets import UtilisationMonitor

    base = Peaks(flops_per_s=50e9, bytes_per_s=20e9, read_bytes_per_s=25e9, info={})
    for info, said in [({"source": "cached", "measured_at": "2026-12-03T17:10:05Z"},
                        "peaks (cached, measured 2026-12-03T17:10:05Z)"),
                       ({"source": "measured", "measured_at": "now"}, "peaks (measured now)")]:
        mon = UtilisationMonitor(llm, num_requests=1, prompt_len=8, max_tokens=2, period_s=0.02,
                                 peaks=replace(base, info=info))
        mon.run_button.click()
        assert said in mon.readout.value and "measured here" not in mon.readout.value, mon.readout.value


def test_static_fallback_without_chrome_is_an_svg(monkeypatch, llm):
    import plotly.graph_objects as go

    from widgets import SchedulerTimeline
    from widgets import _static

    monkeypatch.setattr(_static, "_disabled", True)  # as on a machine without Chrome
    fig = go.Figure()
    fig.add_bar(x=["TTFT", "TPOT", "total"], y=[30.0, 2.0, 60.0], name="predicted")
    fig.add_scatter(x=["TTFT", "TPOT", "total"], y=[28.0, 2.5, 55.0], mode="markers", name="measured")
    fig.update_layout(title="latency", yaxis_type="log")
    out = _static.figure_html(fig)
    assert out.count("<svg") == 1 and out.count("<rect x=") >= 3 + 1 and out.count("<circle") == 3
    assert "predicted" in out and "latency" in out
    tl = SchedulerTimeline()  # heatmap + subplots: not drawable as SVG, a text note instead
    assert _static.figure_svg(tl.chart) is None
    assert "static image unavailable" in _static.figure_html(tl.chart)


def _ready_sweep() -> list[dict]:
    """Step rows as widgets.measure returns them (made up: these tests check drawing, not timing)."""
    rows = [dict(phase="prefill", tokens=n, wall_ms=1.0 + 0.1 * n) for n in (8, 16)]
    return rows + [dict(phase="decode", batch=b, wall_ms=2.0 + 0.2 * b) for b in (1, 2)]


def _charts_of_every_widget(llm, model_path):
    """(name, figure, the LLM it measures) for every chart the widgets draw, built without running
    workloads (the latency calculator gets a ready-made sweep)."""
    from widgets import (ChunkedPrefillDemo, EngineStepper, LatencyCalculator, PrefixCacheView, SamplingExplorer,
                         SchedulerTimeline, UtilisationMonitor)

    stepper = EngineStepper(llm)
    sweep = _ready_sweep()
    calc = LatencyCalculator(llm, sweeps={llm.llm_engine.source.name: sweep})
    monitor = UtilisationMonitor(llm)
    whole = LLM(model_path, block_size=BLOCK, num_kvcache_blocks=32, enable_chunked_prefill=False)
    demo = ChunkedPrefillDemo(llm, whole, long_prompt_len=32, run=False)
    charts = [("EngineStepper", stepper.chart, llm), ("SchedulerTimeline", SchedulerTimeline(stepper=stepper).chart, llm),
              ("SchedulerTimeline(llm=)", SchedulerTimeline(records=[], arrivals={}, llm=llm).chart, llm),
              ("LatencyCalculator", calc.chart, llm),
              ("PrefixCacheView", PrefixCacheView(llm, ids(20), [ids(3, 60), ids(3, 70)], run=False).chart, llm),
              ("SamplingExplorer", SamplingExplorer(llm, prompt="The list", top_n=5).chart, llm),
              ("UtilisationMonitor.series", monitor.series, llm), ("UtilisationMonitor.roofline", monitor.roofline, llm),
              ("ChunkedPrefillDemo", demo.chart, llm)]
    return charts, whole


def test_every_chart_title_names_device_model_dtype_and_threads(llm, model_path):
    """One provenance line (``env_report.chart_provenance``) under every widget chart's title, and
    every axis labelled."""
    import torch

    from minivllm.utils.env_report import chart_provenance, cpu_name

    charts, whole = _charts_of_every_widget(llm, model_path)
    try:
        cfg = llm.llm_engine.config
        n = torch.get_num_threads()
        for name, fig, measured in charts:
            title = fig.layout.title.text
            assert chart_provenance(measured) in title, name
            assert f"measured on {cfg.device} ({cpu_name()})" in title and llm.llm_engine.source.name in title, name
            assert "float32" in title and f"{n} CPU thread" in title, name
            for axis in ("xaxis", "yaxis"):
                label = fig.layout[axis].title.text
                if name.startswith("SchedulerTimeline") and axis == "xaxis":  # shared with the bar panel's
                    label = fig.layout.xaxis2.title.text
                assert label, f"{name}: {axis} has no label"
    finally:
        whole.shutdown()


def test_latency_calculator_bars_on_a_linear_axis_with_units(llm):
    from widgets import LatencyCalculator

    sweep = _ready_sweep()
    calc = LatencyCalculator(llm, sweeps={llm.llm_engine.source.name: sweep})
    assert calc.chart.layout.yaxis.type in (None, "linear")
    assert "(ms)" in calc.chart.layout.yaxis.title.text
    assert all(t.type == "bar" and "ms" in t.texttemplate for t in calc.chart.data)


def test_static_svg_ticks_are_round_and_overlay_axes_get_round_ticks(monkeypatch):
    """Tick labels at round values (not max/4 steps such as 2.1 / 4.21 / 6.31), and a second y axis
    drawn by show_figure gets plotly's round ticks instead of ticks synced to the first axis."""
    import plotly.graph_objects as go

    from widgets import _static

    assert _static.nice_ticks(0, 8.42) == [0, 2, 4, 6, 8, 10]
    assert _static.nice_ticks(0, 0.37) == [0, 0.1, 0.2, 0.3, 0.4]
    assert _static.nice_step(1234) == 250
    monkeypatch.setattr(_static, "_disabled", True)
    fig = go.Figure(go.Bar(x=["a", "b"], y=[8.42, 3.0]))
    labels = re.findall(r"text-anchor='end'>([^<]*)<", _static.figure_svg(fig))
    assert labels == ["0", "2", "4", "6", "8", "10"]
    fig = go.Figure()
    fig.add_scatter(x=[1, 2], y=[0.2, 0.9])
    fig.add_scatter(x=[1, 2], y=[2.1, 8.42], yaxis="y2")
    fig.update_layout(yaxis=dict(range=[0, 1]), yaxis2=dict(title="TTFT (ms)", overlaying="y", side="right"),
                      yaxis3=dict(overlaying="y", dtick=5))
    _static.StaticFigure(fig)
    assert fig.layout.yaxis2.tickmode == "auto" and fig.layout.yaxis2.showgrid is False
    assert fig.layout.yaxis3.tickmode is None  # its own tick settings are kept
    assert fig.layout.yaxis.tickmode is None


def test_stepper_shows_accepted_and_rejected_draft_tokens():
    from widgets import EngineStepper

    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    s = EngineStepper(llm)
    s.prompt_box.value = "[" + ", ".join(map(str, [11, 12, 13] * 8)) + "]"  # a loop: the proposer has drafts
    s.max_tokens_box.value = 12
    s.add_button.click()
    seen = []
    for _ in range(12):
        s.step_button.click()
        r = s.steps[-1]
        if r.num_draft_tokens:
            seen.append(r)
            text = (f"{r.num_draft_tokens} draft tokens scored, {r.num_accepted_draft_tokens} accepted, "
                    f"{r.num_draft_tokens - r.num_accepted_draft_tokens} rejected")
            assert text in s.step_pane.value
    assert seen, "no step had draft tokens"
    llm.shutdown()


# -- the garbage collector while the widgets step -------------------------------------------------


def test_widget_and_helper_steps_run_with_the_heap_frozen(llm, monkeypatch):
    """Every stepping loop of the widgets and the course helpers runs its steps with the older
    objects frozen (a full collection of torch's and transformers' ~220k objects took 86-103 ms
    inside a hand-stepped 4004-token prefill, shown as its 'prepare' time), and leaves nothing
    frozen once it returns."""
    import gc

    from widgets import EngineStepper, UtilisationMonitor
    from widgets.chunked_prefill_demo import itl_around_long_prompt
    from widgets.measure import run_requests

    engine = llm.llm_engine
    real, frozen = engine.step_with_record, []

    def step_with_record():
        frozen.append(gc.get_freeze_count() > 0)
        return real()

    monkeypatch.setattr(engine, "step_with_record", step_with_record)
    assert gc.get_freeze_count() == 0

    def check(what):
        assert frozen and all(frozen), what
        assert gc.get_freeze_count() == 0, what
        frozen.clear()

    run_requests(llm, [ids(6), ids(9, 3)], 3)
    check("run_requests")
    s = EngineStepper(llm)
    s.prompt_box.value = "[" + ", ".join(map(str, ids(12))) + "]"
    s.max_tokens_box.value = 3
    s.add_button.click()
    s.step_button.click()
    check("EngineStepper step")
    s.run_button.click()
    check("EngineStepper run to end")
    UtilisationMonitor(llm, num_requests=2, prompt_len=8, max_tokens=3, period_s=0.02).run_button.click()
    check("UtilisationMonitor")
    itl_around_long_prompt(llm, num_decoders=2, decoder_prompt_len=8, decode_tokens=8, long_prompt_len=40, arrive_after=2)
    check("itl_around_long_prompt")


def test_latency_calculator_draws_no_tpot_bar_for_one_token_and_warns_of_a_pool_too_small(llm):
    """With one response token TPOT is undefined: the bar read "0 ms". A point whose requests
    cannot all hold their KV at once is predicted as if they could: the readout now says so."""
    from widgets import LatencyCalculator

    calc = LatencyCalculator(llm, prompt_lens=(8, 16, 32), batch_sizes=(1, 2))
    calc.response_slider.value = 1
    assert calc.chart.data[0].y[1] is None
    pool = llm.llm_engine.block_manager.num_blocks
    calc.prompt_slider.value = min(calc.prompt_slider.max, 200)
    calc.batch_slider.value = calc.batch_slider.max
    need = calc.batch_slider.value * -(-(calc.prompt_slider.value + 1) // BLOCK)
    assert need > pool and f"the pool has {pool}" in calc.readout.value


def test_token_piece_names_ids_beyond_the_tokenizer_as_the_engine_does():
    """A random: preset's 151936-token model beside the embedded 4096-token tokenizer: every id above 4095
    decoded to '' and showed as '∅' in the stepper, the sampling explorer and the KV view, where the engine's
    text says <id:N>."""
    from transformers import AutoTokenizer

    from widgets._engine import token_piece

    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    assert token_piece(tok, 150989) == "<id:150989>" and token_piece(tok, len(tok)) == f"<id:{len(tok)}>"
    assert token_piece(tok, tok.encode("The")[0]) == "The"
    assert token_piece(tok, tok.encode(" list")[0]) == "·list"


def test_latency_calculator_says_an_interrupted_measurement(llm, monkeypatch):
    # Kernel > Interrupt during "measure this point" put the measured column back to "-" and said nothing
    import widgets.latency_calculator as lc
    from widgets import LatencyCalculator

    calc = LatencyCalculator(llm, prompt_lens=(8, 16), batch_sizes=(1, 2))

    def interrupted(*args, **kwargs):
        assert calc.measure_button.disabled
        raise KeyboardInterrupt

    monkeypatch.setattr(lc, "measure_request_latency", interrupted)
    with pytest.raises(KeyboardInterrupt):
        calc.measure_button.click()
    assert "interrupted (Kernel &gt; Interrupt): this measurement was not recorded" in calc.readout.value
    assert not calc.measure_button.disabled and calc.measurements == []


def test_chunked_prefill_demo_disables_run_both_while_it_runs_and_says_an_interrupt(model_path, monkeypatch):
    # the button stayed clickable during a run (a second click queued a second run behind it), and an
    # interrupted run said nothing
    from widgets import ChunkedPrefillDemo

    common = dict(block_size=BLOCK, num_kvcache_blocks=32, max_num_seqs=4)
    chunked = LLM(model_path, enable_chunked_prefill=True, max_num_batched_tokens=32, **common)
    whole = LLM(model_path, enable_chunked_prefill=False, max_num_batched_tokens=512, **common)
    try:
        demo = ChunkedPrefillDemo(chunked, whole, run=False)
        seen = []

        def interrupted():
            seen.append(demo.run_button.disabled)
            raise KeyboardInterrupt

        monkeypatch.setattr(demo, "run", interrupted)
        with pytest.raises(KeyboardInterrupt):
            demo.run_button.click()
        assert seen == [True] and not demo.run_button.disabled
        assert "interrupted (Kernel &gt; Interrupt): no run has completed yet" in demo.readout.value
        with pytest.raises(KeyboardInterrupt):  # a second interrupt replaces the note (they piled up)
            demo.run_button.click()
        assert demo.readout.value.count("interrupted") == 1
    finally:
        chunked.shutdown()
        whole.shutdown()


def test_prefix_cache_view_keeps_its_last_complete_run_and_says_an_interrupt(llm, monkeypatch):
    # an interrupted Run left the old table on show with no word of it, while `results` held the interrupted
    # run's first rows only (a teacher's browser pass)
    from widgets import PrefixCacheView

    view = PrefixCacheView(llm, ids(32, start=3), [ids(4, start=81), ids(4, start=91)], repeats=1)
    before = [dict(r) for r in view.results]
    calls = []
    ttft = view._ttft

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return ttft(*args, **kwargs)

    monkeypatch.setattr(view, "_ttft", interrupted)
    with pytest.raises(KeyboardInterrupt):
        view.run_button.click()
    assert len(view.results) == len(before) == 2
    assert [r["hit_blocks"] for r in view.results] == [r["hit_blocks"] for r in before]
    assert "interrupted (Kernel &gt; Interrupt): the table is the last complete run" in view.grid.value
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_explorer_box_shows_the_draws_a_cell_asked_for(llm):
    # draw(2000) from a cell left the "draws" box at 500 while the readout said 2000 draws; the next click then
    # reported 2500 (a teacher's browser pass)
    from widgets import SamplingExplorer

    ex = SamplingExplorer(llm, prompt="The list type", top_n=5)
    ex.draw(300)
    assert ex.n_draws.value == 300 and ex.num_draws == 300
    ex.draw_button.click()
    assert ex.num_draws == 600  # the same amount again: the draws still add up under the same settings


def test_a_live_chart_of_many_points_is_redrawn_less_often():
    # a stepper's chart of 1,800 steps redrawn twice a second kept the browser busy enough to hold a
    # "Stop" click back 1-2 s; the interval between redraws now grows with the points drawn
    import time

    from widgets._static import LiveFigure

    async def scheduled_wait(points: int) -> float:
        fig = LiveFigure()
        fig.add_bar(x=list(range(points)), y=[1.0] * points)
        loop, waits = asyncio.get_running_loop(), []
        real = loop.call_later
        loop.call_later = lambda delay, cb, *a: waits.append(delay) or real(delay, cb, *a)
        try:
            fig._last_draw, fig._pending = time.monotonic(), False  # just drawn
            fig.data[0].y = [2.0] * points  # a change right after: drawn by a trailing redraw
        finally:
            del loop.call_later
        return waits[-1]

    assert asyncio.run(scheduled_wait(10)) <= LiveFigure.min_redraw_s
    assert asyncio.run(scheduled_wait(2000)) > 0.9 * 2000 * LiveFigure.redraw_s_per_point > LiveFigure.min_redraw_s
