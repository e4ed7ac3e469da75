"""CUDA graphs for decode steps.

A decode step of a small model is dominated by kernel-launch overhead on the host (a
0.6B model launches several hundred small kernels per step). A CUDA graph records the
launches of one forward pass once and replays them with a single call, so a step costs
roughly its GPU time. A graph is recorded for fixed tensor shapes and fixed addresses, so:

* graphs are captured for a list of batch-size *buckets*; a step of ``n`` sequences runs
  the smallest bucket ``>= n``, its extra rows padded (``select_bucket``,
  ``pad_decode_batch``); a batch larger than the largest bucket runs eagerly;
* inputs are copied into *static* buffers the graph reads (ids, positions, slot mapping,
  context lengths, block tables sized for ``max_model_len``) and the output is read from
  a static buffer the graph writes. The static buffers are views of one device byte
  buffer with a host mirror (pinned on CUDA): a step is padded on the host and uploaded
  with one copy, instead of a dozen small device ops before each replay;
* the attention backend may ask for one graph per *context-length bucket* as well
  (``decode_context_buckets``): the triton backend splits each sequence's keys over more
  programs for longer contexts, and a graph captured for ``max_model_len`` would use the
  largest split count (and a merge kernel) for a 100-token context too;
* padded rows write no KV (slot ``-1``) and attend to one key (context length 1 through
  physical block 0), so every kernel sees well-formed, finite input.

Graphs are captured largest bucket first and share one memory pool, so the smaller
graphs reuse the larger one's activation memory (PyTorch docs, "CUDA Graphs",
``torch.cuda.graph(pool=...)``). Only backends whose decode forward reads nothing but
device tensors (``supports_cuda_graphs = True``: triton, flash_attn) can be captured.

On a CPU the same runner records CPU graphs (``minivllm/layers/cpu_graph.py``: the forward's C
calls with their pointers) for a float32 model with our C ops and the torch backend's native
decode kernel (``supports_cpu_graphs``). A step of decodes and draft verifications replays them
too, staged one row per token (``ModelRunner._stage_as_decode_rows``). They differ from CUDA
graphs in four ways: every batch size is a bucket of its own (``cpu_capture_batch_sizes``: a padded
row is real arithmetic on a CPU); a graph is recorded at the first step of its (bucket, context
bound, thread count), while that step runs, not ahead; the static buffers are host memory the graphs
read directly (nothing to upload); and the runner checks each step that the model is still what
the graphs recorded: with a forward hook on some module the step runs eagerly (a replay calls no
module), and after a submodule or a parameter is replaced the graphs are recorded again. Block
tables are checked while staging (the kernels trust them); a row's table is written only when its
sequence's ``table_version`` changed since it was staged there (a decode step's tables change only
when a sequence gets a new block). A forward with an operation a CPU graph cannot replay switches CPU
graphs off for the engine, with a warning naming the operation.
"""
from __future__ import annotations

import bisect
import ctypes
import itertools
from dataclasses import dataclass
from operator import lt
from typing import Callable

import numpy as np
import torch

from minivllm.engine import model_check
from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.cpu_graph import CpuGraph, GraphPool, NotCapturable, launch, packed_memmove
from minivllm.logger import init_logger

logger = init_logger(__name__)

#: largest batch size a graph is captured for by default (bigger decode batches are
#: compute-heavy enough that launch overhead no longer matters)
DEFAULT_MAX_CAPTURE_SIZE = 512
#: the same for CPU graphs: a CPU graph holds every intermediate of its forward in its pool
#: (no reuse within a graph), and from a few dozen rows a CPU step's arithmetic dwarfs the
#: Python a graph saves (~2-3 ms per step, embedded model)
CPU_MAX_CAPTURE_SIZE = 64


