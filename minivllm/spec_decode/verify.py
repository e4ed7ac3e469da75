"""Exact verification of draft tokens (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).

The target model scored the last known token and the k drafts in one forward pass, giving
k + 1 next-token distributions p_0 .. p_k (p_i: what follows draft i; p_0 follows the last
known token). Draft d_(i+1) was drawn from a proposal distribution q_i, and:

* accept d_(i+1) with probability min(1, p_i(d) / q_i(d));
* at the first rejection, draw from the residual norm(max(0, p_i - q_i)) and stop;
* if all k drafts are accepted, draw a bonus token from p_k.

Every emitted token is then distributed exactly as sampling from the target model one
token at a time. A draft model that samples passes its real q_i (the closer q is to p,
the more is accepted: q = p accepts everything). A deterministic proposer (n-gram, or any
greedy draft) has q_i a point mass on d: acceptance becomes p_i(d) and the residual is p_i
with d removed and renormalised. Greedy requests (temperature 0) accept a draft iff it is
the argmax.
"""
from __future__ import annotations

import torch

from minivllm.layers.sampler import exponential_race


def verify_greedy(drafts: list[int], argmax_tokens: list[int]) -> list[int]:
    """``argmax_tokens``: the target's argmax at each of the k + 1 rows. Returns the
    accepted drafts followed by the target's own token at the first mismatch (or the
    bonus token after all k)."""
    out = []
    for draft, target in zip(drafts, argmax_tokens):
        if draft != target:
            break
        out.append(draft)
    out.append(argmax_tokens[len(out)])
    return out


def verify_sampled(drafts: list[int], probs: torch.Tensor, generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """``probs``: fp32 ``[k + 1, V]``, the target's processed next-token distributions
    (after temperature, top-k, top-p, min-p). ``draft_probs``: fp32 ``[k, V]``, the q_i each
    draft was drawn from, or None for point masses (deterministic drafts). Draws uniforms and
    exponentials from ``generator`` (the request's own when seeded). Returns accepted drafts
    + one drawn token."""
    k = len(drafts)
    rows, ids = torch.arange(k, device=probs.device), torch.tensor(drafts, device=probs.device)
    accept_p = probs[rows, ids]
    if draft_probs is not None:  # min(1, p/q); q(d) > 0 for a token drawn from q
        accept_p = (accept_p / draft_probs[rows, ids].clamp(min=torch.finfo(torch.float32).tiny)).clamp(max=1.0)
    uniforms = torch.rand(k, generator=generator, device=probs.device)
    accepted = (uniforms < accept_p).tolist()
    out = []
    for i, ok in enumerate(accepted):
        if not ok:
            if draft_probs is None:
                residual = probs[i].clone()
                residual[drafts[i]] = 0.0
            else:
                residual = (probs[i] - draft_probs[i]).clamp(min=0.0)
            if residual.sum() <= 1e-12:  # p_i (nearly) equal to q_i: nothing else can follow; rounding
                residual = probs[i]
            out.append(int(exponential_race(residual.unsqueeze(0), [generator], generator)[0]))
            return out
        out.append(drafts[i])
    out.append(int(exponential_race(probs[k].unsqueeze(0), [generator], generator)[0]))
    return out
