"""16-bit panels: a float32 weight whose values are all float16 (or bfloat16) values is held in that
type and widened back as the kernel reads it, so every result is bit for bit that of float32 panels;
the engine picks them by itself for such a checkpoint, and its roofline counts the bytes it holds."""
from __future__ import annotations

import logging

import pytest
import torch

from helpers_native import native_or_skip
from minivllm.layers import cpu_gemm, prepack


@pytest.fixture
def gemm():
    return native_or_skip(cpu_gemm, "panel GEMM")


def _dtypes(gemm):
    return [dt for dt in (torch.float16, torch.bfloat16) if dt in gemm.panel_dtypes]


def _weight(n, k, dtype, seed=0):
    """A float32 weight holding ``dtype`` values (as loaded from a 16-bit checkpoint)."""
    g = torch.Generator().manual_seed(seed * 31 + n * 7 + k)
    return (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).float()


def test_bfloat16_panels_are_built_everywhere_the_gemm_loads(gemm):
    assert torch.bfloat16 in gemm.panel_dtypes and torch.float32 in gemm.panel_dtypes


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 12, 13, 32, 40])
@pytest.mark.parametrize("k", [1, 17, 256, 600])
def test_16bit_panels_give_the_float32_panels_bits(gemm, m, k):
    for dtype in _dtypes(gemm):
        w = _weight(80, k, dtype)  # 80: five panels, so groups of 4 and 2 and single panels all run
        x, b = torch.randn(m, k), torch.randn(80)
        want = gemm(x, cpu_gemm.pack_panels(w), b)
        narrow = cpu_gemm.pack_panels(w, dtype)
        assert narrow.dtype == dtype and narrow.nbytes * 2 == w.nbytes
        assert torch.equal(gemm(x, narrow, b), want), (dtype, m, k)
        assert torch.equal(cpu_gemm.unpack_panels(narrow), w)  # widened back exactly, float32


def test_16bit_panels_split_over_threads_give_the_same_bits(gemm):
    w = _weight(256, 512, torch.bfloat16)
    x = torch.randn(64, 512)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, cpu_gemm.pack_panels(w, torch.bfloat16))
        torch.set_num_threads(2)  # enough work per thread: the C code splits the panels in two
        two = gemm(x, cpu_gemm.pack_panels(w, torch.bfloat16))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two) and torch.equal(one, gemm(x, cpu_gemm.pack_panels(w)))


def test_compact_dtype_takes_only_exact_values(gemm, monkeypatch):
    half = _weight(32, 8, torch.float16)
    want_half = torch.float16 if torch.float16 in gemm.panel_dtypes else None
    assert cpu_gemm.compact_dtype(half) == (want_half or (torch.bfloat16 if torch.equal(
        half.bfloat16().float(), half) else None))
    tiny = _weight(32, 8, torch.bfloat16) * 2.0 ** -30  # bfloat16 values below float16's range
    assert cpu_gemm.compact_dtype(tiny) == torch.bfloat16
    almost = _weight(2 * cpu_gemm._CHECK_ROWS + 16, 8, torch.bfloat16)  # checked in three parts
    assert cpu_gemm.compact_dtype(almost) is not None
    almost[cpu_gemm._CHECK_ROWS + 3, 5] = torch.nextafter(almost[cpu_gemm._CHECK_ROWS + 3, 5], torch.tensor(1.0))
    assert cpu_gemm.compact_dtype(almost) is None  # one value, in the second part, needs float32
    assert cpu_gemm.compact_dtype(torch.randn(32, 8)) is None
    nan = _weight(32, 8, torch.bfloat16)
    nan.view(torch.int32)[2, 3] = 0x7FC00001  # a NaN whose payload neither 16-bit type holds
    assert cpu_gemm.compact_dtype(nan) is None
    # whatever is chosen, packing and unpacking give every value's bits back (NaN payloads, -0.0, inf,
    # float16 subnormals, values only bfloat16 reaches)
    for bits in (0x7FC50000, 0xFFC50000, 0x80000000, 0x7F800000, 0x33800000, 0x2F000000, 0x00010000):
        special = _weight(32, 8, torch.bfloat16)
        special.view(torch.int32)[5, 6] = bits - (1 << 32) if bits >= 1 << 31 else bits
        dtype = cpu_gemm.compact_dtype(special)
        if dtype is not None:
            back = cpu_gemm.unpack_panels(cpu_gemm.pack_panels(special, dtype))
            assert torch.equal(back.view(torch.int32), special.view(torch.int32)), (hex(bits), dtype)
    monkeypatch.setenv(cpu_gemm.ENV_16BIT, "0")
    assert cpu_gemm.compact_dtype(half) is None


