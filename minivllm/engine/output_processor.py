"""From sampled tokens to user-facing results: detokenise, apply stop strings, build outputs.

The ``OutputProcessor`` owns every unfinished request's ``RequestState``. After the
scheduler has applied a step (tokens appended, token/eos/length stops), ``process``
detokenises what is new, ends requests whose text reached a stop string (through the
scheduler, which frees their blocks), and builds the step's ``RequestOutput``s in each
request's output kind.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Callable

from minivllm.engine.detokenizer import IncrementalDetokenizer, byte_table, unknown_id_text
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.undo import UndoLog
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput, new_request_output
from minivllm.sampling_params import OutputKind


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
        sent_prompt_logprobs: a delta output has carried the prompt logprobs already.
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
    sent_prompt_logprobs: bool = False

    #: Detokenise every step (outputs carry text, or stop strings must be watched); a
    #: final-only request without stop strings decodes once, at the end.
    text_every_step: bool = field(init=False)

    def __post_init__(self) -> None:
        self.text_every_step = self.kind is not OutputKind.FINAL_ONLY or bool(self.seq.params.stop_strings)


def snapshot_state(state: RequestState) -> tuple:
    """What ``restore_state`` needs to undo a step's changes to ``state`` (rollback)."""
    detok = state.detokenizer
    return (state, state.__dict__.copy(), detok.get_state() if detok is not None else None)


def restore_state(snapshot: tuple) -> None:
    state, fields, detok_state = snapshot
    state.__dict__.update(fields)
    if detok_state is not None:
        state.detokenizer.set_state(detok_state)


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def find_stop(text: str, stops: list[str], after: int) -> tuple[int, str] | None:
    """Among the stop strings that occur in ``text`` ending beyond offset ``after`` (the text
    already searched: an occurrence may start before it), the one that completes earliest (ties:
    first in ``stops``, as vLLM since its PR 49391), as (its index in ``text``, the string); None
    if none does."""
    best = None
    for order, stop in enumerate(stops):
        index = text.find(stop, max(0, after - len(stop) + 1))
        if index >= 0:
            key = (index + len(stop), order)
            if best is None or key < best[0]:
                best = (key, index, stop)
    return None if best is None else (best[1], best[2])


def update_text(state: RequestState) -> str | None:
    """Detokenise new tokens; returns the stop string found, if any (text is cut before it,
    or after it with ``include_stop_str_in_output``). A stop token's (eos or a
    ``stop_token_ids`` entry) own text is left out of the text unless
    ``include_stop_str_in_output``, as in vLLM."""
    seq = state.seq
    if state.detokenizer is None:
        return None
    new_ids = seq.token_ids[seq.num_prompt_tokens + state.num_detokenized:]
    if not new_ids and not seq.is_finished:
        return None
    state.num_detokenized += len(new_ids)
    params = seq.params
    if new_ids and seq.finish_reason == "stop" and state.stop_hit is None and not params.include_stop_str_in_output:
        new_ids = new_ids[:-1]  # finished by a stop token this step (stop strings are found below)
    before = len(state.text)
    state.text += state.detokenizer.step(new_ids, final=seq.is_finished)
    stops = params.stop_strings
    if stops and state.stop_hit is None:
        if params.min_tokens and state.num_detokenized <= params.min_tokens:
            return None  # no stop string ends in the first min_tokens tokens' text (one may start in it, as in vLLM)
        found = find_stop(state.text, stops, before)  # one ending in the new text
        if found is not None:
            index, stop = found
            state.text = state.text[:index + len(stop) if params.include_stop_str_in_output else index]
            state.stop_hit = stop
            return stop
    return None


