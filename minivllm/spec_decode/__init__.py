"""Speculative decoding: propose several tokens cheaply, verify them in one forward pass.

    config.py   ``SpeculativeConfig``: vLLM v1's ``speculative_config`` dict, validated
    ngram.py    the n-gram (prompt lookup) proposer
    verify.py   exact verification: greedy prefix match, or rejection sampling at T > 0
"""
from minivllm.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
