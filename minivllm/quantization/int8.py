"""int8 weights: per-output-channel symmetric quantisation and the int8 matmul paths (weight-only: the
activations stay in their float dtype, on a CPU through our panel GEMM, on CUDA through our Triton kernel).

Quantisation (computed once, at load, from weights of any float dtype, in fp32)::

    scale[n] = max_k |W[n, k]| / 127            (1.0 for an all-zero row)
    Q[n, k]  = clamp(round(W[n, k] / scale[n]), -127, 127)     int8
    W ~ Q * scale[:, None]

so the largest weight of every output row is represented exactly and the rounding error of
any weight is at most ``scale[n] / 2`` (symmetric "absmax" quantisation, as in LLM.int8(),
Dettmers et al. 2022, sec. 2, applied per output row). The rows are output channels, so the
scale factors out of the dot product: ``y[m, n] = scale[n] * sum_k x[m, k] * Q[n, k]``.

Matmul paths (:class:`Int8Weight.kernel` names the one a weight uses):

* ``"panel-int8"`` (CPU, the default where our panel GEMM builds): the weight held as int8 panels
  (:mod:`minivllm.layers.cpu_gemm`), each value widened to float32 as the kernel reads it and
  multiplied by the float32 activations; the scale applied once per output after the sum over
  ``k``. Exact weight-only semantics up to float32 summation order, so a token's result does not
  depend on the other rows, and a decode step's calls are C calls a CPU graph can replay. Chosen
  by measurement over fbgemm (below) on a 2-core Xeon (2026-12-06, one thread,
  ``random:qwen3-0.6b`` batch-1 decode, ``bench --quantization int8`` runs minutes apart: median
  ITL 54.3 ms against fbgemm's 68.8, the float32 step 164.9 and 148.2 ms in those runs;
  ``docs/quantization.md``). Where the output count is a multiple of 64 the panels go in groups of
  four in an AVX-512 build (one stream of whole cache lines for a decode step), and panels of 2 MiB
  or more on 2 MiB pages: on the dev EPYC Zen 4 (2026-12-07) the two took the batch-1 int8 step of
  ``random:qwen3-0.6b`` from 33.5 to 23.6 ms (float32 ~81-85 ms).
* ``"fbgemm-dynamic"`` (CPU, where the panel GEMM does not build, and for a weight whose output
  count is not a multiple of 16): torch's own quantized dynamic linear,
  ``torch.ops.quantized.linear_dynamic`` with weights prepacked by
  ``torch.ops.quantized.linear_prepack`` under the ``x86``/``fbgemm`` quantized engine. It
  also quantises the *activations* at run time, per tensor, to uint8 with
  ``reduce_range=True`` (7 bits; CPUs without VNNI saturate 8-bit products in 16-bit
  accumulators). To make that per token rather than per call, every row of ``x`` is mapped
  affinely onto [-1, 1] before the call, with a row holding exactly -1 and 1 beside them, and
  mapped back after (:func:`_fbgemm_linear`): a token with outlier activations does not flatten
  the others, and a token's result does not depend on what else is in the batch. Faster than
  fp32 oneDNN and ``torch._weight_int8pack_mm`` (``docs/quantization.md``).
* ``"triton"`` (CUDA): our Triton kernel (:mod:`minivllm.quantization.triton_int8`), int8
  weights loaded and converted to the activation dtype inside the matmul loop, scale applied
  to the fp32 accumulator: weight-only, activations untouched.
* ``"reference"``: ``F.linear(x, Q * scale)``, dequantising the whole weight on every call.
  Exact weight-only semantics; slow. Used where neither fast path is available, and as the
  reference in tests.
"""
from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn.functional as F

from minivllm.layers import cpu_fused, cpu_gemm

logger = logging.getLogger(__name__)

INT8_MAX = 127
#: bytes per scale factor (fp32, one per output channel); used by the roofline too
SCALE_BYTES = 4

KERNELS = ("panel-int8", "fbgemm-dynamic", "triton", "reference")

