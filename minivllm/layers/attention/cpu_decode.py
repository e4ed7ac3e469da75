"""Paged decode attention on the CPU without the gather: our C kernel, built at first use.

The reference path (``torch_backend``) copies every decode sequence's KV blocks into a padded
tensor each layer and runs masked SDPA over it: two passes over the KV bytes plus a write,
for a step that should be one read of them. ``csrc/paged_decode_f32.c`` reads K and V in place
through the block table instead (fp32, any GQA ratio and block size), for decode rows and for
short causal queries (draft verification: up to ``MAX_QUERY_LEN`` tokens per sequence, one row
per token). The cache may hold float32 or bfloat16 (``KV_DTYPES``; ``kv_cache_dtype="bfloat16"``:
half the bytes a decode step reads, widened to float32 as they are loaded). Measured on the 2-core
dev EPYC, one thread, embedded model's shapes (32 sequences of 200-260 tokens, 16-token blocks, 2 KV
heads of 64), float32 cache: 0.8 ms per layer against 1.9 ms for gather + SDPA in the engine. The
same library computes the causal self-attention of fresh prompts (no cached prefix) from the step's
own K and V (:meth:`PagedDecodeKernel.causal_self_attention`), in place of one SDPA call per prompt.

It is compiled at first use and loaded with ``ctypes`` by ``minivllm.layers.native_build``
(first compiler found, cached per source, compiler and CPU). Where that fails (no compiler, e.g. a bare Windows box) or ``MINIVLLM_CPU_DECODE_KERNEL=0`` is set,
:func:`load` returns ``None`` with the reason in :func:`unavailable_reason`, and the backend keeps
the gather + SDPA path.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from minivllm.layers import cpu_gemm, cpu_graph
from minivllm.layers.native_build import NativeLibrary
from minivllm.layers.native_parallel import run_chunks
from minivllm.logger import init_logger

__all__ = ["KV_DTYPES", "PagedDecodeKernel", "load", "unavailable_reason"]

logger = init_logger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_f32.c"
ENV_SWITCH = "MINIVLLM_CPU_DECODE_KERNEL"
#: below this many query rows per extra thread, splitting costs more than it saves (thread hand-off
#: is tens of microseconds; one row over a few hundred tokens is a few microseconds)
MIN_ROWS_PER_THREAD = 8
#: longest query (tokens per sequence in a step) sent to the kernel: it reads a sequence's K/V once
#: per query token (from the CPU's caches after the first), so it suits decode, draft
#: verification and short prompt chunks; longer queries (most prefills) keep gather + SDPA
MAX_QUERY_LEN = 16

#: below this much causal work in a step (sum of squared prompt lengths) the fresh-prompt attention runs
#: on the calling thread alone: a 256-token prompt's is about a millisecond per layer at the embedded
#: model's shapes (32 prompts with 627k of it took 8.9 ms on one thread), far above a thread hand-off
MIN_CAUSAL_WORK_TO_SPLIT = 1 << 16

#: KV cache element types the kernel reads (and its store writes), and the C functions' suffix for each
KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_library = NativeLibrary(SOURCE, ENV_SWITCH, lambda lib: PagedDecodeKernel(lib))


class _DecodeCall(ctypes.Structure):
    """``decode_call`` in the C source: one call's arguments, for ``paged_decode_part``."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k_cache", "v_cache", "block_tables")] + [
        ("table_stride", ctypes.c_int64), ("row_seq", ctypes.c_void_p), ("row_lens", ctypes.c_void_p),
        ("out", ctypes.c_void_p)] + [(name, ctypes.c_int64) for name in (
            "num_rows", "num_heads", "num_kv_heads", "head_dim", "block_size")] + [
        ("scale", ctypes.c_float), ("scratch", ctypes.c_void_p), ("scratch_floats", ctypes.c_int64),
        ("kv_bf16", ctypes.c_int64)]


