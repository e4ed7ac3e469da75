"""oneDNN prepacked weights for CPU linear layers.

``torch.nn.functional.linear`` on the CPU calls MKL sgemm, which is slow for the few rows of a
decode step (measured on a 2-core EPYC: 1024 -> 3072 at 4 rows 2.3 ms vs 0.48 ms prepacked;
``/work/shared/notes/cpu-probes.md``). torch also ships oneDNN: a weight reordered once with
``torch.ops.mkldnn._reorder_linear_weight`` into oneDNN's blocked layout, then multiplied with
``torch.ops.mkldnn._linear_pointwise``, the pair torch's inductor uses for CPU linears with
frozen weights.

A layer opts in by defining ``pack_weights()``. :func:`process_weights_after_loading` calls it
on every such module once the weights are loaded; :func:`unpack_weights` undoes it before a
(re)load writes into the parameters. A packed weight is an ``mkldnn``-layout tensor with the
logical shape ``[out_features, in_features]``; ``state_dict()`` of a packed layer still returns
the plain dense weight (see :class:`PackedWeightMixin`).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

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


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (dense, CPU) -> the same values in oneDNN's blocked layout (an
    ``mkldnn`` tensor of logical shape ``[out, in]``, a new allocation), laid out for one row
    when the weight is larger than ``_STREAMED_BYTES`` (read from memory every step), else for
    8 rows (see the measurements above)."""
    big = weight.numel() * weight.element_size() > _STREAMED_BYTES
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _HINT_STREAMED if big else _HINT_CACHED)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ weight.T + bias`` for ``x [..., in]``, through oneDNN when ``weight`` is packed
    (``weight.is_mkldnn``), else ``F.linear``. Output ``[..., out]`` in ``x``'s dtype."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain strided tensor (a packed weight is converted back; others returned as is)."""
    return t.to_dense() if t.is_mkldnn else t


class PackedWeightMixin:
    """For an ``nn.Module`` whose ``weight`` parameter may be packed in place.

    Packing replaces ``self.weight`` with an ``nn.Parameter`` holding the packed tensor (the
    dense copy is freed, so memory is not doubled) and keeps the loader attributes
    (``weight_loader``, ``full_shape``). ``state_dict()`` converts it back to dense, so saving,
    comparing and copying weights to another model work unchanged.
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
        if w.is_mkldnn or self.packed_copy is not None:
            return True
        if w.device.type != "cpu" or onednn_unavailable_reason(w.dtype) is not None:
            return False
        if shared:
            self.packed_copy = pack_weight(w)
        else:
            self._replace_weight(pack_weight(w))
        return True

    def unpack_weights(self) -> None:
        """Back to a dense ``self.weight`` (before new values are loaded into it)."""
        self.packed_copy = None
        if self.weight.is_mkldnn:
            self._replace_weight(self.weight.to_dense())

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight"
        if key in destination and destination[key].is_mkldnn:
            destination[key] = self.weight.to_dense()


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of parameters registered in more than one module (tied embeddings)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            (shared if id(p) in seen else seen).add(id(p))
    return shared


def process_weights_after_loading(model: nn.Module) -> None:
    """Pack every packable CPU linear of ``model`` for oneDNN, once its weights are loaded.

    A module whose weight is shared with another (the LM head tied to the token embedding,
    whose lookup needs the plain table) packs a private copy instead (``pack_weights(shared=True)``):
    that one weight is then held twice, once per layout. Logs one line: how many layers
    are packed, or why none could be (then every layer keeps ``F.linear``).
    """
    # (a layer holding int8 weights has no float weight left, or a shared one it does not use)
    modules = [m for m in model.modules() if hasattr(m, "pack_weights") and getattr(m, "int8", None) is None]
    if not modules:
        return
    shared = shared_parameter_ids(model)
    devices = {m.weight.device.type for m in modules}
    dtypes = {m.weight.dtype for m in modules}
    if devices != {"cpu"}:
        return  # GPU linears: cuBLAS/hipBLAS already handle small batches
    reasons = {onednn_unavailable_reason(dt) for dt in dtypes} - {None}
    if reasons:
        logger.info("CPU linears use F.linear (MKL): oneDNN prepacking unavailable: %s", "; ".join(sorted(reasons)))
        return
    packed = 0
    for m in modules:
        packed += bool(m.pack_weights(shared=id(m.weight) in shared))
    logger.info("CPU linears use oneDNN prepacked weights (%d layers)", packed)


def unpack_weights(model: nn.Module) -> None:
    """Undo :func:`process_weights_after_loading` (dense weights again), before a reload."""
    for m in model.modules():
        if hasattr(m, "unpack_weights"):
            m.unpack_weights()