_KERNEL_DESCRIPTIONS = {
    "panel-int8": "our panel GEMM, weight-only: int8 panels widened to float32 as they are read, activations "
                  "untouched",
    "fbgemm-dynamic": "torch.ops.quantized.linear_dynamic (fbgemm; activations quantised per token at run time, "
                      "7-bit)",
    "triton": "Triton weight-only int8 matmul (dequantisation fused, activations untouched)",
    "reference": "dequantise + F.linear (reference path, no fast int8 kernel available)",
}


def describe_kernel(kernel: str) -> str:
    """One line naming ``kernel`` (one of :data:`KERNELS`) for logs and reports."""
    if kernel not in _KERNEL_DESCRIPTIONS:
        raise ValueError(f"unknown int8 kernel {kernel!r}; expected one of {KERNELS}")
    return _KERNEL_DESCRIPTIONS[kernel]


def quantize_per_channel(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantisation (formula in the module docstring).

    Args:
        weight: ``[out_features, in_features]``, any float dtype, any device (a oneDNN-packed
            CPU tensor is read dense).
        amax: fp32 ``[out_features]``, each row's largest magnitude when ``weight`` holds only
            part of each row (a row-parallel shard: the maximum over every rank's part, so that
            every rank quantises with the scales of the whole row); None: ``weight``'s own.

    Returns:
        ``(q, scale)``: ``q`` int8 ``[out, in]`` with values in ``[-127, 127]``, ``scale`` fp32
        ``[out]``, both on ``weight``'s device.

    Raises:
        ValueError: ``weight`` is not 2-D or not a float tensor, or ``amax`` is not of shape
            ``[out_features]``.
    """
    if weight.is_mkldnn:
        weight = weight.to_dense()
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a float tensor to quantise, got dtype {weight.dtype}")
    w = weight.detach().float()
    if amax is None:
        amax = row_amax(w)
    elif tuple(amax.shape) != (w.shape[0],):
        raise ValueError(f"amax: expected [{w.shape[0]}] (one per output row), got shape {tuple(amax.shape)}")
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``[out_features]``: each row's largest magnitude, what its int8 scale is made from."""
    return weight.detach().float().abs().amax(dim=1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q int8 [out, in]``, ``scale fp32 [out]`` -> ``q * scale[:, None]`` in ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


# --------------------------------------------------------------------------------------------
# CPU: torch's quantized dynamic linear (fbgemm)
# --------------------------------------------------------------------------------------------
def _cpu_engine() -> str | None:
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm"):
        if name in engines:
            return name
    return None


def _prepack_cpu(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """fbgemm packed params of an int8 weight (a new int8 copy in fbgemm's blocked layout)."""
    engine = _cpu_engine()
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        with warnings.catch_warnings():  # torch >= 2.10 marks quantized tensors deprecated (docs/quantization.md)
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long),
                                                          0)
            return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())
    finally:
        torch.backends.quantized.engine = previous


@functools.lru_cache(maxsize=64)
def _range_rows(k: int) -> torch.Tensor:
    """Rows ``[r, k]`` whose values are exactly -1 and 1 (and nothing else): appended to every call, they
    make the tensor's range [-1, 1] whatever the other rows hold."""
    if k == 1:
        return torch.tensor([[-1.0], [1.0]])
    row = torch.ones(1, k)
    row[0, ::2] = -1.0
    return row


def _fbgemm_linear(x: torch.Tensor, packed, row_sums: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]`` in ``x``'s dtype through torch's per-tensor dynamic quantisation,
    made per token: each row is mapped affinely onto [-1, 1] (``x = mid + half * x'``, its minimum to -1,
    its maximum to 1) and rows holding exactly -1 and 1 join the call, so every call's range is [-1, 1]
    and a token's 7-bit grid spans its own values whatever else is in the batch (with the range of the
    whole call, a token's result depended on its neighbours). Undone after: ``x W^T = half * (x' W^T) +
    mid * row_sums``, ``row_sums[n] = sum_k W[n, k]`` of the dequantised weight."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    fused = cpu_fused.load()
    if fused is not None and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous())):
        mapped = fused.int8_rows_in(x2)
        if mapped is not None:  # the same map in two C calls (the torch ops below cost ~70 us a linear)
            xn, scales = mapped
            y = torch.ops.quantized.linear_dynamic(xn, packed, True)[:x2.shape[0]]
            fused.int8_rows_out(y, scales, row_sums, bias)
            return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
    lo, hi = x2.amin(dim=1, keepdim=True), x2.amax(dim=1, keepdim=True)
    mid, half = 0.5 * hi + 0.5 * lo, (0.5 * hi - 0.5 * lo).clamp_min_(1e-30)
    bad = ~torch.isfinite(x2).all(dim=1, keepdim=True)  # as the C pass: zeros in, NaN out, the other rows untouched
    if bad.any():
        mid, half = mid.masked_fill(bad, float("nan")), half.masked_fill(bad, 1.0)
        x2 = x2.masked_fill(bad, 0.0)
    xn = torch.cat([((x2 - mid.nan_to_num(0.0)) / half).clamp_(-1.0, 1.0), _range_rows(shape[-1])])
    y = torch.ops.quantized.linear_dynamic(xn, packed, True)[:x2.shape[0]]
    y.mul_(half).addmm_(mid, row_sums[None, :])
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])


