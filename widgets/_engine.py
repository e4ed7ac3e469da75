"""Small helpers the widgets share to read the live engine (no engine state is copied or faked)."""
from __future__ import annotations

import html
import re

_IDS_RE = re.compile(r"^\s*\[\s*(\d+\s*(,\s*\d+\s*)*)?,?\s*\]\s*$")


def engine_of(llm):
    """The ``LLMEngine`` behind an ``LLM`` (or the engine itself).

    Raises:
        ValueError: ``llm`` is neither, or it has been shut down.
    """
    engine = getattr(llm, "llm_engine", llm)
    gone = (f"this {type(llm).__name__} has been shut down (LLM.shutdown() frees its engine; a later cell may "
            f"have called it): make a new LLM, and a new widget on it (in a notebook: run the cell that built the "
            f"LLM again, then this one)")
    if engine is None or not hasattr(engine, "step") or not hasattr(engine, "block_manager"):
        raise ValueError(f"expected a minivllm LLM or LLMEngine, got {llm!r}")
    if engine.is_shut_down:
        raise ValueError(gone)
    return engine


def idle_engine(llm) -> list[str]:
    """Abort every unfinished request on ``llm``'s engine, so that the cell calling this steps only
    its own: a request a stepper widget left mid-decode (after its cell, a learner's clicks can add
    more), or one an interrupted cell left queued, would join the cell's steps and its figures.
    Prints one line naming what it aborted; nothing when the engine was idle.

    Returns:
        The aborted request ids (empty when there were none).

    Raises:
        ValueError: ``llm`` is not an engine, or has been shut down (``engine_of``).
    """
    engine = engine_of(llm)
    ids = list(engine.requests)
    for rid in ids:
        engine.abort_request(rid)
    if ids:
        print(f"(aborted {len(ids)} unfinished request(s) left on the engine by a widget or an earlier cell: "
              f"{ids}; this cell's steps hold only its own)")
    return ids


def provenance(llm) -> str:
    """Where a chart's measurements come from: ``"measured on cpu (AMD EPYC 9R14) · minivllm-tiny ·
    float32 · 1 CPU thread"`` (device and its name, model, dtype of the live engine, torch's CPU
    threads), for chart subtitles;
    the one function every widget's chart uses (``minivllm.utils.env_report.chart_provenance``).

    Raises:
        ValueError: ``llm`` is not an engine, or has been shut down."""
    from minivllm.utils.env_report import chart_provenance

    return chart_provenance(engine_of(llm))


def titled(title: str, llm, threads=None) -> str:
    """A plotly title with the provenance line under it (``env_report.chart_title``; ``threads``:
    the CPU thread count(s) the data were measured with, default torch's count now)."""
    from minivllm.utils.env_report import chart_title

    return chart_title(title, engine_of(llm), threads)


# what a learner typing token ids may get wrong: only digits, signs, commas and spaces after a "["
_IDS_ATTEMPT_RE = re.compile(r"^\s*\[[\s\d,+-]*\]?\s*$")


def parse_prompt(text: str):
    """A prompt typed into a text box: ``"[1, 2, 3]"`` (brackets required) means token ids,
    anything else is text. Returns ``str`` or ``list[int]``.

    Raises:
        ValueError: the text looks like token ids but is not a valid list of them (``"[-1]"``,
            ``"[1, 2,"``, ``"[1 2]"``, ``"[1,,2]"``): such a prompt is a typo, not text.
    """
    if _IDS_RE.match(text or ""):
        inner = text.strip()[1:-1]
        return [int(t) for t in inner.replace(" ", "").split(",") if t]
    if _IDS_ATTEMPT_RE.match(text or "") and text.strip() != "[":
        raise ValueError(f"{text.strip()!r} is not a list of token ids: write them as [1, 2, 3] (non-negative "
                         "integers, comma-separated, in brackets)")
    return text


def token_piece(tokenizer, token_id: int) -> str:
    """Printable text of one token: spaces as '·', newlines as '↵', tabs as '→'; '∅' for a token that
    decodes to nothing, and ``<id:N>`` (as the engine's output text) for an id the tokenizer has no
    entry for (a ``random:`` preset's 151936-token model beside the embedded 4096-token tokenizer).

    A byte-level BPE token can hold part of a UTF-8 character; it then decodes to '�'.
    """
    from minivllm.engine.detokenizer import unknown_id_text

    token_id = int(token_id)
    try:
        known = len(tokenizer)
    except TypeError:  # no length: trust decode
        known = None
    if known is not None and not 0 <= token_id < known:
        return unknown_id_text(token_id)
    s = tokenizer.decode([token_id])
    return s.replace(" ", "·").replace("\n", "↵").replace("\t", "→") or "∅"


def tok_span(tokenizer, token_id: int, cls: str, extra_title: str = "") -> str:
    """A token as an HTML ``<span>`` of CSS class ``cls``, its text escaped, its id (and ``extra_title``) on hover."""
    piece = html.escape(token_piece(tokenizer, token_id))
    title = html.escape(f"id {token_id}{extra_title}")
    return f"<span class='mv-tok {cls}' title='{title}'>{piece}</span>"


def plural(n: int, word: str) -> str:
    """``"1 sequence"``, ``"2 sequences"``: ``n`` and ``word``, with an s unless ``n`` is 1."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt_ms(ms: float | None) -> str:
    """Milliseconds for a readout (two decimals below 100 ms); "–" for None."""
    if ms is None:
        return "–"
    return f"{ms:.2f} ms" if ms < 100 else f"{ms:.0f} ms"


def fmt_si(x: float | None, unit: str = "") -> str:
    """``x`` with an SI prefix (k, M, G, T) before ``unit``, two decimals; "–" for None."""
    if x is None:
        return "–"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def slot_ranges(block_table: list[int], num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Slot mapping of a sequence's first ``num_tokens`` tokens as inclusive (first, last)
    slot ranges, one per block: token ``p`` lives in slot ``table[p // bs] * bs + p % bs``."""
    out = []
    for i, b in enumerate(block_table):
        first_pos = i * block_size
        if first_pos >= num_tokens:
            break
        last_pos = min(num_tokens, first_pos + block_size) - 1
        out.append((b * block_size, b * block_size + (last_pos - first_pos)))
    return out