def load() -> "PagedDecodeKernel | None":
    """The compiled kernel, building it on first use; ``None`` when it cannot be had (see
    :func:`unavailable_reason`). Thread-safe; builds at most once per process. Builds into
    ``cache_dir()/kernels`` (``$MINIVLLM_CACHE_DIR`` or ``~/.cache/minivllm``), or the temp
    directory when that is not writable."""
    return _library.load()


def switched_off() -> bool:
    """``MINIVLLM_CPU_DECODE_KERNEL`` is set to 0 / false / no / off (read at every call)."""
    return _library.switched_off()


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it did not)."""
    return _library.unavailable_reason()


def describe(dtype: torch.dtype | None, heads: tuple[int, int, int] | None = None) -> str:
    """One line for an engine's startup log: which path its CPU decode attention takes in ``dtype``;
    with ``heads`` (query heads, KV heads, head_dim of a rank), also which loops the kernel runs
    for them."""
    if dtype is not None and dtype != torch.float32:
        return f"gather + SDPA (the native kernel computes float32; this model runs in {dtype})"
    kernel = load()
    if kernel is None:
        how = "switched off" if switched_off() else "native kernel unavailable"
        return f"gather + SDPA ({how}: {unavailable_reason()})"
    if heads is None:
        return f"native paged kernel ({_library.path})"
    num_heads, kv_heads, head_dim = heads
    width, vector = kernel.tile_width(num_heads, kv_heads, head_dim), kernel.vector_width()
    shape = f"head_dim {head_dim}, {num_heads // max(kv_heads, 1)} query heads per KV head"
    loops = (f"{width} dots at a time ({shape})" if width else
             f"portable loops ({shape}; the tiled loops need head_dim a multiple of {vector} up to "
             f"{8 * vector} and query heads per KV head dividing {vector})")
    return f"native paged kernel, {loops} ({_library.path})"


class PagedDecodeKernel:
    """The loaded C function, with the shape checks and the optional split over threads."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # per KV cache dtype: (decode attention, its packed twin, KV store, its packed twin); the packed
        # twins (csrc/packed_call.h) are what a CPU graph replays from C
        self._by_dtype = {}
        for dtype, suffix in KV_DTYPES.items():
            fn, store = getattr(lib, f"paged_decode_attention_{suffix}"), getattr(lib, f"paged_store_kv_{suffix}")
            fn.argtypes, fn.restype = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, p], None
            store.argtypes, store.restype = [p, i64, p, i64, p, i64, i64, p, p, i64], i64
            self._by_dtype[dtype] = (fn, cpu_graph.packed_address(lib, f"paged_decode_attention_{suffix}"),
                                     store, cpu_graph.packed_address(lib, f"paged_store_kv_{suffix}"))
        causal = lib.causal_self_attention_f32
        causal.argtypes = [p, i64, p, i64, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p]
        causal.restype = None
        self._causal = causal
        self._tile_width = lib.paged_decode_tile_width
        self._tile_width.argtypes, self._tile_width.restype = [i64, i64, i64], i64
        self._vector_width = lib.paged_decode_vector_width
        self._vector_width.argtypes, self._vector_width.restype = [], i64
        # the C function that runs one part of a split call's rows on the panel GEMM's threads (__call__)
        self._part_address = ctypes.cast(lib.paged_decode_part, ctypes.c_void_p).value
        # One kernel object serves every backend in the process, and engines may step in
        # different Python threads at once (ctypes drops the GIL): each calling thread gets its
        # own score scratch.
        self._local = threading.local()

    def c_function(self, kv_dtype: torch.dtype) -> ctypes._CFuncPtr:
        """The bare C decode function for caches of ``kv_dtype`` (a key of ``KV_DTYPES``), its argument
        types set: ``scripts/probe_kv_read.py`` times it without this class's checks and split."""
        return self._by_dtype[kv_dtype][0]

    def tile_width(self, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
        """How many query-head x key dot products the kernel computes at once for these heads (its
        vector width in floats), 0 where it runs its portable loops instead."""
        return int(self._tile_width(num_heads, num_kv_heads, head_dim))

    def vector_width(self) -> int:
        """This build's vector width in floats (16 with AVX-512, else 8)."""
        return int(self._vector_width())

    def _scratch(self, numel: int) -> torch.Tensor:
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < numel:
            with cpu_graph.persistent():  # reused by later calls: never from a CPU graph's pool
                buf = self._local.scratch = torch.empty(numel, dtype=torch.float32, device="cpu")
        return buf

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 row_seq: torch.Tensor, row_lens: torch.Tensor, max_len: int, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of query rows over their paged contexts.

        A row is one query token: a decode sequence is one row seeing its whole context; a
        short causal query (draft verification) is one row per token, row ``i`` of ``n``
        seeing ``context_len - n + 1 + i`` keys.

        Args:
            q: fp32 ``[R, heads, head_dim]``, contiguous.
            k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, contiguous, both
                fp32 or both bf16 (``KV_DTYPES``).
            block_tables: int32 ``[S, max_blocks]``, contiguous, one row per sequence.
            row_seq: int32 ``[R]``: the block-table row of each query row.
            row_lens: int32 ``[R]``: keys each row sees, ``1 .. max_blocks * block_size``; its
                table row must hold valid block ids for the first ``ceil(len / block_size)`` entries.
            max_len: ``max(row_lens)`` or more (sizes the score scratch).
            scale: softmax scale (``head_dim ** -0.5`` for Qwen3).
            out: optional fp32 ``[R, heads, head_dim]`` to write into.

        Returns:
            fp32 ``[R, heads, head_dim]``.

        Raises:
            ValueError: a dtype, device, layout or shape the kernel does not take. The caller
                (the backend's step plan) checks the table entries and lengths once per step;
                the kernel trusts them.
        """
        if q.dim() != 3 or k_cache.dim() != 4:
            raise ValueError(f"paged decode kernel: q must be [rows, heads, head_dim] and the caches "
                             f"[blocks, block_size, kv_heads, head_dim], got {tuple(q.shape)} and {tuple(k_cache.shape)}")
        rows, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        kv_dtype = k_cache.dtype if k_cache.dtype in KV_DTYPES else torch.float32  # else refused below
        for name, t, dt in (("q", q, torch.float32), ("k_cache", k_cache, kv_dtype),
                            ("v_cache", v_cache, kv_dtype), ("block_tables", block_tables, torch.int32),
                            ("row_seq", row_seq, torch.int32), ("row_lens", row_lens, torch.int32)):
            if t.dtype != dt or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"paged decode kernel: {name} must be a contiguous CPU {dt} tensor, got "
                                 f"{t.dtype} on {t.device} (contiguous={t.is_contiguous()})")
        if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim or heads % kv_heads
                or block_tables.dim() != 2 or row_seq.shape != (rows,) or row_lens.shape != (rows,)):
            raise ValueError(f"paged decode kernel: inconsistent shapes q {tuple(q.shape)}, k_cache "
                             f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}, block_tables "
                             f"{tuple(block_tables.shape)}, row_seq {tuple(row_seq.shape)}, row_lens "
                             f"{tuple(row_lens.shape)}")
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"paged decode kernel: out must be a contiguous CPU float32 tensor of shape "
                             f"{tuple(q.shape)}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        block_size = k_cache.shape[1]
        fn, fn_packed, _, _ = self._by_dtype[kv_dtype]
        name = f"paged_decode_attention_{KV_DTYPES[kv_dtype]}"
        chunks = max(1, min(torch.get_num_threads(), rows // MIN_ROWS_PER_THREAD))
        per_chunk = heads * max_len
        graph = cpu_graph.capturing()
        if graph is None:
            scratch = self._scratch(chunks * per_chunk)
        else:
            # the graph pool's shared scratch: the graphs of one engine replay one at a time and every
            # call writes the scores before reading them, so all layers of all its graphs can use one
            # buffer (one per graph was up to 64 x heads x max_model_len floats, 168 MiB for Qwen3-0.6B
            # at 40,960 tokens); another engine's graphs, maybe in another thread, have a pool of their own
            scratch = graph.pool.scratch(chunks * per_chunk)
            graph.keep_alive(scratch)
        stride = block_tables.stride(0)
        qp, sq, lp, op, sp = (t.data_ptr() for t in (q, row_seq, row_lens, out, scratch))
        kp, vp, tp = k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr()

        gemm = cpu_gemm.load() if chunks > 1 else None
        if gemm is not None:
            # the rows split on the panel GEMM's threads, which poll between a step's calls: a pool
            # of its own (Python threads, below) woke a sleeping thread for each layer while the
            # GEMM's polled on the same cores (2 cores, 2 threads, the embedded model's batch-32
            # step: 11.1-14.3 ms against 5.9-7.1 ms this way; docs/benchmarks.md, run AF)
            call = _DecodeCall(qp, kp, vp, tp, stride, sq, lp, op, rows, heads, kv_heads, head_dim, block_size,
                               scale, sp, per_chunk, int(kv_dtype == torch.bfloat16))
            if graph is not None:
                graph.keep_alive(call)  # its replays pass the structure's address again
            args = (self._part_address, ctypes.addressof(call), chunks)
            cpu_graph.launch(gemm.parallel_run, *args, name=name, native=(gemm.parallel_run_packed, args))
            return out

        def chunk_args(c: int) -> tuple:  # the kernel's arguments for chunk c's rows and scratch
            lo, hi = rows * c // chunks, rows * (c + 1) // chunks
            return (qp + lo * heads * head_dim * 4, kp, vp, tp, stride, sq + lo * 4, lp + lo * 4,
                    op + lo * heads * head_dim * 4, hi - lo, heads, kv_heads, head_dim, block_size, float(scale),
                    sp + c * per_chunk * 4)

        if chunks == 1:
            args = chunk_args(0)
            cpu_graph.launch(fn, *args, name=name, native=(fn_packed, args))
            return out

        def run(c: int) -> None:
            fn(*chunk_args(c))

        # several chunks run on several threads (ctypes drops the GIL); run_chunks returns only once
        # every chunk is done, so the scratch is free for the next call even after an interrupt
        cpu_graph.launch(run_chunks, run, chunks, name=name)
        return out

    def causal_self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                              scale: float, out: torch.Tensor) -> bool:
        """Causal attention of fresh prompts over their own tokens (no cached prefix), written into
        ``out``: for each ``(start, n)`` in ``spans``, token ``start + i`` sees tokens ``start ..
        start + i`` of ``k`` and ``v``. Rows of ``out`` outside every span are not written.

        Args:
            q, out: fp32 ``[T, heads, head_dim]``; k, v: fp32 ``[T, kv_heads, head_dim]``; each
                token's heads contiguous (any row stride: ``v`` may be a view of the fused QKV
                output), ``out`` contiguous. ``head_dim`` a multiple of 8.
            spans: ``(start, n)`` per prompt, inside ``[0, T)``.
            scale: softmax scale.

        Returns:
            False, writing nothing, for tensors it does not take, or while a CPU graph records (the
            caller then uses SDPA).

        Raises:
            ValueError: a span outside ``[0, T)``, empty, or overlapping another (naming them all).
        """
        tokens, heads, head_dim = q.shape
        if cpu_graph.capturing() is not None:  # graphs record decode steps only; keep a prompt's path eager
            return False
        if (out.shape != q.shape or k.dim() != 3 or v.shape != k.shape or k.shape[0] != tokens
                or k.shape[2] != head_dim or heads % k.shape[1] or head_dim % 8 or not out.is_contiguous()):
            return False
        for t in (q, k, v, out):
            if t.dtype is not torch.float32 or not t.is_cpu or t.stride(2) != 1 or t.stride(1) != head_dim:
                return False
        if not spans:
            return True
        ends = [start + n for start, n in spans]
        order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        if (any(start < 0 or n < 1 or start + n > tokens for start, n in spans)
                or any(ends[a] > spans[b][0] for a, b in zip(order, order[1:]))):
            raise ValueError(f"causal attention: spans {spans} do not lie in the step's {tokens} tokens "
                             f"without overlapping")
        kv_heads = k.shape[1]
        work = [n * n for _, n in spans]  # a prompt's cost grows as its length squared
        threads = torch.get_num_threads() if sum(work) >= MIN_CAUSAL_WORK_TO_SPLIT else 1
        # One chunk per thread: every prompt over a share of the KV heads (equal work whatever the
        # lengths, one long prompt included), or, with fewer KV heads than threads, runs of
        # consecutive prompts of about equal work.
        if kv_heads < threads and len(spans) > 1:
            bounds, acc, total = [0], 0, sum(work)
            for i, w in enumerate(work):
                acc += w
                if len(bounds) < threads and acc * threads >= total * len(bounds):
                    bounds.append(i + 1)
            bounds.append(len(spans))
            chunks = [(lo, hi, 0, kv_heads) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        else:
            parts = min(threads, kv_heads)  # 1 when not split
            chunks = [(0, len(spans), kv_heads * c // parts, kv_heads * (c + 1) // parts) for c in range(parts)]
        meta = torch.tensor(spans, dtype=torch.int64).reshape(-1, 2).t().contiguous()  # [2, S]: starts, lens
        npad = (max(n for _, n in spans) + 15) // 16 * 16  # a multiple of the C's vector width (8 or 16 floats)
        per_chunk = (head_dim + 8) * npad  # transposed keys + scores of one tile (TILE = 8)
        scratch = self._scratch(len(chunks) * per_chunk)
        sp, lp, scp = meta[0].data_ptr(), meta[1].data_ptr(), scratch.data_ptr()
        args = (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
                out.stride(0))

        def run(c: int) -> None:
            lo, hi, g_lo, g_hi = chunks[c]
            self._causal(*args, sp + lo * 8, lp + lo * 8, hi - lo, heads, kv_heads, g_lo, g_hi, head_dim, scale,
                         scp + c * per_chunk * 4)

        cpu_graph.launch(run_chunks, run, len(chunks), name="causal_self_attention_f32")
        return True

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> bool:
        """Write token ``t``'s ``k[t]`` and ``v[t]`` (``[T, kv_heads, head_dim]`` fp32, each token's
        heads contiguous) at slot ``slot_mapping[t]`` (int64 ``[T]``, contiguous; -1: skipped) of
        the caches (``[num_blocks, block_size, kv_heads, head_dim]``, contiguous, both fp32 or both
        bf16: rounded to nearest, ties to even, as ``Tensor.to(torch.bfloat16)``). Returns False,
        writing nothing, for tensors it does not take (the caller then uses ``index_copy_``).

        Raises:
            IndexError: a slot outside ``[-1, num_blocks * block_size)``, naming it.
        """
        tokens = k.shape[0]
        if (k.dim() != 3 or v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape
                or slot_mapping.shape != (tokens,) or slot_mapping.dtype is not torch.int64
                or not slot_mapping.is_contiguous() or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
            return False
        if (k.dtype is not torch.float32 or v.dtype is not torch.float32 or k_cache.dtype not in KV_DTYPES
                or v_cache.dtype is not k_cache.dtype or not all(t.is_cpu for t in (k, v, k_cache, v_cache))):
            return False
        row = k.shape[1] * k.shape[2]
        if tokens > 1 and (k.stride(1) != k.shape[2] or k.stride(2) != 1 or v.stride(1) != v.shape[2]
                           or v.stride(2) != 1):
            return False
        if tokens == 1 and not (k[0].is_contiguous() and v[0].is_contiguous()):
            return False
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        args = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), tokens, row,
                k_cache.data_ptr(), v_cache.data_ptr(), num_slots)

        _, _, store_fn, store_packed = self._by_dtype[k_cache.dtype]

        def store() -> None:
            bad = store_fn(*args)
            if bad >= 0:
                raise IndexError(f"KV cache write: slot {int(slot_mapping[bad])} (token {bad}) is outside the "
                                 f"cache's {num_slots} slots")

        cpu_graph.launch(store, name=f"paged_store_kv_{KV_DTYPES[k_cache.dtype]}", native=(store_packed, args))
        return True
