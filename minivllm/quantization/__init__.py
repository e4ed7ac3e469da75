"""Weight quantisation: ``LLM(..., quantization="int8")``.

* :mod:`minivllm.quantization.int8`: per-output-channel symmetric int8 weights and the
  matmul paths (weight-only: our panel GEMM's int8 panels on CPU, our Triton kernel on CUDA; torch's
  fbgemm dynamic linear where the panel GEMM does not build).
* :mod:`minivllm.quantization.triton_int8`: the Triton kernel (dequantisation fused).
* :mod:`minivllm.quantization.layer`: the layer mixin and :func:`quantize_model`, run after
  the weights are loaded.
* :mod:`minivllm.quantization.accuracy`: int8 vs float accuracy figures.
* :mod:`minivllm.quantization.gpu_check_int8`: the CUDA accuracy/speed check.
"""
from minivllm.quantization.int8 import KERNELS, Int8Weight, dequantize, quantize_per_channel
from minivllm.quantization.layer import (QUANTIZATION_METHODS, Int8LinearMixin, QuantConfig, check_quantization,
                                         quantize_model, quantized_layers)

__all__ = ["KERNELS", "Int8Weight", "dequantize", "quantize_per_channel", "QUANTIZATION_METHODS",
           "Int8LinearMixin", "QuantConfig", "check_quantization", "quantize_model", "quantized_layers"]
