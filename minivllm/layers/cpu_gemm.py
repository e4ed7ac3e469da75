"""CPU linears in float32 through our panel GEMM (``csrc/panel_gemm_f32.c``), built at first use.

Why: a decode step multiplies a few rows by every weight, and should cost about one read of
the weights whatever the row count. The libraries torch ships do not do that on the 2-core dev
EPYC (AVX2): ``python scripts/probe_cpu_gemm.py`` (2026-12-01 23:04 UTC, one thread, load 0.9),
the four linears of one Qwen3-0.6B layer cycled over three copies of them (180 MiB, so every
read comes from memory), milliseconds per pass:

    rows                     1      2      4      8     16
    F.linear (MKL)         13.1   29.9   37.2   39.1   48.4
    oneDNN, 1-row layout   13.0   26.2   30.2   33.2   47.4
    oneDNN, 8-row layout   13.3   14.8   21.3   26.0   38.4
    panel GEMM (this)      10.9   11.5   16.0   15.7   30.0

and on cache-resident prefill shapes (64-512 rows) it ran level with them (58-69 GFLOP/s against
48-73). A shared machine's memory speed varies by 1.5x from run to run (8 rows coming out faster
than 4 here was not repeated in other runs); compare within a run. Built where the CPU has AVX-512,
the kernel's passes of two or more rows use 512-bit vectors (same bits); on a 2-core Xeon (one thread,
2026-12-02) they ran cache-resident linears at 167-198 GFLOP/s from 32 rows up, against 104-117 for the
256-bit passes and 101-187 for ``F.linear``, and took 1024 -> 3072 at 4 rows in 0.45 ms against MKL's 0.89.

The C code splits the panels over ``torch.get_num_threads()`` threads of its own (a persistent
pool that polls briefly between calls, then sleeps; see the source for why).

A weight ``[N, K]`` (``N`` a multiple of 16) is stored as panels ``[N / 16, K, 16]``, or in groups of
four panels ``[N / 64, K, 64]`` (:func:`pack_panels`): a 3-D tensor in a linear layer's ``weight`` means
this layout, and
:func:`unpack_panels` gives back the plain float32 weight. Packing replaces the weight (no second copy).
``MINIVLLM_CPU_GEMM=0`` (read when an engine packs its weights) leaves the layers to oneDNN.

int8 panels. :meth:`PanelGemm.run_int8` multiplies by a per-output-channel int8 weight
(``quantization="int8"``, :mod:`minivllm.quantization.int8`) held as int8 panels: each value widened
to float32 as it is read, the scale applied once per output at the end (weight-only; a decode step
reads a quarter of the float32 bytes).

16-bit panels. A float32 weight whose every value is a float16 (or a bfloat16) value, as when a
checkpoint stored in that type is loaded into a float32 model, is held in that type
(:func:`compact_dtype`): the kernel widens each value back to the same float32 as it loads it
(exact), multiplies in float32 as before, and reads half the bytes. Same results bit for bit;
half the memory. Where ``N`` is a multiple of 64, panels go in groups of four in an AVX-512 build
(:func:`pack_panels`). Measured on the dev EPYC (Zen 4, AVX-512, one thread, 2026-12-03, medians of
interleaved passes): the embedded model's linears (float16 checkpoint) at 1 / 4 / 32 rows took
0.69 / 0.66 / 0.94x the float32 panels' time; Qwen3-0.6B layer shapes streamed from memory at
1 / 4 / 8 rows 0.61 / 0.62 / 0.60x (float16) and 0.65 / 0.64 / 0.58x (bfloat16), level at 32 rows
(``python scripts/probe_cpu_gemm.py`` compares them). ``MINIVLLM_PANELS_16BIT=0`` (or false, no,
off; read when weights are packed) keeps every panel in float32, and the startup log says so.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from minivllm.layers.cpu_graph import capturing, launch, packed_address
from minivllm.layers.native_build import NativeLibrary
from minivllm.utils.env_switch import switched_off
from minivllm.utils.hugepages import HUGE_PAGE, zeroed_cpu_tensor

__all__ = ["PanelGemm", "compact_dtype", "describe", "is_panels", "load", "pack_panels", "packable",
           "unavailable_reason", "unpack_panels"]

SOURCE = Path(__file__).with_name("csrc") / "panel_gemm_f32.c"
ENV_SWITCH = "MINIVLLM_CPU_GEMM"
ENV_16BIT = "MINIVLLM_PANELS_16BIT"
PANEL = 16  # output columns per panel (the kernel's NR)
F32 = torch.float32
#: panel dtype -> the kernel's weight-type code (WT_* in the C source)
_WEIGHT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_INT8 = 3  # WT_I8: int8 panels, always with a scale per output (run_int8)
_GROUPED = 8  # WT_GROUPED: a flag on any weight type, panels in groups of GROUP_PANELS ([N / 64, K, 64])
GROUP_PANELS = 4
#: below this many multiply-adds per extra thread, waking another thread (a few microseconds) costs
#: more than it saves
MIN_MACS_PER_THREAD = 1 << 18
#: rows of a weight :func:`compact_dtype` checks at a time
_CHECK_ROWS = 1024
#: a call multiplies at most this many rows: the kernel reads the rows once per panel, so for a
#: prefill of thousands of tokens they must stay in the L2 cache between panels. Measured on the
#: dev EPYC (one thread, 4004 rows): 1024 -> 4096 and 3072 -> 1024 at 31-34 GFLOP/s in one call,
#: 57-68 in calls of 256 rows (F.linear 64-66); 128-512 rows within the machine's noise of that
ROWS_PER_CALL = 256

_library = NativeLibrary(SOURCE, ENV_SWITCH, lambda lib: PanelGemm(lib))


def load() -> "PanelGemm | None":
    """The compiled GEMM, built on first use; ``None`` when switched off or unbuildable (see
    :func:`unavailable_reason`). Thread-safe; builds at most once per process."""
    return _library.load()


def loaded() -> "PanelGemm | None":
    """The GEMM if :func:`load` has built it in this process, else ``None`` (no lock, no
    environment lookup: for the per-call path; packing called :func:`load`)."""
    return _library.loaded()


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it did not)."""
    return _library.unavailable_reason()


