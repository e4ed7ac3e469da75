"""Speculative decoding: propose several tokens cheaply, verify them in one forward pass.

    config.py   ``SpeculativeConfig``: vLLM v1's ``speculative_config`` dict, validated
    proposal.py ``Proposal``: draft token ids (and the distribution they were drawn from)
    ngram.py    the n-gram (prompt lookup) proposer
    draft_model.py  the draft-model proposer (a smaller model with the target's vocabulary)
    draft_cache.py  its KV pool and per-request cache entries, validated against the sequence
    verify.py   exact verification: greedy prefix match, or rejection sampling at T > 0
"""
from minivllm.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
