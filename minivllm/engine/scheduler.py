"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running sequences go
first, oldest first: decodes (one token each), then prompts still being prefilled.
Waiting requests are then admitted while the budget, ``max_num_seqs`` and the KV
pool allow; with chunked prefill a prompt that does not fit the remaining budget is
split, so a long prompt shares steps with other requests' decodes instead of
stalling them. When a running sequence needs a block and none is free, the most
recently admitted running sequence is preempted: its blocks are released and it
goes back to the front of the queue, to be recomputed (prompt + output so far)
when there is room again.

After the forward pass, ``update_from_output`` applies the step: computed-token
counts, newly completed prefix blocks, the sampled tokens, and the stop checks that
need no text (stop token ids, eos, length), freeing finished sequences' blocks.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

from typing import Callable, NamedTuple

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.undo import UndoLog


@dataclass
class SchedulerConfig:
    """Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest sequence (prompt + output) in tokens; reaching it ends a request.
        enable_chunked_prefill: split prompts that do not fit the remaining budget.
        eos_token_ids: token ids that end a request unless ``ignore_eos``.
        eos_token_id: the tokenizer's eos (None: it has none). It finishes a request with
            ``stop_reason`` None; the other ``eos_token_ids`` (a generation config's extra ones) with
            the id, as vLLM's ``SamplingParams.update_from_generation_config`` makes them stop tokens.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    #: Speculative decoding: ``propose([(seq, max_tokens), ...]) -> [Proposal, ...]`` for the
    #: decoding sequences, once per step (None: no speculation). See ``minivllm/spec_decode``.
    propose: Callable[[list[tuple[Sequence, int]]], list] | None = None
    eos_token_id: int | None = None


class ScheduledSequence(NamedTuple):
    """One sequence's work this step: tokens ``start_pos .. start_pos + num_tokens - 1``.

    A named tuple: one is built per scheduled sequence every step, and the decode loop of
    ``Scheduler.schedule`` builds it in C (``_new_decode``)."""

    seq: Sequence
    num_tokens: int
    start_pos: int
    is_prefill: bool
    #: True when this step computes the sequence's last known token, so a new one is
    #: sampled (fixed at planning time: the sequence grows after the step).
    samples: bool
    #: Speculative decoding: draft tokens scored after the last known token (a decode then
    #: has ``1 + len(draft_token_ids)`` tokens and samples at each of them). An empty tuple
    #: when there are none.
    draft_token_ids: list[int] | tuple = ()
    #: The distributions the drafts were drawn from (fp32 ``[len(drafts), vocab]``), or None
    #: for deterministic drafts; see ``minivllm/spec_decode/proposal.py``.
    draft_probs: object = None


@dataclass
class SchedulerOutput:
    """The plan for one step (decodes first, then prefill chunks)."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache_hit_tokens: int = 0
    #: Set by ``Scheduler.schedule``: the decode entries (the first ones) and their draft
    #: tokens, so the step's counts cost no pass over a large batch; None: count.
    num_decodes: int | None = None
    num_draft_tokens: int | None = None
    #: Set by ``Scheduler.schedule``: no live request samples other than by plain argmax
    #: (``SamplingParams.plain_greedy``), so the sampler needs no per-row settings.
    all_plain_greedy: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        if self.num_decodes is not None:
            return sum(s.num_tokens for s in self.scheduled[self.num_decodes:])
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        if self.num_decodes is not None and self.num_draft_tokens is not None:
            return self.num_decodes + self.num_draft_tokens
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def all_plain_decodes(self) -> bool:
        """Every entry is one decode token without drafts (the runner's vectorised path)."""
        return self.num_decodes == len(self.scheduled) and self.num_draft_tokens == 0


#: ``ScheduledSequence`` from a 7-tuple, without the Python-level ``__new__`` (the decode loop).
_new_decode = partial(tuple.__new__, ScheduledSequence)