def describe() -> str:
    """Where the loaded library came from (for the startup log)."""
    return f"panel GEMM ({_library.path})"


def packable(weight: torch.Tensor) -> bool:
    """A dense 2-D float32 CPU weight with a multiple of 16 rows (output features)."""
    return (weight.dtype == F32 and weight.device.type == "cpu" and weight.dim() == 2 and not weight.is_mkldnn
            and weight.shape[0] % PANEL == 0)


def compact_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype that holds every value of float32 ``weight`` exactly (float16 first: its
    widening is one instruction), or ``None`` (some value needs float32, the loaded GEMM does not
    take the type, or ``MINIVLLM_PANELS_16BIT=0``). Checks ``_CHECK_ROWS`` rows at a time, so the
    temporaries stay small (a 0.6B model's LM head is 622 MB) and a float32 weight is usually
    refused at its first rows."""
    gemm = loaded() or load()
    if gemm is None or weight.dtype != F32 or sixteen_bit_switched_off():
        return None
    w = weight.detach()
    for dtype in (torch.float16, torch.bfloat16):
        if dtype in gemm.panel_dtypes and all(_exact_in(part, dtype) for part in w.split(_CHECK_ROWS)):
            return dtype
    return None


def sixteen_bit_switched_off() -> bool:
    """``MINIVLLM_PANELS_16BIT`` is 0, false, no or off (as the kernels' other switches)."""
    return switched_off(ENV_16BIT)


def _exact_in(w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every value of ``w`` comes back from ``dtype`` with the same bits. Bits, not values: a NaN's
    payload or a float32 subnormal that compares equal to 0 under flush-denormal mode would
    otherwise change in the round trip (a reviewer's find)."""
    bits = w.view(torch.int32)
    if dtype == torch.bfloat16 and bool((bits & 0xFFFF).any()):
        return False  # a bfloat16 value is a float32 whose low 16 bits are zero: the cheap refusal first
    return torch.equal(w.to(dtype).to(F32).view(torch.int32), bits)


def is_panels(t: torch.Tensor) -> bool:
    """``t`` has the panel layout's shape ``[N / 16, K, 16]`` or the grouped one's ``[N / 64, K, 64]``
    (a linear layer's weight is 2-D otherwise, so in a weight this shape means panels)."""
    return not t.is_mkldnn and t.dim() == 3 and t.shape[2] in (PANEL, PANEL * GROUP_PANELS)


def pack_panels(weight: torch.Tensor, dtype: torch.dtype = F32, grouped: bool | None = None) -> torch.Tensor:
    """``weight [N, K]`` (float32, CPU, ``N % 16 == 0``) -> panels ``[N / 16, K, 16]`` in ``dtype``,
    contiguous: ``panels[b, k, j] == weight[16 * b + j, k]`` (a new allocation). A 16-bit ``dtype``
    should come from :func:`compact_dtype` (else values are rounded: the results change). ``torch.int8``:
    ``weight`` is an int8 quantised weight, for :meth:`PanelGemm.run_int8`.

    ``grouped`` (default: where the loaded GEMM's build prefers them, :attr:`PanelGemm.prefers_groups`:
    AVX-512) and ``N % 64 == 0``: the panels go in
    groups of four, ``[N / 64, K, 64]`` with ``panels[c, k, j] == weight[64 * c + j, k]``, so that a pass
    over four panels reads one stream of whole cache lines; the same bits either way (``WT_GROUPED`` in
    the C source, with the measurements: at one row int8 panels stream ~40% faster grouped, 16-bit ones
    ~10-18%, float32 ones ~5%, and from 4 rows on every type 5-30%). ``random:qwen3-0.6b`` (float32
    panels) in two engines in one process taking turns (dev EPYC Zen 4, one thread, 2026-12-07): a
    512-token prefill 4.85-4.94 s grouped against 5.59-5.67 s, batch-16 decode steps 200-207 against
    232-233 ms; the embedded model (float16 panels) batch-1 decode 0.21 against 0.25-0.27 ms.

    2 MiB pages are asked for where the panels fill one or more
    (:func:`minivllm.utils.hugepages.zeroed_cpu_tensor`): a decode step streams every weight from
    memory, and the hardware prefetcher stops at each page's end. ``random:qwen3-0.6b``'s batch-1
    decode, two engines in one process taking turns (dev EPYC Zen 4, one thread, 2026-12-07, median
    ITL of rounds 2-4): float32 76.8-77.8 ms with them against 79.3-81.2 ms without, int8 22.5-22.7
    against 24.1-24.3 ms.

    Raises:
        ValueError: ``dtype`` is not float32, float16, bfloat16 or int8."""
    if dtype not in _WEIGHT_TYPES and dtype != torch.int8:
        raise ValueError(f"panels hold float32, float16, bfloat16 or int8 values, not {dtype}")
    n, k = weight.shape
    if grouped is None:
        lib = loaded()
        grouped = lib is not None and lib.prefers_groups
    width = PANEL * GROUP_PANELS if grouped and n % (PANEL * GROUP_PANELS) == 0 else PANEL
    shape = (n // width, k, width)
    if weight.device.type == "cpu" and n * k * dtype.itemsize >= HUGE_PAGE:
        panels, _ = zeroed_cpu_tensor(shape, dtype)  # 2 MiB pages: a decode step streams every panel (above)
    else:
        panels = torch.empty(shape, dtype=dtype, device=weight.device)
    return panels.copy_(weight.detach().reshape(n // width, width, k).transpose(1, 2))  # (one copy, converting)


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """Panels ``[N / 16, K, 16]`` (or grouped panels ``[N / 64, K, 64]``) -> the plain float32 weight
    ``[N, K]`` (a new allocation; 16-bit and int8 panels widened, exactly)."""
    nb, k, nr = panels.shape
    return panels.transpose(1, 2).reshape(nb * nr, k).to(F32)


def _weight_type(panels: torch.Tensor, int8: bool = False) -> int:
    """The C code's weight-type code (``WT_*``) for ``panels``: int8 (with scales) or the panels' dtype, with
    the grouped flag for ``[N / 64, K, 64]`` panels."""
    return (_INT8 if int8 else _WEIGHT_TYPES[panels.dtype]) | (_GROUPED if panels.shape[2] != PANEL else 0)


def _parts(rows: int, n: int, k: int, nb: int) -> int:
    """Threads a call of ``rows`` rows over ``nb`` units (panels, or groups of grouped panels: the C code
    splits at whole groups; ``n`` outputs, ``k`` inputs) is split over: torch's thread count, at most one
    per unit, each with ``MIN_MACS_PER_THREAD`` or more."""
    return max(1, min(torch.get_num_threads(), nb, rows * n * k // MIN_MACS_PER_THREAD))


class PanelGemm:
    """The loaded C function with the layout checks and the split over threads."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.panel_gemm_parallel_w
        self._fn.argtypes = [ctypes.c_int, p, i64, p, p, p, i64, i64, p, i64, i64, ctypes.c_int]
        self._fn.restype = None
        lib.panel_gemm_has_f16.restype = ctypes.c_int
        lib.panel_gemm_prefers_groups.restype = ctypes.c_int
        #: whether :func:`pack_panels` groups panels by default: where this build's passes read four panels
        #: at once (AVX-512; see the C source's panel_gemm_prefers_groups)
        self.prefers_groups = bool(lib.panel_gemm_prefers_groups())
        #: ``parallel_run(fn, ctx, parts)``: the C function at address ``fn`` called as
        #: ``fn(ctx, part, n)`` for each part on this library's threads (see ``native_parallel_run``
        #: in the C source); the CPU decode attention splits its rows through it
        self.parallel_run = lib.native_parallel_run
        self.parallel_run.argtypes = [p, p, ctypes.c_int]
        self.parallel_run.restype = None
        #: the packed twins (``csrc/packed_call.h``) of ``parallel_run`` and of the GEMM, which a CPU
        #: graph replays from C
        self.parallel_run_packed = packed_address(lib, "native_parallel_run")
        self._fn_packed = packed_address(lib, "panel_gemm_parallel_w")
        self._greedy = lib.panel_gemm_greedy_w
        self._greedy.argtypes = [ctypes.c_int, p, i64, p, p, i64, i64, p, i64, i64, i64, p]
        self._greedy.restype = i64
        #: the dtypes panels may hold: float16 where this build widens it in hardware (x86 F16C)
        self.panel_dtypes = frozenset(dt for dt in _WEIGHT_TYPES
                                      if dt != torch.float16 or lib.panel_gemm_has_f16())

    def takes(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Float32 CPU ``x [..., K]`` (``K >= 1``) with unit stride along ``K`` and contiguous CPU
        panels of that ``K`` in a dtype of :attr:`panel_dtypes`, neither needing gradients (the C
        code records no autograd graph), a contiguous float32 bias ``[N]`` or none."""
        if (x.dtype is not F32 or not x.is_cpu or x.requires_grad or x.dim() == 0 or x.stride(-1) != 1
                or panels.dtype not in self.panel_dtypes or not panels.is_cpu or panels.requires_grad
                or not is_panels(panels)
                or x.shape[-1] != panels.shape[1] or x.shape[-1] == 0 or not panels.is_contiguous()):
            return False
        return bias is None or (bias.dtype is F32 and bias.is_cpu and bias.is_contiguous()
                                and not bias.requires_grad and bias.shape == (panels.shape[0] * panels.shape[2],))

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ W.T (+ bias)`` -> float32 ``[..., N]`` for ``W`` held as ``panels``
        ``[N / 16, K, 16]`` or grouped ``[N / 64, K, 64]`` (float32, or 16-bit values widened to float32
        as they are read), split over ``torch.get_num_threads()`` threads by panels (groups) when the
        work is large enough.

        Raises:
            ValueError: inputs :meth:`takes` refuses (the caller checks first).
        """
        if not self.takes(x, panels, bias):
            raise ValueError(f"panel GEMM: x {x.dtype} {tuple(x.shape)} on {x.device}, panels {panels.dtype} "
                             f"{tuple(panels.shape)}: needs float32 CPU tensors (panels: one of "
                             f"{sorted(str(d) for d in self.panel_dtypes)}), x [..., K] with unit stride "
                             f"along K, contiguous panels [N/16, K, 16] or [N/64, K, 64], no gradients")
        return self.run(x, panels, bias)

    def run_greedy(self, x: torch.Tensor, panels: torch.Tensor, cols: int) -> tuple[torch.Tensor, np.ndarray] | None:
        """``y = x @ W.T`` as :meth:`run` (no bias), and each row's greedy token: the column of its
        first maximum among ``y``'s first ``cols`` columns, -1 for a row where one of them is NaN or
        an infinity (as ``CpuFusedOps.greedy_ids``), found while the GEMM writes them (see the C
        source). For a plain greedy step's LM head.

        Args:
            x: float32 ``[m, K]`` taken by :meth:`takes`; panels: ``[N / 16, K, 16]`` or ``[N / 64, K, 64]``.
            cols: the logits' columns (``N`` less the head's padding), ``1 <= cols <= N``.

        Returns:
            ``(y [m, N], ids)`` with ``ids`` int64 numpy ``[m]``; ``None`` where it does not apply
            (another shape, more rows than one call takes, or a GEMM large enough to split over
            threads: :meth:`run` then, and the sampler's pass).
        """
        if x.dim() != 2 or not 1 <= x.shape[0] <= ROWS_PER_CALL or not self.takes(x, panels, None):
            return None
        (m, k), nb = x.shape, panels.shape[0] * panels.shape[2] // PANEL
        n = nb * PANEL
        if not 1 <= cols <= n or _parts(m, n, k, panels.shape[0]) > 1 or capturing() is not None:
            return None  # (a head's ids are read on the host: not a graph's call)
        y = torch.empty(m, n, dtype=F32, device="cpu")
        ids = np.empty(m, dtype=np.int64)
        stride = x.stride(0) if m > 1 else k
        status = []  # through launch, so count_calls sees it (a head runs outside CPU graphs: never recorded)
        wt = _weight_type(panels)
        launch(lambda: status.append(self._greedy(wt, x.data_ptr(), stride, panels.data_ptr(),
                                                  None, m, k, y.data_ptr(), n, nb, cols, ids.ctypes.data)),
               name="panel_gemm_greedy_w")
        return (y, ids) if status == [0] else None

    def run(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None,
            scale: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`__call__` without the checks, for a caller that has just called :meth:`takes`; or, with
        ``scale``, :meth:`run_int8`'s product."""
        flat = x.dim() == 2  # the layers' case: no reshapes (each costs microseconds per call)
        x2 = x if flat else x.reshape(-1, x.shape[-1])  # unit stride along k either way
        m, k = x2.shape
        nb = panels.shape[0] * panels.shape[2] // PANEL  # (grouped panels: four per group)
        n = nb * PANEL
        y = torch.empty(m, n, dtype=F32, device="cpu")
        if m:
            # the C code splits the panels over its own threads (torch's thread count of them); it
            # returns when all are written, so an interrupt can only arrive after the call
            rows = min(m, ROWS_PER_CALL)
            parts = _parts(rows, n, k, panels.shape[0])  # (grouped panels: one group a unit)
            wt = _weight_type(panels, int8=scale is not None)
            xp, stride, pp = x2.data_ptr(), x2.stride(0) if m > 1 else k, panels.data_ptr()
            sp, bp = scale.data_ptr() if scale is not None else None, bias.data_ptr() if bias is not None else None
            yp = y.data_ptr()
            for r0 in range(0, m, rows):  # one call for a decode step; a prefill's rows in L2-sized chunks
                args = (wt, xp + r0 * stride * 4, stride, pp, sp, bp, min(rows, m - r0), k, yp + r0 * n * 4, n, nb,
                        parts)
                launch(self._fn, *args, name="panel_gemm_parallel_w", native=(self._fn_packed, args))
        return y if flat else y.reshape(*x.shape[:-1], n)

    def run_int8(self, x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ (Q * scale[:, None]).T (+ bias)`` -> float32 ``[..., N]`` for an int8 weight ``Q``
        held as int8 panels ``[N / 16, K, 16]`` or ``[N / 64, K, 64]`` (:func:`pack_panels` with
        ``torch.int8``) and its fp32 per-output-channel ``scale [N]``: weight-only, each int8 value
        widened to float32 as it is read, ``x`` untouched; the scale applied once per output after the sum
        over ``K``. Split over threads
        as :meth:`run`. The caller passes float32 CPU ``x`` with unit stride along ``K``, contiguous int8
        panels of that ``K``, a contiguous float32 ``scale`` and ``bias`` (or none) of ``N``.

        Raises:
            ValueError: ``panels`` are not int8, ``scale`` or ``bias`` not a contiguous float32 ``[N]``, or
                ``x``'s last dimension is not the panels' ``K`` (the C code would read past their end)."""
        layout = panels.dim() == 3 and panels.shape[2] in (PANEL, PANEL * GROUP_PANELS)
        n = panels.shape[0] * panels.shape[2] if layout else -1
        if (panels.dtype != torch.int8 or not layout or scale.dtype is not F32 or not scale.is_contiguous()
                or scale.shape != (n,)):
            raise ValueError(f"run_int8: int8 panels and a contiguous float32 scale of their N outputs, got panels "
                             f"{panels.dtype} {tuple(panels.shape)} and scale {scale.dtype} {tuple(scale.shape)}")
        if x.dim() == 0 or x.shape[-1] != panels.shape[1] or x.dtype is not F32 or not x.is_cpu or x.stride(-1) != 1:
            raise ValueError(f"run_int8: x {x.dtype} {tuple(x.shape)} on {x.device} for a weight of {panels.shape[1]} "
                             f"input features: a float32 CPU x [..., {panels.shape[1]}] with unit stride along it")
        if bias is not None and (bias.dtype is not F32 or not bias.is_contiguous() or bias.shape != (n,)):
            raise ValueError(f"run_int8: bias {bias.dtype} {tuple(bias.shape)} for {n} outputs: a contiguous float32 "
                             f"[{n}] or None")
        return self.run(x, panels, bias, scale)