def capture_batch_sizes(max_num_seqs: int, max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> list[int]:
    """Batch-size buckets to capture: 1, 2, 4, 8, then every multiple of 8 up to
    ``min(max_num_seqs, max_capture_size)``, which is always the last bucket.

    Returns:
        Sorted, distinct sizes, e.g. ``[1, 2, 4, 8, 16, 24, 32]`` for 32 and
        ``[1, 2, 4, 8, 16, 20]`` for 20.
    """
    top = _largest_bucket(max_num_seqs, max_capture_size)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def cpu_capture_batch_sizes(max_num_seqs: int, max_capture_size: int = CPU_MAX_CAPTURE_SIZE) -> list[int]:
    """CPU graph buckets: every batch size from 1 to ``min(max_num_seqs, max_capture_size)``.

    A padded row costs a GPU next to nothing (a small decode step waits on weight reads, not
    arithmetic), but on a CPU it is arithmetic like any other row: with the GPU's buckets a step
    of 5 sequences computed 8 rows and one of 9 computed 16 (embedded model, one thread, dev EPYC,
    2026-12-04: 1.02 ms for batch 5 against 1.17 ms for batch 8, 1.78 ms for batch 9 against 2.26
    ms for batch 16). CPU graphs are recorded at the first step of their size, not ahead, so a
    bucket per size costs only that one recording (3.6-4.2 ms there) for the sizes a run meets.

    Raises:
        ValueError: ``max_num_seqs`` or ``max_capture_size`` below 1.
    """
    return list(range(1, _largest_bucket(max_num_seqs, max_capture_size) + 1))


def _largest_bucket(max_num_seqs: int, max_capture_size: int) -> int:
    """``min(max_num_seqs, max_capture_size)``, both checked to be >= 1 (ValueError naming the bad one)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_capture_size < 1:
        raise ValueError(f"max_capture_size must be >= 1, got {max_capture_size}")
    return min(max_num_seqs, max_capture_size)


def select_bucket(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket ``>= batch_size``, or ``None`` when the batch is larger than
    every bucket (the caller then runs the step eagerly).

    Args:
        batch_size: number of sequences in the decode step (>= 1).
        buckets: captured batch sizes, in any order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ordered = sorted(buckets)
    i = bisect.bisect_left(ordered, batch_size)
    return ordered[i] if i < len(ordered) else None


@dataclass
class DecodeBatch:
    """One decode step's inputs padded to a bucket (all on one device).

    Attributes:
        input_ids: int64 ``[bucket]`` (padded rows: 0).
        positions: int64 ``[bucket]`` (padded rows: 0).
        slot_mapping: int64 ``[bucket]`` (padded rows: -1, nothing written).
        context_lens: int32 ``[bucket]`` (padded rows: 1).
        block_tables: int32 ``[bucket, max_blocks_per_seq]`` (-1 past each row's blocks;
            padded rows: ``[0, -1, ...]``, i.e. their single key is slot 0 of block 0).
        cu_seqlens_q: int32 ``[bucket + 1]``: ``0, 1, ..., bucket``.
        cu_seqlens_k: int32 ``[bucket + 1]``: prefix sums of ``context_lens`` (on a CPU
            written only when ``staged_meta`` is read: no decode kernel reads it).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor

    @classmethod
    def allocate(cls, bucket: int, max_blocks_per_seq: int, device: torch.device | str) -> "DecodeBatch":
        """Buffers for ``bucket`` rows, every row padding."""
        dev = torch.device(device)
        b = cls(
            input_ids=torch.zeros(bucket, dtype=torch.int64, device=dev),
            positions=torch.zeros(bucket, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((bucket,), -1, dtype=torch.int64, device=dev),
            context_lens=torch.ones(bucket, dtype=torch.int32, device=dev),
            block_tables=torch.full((bucket, max_blocks_per_seq), -1, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
        )
        b.block_tables[:, 0] = 0
        return b

    def rows(self, n: int) -> "DecodeBatch":
        """Views of the first ``n`` rows (``n + 1`` for the prefix sums)."""
        return DecodeBatch(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                           self.context_lens[:n], self.block_tables[:n],
                           self.cu_seqlens_q[: n + 1], self.cu_seqlens_k[: n + 1])


def pad_decode_batch(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    bucket: int,
    max_blocks_per_seq: int,
    out: DecodeBatch | None = None,
) -> DecodeBatch:
    """Pad a decode step of ``n`` sequences to ``bucket`` rows.

    Args:
        input_ids, positions: int64 ``[n]``.
        slot_mapping: int64 ``[n]``.
        context_lens: int32 ``[n]``.
        block_tables: int32 ``[n, w]`` with ``w <= max_blocks_per_seq``.
        bucket: rows to pad to (``>= n``).
        max_blocks_per_seq: block-table width of the result, ``ceil(max_model_len /
            block_size)``, so any sequence up to ``max_model_len`` fits.
        out: static buffers with at least ``bucket`` rows and ``max_blocks_per_seq``
            columns to write into (the CUDA-graph inputs); fresh tensors when ``None``.

    Returns:
        A ``DecodeBatch`` of ``bucket`` rows (views of ``out`` when given).
    """
    n = int(input_ids.shape[0])
    if n > bucket:
        raise ValueError(f"batch of {n} sequences does not fit bucket {bucket}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping),
                    ("context_lens", context_lens), ("block_tables", block_tables)):
        if int(t.shape[0]) != n:
            raise ValueError(f"{name} has {t.shape[0]} rows, input_ids has {n}")
    if block_tables.dim() != 2 or block_tables.shape[1] > max_blocks_per_seq:
        raise ValueError(
            f"block_tables of shape {tuple(block_tables.shape)} is wider than "
            f"max_blocks_per_seq={max_blocks_per_seq}"
        )
    if out is None:
        out = DecodeBatch.allocate(bucket, max_blocks_per_seq, input_ids.device)
    elif out.input_ids.shape[0] < bucket or out.block_tables.shape[1] != max_blocks_per_seq:
        raise ValueError(
            f"static buffers of {out.input_ids.shape[0]} rows x {out.block_tables.shape[1]} "
            f"blocks cannot hold bucket {bucket} x {max_blocks_per_seq}"
        )
    b = out.rows(bucket)
    w = int(block_tables.shape[1])
    b.input_ids[:n].copy_(input_ids)
    b.input_ids[n:].zero_()
    b.positions[:n].copy_(positions)
    b.positions[n:].zero_()
    b.slot_mapping[:n].copy_(slot_mapping)
    b.slot_mapping[n:].fill_(-1)
    b.context_lens[:n].copy_(context_lens)
    b.context_lens[n:].fill_(1)
    b.block_tables[:n, :w].copy_(block_tables)
    b.block_tables[:n, w:].fill_(-1)
    b.block_tables[n:].fill_(-1)
    b.block_tables[n:, 0] = 0
    b.cu_seqlens_k[0] = 0
    torch.cumsum(b.context_lens, dim=0, dtype=torch.int32, out=b.cu_seqlens_k[1:])
    return b


class _EagerReplay:
    """Stands in for ``torch.cuda.CUDAGraph`` when emulating on CPU: replay re-runs the
    recorded function on the same static buffers (tests the buffer plumbing)."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def replay(self) -> None:
        self._fn()


def _align(nbytes: int, to: int = 16) -> int:
    return -(-nbytes // to) * to


class StagingLayout:
    """Byte offsets of the static decode inputs inside one buffer, for ``rows`` rows and
    ``width`` block-table columns. Every field starts on a 16-byte boundary (Triton
    specialises kernels on pointer alignment), the per-step fields come first and the
    block table last, so a step of ``n`` rows needs only the first ``step_bytes(n)`` bytes.

    Fields: ``input_ids``, ``positions``, ``slot_mapping`` int64 ``[rows]``;
    ``context_lens`` int32 ``[rows]``; ``cu_seqlens_k`` int32 ``[rows + 1]``;
    ``block_tables`` int32 ``[rows, width]``.
    """

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        off = 0
        self.offsets: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        for name, dtype, shape in (("input_ids", torch.int64, (rows,)), ("positions", torch.int64, (rows,)),
                                   ("slot_mapping", torch.int64, (rows,)), ("context_lens", torch.int32, (rows,)),
                                   ("cu_seqlens_k", torch.int32, (rows + 1,)),
                                   ("block_tables", torch.int32, (rows, width))):
            self.offsets[name] = (off, dtype, shape)
            off = _align(off + int(np.prod(shape)) * dtype.itemsize)
        self.nbytes = off

    def step_bytes(self, n: int) -> int:
        """Bytes that hold every field of the first ``n`` rows."""
        return self.offsets["block_tables"][0] + n * self.width * 4

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a ``uint8 [nbytes]`` buffer."""
        out = {}
        for name, (off, dtype, shape) in self.offsets.items():
            size = int(np.prod(shape)) * dtype.itemsize
            out[name] = buf[off:off + size].view(dtype).view(shape)
        return out


class CudaGraphDecodeRunner:
    """Captures and replays decode forwards of ``model`` for a set of batch-size buckets
    (and, when the backend asks, context-length buckets).

    Args:
        model: called as ``model(input_ids, positions, ForwardContext) -> hidden [n, H]``.
        kv_caches: per-layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hk, D]``.
        backend: the attention backend; must have ``supports_cuda_graphs = True``. If it has
            ``decode_context_buckets(num_seqs, max_seqlen_k, k_cache) -> list[int]``, one
            graph is captured per returned context bound for that batch bucket.
        max_num_seqs: largest decode batch the scheduler forms (largest bucket, capped
            at ``max_capture_size``).
        max_blocks_per_seq: ``ceil(max_model_len / block_size)``: static block-table width.
        hidden_size: model width ``H`` (the static output is ``[max_bucket, H]``).
        device, dtype: of the model.
        max_capture_size: cap on the largest bucket.
        emulate: record nothing and re-run the forward eagerly on replay; lets the
            padding and buffer logic be tested without a GPU.

    Attributes:
        num_replays: graph replays so far (one per decode step run through a graph; a CPU
            graph's first step, which records it, counts in ``num_recordings`` instead).

    Usage::

        runner = CudaGraphDecodeRunner(model, kv_caches, backend, 256, max_blocks, H, dev, dt)
        runner.capture()
        if runner.can_run(meta):
            hidden = runner.run(input_ids, positions, meta)   # [n, H], a view: use before the next run
        # or, from host arrays (what the engine does: one upload per step)
        hidden = runner.replay(runner.stage(ids, pos, slots, ctx_lens, tables))
    """

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        max_capture_size: int | None = None,
        emulate: bool = False,
    ) -> None:
        self.device = torch.device(device)
        #: "cuda": torch.cuda.CUDAGraph; "cpu": CpuGraph (recorded C calls); "emulate": eager re-runs
        self.kind = "emulate" if emulate else self.device.type
        if self.kind == "cpu":
            if not getattr(backend, "supports_cpu_graphs", False):
                raise ValueError(f"attention backend {getattr(backend, 'name', backend)!r} cannot be recorded in a "
                                 "CPU graph (it needs the native decode kernel); or enforce_eager=True")
        elif not emulate and self.device.type != "cuda":
            raise ValueError(f"decode graphs need a CUDA or CPU device, got {self.device}")
        elif not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(
                f"attention backend {getattr(backend, 'name', backend)!r} cannot be captured in a "
                "CUDA graph (it plans each step on the host); use triton or flash_attn, "
                "or enforce_eager=True"
            )
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = int(kv_caches[0][0].shape[1])
        self.max_blocks_per_seq = max_blocks_per_seq
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.emulate = emulate
        # padding costs a CPU real arithmetic: there a graph per batch size
        sizes, cap = ((cpu_capture_batch_sizes, CPU_MAX_CAPTURE_SIZE) if self.kind == "cpu"
                      else (capture_batch_sizes, DEFAULT_MAX_CAPTURE_SIZE))
        self.buckets = sizes(max_num_seqs, cap if max_capture_size is None else max_capture_size)
        self.max_seqlen_k = max_blocks_per_seq * self.block_size
        plan = getattr(backend, "decode_context_buckets", None)
        #: per batch bucket: sorted context bounds, one graph each (the last is max_seqlen_k)
        self.context_buckets: dict[int, list[int]] = {}
        for bs in self.buckets:
            bounds = sorted(set(plan(bs, self.max_seqlen_k, kv_caches[0][0]))) if plan else []
            self.context_buckets[bs] = [b for b in bounds if b < self.max_seqlen_k] + [self.max_seqlen_k]
        self._graphs: dict[tuple, object] = {}
        #: is the model still the one the CPU graphs were recorded from (asked before every replay)
        self._watch = model_check.ModelWatch(self._graphs.clear) if self.kind == "cpu" else None
        self._pool = GraphPool() if self.kind == "cpu" else None
        self._ready = False  # capture() called (CPU graphs are then recorded at each key's first step)
        #: why CPU graphs were switched off (an operation a graph cannot replay), else None
        self.not_capturable: str | None = None
        self.num_replays = 0
        self.num_recordings = 0  # CPU graphs recorded (each while its first step ran)
        top = self.buckets[-1]
        self.layout = StagingLayout(top, max_blocks_per_seq)
        self._host_bytes = torch.zeros(self.layout.nbytes, dtype=torch.uint8,
                                       pin_memory=self.device.type == "cuda")
        # on the CPU the graphs read the host buffer itself: nothing to upload
        self._dev_bytes = (self._host_bytes if self.kind == "cpu"
                           else torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=self.device))
        dev, host = self.layout.views(self._dev_bytes), self.layout.views(self._host_bytes)
        self._host = {k: v.numpy() for k, v in host.items()}
        # input_ids, positions and slot_mapping lie back to back, equally spaced: one [3, rows] view
        ids = self._host["input_ids"]
        gap = self.layout.offsets["positions"][0] - self.layout.offsets["input_ids"][0]
        self._ids_pos_slots = np.lib.stride_tricks.as_strided(ids, shape=(3, top), strides=(gap, 8))
        assert self.layout.offsets["slot_mapping"][0] == 2 * gap
        #: the bucket of a step of n sequences, n = 0..largest (None: no bucket)
        self._bucket_of = [None] + [select_bucket(n, self.buckets) for n in range(1, top + 1)]
        self._buf = DecodeBatch(dev["input_ids"], dev["positions"], dev["slot_mapping"], dev["context_lens"],
                                dev["block_tables"],
                                torch.arange(top + 1, dtype=torch.int32, device=self.device), dev["cu_seqlens_k"])
        self._copy_done = torch.cuda.Event() if self.device.type == "cuda" else None
        #: per host row: the table version staged there (-1: unknown), and how many tokens its
        #: blocks hold (its entries that are not -1, times the block size); ``_rows_trusted``:
        #: both are what the rows hold
        self._row_versions = [-1] * top
        self._row_capacity = [0] * top
        self._rows_trusted = False
        self._padded: tuple[int, int] | None = None  # (rows, bucket) of the last completed stage()
        self._fill_padding(0, top)
        self._upload(top)
        self._hidden = torch.zeros(top, hidden_size, dtype=dtype, device=self.device)
        self._staged: tuple[int, int, int] | None = None  # (rows, bucket, context bound) staged
        self.num_stages = 0  # completed stage() calls: which step the static buffers hold
        self._row_views: dict[int, DecodeBatch] = {}

    @property
    def captured(self) -> bool:
        """Steps can replay: graphs were captured (CPU: recording was enabled and nothing was
        found that a graph cannot replay)."""
        if self.kind == "cpu":
            return self._ready and self.not_capturable is None
        return bool(self._graphs)

    def release(self) -> None:
        """Drop every graph, and with them the model and KV cache they hold: a recorded graph keeps
        the closure that runs the forward, which refers back to this runner, so without this the
        whole engine's memory waited for Python's cycle collector after ``shutdown``."""
        self._graphs.clear()
        self._ready = False
        self.model = None
        self.kv_caches = []
        if self._watch is not None:
            self._watch.forget()  # the model check's lists and its hold on the weights go with the model

    @property
    def graph_keys(self) -> list[tuple]:
        """``(batch bucket, context bound)`` of every captured graph (CPU graphs: ``(batch
        bucket, context bound, torch threads)``, recorded at first use)."""
        return sorted(self._graphs)

    # -- static inputs ------------------------------------------------------------------------
    def _fill_padding(self, lo: int, hi: int) -> None:
        """Host rows ``lo..hi-1`` as padding: no KV written, one key in block 0."""
        h = self._host
        h["input_ids"][lo:hi] = 0
        h["positions"][lo:hi] = 0
        h["slot_mapping"][lo:hi] = -1
        h["context_lens"][lo:hi] = 1
        h["block_tables"][lo:hi] = -1
        h["block_tables"][lo:hi, 0] = 0
        self._row_versions[lo:hi] = [-1] * (hi - lo)
        self._row_capacity[lo:hi] = [self.block_size] * (hi - lo)

    def _upload(self, rows: int) -> None:
        if self._dev_bytes is self._host_bytes:
            return
        n = self.layout.step_bytes(rows)
        self._dev_bytes[:n].copy_(self._host_bytes[:n], non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()

    def stage(self, input_ids, positions, slot_mapping, context_lens, block_tables, table_versions=None) -> int:
        """Pad a decode step of ``n`` sequences to its bucket in the host mirror and upload it
        with one copy; ``replay(n)`` then runs it.

        Args:
            input_ids, positions, slot_mapping: int ``[n]`` (numpy arrays or lists).
            context_lens: int ``[n]``.
            block_tables: int ``[n, w]`` numpy array (``w <= max_blocks_per_seq``, padded
                with -1), or a list of ``n`` block-id lists.
            table_versions: optional, with lists: one int per row that changes whenever its
                table does (``Sequence.table_version``): a row whose table has the version
                already staged in that row by the last completed call is not written again
                (a decode step's tables change only when a sequence gets a new block).

        Returns:
            ``n``.

        Raises:
            ValueError: ``n`` is 0 or above the largest bucket, a field has another length,
                or a table is wider than ``max_blocks_per_seq``.
            RuntimeError: a table holds a block outside the KV cache, or covers fewer blocks
                than its context needs (the kernels trust the staged tables).
        """
        n = len(input_ids)
        bucket = self._bucket_of[n] if n < len(self._bucket_of) else None
        if bucket is None:
            raise ValueError(f"a decode step of {n} sequences fits no bucket (buckets 1..{self.buckets[-1]})")
        if not len(positions) == len(slot_mapping) == len(context_lens) == len(block_tables) == n:
            for name, x in (("positions", positions), ("slot_mapping", slot_mapping),
                            ("context_lens", context_lens), ("block_tables", block_tables)):
                if len(x) != n:
                    raise ValueError(f"{name} has {len(x)} rows, input_ids has {n}")
        if table_versions is not None and (len(table_versions) != n or not isinstance(block_tables, list)):
            raise ValueError(f"table_versions needs one version per row ({n}) and the tables as lists")
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous upload has left the host mirror
        h = self._host
        # Nothing counts as staged, and no row's version as written, until every row is: an
        # interrupt below leaves rows that the next stage() must write again.
        self._staged = None
        trusted, self._rows_trusted = self._rows_trusted, False
        if not trusted:  # after an interrupted call any row may hold anything: none is known
            self._row_versions[:] = [-1] * len(self._row_versions)
            self._padded = None
        if n == 1:  # batch-1 decode: four scalar stores cost ~0.2 us, numpy reading four lists ~0.9
            ips = self._ids_pos_slots
            ips[0, 0], ips[1, 0], ips[2, 0] = input_ids[0], positions[0], slot_mapping[0]
            h["context_lens"][0] = context_lens[0]
        else:
            self._ids_pos_slots[:, :n] = (input_ids, positions, slot_mapping)  # one numpy call for the three
            h["context_lens"][:n] = context_lens
        staged = self._row_versions
        if table_versions is not None:
            if table_versions != staged[:n]:  # some row's table changed (all, when untrusted)
                self._write_table_rows([i for i, v, w in zip(range(n), table_versions, staged) if v != w],
                                       block_tables)
                staged[:n] = table_versions
        elif self.kind == "cpu" and n <= 8 and isinstance(block_tables, list):
            self._write_table_rows(range(n), block_tables)
            staged[:n] = [-1] * n
        else:
            used = fill_block_tables(h["block_tables"][:n], block_tables)
            staged[:n] = [-1] * n
            blocks = (h["block_tables"][:n] >= 0).sum(axis=1).tolist() if used is None else list(map(len, block_tables))
            self._row_capacity[:n] = [b * self.block_size for b in blocks]
            if self.kind == "cpu":
                self._check_tables(n, used)
        if self.kind == "cpu":  # what the kernels will read: each row's blocks cover its context
            if any(map(lt, self._row_capacity, context_lens)):
                short = next(i for i, (cap, c) in enumerate(zip(self._row_capacity, context_lens)) if cap < c)
                raise RuntimeError(f"decode graph: sequence {short}'s block table covers fewer than its "
                                   f"{context_lens[short]} tokens (block manager state is corrupt)")
        if n < bucket and self._padded != (n, bucket):  # else they are padding already (None when untrusted)
            self._fill_padding(n, bucket)
        # No decode kernel reads cu_seqlens_k (flash-attn's reads context_lens): a CPU stage leaves it
        # to staged_meta (~1 us of a batch-1 step); a GPU's goes up with the step's one upload.
        if self.kind != "cpu":
            self._fill_cu_seqlens_k(bucket)
        self._upload(bucket)
        bounds = self.context_buckets[bucket]
        bound = bounds[0] if len(bounds) == 1 else bounds[min(bisect.bisect_left(bounds, int(max(context_lens))),
                                                                  len(bounds) - 1)]
        self._padded, self._rows_trusted = (n, bucket), True
        self._staged = (n, bucket, bound)
        self.num_stages += 1
        return n

    def _fill_cu_seqlens_k(self, rows: int) -> None:
        cu = self._host["cu_seqlens_k"]
        cu[0] = 0
        np.add.accumulate(self._host["context_lens"][:rows], out=cu[1:rows + 1])  # np.cumsum without its ~1.5 us wrapper

    def _write_table_rows(self, rows, tables: list) -> None:
        """Write ``tables[i]`` into host row ``i`` (-1 after its blocks) for each ``i`` in ``rows``,
        refusing a block outside the KV cache first; a row at a time (a few rows: cheaper than the
        vectorised fill's fixed cost, ~20 us)."""
        out, capacity, bs = self._host["block_tables"], self._row_capacity, self.block_size
        for i in rows:
            t = tables[i]
            if t:
                self._check_range(min(t), max(t))
            out[i, :len(t)] = t
            out[i, len(t):] = -1
            capacity[i] = len(t) * bs

    def _check_tables(self, n: int, used: np.ndarray | None) -> None:
        """The CPU kernels trust the block tables (a replay makes no check): refuse a step whose
        tables point outside the KV cache or hold -1 within a sequence's tokens. ``used``: the
        tables' block ids when they came as lists (each list is its sequence's blocks)."""
        if used is None:
            h = self._host
            tables, lens = h["block_tables"][:n], h["context_lens"][:n]
            bs = self.block_size
            used = tables[np.arange(tables.shape[1])[None, :] < ((lens + bs - 1) // bs)[:, None]]
        if used.size:
            self._check_range(int(used.min()), int(used.max()))

    def _check_range(self, lo: int, hi: int) -> None:
        num_blocks = int(self.kv_caches[0][0].shape[0])
        if lo < 0 or hi >= num_blocks:
            self._staged = None
            raise RuntimeError(f"decode graph: a block table holds {lo}..{hi} within its sequence's tokens, "
                               f"outside the KV cache's {num_blocks} blocks (block manager state is corrupt)")

    def _rows(self, n: int) -> DecodeBatch:
        """Views of the static buffers' first ``n`` rows, made once per ``n`` (seven slicing ops
        cost ~10 us a step)."""
        b = self._row_views.get(n)
        if b is None:
            b = self._row_views[n] = self._buf.rows(n)
        return b

    def static_input_ids(self, n: int) -> torch.Tensor:
        """The static ``input_ids`` buffer's first ``n`` rows (int64, device)."""
        return self._rows(n).input_ids

    def static_positions(self, n: int) -> torch.Tensor:
        """The static ``positions`` buffer's first ``n`` rows (int64, device)."""
        return self._rows(n).positions

    def staged_meta(self, n: int, stage: int | None = None) -> AttentionMetadata:
        """Metadata of the staged step's ``n`` real rows (views of the static buffers, valid
        until the next ``stage``), for callers that inspect the step: the replay does not read
        it (the runner builds it only when read: ``StagedModelInput``). ``stage``: the
        ``num_stages`` the caller's step was staged as, refused once a later stage replaced it.

        Raises:
            ValueError: no step of ``n`` rows is staged, or not the one of ``stage``.
        """
        if self._staged is None or self._staged[0] != n or stage not in (None, self.num_stages):
            raise ValueError(f"the step of {n} rows staged as number {stage} is no longer in the graphs' buffers "
                             f"(now: {None if self._staged is None else self._staged[0]} rows, stage "
                             f"{self.num_stages}): a later stage replaced it")
        if self.kind == "cpu":  # host and device are one buffer there; stage() left this out
            self._fill_cu_seqlens_k(n)
        b = self._rows(n)
        context_lens = self._host["context_lens"][:n].tolist()
        return AttentionMetadata(
            cu_seqlens_q=b.cu_seqlens_q, cu_seqlens_k=b.cu_seqlens_k, context_lens=b.context_lens,
            slot_mapping=b.slot_mapping, block_tables=b.block_tables, max_seqlen_q=1,
            max_seqlen_k=max(context_lens), block_size=self.block_size, is_decode_only=True,
            q_lens_cpu=[1] * n, context_lens_cpu=context_lens)

    def _meta(self, bs: int, max_seqlen_k: int) -> AttentionMetadata:
        """Metadata whose tensors are views of the static buffers (what the graph reads)."""
        b = self._buf.rows(bs)
        return AttentionMetadata(
            cu_seqlens_q=b.cu_seqlens_q,
            cu_seqlens_k=b.cu_seqlens_k,
            context_lens=b.context_lens,
            slot_mapping=b.slot_mapping,
            block_tables=b.block_tables,
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k,
            block_size=self.block_size,
            is_decode_only=True,
            q_lens_cpu=[1] * bs,
            # host-side lengths are unknown at replay; kernels used in graphs never read them
            context_lens_cpu=[1] * bs,
        )

    def _forward_into_static(self, bs: int, max_seqlen_k: int) -> Callable[[], None]:
        meta = self._meta(bs, max_seqlen_k)
        ctx = ForwardContext(meta, self.backend, self.kv_caches)
        ids, pos = self._buf.input_ids[:bs], self._buf.positions[:bs]
        out = self._hidden[:bs]

        if self.kind == "cpu":  # planned once: a CPU graph records the forward, not the plan
            self.backend.prepare_cpu_graph(meta)

            def fn() -> None:
                hidden = self.model(ids, pos, ctx)
                if hidden.is_contiguous() and hidden.dtype == out.dtype and hidden.shape == out.shape:
                    # one C memmove rather than an ATen copy_: in a replay right after a step has
                    # streamed the KV cache, the dispatch ran from cold caches (70-130 us at batch 32)
                    args = (out.data_ptr(), hidden.data_ptr(), hidden.numel() * hidden.element_size())
                    copy = packed_memmove()
                    launch(ctypes.memmove, *args, name="memmove", native=None if copy is None else (copy, args))
                else:
                    out.copy_(hidden)

            return fn

        def fn() -> None:
            meta.extras.clear()
            self.backend.prepare(meta)
            out.copy_(self.model(ids, pos, ctx))

        return fn

    @torch.inference_mode()
    def capture(self, warmup_iters: int = 2) -> None:
        """Capture one graph per (bucket, context bound), largest first, sharing one memory pool.

        Each graph first runs ``warmup_iters`` eager forwards on the all-padding static
        buffers (compiles Triton kernels, sets up cuBLAS workspaces; writes no KV).

        CPU graphs are not recorded here but at the first step of each (bucket, context bound,
        thread count): that step's forward runs for real while it is recorded (nothing to warm
        up, no memory for buckets never used).
        """
        if self.kind == "cpu":
            self._ready = True
            return
        for bs in reversed(self.buckets):
            for bound in reversed(self.context_buckets[bs]):
                fn = self._forward_into_static(bs, bound)
                if self.emulate:
                    self._graphs[(bs, bound)] = _EagerReplay(fn)
                    continue
                for _ in range(warmup_iters):
                    fn()
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    fn()
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[(bs, bound)] = graph
        if not self.emulate:
            torch.cuda.synchronize(self.device)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True when this step can replay a graph: captured, decode-only, fits a bucket,
        same block size, block table no wider than the static one."""
        return self.can_run_step(meta.num_seqs, meta.num_tokens, meta.is_decode_only, meta.block_size,
                                 int(meta.block_tables.shape[1]))

    def reset(self) -> None:
        """Drop every recorded CPU graph: each is recorded again at its next step (after changing
        the model's code on a live engine, which the runner cannot see). CUDA graphs: refused."""
        if self.kind != "cpu":
            raise ValueError("reset() drops CPU graphs; CUDA graphs are captured once, at start-up")
        self._graphs.clear()
        self._watch.forget()  # listed again at the next step

    def can_run_step(self, num_seqs: int, num_tokens: int, decode_only: bool, block_size: int,
                     table_width: int) -> bool:
        """``can_run`` from host values (no metadata built yet)."""
        return (
            self.captured
            and decode_only
            and num_tokens == num_seqs
            and num_seqs >= 1
            and num_seqs < len(self._bucket_of)
            and block_size == self.block_size
            and table_width <= self.max_blocks_per_seq
            and (self.kind != "cpu" or not self._watch.hooked(self.model))
        )

    def replay(self, n: int) -> torch.Tensor:
        """Replay the graph of the step ``stage`` uploaded (``n`` sequences).

        Returns:
            ``hidden [n, hidden_size]``: a view of the static output, valid until the
            next replay.
        """
        if self._staged is None or self._staged[0] != n:
            raise ValueError(f"replay({n}): the staged step has {None if self._staged is None else self._staged[0]} "
                             "sequences; call stage() first")
        _, bucket, bound = self._staged
        if self.kind == "cpu":
            key = (bucket, bound, torch.get_num_threads())  # a graph's calls split work for its thread count
            graph = self._graphs.get(key)
            if graph is None:
                return self._record_cpu(key, n)
            if graph.replays_in_c:  # C calls only, no tensor operation: the mode cost ~10 us after a step
                graph.replay()
            else:
                with torch.inference_mode():  # the recorded ATen calls write inference tensors in place
                    graph.replay()
        else:
            self._graphs[(bucket, bound)].replay()
        self.num_replays += 1
        return self._hidden[:n]

    def _record_cpu(self, key: tuple, n: int) -> torch.Tensor:
        """Run the staged step while recording it as the CPU graph of ``key``. If the forward does
        something a graph cannot replay, CPU graphs are switched off (``not_capturable`` says why)
        and this step's forward runs again, eagerly, into the same static output: the recorded
        part only wrote what the eager run writes again (this step's K/V, intermediates)."""
        bucket, bound, _ = key
        fn = self._forward_into_static(bucket, bound)
        graph = CpuGraph(self._pool)
        with torch.inference_mode():
            try:
                with graph.capture():
                    fn()
                graph.check_nothing_outlives()
            except NotCapturable as e:
                self.not_capturable = str(e)
                self._watch.disarm()  # no replay to check for any more
                logger.warning("CPU graphs off for this engine: %s", e)
                if not graph.complete:
                    fn()  # the recording stopped part-way: this step's forward again, eagerly
                return self._hidden[:n]
        graph.keep_alive(fn)  # its metadata hold the static plan's tensors the calls point into
        self._graphs[key] = graph
        self.num_recordings += 1
        return self._hidden[:n]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Stage and replay a decode step given as tensors (reads them back to the host
        first: for tests and scripts; the engine stages host arrays directly).

        Args:
            input_ids, positions: int64 ``[n]``, one token per sequence.
            meta: the step's metadata (decode-only, ``n`` sequences).

        Returns:
            ``hidden [n, hidden_size]``: a view of the static output, valid until the
            next ``run``.
        """
        if not self.can_run(meta):
            raise ValueError(
                f"this step cannot run in a CUDA graph (decode_only={meta.is_decode_only}, "
                f"num_seqs={meta.num_seqs}, buckets up to {self.buckets[-1]}, "
                f"captured={self.captured})"
            )
        n = meta.num_seqs
        self.stage(input_ids.cpu().numpy(), positions.cpu().numpy(), meta.slot_mapping.cpu().numpy(),
                   meta.context_lens.cpu().numpy(), meta.block_tables.cpu().numpy())
        return self.replay(n)


def fill_block_tables(out: np.ndarray, tables) -> np.ndarray | None:
    """Write ``tables`` into ``out [n, width]`` with -1 past each row's blocks, without a
    Python loop over rows.

    Args:
        out: int32 ``[n, width]`` (a view is written in place).
        tables: an int ``[n, w]`` array with ``w <= width`` (-1 padded), or ``n`` block-id lists.

    Returns:
        For lists, every block id they hold (int32, concatenated); for an array, None.

    Raises:
        ValueError: a row is longer than ``width``.
    """
    n, width = out.shape
    if isinstance(tables, np.ndarray):
        if tables.ndim != 2 or tables.shape[1] > width:
            raise ValueError(f"block table of shape {tables.shape} is wider than {width}")
        w = tables.shape[1]
        out[:, :w] = tables
        out[:, w:] = -1
        return None
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=n)
    if n and int(lens.max(initial=0)) > width:
        raise ValueError(f"a block table has {int(lens.max())} blocks, more than the width {width}")
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    out.fill(-1)
    out[np.arange(width)[None, :] < lens[:, None]] = flat  # row-major order matches the concatenation
    return flat
