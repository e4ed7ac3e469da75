"""``LatencyCalculator``: predicted TTFT / TPOT / total from a cost model fitted here, and
measured points beside the predictions."""
from __future__ import annotations

import html

import ipywidgets as W
import torch

from minivllm.utils import cdiv

from ._base import STYLE, CourseWidget, error_box
from ._engine import engine_of, fmt_ms, titled
from ._main_thread import on_main_thread
from .latency_model import LatencyModel
from .measure import measure_decode_batch, measure_request_latency, measure_step_latency


def _bar_label(ms: float | None) -> str:
    """A bar's value in ms without an exponent: "1,870", "93.0", "0.55"."""
    if ms is None:
        return ""
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


class LatencyCalculator(CourseWidget):
    """Sliders for prompt length, response length and batch size (and a model menu when
    several are given) predict TTFT, TPOT and total time.

    Where the numbers come from: at construction (or from ``sweeps`` you pass) the engine
    runs a short sweep on this machine: prefill steps for several prompt lengths and
    decode steps for several batch sizes (:mod:`widgets.measure`). A
    :class:`~widgets.latency_model.LatencyModel` is fitted to those measured steps and
    replays the scheduler for the sliders' point. "Measure this point" runs exactly that
    workload on the engine (random prompts, greedy, ``ignore_eos``) and plots the measured
    means (``RequestMetrics.ttft_ms`` / ``tpot_ms`` / ``e2e_ms``) beside the prediction.

    Args:
        llms: an ``LLM``, or a dict ``{name: LLM}`` to choose between.
        prompt_lens / batch_sizes: the sweep's points (keep them short on CPU).
        max_prompt_len: the prompt slider's top (default 1024); never more than ``max_model_len``
            leaves beside the response slider's top.
        sweeps: ``{name: rows}`` already measured (skips the sweep for those models).
        repeats: runs of each prefill size in the sweep (the fit takes each size's median, so one
            slow run does not set it).

    State for code and tests: ``models`` (name -> fitted ``LatencyModel``), ``sweeps``,
    ``prediction`` (the current point's dict), ``measurements`` (list of dicts, one per
    press of "measure this point").

    Raises:
        ValueError: an empty dict of LLMs; what the sweep refuses (``widgets.measure``: an engine
            with unfinished requests, a batch size above ``max_num_seqs``, a prompt that does not
            fit ``max_model_len``).
    """

    #: below this R² the readout warns that the fitted model describes its own measurements poorly
    MIN_R2 = 0.9

    def __init__(self, llms, *, prompt_lens=(16, 32, 64, 128), batch_sizes=(1, 2, 4, 8),
                 max_prompt_len: int | None = None, sweeps: dict | None = None, repeats: int = 3):
        super().__init__()
        if not isinstance(llms, dict):
            llms = {getattr(engine_of(llms).source, "name", "model"): llms}
        if not llms:
            raise ValueError("llms: give at least one LLM")
        self.llms = llms
        self.sweeps: dict[str, list[dict]] = dict(sweeps or {})
        self.models: dict[str, LatencyModel] = {}
        #: torch's CPU threads when each model's sweep ran here (None: the sweep was passed in)
        self.fit_threads: dict[str, int | None] = {}
        for name, llm in llms.items():
            self.fit_threads[name] = None
            if name not in self.sweeps:
                self.fit_threads[name] = torch.get_num_threads()
                self.sweeps[name] = (measure_step_latency(llm, prompt_lens, decode_steps=3, repeats=repeats)
                                     + measure_decode_batch(llm, batch_sizes, decode_steps=3))
            self.models[name] = LatencyModel.fit(self.sweeps[name])
        # What update() reads of each engine, read once: a later cell may shut an engine down, and moving a
        # slider must still redraw the prediction (only "measure this point" needs the live engine).
        self._pool: dict[str, tuple[int, int, int]] = {}  # name -> (step budget, block size, KV blocks)
        self._titles: dict[str, str] = {}
        for name, llm in llms.items():
            engine = engine_of(llm)
            self._pool[name] = (engine.config.max_num_batched_tokens, engine.block_manager.block_size,
                                engine.block_manager.num_blocks)
            self._titles[name] = titled("Predicted and measured latency", llm, self.fit_threads[name])
        self.measurements: list[dict] = []
        self.prediction: dict = {}
        self._error = ""  # the last refused measurement, shown once under the readout
        first = next(iter(llms.values()))
        cfg = engine_of(first).config
        # a prompt and a response must fit max_model_len together: a short one (<= 130) gave the prompt
        # slider a top below its bottom (TraitError)
        mml = cfg.max_model_len
        response_top = max(1, min(128, mml // 2))
        wanted = max_prompt_len or 1024
        top = max(1, min(wanted, mml - response_top))
        self.model_menu = W.Dropdown(options=list(llms), description="model", layout=W.Layout(width="320px"))
        self.prompt_slider = W.IntSlider(value=min(128, top), min=1, max=top, description="prompt tokens",
                                         continuous_update=False, style={"description_width": "110px"},
                                         layout=W.Layout(width="420px"))
        self.response_slider = W.IntSlider(value=min(32, response_top), min=1, max=response_top,
                                           description="response tokens",
                                           continuous_update=False, style={"description_width": "110px"},
                                           layout=W.Layout(width="420px"))
        self.limit_note = W.HTML(
            f"<div class='mv-small' style='max-width:420px'>prompt up to {top} tokens: max_model_len={mml} must "
            f"hold the prompt and up to {response_top} response tokens</div>" if top < wanted else "")
        self.batch_slider = W.IntSlider(value=1, min=1, max=min(16, cfg.args.max_num_seqs), description="batch",
                                        continuous_update=False, style={"description_width": "110px"},
                                        layout=W.Layout(width="420px"))
        self.measure_button = W.Button(description="measure this point", icon="stopwatch", button_style="info",
                                        layout=W.Layout(width="200px"))
        self.measure_button.add_class("mv-measure")
        self.measure_button.on_click(on_main_thread(lambda _: self.measure()))
        self.readout = W.HTML()
        from ._static import LiveFigure

        self.chart = LiveFigure()
        # a linear axis (bar lengths compare); TPOT is short beside TTFT and the total, so every bar
        # also carries its value, written by _bar_label (plotly's "%{y:.3g}" wrote 1870 as "1.87e+3")
        bar_text = dict(texttemplate="%{text} ms", textposition="outside", cliponaxis=False)
        self.chart.add_bar(name="predicted", x=["TTFT", "TPOT", "total"], y=[0, 0, 0], marker_color="#9ecae9",
                           text=["", "", ""], **bar_text)
        self.chart.add_bar(name="measured", x=["TTFT", "TPOT", "total"], y=[None, None, None],
                           marker_color="#4c78a8", text=["", "", ""], **bar_text)
        # 760 wide as the other charts: at 560 the provenance line under the title was cut off
        self.chart.update_layout(title=self._titles[next(iter(llms))],
                                 xaxis_title="mean over the batch's requests", yaxis_title="time (ms)",
                                 barmode="group", height=320, width=760, margin=dict(l=60, r=10, t=60, b=45),
                                 yaxis_rangemode="nonnegative")
        for w in (self.model_menu, self.prompt_slider, self.response_slider, self.batch_slider):
            w.observe(on_main_thread(lambda _c: self.update()), names="value")
        self.add_class("mv-latency-calculator")
        controls = [self.prompt_slider, self.response_slider, self.limit_note, self.batch_slider,
                    self.measure_button]
        if len(llms) > 1:
            controls.insert(0, self.model_menu)
        self.children = [W.HTML(STYLE), W.HBox([W.VBox(controls), self.readout]), self.chart]
        self.update()

    @property
    def point(self) -> tuple[str, int, int, int]:
        """The sliders' point: (model, prompt tokens, response tokens, batch)."""
        return (self.model_menu.value, self.prompt_slider.value, self.response_slider.value, self.batch_slider.value)

    def update(self) -> None:
        """Recompute the prediction for the sliders' point and redraw."""
        name, p, r, b = self.point
        model = self.models[name]
        budget, block_size, num_blocks = self._pool[name]
        self.prediction = model.predict(p, r, b, budget)
        measured = next((m for m in reversed(self.measurements) if m["point"] == self.point), None)
        pr = self.prediction
        rows = [("TTFT", pr["ttft_ms"], measured and measured["ttft_ms"]),
                ("TPOT", pr["tpot_ms"], measured and measured["tpot_ms"]),
                ("total", pr["e2e_ms"], measured and measured["e2e_ms"])]
        table = "".join(f"<tr><td>{k}</td><td class='mv-pred-{k.lower()}'>{fmt_ms(v)}</td>"
                        f"<td>{fmt_ms(m) if measured else '–'}</td></tr>" for k, v, m in rows)
        notes = []
        fitted = self.fit_threads[name]
        if measured and fitted is not None and measured["threads"] != fitted:
            notes.append(f"measured with {measured['threads']} CPU thread(s), the model fitted with {fitted}: "
                         f"not the same machine setting")
        need = b * cdiv(p + r, block_size)
        if need > num_blocks:
            notes.append(f"{b} requests of {p} + {r} tokens need {need} KV blocks at once and the pool has "
                         f"{num_blocks}: some wait or are preempted, which the prediction does not replay")
        if model.r2 < self.MIN_R2:  # said beside the numbers, not only in the small print of the fit
            notes.append(f"the cost model fits its own measurements poorly (R² = {model.r2:.2f}, below "
                         f"{self.MIN_R2}): treat these predictions as rough; other work on the machine during the "
                         f"sweep is a common cause (build the calculator again to re-measure)")
        if model.cold_decode:
            notes.append("the decode cost was fitted to the first decode steps after a prefill, which are slower "
                         "than the steady state: TPOT is over-predicted (add measure_decode_batch rows)")
        self.readout.value = (
            f"<div class='mv-box'><table class='mv-table'><tr><th></th><th>predicted</th><th>measured</th></tr>"
            f"{table}</table><div class='mv-small' style='max-width:360px'>cost model fitted to steps measured "
            f"on this machine: {html.escape(model.describe())}</div>"
            + "".join(f"<div class='mv-note' style='max-width:360px;color:#b00'>⚠ {html.escape(n)}</div>"
                      for n in notes) + "</div>" + self._error)
        predicted = [v for _, v, _ in rows]  # no TPOT with one response token: no bar
        got = [m if (measured and m is not None) else None for _, _, m in rows]
        with self.chart.batch_update():
            self.chart.layout.title.text = self._titles[name]
            self.chart.data[0].y, self.chart.data[0].text = predicted, [_bar_label(v) for v in predicted]
            self.chart.data[1].y, self.chart.data[1].text = got, [_bar_label(v) for v in got]

    def measure(self) -> dict:
        """Run the current point on the engine and record the measured means."""
        name, p, r, b = self.point
        try:
            self.measure_button.disabled = True  # inside: an interrupt while it is sent must not leave it disabled
            m = measure_request_latency(self.llms[name], p, r, b)
        except ValueError as e:  # replaces an earlier refusal: a second click stacked a second copy
            self._error = error_box(str(e))
            self.update()
            return {}
        except KeyboardInterrupt:  # Kernel > Interrupt: say so (the table alone would show the last measurement)
            self._error = error_box("interrupted (Kernel > Interrupt): this measurement was not recorded (the "
                                    "measured column shows the point's previous one, if any); press measure "
                                    "this point again")
            self.update()
            raise
        finally:
            self.measure_button.disabled = False
        self._error = ""
        m["point"] = self.point
        m["threads"] = torch.get_num_threads()
        m["predicted"] = dict(self.prediction)
        self.measurements.append(m)
        self.update()
        return m

    def static_html(self) -> str:
        from ._static import figure_html

        return "<div class='mv-box'>" + self.readout.value + figure_html(self.chart) + "</div>"