def test_a_layer_of_16bit_values_packs_into_16bits_and_saves_float32(gemm):
    from minivllm.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(64, 48, bias=False)
    w = _weight(48, 64, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
    assert layer.pack_weights()
    assert cpu_gemm.is_panels(layer.weight) and layer.weight.dtype != torch.float32
    saved = layer.state_dict()["weight"]
    assert saved.dtype == torch.float32 and torch.equal(saved, w)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), gemm(x, cpu_gemm.pack_panels(w)))
    assert prepack.matmul_bytes_per_weight(layer) == (2.0, None)  # (no LM head in a lone layer)


def test_the_embedded_engine_holds_16bit_panels_with_the_same_logits(gemm, monkeypatch, caplog):
    """The embedded checkpoint is float16: its linears go to 16-bit panels, the logits are bit for
    bit those of float32 panels, and the roofline counts 2 bytes per matmul weight."""
    if torch.float16 not in gemm.panel_dtypes:
        pytest.skip("this build of the GEMM widens no float16 (no F16C): the embedded model keeps float32 panels")
    from minivllm.engine.model_runner import build_model
    from minivllm.telemetry.roofline import ModelCost
    from minivllm.utils.model_source import resolve_model

    source = resolve_model(None)
    with caplog.at_level(logging.INFO, logger="minivllm.layers.prepack"):
        narrow = build_model(source, torch.device("cpu"), torch.float32, 0, None)
    assert "holding their values in" in caplog.text
    monkeypatch.setenv(cpu_gemm.ENV_16BIT, "0")
    wide = build_model(source, torch.device("cpu"), torch.float32, 0, None)
    heads = [m.matmul_weight for m in (narrow.lm_head, narrow.model.layers[0].mlp.down_proj)]
    assert all(cpu_gemm.is_panels(w) and w.dtype in (torch.float16, torch.bfloat16) for w in heads)
    assert wide.lm_head.matmul_weight.dtype == torch.float32
    storage = prepack.matmul_bytes_per_weight(narrow)
    assert storage == (2.0, 2.0) and prepack.matmul_bytes_per_weight(wide) == (4.0, 4.0)
    cfg = source.hf_config
    fp32, held = ModelCost.from_config(cfg), ModelCost.from_config(cfg, weight_storage=storage)
    assert held.lm_head_bytes * 2 == fp32.lm_head_bytes
    assert held.body_weight_bytes == 2 * fp32.matmul_params + 4 * fp32.norm_params
    x = torch.randn(3, cfg.hidden_size)
    with torch.inference_mode():
        assert torch.equal(narrow.lm_head.compute_logits(x), wide.lm_head.compute_logits(x))
        for a, b in zip(narrow.model.layers, wide.model.layers):
            h = torch.randn(4, cfg.hidden_size)
            assert torch.equal(a.mlp(h), b.mlp(h))


def test_flush_denormal_mode_does_not_let_a_float32_subnormal_into_16_bits(gemm):
    w = _weight(32, 8, torch.bfloat16)
    w.view(torch.int32)[1, 1] = 0x00011170  # a float32 subnormal: not a float16 value, not a bfloat16 one
    old = torch.set_flush_denormal(True)
    try:
        assert cpu_gemm.compact_dtype(w) is None  # (compared by value it equals 0 in this mode)
    finally:
        torch.set_flush_denormal(False)
    del old


def test_int8_quantisation_of_a_16bit_packed_model_survives_a_reload(gemm):
    """int8 kept the packed weight's dtype (float16) as the layer's, and a reload then rebuilt a
    float16 weight in a float32 model, whose forward failed (a reviewer's find)."""
    from minivllm.engine.model_runner import build_model
    from minivllm.quantization import QuantConfig, quantize_model
    from minivllm.utils.loader import load_weights
    from minivllm.utils.model_source import resolve_model

    source = resolve_model(None)
    model = build_model(source, torch.device("cpu"), torch.float32, 0, None)
    quantize_model(model, QuantConfig("int8"))
    model.quant_config = None
    load_weights(model, source.checkpoint_dir)  # dequantise, load, pack again
    layer = model.model.layers[0].mlp.down_proj
    assert prepack.is_packed(layer.weight)
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}
    with torch.inference_mode():
        assert layer(torch.randn(2, 768)).dtype == torch.float32


@pytest.mark.parametrize("value", ["0", "false", "No", " off "])
def test_every_off_spelling_keeps_float32_panels_and_the_log_says_why(gemm, monkeypatch, caplog, value):
    from minivllm.engine.model_runner import build_model
    from minivllm.utils.model_source import resolve_model

    monkeypatch.setenv(cpu_gemm.ENV_16BIT, value)
    assert cpu_gemm.compact_dtype(_weight(32, 8, torch.bfloat16)) is None
    with caplog.at_level(logging.INFO, logger="minivllm.layers.prepack"):
        model = build_model(resolve_model(None), torch.device("cpu"), torch.float32, 0, None)
    assert model.lm_head.matmul_weight.dtype == torch.float32
    assert f"16-bit panels switched off: {cpu_gemm.ENV_16BIT}={value}" in caplog.text
