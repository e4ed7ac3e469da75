"""The small per-layer ops (RMSNorm, residual add + RMSNorm, rotary embedding, SiLU-and-multiply)
as one C call each on the CPU in float32: ``csrc/cpu_fused_f32.c``, built at first use.

Why: in eager PyTorch each is several ATen ops, and on a small CPU every op pays microseconds of
dispatch before it touches a byte; at decode sizes that dispatch is the whole cost. Measured on
the 2-core dev EPYC, one thread, 32 tokens of the embedded model: RMSNorm over 256 features
43 us, q_norm over 4 heads of 64 58 us, RoPE of q and k 107 us, SiLU-and-multiply 56 us
(``notebooks/11_optimizations.py`` measures both paths on the machine it runs on).

:meth:`ModelRunner.enable_cpu_fused_ops` points every ``RMSNorm``, ``RotaryEmbedding`` and
``SiluAndMul`` at one :class:`CpuFusedOps` (their ``fused`` attribute); each method falls back
to the module's torch reference for anything the C code does not take (another dtype or device,
an unusual layout, a tensor that needs gradients). A large input (a prefill) is split by rows over
torch's thread count (``native_parallel.run_chunks``): every row is computed the same way whatever
the split, so tensor-parallel ranks running with different thread counts agree bit for bit. The modules
stay in the model, so forward hooks on them still fire. ``MINIVLLM_CPU_FUSED_OPS=0`` switches
this off (read at every engine start).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from minivllm.layers.cpu_graph import launch, packed_address
from minivllm.layers.native_build import NativeLibrary
from minivllm.layers.native_parallel import run_chunks

__all__ = ["CpuFusedOps", "describe", "load", "unavailable_reason"]

SOURCE = Path(__file__).with_name("csrc") / "cpu_fused_f32.c"
ENV_SWITCH = "MINIVLLM_CPU_FUSED_OPS"
F32 = torch.float32  # outputs name it and device="cpu": the C code writes float32 CPU memory whatever
#                     torch's default dtype and device are
#: elements per thread below which an op is not split (handing a chunk to a Python thread costs
#: ~0.1 ms; a C pass over 256 K floats takes about that). Until session 7 larger inputs went to the
#: torch ops instead, which on one thread took 13.4 ms for the embedded model's prefill SiLU of
#: 4004 x 768 (dev EPYC, 2026-12-02) where this loop takes a few.
MIN_ELEMENTS_PER_THREAD = 1 << 18

_library = NativeLibrary(SOURCE, ENV_SWITCH, lambda lib: CpuFusedOps(lib))


def switched_off() -> bool:
    """``MINIVLLM_CPU_FUSED_OPS`` is set to 0 / false / no / off (read at every call)."""
    return _library.switched_off()


def load() -> "CpuFusedOps | None":
    """The compiled ops, built on first use; ``None`` when switched off or unbuildable (see
    :func:`unavailable_reason`). Thread-safe; builds at most once per process."""
    return _library.load()


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it did not)."""
    return _library.unavailable_reason()


def describe(dtype: torch.dtype | None = None) -> str:
    """One line for the startup log: which path the per-layer small ops of a CPU model in
    ``dtype`` take."""
    if dtype is not None and dtype != F32:
        return f"torch ops (the C ops compute float32; this model runs in {dtype})"
    if switched_off():
        return f"torch ops (switched off: {unavailable_reason()})"
    if load() is None:
        return f"torch ops (fused C ops unavailable: {unavailable_reason()})"
    return f"fused C ops ({_library.path})"


def _position_error(positions: torch.Tensor, token: int, max_position: int) -> IndexError:
    """The error for a RoPE position outside the cos/sin table, naming it and its token."""
    return IndexError(f"rotary embedding: position {int(positions[token])} (token {token}) is outside the table "
                      f"of {max_position} positions (max_position_embeddings)")


