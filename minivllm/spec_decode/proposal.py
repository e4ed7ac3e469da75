"""What a proposer hands the scheduler for one sequence: draft token ids, and the distribution
each was drawn from when the proposer samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Proposal:
    """Draft tokens for one decoding sequence.

    Attributes:
        token_ids: the drafts, in order (possibly empty).
        probs: fp32 ``[len(token_ids), vocab_size]`` on the model's device: row i is the
            distribution q_i that ``token_ids[i]`` was drawn from (a draft model sampling at
            the request's temperature and filters); rejection sampling needs it. None when the
            drafts are deterministic (the n-gram proposer, or a greedy request): each q_i is
            then a point mass on its draft.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None

    def truncated(self, n: int) -> "Proposal":
        """The first ``max(n, 0)`` drafts (a prefix of a proposal is a valid proposal)."""
        n = max(n, 0)
        if n >= len(self.token_ids):
            return self
        return Proposal(self.token_ids[:n], None if self.probs is None else self.probs[:n])


NO_PROPOSAL = Proposal([])


def may_speculate(params) -> bool:
    """Whether a request's next-token distribution is the model's alone (after temperature,
    top-k, top-p, min-p), so drafts can be verified exactly: repetition penalties,
    ``min_tokens``, ``bad_words``, ``logit_bias`` / ``allowed_token_ids`` and logprobs would
    have to be applied or reported per draft position, which this engine does not do yet."""
    return params.repetition_penalty == 1.0 and not params.has_logits_processors and params.logprobs is None