@functools.lru_cache(maxsize=None)
def cpu_int8_unavailable_reason() -> str | None:
    """Why the fbgemm int8 path cannot run on this CPU, or ``None`` if it can (a small
    prepacked matmul is tried and compared with the dequantised reference)."""
    if _cpu_engine() is None:
        return f"torch has no x86/fbgemm quantized engine (supported: {torch.backends.quantized.supported_engines})"
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(16, 32, generator=gen)
        x = torch.randn(3, 32, generator=gen)
        q, s = quantize_per_channel(w)
        y = _fbgemm_linear(x, _prepack_cpu(q, s, None), dequantize(q, s).sum(dim=1), None)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    ref = F.linear(x, dequantize(q, s))
    # 7-bit activations: a few percent of the output range, not a wrong result
    if not (y - ref).abs().max() <= 0.05 * ref.abs().max():
        return "fbgemm int8 result differs from the dequantised reference"
    return None


# --------------------------------------------------------------------------------------------
# Kernel choice and the per-layer state
# --------------------------------------------------------------------------------------------
def default_kernel(device: torch.device | str) -> str:
    """The int8 path for weights on ``device``: on a CPU ``"panel-int8"`` where our panel GEMM is
    built (:mod:`minivllm.layers.cpu_gemm`), else ``"fbgemm-dynamic"`` where torch has it; ``"triton"``
    on CUDA when Triton imports; else ``"reference"``."""
    dev = torch.device(device)
    if dev.type == "cpu":
        if cpu_gemm.load() is not None:
            return "panel-int8"
        return "fbgemm-dynamic" if cpu_int8_unavailable_reason() is None else "reference"
    if dev.type == "cuda":
        from minivllm.quantization.triton_int8 import triton_unavailable_reason

        return "triton" if triton_unavailable_reason() is None else "reference"
    return "reference"


