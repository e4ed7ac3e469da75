"""From sampled tokens to user-facing results: detokenise, apply stop strings, build outputs."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.sequence import Sequence
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
    """

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    kind: OutputKind = OutputKind.CUMULATIVE
    text: str = ""
    num_detokenized: int = 0
    sent_text: int = 0
    sent_tokens: int = 0
    stop_hit: str | None = field(default=None)

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
                         metrics=seq.metrics)
