"""``EngineStepper``: drive the real engine one step at a time and see what each step did."""
from __future__ import annotations

import asyncio
import contextlib
import html
import signal
import threading
import time
import types
from typing import Callable

import ipywidgets as W
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.telemetry.step_record import StepRecord
from minivllm.utils import cdiv
from minivllm.utils.checks import is_count
from minivllm.utils.gc_heap import heap_frozen

from ._base import PALETTE, STYLE, CourseWidget
from ._engine import engine_of, fmt_ms, fmt_si, parse_prompt, plural, titled, tok_span
from ._main_thread import on_main_thread

PHASE_COLOURS = {"prefill": "#e4572e", "decode": "#f0a202", "mixed": "#8f5ea2", "idle": "#999999"}


class _InterruptStopsRuns:
    """One SIGINT handler for every "Run to end" in progress (main thread only): a kernel
    interrupt stops them all after their current step instead of raising inside one. Installed
    when the first run starts, the previous handler put back when the last one ends, whatever
    order runs end in (each run saving and restoring its own left a finished run's handler
    installed when two overlapped). A background run holds it between its steps too: ipykernel
    ignores SIGINT while idle and installs its own handler while a cell executes, so an interrupt
    reaches the run when nothing else is running and the cell when one is."""

    def __init__(self):
        self.runs: list = []      # (stepper, run) pairs
        self.saved = None         # the handler before the first run

    def _handle(self, signum, frame):
        if not self.runs:  # put back by someone who saved it while runs were active: act as the old one
            if callable(self.saved):
                return self.saved(signum, frame)
            if self.saved != signal.SIG_IGN:
                raise KeyboardInterrupt
            return None
        for stepper, run in list(self.runs):
            run.interrupted = True
            stepper._stop_requested = True

    def reclaim(self) -> None:
        """Between a background run's steps: take SIGINT back where an idle kernel's "ignore"
        replaced this handler. A run clicked while an async cell awaited installed it over the
        cell's handler, and ipykernel put its idle handler back when the cell ended."""
        if (self.runs and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) == signal.SIG_IGN):
            self.saved = signal.signal(signal.SIGINT, self._handle)

    @contextlib.contextmanager
    def during(self, stepper, run):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        if not self.runs:
            self.saved = signal.signal(signal.SIGINT, self._handle)
        self.runs.append((stepper, run))
        try:
            yield
        finally:
            self.runs.remove((stepper, run))
            if not self.runs and signal.getsignal(signal.SIGINT) == self._handle:
                signal.signal(signal.SIGINT, self.saved)


_INTERRUPTS = _InterruptStopsRuns()


