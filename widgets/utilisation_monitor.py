"""``UtilisationMonitor``: utilisation over time during a workload, and a per-step roofline."""
from __future__ import annotations

import math
import os
import random
import time
from html import escape

import ipywidgets as W

from minivllm.sampling_params import SamplingParams
from minivllm.telemetry.utilisation import check_period
from minivllm.utils.gc_heap import heap_frozen

from ._base import STYLE, CourseWidget, error_box
from ._engine import engine_of, fmt_si, plural, titled
from ._main_thread import on_main_thread
from .engine_stepper import PHASE_COLOURS
from .measure import random_prompt


class UtilisationMonitor(CourseWidget):
    """Runs a workload on the engine while ``minivllm.telemetry.utilisation.UtilisationSampler``
    samples the machine, and draws:

    * the sampler's series over time (the machine's CPU busy %, every process's, and this
      process's share of all cores, always; on a GPU, NVML's GPU busy % (a kernel running) and memory
      busy %, which are averages over NVML's 1/6 s to 1 s window: context, not per-step
      figures), with each engine step drawn as a tick coloured by phase on the same clock
      (``time.perf_counter``);
    * a roofline: one point per step at (arithmetic intensity, achieved FLOP/s), the
      step's FLOPs and bytes from ``minivllm.telemetry.roofline`` over its measured wall
      time, under the ceilings ``min(peak FLOP/s, intensity x read bandwidth)`` measured on
      this machine by ``minivllm.telemetry.peaks`` (``Peaks.mbu_bytes_per_s``: the read
      bandwidth where measured, else the copy's).

    Args:
        llm: a ``minivllm.LLM`` or ``LLMEngine`` (idle while the workload runs).
        num_requests / prompt_len / max_tokens: the workload (random prompts, greedy,
            ``ignore_eos``), all submitted at once.
        period_s: sampling period, seconds (positive, finite).
        peaks: measured ``Peaks`` (default ``get_peaks()`` for the engine's device/dtype).

    Raises:
        ValueError: ``llm`` is not an engine or is shut down (``engine_of``), or ``period_s`` is
            not a positive, finite number of seconds.

    State for code and tests: ``records`` (the workload's step records, roofline filled),
    ``samples`` (the sampler's samples), ``interrupted`` (the last run was cut short by a kernel
    interrupt).
    """

    #: below this many samples the readout warns that the utilisation line says little
    MIN_SAMPLES = 5

    def __init__(self, llm, num_requests: int = 4, prompt_len: int = 64, max_tokens: int = 16,
                 period_s: float = 0.05, peaks=None):
        super().__init__()
        self.llm = llm
        self.engine = engine_of(llm)
        self.period_s = check_period(period_s)  # refused here, not after a run has queued its requests
        self._peaks = peaks
        self.records: list = []
        self.samples: list = []
        self.interrupted = False
        self._running_live = False  # a run in progress: its redraws are partial by design
        self.num_requests = W.BoundedIntText(value=num_requests, min=1, max=256, description="requests",
                                             tooltip="1 to 256 (a larger entry is set to 256)", layout=W.Layout(width="170px"))
        self.prompt_len = W.BoundedIntText(value=prompt_len, min=1, max=8192, description="prompt len",
                                           tooltip="1 to 8192 tokens; with max_tokens within the model's max_model_len",
                                           layout=W.Layout(width="170px"))
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=4096, description="max_tokens",
                                           tooltip="1 to 4096 (a larger entry is set to 4096)", layout=W.Layout(width="170px"))
        self.run_button = W.Button(description="Run workload", icon="play", button_style="primary")
        self.run_button.add_class("mv-run")
        self.run_button.on_click(on_main_thread(lambda _: self.run()))
        self.readout = W.HTML()
        from ._static import LiveFigure

        self.series = LiveFigure()
        for name, colour in (("machine CPU busy % (every process)", "#4c78a8"),
                             ("GPU busy % (NVML: a kernel running; window)", "#e4572e"),
                             ("GPU memory busy % (NVML window)", "#54a24b")):
            self.series.add_scatter(name=name, x=[], y=[], mode="lines", line=dict(color=colour))
        for phase in ("prefill", "decode", "mixed"):
            self.series.add_scatter(name=f"{phase} step", x=[], y=[], mode="markers",
                                    marker=dict(symbol="line-ns-open", size=12, color=PHASE_COLOURS[phase]))
        # last, after the step ticks (_redraw finds those by position): the machine's line includes other
        # processes, so the engine's own share is drawn beside it
        self.series.add_scatter(name="this process's CPU % (of all cores)", x=[], y=[], mode="lines",
                                line=dict(color="#72b7b2", dash="dot"))
        self.series.update_layout(title=titled("Utilisation during the workload", self.engine), xaxis_title="time (s)",
                                  yaxis_title="busy (% of capacity)", yaxis_range=[0, 110], height=300, width=760,
                                  margin=dict(l=50, r=10, t=60, b=40), xaxis_rangemode="nonnegative")
        self.roofline = LiveFigure()
        self.roofline.add_scatter(name="ceiling", x=[], y=[], mode="lines", line=dict(color="#333"))
        for phase in ("prefill", "decode", "mixed"):
            self.roofline.add_scatter(name=phase, x=[], y=[], mode="markers",
                                      marker=dict(color=PHASE_COLOURS[phase], size=8))
        # SI prefixes on the log axes: plotly's default wrote 1e11 FLOP/s as "100B" (B for billion)
        self.roofline.update_layout(title=titled("Roofline: one point per step", self.engine), xaxis_type="log", yaxis_type="log",
                                    xaxis_title="arithmetic intensity (FLOP/byte)",
                                    yaxis_title="achieved FLOP/s", height=340, width=760,
                                    xaxis_exponentformat="SI", yaxis_exponentformat="SI",
                                    margin=dict(l=60, r=10, t=60, b=40))
        self.add_class("mv-utilisation-monitor")
        self.children = [W.HTML(STYLE), W.HBox([self.num_requests, self.prompt_len, self.max_tokens,
                                                self.run_button]), self.readout, self.series, self.roofline]

    @property
    def peaks(self):
        """The ``Peaks`` the roofline is drawn under: given, else ``get_peaks()`` for the engine (cached)."""
        if self._peaks is None:
            from minivllm.telemetry.peaks import get_peaks

            self._peaks = get_peaks(self.engine.config.device, self.engine.config.dtype)
        return self._peaks

    def run(self) -> list:
        """Run the workload, sampling all along; returns the step records."""
        from minivllm.telemetry.roofline import engine_cost, fill_step_record
        from minivllm.telemetry.utilisation import UtilisationSampler

        engine = self.engine
        try:
            engine_of(engine)  # shut down by a later cell: said here (the button's exception reached only the log)
        except ValueError as e:
            self.readout.value = error_box(str(e))
            return []
        if engine.has_unfinished_requests():
            self.readout.value = "<div class='mv-box' style='color:#b00'>the engine is busy; reset it first</div>"
            return []
        cost = engine_cost(engine)
        peaks = self.peaks
        rng = random.Random(0)
        engine.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=int(self.max_tokens.value), ignore_eos=True)
        ids = [f"util-{i}" for i in range(int(self.num_requests.value))]
        sampler = UtilisationSampler(period_s=self.period_s, device=str(engine.config.device))  # may refuse: first
        try:
            for rid in ids:
                engine.add_request(rid, random_prompt(engine, int(self.prompt_len.value), rng), params,
                                   output_kind="final_only")
        except BaseException as e:  # a prompt length the engine cannot take, or an interrupt: nothing left queued
            for rid in ids:
                engine.abort_request(rid)
            if not isinstance(e, ValueError):
                raise
            self.readout.value = error_box(str(e))
            return []
        self.records = []
        self.interrupted = False
        t0 = time.perf_counter()
        last = t0
        try:  # from the sampler's start: an interrupt inside it must still stop it and free the requests
            sampler.start()
            self._running_live = True
            with heap_frozen():  # a full collection of the process's heap is not a step (minivllm.utils.gc_heap)
                while engine.has_unfinished_requests():
                    rec = engine.step_with_record().record
                    if rec.mfu is None and rec.num_tokens:
                        fill_step_record(rec, cost, peaks)
                    self.records.append(rec)
                    if time.perf_counter() - last > 0.25:  # live update while it runs
                        self.samples = sampler.samples
                        self._redraw(t0)
                        last = time.perf_counter()
        except KeyboardInterrupt:  # Kernel > Interrupt: the readout says the run is partial, then it re-raises
            self.interrupted = True
            raise
        finally:
            sampler.stop()
            self._running_live = False
            for rid in ids:
                engine.abort_request(rid)
            engine.reset_prefix_cache()
            self.samples = sampler.samples
            self._redraw(t0)
        return self.records

    def _redraw(self, t0: float) -> None:
        from minivllm.telemetry.roofline import arithmetic_intensity

        s = self.samples
        peaks = self.peaks
        with self.series.batch_update():
            xs = [x.time - t0 for x in s]
            self.series.data[0].x, self.series.data[0].y = xs, [x.cpu_percent for x in s]
            gpu = [x.gpu_util_percent for x in s]
            if any(g is not None for g in gpu):
                self.series.data[1].x, self.series.data[1].y = xs, gpu
                self.series.data[2].x, self.series.data[2].y = xs, [x.mem_util_percent for x in s]
            cores = len(s[-1].per_cpu_percent) if s and s[-1].per_cpu_percent else (os.cpu_count() or 1)
            own = self.series.data[-1]
            own.x, own.y = xs, [None if x.process_cpu_percent is None else x.process_cpu_percent / cores for x in s]
            for trace in self.series.data[3:-1]:
                phase = trace.name.split()[0]
                recs = [r for r in self.records if r.phase == phase]
                trace.x = [(r.start_time + r.end_time) / 2 - t0 for r in recs]
                trace.y = [104] * len(recs)
        pts = [r for r in self.records if r.flops]
        with self.roofline.batch_update():
            for trace in self.roofline.data[1:]:
                recs = [r for r in pts if r.phase == trace.name]
                trace.x = [arithmetic_intensity(r.flops, r.bytes_moved) for r in recs]
                trace.y = [r.flops / (r.wall_ms / 1e3) for r in recs]
            if pts:
                lo = min(arithmetic_intensity(r.flops, r.bytes_moved) for r in pts) / 2
                hi = max(arithmetic_intensity(r.flops, r.bytes_moved) for r in pts) * 2
                hi = max(hi, peaks.ridge_intensity * 2)
                xs = [lo, peaks.ridge_intensity, hi]
                roof = self.roofline.data[0]
                roof_y = [min(peaks.flops_per_s, x * peaks.mbu_bytes_per_s) for x in xs]
                roof.x, roof.y = xs, roof_y  # (read back only when the batch update ends)
                # the ceilings' values in the legend, and room above the flat one (log axis: exponents)
                roof.name = (f"roof: {peaks.mbu_bytes_per_s / 1e9:.1f} GB/s read, "
                             f"{peaks.flops_per_s / 1e9:.0f} GFLOP/s matmul")
                ys = [r.flops / (r.wall_ms / 1e3) for r in pts] + [roof_y[0]]
                self.roofline.layout.yaxis.range = [math.log10(min(ys) / 2),
                                                    math.log10(max(max(ys), peaks.flops_per_s) * 3)]
        warnings = []
        if self.interrupted:
            n = len(self.records)
            shown = ("the charts show a partial workload" if n else
                     "no step had finished, so the charts show no step")
            warnings.append(f"interrupted (Kernel > Interrupt) after {plural(n, 'step')}: {shown}; "
                            "its requests were aborted")
        if len(s) < self.MIN_SAMPLES and not self._running_live:
            span = (s[-1].time - t0) if s else 0.0
            warnings.append(f"only {plural(len(s), 'utilisation sample')} over {span:.2f} s "
                            f"(period_s={self.period_s}): too few for the busy-% line to say much; give the "
                            "workload more requests or tokens, or a shorter period_s")
        note = "".join(f"<div class='mv-box mv-warning' style='color:#b00'>⚠ {escape(w)}</div>" for w in warnings)
        if pts:
            best = max(pts, key=lambda r: r.mfu or 0)
            self.readout.value = note + (
                f"<div class='mv-box'>{len(self.records)} steps, {len(s)} samples · peaks ({escape(peaks.provenance)}): "
                f"{fmt_si(peaks.flops_per_s, 'FLOP/s')}, {fmt_si(peaks.mbu_bytes_per_s, 'B/s')} read (ridge at "
                f"{peaks.ridge_intensity:.1f} FLOP/byte) · best MFU {100 * (best.mfu or 0):.2f} % "
                f"({best.phase} step)</div>")
        else:
            self.readout.value = note

    def static_html(self) -> str:
        from ._static import figure_html

        if not self.records:
            return "<i>no workload run yet</i>"
        return "<div class='mv-box'>" + self.readout.value + figure_html(self.series) + \
            figure_html(self.roofline) + "</div>"
