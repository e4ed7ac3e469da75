"""Live charts that stay small in a saved notebook, and static renderings of them.

Live charts are :class:`LiveFigure`\ s: a plotly figure that is also an ipywidgets ``Output`` showing
the figure as plotly's JSON (``application/vnd.plotly.v1+json``), redrawn whenever the figure changes.
JupyterLab draws that JSON with the plotly renderer it already has (the ``jupyterlab-plotly``
extension installed with plotly), so a chart costs its data (kilobytes) in a saved notebook's widget
state. plotly's own ``FigureWidget`` is an anywidget that carries the whole plotly.js bundle (about
5 MB) in every instance's state: a notebook saved with widget state (JupyterLab's save, nbconvert
``--execute``) grew by 5 MB per chart.

A notebook stores a widget as a reference
to kernel-side state, which a viewer without a running kernel (GitHub, nbconvert,
a static site) cannot draw. Every widget in this package therefore also emits a
``text/html`` snapshot beside its widget view; charts in that snapshot are PNG
images rendered by plotly's ``kaleido`` exporter, which drives a headless
Chrome/Chromium. Front ends that run widgets (JupyterLab, Notebook 7, VS Code) rank
the widget view first and show the live widget; the others show the snapshot.

Where no Chrome is found the snapshot carries the chart's title and data summary
as text instead of an image (:func:`figure_png` returns None).
"""
from __future__ import annotations

import asyncio
import base64
import html
import os
import re
import shutil
import threading
import time
import warnings

_CHROME_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
_server_lock = threading.Lock()
_server_started = False
_disabled = False


def find_chrome() -> str | None:
    """Path of a Chrome/Chromium binary kaleido can drive: ``$BROWSER_PATH`` or a usual location."""
    env = os.environ.get("BROWSER_PATH")
    if env and os.path.exists(env):
        return env
    for path in _CHROME_CANDIDATES:
        if os.path.exists(path):
            return path
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _ensure_server() -> bool:
    """Start kaleido's persistent browser once (the first image then costs ~5 s, later ones ~0.3 s)."""
    global _server_started, _disabled
    if _disabled:
        return False
    with _server_lock:
        if _server_started:
            return True
        chrome = find_chrome()
        if chrome is None:
            _disabled = True
            return False
        os.environ.setdefault("BROWSER_PATH", chrome)
        try:
            import kaleido

            _keep_server_failure()  # before the start: the browser may fail at once
            # plotly passes kaleido options a persistent server cannot take, and says so at every export
            warnings.filterwarnings("ignore", message="The kopts argument is ignored", category=UserWarning)
            kaleido.start_sync_server(silence_warnings=True)
        except Exception:  # no kaleido, or it cannot start the browser: text fallback
            _disabled = True
            return False
        _server_started = True
        return True


_server_failure: BaseException | None = None
_hook_installed = False


def _keep_server_failure() -> None:
    """Keep the exception that ends kaleido's server thread (a browser that cannot start) for
    :func:`figure_png` to report in one line, instead of a traceback in whichever cell runs."""
    global _hook_installed
    if _hook_installed:
        return
    previous = threading.excepthook

    def hook(args):
        global _server_failure
        if args.thread is not None and args.thread is _server_thread():
            _server_failure = args.exc_value
        else:
            previous(args)

    threading.excepthook = hook
    _hook_installed = True


def image_size(fig, width: int | None = None, height: int | None = None) -> tuple[int, int]:
    """``(width, height)`` in pixels of a figure's static image: each argument given, else the
    figure's layout's, else 760 x 360 (the same for the PNG and the SVG fallback)."""
    return int(width or fig.layout.width or 760), int(height or fig.layout.height or 360)


# The longest a snapshot may wait for kaleido before the text fallback, seconds: a first image
# takes ~5 s (the browser starts), a loaded 2-core machine several times that.
EXPORT_TIMEOUT_S = 120.0


def _server_thread() -> threading.Thread | None:
    """kaleido's server thread, or None (not started, or another kaleido layout: then only the
    timeout guards an export's wait)."""
    try:
        import kaleido

        return getattr(kaleido._global_server, "_thread", None)
    except Exception:
        return None