class Scheduler:
    """Owns the waiting queue and the running list; decides every step's batch."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        #: Set by the engine during a step; the running list is snapshotted whole instead.
        self.undo: UndoLog | None = None
        #: The live sequences whose sampling may draw random numbers or owns a generator
        #: (``SamplingParams.draws_random``; a request's params are its own copy): while there are
        #: none, a step saves no generator state without looking at its entries
        #: (``StepTransaction.protect``). Conservative: a sequence may outlive its finish here
        #: (an interrupted ``finish``), never the other way round.
        self.random_seqs: set[Sequence] = set()
        #: Likewise, the live sequences that do not sample by plain argmax
        #: (``SamplingParams.plain_greedy``): while there are none, a step's sampler builds no
        #: per-row settings (``SchedulerOutput.all_plain_greedy``).
        self.non_greedy_seqs: set[Sequence] = set()
        #: Set by the engine (``OutputProcessor.stop_string_cut``): how many of a speculative step's
        #: tokens to append to a sequence with stop strings, up to the one whose text completes one.
        self.stop_string_cut: Callable[[Sequence, list[int]], int] | None = None

    # -- queue management ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq``, fixing its stop rule (the stops that need no text) for ``_append``:
        the token ids that end it (its ``stop_token_ids``, and the eos ids unless
        ``ignore_eos``) and the length at which it ends (its prompt plus ``max_tokens``, at most
        ``max_model_len``)."""
        p = seq.params
        eos = frozenset() if p.ignore_eos else frozenset(self.config.eos_token_ids)
        seq.stop_ids = frozenset(p.stop_token_ids or ()) | eos
        max_len = self.config.max_model_len
        seq.max_len = max_len if p.max_tokens is None else min(max_len, seq.num_prompt_tokens + p.max_tokens)
        if p.draws_random:
            self.random_seqs.add(seq)
        if not p.plain_greedy:
            self.non_greedy_seqs.add(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End ``seq`` (from either queue) and release its blocks."""
        if self.undo is not None:
            self.undo.touch(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:  # an abort
            if self.undo is not None:
                self.undo.save_contents(self.waiting)
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.release(seq)
        for listed in (self.random_seqs, self.non_greedy_seqs):
            if seq in listed:
                if self.undo is not None:
                    self.undo.add(listed.add, seq)
                listed.discard(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finished_time = time.perf_counter()

    # -- the step plan -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's plan (the module docstring's rules): the running sequences' decodes first,
        then their unfinished prefills, then admitted waiting requests, within the token budget,
        ``max_num_seqs`` and the KV pool. Grows block tables (and may preempt the most recently
        admitted running sequences, by recompute, to do so); the step's transaction undoes it all
        if the step fails. Returns a ``SchedulerOutput`` (``scheduled``: decodes, then prefill
        chunks; ``preempted``)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        block_size = bm.block_size
        propose = self.config.propose
        running_status = SequenceStatus.RUNNING
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        num_drafts = 0

        # 1. Running sequences, oldest first: decodes, then unfinished prefills (deferred to
        # a second pass). One pass over a copy: preemption removes from self.running.
        deferred: list[Sequence] = []
        # One proposer call for all decoding sequences (a draft model runs them as one batch).
        proposals = self._propose([s for s in self.running if not s.is_prefilling], budget) if propose else {}
        # Drafts never take blocks that a running sequence planned later in this loop needs for its own
        # next token (or the rest of its prompt): a request never preempts another for room to speculate.
        reserve, reserved = self._blocks_reserved() if proposals else ({}, 0)
        for seqs in (list(self.running), deferred):
            first_pass = seqs is not deferred
            for seq in seqs:
                if seq.status is not running_status:
                    continue  # preempted earlier in this loop
                computed = seq.num_computed_tokens
                if not proposals and computed >= seq.prefill_target:  # a plain decode: the usual case
                    if budget == 0:
                        break
                    total = computed + 1
                    if total > len(seq.block_table) * block_size:  # needs a new block
                        budget += self._grow_or_preempt(seq, total, decodes, prefills, out)
                        if seq.status is not running_status:
                            continue
                    decodes.append(_new_decode((seq, 1, computed, False, total == len(seq.token_ids), (), None)))
                    budget -= 1
                    continue
                prefilling = computed < seq.prefill_target
                if prefilling and first_pass:
                    deferred.append(seq)
                    continue
                reserved -= reserve.pop(seq, 0)  # its own blocks are planned now
                if budget == 0:
                    break
                n = min(seq.prefill_target - computed, budget) if prefilling else 1
                drafts, draft_probs = (), None
                proposal = proposals.get(seq) if proposals and not prefilling else None
                if proposal is not None and proposal.token_ids:  # as many as this step's budget still allows
                    proposal = proposal.truncated(self._draft_room(seq, budget))
                    drafts, draft_probs = proposal.token_ids, proposal.probs
                    if not drafts:  # cut to none: keep no view of the proposal's probabilities
                        drafts, draft_probs = (), None
                if drafts:
                    if bm.num_blocks_needed(seq, computed + 1 + len(drafts)) + reserved <= bm.num_free_blocks:
                        n += len(drafts)
                        num_drafts += len(drafts)
                    else:  # no room to speculate: a plain decode, never a preemption for drafts
                        drafts, draft_probs = (), None
                total = computed + n
                if total > len(seq.block_table) * block_size:  # needs a new block
                    victims = len(out.preempted)
                    budget += self._grow_or_preempt(seq, total, decodes, prefills, out)
                    for victim in out.preempted[victims:]:  # a victim needs no blocks this step
                        reserved -= reserve.pop(victim, 0)
                    if seq.status is not running_status:
                        continue
                entry = ScheduledSequence(seq, n, computed, prefilling, total == len(seq.token_ids) + len(drafts),
                                          drafts, draft_probs)
                (prefills if prefilling else decodes).append(entry)
                budget -= n
            if budget == 0:
                break

        # 2. Admit waiting requests (not in a step that had to preempt).
        if out.preempted:  # a victim's drafts no longer count
            num_drafts = sum(len(e.draft_token_ids) for e in decodes)
        elif self.waiting:
            budget = self._admit(budget, prefills, out)
        out.scheduled = decodes + prefills if prefills else decodes
        out.num_decodes, out.num_draft_tokens = len(decodes), num_drafts
        out.all_plain_greedy = not self.non_greedy_seqs
        return out

    def _blocks_reserved(self) -> tuple[dict, int]:
        """For a step with drafts: each running sequence's new blocks for its plain next token (a
        decode) or its next chunk (a prefill: the rest of its prompt, at most a step's token budget,
        the most its chunk can take), and their sum."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        reserve = {}
        for seq in self.running:
            computed = seq.num_computed_tokens
            target = min(seq.prefill_target, computed + budget) if computed < seq.prefill_target else computed + 1
            need = bm.num_blocks_needed(seq, target)
            if need:
                reserve[seq] = need
        return reserve, sum(reserve.values())

    def _grow_or_preempt(self, seq: Sequence, total: int, decodes: list[ScheduledSequence],
                         prefills: list[ScheduledSequence], out: SchedulerOutput) -> int:
        """Give ``seq`` the blocks for ``total`` tokens, preempting the most recently admitted
        running sequences while the pool is short (``seq`` itself last: then it is no longer
        RUNNING and gets nothing). Returns the budget given back by unplanning victims."""
        bm, refund = self.block_manager, 0
        while not bm.can_grow(seq, total):
            victim = self.running[-1]  # most recently admitted
            refund += self._preempt(victim, decodes, prefills, out)
            if victim is seq:
                return refund
        bm.grow(seq, total)
        return refund

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """Most drafts a decoding sequence may get: what the budget, ``max_tokens`` and
        ``max_model_len`` leave room for (a step with d drafts can emit d + 1 tokens)."""
        max_tokens = seq.params.max_tokens if seq.params.max_tokens is not None else self.config.max_model_len
        return min(budget, max_tokens - seq.num_output_tokens, self.config.max_model_len - len(seq)) - 1

    def _propose(self, order: list[Sequence], budget: int) -> dict:
        """One proposer call for every decoding sequence (a draft model runs them as one batch),
        each with the room the whole budget would leave; the loop then cuts each proposal to
        the budget left when its sequence's turn comes. Returns sequence -> ``Proposal``."""
        requests = [(s, room) for s in order if not s.is_prefilling and (room := self._draft_room(s, budget)) > 0]
        if not requests:
            return {}
        return {seq: p for (seq, _), p in zip(requests, self.config.propose(requests))}

    def _admit(self, budget: int, prefills: list[ScheduledSequence], out: SchedulerOutput) -> int:
        """Admit waiting sequences in arrival order while the budget, the seats and the free KV
        blocks allow (the first that does not fit stops admission: first come, first served). A
        sibling sample (``n > 1``) whose leader has not finished its prompt is passed over, not
        waited for: it joins once the leader's blocks can be hit, and the requests behind it need
        not wait for that (waiting for it held every later prompt to one admission per step)."""
        bm = self.block_manager
        i = 0  # position in the waiting queue: the held siblings before it stay where they are
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            # A request wanting prompt logprobs computes every prompt position (as in vLLM v1).
            wants_prompt = seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens
            leader = seq.prefix_leader
            if (leader is not None and bm.enable_prefix_caching and not wants_prompt and not leader.is_finished
                    and leader.num_output_tokens == 0):
                i += 1  # a sibling sample waits for its leader's prompt blocks (one prefill, shared)
                continue
            hit_ids, hit_hashes = ([], []) if wants_prompt else bm.match_prefix(seq)
            cached = len(hit_ids) * bm.block_size
            remaining = len(seq) - cached
            if remaining <= budget:
                n = remaining
            elif self.config.enable_chunked_prefill:
                n = budget
            else:
                break  # without chunking a prompt is scheduled whole
            if bm.num_blocks_to_admit(hit_ids, cached + n) > bm.num_free_blocks:
                break
            if self.undo is not None:
                self.undo.save_contents(self.waiting)
                self.undo.touch(seq)
            del self.waiting[i]
            bm.admit(seq, hit_ids, hit_hashes)
            bm.grow(seq, cached + n)
            first_time = seq.metrics.first_scheduled_time is None
            if first_time:
                seq.metrics.first_scheduled_time = time.perf_counter()
                seq.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            seq.prefill_target = len(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledSequence(seq, n, cached, True, cached + n == len(seq)))
            out.prefix_cache_hit_tokens += cached
            budget -= n
        return budget

    def _preempt(self, victim: Sequence, decodes: list[ScheduledSequence], prefills: list[ScheduledSequence],
                 out: SchedulerOutput) -> int:
        """Recompute preemption of ``victim``; returns budget given back by unplanning it."""
        refund = 0
        for planned in (decodes, prefills):  # rare: a scan is fine
            for i, entry in enumerate(planned):
                if entry.seq is victim:
                    refund = entry.num_tokens
                    del planned[i]
                    break
        self.requeue(victim)
        out.preempted.append(victim)
        return refund

    def requeue(self, victim: Sequence) -> None:
        """Release a running ``victim``'s blocks and put it first in the waiting queue, to be
        computed again from its first token (recompute preemption)."""
        if self.undo is not None:
            self.undo.touch(victim)
        self.running.remove(victim)
        self.block_manager.release(victim)
        victim.metrics.num_preemptions += 1  # (a step's rollback restores the metrics with the rest)
        victim.num_computed_tokens = 0
        victim.prefill_target = 0
        victim.status = SequenceStatus.WAITING
        if self.undo is not None:
            self.undo.save_contents(self.waiting)
        self.waiting.appendleft(victim)

    # -- after the forward pass ----------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, seqs: list[Sequence], token_ids: list[int],
                           failed: set[Sequence] = frozenset(), logprobs: list | None = None,
                           prompt_logprobs: dict | None = None,
                           more_token_ids: dict[Sequence, list[int]] | None = None) -> list[Sequence]:
        """Apply a finished forward pass; returns the sequences that finished.

        Args:
            plan: the step's plan (every entry's KV is now computed).
            seqs / token_ids: the sequences that sampled and their (first) new token, in order.
            failed: sampling sequences with no token to sample (their logits were not finite, or
                their parameters masked every token): they get no token, none
                of their blocks are registered for the prefix cache, and they finish with
                finish_reason "error".
            logprobs: aligned with ``seqs``: the new token's ``(ids, logprobs, ranks)`` entry
                (``ModelRunner``'s), or None where not wanted; None when nobody wants them.
            prompt_logprobs: sequence -> (first prompt position, entries) computed this step;
                a position already recorded (a preempted prompt computed again) is skipped.
            more_token_ids: speculative decoding: the tokens a sequence emits after its first
                (its accepted drafts' successors, see ``minivllm/spec_decode/verify.py``).
                Its KV is then valid up to the last of them, excluded (rejected drafts'
                slots are simply overwritten later), and only those blocks are registered.
        """
        bm = self.block_manager
        caching, block_size = bm.enable_prefix_caching, bm.block_size
        undo = self.undo
        if undo is not None:
            # The usual changes (computed counts, one token and its time) are undone from the
            # plan; whatever else changes a sequence snapshots it first (undo.touch).
            undo.add(_unapply_tokens, plan.scheduled)
            if plan.num_draft_tokens != 0:
                for entry in plan.scheduled:
                    if entry.draft_token_ids:
                        undo.touch(entry.seq)
            if logprobs is not None:
                for seq, entry in zip(seqs, logprobs):
                    if entry is not None:
                        undo.touch(seq)
            for seq in prompt_logprobs or ():
                undo.touch(seq)
        if plan.all_plain_decodes and len(seqs) == len(plan.scheduled) and not (
                failed or logprobs is not None or prompt_logprobs or more_token_ids):
            return self._apply_plain_decodes(plan.scheduled, token_ids)
        for entry in plan.scheduled:
            seq = entry.seq
            if entry.draft_token_ids:
                continue  # its valid KV is known once its tokens are appended (below)
            computed = seq.num_computed_tokens = seq.num_computed_tokens + entry.num_tokens
            if caching and computed // block_size > len(seq.block_hashes) and seq not in failed:
                bm.register_computed_blocks(seq)  # a block was completed this step
        if prompt_logprobs:
            for seq, (first, entries) in prompt_logprobs.items():
                recorded = seq.prompt_logprobs
                recorded.extend(entries[len(recorded) - first:] if len(recorded) >= first else ())
        finished = []
        now = time.perf_counter()
        more_token_ids = more_token_ids or {}
        append = self._append
        if not (failed or logprobs is not None or more_token_ids):  # the usual step: tokens only
            for seq, token in zip(seqs, token_ids):
                if append(seq, token, now):
                    finished.append(seq)
        else:
            for i, (seq, token) in enumerate(zip(seqs, token_ids)):
                if seq in failed:
                    self.finish(seq, "error")
                    finished.append(seq)
                    continue
                more = more_token_ids.get(seq)
                if more and self.stop_string_cut is not None and seq.params.stop_strings:
                    # the accepted drafts after a token whose text completes a stop string are not
                    # the request's: one token a step, it would have ended there (the step's counts of
                    # accepted drafts, its metrics and its record, count the kept ones)
                    more = more_token_ids[seq] = more[:self.stop_string_cut(seq, [token, *more]) - 1]
                if append(seq, token, now, logprobs[i] if logprobs is not None else None):
                    finished.append(seq)
                    if more:  # a stop token, an eos or the length ended it: its drafts are not kept
                        more_token_ids[seq] = []
                elif more is not None:
                    for j, t in enumerate(more):
                        if append(seq, t, now):
                            finished.append(seq)
                            more_token_ids[seq] = more[:j + 1]  # count the kept drafts, as for stop strings
                            break
        for entry in plan.scheduled:
            if entry.draft_token_ids:
                self._apply_verified(entry, more_token_ids.get(entry.seq))
        return finished

    def _apply_plain_decodes(self, scheduled: list[ScheduledSequence], token_ids: list[int]) -> list[Sequence]:
        """``update_from_output`` for a step of plain decodes, every entry one token that
        sampled ``token_ids[i]``: the same changes in one pass, ``_append`` inlined (this runs
        for every sequence every step). Returns the sequences that finished."""
        bm = self.block_manager
        caching, block_size, register = bm.enable_prefix_caching, bm.block_size, bm.register_computed_blocks
        now, finished = time.perf_counter(), []
        for entry, token in zip(scheduled, token_ids):
            seq = entry.seq
            computed = seq.num_computed_tokens = entry.start_pos + 1
            if caching and computed // block_size > len(seq.block_hashes):
                register(seq)  # a block was completed this step
            tokens = seq.token_ids
            tokens.append(token)
            metrics = seq.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.token_times.append(now)
            if token in seq.stop_ids or len(tokens) >= seq.max_len:
                self._stop(seq, token)
                finished.append(seq)
        return finished

    def _append(self, seq: Sequence, token: int, now: float, logprob_entry=None) -> bool:
        """Append one sampled token (and its logprobs entry, when wanted) and apply the stops
        that need no text; True if it finished."""
        # Sequence.append_token, inlined (this runs for every sequence every step)
        token_ids = seq.token_ids
        token_ids.append(token)
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.append(now)
        if logprob_entry is not None:
            seq.logprobs.append(logprob_entry)
            seq.cumulative_logprob += logprob_entry[1][0]  # the sampled token's own comes first
        if token in seq.stop_ids or len(token_ids) >= seq.max_len:
            self._stop(seq, token)
            return True
        return False

    def _stop(self, seq: Sequence, token: int) -> None:
        """Finish ``seq``, which met its stop rule (see ``add``) with ``token``: an eos unless
        ``ignore_eos`` (reason "stop", stop_reason None, or the id for an eos other than the
        tokenizer's; checked first, as vLLM does, so an eos also listed in ``stop_token_ids`` reads
        as an eos), another stop token ("stop", the token), or its length."""
        params = seq.params
        if not params.ignore_eos and token in self.config.eos_token_ids:
            self.finish(seq, "stop", None if token == self.config.eos_token_id else token)
        elif params.stop_token_ids and token in params.stop_token_ids:
            self.finish(seq, "stop", token)
        else:
            self.finish(seq, "length")

    def _apply_verified(self, entry: ScheduledSequence, more: list[int] | None) -> None:
        """A speculative decode: count the drafts and the accepted ones, and mark KV valid
        for every token but the newest (the last draft slot may hold a rejected draft's KV)."""
        seq = entry.seq
        accepted = len(more) if more is not None else 0
        seq.metrics.num_draft_tokens += len(entry.draft_token_ids)
        seq.metrics.num_accepted_draft_tokens += accepted
        seq.metrics.num_spec_steps += 1
        if seq.is_finished:
            return
        seq.num_computed_tokens = len(seq) - 1
        bm = self.block_manager
        if bm.enable_prefix_caching and seq.num_computed_tokens // bm.block_size > len(seq.block_hashes):
            bm.register_computed_blocks(seq)


def _unapply_tokens(scheduled: list[ScheduledSequence]) -> None:
    """Undo what ``update_from_output`` does to every entry without drafts (its computed count,
    the token it sampled and that token's time) from the plan alone: set, not subtract, so it
    is right wherever the update was interrupted. Entries with drafts, and any other change,
    are restored from snapshots (``UndoLog.touch``)."""
    for entry in scheduled:
        if entry.draft_token_ids:
            continue
        seq = entry.seq
        seq.num_computed_tokens = entry.start_pos
        if entry.samples:
            length = entry.start_pos + entry.num_tokens  # its tokens when the step was planned
            if len(seq.token_ids) > length:
                del seq.token_ids[length:]
                metrics = seq.metrics
                num_out = length - len(seq.prompt_token_ids)
                del metrics.token_times[num_out:]  # one time per output token
                if num_out == 0:
                    metrics.first_token_time = None
