"""Our Triton int8 kernel (dequantisation fused into the matmul) against the dequantised
reference, on CPU under the Triton interpreter (tiny shapes: every program runs in Python)."""
from __future__ import annotations

import os

# The interpreter must be on before the kernel is decorated (lazily, at its first call).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from minivllm.quantization import Int8Weight, dequantize, quantize_per_channel  # noqa: E402
from minivllm.quantization import triton_int8  # noqa: E402

triton_int8.triton_unavailable_reason.cache_clear()


def _reference(x, q, scale, bias):
    y = F.linear(x.float(), dequantize(q, scale), None if bias is None else bias.float())
    return y.to(x.dtype)


@pytest.mark.parametrize("M,N,K,dtype,bias,blocks", [
    (1, 40, 70, torch.float32, False, None),          # decode row, ragged N and K
    (5, 33, 130, torch.bfloat16, True, None),         # bf16, K spans two BLOCK_K tiles plus a tail
    (20, 64, 64, torch.float16, True, None),          # M > 16: a 32-row tile
    (70, 48, 96, torch.float32, False, (16, 16, 32, 4)),  # several M and N programs, explicit tiles
])
def test_kernel_matches_dequantised_reference(M, N, K, dtype, bias, blocks):
    g = torch.Generator().manual_seed(M * 1000 + N)
    q, scale = quantize_per_channel(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    got = triton_int8.int8_linear(x, q, scale, b, blocks=blocks)
    want = _reference(x, q, scale, b)
    assert got.dtype == dtype and got.shape == (M, N)
    # fp32: same sums in another order; bf16/fp16: one rounding of the output
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))


def test_kernel_sees_every_scale_and_weight():
    """A wrong row/column stride or a dropped scale would move these exact small-integer sums."""
    q = torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4)
    scale = torch.tensor([1.0, 0.5, 2.0])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, -1.0, 0.0, 1.0]])
    got = triton_int8.int8_linear(x, q, scale)
    torch.testing.assert_close(got, x @ (q.float() * scale[:, None]).T, rtol=0, atol=0)


def test_int8_weight_uses_the_kernel_with_leading_dims():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 40, generator=g)
    iw = Int8Weight(w, kernel="triton")
    assert iw.qweight is not None and iw.qweight.dtype == torch.int8
    x = torch.randn(2, 3, 40, generator=g)
    torch.testing.assert_close(iw.matmul(x), Int8Weight(w, kernel="reference").matmul(x), rtol=1e-4, atol=1e-4)


def test_kernel_validates_its_inputs():
    q, s = quantize_per_channel(torch.randn(8, 16))
    with pytest.raises(ValueError, match="input features"):
        triton_int8.int8_linear(torch.randn(2, 15), q, s)
    with pytest.raises(ValueError, match="int8"):
        triton_int8.int8_linear(torch.randn(2, 16), q.float(), s)
    with pytest.raises(ValueError, match="scale"):
        triton_int8.int8_linear(torch.randn(2, 16), q, s.half())
    with pytest.raises(ValueError, match="int64"):
        triton_int8.int8_linear(torch.ones(2, 16, dtype=torch.int64), q, s)


def test_embedded_model_logits_through_the_kernel_match_the_reference_path():
    """Every linear of the embedded model (transformers' Qwen3 holding its weights) through the
    Triton kernel, against the same model through the dequantised reference: real shapes,
    biases absent, the LM head included."""
    from transformers import AutoModelForCausalLM

    from minivllm.quantization.accuracy import int8_hf_linears, restore_hf_linears
    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(str(EMBEDDED_MODEL_DIR), dtype=torch.float32).eval()
    ids = torch.tensor([[742, 536, 540, 310, 268, 466, 403, 14]])
    with torch.no_grad():
        int8_hf_linears(model, "reference")
        want = model(input_ids=ids).logits
        restore_hf_linears(model)
        assert int8_hf_linears(model, "triton") == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer + head
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
