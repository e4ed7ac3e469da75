"""``ChunkedPrefillDemo``: decoding requests' inter-token latency when a long prompt arrives,
with and without chunked prefill, measured."""
from __future__ import annotations

import random
import statistics

import ipywidgets as W

from minivllm.sampling_params import SamplingParams
from minivllm.utils.checks import is_count
from minivllm.utils.gc_heap import heap_frozen

from ._base import STYLE, CourseWidget, error_box
from ._engine import engine_of, fmt_ms, titled
from ._main_thread import on_main_thread
from .measure import random_prompt


def itl_around_long_prompt(llm, num_decoders: int = 3, decoder_prompt_len: int = 16, decode_tokens: int = 24,
                           long_prompt_len: int = 256, arrive_after: int = 4, seed: int = 0) -> dict:
    """Run the scenario once on ``llm`` and return what was measured.

    ``num_decoders`` requests (random prompts of ``decoder_prompt_len`` tokens, greedy,
    ``ignore_eos``, ``decode_tokens`` outputs) start together; after ``arrive_after`` engine
    steps a ``long_prompt_len``-token request (2 outputs) arrives; the engine runs until all
    finish. Returns ``{"itl_ms": per decoder the gaps between its tokens (RequestMetrics.itl_ms),
    "token_times_ms": per decoder each token's time since the long prompt arrived,
    "long_ttft_ms", "prefill_steps": steps that carried part of the long prompt,
    "max_itl_ms"}``.

    Raises:
        ValueError: a count that is not a positive int (``decode_tokens`` below 2: one token has no
            gap to a previous one; ``arrive_after`` an int >= 0), the engine is busy, or a length does
            not fit the engine (naming it).
    """
    import time

    for name, value, least in (("num_decoders", num_decoders, 1), ("decoder_prompt_len", decoder_prompt_len, 1),
                               ("decode_tokens", decode_tokens, 2), ("long_prompt_len", long_prompt_len, 1),
                               ("arrive_after", arrive_after, 0)):
        if not is_count(value, least):
            raise ValueError(f"{name}={value!r}: must be an int >= {least}")
    engine = engine_of(llm)
    if engine.has_unfinished_requests():
        raise ValueError("the engine is busy with other requests; finish or reset them first")
    rng = random.Random(seed)
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    ids = [f"chunk-demo-dec-{i}" for i in range(num_decoders)]
    long_id = "chunk-demo-long"
    arrival = None
    prefill_steps = 0
    try:  # the adds too: an interrupt between two leaves none queued (aborting one never added is a no-op)
        for rid in ids:
            engine.add_request(rid, random_prompt(engine, decoder_prompt_len, rng), params)
        seqs = {rid: engine.requests[rid].seq for rid in ids}
        with heap_frozen():  # the steps' times are the engine's, not a full collection's (minivllm.utils.gc_heap)
            step = 0
            while engine.has_unfinished_requests():
                if step == arrive_after:
                    engine.add_request(long_id, random_prompt(engine, long_prompt_len, rng),
                                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
                    long_seq = engine.requests[long_id].seq
                    arrival = time.perf_counter()
                rec = engine.step_with_record().record
                if any(e.request_id == long_id and e.is_prefill for e in rec.scheduled):
                    prefill_steps += 1
                step += 1
    finally:
        for rid in ids + [long_id]:
            engine.abort_request(rid)
        engine.reset_prefix_cache()
    if arrival is None:
        raise ValueError(f"decode_tokens={decode_tokens}: the decoders finished within arrive_after={arrive_after} "
                         f"steps, before the long prompt arrived (give them more tokens)")
    itl = [seqs[r].metrics.itl_ms for r in ids]
    times = [[(t - arrival) * 1e3 for t in seqs[r].metrics.token_times] for r in ids]
    return dict(itl_ms=itl, token_times_ms=times, long_ttft_ms=long_seq.metrics.ttft_ms,
                prefill_steps=prefill_steps, max_itl_ms=max(max(x) for x in itl if x))


class ChunkedPrefillDemo(CourseWidget):
    """A long prompt arrives while other requests decode: their inter-token latency with and
    without chunked prefill, measured on two engines, on one chart.

    Each run is :func:`itl_around_long_prompt` on an engine with
    ``enable_chunked_prefill=True`` (the long prompt is split into budget-sized chunks that
    share steps with the decodes) and one with it off (the whole prompt in one step; the
    decoders wait for it). The chart plots every decoder token's gap to its previous token
    (``RequestMetrics.itl_ms``) against when it arrived relative to the long prompt.

    Before measuring, each engine runs the scenario once unrecorded (``warm_up``): a new engine's
    first run also pays one-off costs (its first decode step at each batch size records a CPU graph,
    caches are cold), which made the worst gap of a first run several times a later run's and could
    reverse the comparison.

    Args:
        chunked_llm / whole_llm: the two engines (same model); build both with
            :meth:`from_model`.
        long_prompt_len, num_decoders, decode_tokens: the scenario.
        run: measure at construction (else press "Run").
        repeats: measured runs per engine (after the warm-up); with more than one, the worst gap and
            the long prompt's TTFT are medians over the runs and the chart shows the run whose worst gap
            is that median.
        warm_up: run the scenario once, unrecorded, on each engine before measuring it.

    State for code and tests: ``results`` (``{"chunked": dict, "whole": dict}`` as returned by
    :func:`itl_around_long_prompt`, plus ``"runs"``: the measured runs' ``max_itl_ms`` and
    ``long_ttft_ms``, one pair per run).

    Raises:
        ValueError: ``chunked_llm`` without chunked prefill, ``whole_llm`` with it, or ``repeats``
            not an int of at least 1.
    """

    def __init__(self, chunked_llm, whole_llm, long_prompt_len: int = 256, num_decoders: int = 3,
                 decode_tokens: int = 24, run: bool = True, repeats: int = 1, warm_up: bool = True):
        super().__init__()
        if not engine_of(chunked_llm).config.args.enable_chunked_prefill:
            raise ValueError("chunked_llm has enable_chunked_prefill=False")
        if engine_of(whole_llm).config.args.enable_chunked_prefill:
            raise ValueError("whole_llm has enable_chunked_prefill=True")
        if not is_count(repeats, 1):
            raise ValueError(f"repeats={repeats!r}: must be an int >= 1")
        self.llms = {"chunked": chunked_llm, "whole": whole_llm}
        self.scenario = dict(long_prompt_len=long_prompt_len, num_decoders=num_decoders,
                             decode_tokens=decode_tokens)
        self.repeats, self.warm_up = repeats, warm_up
        self.results: dict[str, dict] = {}
        self.run_button = W.Button(description="Run both", icon="play", button_style="primary")
        self.run_button.add_class("mv-run")
        self.run_button.on_click(on_main_thread(self._on_run))
        self.readout = W.HTML()
        self._last_readout = ""  # the last complete run's readout, under which an interrupt is said
        from ._static import LiveFigure

        self.chart = LiveFigure()
        self.chart.add_scatter(name="chunked prefill", x=[], y=[], mode="markers",
                               marker=dict(color="#4c78a8", size=7))
        self.chart.add_scatter(name="whole prompt in one step", x=[], y=[], mode="markers",
                               marker=dict(color="#e4572e", size=7))
        self.chart.update_layout(title=titled("Decoding requests' inter-token latency around a long prompt", chunked_llm),
                                 xaxis_title="token time relative to the long prompt's arrival (ms)",
                                 yaxis_title="gap to previous token (ms)", height=340, width=760,
                                 margin=dict(l=50, r=10, t=60, b=40), yaxis_rangemode="nonnegative")
        self.add_class("mv-chunked-prefill-demo")
        self.children = [W.HTML(STYLE), self.run_button, self.readout, self.chart]
        if run:
            self.run()

    @classmethod
    def from_model(cls, model=None, budget: int = 64, max_model_len: int = 512, block_size: int = 16,
                   device: str = "auto", **kwargs):
        """Build the two engines for ``model`` (chunked with a ``budget``-token step budget;
        unchunked with ``max_model_len`` tokens per step, as scheduling whole prompts needs), each
        with ``block_size``-token blocks, a KV pool of ``4 * max_model_len`` tokens, on ``device``;
        ``kwargs`` go to the widget (``repeats``, ...). Raises what ``LLM`` and the widget raise."""
        from minivllm import LLM

        common = dict(block_size=block_size, max_model_len=max_model_len, device=device,
                      num_kvcache_blocks=4 * max_model_len // block_size)
        chunked = LLM(model, enable_chunked_prefill=True, max_num_batched_tokens=budget, **common)
        whole = LLM(model, enable_chunked_prefill=False, max_num_batched_tokens=max_model_len, **common)
        return cls(chunked, whole, **kwargs)

    def _on_run(self, _button) -> None:
        """The button: a refused run (a busy engine, a scenario that does not fit) is said in the
        readout; a click handler's exception would only reach the kernel's log."""
        try:
            # a second click while it runs would queue a second run behind it; set inside the try: an
            # interrupt while the change is sent must not leave the button disabled
            self.run_button.disabled = True
            self.run()
        except ValueError as e:
            self.readout.value = error_box(str(e))
        except KeyboardInterrupt:  # Kernel > Interrupt: the chart and readout still show the last complete run
            self.readout.value = self._last_readout + error_box(
                "interrupted (Kernel > Interrupt): " + ("the figures above are the last complete run's"
                                                        if self.results else "no run has completed yet")
                + "; press Run both again")
            raise
        finally:
            self.run_button.disabled = False

    def run(self) -> dict:
        """Measure both engines on the same scenario (same seed, same prompts).

        Raises:
            ValueError: an engine is busy, or the scenario does not fit it.
        """
        # both measured before either is kept: a refused second run leaves the last pair as it was
        self.results = {name: self._measure(llm) for name, llm in self.llms.items()}
        with self.chart.batch_update():
            for trace, name in zip(self.chart.data, ("chunked", "whole")):
                r = self.results[name]
                xs, ys = [], []
                for times, gaps in zip(r["token_times_ms"], r["itl_ms"]):
                    xs += times[1:]
                    ys += gaps
                order = sorted(range(len(xs)), key=xs.__getitem__)
                trace.x, trace.y = [xs[i] for i in order], [ys[i] for i in order]
        c, w = self.results["chunked"], self.results["whole"]
        how = ("each engine first ran the scenario once, unrecorded (warm-up: one-off first-run costs left out); "
               if self.warm_up else "no warm-up run (a new engine's first run includes one-off costs); ")
        how += ("one measured run each" if self.repeats == 1 else
                f"worst gap and TTFT: medians of {self.repeats} measured runs each (the chart: the median run)")
        self.readout.value = self._last_readout = (
            f"<div class='mv-box'>long prompt {self.scenario['long_prompt_len']} tokens · "
            f"<b>chunked</b>: {c['prefill_steps']} prefill steps, worst gap {fmt_ms(c['max_itl_ms'])}, long "
            f"prompt's TTFT {fmt_ms(c['long_ttft_ms'])} · <b>whole</b>: {w['prefill_steps']} prefill step, worst "
            f"gap {fmt_ms(w['max_itl_ms'])}, long prompt's TTFT {fmt_ms(w['long_ttft_ms'])}"
            f"<br><span class='mv-small mv-method'>{how}</span></div>")
        return self.results

    def _measure(self, llm) -> dict:
        """One engine: the warm-up run (discarded), then ``repeats`` measured runs."""
        if self.warm_up:
            itl_around_long_prompt(llm, **self.scenario)
        runs = [itl_around_long_prompt(llm, **self.scenario) for _ in range(self.repeats)]
        # median_low: a value one run really had, so the kept run's chart and worst gap agree
        gap = statistics.median_low(r["max_itl_ms"] for r in runs)
        result = dict(next(r for r in runs if r["max_itl_ms"] == gap))
        result["long_ttft_ms"] = statistics.median_low(r["long_ttft_ms"] for r in runs)
        result["runs"] = [dict(max_itl_ms=r["max_itl_ms"], long_ttft_ms=r["long_ttft_ms"]) for r in runs]
        return result

    def static_html(self) -> str:
        from ._static import figure_html

        return "<div class='mv-box'>" + self.readout.value + (figure_html(self.chart) if self.results else "") + \
            "</div>"