class CpuFusedOps:
    """The loaded C functions. Every method computes what the torch reference does
    (``minivllm.layers.norm``, ``rotary``, ``activation``), or returns ``None`` for inputs the
    C code does not take, and the calling module runs its reference instead."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._rms = lib.rms_norm_f32
        self._rms.argtypes = [p, i64, i64, i64, i64, p, p, i64, f32]
        self._add_rms = lib.add_rms_norm_f32
        self._add_rms.argtypes = [p, p, p, p, p, i64, i64, f32]
        self._rope = lib.rope_f32
        self._rope.argtypes = [p, i64, i64, i64, i64, p, p, i64, p, i64]
        self._rope.restype = i64
        self._silu = lib.silu_and_mul_f32
        self._silu.argtypes = [p, i64, i64, p, i64]
        self._embedding = lib.embedding_f32
        self._embedding.argtypes = [p, i64, i64, p, i64, p]
        self._embedding.restype = i64
        self._qk_norm_rope = lib.qk_norm_rope_f32
        self._qk_norm_rope.argtypes = [p, i64, i64, i64, p, i64, i64, i64, i64, i64, p, f32, p, f32, p, p, i64, p, p]
        self._qk_norm_rope.restype = i64
        self._argmax = lib.argmax_rows_f32
        self._argmax.argtypes = [p, i64, i64, i64, p]
        self._argmax.restype = None
        self._int8_in = lib.int8_rows_in_f32
        self._int8_in.argtypes, self._int8_in.restype = [p, i64, i64, i64, p, p, p], None
        self._int8_out = lib.int8_rows_out_f32
        self._int8_out.argtypes, self._int8_out.restype = [p, i64, i64, p, p, p, p], None
        for fn in (self._rms, self._add_rms, self._silu):
            fn.restype = None
        # the packed twins a CPU graph replays from C (cpu_graph.launch's ``native``)
        self._packed = {name: packed_address(lib, name) for name in (
            "rms_norm_f32", "add_rms_norm_f32", "rope_f32", "silu_and_mul_f32", "embedding_f32", "qk_norm_rope_f32")}

    @staticmethod
    def _takes(x: torch.Tensor, *others: torch.Tensor) -> bool:
        """All fp32 CPU tensors with unit stride in the last dim, none needing gradients (the C
        code records no autograd graph). (Plain attribute checks: this runs several times per
        layer and step.)"""
        for t in (x, *others):
            if t.dtype is not F32 or not t.is_cpu or t.stride(-1) != 1 or t.requires_grad:
                return False
        return True

    @staticmethod
    def _split(rows: int, numel: int, run) -> None:
        """``run(lo, hi)`` over row ranges covering ``range(rows)``, one range per thread (at most
        ``torch.get_num_threads()``, each of at least ``MIN_ELEMENTS_PER_THREAD``), run
        concurrently. The methods call the C function directly below ``2 * MIN_ELEMENTS_PER_THREAD``
        (a decode step: no closure, no extra call)."""
        chunks = min(torch.get_num_threads(), rows, numel // MIN_ELEMENTS_PER_THREAD)
        if chunks <= 1:
            run(0, rows)
            return
        run_chunks(lambda c: run(rows * c // chunks, rows * (c + 1) // chunks), chunks)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``x [..., D]`` (a 2-D matrix or a 3-D ``[T, H, D]`` view with any outer strides) ->
        contiguous ``weight * x / sqrt(mean(x**2) + eps)`` of the same shape; ``None`` for
        inputs the C code does not take."""
        if (x.dim() not in (2, 3) or not self._takes(x, weight) or not weight.is_contiguous()
                or weight.shape != x.shape[-1:]):
            return None
        if x.dim() == 2:
            (outer, dim), inner, s_inner = x.shape, 1, 0
            out = torch.empty(outer, dim, dtype=F32, device="cpu")  # int sizes: a torch.Size costs 2x the call
        else:
            (outer, inner, dim), s_inner = x.shape, x.stride(1)
            out = torch.empty(outer, inner, dim, dtype=F32, device="cpu")
        xp, s_outer, wp, op = x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr()
        if outer * inner * dim < 2 * MIN_ELEMENTS_PER_THREAD:
            args = (xp, outer, inner, s_outer, s_inner, wp, op, dim, float(eps))
            launch(self._rms, *args, name="rms_norm_f32", native=(self._packed["rms_norm_f32"], args))
            return out
        launch(self._split, outer, out.numel(), lambda lo, hi: self._rms(
            xp + lo * s_outer * 4, hi - lo, inner, s_outer, s_inner, wp, op + lo * inner * dim * 4, dim, eps),
            name="rms_norm_f32")
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """``(rms_norm(x + residual), x + residual)`` for ``x, residual [T, D]``; ``None`` for
        inputs the C code does not take."""
        if (x.dim() != 2 or x.shape != residual.shape or not self._takes(x, residual, weight)
                or not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous())
                or weight.shape != x.shape[-1:]):
            return None
        total, out = torch.empty_like(x), torch.empty_like(x)
        (rows, dim), wp = x.shape, weight.data_ptr()
        xp, rp, tp, op = x.data_ptr(), residual.data_ptr(), total.data_ptr(), out.data_ptr()
        if rows * dim < 2 * MIN_ELEMENTS_PER_THREAD:
            args = (xp, rp, wp, tp, op, rows, dim, float(eps))
            launch(self._add_rms, *args, name="add_rms_norm_f32", native=(self._packed["add_rms_norm_f32"], args))
            return out, total
        launch(self._split, rows, x.numel(), lambda lo, hi: self._add_rms(
            xp + lo * dim * 4, rp + lo * dim * 4, wp, tp + lo * dim * 4, op + lo * dim * 4, hi - lo, dim, eps),
            name="add_rms_norm_f32")
        return out, total

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor | None:
        """``x [T, H, D]`` rotated by ``positions`` (int64 ``[T]``) through the fp32 table
        ``cos_sin [max_position, D]`` -> contiguous ``[T, H, D]``; ``None`` for inputs the C
        code does not take (the caller then runs the reference).

        Raises:
            IndexError: a position outside ``[0, max_position)``, naming it.
        """
        if (x.dim() != 3 or not self._takes(x, cos_sin) or not cos_sin.is_contiguous()
                or positions.dtype is not torch.int64 or not positions.is_cpu or not positions.is_contiguous()
                or positions.shape != (x.shape[0],) or cos_sin.shape[1] != x.shape[2] or x.shape[2] % 2):
            return None
        tokens, heads, dim = x.shape
        out = torch.empty(tokens, heads, dim, dtype=F32, device="cpu")
        xp, s_tok, s_head, pp, op = x.data_ptr(), x.stride(0), x.stride(1), positions.data_ptr(), out.data_ptr()
        cp, max_position = cos_sin.data_ptr(), cos_sin.shape[0]

        def run(lo: int, hi: int) -> None:
            found = self._rope(xp + lo * s_tok * 4, hi - lo, heads, s_tok, s_head, pp + lo * 8, cp, max_position,
                               op + lo * heads * dim * 4, dim)
            if found >= 0:  # raised here, so a CPU graph's replay checks too
                raise _position_error(positions, lo + found, max_position)

        if tokens * heads * dim < 2 * MIN_ELEMENTS_PER_THREAD:
            launch(run, 0, tokens, name="rope_f32", native=(self._packed["rope_f32"], (
                xp, tokens, heads, s_tok, s_head, pp, cp, max_position, op, dim)))
        else:
            launch(self._split, tokens, out.numel(), run, name="rope_f32")
        return out

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, eps_q: float, wk: torch.Tensor,
                     eps_k: float, positions: torch.Tensor, cos_sin: torch.Tensor):
        """``(rope(rms_norm(q, wq, eps_q)), rope(rms_norm(k, wk, eps_k)))`` in one C call: Qwen3's
        per-head q/k norms and the rotary embedding of a step, which are four calls through
        :meth:`rms_norm` and :meth:`rope` (each paying its own call and pass over the rows).

        Args:
            q: ``[T, Hq, D]``, k: ``[T, Hk, D]`` fp32 (any token and head strides: views of the fused
                QKV projection's output), ``D`` even and at most 1024.
            wq, wk: the norms' weights, contiguous ``[D]``; eps_q, eps_k: their epsilons.
            positions: int64 ``[T]``, contiguous; cos_sin: the fp32 table ``[max_position, D]``.

        Returns:
            Contiguous ``(q_out [T, Hq, D], k_out [T, Hk, D])``, or ``None`` for inputs the C code
            does not take (the caller then runs the modules).

        Raises:
            IndexError: a position outside ``[0, max_position)``, naming it.
        """
        if (q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]
                or not self._takes(q, k, wq, wk, cos_sin) or not (wq.is_contiguous() and wk.is_contiguous()
                                                                and cos_sin.is_contiguous())):
            return None
        tokens, q_heads, dim = q.shape
        k_heads = k.shape[1]
        if (dim % 2 or dim > 1024 or wq.shape != (dim,) or wk.shape != (dim,) or cos_sin.dim() != 2
                or cos_sin.shape[1] != dim or positions.dtype is not torch.int64 or not positions.is_cpu
                or not positions.is_contiguous() or positions.shape != (tokens,)):
            return None
        q_out = torch.empty(tokens, q_heads, dim, dtype=F32, device="cpu")
        k_out = torch.empty(tokens, k_heads, dim, dtype=F32, device="cpu")
        qp, qs_tok, qs_head = q.data_ptr(), q.stride(0), q.stride(1)
        kp, ks_tok, ks_head = k.data_ptr(), k.stride(0), k.stride(1)
        wqp, wkp, pp, cp, max_position = wq.data_ptr(), wk.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(), \
            cos_sin.shape[0]
        qop, kop = q_out.data_ptr(), k_out.data_ptr()

        def run(lo: int, hi: int) -> None:
            found = self._qk_norm_rope(qp + lo * qs_tok * 4, q_heads, qs_tok, qs_head, kp + lo * ks_tok * 4, k_heads,
                                       ks_tok, ks_head, hi - lo, dim, wqp, eps_q, wkp, eps_k, pp + lo * 8, cp,
                                       max_position, qop + lo * q_heads * dim * 4, kop + lo * k_heads * dim * 4)
            if found >= 0:  # raised here, so a CPU graph's replay checks too
                raise _position_error(positions, lo + found, max_position)

        numel = tokens * (q_heads + k_heads) * dim
        if numel < 2 * MIN_ELEMENTS_PER_THREAD:
            launch(run, 0, tokens, name="qk_norm_rope_f32", native=(self._packed["qk_norm_rope_f32"], (
                qp, q_heads, qs_tok, qs_head, kp, k_heads, ks_tok, ks_head, tokens, dim, wqp, float(eps_q), wkp,
                float(eps_k), pp, cp, max_position, qop, kop)))
        else:
            launch(self._split, tokens, numel, run, name="qk_norm_rope_f32")
        return q_out, k_out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x [T, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[T, I]``; ``None`` for inputs the
        C code does not take."""
        if x.dim() != 2 or x.shape[1] % 2 or not self._takes(x):
            return None
        rows, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, inter, dtype=F32, device="cpu")
        xp, s_row, op = x.data_ptr(), x.stride(0), out.data_ptr()
        if rows * inter < MIN_ELEMENTS_PER_THREAD:  # x has 2 * rows * inter elements
            args = (xp, rows, s_row, op, inter)
            launch(self._silu, *args, name="silu_and_mul_f32", native=(self._packed["silu_and_mul_f32"], args))
            return out
        launch(self._split, rows, x.numel(), lambda lo, hi: self._silu(xp + lo * s_row * 4, hi - lo, s_row,
                                                              op + lo * inter * 4, inter), name="silu_and_mul_f32")
        return out

    def int8_rows_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For the CPU int8 linear (``minivllm.quantization.int8``): ``x [m, k]`` -> ``(x', scales)``,
        each row mapped onto [-1, 1] (``x = mid + half * x'``) in the first ``m`` rows of ``x'``,
        followed by rows holding exactly -1 and 1 (one, two when ``k == 1``); ``scales [2, m]``: mid,
        half. A row holding NaN or an infinity: zeros, mid NaN. ``None`` for inputs the C code does
        not take."""
        if x.dim() != 2 or not self._takes(x) or x.shape[1] == 0:
            return None
        m, k = x.shape
        out = torch.empty(m + (2 if k == 1 else 1), k, dtype=F32, device="cpu")
        scales = torch.empty(2, m, dtype=F32, device="cpu")
        sp = scales.data_ptr()
        launch(self._int8_in, x.data_ptr(), x.stride(0) if m > 1 else k, m, k, out.data_ptr(), sp, sp + 4 * m,
               name="int8_rows_in_f32")
        return out, scales

    def int8_rows_out(self, y: torch.Tensor, scales: torch.Tensor, row_sums: torch.Tensor,
                      bias: torch.Tensor | None) -> None:
        """In place on contiguous ``y [m, n]``: ``y = half[:, None] * y + mid[:, None] * row_sums (+ bias)``
        with ``scales`` from :meth:`int8_rows_in` (undoes its map after the matmul). The caller passes
        what it checked: fp32 contiguous CPU tensors, ``row_sums`` and ``bias`` ``[n]``."""
        m, n = y.shape
        sp = scales.data_ptr()
        launch(self._int8_out, y.data_ptr(), m, n, sp, sp + 4 * m, row_sums.data_ptr(),
               None if bias is None else bias.data_ptr(), name="int8_rows_out_f32")

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
        """``table[ids]``: int64 ``ids [T]`` (contiguous, CPU) into a contiguous fp32 CPU ``table
        [V, D]`` -> contiguous ``[T, D]``, as ``F.embedding``; ``None`` for inputs the C code does not
        take.

        Raises:
            IndexError: an id outside ``[0, V)``, naming it (as ``F.embedding`` raises for one).
        """
        if (ids.dim() != 1 or ids.dtype is not torch.int64 or not ids.is_cpu or not ids.is_contiguous()
                or table.dim() != 2 or not self._takes(table) or not table.is_contiguous()):
            return None
        (tokens,), (vocab, dim) = ids.shape, table.shape
        out = torch.empty(tokens, dim, dtype=F32, device="cpu")
        ids_ptr = ids.data_ptr()
        args = (table.data_ptr(), vocab, dim, ids_ptr, tokens, out.data_ptr())

        def lookup() -> None:
            bad = self._embedding(*args)
            if bad >= 0:  # raised here, so a CPU graph's replay checks too
                # the id read without torch: while a graph records, an ATen read (.item()) is refused
                value = ctypes.c_int64.from_address(ids_ptr + 8 * bad).value
                raise IndexError(f"token embedding: id {value} (token {bad}) is outside the vocabulary of "
                                 f"{vocab} rows")

        launch(lookup, name="embedding_f32", native=(self._packed["embedding_f32"], args))
        return out

    def greedy_ids(self, logits: torch.Tensor) -> np.ndarray | None:
        """Each row's first maximum of fp32 CPU ``logits [N, V]`` (unit stride along V), -1 for a
        row holding a NaN or an infinity: int64 numpy ``[N]``. ``None`` for inputs the C code does
        not take. (Not recorded into a CPU graph: the sampler runs after the forward, outside it.)
        Reads the tensor's memory directly: its ``.numpy()`` view alone cost ~9 us in a step."""
        if logits.dim() != 2 or not self._takes(logits):
            return None
        rows, cols = logits.shape
        if rows and not cols:
            return None  # a row with no logits has no maximum
        out = np.empty(rows, dtype=np.int64)
        if rows:
            self._argmax(logits.data_ptr(), rows, cols, logits.stride(0), out.ctypes.data)
        return out
