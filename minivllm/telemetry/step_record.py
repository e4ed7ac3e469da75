"""What one engine step did, measured: the unit the widgets and benchmarks draw from."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from operator import attrgetter
from typing import NamedTuple


class ScheduledEntry(NamedTuple):
    """One request's share of a step (immutable).

    A named tuple: immutable, and built in bulk in C (:func:`entries_of`: attribute getters,
    ``zip``, ``tuple.__new__``). ``StepRecord.to_dict`` gives each as a dict.

    Attributes:
        request_id: the request.
        num_tokens: tokens it contributed to the forward pass this step.
        is_prefill: True for a prefill chunk (prompt, or prompt + output being
            recomputed after a preemption), False for a decode token.
        first_position: absolute position of its first token this step.
        sampled: True when a token was sampled for it at the end of the step
            (a prefill chunk that does not reach the end of the prompt samples nothing).
    """

    request_id: str
    num_tokens: int
    is_prefill: bool
    first_position: int
    sampled: bool


_new_entry = partial(tuple.__new__, ScheduledEntry)  # in C, without the Python-level __new__
_ENTRY_FIELDS = tuple(map(attrgetter, ("seq.request_id", "num_tokens", "is_prefill", "start_pos", "samples")))


def entries_of(planned: list) -> list[ScheduledEntry]:
    """The ``ScheduledEntry`` of each of a plan's entries (``Scheduler.schedule``'s
    ``ScheduledSequence``), built in C: attribute getters, ``zip``, ``tuple.__new__``."""
    return list(map(_new_entry, zip(*(map(get, planned) for get in _ENTRY_FIELDS))))


class PlannedEntries(Sequence):
    """``StepRecord.scheduled`` of a step without draft tokens, built from the plan's entries
    on first read: the engine records every step, most records are never read entry by entry,
    and building a batch-256 step's entries took 140 us (best of 5 steps; embedded model, one
    thread, 2-core Xeon dev VM, 2026-12-06). Until then it holds the plan's
    entries (and so their sequences); after, only the built list. Reads, compares, copies and
    pickles as a list of ``ScheduledEntry``."""

    __slots__ = ("_planned", "_entries")

    def __init__(self, planned: list) -> None:
        self._planned, self._entries = planned, None

    def _list(self) -> list[ScheduledEntry]:
        if self._entries is None:
            self._entries, self._planned = entries_of(self._planned), None
        return self._entries

    def __len__(self) -> int:
        return len(self._planned) if self._entries is None else len(self._entries)

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return self._list() == (other._list() if isinstance(other, PlannedEntries) else other)

    __hash__ = None

    def __add__(self, other) -> list[ScheduledEntry]:
        return self._list() + list(other)

    def __radd__(self, other) -> list[ScheduledEntry]:
        return list(other) + self._list()

    def __repr__(self) -> str:
        return repr(self._list())

    def __copy__(self) -> list[ScheduledEntry]:
        return list(self._list())

    def __deepcopy__(self, memo) -> list[ScheduledEntry]:
        return list(self._list())  # the entries are tuples of immutable values

    def __reduce__(self):
        return list, (self._list(),)


@dataclass(slots=True)
class StepRecord:
    """Measured facts about one ``LLMEngine.step()``.

    Times are ``time.perf_counter`` seconds (``start_time``, ``end_time``) and
    milliseconds (``*_ms``). On CPU the model time is taken around a synchronous
    forward; on CUDA a step that samples waits for the device when it reads its tokens back, before
    ``end_time`` is read, so its ``wall_ms`` is real device time plus host overhead. A step that
    samples nothing (a prompt chunk before the prompt's last) is not synchronised, so that the host
    prepares the next step while its forward runs: part of its device time can land in the next
    step's record.

    Attributes:
        index: 0-based step number since the engine started.
        num_prefill_tokens / num_decode_tokens: tokens of each phase in the forward pass.
        num_seqs: sequences in the forward pass.
        num_prefill_chunks: prefill entries this step (a whole prompt counts as one chunk).
        scheduled: per-request entries, decodes first, then prefill chunks (a list, or for a
            step of plain decodes a ``PlannedEntries`` built when first read).
        preempted / finished: request ids preempted (recompute) or finished this step.
        kv_blocks_used / kv_blocks_free / kv_blocks_cached: block pool state after the
            step. ``free`` includes cached blocks that no request references (they are
            reusable); ``cached`` counts blocks holding a registered prefix hash.
        prefix_cache_hit_tokens: prompt tokens whose KV was reused from the prefix
            cache by requests admitted this step.
        attention_backend: name of the backend that ran the step.
        schedule_ms / prepare_ms / model_ms / sample_ms / postprocess_ms: where the
            time went (scheduling, building input tensors and metadata, the forward
            pass incl. logits, sampling, stop checks + detokenisation + outputs). On CUDA
            the forward is asynchronous: ``model_ms`` is the time to launch it (or replay its
            graph) and ``sample_ms`` includes waiting for the device to finish it.
        num_draft_tokens / num_accepted_draft_tokens: speculative decoding: draft tokens
            scored this step, and how many of them were accepted.
        flops / bytes_moved: the step's model FLOPs and bytes moved (counts for the whole step,
            from its shapes: ``minivllm.telemetry.roofline.fill_step_record``), set for every
            step that scheduled something (else None). mfu / mbu: the fractions (0..1, not percent) of the measured peak FLOP/s and
            read bandwidth they reached, set when the engine has peaks
            (``LLMEngine.measure_peaks``), else None.
    """

    index: int
    start_time: float
    end_time: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_prefill_chunks: int
    scheduled: list[ScheduledEntry] | PlannedEntries
    preempted: list[str]
    finished: list[str]
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_cache_hit_tokens: int
    attention_backend: str
    schedule_ms: float = 0.0
    prepare_ms: float = 0.0
    model_ms: float = 0.0
    sample_ms: float = 0.0
    postprocess_ms: float = 0.0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    flops: float | None = None
    bytes_moved: float | None = None
    mfu: float | None = None
    mbu: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def wall_ms(self) -> float:
        """Step wall time in milliseconds."""
        return (self.end_time - self.start_time) * 1e3

    @property
    def num_tokens(self) -> int:
        """Tokens the step ran: prefill plus decode."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def phase(self) -> str:
        """"prefill", "decode", "mixed" or "idle" (no tokens)."""
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        if self.num_prefill_tokens:
            return "prefill"
        if self.num_decode_tokens:
            return "decode"
        return "idle"

    def to_dict(self) -> dict:
        """Every field, the scheduled entries as dicts, and ``wall_ms`` and ``phase``: JSON-ready."""
        d = asdict(self)
        d["scheduled"] = [e._asdict() for e in self.scheduled]
        d["wall_ms"] = self.wall_ms
        d["phase"] = self.phase
        return d
