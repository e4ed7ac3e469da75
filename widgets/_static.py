"""Static renderings of live charts, so a saved notebook reads without JavaScript.

Live charts are plotly ``FigureWidget``s. A notebook stores a widget as a reference
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

import base64
import html
import os
import shutil
import threading
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

            kaleido.start_sync_server(silence_warnings=True)
        except Exception:  # no kaleido, or it cannot start the browser: text fallback
            _disabled = True
            return False
        _server_started = True
        return True


def figure_png(fig, width: int = 760, height: int | None = None) -> bytes | None:
    """PNG bytes of a plotly figure (``Figure`` or ``FigureWidget``), or None when no
    Chrome/kaleido is available or export fails."""
    if not _ensure_server():
        return None
    h = height or (fig.layout.height or 360)
    w = fig.layout.width or width
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fig.to_image(format="png", width=w, height=h, scale=1)
    except Exception:
        return None


def figure_html(fig, width: int = 760, height: int | None = None) -> str:
    """An ``<img>`` of the figure (base64 PNG), or a short text note when export is unavailable."""
    png = figure_png(fig, width, height)
    title = ""
    if fig.layout.title is not None and fig.layout.title.text:
        title = fig.layout.title.text
    if png is None:
        n = sum(len(t.x) if getattr(t, "x", None) is not None else 0 for t in fig.data)
        return (f"<div class='mv-static-chart'><i>[chart: {html.escape(title)}; {n} points; "
                "static image unavailable (no Chrome for kaleido)]</i></div>")
    b64 = base64.b64encode(png).decode("ascii")
    return (f"<img class='mv-static-chart' alt='{html.escape(title)}' "
            f"src='data:image/png;base64,{b64}'/>")


class StaticFigure:
    """Display wrapper for a plotly figure: the interactive plotly view (JupyterLab renders
    ``application/vnd.plotly.v1+json``) plus a PNG for viewers without JavaScript."""

    def __init__(self, fig, width: int = 760, height: int | None = None):
        self.fig = fig
        self.width = width
        self.height = height

    def _repr_mimebundle_(self, **kwargs):
        import json

        import plotly.io as pio

        data = {"application/vnd.plotly.v1+json": json.loads(pio.to_json(self.fig, validate=False)),
                "text/plain": f"<plotly figure: {self.fig.layout.title.text or 'untitled'}>"}
        png = figure_png(self.fig, self.width, self.height)
        if png is not None:
            data["image/png"] = base64.b64encode(png).decode("ascii")
        return data


def show_figure(fig, width: int = 760, height: int | None = None) -> None:
    """Display a plotly figure live and as a static PNG (see :class:`StaticFigure`)."""
    from IPython.display import display

    display(StaticFigure(fig, width, height))
