"""Prepacked weights for CPU linear layers: our panel GEMM in float32, else oneDNN.

``torch.nn.functional.linear`` on the CPU calls MKL sgemm, which is slow for the few rows of a
decode step (1024 -> 3072 at 4 rows: 2.3 ms vs 0.48 ms prepacked, in the table of the issue that
asked for this path, measured on the 2-core AMD EPYC development machine with torch 2.13.0+cpu,
2026-12-01; ``python -m minivllm bench --sweep`` shows the effect on a step). Two packed forms,
chosen once per weight at load:

* float32 weights with a multiple of 16 output features: panels ``[N / 16, K, 16]`` for our C
  kernel (:mod:`minivllm.layers.cpu_gemm`), which keeps a decode step of a few rows at about the
  cost of one (figures there); held in float16 or bfloat16 when every value of the weight is one
  (a checkpoint stored in 16 bits), which halves the bytes a step reads and changes no result
  (panels in groups of four, ``[N / 64, K, 64]``, where ``N`` and the build allow);
* otherwise (bf16, no C compiler, ``MINIVLLM_CPU_GEMM=0``): oneDNN, the weight reordered once with
  ``torch.ops.mkldnn._reorder_linear_weight`` into its blocked layout (an ``mkldnn`` tensor of
  logical shape ``[out, in]``) and multiplied with ``torch.ops.mkldnn._linear_pointwise``, the pair
  torch's inductor uses for CPU linears with frozen weights.

A layer opts in by defining ``pack_weights()``. :func:`process_weights_after_loading` calls it
on every such module once the weights are loaded; :func:`unpack_weights` undoes it before a
(re)load writes into the parameters. ``state_dict()`` of a packed layer still returns the plain
dense weight (see :class:`PackedWeightMixin`); :func:`dense` converts either form back.
"""
from __future__ import annotations

import functools
import logging
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers import cpu_gemm

logger = logging.getLogger(__name__)

# oneDNN picks its blocked layout for a batch-size hint. Measured one-thread on a loaded 2-core
# EPYC, 2026-12-01 (best of 4-5): on the 0.6B model's layer shapes (8-24 MiB each, streamed from
# memory) the layout for 1 row was as fast as MKL at 1 row and faster at 2-64 rows, while the
# layout for 8 rows cost 1.3-1.9x at 1 row; on the embedded model's shapes (0.25-4 MiB,
# cache-resident) the 8-row layout was faster than the 1-row one at 1-32 rows. The size
# threshold sits between the two measured ranges.
_STREAMED_BYTES = 6 << 20
_HINT_STREAMED, _HINT_CACHED = 1, 8


@functools.lru_cache(maxsize=None)
def onednn_unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why oneDNN prepacked linears cannot run in ``dtype`` on this CPU, or ``None`` if they can.

    Tries a small packed matmul and compares it with ``F.linear`` (some dtypes need CPU
    instructions this machine may lack; torch then raises at reorder time).
    """
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    try:
        gen = torch.Generator().manual_seed(0)  # on the CPU whatever torch's default device (the
        # answer is cached for the process: a probe made under `with torch.device("meta")` failed once for all)
        w = torch.randn(8, 16, generator=gen, device="cpu").to(dtype)
        x = torch.randn(3, 16, generator=gen, device="cpu").to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _HINT_CACHED)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as e:  # unsupported dtype / ISA: torch's message says which
        return str(e).splitlines()[0]
    ref = F.linear(x.float(), w.float())
    if not torch.allclose(y.float(), ref, atol=1e-2, rtol=1e-2):
        return f"oneDNN result differs from F.linear in {dtype}"
    return None


def panels_available(dtype: torch.dtype) -> bool:
    """Whether weights in ``dtype`` can go to our panel GEMM (float32, and the C library builds
    and is not switched off: see :func:`minivllm.layers.cpu_gemm.unavailable_reason`)."""
    return dtype == torch.float32 and cpu_gemm.load() is not None


def _to_panels(weight: torch.Tensor) -> bool:
    """``weight`` goes to the panel GEMM: packable (float32 CPU, ``out % 16 == 0``) and the GEMM loads."""
    return cpu_gemm.packable(weight) and panels_available(weight.dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (dense, CPU) -> a packed copy (a new allocation): panels
    ``[out / 16, in, 16]`` for the panel GEMM when :func:`panels_available` and ``out % 16 == 0``
    (in float16 / bfloat16 when that holds every value exactly: :func:`cpu_gemm.compact_dtype`;
    panels in groups of four, ``[out / 64, in, 64]``, where ``out % 64 == 0`` in an AVX-512 build);
    else oneDNN's blocked layout (an ``mkldnn`` tensor of logical shape ``[out, in]``), laid out
    for one row when the weight is larger than ``_STREAMED_BYTES`` (read from memory every step),
    else for 8 rows (see the measurements above)."""
    if _to_panels(weight):
        return cpu_gemm.pack_panels(weight, cpu_gemm.compact_dtype(weight) or torch.float32)
    big = weight.numel() * weight.element_size() > _STREAMED_BYTES
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _HINT_STREAMED if big else _HINT_CACHED)