def _server_thread_dead() -> bool:
    """Whether kaleido's server thread has exited (its browser failed to start, or it crashed).
    kaleido then queues an export that nothing will take and waits for it forever."""
    thread = _server_thread()
    return thread is not None and not thread.is_alive()


_export_lock = threading.Lock()
# Set when the latest export's thread has finished; unset while one an interrupt left behind runs.
# (An Event, not Thread.is_alive: Python 3.11's Thread.join, interrupted, marks a running thread stopped.)
_last_export: threading.Event | None = None


def _wait_for(done: threading.Event, deadline: float) -> bool:
    """Wait for an export's ``done`` while kaleido's server thread lives, until ``deadline``
    (``time.monotonic()``); True if it finished."""
    while not done.wait(0.05):
        if _server_thread_dead() or time.monotonic() > deadline:
            return False
    return True


def figure_png(fig, width: int | None = None, height: int | None = None) -> bytes | None:
    """PNG bytes of a plotly figure (``Figure`` or ``FigureWidget``), or None when no
    Chrome/kaleido is available or export fails. ``width`` / ``height``: pixels (default: the
    figure's layout's, else 760 x 360; :func:`image_size`).

    The export runs in a thread so that a browser that cannot start (kaleido's server thread
    then dies and its export waits forever) costs the caller a fallback, not a hung kernel:
    once the server thread has died, or an export has taken :data:`EXPORT_TIMEOUT_S` seconds,
    this and every later call return None at once. One export at a time: kaleido hands its
    results back in order, so an export left running by an interrupt is waited for before the
    next starts (else each would take the other's image)."""
    global _disabled, _last_export
    if not _ensure_server():
        return None
    w, h = image_size(fig, width, height)
    result: list = []
    done = threading.Event()

    def export():
        try:
            result.append(fig.to_image(format="png", width=w, height=h, scale=1))
        except Exception:
            result.append(None)
        finally:
            done.set()

    with _export_lock:
        deadline = time.monotonic() + EXPORT_TIMEOUT_S
        if _last_export is None or _wait_for(_last_export, deadline):
            threading.Thread(target=export, name="minivllm-png-export", daemon=True).start()
            _last_export = done  # once it runs: an event no thread will set would stall the next export
            if _wait_for(done, deadline):
                return result[0] if result else None
        _disabled = True  # the abandoned export stays blocked in its daemon thread
    failure = _server_failure
    why = (f"{type(failure).__name__}: {(failure.args[0] if failure.args else failure)}" if failure
           else "its server thread exited" if _server_thread_dead() else f"no image after {EXPORT_TIMEOUT_S:.0f} s")
    warnings.warn(f"kaleido could not export a chart ({why}); the widgets' saved snapshots draw "
                  "charts as SVG or text instead", RuntimeWarning, stacklevel=2)
    return None


def figure_html(fig, width: int | None = None, height: int | None = None) -> str:
    """An ``<img>`` of the figure (base64 PNG); without Chrome, an SVG drawn by
    :func:`figure_svg` (bar and scatter charts), else a short text note. Both images take the
    size :func:`image_size` gives (pixels)."""
    png = figure_png(fig, width, height)
    title = ""
    if fig.layout.title is not None and fig.layout.title.text:
        title = fig.layout.title.text
    if png is None:
        svg = figure_svg(fig, width, height)
        if svg is not None:
            return f"<div class='mv-static-chart'>{svg}</div>"
        n = sum(len(t.x) if getattr(t, "x", None) is not None else 0 for t in fig.data)
        return (f"<div class='mv-static-chart'><i>[chart: {html.escape(title)}; {n} points; "
                "static image unavailable (no Chrome for kaleido)]</i></div>")
    b64 = base64.b64encode(png).decode("ascii")
    return (f"<img class='mv-static-chart' alt='{html.escape(title)}' "
            f"src='data:image/png;base64,{b64}'/>")


def plotly_bundle(fig) -> dict:
    """The figure as plotly's JSON mime type (drawn by JupyterLab's plotly renderer) plus a text line."""
    import json

    import plotly.io as pio

    title = fig.layout.title.text if fig.layout.title is not None else None
    return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(fig, validate=False)),
            "text/plain": f"<plotly figure: {title or 'untitled'}>"}


