"""Shared behaviour of the course widgets: one-line display with a static snapshot."""
from __future__ import annotations

import html

import ipywidgets as W
from plotly.colors import qualitative

STYLE = """<style>
.mv-box{font-family:var(--jp-content-font-family,system-ui,sans-serif);font-size:13px;line-height:1.5}
.mv-tok{display:inline-block;padding:0 3px;margin:1px;border-radius:3px;font-family:monospace;font-size:12px;
  white-space:pre;border:1px solid transparent}
.mv-tok-wait{background:#eee;color:#999}
.mv-tok-done{background:#cfe3f7;color:#123}
.mv-tok-chunk{background:#e4572e;color:#fff}
.mv-tok-cached{background:#c9e8c4;color:#123;border-color:#5a9a50}
.mv-tok-gen{background:#f2e2b8;color:#321}
.mv-tok-new{background:#f0a202;color:#000;font-weight:bold}
.mv-badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:11px;color:#fff;margin-right:4px}
.mv-bar{height:14px;display:inline-block;vertical-align:middle}
.mv-bartrack{display:inline-block;width:220px;height:14px;background:#eee;vertical-align:middle;margin:0 6px}
.mv-kv-grid{display:flex;flex-wrap:wrap;gap:2px;max-width:760px}
.mv-kv{width:30px;height:22px;font-size:9px;text-align:center;line-height:22px;border-radius:3px;
  box-sizing:border-box;font-family:monospace;cursor:default}
.mv-kv-free{background:#f1f1f1;color:#aaa}
.mv-kv-cachedfree{background:repeating-linear-gradient(45deg,#dde7dd,#dde7dd 3px,#f4f4f4 3px,#f4f4f4 6px);
  color:#555}
.mv-kv-shared{border:3px solid #222}
.mv-small{color:#666;font-size:11px}
table.mv-table{border-collapse:collapse;font-size:12px}
table.mv-table td,table.mv-table th{padding:2px 6px;border-bottom:1px solid #eee;text-align:left}
</style>"""


def error_box(message: str) -> str:
    """A refusal or error, said in red in a widget's readout (``message`` is escaped)."""
    return f"<div class='mv-box' style='color:#b00'>{html.escape(message)}</div>"


#: One colour per request, in the order requests were added (cycled after 20): Tableau's ten, then ten
#: darker ones of plotly's Dark24, so the KV grid tells an 11th request from the 1st
PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#9d755d", "#eeca3b",
           "#ff9da6", "#bab0ac"] + [qualitative.Dark24[i] for i in (5, 7, 10, 14, 16, 19, 11, 6, 18, 22)]


class CourseWidget(W.VBox):
    """A ``VBox`` that also carries a static HTML snapshot for viewers without a kernel.

    Subclasses implement :meth:`static_html`. ``display()`` shows the live widget;
    the notebook stores the widget view *and* the snapshot (``text/html``), and each
    front end picks what it can render.
    """

    def static_html(self) -> str:  # pragma: no cover - overridden
        return ""

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        try:
            snap = self.static_html()
        except Exception as e:  # a snapshot must never break the live widget
            snap = f"<i>static snapshot unavailable: {type(e).__name__}</i>"
        if snap:
            data["text/html"] = STYLE + snap
        return data

    def display(self) -> None:
        """Show the widget in the current cell output."""
        from IPython.display import display

        display(self)
