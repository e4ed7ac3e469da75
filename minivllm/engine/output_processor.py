"""From sampled tokens to user-facing results: detokenise, apply stop strings, build outputs.

The ``OutputProcessor`` owns every unfinished request's ``RequestState``. After the
scheduler has applied a step (tokens appended, token/eos/length stops), ``process``
detokenises what is new, ends requests whose text reached a stop string (through the
scheduler, which frees their blocks), and builds the step's ``RequestOutput``s in each
request's output kind.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.sequence import Sequence
from minivllm.engine.undo import UndoLog
from minivllm.outputs import CompletionOutput, RequestOutput


class OutputKind(enum.Enum):
    """What ``LLMEngine.step()`` returns for a request (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = "cumulative"  # every step: all text and tokens so far
    DELTA = "delta"            # every step: only what is new (LLM.stream)
    FINAL_ONLY = "final_only"  # once, when finished (LLM.generate): no per-step work


@dataclass
class RequestState:
    """The engine's view of one request beyond the scheduler's ``Sequence``.

    Attributes:
        seq: the scheduled sequence.
        detokenizer: incremental decoder of its output tokens.
        kind: which outputs the request returns.
        text: output text so far (truncated before a stop string once one appears).
        num_detokenized: output tokens already fed to the detokenizer.
        sent_text / sent_tokens: how much of ``text`` / output tokens delta outputs have returned.
        stop_hit: the stop string found in the text, if any.
        error: why the request ended with finish_reason "error", else None.
    """

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    kind: OutputKind = OutputKind.CUMULATIVE
    text: str = ""
    num_detokenized: int = 0
    sent_text: int = 0
    sent_tokens: int = 0
    stop_hit: str | None = field(default=None)
    error: str | None = None

    @property
    def text_every_step(self) -> bool:
        """Detokenise every step (outputs carry text, or stop strings must be watched);
        a final-only request without stop strings decodes once, at the end."""
        return self.kind is not OutputKind.FINAL_ONLY or bool(self.seq.params.stop_strings)


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def update_text(state: RequestState) -> str | None:
    """Detokenise new tokens; returns the stop string found, if any (text is cut before it)."""
    seq = state.seq
    if state.detokenizer is None:
        return None
    new_ids = seq.token_ids[seq.num_prompt_tokens + state.num_detokenized:]
    if not new_ids and not seq.is_finished:
        return None
    state.num_detokenized += len(new_ids)
    before = len(state.text)
    state.text += state.detokenizer.step(new_ids, final=seq.is_finished)
    stops = seq.params.stop_strings
    if stops and state.stop_hit is None:
        # A stop string can start up to len(stop) - 1 characters before the new text.
        start = max(0, before - max(len(s) for s in stops) + 1)
        found = [(state.text.find(s, start), s) for s in stops]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            index, stop = min(found)
            state.text = state.text[:index]
            state.stop_hit = stop
            return stop
    return None


def make_output(state: RequestState) -> RequestOutput:
    """Build the ``RequestOutput`` for ``state`` (delta or cumulative), advancing delta cursors."""
    seq = state.seq
    finished = seq.is_finished
    out_ids = seq.output_token_ids
    if state.kind is OutputKind.DELTA:
        visible = len(state.text) if finished else len(state.text) - _held_back(state.text, seq.params.stop_strings)
        visible = max(visible, state.sent_text)
        text = state.text[state.sent_text:visible]
        token_ids = out_ids[state.sent_tokens:]
        state.sent_text, state.sent_tokens = visible, len(out_ids)
    else:
        text, token_ids = state.text, list(out_ids)
    completion = CompletionOutput(index=0, text=text, token_ids=token_ids,
                                  finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
    return RequestOutput(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                         outputs=[completion], finished=finished, num_cached_tokens=seq.num_cached_tokens,
                         metrics=seq.metrics, error=state.error)


class OutputProcessor:
    """Detokenisation, stop strings and output kinds for every unfinished request.

    Args:
        finish: ``Scheduler.finish``, called for a request whose text reached a stop string.
    """

    def __init__(self, finish: Callable[..., None]):
        self.finish = finish
        self.states: dict[str, RequestState] = {}
        #: Set by the engine during a step (request states themselves are snapshotted).
        self.undo: UndoLog | None = None

    def add_request(self, state: RequestState) -> None:
        self.states[state.seq.request_id] = state

    def process(self, seqs: list[Sequence], errors: dict[Sequence, str]) -> list[RequestOutput]:
        """Outputs of the requests that sampled this step (``seqs``, tokens already appended
        and token/eos/length stops applied); ``errors`` gives the reason of each that failed.
        A finished request's state is dropped."""
        outputs = []
        states = self.states
        for seq in seqs:
            state = states[seq.request_id]
            if seq in errors:
                state.error = errors[seq]
            if state.text_every_step or seq.is_finished:
                stop = update_text(state)
                if stop is not None:
                    if seq.is_finished:  # the stop string showed up in the last token's text
                        seq.finish_reason, seq.stop_reason = "stop", stop
                    else:
                        self.finish(seq, "stop", stop)
            if seq.is_finished:
                outputs.append(make_output(state))
                del states[seq.request_id]
                if self.undo is not None:
                    self.undo.add(states.__setitem__, seq.request_id, state)
            elif state.kind is not OutputKind.FINAL_ONLY:
                outputs.append(make_output(state))
        return outputs