def _live_figure_class():
    import ipywidgets as W
    import plotly.graph_objects as go

    class LiveFigure(go.Figure, W.Output):
        """A plotly ``Figure`` that is also a widget: an ipywidgets ``Output`` holding the figure's
        plotly JSON, redrawn after every change (``fig.data[0].y = ...``, ``update_layout``, the end of
        a ``batch_update()`` block). Use it where ``go.FigureWidget`` would go (a widget's children,
        ``display``); it does not embed plotly.js (see the module docstring). Zoom and pan are reset
        by each redraw, and clicks on the chart do not reach Python."""

        #: Seconds between two redraws. Each redraw makes the browser draw the chart anew (there is
        #: no incremental update), so a run that changes the figure every few milliseconds would
        #: queue more drawing than the browser can do; changes in between are drawn by a trailing
        #: redraw on the kernel's event loop.
        min_redraw_s = 0.5
        #: ... and at least this long per point drawn: a redraw costs the browser time in proportion to
        #: the points (every bar is drawn anew), and clicks wait while it draws. Chapter 06's stepper
        #: after 400-1,200 steps of a long run, a "Stop" click to the kernel's stop() (JupyterLab 4.6.6,
        #: headless Chromium, the 2-core dev machine, 2026-12-07): median 0.97 s over 6 runs redrawing
        #: at 2 ms a point, 0.60 s over 9 at 5 ms, 0.38 s over 6 with the chart not redrawn during the
        #: run (redrawn twice a second whatever its size, a one-cell notebook's stepper after 1,200-1,800
        #: steps: 1.1-2.0 s)
        redraw_s_per_point = 5e-3

        def __init__(self, data=None, layout=None, **kwargs):
            self._live, self._last_draw, self._dirty, self._pending = False, 0.0, False, False
            super().__init__(data, layout, **kwargs)
            self.add_class("mv-live-figure")
            self._live = True
            self._draw()

        def _draw(self) -> None:
            self._last_draw, self._dirty = time.monotonic(), False
            self.outputs = ({"output_type": "display_data", "data": plotly_bundle(self), "metadata": {}},)

        def _redraw(self) -> None:
            if not getattr(self, "_live", False) or getattr(self, "_in_batch_mode", False):
                return
            self._dirty = True
            points = sum(len(t.x) for t in self.data if getattr(t, "x", None) is not None)
            wait = self._last_draw + max(self.min_redraw_s, points * self.redraw_s_per_point) - time.monotonic()
            if wait <= 0:
                self._draw()
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop (a script, a test): draw now
                self._draw()
                return
            if not self._pending:
                self._pending = True
                loop.call_later(wait, self._trailing_draw)

        def _trailing_draw(self) -> None:
            self._pending = False
            if self._dirty:
                self._draw()

        # plotly calls these after every change a FigureWidget would send to the browser
        def _send_addTraces_msg(self, *args, **kwargs):
            self._redraw()

        _send_animate_msg = _send_deleteTraces_msg = _send_moveTraces_msg = _send_addTraces_msg
        _send_relayout_msg = _send_restyle_msg = _send_update_msg = _send_addTraces_msg

        def _repr_mimebundle_(self, **kwargs):
            return W.Output._repr_mimebundle_(self, **kwargs)

    return LiveFigure


