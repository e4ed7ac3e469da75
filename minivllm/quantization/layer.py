"""Int8 weights on the model's layers: the per-layer mixin and the whole-model pass.

A layer opts in by inheriting :class:`Int8LinearMixin` (before ``PackedWeightMixin``) and
computing through ``self.int8.matmul`` when ``self.int8`` is set. :func:`quantize_model`
runs after the weights are loaded (``minivllm.utils.loader`` calls it just before the
weights are packed); ``unpack_weights`` (called by the loader before a reload) turns the layer back
into a float one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.distributed.parallel_state import tensor_model_parallel_all_reduce_max
from minivllm.layers.prepack import dense, shared_parameter_ids
from minivllm.quantization.int8 import Int8Weight, describe_kernel, quantize_per_channel, row_amax

logger = logging.getLogger("minivllm")

#: the values ``LLM(..., quantization=...)`` accepts (besides None)
QUANTIZATION_METHODS = ("int8",)


def check_quantization(quantization) -> str | None:
    """``quantization`` validated: ``None`` or one of :data:`QUANTIZATION_METHODS`.

    Raises:
        ValueError: any other value (the message names it).
    """
    if quantization is None or (isinstance(quantization, str) and quantization in QUANTIZATION_METHODS):
        return quantization
    raise ValueError(f"quantization={quantization!r}: choose None or one of {list(QUANTIZATION_METHODS)}")


@dataclass(frozen=True)
class QuantConfig:
    """How a model's weights are quantised after loading.

    Attributes:
        method: ``"int8"`` (per-output-channel symmetric, weight-only; see
            :mod:`minivllm.quantization.int8`).
        quantize_lm_head: also quantise the LM head (with tied embeddings the head gets its
            own int8 copy; the embedding table stays in the model dtype).
        kernel: force one matmul path (:data:`minivllm.quantization.int8.KERNELS`); ``None``
            picks the device's default.

    Raises:
        ValueError: an unknown ``method`` or a non-bool ``quantize_lm_head``.
    """

    method: str = "int8"
    quantize_lm_head: bool = True
    kernel: str | None = None

    def __post_init__(self) -> None:
        if check_quantization(self.method) is None:
            raise ValueError("QuantConfig.method must not be None (use no QuantConfig for float weights)")
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head={self.quantize_lm_head!r}: must be a bool")


class Int8LinearMixin:
    """For an ``nn.Module`` with a ``weight [out, in]`` it multiplies by (``x @ weight.T``).

    After :meth:`quantize_weights`, ``self.int8`` holds the int8 form; the float ``weight``
    parameter is dropped (set to ``None``) so its memory is freed, unless it is shared with
    another module (a tied embedding), which keeps it. The buffers ``weight_scale`` (fp32
    ``[out]``) and, on the paths that keep a plain int8 tensor, ``weight_int8`` (int8
    ``[out, in]``) appear in ``state_dict()``, which always holds ``weight_int8`` (unpacked when
    it is called); ``load_state_dict()`` of the two rebuilds ``self.int8`` from them.
    """

    int8: Int8Weight | None = None
    _float_spec: tuple | None = None

    def quantize_weights(self, kernel: str | None = None, shared: bool = False) -> bool:
        """Quantise ``self.weight`` to int8 (no-op if already); returns True."""
        if self.int8 is not None:
            return True
        if hasattr(self, "unpack_weights"):
            self.packed_copy = None  # a packed copy of a shared weight, if any
        w = self.weight
        attrs = {a: getattr(w, a) for a in ("weight_loader", "full_shape") if hasattr(w, a)}
        with torch.no_grad():
            plain = dense(w)  # a packed weight (panels or oneDNN) read back plain
            quantized = None
            if getattr(self, "input_is_sharded", False) and getattr(self, "tp_size", 1) > 1:
                # a row-parallel shard holds part of each row: the scales come from the whole row, so the
                # ranks quantise the model tensor_parallel_size=1 would (each rank's own maximum would not)
                amax = tensor_model_parallel_all_reduce_max(row_amax(plain).contiguous())
                quantized = quantize_per_channel(plain, amax)
            self.int8 = Int8Weight(plain, kernel, quantized=quantized)
        # the layer's dtype: a packed weight's own may differ (16-bit panels of a float32 model)
        self._float_spec = (plain.dtype, w.device, shared, attrs)
        self.register_buffer("weight_scale", self.int8.scale)
        if self.int8.qweight is not None:
            self.register_buffer("weight_int8", self.int8.qweight)
        if not shared:
            self.weight = None
        return True

    def dequantize_weights(self) -> None:
        """Back to a float ``weight`` parameter (dequantised values, the original dtype and
        loader attributes), e.g. before new weights are loaded into it."""
        if self.int8 is None:
            return
        dtype, device, shared, attrs = self._float_spec
        if not shared:
            p = nn.Parameter(self.int8.dequantized(dtype).to(device), requires_grad=False)
            for a, v in attrs.items():
                setattr(p, a, v)
            self.weight = p
        for name in ("weight_scale", "weight_int8"):
            if name in self._buffers:
                del self._buffers[name]
        self.int8 = None
        self._float_spec = None

    # The packing hooks (minivllm.layers.prepack): a quantised layer has nothing to pack, and a reload must
    # see the float weight again.
    def pack_weights(self, shared: bool = False) -> bool:
        if self.int8 is not None:
            return False
        return super().pack_weights(shared)

    def unpack_weights(self) -> None:
        self.dequantize_weights()
        super().unpack_weights()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.int8 is not None and self.int8.qweight is None:
            destination[prefix + "weight_int8"] = self.int8.int8_tensor()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A quantised layer's own state_dict() loaded back (weight_int8 and weight_scale): its int8 form
        # is rebuilt from them (packed again where its path packs; a copy into the old buffers would
        # leave a packed copy stale). New tensors in the buffer slots, so a CPU graph records again.
        q_key, scale_key = prefix + "weight_int8", prefix + "weight_scale"
        if self.int8 is None:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        if q_key in state_dict and scale_key in state_dict:
            q, scale = state_dict[q_key], state_dict[scale_key]
            want = (self.int8.out_features, self.int8.in_features)
            if tuple(q.shape) != want or tuple(scale.shape) != want[:1]:
                error_msgs.append(f"size mismatch for {q_key} / {scale_key}: copying int8 {tuple(q.shape)} and scale "
                                  f"{tuple(scale.shape)} into a layer of {want}")
            else:
                device = self.int8.scale.device
                try:
                    new = Int8Weight(None, self.int8.kernel, quantized=(q.to(device), scale.to(device)))
                except ValueError as e:
                    error_msgs.append(f"{q_key} / {scale_key}: {e}")
                else:
                    self.int8 = new
                    self._buffers["weight_scale"] = new.scale
                    if new.qweight is not None:
                        self._buffers["weight_int8"] = new.qweight
        rest = {k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in (q_key, scale_key)}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        # the two keys are this method's (super() saw neither): missing where absent, as state_dict() writes both
        missing_keys[:] = [k for k in missing_keys if k not in (q_key, scale_key)]
        if strict:
            missing_keys.extend(k for k in (q_key, scale_key) if k not in state_dict)


def _is_lm_head(module: nn.Module) -> bool:
    return hasattr(module, "compute_logits")


def quantize_model(model: nn.Module, config: QuantConfig | None = None) -> int:
    """Quantise every :class:`Int8LinearMixin` layer of ``model`` (the LM head only when
    ``config.quantize_lm_head``). ``config`` defaults to ``model.quant_config`` (set by the
    engine); with neither, nothing happens. Logs one line naming the matmul path and the
    weight bytes before/after. Returns the number of layers quantised.
    """
    config = config if config is not None else getattr(model, "quant_config", None)
    if config is None:
        return 0
    shared = shared_parameter_ids(model)
    before = after = 0
    count = 0
    kernels = set()
    for m in model.modules():
        if not isinstance(m, Int8LinearMixin) or m.weight is None and m.int8 is None:
            continue
        if _is_lm_head(m) and not config.quantize_lm_head:
            continue
        if m.int8 is None:
            w = m.weight
            before += w.numel() * w.element_size()
            m.quantize_weights(config.kernel, shared=id(w) in shared)
        after += m.int8.nbytes
        kernels.add(m.int8.kernel)
        count += 1
    if count:
        logger.info("int8 weights: %d layers (LM head %s), %.1f MiB -> %.1f MiB (+ scales); matmul: %s",
                    count, "included" if config.quantize_lm_head else "kept in the model dtype",
                    before / 2**20, after / 2**20, "; ".join(describe_kernel(k) for k in sorted(kernels)))
    return count


def quantized_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that currently hold int8 weights."""
    return [m for m in model.modules() if isinstance(m, Int8LinearMixin) and m.int8 is not None]
