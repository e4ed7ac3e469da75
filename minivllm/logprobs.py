"""Where vLLM scripts import logprob types from (``from vllm.logprobs import Logprob``)."""
from __future__ import annotations

from minivllm.outputs import Logprob

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]

#: a generated token's entries, one dict per token (vLLM's alias)
SampleLogprobs = list[dict[int, Logprob]]
#: the prompt's entries; the first is None (no token before it to score it from)
PromptLogprobs = list[dict[int, Logprob] | None]
