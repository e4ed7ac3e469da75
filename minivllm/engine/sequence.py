"""A request as the engine tracks it: its tokens, its KV blocks, its progress."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to be recomputed)
    RUNNING = "running"      # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's token sequence (prompt + generated) and its place in the KV pool.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. A sequence is
    *prefilling* while ``num_computed_tokens < prefill_target`` (the prompt, or after a
    recompute preemption the prompt plus everything generated so far), and *decoding*
    afterwards, one token per step.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    prefill_target: int = 0
    num_cached_tokens: int = 0           # prompt tokens served by the prefix cache (first admission)
    block_table: list[int] = field(default_factory=list)
    # A new number (process-wide, from the block manager) each time block_table changes (admitted,
    # grown, released); a rollback restores it with the table. Equal versions mean equal tables,
    # so the decode graphs' staging writes a row's table only when its version changed.
    table_version: int = 0
    # Hash of each full block in block_table whose KV is computed (the prefix chain) and the
    # (block id, generation) of the registered block holding that content, or None when it
    # could not be linked (see BlockManager.register_computed_blocks).
    block_hashes: list = field(default_factory=list)
    block_refs: list = field(default_factory=list)
    #: The prompt's ``cache_salt`` (vLLM's): its prefix blocks are shared only with requests of the same salt.
    cache_salt: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: object = None             # torch.Generator for a seeded request (made by the runner)
    metrics: RequestMetrics = field(init=False)
    # Set once by the engine when the request is added (see minivllm/layers/logits_processors.py):
    bad_words_token_ids: list = field(default_factory=list)   # each bad word's token ids
    min_tokens_stop_ids: list = field(default_factory=list)   # ids masked before min_tokens
    # With SamplingParams.logprobs / prompt_logprobs: grown by append, one entry per output /
    # prompt token, each (token ids, logprobs, ranks) of that position (see Scheduler.update_from_output).
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None
    #: For samples 1..n-1 of a request with n > 1: sample 0, whose prompt blocks they reuse
    #: through the prefix cache (admitted once it has sampled; see Scheduler._admit).
    prefix_leader: "Sequence | None" = None
    #: The stops that need no text, set by ``Scheduler.add``: the token ids that end the request
    #: and its length (tokens) at which it ends.
    stop_ids: frozenset = frozenset()
    max_len: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no distribution

    # -- sizes ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)


def snapshot_sequence(seq: Sequence) -> tuple:
    """What ``restore_sequence`` needs to put ``seq`` back as it is now (a step's rollback).

    Lists are grown in place (append) or replaced (admit/release): the old list object and
    its length are enough to restore them. Logprob lists are None unless asked for.
    """
    metrics = seq.metrics
    logprobs, prompt_logprobs = seq.logprobs, seq.prompt_logprobs
    return (seq, seq.__dict__.copy(), len(seq.token_ids), len(seq.block_table), len(seq.block_hashes),
            len(seq.block_refs), metrics.__dict__.copy(), len(metrics.token_times),
            None if logprobs is None else len(logprobs), None if prompt_logprobs is None else len(prompt_logprobs))


def restore_sequence(snapshot: tuple) -> None:
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
