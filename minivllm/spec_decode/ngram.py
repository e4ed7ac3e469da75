"""The n-gram proposer (prompt lookup decoding, Saxena 2023; vLLM's "ngram" method).

Text that repeats its context (code being edited, a document being quoted, a list
continuing a pattern) is cheap to guess: find the latest earlier place where the
context's last n tokens occurred, and propose the tokens that followed them there.
"""
from __future__ import annotations

import numpy as np

from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.proposal import NO_PROPOSAL, Proposal, may_speculate


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``token_ids``.

    For n from ``n_max`` down to ``n_min``: if the last n tokens also occur earlier,
    return the k tokens that followed their latest earlier occurrence. A continuation that
    runs past the end of ``token_ids`` goes on as a copy from the same distance back (as an
    LZ77 match may overlap its own output): the context ends in a pattern repeating with
    that period, and the draft assumes it keeps repeating. Without that, a context stuck on
    one token (``[..., 7, 7, 7, 7]``: a greedy model in a loop) would get one draft token per
    step however large k is, since its latest earlier 4-gram ends one token before the end.
    Returns ``[]`` when no n-gram recurs or ``k < 1``.

    Example: ``propose_ngram([1, 2, 1, 2, 1], 4, 1, 2) == [2, 1, 2, 1]`` ((2, 1) last occurred
    two tokens earlier, so the draft repeats with period 2).
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
            draft = token_ids[follow:follow + k]
            period = length - follow  # >= 1: the match ends before the last token
            while len(draft) < k:  # ran into the end: keep copying from `period` tokens back
                draft.append(draft[len(draft) - period])
            return draft
    return []


class NgramProposer:
    """The scheduler's proposer for ``method="ngram"``: ``proposer([(seq, max_tokens), ...])``
    returns one ``Proposal`` per sequence (deterministic drafts: ``probs`` is None).

    Requests whose next-token distribution depends on more than the model and the
    temperature/top-k/top-p/min-p filters get no drafts (see ``may_speculate``), so those
    requests decode one token per step.
    """

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def __call__(self, requests) -> list[Proposal]:
        return [Proposal(propose_ngram(seq.token_ids, min(self.k, max_tokens), self.n_min, self.n_max))
                if may_speculate(seq.params) else NO_PROPOSAL for seq, max_tokens in requests]
