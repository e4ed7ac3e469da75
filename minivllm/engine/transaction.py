"""One ``LLMEngine.step()`` as a transaction: applied whole, or rolled back whole.

A step mutates the scheduler's queues, the block manager (allocations, preemptions,
prefix-cache registrations, frees), the sequences (computed counts, tokens, metrics),
the request states (text, stream cursors) and random generators. An exception can
arrive at any point of it (a bug, bad numerics, a learner pressing "interrupt kernel").
So that no request is lost or corrupted, the step runs inside a ``StepTransaction``:

* the block manager, scheduler and output processor record the inverse of each queue,
  pool and sequence mutation in an ``UndoLog``: a sequence is snapshotted whole right
  before the step first changes it (admission, a new block, a preemption, a finish, a
  prefix-cache registration, logprobs, drafts), while the one change every decode makes
  (its computed count, one token and its time) is undone from the step's plan, so a
  decode step of a large batch copies nothing per sequence;
* each request state is snapshotted before ``OutputProcessor.process`` changes it, and
  the states of the random generators that will draw before the forward pass;
* on an exception, ``rollback()`` undoes all of it, newest first. The KV cache itself
  is not restored (too large): the step only wrote slots past each sequence's computed
  tokens, which are recomputed, and into blocks it took from the free list; a cached
  block it evicted may have been overwritten, so it comes back as a plain free block,
  and a sequence the step preempted whose freed block another sequence took (and may
  have written) stays preempted, to be recomputed from its first token.

The result: after any exception, the engine is where it was before the step (up to those
evicted prefix-cache entries and preemptions), and stepping again produces the same tokens
(a recomputed sequence's, as after any recompute preemption).
"""
from __future__ import annotations

from operator import attrgetter

import torch

from minivllm.engine.output_processor import OutputProcessor, RequestState, restore_state, snapshot_state
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.engine.undo import UndoLog

_DRAWS_RANDOM = attrgetter("seq.params.draws_random")


class StepTransaction:
    """Snapshots and undo records of one step; see the module docstring.

    Use as a context manager around the step: ``with StepTransaction(...) as txn:``, calling
    ``txn.protect(plan)`` once the plan is known, right before the forward pass. Leaving the
    block normally commits; leaving it by an exception rolls back (and re-raises).
    """

    def __init__(self, scheduler: Scheduler, output_processor: OutputProcessor,
                 engine_generator: torch.Generator | None = None, only: Sequence | list[Sequence] | None = None):
        """``only``: an operation on some requests outside a step (an abort: one request, or the
        samples of an ``n > 1`` one together): snapshot just them (the waiting queue, from which they
        may be removed, is saved by ``Scheduler.finish``)."""
        self.scheduler, self.output_processor = scheduler, output_processor
        self.engine_generator = engine_generator
        self.undo = UndoLog()
        self.running = list(scheduler.running)
        for seq in [only] if isinstance(only, Sequence) else only or ():
            self.undo.touch(seq)
        self.states: list[tuple] = []
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []
        self.kv_written = False
        self.preempted: list[Sequence] = []
        # Attached last: an interrupt in the snapshots above (an abort of many samples) leaves no log
        # attached that no transaction will detach.
        bm = scheduler.block_manager
        bm.evicted, bm.taken = [], []
        bm.undo = scheduler.undo = output_processor.undo = self.undo

    def protect_state(self, state: RequestState) -> None:
        """Snapshot one request state (an abort changes it outside ``OutputProcessor.process``,
        which snapshots what it changes itself)."""
        self.states.append(snapshot_state(state))

    def protect(self, plan: SchedulerOutput) -> None:
        """Snapshot the random generators the step's sampling may advance (request states are
        snapshotted by ``OutputProcessor.process`` before it changes them). From here on the
        KV cache may be written (see ``rollback``).

        The engine-wide generator is saved when a sampled row has a temperature above 0: the
        sampler then draws from it for every row without a generator of its own, greedy rows
        included. A seeded request's own generator is saved when it samples, or the request is
        snapshotted when the sampler is about to create it."""
        self.kv_written = True
        self.preempted = plan.preempted
        if not self.scheduler.random_seqs or not any(map(_DRAWS_RANDOM, plan.scheduled)):
            return  # every request greedy without a seed (the usual batch): nothing draws
        draws = False
        for entry in plan.scheduled:
            params = entry.seq.params
            if not entry.samples or (params.temperature == 0 and params.seed is None):
                continue  # greedy without a seed: draws nothing, owns no generator
            draws = draws or params.temperature > 0
            if params.seed is None:
                continue
            seq = entry.seq
            if seq.generator is not None:
                self.generators.append((seq.generator, seq.generator.get_state()))
            else:
                self.undo.touch(seq)  # the sampler creates its generator
        if draws and self.engine_generator is not None:
            self.generators.append((self.engine_generator, self.engine_generator.get_state()))

    def __enter__(self) -> "StepTransaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is not None:
                self._restore()
        finally:
            self._detach()  # also after an interrupt landing here: the log never stays attached
        return False  # re-raise

    def commit(self) -> None:
        self._detach()

    def rollback(self) -> None:
        try:
            self._restore()
        finally:
            self._detach()

    def _restore(self) -> None:
        self.undo.rollback()
        self.scheduler.running[:] = self.running
        for snapshot in self.states:
            restore_state(snapshot)
        for generator, state in self.generators:
            generator.set_state(state)
        if self.kv_written:
            self._requeue_overwritten()  # first: the blocks it releases join the free lists that
            self.scheduler.block_manager.forget_evicted()  # forget_evicted then unregisters

    def _requeue_overwritten(self) -> None:
        """A victim the rollback gave its blocks back to, one of which the step took for another
        sequence (whose forward may have written it), is preempted again: its KV there is not its own."""
        bm = self.scheduler.block_manager
        if not self.preempted or not bm.taken:
            return
        bm.undo = self.scheduler.undo = None  # the log is spent: this is not to be undone
        taken = set(bm.taken)
        for victim in self.preempted:  # in the step's order, so the waiting queue ends as the step left it
            if victim in self.scheduler.running and not taken.isdisjoint(victim.block_table):
                self.scheduler.requeue(victim)

    def _detach(self) -> None:
        bm = self.scheduler.block_manager
        bm.undo = self.scheduler.undo = self.output_processor.undo = None
        bm.evicted, bm.taken = [], []
