"""Log-probabilities for ``SamplingParams.logprobs`` / ``prompt_logprobs`` (vLLM's shapes).

By default from the raw model logits (vLLM v1's default ``logprobs_mode="raw_logprobs"``):
the natural-log softmax over the whole vocabulary, before penalties, temperature or
filters. The engine argument ``logprobs_mode`` selects, as in vLLM, "raw_logits" (the raw
logits themselves), "processed_logprobs" (log-probabilities of the distribution the token
was drawn from: after processors, penalties, temperature, top-k/top-p/min-p) or
"processed_logits" (those logits, -inf where filtered). Prompt logprobs come from the raw logits in
every mode (nothing processes a prompt position): their log-probabilities, or in the two "*_logits"
modes the logits themselves, as vLLM 0.34's runner reports them.
Each position yields one entry ``(token_ids, logprobs, ranks)``: first the chosen token
(sampled, or the actual next prompt token) with its rank (vLLM's: the number of tokens whose
logprob is at least its own, so tied tokens share the lower rank), then the k most likely tokens,
ranks 1..k. The output processor turns entries into ``{token_id: Logprob}`` dicts, where a
top-k entry of the chosen token replaces its own (as vLLM's dicts are filled).
"""
from __future__ import annotations

import torch

#: (token ids, logprobs, ranks) of one position; the chosen token first.
LogprobEntry = tuple


def logprob_entries(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int],
                    normalize: bool = True) -> list[LogprobEntry]:
    """Entries for rows of ``logits``.

    Args:
        logits: fp32 ``[R, V]`` logits (raw, or processed for the "processed" modes).
        chosen: int64 ``[R]``: the token whose own logprob and rank each row reports.
        ks: per row, how many top tokens to add (>= 0; -1: the whole vocabulary).
        normalize: report ``log_softmax(logits)`` (the "*_logprobs" modes), else the logits
            themselves (the "*_logits" modes).

    Returns:
        ``R`` entries ``(token_ids, logprobs, ranks)`` of plain Python numbers.
    """
    if logits.shape[0] == 0:
        return []
    ks = [logits.shape[-1] if k == -1 else k for k in ks]
    lp = logits.float().log_softmax(dim=-1) if normalize else logits.float()
    own = lp.gather(1, chosen.unsqueeze(1))
    ranks = (lp >= own).sum(dim=-1).tolist()  # vLLM's batched_count_greater_than counts >=
    own_list = own.squeeze(1).tolist()
    chosen_list = chosen.tolist()
    kmax = min(max(ks), lp.shape[-1])
    if kmax:
        top_vals, top_ids = lp.topk(kmax, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    entries = []
    for r, k in enumerate(ks):
        ids, vals, rks = [chosen_list[r]], [own_list[r]], [ranks[r]]
        if k:
            ids += top_ids[r][:k]
            vals += top_vals[r][:k]
            rks += list(range(1, min(k, kmax) + 1))
        entries.append((ids, vals, rks))
    return entries
