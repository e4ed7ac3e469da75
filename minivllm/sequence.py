"""vLLM's older home of the logprob types (``from vllm.sequence import Logprob``, before vLLM moved
them to ``vllm.logprobs``): the same objects as :mod:`minivllm.logprobs`."""
from __future__ import annotations

from minivllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
