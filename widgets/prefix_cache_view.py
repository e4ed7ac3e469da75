"""``PrefixCacheView``: requests sharing a system prompt, which blocks hit, and the TTFT saved."""
from __future__ import annotations

import statistics

import ipywidgets as W

from minivllm.utils import cdiv
from minivllm.utils.checks import is_count

from ._base import STYLE, CourseWidget, error_box
from ._engine import engine_of, fmt_ms, titled
from ._main_thread import on_main_thread
from .measure import _require_idle, run_requests


class PrefixCacheView(CourseWidget):
    """Several requests that start with the same system prompt, run one after another.

    For each request, each KV block of its prompt is shown as a hit (reused from the prefix
    cache: ``RequestOutput.num_cached_tokens`` / ``block_size`` leading blocks) or a miss
    (computed). TTFT is measured twice per request, each the median of ``repeats`` runs:
    *warm* (the system prompt's blocks are in the cache, put there by running the first
    request) and *cold* (the prefix cache cleared with ``reset_prefix_cache()`` first). The
    difference is the TTFT the cache saved, measured, not estimated.

    Args:
        llm: a ``minivllm.LLM`` or ``LLMEngine`` with prefix caching on (idle while it runs).
        system_prompt: shared prefix (text or token ids).
        user_prompts: the differing suffixes (text or token ids), at least two.
        repeats: runs per measurement (the median is kept).
        run: measure at construction (else press "Run").

    State for code and tests: ``results``: one dict per request with ``prompt_tokens``,
    ``hit_blocks``, ``miss_blocks``, ``cached_tokens``, ``ttft_warm_ms``, ``ttft_cold_ms``,
    ``saved_ms``. Request 0 is the one that fills the cache: nothing is cached before it, so it
    has no warm run and its ``ttft_warm_ms`` and ``saved_ms`` are None (its "warm" run was a
    second cold run, and the difference of two cold runs read as a saving, or a negative one).

    Raises:
        ValueError: an LLM with prefix caching off (or not an engine, or shut down: ``engine_of``),
            ``user_prompts`` not a list of at least 2, or ``repeats`` not an int >= 1.
    """

    def __init__(self, llm, system_prompt, user_prompts, repeats: int = 3, run: bool = True):
        super().__init__()
        self.llm = llm
        self.engine = engine_of(llm)
        if not self.engine.block_manager.enable_prefix_caching:
            raise ValueError("enable_prefix_caching=False: this LLM never reuses blocks")
        if isinstance(user_prompts, (str, bytes)) or not hasattr(user_prompts, "__len__"):
            # a string would be taken letter by letter, one prompt per character
            raise ValueError(f"user_prompts={user_prompts!r}: give a list of at least 2 prompts")
        if len(user_prompts) < 2:
            raise ValueError(f"user_prompts: give at least 2, got {len(user_prompts)}")
        if not is_count(repeats, 1):
            raise ValueError(f"repeats={repeats!r} must be an int >= 1")
        repeats = int(repeats)
        self.system_prompt, self.user_prompts, self.repeats = system_prompt, list(user_prompts), repeats
        self.results: list[dict] = []
        self.run_button = W.Button(description="Run", icon="play", button_style="primary")
        self.run_button.add_class("mv-run")
        self.run_button.on_click(on_main_thread(self._on_run))
        self.grid = W.HTML()
        self._table = ""  # the last run's table, under a refusal's message
        from ._static import LiveFigure

        self.chart = LiveFigure()
        self.chart.add_bar(name="cold (cache cleared)", x=[], y=[], marker_color="#bbbbbb")
        self.chart.add_bar(name="warm (system prompt cached)", x=[], y=[], marker_color="#54a24b")
        self.chart.update_layout(title=titled("Measured TTFT per request" + (f" (median of {repeats} runs)" if repeats > 1 else " (one run each)"),
                                               self.engine),
                                 xaxis_title="request (same system prompt, different question)",
                                 yaxis_title="time to first token (ms)", barmode="group", height=300,
                                 width=760, margin=dict(l=50, r=10, t=60, b=40), yaxis_rangemode="nonnegative")
        self.add_class("mv-prefix-cache-view")
        self.children = [W.HTML(STYLE), self.run_button, self.grid, self.chart]
        if run:
            self.run()

    def _ids(self, prompt) -> list[int]:
        return list(prompt) if isinstance(prompt, (list, tuple)) else self.engine.tokenizer.encode(prompt)

    def _ttft(self, ids: list[int], cold: bool, prime: list[int] | None) -> tuple[float, int]:
        times, cached = [], 0
        for _ in range(self.repeats):
            self.engine.reset_prefix_cache()
            if not cold and prime is not None:
                run_requests(self.llm, [prime], 1)
            outs, _ = run_requests(self.llm, [ids], 1)
            times.append(outs[0].metrics.ttft_ms)
            cached = outs[0].num_cached_tokens
        return statistics.median(times), cached

    def _on_run(self, _button) -> None:
        """The button: a refused run (a busy engine) is said above the table; a click handler's
        exception would only reach the kernel's log."""
        try:
            self.run()
        except ValueError as e:  # above the last table, replacing an earlier refusal
            self.grid.value = error_box(str(e)) + self._table
        except KeyboardInterrupt:  # Kernel > Interrupt: the table (and results) stay the last complete run's
            self.grid.value = error_box("interrupted (Kernel > Interrupt): the table is the last complete run's; "
                                        "press Run again") + self._table
            raise

    def run(self) -> list[dict]:
        """Measure every request (see the class docstring); returns ``results``.

        Raises:
            ValueError: the engine has unfinished requests (before anything, the prefix cache
                included, is changed).
        """
        _require_idle(self.engine)
        sys_ids = self._ids(self.system_prompt)
        prompts = [sys_ids + self._ids(u) for u in self.user_prompts]
        bs = self.engine.block_manager.block_size
        results = []  # kept only once whole: an interrupted run leaves the last complete one in place
        # one unrecorded run first: request 0's cold run is no longer preceded by its (dropped) warm one,
        # and a first run's one-off costs must not land in it
        self.engine.reset_prefix_cache()
        run_requests(self.llm, [prompts[0]], 1)
        for i, ids in enumerate(prompts):
            warm = None
            if i:  # request 0 fills the cache: nothing is there for it to reuse
                warm, cached = self._ttft(ids, cold=False, prime=prompts[0])
            cold, cold_cached = self._ttft(ids, cold=True, prime=None)
            if not i:
                cached = cold_cached
            n_blocks = cdiv(len(ids), bs)
            hits = cached // bs
            results.append(dict(prompt_tokens=len(ids), hit_blocks=hits, miss_blocks=n_blocks - hits,
                                cached_tokens=cached, ttft_warm_ms=warm, ttft_cold_ms=cold,
                                saved_ms=None if warm is None else cold - warm))
        self.results = results
        self.engine.reset_prefix_cache()
        self._redraw(len(sys_ids))
        return self.results

    def _redraw(self, sys_len: int) -> None:
        rows = []
        for i, r in enumerate(self.results):
            cells = "".join(
                f"<div class='mv-kv' style='background:{'#54a24b' if b < r['hit_blocks'] else '#e4572e'};"
                f"color:#fff' title='block {b}: {'hit (reused)' if b < r['hit_blocks'] else 'miss (computed)'}'>"
                f"{'hit' if b < r['hit_blocks'] else 'miss'}</div>" for b in range(r["hit_blocks"] + r["miss_blocks"]))
            warm = fmt_ms(r['ttft_warm_ms']) if r['ttft_warm_ms'] is not None else "– (fills the cache)"
            rows.append(f"<tr><td>request {i}</td><td>{r['prompt_tokens']}</td><td><div class='mv-kv-grid'>{cells}"
                        f"</div></td><td>{fmt_ms(r['ttft_cold_ms'])}</td><td>{warm}</td>"
                        f"<td>{fmt_ms(r['saved_ms'])}</td></tr>")
        self.grid.value = self._table = (
            f"<div class='mv-box'>system prompt: {sys_len} tokens, shared by every request. Request 0 runs "
            f"first and fills the cache: it has nothing to reuse, so it has no warm run and no saving.</div>"
            "<table class='mv-table'><tr><th></th><th>prompt tokens</th><th>KV blocks (hit / miss)</th>"
            "<th>TTFT cold</th><th>TTFT warm</th><th>saved</th></tr>" + "".join(rows) + "</table>")
        names = [f"request {i}" for i in range(len(self.results))]
        with self.chart.batch_update():
            self.chart.data[0].x, self.chart.data[0].y = names, [r["ttft_cold_ms"] for r in self.results]
            self.chart.data[1].x, self.chart.data[1].y = names, [r["ttft_warm_ms"] for r in self.results]

    def static_html(self) -> str:
        from ._static import figure_html

        return "<div class='mv-box'>" + self.grid.value + (
            figure_html(self.chart) if self.results else "") + "</div>"