class Int8Weight:
    """The int8 form of one ``[out_features, in_features]`` weight, and its matmul.

    Attributes:
        out_features, in_features: the logical shape.
        scale: fp32 ``[out]``.
        qweight: int8 ``[out, in]``, or ``None`` on the ``"panel-int8"`` and ``"fbgemm-dynamic"``
            paths, where the packed copy is the only one (so int8 memory is not held twice).
        panels: int8 panels ``[out / 16, in, 16]``, or in groups of four ``[out / 64, in, 64]`` where
            ``out`` is a multiple of 64 and the build prefers them
            (:func:`minivllm.layers.cpu_gemm.pack_panels`; ``"panel-int8"`` only).
        packed: fbgemm packed params (``"fbgemm-dynamic"`` only).
        kernel: one of :data:`KERNELS`.

    Args:
        weight: the float weight ``[out, in]`` (not kept: only its int8 form is); ``None`` with
            ``quantized``.
        kernel: the matmul path; ``None`` picks :func:`default_kernel` for its device.
        quantized: ``(q, scale)`` already quantised (int8 ``[out, in]``, float ``[out]``, e.g. read
            back from a ``state_dict()``), taken as they are instead of quantising ``weight``.

    Raises:
        ValueError: an unknown ``kernel``, or one that cannot run on ``weight``'s device (or, for
            ``"panel-int8"``, shape: out_features a multiple of 16); ``quantized`` with another
            dtype or shape than those above, or on two devices.
    """

    def __init__(self, weight: torch.Tensor | None, kernel: str | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None):
        if quantized is None:
            q, scale = quantize_per_channel(weight)
        else:
            q, scale = quantized
            if q.dtype != torch.int8 or q.dim() != 2:
                raise ValueError(f"quantized weight: expected int8 [out, in], got {q.dtype} {tuple(q.shape)}")
            if not scale.is_floating_point() or tuple(scale.shape) != (q.shape[0],) or scale.device != q.device:
                raise ValueError(f"quantized scale: expected a float [{q.shape[0]}] on {q.device}, got {scale.dtype} "
                                 f"{tuple(scale.shape)} on {scale.device}")
            scale = scale.float()
        self.out_features, self.in_features = q.shape
        self.kernel = kernel or default_kernel(q.device)
        if kernel is None and self.kernel == "panel-int8" and self.out_features % cpu_gemm.PANEL:
            # panels hold 16 outputs each: a weight of another height takes the next path
            self.kernel = "fbgemm-dynamic" if cpu_int8_unavailable_reason() is None else "reference"
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown int8 kernel {self.kernel!r}; expected one of {KERNELS}")
        self.scale = scale
        self.packed = None
        self.panels = None
        if self.kernel == "panel-int8":
            if q.device.type != "cpu":
                raise ValueError(f"int8 kernel 'panel-int8' needs CPU weights, got {q.device}")
            if self.out_features % cpu_gemm.PANEL:
                raise ValueError(f"int8 kernel 'panel-int8' needs a multiple of {cpu_gemm.PANEL} output features, "
                                 f"got {self.out_features}")
            if cpu_gemm.load() is None:
                raise ValueError(f"int8 kernel 'panel-int8' needs the panel GEMM: {cpu_gemm.unavailable_reason()}")
            self.panels = cpu_gemm.pack_panels(q, torch.int8)  # the only int8 copy
            self.qweight = None
        elif self.kernel == "fbgemm-dynamic":
            if q.device.type != "cpu":
                raise ValueError(f"int8 kernel 'fbgemm-dynamic' needs CPU weights, got {q.device}")
            self.packed = _prepack_cpu(q, scale, None)
            # each output's sum over the dequantised weight row (accumulated in float64), for the
            # affine map of the activations (_fbgemm_linear)
            self.row_sums = (q.double() * scale.double()[:, None]).sum(dim=1).float()
            self.qweight = None
        else:
            if self.kernel == "triton" and q.device.type != "cuda":
                import os

                if os.environ.get("TRITON_INTERPRET") != "1":
                    raise ValueError(f"int8 kernel 'triton' needs CUDA weights (or TRITON_INTERPRET=1), got {q.device}")
            self.qweight = q

    def int8_tensor(self) -> torch.Tensor:
        """The int8 weight ``[out, in]`` (unpacked from panels or fbgemm's layout when needed: a copy)."""
        if self.qweight is not None:
            return self.qweight
        if self.panels is not None:
            nb, k, nr = self.panels.shape
            return self.panels.transpose(1, 2).reshape(nb * nr, k).contiguous()
        qw, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qw.int_repr()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``Q * scale`` as a ``[out, in]`` tensor in ``dtype``."""
        return dequantize(self.int8_tensor(), self.scale, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of int8 weights + fp32 scales (what a matmul reads; fbgemm's column offsets,
        one int32 per output, are not counted)."""
        return self.out_features * self.in_features + self.out_features * SCALE_BYTES

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] -> x @ (Q * scale).T + bias``, ``[..., out]`` in ``x``'s dtype."""
        if self.kernel == "panel-int8":
            x32 = x if x.dtype is torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
            b32 = None if bias is None else bias.detach().float().contiguous()
            y = cpu_gemm.loaded().run_int8(x32, self.panels, self.scale, b32)
            return y if x.dtype is torch.float32 else y.to(x.dtype)
        if self.kernel == "fbgemm-dynamic":
            return _fbgemm_linear(x, self.packed, self.row_sums, bias)
        if self.kernel == "triton":
            from minivllm.quantization.triton_int8 import int8_linear

            return int8_linear(x, self.qweight, self.scale, bias)
        return F.linear(x, dequantize(self.qweight, self.scale, x.dtype), bias)
