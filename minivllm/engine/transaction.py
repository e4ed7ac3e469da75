"""One ``LLMEngine.step()`` as a transaction: applied whole, or rolled back whole.

A step mutates the scheduler's queues, the block manager (allocations, preemptions,
prefix-cache registrations, frees), the sequences (computed counts, tokens, metrics),
the request states (text, stream cursors) and random generators. An exception can
arrive at any point of it (a bug, bad numerics, a learner pressing "interrupt kernel").
So that no request is lost or corrupted, the step runs inside a ``StepTransaction``:

* the block manager and scheduler record the inverse of each queue / pool mutation in
  an ``UndoLog``;
* the fields of every sequence the step can touch (running ones, and the waiting ones
  it could admit), of each request state before ``OutputProcessor.process`` changes it, and the states of
  the random generators that will draw, are snapshotted before they change;
* on an exception, ``rollback()`` undoes all of it, newest first. The KV cache itself
  is not restored (too large): the step only wrote slots past each sequence's computed
  tokens, which are recomputed, and into blocks it took from the free list; a cached
  block it evicted may have been overwritten, so it comes back as a plain free block.

The result: after any exception, the engine is exactly where it was before the step
(up to those evicted prefix-cache entries), and stepping again produces the same tokens.
"""
from __future__ import annotations

from itertools import chain, islice

import torch

from minivllm.engine.output_processor import OutputProcessor, RequestState, restore_state, snapshot_state
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.engine.undo import UndoLog


def _snapshot_sequence(seq: Sequence) -> tuple:
    # Lists are grown in place (append) or replaced (admit/release): the old list object
    # and its length are enough to restore them. Logprob lists are None unless asked for.
    # Taken for every running sequence every step: plain attribute reads, no helpers.
    metrics = seq.metrics
    logprobs, prompt_logprobs = seq.logprobs, seq.prompt_logprobs
    return (seq, seq.__dict__.copy(), len(seq.token_ids), len(seq.block_table), len(seq.block_hashes),
            len(seq.block_refs), metrics.__dict__.copy(), len(metrics.token_times),
            None if logprobs is None else len(logprobs), None if prompt_logprobs is None else len(prompt_logprobs))


def _restore_sequence(snapshot: tuple) -> None:
    seq, fields, n_tokens, n_table, n_hashes, n_refs, metrics, n_times, n_logprobs, n_prompt_logprobs = snapshot
    seq.__dict__.update(fields)
    del seq.token_ids[n_tokens:]
    del seq.block_table[n_table:]
    del seq.block_hashes[n_hashes:]
    del seq.block_refs[n_refs:]
    if n_logprobs is not None:
        del seq.logprobs[n_logprobs:]
    if n_prompt_logprobs is not None:
        del seq.prompt_logprobs[n_prompt_logprobs:]
    seq.metrics.__dict__.update(metrics)
    del seq.metrics.token_times[n_times:]


class StepTransaction:
    """Snapshots and undo records of one step; see the module docstring.

    Use as a context manager around the step: ``with StepTransaction(...) as txn:``, calling
    ``txn.protect(plan)`` once the plan is known, right before the forward pass. Leaving the
    block normally commits; leaving it by an exception rolls back (and re-raises).
    """

    def __init__(self, scheduler: Scheduler, output_processor: OutputProcessor,
                 engine_generator: torch.Generator | None = None, only: Sequence | None = None):
        """``only``: an operation on one request outside a step (an abort): snapshot just it
        (and the waiting queue, from which it may be removed)."""
        self.scheduler, self.output_processor = scheduler, output_processor
        self.engine_generator = engine_generator
        self.undo = UndoLog()
        bm = scheduler.block_manager
        bm.undo = scheduler.undo = output_processor.undo = self.undo
        bm.evicted = []
        self.running = list(scheduler.running)
        self.waiting = None
        if only is not None:
            self.waiting = list(scheduler.waiting)
            self.seqs = [_snapshot_sequence(only)]
        else:
            # Admission takes at most max_num_seqs - len(running) sequences from the queue's front.
            admissible = max(0, scheduler.config.max_num_seqs - len(scheduler.running))
            self.seqs = list(map(_snapshot_sequence, chain(scheduler.running, islice(scheduler.waiting, admissible))))
        self.states: list[tuple] = []
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []
        self.kv_written = False

    def protect_state(self, state: RequestState) -> None:
        """Snapshot one request state (an abort changes it outside ``OutputProcessor.process``,
        which snapshots what it changes itself)."""
        self.states.append(snapshot_state(state))

    def protect(self, plan: SchedulerOutput) -> None:
        """Snapshot the random generators the step's sampling will advance (request states are
        snapshotted by ``OutputProcessor.process`` before it changes them). From here on the
        KV cache may be written (see ``rollback``)."""
        self.kv_written = True
        unseeded = False
        for entry in plan.scheduled:
            if not entry.samples:
                continue
            seq = entry.seq
            if seq.generator is not None:
                self.generators.append((seq.generator, seq.generator.get_state()))
            elif seq.params.temperature > 0 and seq.params.seed is None:
                unseeded = True
        if unseeded and self.engine_generator is not None:
            self.generators.append((self.engine_generator, self.engine_generator.get_state()))

    def __enter__(self) -> "StepTransaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
        else:
            self.rollback()
        return False  # re-raise

    def commit(self) -> None:
        self._detach()

    def rollback(self) -> None:
        self.undo.rollback()
        self.scheduler.running[:] = self.running
        if self.waiting is not None:
            self.scheduler.waiting.clear()
            self.scheduler.waiting.extend(self.waiting)
        for snapshot in self.seqs:
            _restore_sequence(snapshot)
        for snapshot in self.states:
            restore_state(snapshot)
        for generator, state in self.generators:
            generator.set_state(state)
        if self.kv_written:
            self.scheduler.block_manager.forget_evicted()
        self._detach()

    def _detach(self) -> None:
        bm = self.scheduler.block_manager
        bm.undo = self.scheduler.undo = self.output_processor.undo = None
        bm.evicted = []