def __getattr__(name):  # LiveFigure is built on first use: importing this module stays free of plotly
    if name == "LiveFigure":
        cls = _live_figure_class()
        globals()["LiveFigure"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def round_overlay_ticks(fig):
    """Give every overlaying axis (a second y axis on the right, ``overlaying="y"``) plotly's own
    round tick values, and returns ``fig``.

    plotly.js defaults an overlaying axis without tick settings to ``tickmode="sync"``: its ticks sit
    on the main axis's grid lines, at values such as 2.1 / 4.21 / 6.31 ms. With ``tickmode="auto"``
    they are round numbers; the overlaying axis's own grid is hidden so that the two grids do not
    cross. Axes with any tick setting of their own are left as they are."""
    for name in list(fig.layout):
        if not (name.startswith("yaxis") or name.startswith("xaxis")):
            continue
        axis = fig.layout[name]
        if axis is None or not getattr(axis, "overlaying", None):
            continue
        if axis.tickmode is None and axis.tickvals is None and axis.dtick is None and axis.nticks is None:
            axis.tickmode = "auto"
            if axis.showgrid is None:
                axis.showgrid = False
    return fig


class StaticFigure:
    """Display wrapper for a plotly figure: the interactive plotly view (JupyterLab renders
    ``application/vnd.plotly.v1+json``) plus a PNG for viewers without JavaScript. Overlaying axes
    get round ticks (:func:`round_overlay_ticks`)."""

    def __init__(self, fig, width: int | None = None, height: int | None = None):
        self.fig = round_overlay_ticks(fig)
        self.width = width
        self.height = height

    def _repr_mimebundle_(self, **kwargs):
        data = plotly_bundle(self.fig)
        png = figure_png(self.fig, self.width, self.height)
        if png is not None:
            data["image/png"] = base64.b64encode(png).decode("ascii")
        return data


def show_figure(fig, width: int | None = None, height: int | None = None) -> None:
    """Display a plotly figure live and as a static PNG of ``width`` x ``height`` pixels (see
    :class:`StaticFigure` and :func:`image_size`; a second y axis gets round ticks)."""
    from IPython.display import display

    display(StaticFigure(fig, width, height))


_SVG_COLOURS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"]


def _trace_colour(trace, i: int) -> str:
    for attr in ("marker", "line"):
        c = getattr(getattr(trace, attr, None), "color", None)
        if isinstance(c, str):
            return c
    return _SVG_COLOURS[i % len(_SVG_COLOURS)]


def nice_step(span: float, target: int = 5) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) that cuts ``span`` into about
    ``target`` intervals."""
    import math

    if not span > 0:
        return 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values covering ``[lo, hi]``: multiples of :func:`nice_step`, from the one at or
    below ``lo`` to the one at or above ``hi``."""
    import math

    step = nice_step(hi - lo, target)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _tick_label(v: float) -> str:
    return f"{v:.6g}"


