"""``SamplingParams.n > 1``: n independent samples of one prompt (vLLM v1's fan-out).

The engine runs a parent request as n child requests, ids ``"{i}_{parent id}"``, each
with ``n=1`` and, when the parent has a ``seed``, seed ``seed + i`` (so a seeded parent
replays exactly, and its samples differ from each other). The children share their
prompt's KV blocks through the prefix cache: child 0 leads, and the others are admitted
once it has sampled (``Sequence.prefix_leader``), so they hit every full prompt block it
computed instead of computing their own (so samples 1..n-1 produce their first token a step
after sample 0); the scheduler passes over them until then, so the requests queued behind
them are admitted as usual. ``ParentRequests.merge`` turns the children's outputs back into the parent's
``RequestOutput``s, ``outputs[i].index == i``, as vLLM's output processor does:

* final-only: one output when every child has finished, all n completions in index order, its
  metrics and ``num_cached_tokens`` those of the child that finished last;
* cumulative and delta: each child's output as it comes, ``outputs=[that completion]`` (its
  whole text so far, or its new part), under the parent's id; a finished child gives no more.
  ``finished`` is True on the parent's last output only.

Merging happens inside the step's transaction: every change is recorded in the undo log.
"""
from __future__ import annotations

import dataclasses

from minivllm.engine.output_processor import OutputKind
from minivllm.engine.undo import UndoLog
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th child's parameters: n=1, and seed + i when the parent is seeded. The seed is set
    after construction: passed in, a seed + i of -1 would read as vLLM's "no seed" (the parent's
    range check already covers seed + n - 1)."""
    child = dataclasses.replace(params, n=1)
    if params.seed is not None:
        object.__setattr__(child, "seed", params.seed + index)
    return child


class ParentRequest:
    """The latest completion and finished flag of each of a parent's n children."""

    def __init__(self, request_id: str, n: int, kind: OutputKind):
        self.request_id, self.n, self.kind = request_id, n, kind
        self.child_ids = [child_request_id(i, request_id) for i in range(n)]
        self.latest: list[RequestOutput | None] = [None] * n
        self.finished = [False] * n

    def _set(self, index: int, out: RequestOutput, undo: UndoLog | None) -> None:
        if undo is not None:
            undo.add(self._restore, index, self.latest[index], self.finished[index])
        self.latest[index] = out
        self.finished[index] = out.finished

    def _restore(self, index: int, latest, finished: bool) -> None:
        self.latest[index], self.finished[index] = latest, finished

    def absorb(self, index: int, out: RequestOutput, undo: UndoLog | None) -> RequestOutput | None:
        """Take child ``index``'s output; returns the parent's output to emit, if any."""
        self._set(index, out, undo)
        done = all(self.finished)
        completion = dataclasses.replace(out.outputs[0], index=index)
        if self.kind is not OutputKind.FINAL_ONLY:  # streaming: the child's own output (vLLM's)
            return self._output(out, [completion], done)
        if not done:
            return None
        # the last child to finish: its metrics, its cache hits; every sample's completion and any error
        return self.every_sample(self._output(out, [], done))

    def _output(self, base: RequestOutput, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
        return dataclasses.replace(base, request_id=self.request_id, outputs=completions, finished=finished)

    def every_sample(self, base: RequestOutput) -> RequestOutput:
        """``base`` (an output of this parent) with every sample's latest completion, in index order,
        and the first sample's error if any has one: what ``LLMEngine.abort_request`` returns."""
        completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(self.latest) if o is not None]
        error = next((o.error for o in self.latest if o is not None and o.error), None)
        return dataclasses.replace(base, outputs=completions, error=error)


class ParentRequests:
    """Every unfinished parent, and which parent each child belongs to."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self.child_of: dict[str, tuple[ParentRequest, int]] = {}

    def __contains__(self, request_id: str) -> bool:
        """A parent's id, or a child's while its parent is unfinished (the child may be done:
        a new request under its id would be merged into the parent)."""
        return request_id in self.parents or request_id in self.child_of

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for i, cid in enumerate(parent.child_ids):
            self.child_of[cid] = (parent, i)

    def merge(self, outputs: list[RequestOutput], undo: UndoLog | None) -> list[RequestOutput]:
        """Children's outputs -> their parents' (others pass through); a parent whose last
        child finished is forgotten."""
        if not self.child_of:
            return outputs
        merged = []
        for out in outputs:
            link = self.child_of.get(out.request_id)
            if link is None:
                merged.append(out)
                continue
            parent, index = link
            result = parent.absorb(index, out, undo)
            if result is not None:
                merged.append(result)
                if result.finished:
                    self._forget(parent, undo)
        return merged

    def _forget(self, parent: ParentRequest, undo: UndoLog | None) -> None:
        if undo is not None:  # recorded first: add() puts back whatever was already removed
            undo.add(self.add, parent)
        del self.parents[parent.request_id]
        for cid in parent.child_ids:
            del self.child_of[cid]
