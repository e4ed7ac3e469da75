"""Fault injection for engine tests: make one internal function raise on its n-th call."""
from __future__ import annotations

import functools

import minivllm.engine.llm_engine as llm_engine_mod
import minivllm.engine.output_processor as output_processor_mod
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler
import minivllm.layers.sampler as sampler_mod
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.layers.sampler import Sampler
from minivllm.spec_decode.draft_model import DraftModelProposer

#: Every place in a step an exception can come from: (name, owner, attribute).
FAULT_POINTS = [
    ("scheduling", Scheduler, "schedule"),
    ("admission", BlockManager, "admit"),
    ("block allocation", BlockManager, "grow"),
    ("input preparation", ModelRunner, "prepare_input"),
    ("forward", ModelRunner, "forward_logits"),
    ("sampling", Sampler, ("__call__", "greedy_token_ids")),  # the general path, a plain greedy batch's
    ("postprocess", Scheduler, "update_from_output"),
    ("block registration", BlockManager, "register_computed_blocks"),
    ("stop checks", Scheduler, "finish"),
    ("detokenization", IncrementalDetokenizer, "step"),
    ("stop strings", output_processor_mod, "update_text"),
    ("output building", output_processor_mod, "make_output"),
    ("step record", llm_engine_mod, "fill_step_record"),
]
FAULT_NAMES = [name for name, _, _ in FAULT_POINTS]

#: Places only requests with vLLM's extra options reach (logits processors, logprobs, n > 1).
OPTION_FAULT_POINTS = [
    ("logits processors", sampler_mod, "apply_logits_processors"),
    ("frequency/presence penalties", sampler_mod, "apply_frequency_presence_penalties"),
    ("logprobs", ModelRunner, "_logprobs"),
    ("prompt logprobs", ModelRunner, "_prompt_logprobs"),
    ("parallel sampling merge", ParentRequest, "absorb"),
]
OPTION_FAULT_NAMES = [name for name, _, _ in OPTION_FAULT_POINTS]

#: Places only a draft model's proposer reaches (speculative_config method "draft_model").
DRAFT_FAULT_POINTS = [
    ("draft proposal", DraftModelProposer, "__call__"),
    ("draft forward", ModelRunner, "logits_at"),
    ("draft sampling", DraftModelProposer, "_draw"),
]
DRAFT_FAULT_NAMES = [name for name, _, _ in DRAFT_FAULT_POINTS]


class Fault:
    """Raise ``exc`` from the ``at``-th call (0-based) of the named fault point, once. A point may
    name several attributes (one place reached by different paths): their calls count together."""

    def __init__(self, monkeypatch, name: str, at: int = 0, exc: type[BaseException] = KeyboardInterrupt):
        owner, attrs = next((o, a) for n, o, a in FAULT_POINTS + OPTION_FAULT_POINTS + DRAFT_FAULT_POINTS
                            if n == name)
        self.calls, self.fired = 0, False
        for attr in (attrs,) if isinstance(attrs, str) else attrs:
            monkeypatch.setattr(owner, attr, self._faulty(getattr(owner, attr), name, at, exc))

    def _faulty(self, original, name, at, exc):
        @functools.wraps(original)
        def faulty(*args, **kwargs):
            if not self.fired and self.calls == at:
                self.fired = True
                raise exc(f"injected fault in {name}")
            self.calls += 1
            return original(*args, **kwargs)

        return faulty
