"""The n-gram proposer (prompt lookup decoding, Saxena 2023; vLLM's "ngram" method).

Text that repeats its context (code being edited, a document being quoted, a list
continuing a pattern) is cheap to guess: find the latest earlier place where the
context's last n tokens occurred, and propose the tokens that followed them there.
"""
from __future__ import annotations

import numpy as np

from minivllm.spec_decode.config import SpeculativeConfig


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``token_ids``.

    For n from ``n_max`` down to ``n_min``: if the last n tokens also occur earlier,
    return the (at most k) tokens that followed their latest earlier occurrence (the
    continuation may run into the suffix itself, which extends a repeating pattern).
    Returns ``[]`` when no n-gram recurs or ``k < 1``.
    """
    length = len(token_ids)
    if k < 1 or length < n_min + 1:
        return []
    arr = np.asarray(token_ids)
    # Candidate ends: earlier positions holding the last token (not the last position itself).
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        starts = ends - (n - 1)
        starts = starts[starts >= 0]
        if starts.size == 0:
            continue
        pattern = arr[length - n:]
        # Compare the n-token window at each candidate start with the pattern, latest first.
        windows = arr[starts[:, None] + np.arange(n)]
        hits = starts[(windows == pattern).all(axis=1)]
        if hits.size:
            follow = int(hits[-1]) + n
            return token_ids[follow:follow + k]
    return []


class NgramProposer:
    """The scheduler's ``propose(seq, max_tokens)`` for ``method="ngram"``.

    Requests whose next-token distribution depends on more than the model and the
    temperature/top-k/top-p/min-p filters get no drafts: penalties, ``min_tokens``,
    ``bad_words``, ``logit_bias`` / ``allowed_token_ids`` (``has_logits_processors``) would
    have to be applied per draft position, and logprobs reported per accepted draft; this
    engine does not do either yet, so those requests decode one token per step.
    """

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def __call__(self, seq, max_tokens: int) -> list[int]:
        p = seq.params
        if p.repetition_penalty != 1.0 or p.has_logits_processors or p.logprobs is not None:
            return []
        return propose_ngram(seq.token_ids, min(self.k, max_tokens), self.n_min, self.n_max)