def _log_tick_label(v: float) -> str:
    """A power of ten with an SI prefix ("100G", "1k"): ``%g`` wrote 1e11 as "1e+11"."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:g}{prefix}"
    return f"{v:g}"


def figure_svg(fig, width: int | None = None, height: int | None = None) -> str | None:
    """A plain SVG of a single-panel figure made of bar and scatter traces (the fallback
    when no Chrome is available for kaleido). Returns None for anything else (heatmaps,
    subplots), so the caller can fall back further. Its size: :func:`image_size` (pixels)."""
    import math

    traces = [t for t in fig.data if t.x is not None and t.y is not None and len(t.x)]
    if not traces or any(t.type not in ("bar", "scatter") for t in fig.data):
        return None
    if any(getattr(t, "xaxis", "x") not in (None, "x") for t in fig.data):
        return None
    w, h = image_size(fig, width, height)
    left, right, top, bottom = 60, 170, 40, 45
    pw, ph = w - left - right, h - top - bottom
    logy = fig.layout.yaxis.type == "log"
    categorical = any(isinstance(x, str) for t in traces for x in t.x)
    cats: list = []
    if categorical:
        for t in traces:
            for x in t.x:
                if x not in cats:
                    cats.append(x)
    ys = [float(y) for t in traces for y in t.y if y is not None and (not logy or y > 0)]
    if not ys:
        return None
    fy = (lambda v: math.log10(v)) if logy else (lambda v: v)
    y0, y1 = min(fy(v) for v in ys), max(fy(v) for v in ys)
    if logy:  # one tick per power of ten (every other one beyond six decades)
        y0, y1 = math.floor(y0), max(math.ceil(y1), math.floor(y0) + 1)
        yticks = list(range(int(y0), int(y1) + 1, 1 if y1 - y0 <= 6 else 2))
    else:  # round ticks; bars need a baseline below the smallest value
        y0 = min(0.0, y0)
        if y1 == y0:
            y1 = y0 + 1
        yticks = nice_ticks(y0, y1)
        y0, y1 = yticks[0], yticks[-1]
    if categorical:
        xpos = {c: i + 0.5 for i, c in enumerate(cats)}
        x0, x1 = 0.0, float(len(cats))
    else:
        xs = [float(x) for t in traces for x in t.x]
        x0, x1 = min(xs), max(xs)
        pad = (x1 - x0) * 0.05 or 0.5
        x0, x1 = x0 - pad, x1 + pad

    def sx(x):
        v = xpos[x] if categorical else float(x)
        return left + (v - x0) / (x1 - x0) * pw

    def sy(y):
        return top + ph - (fy(float(y)) - y0) / (y1 - y0) * ph

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' "
           f"font-size='11'><rect width='{w}' height='{h}' fill='white'/>",
           f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' fill='#f3f5f9'/>"]
    title = fig.layout.title.text if fig.layout.title is not None else None
    if title:  # plotly markup (the provenance line: "title<br><sup>measured on ...</sup>") as SVG lines
        for i, part in enumerate(re.split(r"<br\s*/?>", title)[:2]):
            text = html.unescape(re.sub(r"<[^>]+>", "", part))
            out.append(f"<text x='{left}' y='{20 + 14 * i}' font-size='{15 if i == 0 else 10}'>"
                       f"{html.escape(text)}</text>")
    for v in yticks:  # y grid and labels, at round values
        yy = top + ph - (v - y0) / (y1 - y0) * ph
        label = _log_tick_label(10.0 ** v) if logy else _tick_label(v)
        out.append(f"<line x1='{left}' x2='{left + pw}' y1='{yy:.1f}' y2='{yy:.1f}' stroke='white'/>"
                   f"<text x='{left - 6}' y='{yy + 4:.1f}' text-anchor='end'>{label}</text>")
    ticks = cats if categorical else [x for x in nice_ticks(x0, x1) if x0 <= x <= x1]
    step = max(1, len(ticks) // 10)
    for x in ticks[::step]:
        label = html.escape(str(x)) if categorical else _tick_label(x)
        out.append(f"<text x='{sx(x):.1f}' y='{top + ph + 15}' text-anchor='middle'>{label}</text>")
    for axis, anchor in ((fig.layout.xaxis, "x"), (fig.layout.yaxis, "y")):
        t = axis.title.text if axis.title is not None else None
        if t and anchor == "x":
            out.append(f"<text x='{left + pw / 2}' y='{h - 8}' text-anchor='middle'>{html.escape(t)}</text>")
        elif t:
            out.append(f"<text transform='translate(14,{top + ph / 2}) rotate(-90)' text-anchor='middle'>"
                       f"{html.escape(t)}</text>")
    bars = [t for t in traces if t.type == "bar"]
    slot = (pw / (len(cats) if categorical else max(len(traces[0].x), 1))) * 0.8
    bw = slot / max(len(bars), 1) if fig.layout.barmode in (None, "group") else slot
    base = sy(10 ** y0) if logy else sy(0)
    for i, t in enumerate(traces):
        colour = _trace_colour(t, i)
        if t.type == "bar":
            j = bars.index(t)
            off = (j - (len(bars) - 1) / 2) * bw if fig.layout.barmode in (None, "group") else 0
            for x, y in zip(t.x, t.y):
                if y is None or (logy and y <= 0):
                    continue
                top_y = sy(y)
                out.append(f"<rect x='{sx(x) + off - bw / 2:.1f}' y='{min(top_y, base):.1f}' width='{bw:.1f}' "
                           f"height='{abs(base - top_y):.1f}' fill='{colour}'/>")
        else:
            pts = [(sx(x), sy(y)) for x, y in zip(t.x, t.y) if y is not None and (not logy or y > 0)]
            if "lines" in (t.mode or "lines") and len(pts) > 1:
                path = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
                out.append(f"<polyline points='{path}' fill='none' stroke='{colour}' stroke-width='2'/>")
            if "markers" in (t.mode or ""):
                out += [f"<circle cx='{a:.1f}' cy='{b:.1f}' r='3' fill='{colour}'/>" for a, b in pts]
        ly = top + 14 * i + 6
        out.append(f"<rect x='{left + pw + 10}' y='{ly - 8}' width='10' height='10' fill='{colour}'/>"
                   f"<text x='{left + pw + 25}' y='{ly + 1}'>{html.escape(str(t.name or ''))}</text>")
    out.append("</svg>")
    return "".join(out)