#: preceding tokens tried, one more at a time, to complete a character a token's bytes end inside
#: (4: the most bytes a UTF-8 character has; vLLM's logprobs processor tries as many)
_COMPLETING_TOKENS = 4
#: tokenizer -> {path: {token id: its text alone}}: logprobs name the same few thousand ids step after step
_SINGLE_TEXTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _TokenTexts:
    """Token id -> its text for ``Logprob.decoded_token`` (None without detokenisation).

    A special token reads as itself (``<|im_end|>``) whatever the request's ``skip_special_tokens``,
    as in vLLM (``convert_ids_list_to_tokens`` decodes each id alone with the tokenizer's defaults).
    A token whose text alone ends in U+FFFD (its bytes end inside a multi-byte UTF-8 character:
    Chinese, emoji, "€" are split across byte-level tokens) reads, as in vLLM's logprobs processor,
    ``""`` unless up to 4 preceding tokens complete it: then it reads as the character, with the text
    of the preceding tokens that read ``""`` themselves (a space before a curly quote included), so
    that the decoded tokens still join to the text (for an output token, only the output's own:
    the prompt's text is not the completion's). The preceding tokens are the whole sequence's,
    prompt included (vLLM's look back over the sampled tokens only, and over the prompt's after the
    first: a character the prompt begins and the output ends reads ``""`` there). A token that both
    ends one character and begins another reads ``""`` too, as in vLLM."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None):
        self.detokenizer = detokenizer
        self.table = None
        if detokenizer is not None and detokenizer.table is not None:
            self.table = byte_table(detokenizer.tokenizer, skip_special_tokens=False)
        self.limit = getattr(detokenizer, "num_known_ids", None)  # (set on the general path)
        path = "table" if self.table is not None else "decode"
        self.cache = (_SINGLE_TEXTS.setdefault(detokenizer.tokenizer, {}).setdefault(path, {})
                      if detokenizer is not None else {})

    def decode(self, ids: list[int]) -> str:
        if self.table is not None:
            pieces = [self.table[t] if t < len(self.table) else None for t in ids]
            if all(p is not None for p in pieces):
                return b"".join(pieces).decode("utf-8", "replace")
            if len(ids) == 1:
                return unknown_id_text(ids[0])
            return "\ufffd"  # an unknown id in the context completes nothing
        if self.limit is not None and any(t >= self.limit for t in ids):
            return unknown_id_text(ids[0]) if len(ids) == 1 else "\ufffd"
        return self.detokenizer.tokenizer.decode(list(ids), skip_special_tokens=False)

    def single(self, token_id: int) -> str:
        """The text of ``token_id`` alone (cached per tokenizer)."""
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.decode([token_id])
        return text

    def __call__(self, token_id: int, token_ids: list[int] = (), end: int = 0, read: int = 0) -> str | None:
        """The text of ``token_id`` where it follows ``token_ids[:end]``; ``token_ids[:read]`` are
        text already read elsewhere (the prompt, for an output position): never handed on."""
        if self.detokenizer is None:
            return None
        text = self.single(token_id)
        if not text.endswith("\ufffd"):
            return text
        preceding = token_ids[max(0, end - _COMPLETING_TOKENS):end]
        for n in range(1, len(preceding) + 1):
            context = list(preceding[-n:])
            whole = self.decode(context + [token_id])
            if whole.endswith("\ufffd"):
                continue
            # the context tokens that read "" themselves (their text ends inside a character) hand their text,
            # a space before it included, to the token that completes it; what precedes them stays theirs
            clean = len(context)
            while clean and end - n + clean - 1 >= read and self.single(context[clean - 1]).endswith("\ufffd"):
                clean -= 1
            before = self.decode(context[:clean]) if clean else ""
            if whole.startswith(before):
                return whole[len(before):]
            return whole[len(os.path.commonprefix([before, whole])):]  # (a tokenizer that normalises its text)
        return ""


def logprob_dicts(entries, detokenizer: IncrementalDetokenizer | None, token_ids: list[int] = (),
                  start: int = 0, read: int = 0) -> list:
    """Logprob entries ``(ids, logprobs, ranks)`` -> vLLM's ``{token_id: Logprob}`` per position
    (None entries, the first prompt token's, stay None). Entry ``k`` scores the token that follows
    ``token_ids[:start + k]`` (what that changes for a character split across tokens: :class:`_TokenTexts`;
    ``token_ids[:read]``: text already read, the prompt's for output positions)."""
    out = []
    if detokenizer is None:
        text_of = _TokenTexts(None)
    else:  # one per request: built at its first logprobs
        text_of = detokenizer.logprob_texts = detokenizer.logprob_texts or _TokenTexts(detokenizer)
    for k, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        ids, vals, ranks = entry
        d = {}
        for t, v, r in zip(ids, vals, ranks):  # the chosen token first: its top-k entry, if any, replaces it
            d[t] = Logprob(v, r, text_of(t, token_ids, start + k, read))
        out.append(d)
    return out


def make_output(state: RequestState) -> RequestOutput:
    """Build the ``RequestOutput`` for ``state`` (delta or cumulative), advancing delta cursors."""
    seq = state.seq
    finished = seq.is_finished
    out_ids = seq.output_token_ids
    # text that may grow into a stop string is held back until it does or cannot (vLLM holds back a
    # fixed len(longest stop) - 1 characters instead; the joined text is the same), but not when the
    # stop string is to be kept in the output: then nothing is cut once it completes
    stops = () if seq.params.include_stop_str_in_output else seq.params.stop_strings
    if state.kind is OutputKind.DELTA:
        visible = len(state.text) if finished else len(state.text) - _held_back(state.text, stops)
        visible = max(visible, state.sent_text)
        text = state.text[state.sent_text:visible]
        first_token = state.sent_tokens
        token_ids = out_ids[first_token:]
        state.sent_text, state.sent_tokens = visible, len(out_ids)
    else:
        first_token = 0
        text, token_ids = state.text, out_ids  # output_token_ids is a fresh slice: the caller's own list
        if not finished and stops:  # as a delta: shown text never shrinks
            text = text[:len(text) - _held_back(text, stops)]
    logprobs = prompt_logprobs = None
    if seq.logprobs is not None:
        logprobs = logprob_dicts(seq.logprobs[first_token:first_token + len(token_ids)], state.detokenizer,
                                 seq.token_ids, seq.num_prompt_tokens + first_token, seq.num_prompt_tokens)
    if seq.prompt_logprobs is not None and not state.sent_prompt_logprobs:
        prompt_logprobs = logprob_dicts(seq.prompt_logprobs, state.detokenizer, seq.prompt_token_ids)
        state.sent_prompt_logprobs = state.kind is OutputKind.DELTA  # deltas carry them once
    elif seq.prompt_logprobs is not None:
        prompt_logprobs = []  # the later deltas: an empty list, as vLLM 0.34's (v1/engine/logprobs.py pop_prompt_logprobs)
    completion = CompletionOutput(index=0, text=text, token_ids=token_ids, finish_reason=seq.finish_reason,
                                  stop_reason=seq.stop_reason, logprobs=logprobs,
                                  cumulative_logprob=seq.cumulative_logprob)
    return new_request_output(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                              outputs=[completion], finished=finished, num_cached_tokens=seq.num_cached_tokens,
                              metrics=seq.metrics, error=state.error, prompt_logprobs=prompt_logprobs)


class OutputProcessor:
    """Detokenisation, stop strings and output kinds for every unfinished request.

    Args:
        finish: ``Scheduler.finish``, called for a request whose text reached a stop string.
    """

    def __init__(self, finish: Callable[..., None]):
        self.finish = finish
        self.states: dict[str, RequestState] = {}
        #: Ids of the requests whose states want work every step (``text_every_step``), so a step
        #: in which there are none looks only at the requests that finished. Kept conservative:
        #: an id may outlive its state (an interrupted ``drop``), never the other way round.
        self.every_step: set[str] = set()
        #: Set by the engine during a step (request states themselves are snapshotted).
        self.undo: UndoLog | None = None

    def add_request(self, state: RequestState) -> None:
        if state.text_every_step:
            self.every_step.add(state.seq.request_id)
        self.states[state.seq.request_id] = state

    def stop_string_cut(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of ``tokens`` (a speculative step's sampled token and accepted drafts, before
        they are appended to ``seq``) to keep: up to and including the first whose text completes
        one of ``seq``'s stop strings, as when it generates one token a step (then the stop ends it
        at that token; the drafts accepted after it would otherwise stay in ``token_ids``);
        ``len(tokens)`` when none does. Changes nothing: the detokenizer is restored."""
        state = self.states.get(seq.request_id)
        stops = seq.params.stop_strings
        if state is None or state.detokenizer is None or not stops or state.stop_hit is not None or len(tokens) < 2:
            return len(tokens)
        detok = state.detokenizer
        saved = detok.get_state()
        try:
            pending = seq.token_ids[seq.num_prompt_tokens + state.num_detokenized:]  # (none, one step at a time)
            text = state.text + detok.step(pending)
            done = state.num_detokenized + len(pending)
            min_tokens = seq.params.min_tokens
            for i, token in enumerate(tokens[:-1]):  # (a stop in the last token's text cuts nothing)
                before = len(text)
                text += detok.step([token])
                done += 1
                if done > min_tokens and find_stop(text, stops, before) is not None:  # as update_text looks
                    return i + 1
            return len(tokens)
        finally:
            detok.set_state(saved)

    def drop(self, request_id: str) -> None:
        """Forget a request's state (an aborted request, outside a step); inside a transaction
        (``undo`` attached), undone with it."""
        states, undo = self.states, self.undo
        if undo is not None:  # the inverses first: an interrupt between them and the changes undoes nothing wrong
            undo.add(states.__setitem__, request_id, states[request_id])
            if request_id in self.every_step:
                undo.add(self.every_step.add, request_id)
        del states[request_id]
        self.every_step.discard(request_id)

    def process(self, seqs: list[Sequence], errors: dict[Sequence, str],
                finished: list[Sequence] | None = None) -> list[RequestOutput]:
        """Outputs of the requests that sampled this step (``seqs``, tokens already appended
        and token/eos/length stops applied); ``errors`` gives the reason of each that failed.
        ``finished``: those of ``seqs`` that finished (``Scheduler.update_from_output``'s
        answer), if known: when no request wants work every step and none failed, only they
        are looked at. A finished request's state is dropped."""
        outputs = []
        states, undo = self.states, self.undo
        if finished is not None and not errors and not self.every_step:
            seqs = finished  # every request is final-only without stop strings: nothing else to do
        finished_status = SequenceStatus.FINISHED
        for seq in seqs:
            state = states[seq.request_id]
            finished = seq.status is finished_status
            if not (state.text_every_step or finished or (errors and seq in errors)):
                continue  # final-only, no stop strings, still running: nothing to do this step
            # Snapshot before the first change: a final-only request without stop strings
            # changes nothing here until it finishes, so most steps copy nothing for it.
            if undo is not None:
                undo.add(restore_state, snapshot_state(state))
            if seq in errors:
                state.error = errors[seq]
            if state.text_every_step or finished:
                stop = update_text(state)
                if stop is not None:
                    if seq.is_finished:  # the stop string showed up in the last token's text
                        if undo is not None:
                            undo.touch(seq)
                        seq.finish_reason, seq.stop_reason = "stop", stop
                    else:
                        self.finish(seq, "stop", stop)
            if seq.is_finished:
                outputs.append(make_output(state))
                if undo is not None:
                    undo.add(states.__setitem__, seq.request_id, state)
                del states[seq.request_id]
                if state.text_every_step:
                    if undo is not None:
                        undo.add(self.every_step.add, seq.request_id)
                    self.every_step.discard(seq.request_id)
            elif state.kind is not OutputKind.FINAL_ONLY:
                outputs.append(make_output(state))
        return outputs
