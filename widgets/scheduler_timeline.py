"""``SchedulerTimeline``: what the scheduler did with every request, step by step."""
from __future__ import annotations

import ipywidgets as W

from ._base import STYLE, CourseWidget

STATES = ["", "waiting", "prefill", "decode", "preempted", "finished"]
STATE_COLOURS = ["#ffffff", "#d9d9d9", "#e4572e", "#f0a202", "#222222", "#54a24b"]


def request_states(records, arrivals: dict[str, int]) -> dict[str, list[str]]:
    """Each request's state at each step, from the step records alone.

    Args:
        records: ``StepRecord`` list in step order.
        arrivals: request id -> index (in ``records``) of the first step after it arrived.

    A state is "" (not arrived, or finished earlier), "waiting" (arrived, not in the step),
    "prefill" (a prefill chunk in the step), "decode", "preempted" (its blocks were taken
    back this step; it will be recomputed), or "finished" (its last token came this step).
    """
    states = {rid: [""] * len(records) for rid in arrivals}
    done: set[str] = set()
    for i, rec in enumerate(records):
        entries = {e.request_id: e for e in rec.scheduled}
        for rid, first in arrivals.items():
            if i < first or rid in done:
                continue
            if rid in rec.finished:
                states[rid][i] = "finished"
                done.add(rid)
            elif rid in entries:
                states[rid][i] = "prefill" if entries[rid].is_prefill else "decode"
            elif rid in rec.preempted:
                states[rid][i] = "preempted"
            else:
                states[rid][i] = "waiting"
    return states


class SchedulerTimeline(CourseWidget):
    """One row per request over engine steps, coloured by its state, and a stacked bar per
    step of prefill vs decode tokens.

    Where it comes from: the ``StepRecord`` of each step (``scheduled`` entries with their
    ``is_prefill`` flag and token counts, ``preempted``, ``finished``) and when each request
    was added. Follow an ``EngineStepper`` (``SchedulerTimeline(stepper=...)``) or draw a
    finished run with :meth:`show_run` (give ``llm=`` the engine that ran it, so the title names
    the device, model, dtype and threads; a stepper's engine is named by itself).

    Args:
        stepper: an ``EngineStepper`` to follow (redrawn after each of its steps), or None.
        records / arrivals: without a stepper, a finished run to draw now: its ``StepRecord`` list
            (step order) and each request's arrival step (request id -> steps taken before it was
            added); both may be left out for an empty chart that :meth:`show_run` fills later.
        llm: the engine that ran ``records``, named in the title (device, model, dtype, threads).

    State for code and tests: ``states`` (request id -> state per step, see
    :func:`request_states`), ``num_steps``.
    """

    def __init__(self, stepper=None, records=None, arrivals=None, llm=None):
        super().__init__()
        import plotly.graph_objects as go

        from ._static import LiveFigure
        from plotly.subplots import make_subplots

        base = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.62, 0.38], vertical_spacing=0.06)
        n = len(STATES) - 1
        scale = []
        for k, colour in enumerate(STATE_COLOURS):  # discrete colours for codes 0..n
            scale += [[k / (n + 1), colour], [(k + 1) / (n + 1), colour]]
        base.add_trace(go.Heatmap(z=[], x=[], y=[], zmin=-0.5, zmax=n + 0.5, colorscale=scale, showscale=False,
                                  xgap=1, ygap=2, hoverinfo="text", text=[]), row=1, col=1)
        for k in range(1, len(STATES)):  # legend entries for the states
            base.add_scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="square", size=10,
                             color=STATE_COLOURS[k]), name=STATES[k], row=1, col=1)
        # the bars share the states' colours (prefill red, decode orange): one legend entry per colour, not
        # two entries of the same colour side by side
        base.add_bar(x=[], y=[], name="prefill tokens", marker_color=STATE_COLOURS[STATES.index("prefill")],
                     showlegend=False, row=2, col=1)
        base.add_bar(x=[], y=[], name="decode tokens", marker_color=STATE_COLOURS[STATES.index("decode")],
                     showlegend=False, row=2, col=1)
        base.update_layout(barmode="stack", height=380, width=760, margin=dict(l=70, r=10, t=60, b=40),
                           title=self._title(llm if llm is not None else getattr(stepper, "engine", None)),
                           legend=dict(orientation="h", y=-0.18, traceorder="normal"), yaxis_title="request",
                           xaxis2_title="engine step", yaxis2_title="tokens in the step",
                           xaxis2_tickformat="d", xaxis_tickformat="d", yaxis2_rangemode="nonnegative")
        self.chart = LiveFigure(base)
        self.states: dict[str, list[str]] = {}
        self.num_steps = 0
        self.stepper = None
        self.add_class("mv-scheduler-timeline")
        self.children = [W.HTML(STYLE), self.chart]
        if stepper is not None:
            self.attach(stepper)
        else:  # empty until show_run is given steps: drawn now so that its axes start at 0
            self.show_run(records or [], arrivals or {})

    @staticmethod
    def _title(llm) -> str:
        from ._engine import titled

        return titled("Scheduler timeline", llm) if llm is not None else "Scheduler timeline"

    def attach(self, stepper) -> "SchedulerTimeline":
        """Redraw after every step of ``stepper`` (and after its adds and resets)."""
        self.stepper = stepper
        self.chart.layout.title.text = self._title(stepper.engine)
        stepper.on_step(lambda s, _r: self.show_run(s.steps, {rid: s.arrival_step(rid) for rid in s.request_ids}))
        self.show_run(stepper.steps, {rid: stepper.arrival_step(rid) for rid in stepper.request_ids})
        return self

    def show_run(self, records, arrivals: dict[str, int]) -> None:
        """Draw ``records`` (step order) for the requests in ``arrivals`` (see :func:`request_states`)."""
        self.states = request_states(records, arrivals)
        self.num_steps = len(records)
        rids = list(arrivals)
        xs = [r.index for r in records]
        z = [[STATES.index(s) for s in self.states[rid]] for rid in rids]
        text = [[f"{rid}, step {x}: {s or '-'}" for x, s in zip(xs, self.states[rid])] for rid in rids]
        with self.chart.batch_update():
            # nothing yet: plotly's empty axes run from -1 and number requests that do not exist
            self.chart.layout.xaxis2.range = None if records else [-0.5, 9.5]
            self.chart.layout.xaxis2.autorange = True if records else None
            self.chart.layout.yaxis.showticklabels = bool(rids)
            hm = self.chart.data[0]
            hm.z, hm.x, hm.y, hm.text = z, xs, rids, text
            self.chart.data[-2].x = xs
            self.chart.data[-2].y = [r.num_prefill_tokens for r in records]
            self.chart.data[-1].x = xs
            self.chart.data[-1].y = [r.num_decode_tokens for r in records]

    def static_html(self) -> str:
        from ._static import figure_html

        return figure_html(self.chart) if self.num_steps else "<i>no steps yet</i>"