def is_packed(t: torch.Tensor) -> bool:
    """``t`` is a packed weight: oneDNN's (``is_mkldnn``) or panels (``[N / 16, K, 16]``, or grouped
    ``[N / 64, K, 64]``: :func:`minivllm.layers.cpu_gemm.pack_panels`)."""
    return t.is_mkldnn or cpu_gemm.is_panels(t)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ weight.T + bias`` for ``x [..., in]``: through the panel GEMM when ``weight``
    is panels (``[out / 16, in, 16]`` or ``[out / 64, in, 64]``), oneDNN when it is an ``mkldnn`` tensor, else
    ``F.linear``. Output ``[..., out]`` in ``x``'s dtype. An input the panel GEMM does not take
    (another dtype, one that needs gradients) gets ``F.linear`` on the unpacked weight."""
    if cpu_gemm.is_panels(weight):
        gemm = cpu_gemm.loaded() or cpu_gemm.load()  # loaded when the weight was packed (this runs per call)
        if gemm is not None and gemm.takes(x, weight, bias):
            return gemm.run(x, weight, bias)
        return F.linear(x, cpu_gemm.unpack_panels(weight).to(x.dtype), None if bias is None else bias.to(x.dtype))
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_greedy(x: torch.Tensor, weight: torch.Tensor, cols: int) -> tuple[torch.Tensor, np.ndarray] | None:
    """``linear(x, weight)`` for an LM head, with each row's greedy token id among the first ``cols``
    outputs found by the panel GEMM as it writes them (``PanelGemm.run_greedy``): ``(y, ids)``, or
    ``None`` where it does not apply (then :func:`linear` and the sampler's own pass)."""
    if not cpu_gemm.is_panels(weight):
        return None
    gemm = cpu_gemm.loaded() or cpu_gemm.load()
    return None if gemm is None else gemm.run_greedy(x, weight, cols)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain ``[out, in]`` strided tensor (a packed weight is converted back; others
    returned as is)."""
    if t.is_mkldnn:
        return t.to_dense()
    return cpu_gemm.unpack_panels(t) if cpu_gemm.is_panels(t) else t


class PackedWeightMixin:
    """For an ``nn.Module`` whose ``weight`` parameter may be packed in place.

    Packing replaces ``self.weight`` with an ``nn.Parameter`` holding the packed tensor (the
    dense copy is freed, so memory is not doubled) and keeps the loader attributes
    (``weight_loader``, ``full_shape``). ``state_dict()`` converts it back to dense, so saving,
    comparing and copying weights into an unpacked model work unchanged; ``load_state_dict()`` into
    a packed model unpacks each layer, loads it and packs it again (new tensors: a CPU graph sees
    the new storage and is recorded again; the engine's roofline keeps the bytes per weight it
    found at load, should new values no longer fit 16-bit panels).
    """

    def _replace_weight(self, data: torch.Tensor) -> None:
        old = self.weight
        new = nn.Parameter(data, requires_grad=False)
        for attr in ("weight_loader", "full_shape"):
            if hasattr(old, attr):
                setattr(new, attr, getattr(old, attr))
        self.weight = new

    #: a packed copy kept beside a shared (tied) dense weight; ``None`` otherwise
    packed_copy: torch.Tensor | None = None

    @property
    def matmul_weight(self) -> torch.Tensor:
        """The weight the forward multiplies by: the packed copy if any, else ``self.weight``."""
        return self.packed_copy if self.packed_copy is not None else self.weight

    def pack_weights(self, shared: bool = False) -> bool:
        """Pack ``self.weight`` if it is a dense CPU tensor; returns whether it is packed now.

        ``shared=True`` (the weight is also another module's, e.g. a tied embedding that needs
        the plain table for lookups): keep the dense parameter and pack a private copy, which
        costs one more copy of this weight.
        """
        w = self.weight
        if is_packed(w) or self.packed_copy is not None:
            return True
        if w.device.type != "cpu" or w.requires_grad:
            return False
        if not _to_panels(w) and onednn_unavailable_reason(w.dtype) is not None:
            return False
        if shared:
            self.packed_copy = pack_weight(w)
        else:
            self._replace_weight(pack_weight(w))
        return True

    def unpack_weights(self) -> None:
        """Back to a dense ``self.weight`` (before new values are loaded into it)."""
        self.packed_copy = None
        if is_packed(self.weight):
            self._replace_weight(dense(self.weight))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight"
        if key in destination and is_packed(destination[key]):
            destination[key] = dense(self.weight)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # ``model.load_state_dict(...)`` of dense weights into a packed model: back to dense, load,
        # pack again. Without it the panels' shape was refused after the other layers had loaded,
        # and a packed copy beside a tied weight kept multiplying by the old values.
        packed = getattr(self, "int8", None) is None and (is_packed(self.weight) or self.packed_copy is not None)
        shared = self.packed_copy is not None
        if packed:
            self.unpack_weights()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if packed:
            self.pack_weights(shared=shared)


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of parameters registered in more than one module (tied embeddings)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            (shared if id(p) in seen else seen).add(id(p))
    return shared


def process_weights_after_loading(model: nn.Module) -> None:
    """Pack every packable CPU linear of ``model`` (:func:`pack_weight`), once its weights are loaded.

    A module whose weight is shared with another (the LM head tied to the token embedding,
    whose lookup needs the plain table) packs a private copy instead (``pack_weights(shared=True)``):
    that one weight is then held twice, once per layout. Logs one line: how many layers took
    each path, and why the faster ones were not taken where they were not.
    """
    # (a layer holding int8 weights has no float weight left, or a shared one it does not use)
    modules = [m for m in model.modules() if hasattr(m, "pack_weights") and getattr(m, "int8", None) is None]
    if not modules or {m.weight.device.type for m in modules} != {"cpu"}:
        return  # GPU linears: cuBLAS/hipBLAS already handle small batches
    shared = shared_parameter_ids(model)
    dtypes = {m.weight.dtype for m in modules}  # the model's, before packing (panels may hold 16 bits)
    counts = {"panels": 0, "onednn": 0, "plain": 0}
    compact: dict[str, int] = {}  # 16-bit panel dtype -> layers
    for m in modules:
        m.pack_weights(shared=id(m.weight) in shared)
        w = m.matmul_weight
        counts["panels" if cpu_gemm.is_panels(w) else "onednn" if w.is_mkldnn else "plain"] += 1
        if cpu_gemm.is_panels(w) and w.dtype != torch.float32:
            name = str(w.dtype).removeprefix("torch.")
            compact[name] = compact.get(name, 0) + 1
    parts = []
    if counts["panels"]:
        held = "".join(f", {n} of them holding their values in {dt} (exactly)" for dt, n in sorted(compact.items()))
        parts.append(f"{counts['panels']} through our {cpu_gemm.describe()}{held}")
    if counts["onednn"]:
        parts.append(f"{counts['onednn']} through oneDNN prepacked weights")
    if counts["plain"]:
        parts.append(f"{counts['plain']} through F.linear (MKL)")
    why = []
    if torch.float32 in dtypes and not panels_available(torch.float32):
        why.append(f"panel GEMM unavailable: {cpu_gemm.unavailable_reason()}")
    elif counts["panels"] and not compact and cpu_gemm.sixteen_bit_switched_off():
        why.append(f"16-bit panels switched off: {cpu_gemm.ENV_16BIT}={os.environ.get(cpu_gemm.ENV_16BIT)}")
    if counts["plain"]:
        why += [f"oneDNN unavailable: {r}" for r in sorted({onednn_unavailable_reason(dt) for dt in dtypes} - {None})]
    logger.info("CPU linears: %s%s", ", ".join(parts), f" ({'; '.join(why)})" if why else "")


def matmul_bytes_per_weight(model: nn.Module) -> tuple[float | None, float | None] | None:
    """Bytes per element of the weights the linears multiply by, as held (packed 16-bit panels: 2),
    averaged over ``(the decoder layers' linears, the LM head)`` by element count, ``None`` for a
    part without such a linear (int8 layers are left to the roofline's own formula); ``None`` for a
    model with none on the CPU. For the roofline's bytes moved
    (:class:`minivllm.telemetry.roofline.ModelCost`)."""
    body = [0, 0]  # bytes, elements
    head = [0, 0]
    for name, m in model.named_modules():
        if not hasattr(m, "pack_weights") or getattr(m, "int8", None) is not None:
            continue
        w = m.matmul_weight
        if w.device.type != "cpu":
            return None
        numel = w.numel() if not w.is_mkldnn else math.prod(w.shape)
        acc = head if name.split(".")[-1] == "lm_head" else body
        acc[0] += numel * w.element_size()
        acc[1] += numel
    if not body[1] and not head[1]:
        return None
    return tuple(b / n if n else None for b, n in (body, head))


def unpack_weights(model: nn.Module) -> None:
    """Undo :func:`process_weights_after_loading` (dense weights again), before a reload."""
    for m in model.modules():
        if hasattr(m, "unpack_weights"):
            m.unpack_weights()
