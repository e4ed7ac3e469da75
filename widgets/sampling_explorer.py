"""``SamplingExplorer``: the model's real next-token distribution, reshaped by sampling filters."""
from __future__ import annotations

import html
import numbers

import ipywidgets as W
import numpy as np
import torch

from minivllm.layers.sampler import SamplingBatch, exponential_race, filtered_probs
from minivllm.sampling_params import SamplingParams

from ._base import STYLE, CourseWidget, error_box
from ._engine import engine_of, parse_prompt, titled, token_piece
from ._main_thread import on_main_thread


def next_token_logits(llm, prompt) -> torch.Tensor:
    """fp32 logits ``[vocab_size]`` of the token after ``prompt``, from a real engine step.

    The request runs through the engine as usual (prefill, one sampled token); the runner's
    ``forward_logits`` is wrapped for that step only, to keep the row it computed.

    Raises:
        ValueError: a bad prompt, or the engine is busy with other requests.
    """
    engine = engine_of(llm)
    if engine.has_unfinished_requests():
        raise ValueError("the engine is busy with other requests; finish or reset them first")
    runner = engine.runner
    original = runner.forward_logits
    captured = {}

    def capture(inp):
        logits = original(inp)
        for row, seq in enumerate(inp.sampling_seqs):
            if seq.request_id == "sampling-explorer":
                captured["logits"] = logits[row].detach().float().cpu().clone()
        return logits

    engine.add_request("sampling-explorer", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    runner.forward_logits = capture
    try:
        while "logits" not in captured and engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.forward_logits = original
        engine.abort_request("sampling-explorer")
    return captured["logits"]


def _shortened(prompt: str, keep: int = 60) -> str:
    """``repr(prompt)``, its middle cut out past ``keep`` characters: a long prompt in the readout pushed
    the chart below the screen."""
    if len(prompt) <= keep:
        return repr(prompt)
    return f"{prompt[:keep // 2]!r} … {prompt[-keep // 2:]!r} ({len(prompt):,} characters)"


def sampling_batch(temperature: float, top_k: int, top_p: float, min_p: float, rows: int = 1) -> SamplingBatch:
    """A ``SamplingBatch`` of ``rows`` identical rows (CPU tensors), as the runner builds it."""
    return SamplingBatch(
        temperatures=torch.full((rows,), float(temperature)), top_k=torch.full((rows,), int(top_k)),
        top_p=torch.full((rows,), float(top_p)), min_p=torch.full((rows,), float(min_p)),
        repetition_penalties=torch.ones(rows), seen_token_ids=[None] * rows, generators=[None] * rows,
        all_greedy=temperature == 0, any_top_k=top_k > 0, any_top_p=top_p < 1.0, any_min_p=min_p > 0,
        any_penalty=False)


#: floats of noise one chunk of draws may hold (16 MiB)
_RACE_FLOATS = 4 << 20


class SamplingExplorer(CourseWidget):
    """The next-token distribution the model really computes for a prompt, and what the
    sampling filters make of it.

    Where the numbers come from: the logits are captured from a real engine step
    (:func:`next_token_logits`); "model" is their softmax; "after filters" is the engine's
    own :func:`minivllm.layers.sampler.filtered_probs` (temperature, then top-k, top-p,
    min-p: minivllm's order, vLLM V0's; V1 applies min-p right after temperature); "drawn" are the frequencies of tokens drawn with the engine's
    own :func:`~minivllm.layers.sampler.exponential_race` from that distribution (seeded).
    Temperature 0 is greedy: all mass on the argmax.

    Args:
        llm: a ``minivllm.LLM`` or ``LLMEngine`` (must be idle when the prompt changes).
        prompt: initial prompt (text, or token ids like ``[1, 2, 3]`` in the text box).
        top_n: tokens shown (the most likely under the model).
        seed: seeds the generator the draws come from (the same seed, the same histogram).

    Raises:
        ValueError: ``llm`` is not an engine or is shut down (``engine_of``), or ``top_n`` is not
            an int >= 1.

    State for code and tests: ``logits``, ``model_probs``, ``probs`` (after filters),
    ``counts`` (token id -> draws), ``num_draws``, ``kept`` (tokens with non-zero probability).
    """

    def __init__(self, llm, prompt: str = "The function returns", top_n: int = 20, seed: int = 0):
        super().__init__()
        self.llm = llm
        self.engine = engine_of(llm)
        self.tokenizer = self.engine.tokenizer
        if isinstance(top_n, bool) or not isinstance(top_n, numbers.Integral) or top_n < 1:  # -1 showed 4095 tokens
            raise ValueError(f"top_n={top_n!r}: show at least one token (an int >= 1)")
        self.top_n = int(top_n)
        self.generator = torch.Generator().manual_seed(seed)
        self.counts: dict[int, int] = {}
        self.num_draws = 0
        self.logits = None          # the loaded prompt's next-token logits (None until a load succeeds)
        self.loaded_prompt = None   # the text box's value they were computed for
        self._error = None          # the last load's refusal, kept in the readout until the next load
        style = {"description_width": "90px"}
        self.prompt_box = W.Text(value=prompt, description="prompt", layout=W.Layout(width="460px"))
        # wide enough for its label (the default button width cut it to "Next-token dis…")
        self.load_button = W.Button(description="Next-token distribution", icon="refresh",
                                    layout=W.Layout(width="auto"))
        self.temperature = W.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.05, description="temperature",
                                         style=style, continuous_update=False)
        self.top_k = W.IntSlider(value=0, min=0, max=100, description="top_k (0=off)", style=style,
                                 continuous_update=False)
        self.top_p = W.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top_p", style=style,
                                   continuous_update=False)
        self.min_p = W.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01, description="min_p", style=style,
                                   continuous_update=False)
        self.n_draws = W.BoundedIntText(value=500, min=1, max=100_000, description="draws",
                                        tooltip="1 to 100,000 draws", layout=W.Layout(width="170px"))
        self.draw_button = W.Button(description="Draw samples", icon="random", button_style="info")
        self.readout = W.HTML()
        from ._static import LiveFigure

        self.chart = LiveFigure()
        self.chart.add_bar(name="model (T=1, no filter)", x=[], y=[], marker_color="#c6dbef")
        self.chart.add_bar(name="after filters", x=[], y=[], marker_color="#4c78a8")
        self.chart.add_scatter(name="drawn (frequency)", x=[], y=[], mode="markers",
                               marker=dict(color="#e4572e", size=9, symbol="diamond"))
        self.chart.update_layout(title=titled("Next-token probabilities", self.engine), xaxis_title="next token (the most likely ones)",
                                 yaxis_title="probability (0 to 1)", barmode="group",
                                 height=340, width=760, margin=dict(l=50, r=10, t=60, b=80),
                                 yaxis_rangemode="nonnegative")  # legend at plotly's default place, right of
        # the plot: above it, it covered the provenance line under the title
        self.load_button.on_click(on_main_thread(lambda _: self.load()))
        self.draw_button.on_click(on_main_thread(self._on_draw))
        for w in (self.temperature, self.top_k, self.top_p, self.min_p):
            w.observe(on_main_thread(lambda _c: self.update()), names="value")
        self.add_class("mv-sampling-explorer")
        self.children = [W.HTML(STYLE), W.HBox([self.prompt_box, self.load_button]),
                         W.HBox([W.VBox([self.temperature, self.top_k]), W.VBox([self.top_p, self.min_p])]),
                         W.HBox([self.n_draws, self.draw_button]), self.readout, self.chart]
        self.load()

    def load(self) -> None:
        """Run the prompt through the engine and take its next-token logits."""
        text = self.prompt_box.value
        try:
            self.logits = next_token_logits(self.llm, parse_prompt(text))
        except ValueError as e:
            self._error = str(e)
            if self.logits is None:
                self.readout.value = error_box(self._error)
            else:
                self._redraw()  # the chart keeps the last prompt's distribution, and the readout says whose
            return
        self.loaded_prompt, self._error = text, None
        self.model_probs = torch.softmax(self.logits, dim=-1)
        self.order = torch.argsort(self.model_probs, descending=True)[:self.top_n].tolist()
        self.update()

    def _filtered(self) -> torch.Tensor:
        t = float(self.temperature.value)
        if t == 0:
            probs = torch.zeros_like(self.model_probs)
            probs[int(self.logits.argmax())] = 1.0
            return probs
        batch = sampling_batch(t, self.top_k.value, self.top_p.value, self.min_p.value)
        return filtered_probs(self.logits.unsqueeze(0).clone(), batch)[0]

    def update(self) -> None:
        """Re-apply the filters; drawn frequencies are cleared (they belong to the old settings)."""
        if self.logits is None:  # nothing loaded yet: the readout keeps the load's error
            return
        self.probs = self._filtered()
        self.counts, self.num_draws = {}, 0
        self.kept = int((self.probs > 0).sum())
        self._redraw()

    def _on_draw(self, _button) -> None:
        """The button: a refusal (no prompt loaded) is said in the readout, not lost to the kernel log."""
        try:
            self.draw()
        except ValueError as e:
            self.readout.value = error_box(str(e))
        except KeyboardInterrupt:  # the kernel interrupted mid-draw: draw() counts nothing until it is done
            self._redraw()
            self.readout.value += error_box(f"interrupted (Kernel > Interrupt): none of the draw of "
                                            f"{self.n_draws.value} was counted (the frequencies shown are "
                                            "the earlier draws')")

    def draw(self, n: int | None = None) -> dict[int, int]:
        """Draw ``n`` tokens (default: the "draws" box, which then shows ``n``) from the filtered distribution.

        Raises:
            ValueError: ``n`` not an int >= 1, or no prompt has loaded yet.
        """
        if n is None:
            n = int(self.n_draws.value)
        whole = isinstance(n, numbers.Real) and not isinstance(n, (bool, np.bool_)) and float(n).is_integer()
        if not whole or n < 1:  # 2.7 drew 2; "a" failed in int()
            raise ValueError(f"n={n!r}: draw a whole number of samples, at least one")
        n = int(n)
        if self.logits is None:
            raise ValueError(f"no distribution to draw from: the prompt did not load ({self._error})")
        # in chunks of rows: the race holds a row of noise per draw (n x vocab floats); in one piece,
        # 20,000 draws over the embedded model's 4,096 tokens raised the peak memory by ~0.9 GB
        rows = max(1, _RACE_FLOATS // self.probs.numel())
        tokens = []
        for start in range(0, n, rows):
            k = min(rows, n - start)
            probs = self.probs.unsqueeze(0).expand(k, -1).contiguous()
            tokens += exponential_race(probs, [None] * k, self.generator).tolist()
        for t in tokens:
            self.counts[t] = self.counts.get(t, 0) + 1
        self.num_draws += n
        if n <= self.n_draws.max:  # a cell's draw(2000) left the box at 500: the next click drew another amount
            self.n_draws.value = n
        self._redraw()
        return self.counts

    def _redraw(self) -> None:
        ids = self.order
        labels = [f"{token_piece(self.tokenizer, t)} ({t})" for t in ids]
        with self.chart.batch_update():
            self.chart.data[0].x, self.chart.data[0].y = labels, [float(self.model_probs[t]) for t in ids]
            self.chart.data[1].x, self.chart.data[1].y = labels, [float(self.probs[t]) for t in ids]
            if self.num_draws:
                self.chart.data[2].x = labels
                self.chart.data[2].y = [self.counts.get(t, 0) / self.num_draws for t in ids]
            else:
                self.chart.data[2].x, self.chart.data[2].y = [], []
        shown = float(self.probs[ids].sum())
        shown_ids = set(ids)  # built once, not once per counted token
        outside = sum(c for t, c in self.counts.items() if t not in shown_ids)
        self.readout.value = (
            (error_box(self._error) if self._error else "")
            + f"<div class='mv-box'>next token after {html.escape(_shortened(self.loaded_prompt))}: {self.kept} of "
            f"{self.probs.numel()} tokens keep non-zero probability; the {len(ids)} shown hold {100 * shown:.1f} % of it. "
            + (f"{self.num_draws} draws, {outside} outside the shown tokens." if self.num_draws else "")
            + "</div>")

    def static_html(self) -> str:
        from ._static import figure_html

        return "<div class='mv-box'>" + self.readout.value + figure_html(self.chart) + "</div>"