class EngineStepper(CourseWidget):
    """Add requests, then press "Step" to run exactly one ``LLMEngine.step()`` and see it.

    What it shows, and where each number comes from:

    * Each request's prompt tokens: processed in earlier steps (blue), in *this* step's
      prefill chunk (red), served by the prefix cache (green), still waiting (grey);
      from the engine's ``Sequence`` (``num_computed_tokens``, ``num_cached_tokens``) and
      the step's ``StepRecord.scheduled`` entries (``first_position``, ``num_tokens``).
    * Generated tokens, one more per decode step (the newest in orange): the sequence's
      ``output_token_ids``, decoded by the model's tokenizer one token at a time.
    * The step's composition (prefill vs decode tokens against the token budget
      ``max_num_batched_tokens``) and measured wall time with its breakdown
      (``StepRecord.wall_ms``, ``schedule_ms`` ... ``postprocess_ms``: ``perf_counter``
      around the step; on CUDA a step that samples waits for the device first: see
      ``StepRecord`` for the prompt chunks that do not).
    * MFU and MBU bars: the step's FLOPs and bytes from the roofline model
      (``minivllm.telemetry.roofline``: 2 FLOPs per weight per token plus attention;
      every weight read once) divided by the measured wall time and by this machine's
      measured peaks (``minivllm.telemetry.peaks``: a matmul, and a read of at least 1 GiB for
      MBU). On a GPU, NVML's busy percentages (``utilization.gpu``: the time at least one kernel
      ran; memory: the time memory was read or written) are shown beside them as *windowed*
      context (NVML averages over 1/6 s to 1 s, far longer than a step).
    * A live chart of every step's wall time, coloured by phase.

    Buttons: "Add request", "Step", "Run to end" (steps until the engine is idle, in
    small increments: "Stop" or a kernel interrupt halts it *between* steps, so the
    engine stays consistent), "Stop", "Reset" (aborts every request, clears the prefix
    cache and this widget's history: every KV block is free afterwards).

    Args:
        llm: a ``minivllm.LLM`` (or its ``LLMEngine``). Use a small ``block_size`` (16)
            and a small ``num_kvcache_blocks`` so paging is visible.
        prompt / max_tokens / temperature: initial values of the request form.
        peaks: measured ``Peaks`` to use for MFU/MBU (default: ``get_peaks()`` for the
            engine's device and dtype, measured once per machine and cached).
        show_chart: include the live step-time chart.
        max_run_steps: "Run to end" gives up after this many steps (an int >= 1; the status says
            so, with the requests still unfinished).

    Steps run elsewhere on the same engine (``llm.generate`` in another cell, a second stepper)
    are not in this widget's history; its status line says how many ran, and its requests and
    attached views show the engine as it is now.

    State for code and tests: ``steps`` (the ``StepRecord`` of every step taken through
    this widget), ``request_ids``, ``generated_token_count``, ``processed_prompt_tokens``,
    ``kv_blocks_used``, ``is_running``, ``last_message``, ``outside_steps``.

    Raises:
        ValueError: ``max_run_steps`` not an int of at least 1.
    """

    def __init__(self, llm, *, prompt: str = "The function returns", max_tokens: int = 16,
                 temperature: float = 0.0, peaks=None, show_chart: bool = True, max_run_steps: int = 10_000):
        super().__init__()
        if not is_count(max_run_steps, 1):
            raise ValueError(f"max_run_steps={max_run_steps!r}: must be an int >= 1")
        self.engine = engine_of(llm)
        self.llm = llm  # held: an LLM shuts its engine down when collected (EngineStepper(LLM(...)) must work)
        self.tokenizer = self.engine.tokenizer
        self.steps: list[StepRecord] = []
        self.request_ids: list[str] = []
        self.last_message = ""
        self.max_run_steps = max_run_steps
        self._seqs = {}              # request id -> engine Sequence (kept after it finishes)
        self._arrival_step: dict[str, int] = {}
        self._colour: dict[str, str] = {}
        self._step_threads: dict[int, int] = {}  # step index -> torch's CPU threads when it ran
        self._observers: list[Callable] = []
        self._stop_requested = False
        self._running = False
        self._task = None
        self._reset_during_run = False  # a Reset cancelled the async run: its end is not reported over Reset's
        self._peaks = peaks
        self._cost = None
        self._sampler = None
        self._next_id = 0
        # the engine's step count when this widget last looked: steps run elsewhere (llm.generate, another
        # stepper on the same engine) move it without passing through here
        self._engine_steps_seen = self._engine_step_count()
        #: engine steps that ran outside this widget since it was built (its history lacks them)
        self.outside_steps = 0

        # -- controls ---------------------------------------------------------------
        self.prompt_box = W.Text(value=prompt, description="prompt",
                                 placeholder="text, or token ids like [1, 2, 3]",
                                 layout=W.Layout(width="380px"))
        # descriptions sized to their text: the default width cut "temperature" to "temperat…"
        label = {"description_width": "initial"}
        # up to max_model_len: a request ends there ("length") whatever its max_tokens
        self.max_tokens_box = W.BoundedIntText(value=max_tokens, min=1, max=self.engine.config.max_model_len,
                                               description="max_tokens",
                                               tooltip=f"1 to max_model_len = {self.engine.config.max_model_len}",
                                               style=label, layout=W.Layout(width="170px"))
        self.temperature_box = W.BoundedFloatText(value=temperature, min=0.0, max=5.0, step=0.1,
                                                  description="temperature", style=label,
                                                  tooltip="0 (greedy) to 5", layout=W.Layout(width="170px"))
        self.ignore_eos_box = W.Checkbox(value=False, description="ignore_eos", indent=False,
                                         layout=W.Layout(width="100px"))
        self.add_button = W.Button(description="Add request", icon="plus")
        self.step_button = W.Button(description="Step", button_style="primary", icon="step-forward")
        self.run_button = W.Button(description="Run to end", button_style="success", icon="forward")
        self.stop_button = W.Button(description="Stop", button_style="warning", icon="stop")
        self.reset_button = W.Button(description="Reset", button_style="danger", icon="undo")
        for b, fn in ((self.add_button, self._on_add), (self.step_button, self._on_step),
                      (self.run_button, self._on_run), (self.stop_button, self._on_stop),
                      (self.reset_button, self._on_reset)):
            b.add_class("mv-" + b.description.lower().replace(" ", "-"))
            b.on_click(on_main_thread(fn))
        self.status = W.HTML()
        self.status.add_class("mv-status")
        self.step_pane = W.HTML()
        self.requests_pane = W.HTML()
        self.chart = self._make_chart() if show_chart else None
        self.add_class("mv-engine-stepper")
        children = [W.HTML(STYLE),
                    W.HBox([self.prompt_box, self.max_tokens_box, self.temperature_box, self.ignore_eos_box,
                            self.add_button]),
                    W.HBox([self.step_button, self.run_button, self.stop_button, self.reset_button]),
                    self.status, self.step_pane, self.requests_pane]
        if self.chart is not None:
            children.append(self.chart)
        self.children = children
        self.render()

    # -- public API ----------------------------------------------------------------------
    def add_request(self, prompt, max_tokens: int = 16, temperature: float = 0.0, **sampling) -> str:
        """Queue a request (``str`` or ``list[int]``) on the engine; returns its id.

        ``sampling`` takes any other ``SamplingParams`` field (top_k, seed, ignore_eos, ...).

        Raises:
            ValueError: a bad prompt or sampling value (the engine's message), or ``n`` above 1
                (the stepper follows one sequence per request).
            RuntimeError: the engine has been shut down.
        """
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **sampling)
        if params.n != 1:
            raise ValueError(f"n={params.n}: the stepper follows one sequence per request; use n=1 here "
                             "(LLM.generate runs parallel samples)")
        while f"req-{self._next_id}" in self.engine.requests:
            self._next_id += 1
        rid = f"req-{self._next_id}"
        self.engine.add_request(rid, prompt, params)
        self._next_id += 1  # after the engine took it: a refused prompt uses up no id
        self._seqs[rid] = self.engine.requests[rid].seq
        self._arrival_step[rid] = len(self.steps)
        self._colour[rid] = PALETTE[len(self.request_ids) % len(PALETTE)]
        self.request_ids.append(rid)
        self._message(f"added {rid}: {len(self._seqs[rid].prompt_token_ids)} prompt tokens, "
                      f"max_tokens={max_tokens}, temperature={temperature}")
        self._notify(None)
        self.render()
        return rid

    def step(self) -> StepRecord | None:
        """Run one engine step (when the engine has work); returns its record, else None."""
        if self._running:
            self._message("a run is in progress: press Stop first")
            return None
        return self._step_once(render=True)

    def run_to_end(self, block: bool = True) -> int:
        """Step until the engine is idle, "Stop" is pressed, or the kernel is interrupted.

        ``block=True`` runs here and returns the number of steps taken (a kernel
        interrupt stops it between steps, then re-raises ``KeyboardInterrupt``).
        ``block=False`` (what the button does inside a running kernel) schedules the run
        on the kernel's event loop one step per tick, so button clicks keep arriving.
        """
        if self._running:
            self._message("already running")
            return 0
        if self._engine_gone():
            return 0
        if not self.engine.has_unfinished_requests():
            self._step_once(render=True)  # says so, and catches up with steps run elsewhere
            return 0
        if not block:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                # Stop can arrive before the task's first tick: the flag is cleared here, not in the task
                self._running, self._stop_requested = True, False
                self._task = loop.create_task(self._run_async())
                return 0
        self._stop_requested = False
        return self._run_blocking()

    def stop(self) -> None:
        """Ask a running "Run to end" to halt after the current step (no-op when idle)."""
        if self._running:
            self._stop_requested = True
            self._message("stopping after this step")
        else:
            self._message("idle: nothing to stop")

    def reset(self) -> None:
        """Abort every request on the engine, clear the prefix cache and this widget's history."""
        if self._running:
            self._stop_requested = True
            if self._task is not None:
                self._task.cancel()  # cancellation lands at an await, i.e. between steps
                self._reset_during_run = True
            self._running = False
        if self._engine_gone():
            return
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        self.engine.reset_prefix_cache()
        # new lists, not cleared ones: a notebook that kept the old (pre_steps = stepper.steps) keeps its history
        self.steps = []
        self.request_ids = []
        self._step_threads = {}
        self._seqs.clear()
        self._arrival_step.clear()
        self._colour.clear()
        self._engine_steps_seen = self._engine_step_count()  # a new history: earlier steps are not missing from it
        self._next_id = 0  # ids count from req-0 again (every request was aborted, and add_request skips live ids)
        self._message(f"reset: all requests aborted, prefix cache cleared; "
                      f"{self.engine.block_manager.num_free_blocks} of {self.engine.block_manager.num_blocks} "
                      "KV blocks free")
        self._notify(None)
        self.render()

    def on_step(self, callback: Callable) -> None:
        """Call ``callback(stepper, record)`` after every step (``record`` None after add/reset)."""
        self._observers.append(callback)

    # -- state ------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """Whether a "Run to end" is stepping the engine now."""
        return self._running

    @property
    def generated_token_count(self) -> int:
        """Tokens generated so far by this widget's requests (finished ones included)."""
        return sum(self._seqs[r].num_output_tokens for r in self.request_ids)

    @property
    def processed_prompt_tokens(self) -> int:
        """Prompt tokens whose KV is in the cache (or was, for finished requests)."""
        return sum(min(s.num_computed_tokens, s.num_prompt_tokens) for s in self._seqs.values())

    @property
    def kv_blocks_used(self) -> int:
        """KV blocks held by running sequences now (the engine's, whoever added the requests)."""
        return self.engine.block_manager.num_used_blocks

    def sequence(self, request_id: str):
        """The engine's ``Sequence`` of one of this widget's requests.

        Raises:
            KeyError: no request of this widget has that id (naming it and the widget's ids)."""
        return self._seqs[self._known(request_id)]

    def arrival_step(self, request_id: str) -> int:
        """Number of steps taken (through this widget) before the request was added.

        Raises:
            KeyError: as :meth:`sequence`."""
        return self._arrival_step[self._known(request_id)]

    def colour(self, request_id: str) -> str:
        """The request's colour in the charts (CSS hex; grey for an id the widget did not add)."""
        return self._colour.get(request_id, "#888888")

    def _known(self, request_id: str) -> str:
        if request_id not in self._seqs:
            raise KeyError(f"request {request_id!r} was not added through this widget; its requests: "
                           f"{list(self._seqs)}")
        return request_id

    # -- stepping ---------------------------------------------------------------------------
    def _engine_gone(self) -> bool:
        """Says so in the status line when the engine has been shut down (``LLM.shutdown()``)."""
        if not self.engine.is_shut_down:
            return False
        self._message("this engine has been shut down (LLM.shutdown()): make a new LLM and a new stepper",
                      error=True)
        return True

    def _engine_step_count(self) -> int | None:
        """Steps the engine has run in all (the next step's ``StepRecord.index``)."""
        return getattr(self.engine, "step_index", None)

    def _outside_note(self, n: int) -> str:
        if not n:
            return ""
        return (f" · {plural(n, 'engine step')} ran outside this widget (llm.generate, another "
                f"stepper or widget on this engine): its step history and chart lack them; the requests, KV "
                f"blocks and attached views show the engine as it is now")

    def _count_outside(self, next_index: int | None) -> int:
        """Engine steps run elsewhere since this widget last looked, up to step ``next_index``
        (default: the engine's count now); adds them to ``outside_steps``."""
        expected = self._engine_steps_seen
        if expected is None and self.steps:
            expected = self.steps[-1].index + 1
        now = self._engine_step_count() if next_index is None else next_index
        n = max(0, now - expected) if now is not None and expected is not None else 0
        self._engine_steps_seen = now
        self.outside_steps += n
        return n

    def _idle_message(self) -> str:
        """What an idle engine means for this widget's requests: one a cell or another widget aborted,
        or one that ended with an error, did not finish, so it is named apart from those that did."""
        ended: dict[str, list[str]] = {}
        for rid, seq in self._seqs.items():
            ended.setdefault(seq.finish_reason, []).append(rid)
        aborted, failed = ended.pop("abort", []), ended.pop("error", [])
        if not aborted and not failed:
            return ("nothing to run: add a request first" if not self.steps else
                    "all requests finished: add another or press Reset")
        finished = [rid for reason, rids in ended.items() if reason is not None for rid in rids]
        parts = ([f"{', '.join(finished)} finished"] if finished else []) + (
            [f"{', '.join(failed)} ended with an error (its RequestOutput's error says why)"] if failed else []) + (
            [f"{', '.join(aborted)} aborted outside this widget (a cell or another widget on this engine)"]
            if aborted else [])
        return f"nothing left to run: {'; '.join(parts)}; add a request or press Reset"

    def _step_once(self, render: bool) -> StepRecord | None:
        if self._engine_gone():
            return None
        if not self.engine.has_unfinished_requests():
            outside = self._count_outside(None)
            self._message(self._idle_message() + self._outside_note(outside))
            # attached views redraw too: steps run elsewhere may have changed the engine since they last drew
            self._notify(None)
            if render:
                self.render()
            return None
        self._ensure_sampler()
        # Before the step: a first measurement of the peaks takes seconds, and an interrupt there must
        # find no step run (after it, the step would be lost from this widget's history).
        if getattr(self.engine, "peaks", None) is None:  # else the engine fills the record's MFU itself
            self._roofline_inputs()
        with heap_frozen():  # the step's time is the engine's, not a full collection's (minivllm.utils.gc_heap)
            record = self.engine.step_with_record().record
        # the record's index follows the last step this widget saw unless others ran in between
        outside = self._count_outside(record.index)
        self._engine_steps_seen = record.index + 1
        self.steps.append(record)  # before anything slow: whatever an interrupt cuts short below, the step is kept
        self._step_threads[record.index] = torch.get_num_threads()  # the chart's title names what the steps ran with
        self._fill_roofline(record)
        self._message(f"engine step {record.index}: {record.phase}, {record.num_prefill_tokens} prefill + "
                      f"{plural(record.num_decode_tokens, 'decode token')} in {fmt_ms(record.wall_ms)}"
                      + self._outside_note(outside))
        self._notify(record)
        if render:
            self.render()
        return record

    def _run_blocking(self) -> int:
        with self._run_session() as run:
            for run.taken in self._steps(render_every=0.2):
                pass
        if run.interrupted:
            raise KeyboardInterrupt
        return run.taken

    async def _run_async(self) -> None:
        try:
            with self._run_session() as run:
                for run.taken in self._steps(render_every=0.1):
                    await asyncio.sleep(0.001)  # let Stop / Reset clicks in between steps
                    _INTERRUPTS.reclaim()
        except (asyncio.CancelledError, KeyboardInterrupt, Exception):
            pass  # the widget's status line says how the run ended (_finish_run); the task ends quietly
        finally:
            self._task = None

    @contextlib.contextmanager
    def _run_session(self):
        """A "Run to end": marks the widget running, turns a kernel interrupt into a stop after
        the current step (:class:`_InterruptStopsRuns`), and reports how the run ended (done,
        stopped, interrupted, or the error a step raised: the engine rolled that step back)."""
        self._running = True
        run = types.SimpleNamespace(taken=0, interrupted=False, error=None, outside_before=self.outside_steps)
        try:
            with _INTERRUPTS.during(self, run):
                yield run
        except KeyboardInterrupt:
            run.interrupted = True
            raise
        except Exception as e:
            run.error = e
            raise
        finally:
            self._running = False
            self._finish_run(run)

    def _steps(self, render_every: float):
        """Step until idle, stopped or ``max_run_steps``; yields the count after each step and
        re-renders at most every ``render_every`` seconds."""
        taken, last_render = 0, time.perf_counter()
        with heap_frozen():  # one freeze for the run (each step's own, nested, then costs nothing)
            while self._running and not self._stop_requested and taken < self.max_run_steps:
                if self._step_once(render=False) is None:
                    break
                taken += 1
                if time.perf_counter() - last_render > render_every:
                    self.render()
                    last_render = time.perf_counter()
                yield taken

    def _finish_run(self, run) -> None:
        stopped, self._stop_requested = self._stop_requested, False
        if self._reset_during_run:  # Reset has said what happened
            self._reset_during_run = False
            return
        if self._engine_gone():
            return
        idle = "" if self.engine.has_unfinished_requests() else "; engine idle"
        if run.error is not None:
            self._message(f"run stopped after {run.taken} steps: a step raised {type(run.error).__name__}: "
                          f"{run.error} (that step was rolled back){idle}", error=True)
        else:
            capped = not (run.interrupted or stopped or idle) and run.taken >= self.max_run_steps
            how = ("interrupted" if run.interrupted else "stopped" if stopped else
                   f"stopped at max_run_steps={self.max_run_steps}" if capped else "done")
            self._message(f"run {how} after {run.taken} steps{idle}" + (
                f"; {self.engine.get_num_unfinished_requests()} request(s) unfinished" if capped else "")
                + self._outside_note(self.outside_steps - run.outside_before))
        self.render()

    # -- measurement helpers ------------------------------------------------------------------
    def _ensure_sampler(self) -> None:
        """On CUDA, sample NVML in the background (windowed context, not per-step figures)."""
        if self._sampler is None and self.engine.config.device.type == "cuda":
            from minivllm.telemetry.utilisation import UtilisationSampler

            self._sampler = UtilisationSampler(period_s=0.2, device=str(self.engine.config.device)).start()

    def _fill_roofline(self, record: StepRecord) -> None:
        """Fill FLOPs / bytes / MFU / MBU when the engine has not (from the roofline model and
        this machine's measured peaks)."""
        if record.mfu is not None or record.num_tokens == 0:
            return
        from minivllm.telemetry.roofline import fill_step_record

        self._roofline_inputs()
        fill_step_record(record, self._cost, self._peaks)

    def _roofline_inputs(self) -> None:
        """The model's cost and this machine's peaks for :meth:`_fill_roofline` (a first
        ``get_peaks`` measures them: seconds)."""
        from minivllm.telemetry.peaks import get_peaks
        from minivllm.telemetry.roofline import engine_cost

        if self._cost is None:
            self._cost = engine_cost(self.engine)
        if self._peaks is None:
            self._peaks = get_peaks(self.engine.config.device, self.engine.config.dtype)

    # -- events -------------------------------------------------------------------------------
    def _message(self, text: str, error: bool = False) -> None:
        self.last_message = text
        colour = "#b00" if error else "#333"
        self.status.value = f"<div class='mv-box' style='color:{colour}'>{html.escape(text)}</div>"

    def _notify(self, record) -> None:
        for cb in self._observers:
            cb(self, record)

    def _on_add(self, _):
        try:
            self.add_request(parse_prompt(self.prompt_box.value), int(self.max_tokens_box.value),
                             float(self.temperature_box.value), ignore_eos=bool(self.ignore_eos_box.value))
        except (ValueError, RuntimeError) as e:
            self._message(f"not added: {e}", error=True)

    def _on_step(self, _):
        # a click's exception would only reach the kernel's log: say it here (the engine rolled the step back)
        before = getattr(self.engine, "step_index", None)
        try:
            self.step()
        except KeyboardInterrupt:
            after = getattr(self.engine, "step_index", None)
            self._message(f"interrupted after engine step {after - 1} ran (it is recorded; the engine is consistent)"
                          if before is not None and after is not None and after > before else
                          "step interrupted (a step cut short is rolled back: the engine stays consistent)", error=True)
        except Exception as e:
            self._message(f"the step raised {type(e).__name__}: {e} (rolled back)", error=True)

    def _on_run(self, _):
        try:
            self.run_to_end(block=False)
        except KeyboardInterrupt:
            pass  # halted between steps; the engine is consistent

    def _on_stop(self, _):
        self.stop()

    def _on_reset(self, _):
        self.reset()

    # -- drawing ------------------------------------------------------------------------------
    def _make_chart(self):
        from ._static import LiveFigure

        fig = LiveFigure()
        for phase in ("prefill", "decode", "mixed"):
            fig.add_bar(x=[], y=[], name=phase, marker_color=PHASE_COLOURS[phase], hovertext=[])
        # the legend at plotly's default place, right of the plot: above it, it covered the provenance line
        fig.update_layout(title=titled("Measured wall time of each step", self.engine), xaxis_title="engine step",
                          yaxis_title="step wall time (ms)", height=280, width=760, xaxis_tick0=0, xaxis_dtick=1,
                          margin=dict(l=50, r=10, t=60, b=40), barmode="overlay", yaxis_rangemode="nonnegative")
        return fig

    def _update_chart(self) -> None:
        if self.chart is None:
            return
        with self.chart.batch_update():
            # integer ticks only, at most ~15 of them (steps are whole numbers)
            span = (self.steps[-1].index - self.steps[0].index + 1) if self.steps else 1
            self.chart.layout.xaxis.dtick = max(1, cdiv(span, 15))
            # no step yet: plotly's empty axis runs from -1; with steps, its own range (a bar's half-width shows)
            self.chart.layout.xaxis.range = None if self.steps else [-0.5, 9.5]
            self.chart.layout.xaxis.autorange = True if self.steps else None
            threads = {self._step_threads[r.index] for r in self.steps if r.index in self._step_threads}
            self.chart.layout.title.text = titled("Measured wall time of each step", self.engine, threads or None)
            for trace in self.chart.data:
                recs = [r for r in self.steps if r.phase == trace.name]
                trace.x = [r.index for r in recs]
                trace.y = [r.wall_ms for r in recs]
                trace.hovertext = [f"{r.num_prefill_tokens} prefill + {r.num_decode_tokens} decode tokens, "
                                   f"{r.num_seqs} seqs" for r in recs]

    def render(self) -> None:
        """Redraw the panes and the chart from the engine's current state."""
        self.step_pane.value = self._step_html()
        self.requests_pane.value = self._requests_html()
        self._update_chart()

    def _bar(self, fraction: float, colour: str) -> str:
        pct = max(0.0, min(1.0, fraction)) * 100
        return f"<span class='mv-bar' style='width:{pct:.1f}%;background:{colour}'></span>"

    def _step_html(self) -> str:
        bm = self.engine.block_manager
        summary = (f"<div class='mv-box'><b>steps taken here</b> <span class='mv-step-count'>{len(self.steps)}</span> · "
                   f"<b>generated tokens</b> <span class='mv-generated-count'>{self.generated_token_count}</span> · "
                   f"<b>KV blocks used</b> <span class='mv-kv-used'>{bm.num_used_blocks}</span> / {bm.num_blocks} "
                   f"(block_size {bm.block_size})</div>")
        if not self.steps:
            return summary + "<div class='mv-box mv-small'>No step yet. Add a request, then press Step.</div>"
        r = self.steps[-1]
        budget = self.engine.config.max_num_batched_tokens
        comp = (f"<span class='mv-bartrack' title='token budget {budget}' style='width:300px'>"
                f"{self._bar(r.num_prefill_tokens / budget, PHASE_COLOURS['prefill'])}"
                f"{self._bar(r.num_decode_tokens / budget, PHASE_COLOURS['decode'])}</span>")
        lines = [
            summary,
            f"<div class='mv-box'><b>engine step {r.index}</b> "
            f"<span class='mv-badge' style='background:{PHASE_COLOURS[r.phase]}'>{r.phase}</span>"
            f"{r.num_prefill_tokens} prefill + {plural(r.num_decode_tokens, 'decode token')}, "
            f"{plural(r.num_seqs, 'sequence')} "
            f"{comp} of the {budget}-token budget</div>",
            f"<div class='mv-box'><b>measured wall time</b> {fmt_ms(r.wall_ms)} "
            f"<span class='mv-small'>(schedule {r.schedule_ms:.2f}, prepare inputs {r.prepare_ms:.2f}, "
            f"model {r.model_ms:.2f}, sample {r.sample_ms:.2f}, postprocess {r.postprocess_ms:.2f} ms)</span></div>",
        ]
        if r.num_draft_tokens:
            rejected = r.num_draft_tokens - r.num_accepted_draft_tokens
            lines.append(
                f"<div class='mv-box'><b>speculative decoding</b> <span class='mv-spec'>"
                f"{r.num_draft_tokens} draft tokens scored, {r.num_accepted_draft_tokens} accepted, "
                f"{rejected} rejected</span> <span class='mv-bartrack'>"
                f"{self._bar(r.num_accepted_draft_tokens / r.num_draft_tokens, '#54a24b')}"
                f"{self._bar(rejected / r.num_draft_tokens, '#e45756')}</span></div>")
        if r.mfu is not None:
            # the peaks that filled the record: the engine's own when it measured them, else the stepper's
            p = self._peaks if self._peaks is not None else getattr(self.engine, "peaks", None)
            peak_note = (f"; peaks on this device ({p.provenance}): {fmt_si(p.flops_per_s, 'FLOP/s')} matmul, "
                         f"{fmt_si(p.mbu_bytes_per_s, 'B/s')} read" if p is not None else "")
            tp = getattr(getattr(self.engine.config, "args", None), "tensor_parallel_size", 1)
            if tp > 1:  # the stepper counts the whole model's work (engine_cost); the engine, one rank's share
                peak_note += (f"; the whole model's FLOPs and bytes, which its {tp} ranks share," if self._peaks is not None
                              else "; rank 0's share of the FLOPs and bytes,") + " against one device's peaks"
            lines.append(
                f"<div class='mv-box'><b>MFU</b><span class='mv-bartrack'>{self._bar(r.mfu, '#4c78a8')}</span>"
                f"{100 * r.mfu:.2f} % <span class='mv-small'>({fmt_si(r.flops, 'FLOP')} in the step)</span><br>"
                f"<b>MBU</b><span class='mv-bartrack'>{self._bar(r.mbu, '#54a24b')}</span>"
                f"{100 * r.mbu:.2f} % <span class='mv-small'>({fmt_si(r.bytes_moved, 'B')} moved"
                f"{peak_note})</span></div>")
        if self._sampler is not None:
            samples = self._sampler.samples
            if samples and samples[-1].gpu_util_percent is not None:
                s = samples[-1]
                lines.append(f"<div class='mv-box mv-small'>NVML (average over its last ~1/6-1 s window, not "
                             f"this step): GPU busy (a kernel running) {s.gpu_util_percent:.0f} %, memory busy "
                             f"{s.mem_util_percent:.0f} %</div>")
        return "".join(lines)

    def _current_step(self) -> StepRecord | None:
        """This widget's last step while it is still the engine's last: after steps run elsewhere its
        chunks and preemptions no longer describe the requests."""
        if not self.steps:
            return None
        last, now = self.steps[-1], self._engine_step_count()
        return last if now is None or now == last.index + 1 else None

    def _request_state(self, rid: str, entry) -> tuple[str, str]:
        from minivllm.engine.sequence import SequenceStatus

        seq = self._seqs[rid]
        last = self._current_step()
        if seq.status is SequenceStatus.FINISHED:
            return f"finished ({seq.finish_reason})", "#555"
        if seq.status is SequenceStatus.WAITING:
            if last is not None and rid in last.preempted:
                return "preempted", "#b00"
            return ("waiting to be recomputed (preempted)" if seq.num_output_tokens else "waiting"), "#999"
        if entry is not None and entry.is_prefill:
            if self._recomputing(seq, entry):
                return ("recomputing after preemption" if seq.is_prefilling else
                        "recomputed after preemption: next token"), PHASE_COLOURS["prefill"]
            return ("prefill chunk" if seq.is_prefilling else "prefilled: first token"), PHASE_COLOURS["prefill"]
        if seq.is_prefilling:
            return ("recomputing after preemption" if self._recomputing(seq, None) else "prefilling",
                    PHASE_COLOURS["prefill"])
        return "decoding", PHASE_COLOURS["decode"]

    @staticmethod
    def _recomputing(seq, entry) -> bool:
        """A prefill of a request that had generated tokens before it lost its KV (recompute preemption):
        its prefill target reaches past the prompt, into the outputs."""
        past_prompt = getattr(seq, "prefill_target", 0) > seq.num_prompt_tokens
        if entry is not None:
            past_prompt = past_prompt or entry.first_position + entry.num_tokens > seq.num_prompt_tokens
        return past_prompt

    def _requests_html(self) -> str:
        from minivllm.engine.sequence import SequenceStatus

        if not self.request_ids:
            return ""
        last = self._current_step()
        entries = {e.request_id: e for e in last.scheduled} if last else {}
        rows = []
        tok = self.tokenizer
        for rid in self.request_ids:
            seq = self._seqs[rid]
            entry = entries.get(rid)
            state, colour = self._request_state(rid, entry)
            n_prompt = seq.num_prompt_tokens
            finished = seq.is_finished
            spans = []
            chunk = range(0)
            if entry is not None and entry.is_prefill:
                chunk = range(entry.first_position, entry.first_position + entry.num_tokens)
            for pos, t in enumerate(seq.prompt_token_ids[:512]):
                if pos in chunk:
                    cls = "mv-tok-chunk"
                elif finished or pos < seq.num_computed_tokens:
                    cls = "mv-tok-cached" if pos < seq.num_cached_tokens else "mv-tok-done"
                else:
                    cls = "mv-tok-wait"
                spans.append(tok_span(tok, t, cls, f", position {pos}"))
            if n_prompt > 512:
                spans.append(f"<span class='mv-small'>… {n_prompt - 512} more</span>")
            outs = seq.output_token_ids
            new_sampled = entry is not None and entry.sampled
            # outputs whose KV a preemption dropped: recomputed in this step's chunk, or still to be
            lost_kv = not finished and bool(outs) and (seq.status is SequenceStatus.WAITING or
                                                       (seq.is_prefilling and self._recomputing(seq, entry)))
            gen = []
            first_shown = max(0, len(outs) - 512)  # the newest outputs; a long run's first ones are counted
            if first_shown:
                gen.append(f"<span class='mv-small'>{first_shown} earlier outputs … </span>")
            for i, t in enumerate(outs[first_shown:], first_shown):
                pos = n_prompt + i
                if i == len(outs) - 1 and new_sampled:
                    cls = "mv-tok-new"
                elif pos in chunk:
                    cls = "mv-tok-chunk"
                elif lost_kv and pos >= seq.num_computed_tokens:
                    cls = "mv-tok-wait"
                else:
                    cls = "mv-tok-gen"
                gen.append(tok_span(tok, t, cls, f", output {i}, position {pos}"))
            processed = n_prompt if finished else min(seq.num_computed_tokens, n_prompt)
            cached = f", {seq.num_cached_tokens} from prefix cache" if seq.num_cached_tokens else ""
            rows.append(
                f"<div class='mv-box mv-request' data-request='{rid}' style='border-left:4px solid "
                f"{self.colour(rid)};padding-left:6px;margin:4px 0'>"
                f"<b>{rid}</b> <span class='mv-badge' style='background:{colour}'>{html.escape(state)}</span>"
                f"<span class='mv-small'>prompt {processed}/{n_prompt} processed{cached} · generated "
                f"{len(outs)}/{seq.params.max_tokens}</span><br>{''.join(spans)}"
                f"<br><span class='mv-small'>output:</span> {''.join(gen) or '<i class=mv-small>none yet</i>'}"
                f"</div>")
        legend = ("<div class='mv-small'>prompt tokens: <span class='mv-tok mv-tok-done'>processed</span>"
                  "<span class='mv-tok mv-tok-chunk'>this step</span><span class='mv-tok mv-tok-cached'>"
                  "prefix-cache hit</span><span class='mv-tok mv-tok-wait'>waiting</span> · output: "
                  "<span class='mv-tok mv-tok-new'>new this step</span><span class='mv-tok mv-tok-chunk'>"
                  "recomputed this step</span><span class='mv-tok mv-tok-wait'>KV lost to a preemption</span>"
                  "</div>")
        return legend + "".join(rows)

    def static_html(self) -> str:
        from ._static import figure_html

        parts = [self.status.value, self.step_pane.value, self.requests_pane.value]
        if self.chart is not None and self.steps:
            parts.append(figure_html(self.chart))
        return "<div class='mv-box'>" + "".join(parts) + "</div>"
