"""Per-request logits processors beyond the classic filters (vLLM v1's order):
allowed_token_ids, bad_words, min_tokens, logit_bias; then, after the repetition
penalty, OpenAI's frequency and presence penalties.

Only rows of requests that use one of them get a ``RowProcessing``; the others are None
and cost nothing. Everything here works on fp32 logits ``[N, V]`` in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowProcessing:
    """What to do to one row of logits this step.

    Attributes:
        allowed_token_ids: only these ids keep their logits (others -inf), or None.
        banned_token_ids: ids set to -inf (bad words' next tokens, min_tokens' stop ids).
        logit_bias: ``{token_id: bias}`` added, or None.
        output_token_ids: the output so far (for the frequency/presence penalties), or None.
        presence_penalty / frequency_penalty: OpenAI's penalties (0 disables).
    """

    allowed_token_ids: list[int] | None
    banned_token_ids: list[int]
    logit_bias: dict[int, float] | None
    output_token_ids: list[int] | None
    presence_penalty: float
    frequency_penalty: float


def banned_by_bad_words(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output (a one-token word is
    always banned): generating that token would complete the word."""
    banned = []
    n = len(output_token_ids)
    for word in bad_words_token_ids:
        prefix = word[:-1]
        k = len(prefix)
        if k == 0 or (k <= n and output_token_ids[n - k:] == prefix):
            banned.append(word[-1])
    return banned


def row_processing(params, output_token_ids: list[int], bad_words_token_ids: list[list[int]],
                   min_tokens_stop_ids: list[int]) -> RowProcessing:
    """The ``RowProcessing`` of one request at its current output length."""
    banned = banned_by_bad_words(bad_words_token_ids, output_token_ids) if bad_words_token_ids else []
    if len(output_token_ids) < params.min_tokens:
        banned.extend(min_tokens_stop_ids)
    penalised = params.presence_penalty != 0 or params.frequency_penalty != 0
    return RowProcessing(params.allowed_token_ids, banned, params.logit_bias,
                         output_token_ids if penalised else None, params.presence_penalty, params.frequency_penalty)


def apply_logits_processors(logits: torch.Tensor, rows: list[RowProcessing | None]) -> torch.Tensor:
    """allowed_token_ids, bad words / min_tokens bans, logit_bias; ``logits`` fp32 ``[N, V]``,
    modified in place and returned."""
    vocab = logits.shape[-1]
    dev = logits.device
    for i, r in enumerate(rows):
        if r is None:
            continue
        row = logits[i]
        if r.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
            keep[torch.tensor(r.allowed_token_ids, device=dev)] = True
            row.masked_fill_(~keep, float("-inf"))
        if r.banned_token_ids:
            row[torch.tensor(r.banned_token_ids, device=dev)] = float("-inf")
        if r.logit_bias:
            ids = torch.tensor(list(r.logit_bias), device=dev)
            row[ids] += torch.tensor(list(r.logit_bias.values()), dtype=row.dtype, device=dev)
    return logits


def apply_frequency_presence_penalties(logits: torch.Tensor, rows: list[RowProcessing | None]) -> torch.Tensor:
    """OpenAI's penalties: ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``
    with ``count[j]`` the occurrences of token j in the output so far. In place."""
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        if r is None or not r.output_token_ids:
            continue
        counts = torch.bincount(torch.tensor(r.output_token_ids, device=logits.device), minlength=vocab)[:vocab]
        counts = counts.to(logits.dtype)
        logits[i] -= counts * r.frequency_penalty + (counts > 0).to(logits.dtype) * r.presence_penalty
    return logits
