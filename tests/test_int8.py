"""int8 weights (``LLM(..., quantization="int8")``): the quantiser, the CPU matmul path,
the layers, the engine against fp32, validation, tensor parallelism and the roofline bytes.

The Triton kernel is tested under the interpreter in ``test_int8_triton.py``.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from helpers_engine import greedy, token_lists
from minivllm import LLM
from minivllm.config import EngineArgs
from minivllm.quantization import (Int8Weight, QuantConfig, dequantize, quantize_model, quantize_per_channel,
                                   quantized_layers)
from minivllm.quantization.accuracy import AGREEMENT_PROMPTS, _prefix
from minivllm.quantization.int8 import SCALE_BYTES, cpu_int8_unavailable_reason
from minivllm.telemetry.roofline import ModelCost

needs_fbgemm = pytest.mark.skipif(cpu_int8_unavailable_reason() is not None,
                                  reason=f"fbgemm int8: {cpu_int8_unavailable_reason()}")


# ---------------------------------------------------------------------------- quantiser
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_at_most_half_a_step(dtype):
    w = (torch.randn(48, 80, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert int(q.abs().max()) <= 127
    # every row uses the full range: its absmax maps to +-127
    assert torch.equal(q.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))
    err = (dequantize(q, scale) - w.float()).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())
    assert dequantize(q, scale, dtype).dtype == dtype


def test_scales_are_per_output_channel():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 32, generator=g)
    w[3] *= 1000.0  # one loud row must not coarsen the others
    w[5] = 0.0
    q, scale = quantize_per_channel(w)
    assert torch.allclose(scale[:5], w[:5].abs().amax(dim=1) / 127)
    assert scale[3] > 100 * scale[0]
    q_quiet, _ = quantize_per_channel(w[[0, 1, 2, 4]])
    assert torch.equal(q[[0, 1, 2, 4]], q_quiet)  # rows quantise independently
    assert scale[5] == 1.0 and int(q[5].abs().max()) == 0  # an all-zero row: no division by zero
    assert torch.equal(dequantize(q, scale)[5], torch.zeros(32))


def test_quantizer_refuses_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        quantize_per_channel(torch.randn(8))
    with pytest.raises(ValueError, match="int64"):
        quantize_per_channel(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="'int4'"):
        Int8Weight(torch.randn(4, 4), kernel="int4")


# ---------------------------------------------------------------------------- matmul paths
def test_reference_path_is_the_dequantised_linear():
    g = torch.Generator().manual_seed(3)
    w, x, b = torch.randn(24, 40, generator=g), torch.randn(5, 40, generator=g), torch.randn(24, generator=g)
    iw = Int8Weight(w, kernel="reference")
    want = F.linear(x, dequantize(*quantize_per_channel(w)), b)
    torch.testing.assert_close(iw.matmul(x, b), want)
    assert torch.equal(iw.int8_tensor(), quantize_per_channel(w)[0])


def _panel_gemm():
    from helpers_native import native_or_skip
    from minivllm.layers import cpu_gemm

    return native_or_skip(cpu_gemm, "the panel GEMM")


@pytest.mark.parametrize("threads", [1, 2])
def test_panel_int8_path_is_the_weight_only_linear(threads):
    """Our int8 panels: the dequantised linear up to float32 summation order (weight-only), at every row
    count a pass handles differently (1, 2-6, 7-12, more than 12, beyond one call's 256), k across the
    kernel's 256-value chunks, with and without a bias, and split over threads; the int8 values kept once."""
    _panel_gemm()
    g = torch.Generator().manual_seed(6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((16, 1), (48, 40), (64, 3), (96, 300), (160, 520), (192, 300), (1024, 512)):
            w = torch.randn(n, k, generator=g) * 0.05
            b = torch.randn(n, generator=g)
            iw = Int8Weight(w, kernel="panel-int8")
            assert iw.qweight is None and iw.packed is None and iw.panels.dtype == torch.int8
            width = 64 if n % 64 == 0 and _panel_gemm().prefers_groups else 16  # in groups of four where that pays
            assert iw.panels.shape == (n // width, k, width)
            assert torch.equal(iw.int8_tensor(), quantize_per_channel(w)[0])
            dq = iw.dequantized()
            for m in (1, 2, 5, 7, 12, 13, 31, 300):
                x = torch.randn(m, k, generator=g)
                for bias in (None, b):
                    got, want = iw.matmul(x, bias), F.linear(x, dq, bias)
                    assert got.shape == (m, n) and got.dtype == torch.float32
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    finally:
        torch.set_num_threads(before)
    # leading dims, a strided x and bf16 activations (converted to float32 and back)
    x = torch.randn(2, 3, 2 * 40, generator=g)[..., ::2]
    iw = Int8Weight(torch.randn(48, 40, generator=g), kernel="panel-int8")
    torch.testing.assert_close(iw.matmul(x), F.linear(x, iw.dequantized()), rtol=1e-5, atol=1e-5)
    yb = iw.matmul(x.to(torch.bfloat16))
    assert yb.shape == (2, 3, 48) and yb.dtype == torch.bfloat16
    gemm = _panel_gemm()
    with pytest.raises(ValueError, match=r"int8 panels and a contiguous float32 scale of their N outputs, got panels "
                                         r"torch.float32 \(3, 40, 16\)"):
        gemm.run_int8(x[0], iw.panels.float(), iw.scale)
    with pytest.raises(ValueError, match=r"scale torch.float32 \(47,\)"):
        gemm.run_int8(x[0], iw.panels, iw.scale[:47])
    # a wrong x or bias was read past its end (garbage, or a crash for a large x), where the reference raised
    with pytest.raises(ValueError, match=r"x torch.float32 \(2, 80\) on cpu for a weight of 40 input features"):
        iw.matmul(torch.randn(2, 80))
    with pytest.raises(ValueError, match=r"bias torch.float32 \(3,\) for 48 outputs"):
        iw.matmul(torch.randn(2, 40), torch.zeros(3))
    with pytest.raises(ValueError, match=r"with unit stride along it"):
        gemm.run_int8(torch.randn(2, 80)[:, ::2], iw.panels, iw.scale)


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_int8_panels_give_the_bits_of_panel_by_panel_ones(threads):
    """Int8 panels in groups of four ([N / 64, K, 64], one stream per pass) hold the values of [N / 16, K, 16]
    panels in another order, and each output sums over k in the same order: the same bits, at every row count
    a pass handles differently, k across chunks, a bias, and thread splits that fall inside a group (3 and 5
    groups over 2 threads)."""
    from minivllm.layers import cpu_gemm

    gemm = _panel_gemm()
    g = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((64, 7), (192, 300), (320, 520)):
            q, scale = quantize_per_channel(torch.randn(n, k, generator=g))
            grouped = cpu_gemm.pack_panels(q, torch.int8, grouped=True)
            by_panel = q.reshape(n // 16, 16, k).transpose(1, 2).contiguous()
            assert grouped.shape == (n // 64, k, 64) and torch.equal(cpu_gemm.unpack_panels(grouped), q.float())
            b = torch.randn(n, generator=g)
            for m in (1, 2, 6, 7, 12, 13, 40):
                x = torch.randn(m, k, generator=g)
                for bias in (None, b):
                    assert torch.equal(gemm.run_int8(x, grouped, scale, bias), gemm.run_int8(x, by_panel, scale, bias))
    finally:
        torch.set_num_threads(before)


def test_panel_int8_is_the_cpu_default_and_other_heights_take_the_next_path():
    _panel_gemm()
    g = torch.Generator().manual_seed(7)
    assert Int8Weight(torch.randn(32, 8, generator=g)).kernel == "panel-int8"
    odd = Int8Weight(torch.randn(20, 8, generator=g))  # 20 outputs: not whole panels of 16
    assert odd.kernel in ("fbgemm-dynamic", "reference") and odd.panels is None
    with pytest.raises(ValueError, match="multiple of 16 output features, got 20"):
        Int8Weight(torch.randn(20, 8, generator=g), kernel="panel-int8")


def test_int8_decode_steps_replay_in_cpu_graphs_with_eager_tokens(caplog):
    """With our int8 panels a decode step is C calls a CPU graph records (fbgemm's ops are not): graphs
    are on, and their tokens are the eager engine's."""
    _panel_gemm()
    with caplog.at_level(logging.INFO, logger="minivllm"):
        graphs = LLM("minivllm-tiny", quantization="int8")
    said = [r.getMessage() for r in caplog.records]
    eager = LLM("minivllm-tiny", quantization="int8", enforce_eager=True)
    try:
        assert graphs.llm_engine.runner.graph_runner is not None
        assert any(m.startswith("CPU graphs:") for m in said) and not any("graphs off" in m for m in said)
        prompts = list(AGREEMENT_PROMPTS[:6])
        assert _tokens(graphs, prompts, 20) == _tokens(eager, prompts, 20)
    finally:
        eager.shutdown()
        graphs.shutdown()


@needs_fbgemm
def test_int8_through_fbgemm_keeps_cpu_graphs_off(caplog, monkeypatch):
    from minivllm.quantization import int8

    monkeypatch.setattr(int8, "default_kernel", lambda device: "fbgemm-dynamic")
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = LLM("minivllm-tiny", quantization="int8")
    llm.shutdown()
    assert any("CPU graphs off" in r.getMessage() and "fbgemm-dynamic" in r.getMessage() for r in caplog.records)


@needs_fbgemm
def test_fbgemm_path_matches_reference_and_keeps_one_int8_copy():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 256, generator=g) * 0.02
    x = torch.randn(7, 256, generator=g)
    x[2] *= 300.0  # an outlier token: per-token activation scaling keeps the others accurate
    b = torch.randn(96, generator=g)
    iw = Int8Weight(w, kernel="fbgemm-dynamic")
    assert iw.qweight is None and iw.packed is not None
    assert torch.equal(iw.int8_tensor(), quantize_per_channel(w)[0])  # the packed copy holds our int8 values
    ref = Int8Weight(w, kernel="reference").matmul(x, b)
    got = iw.matmul(x, b)
    assert got.shape == (7, 96) and got.dtype == torch.float32
    rel = (got - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)
    assert float(rel.max()) < 0.03, rel  # 7-bit activations: ~1% of a row's range
    one = iw.matmul(x[3:4], b)
    assert float(((one - ref[3:4]).abs().max() / ref[3].abs().max())) < 0.03
    # batched leading dims and bf16 activations go through the same path
    xb = x[:6].reshape(2, 3, 256).to(torch.bfloat16)
    yb = iw.matmul(xb)
    assert yb.shape == (2, 3, 96) and yb.dtype == torch.bfloat16


@needs_fbgemm
@pytest.mark.parametrize("fused", [True, False], ids=["c-map", "torch-map"])
def test_fbgemm_row_results_do_not_depend_on_the_other_rows(fused, monkeypatch):
    """torch quantises the call's activations with one range: a row's result depended on its neighbours
    (an all-positive row alone against beside a row with a negative extreme: 0.32 apart), so greedy tokens
    changed with the batch. Each row is now mapped onto [-1, 1] beside a row holding -1 and 1: the same
    bits alone or in any batch, with the map in C or in torch ops (no C compiler). A row with a NaN gives
    NaN without touching the others; a constant row and one input feature are exact enough."""
    if not fused:
        from minivllm.layers import cpu_fused

        monkeypatch.setattr(cpu_fused, "load", lambda: None)
    g = torch.Generator().manual_seed(5)
    iw = Int8Weight(torch.randn(64, 128, generator=g), kernel="fbgemm-dynamic")
    a = torch.randn(1, 128, generator=g).abs()
    others = torch.randn(5, 128, generator=g) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0])[:, None]
    alone = iw.matmul(a)
    for batch in (torch.cat([a, others[:1]]), torch.cat([others, a]), torch.cat([others[2:], a, others[:2]])):
        at = next(i for i in range(len(batch)) if torch.equal(batch[i], a[0]))
        assert torch.equal(iw.matmul(batch)[at], alone[0])
    ref = a @ iw.dequantized().T
    assert float((alone - ref).abs().max() / ref.abs().max()) < 0.03
    bad = others.clone()
    bad[1, 7] = float("nan")
    y, y_ok = iw.matmul(bad), iw.matmul(others)
    assert torch.isnan(y[1]).all() and torch.equal(y[[0, 2, 3, 4]], y_ok[[0, 2, 3, 4]])
    const = torch.full((2, 128), 0.7)
    assert torch.allclose(iw.matmul(const), const @ iw.dequantized().T, atol=1e-4)
    one = Int8Weight(torch.randn(16, 1, generator=g), kernel="fbgemm-dynamic")
    x1 = torch.tensor([[2.0], [-3.0], [0.0]])
    assert torch.allclose(one.matmul(x1), x1 @ one.dequantized().T, atol=1e-5)


@needs_fbgemm
def test_int8_greedy_tokens_do_not_depend_on_the_batch():
    """The same prompts one at a time and together: 5 of 8 continuations differed (fp32: none)."""
    llm = LLM("minivllm-tiny", quantization="int8")
    try:
        prompts = list(AGREEMENT_PROMPTS[:8])
        together = _tokens(llm, prompts, 24)
        assert [_tokens(llm, [p], 24)[0] for p in prompts] == together
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------- engine
def _tokens(llm, prompts, n):
    return token_lists(llm.generate(list(prompts), greedy(n), use_tqdm=False))


@pytest.fixture(scope="module")
def fp32_and_int8():
    base = LLM(None)
    quant = LLM(None, quantization="int8")
    yield base, quant
    quant.shutdown()
    base.shutdown()


def test_int8_engine_drops_float_weights(fp32_and_int8):
    base, quant = fp32_and_int8
    model = quant.llm_engine.runner.model
    layers = quantized_layers(model)
    cfg = quant.llm_engine.source.hf_config
    assert len(layers) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down per layer + the LM head
    for m in layers:
        if m is not model.lm_head:
            assert m.weight is None  # the float copy is gone
    # tied embeddings: the table stays float for lookups, the head multiplies by its own int8 copy
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # float32 bytes of the base model's parameters (its packed linears may hold 16-bit values)
    base_bytes = sum(p.numel() * 4 for p in base.llm_engine.runner.model.parameters())
    int8_bytes = sum(m.int8.nbytes for m in layers)
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    # what is left in float: the embedding table and the norms
    assert float_bytes - embed_bytes < 0.01 * base_bytes
    assert int8_bytes < (base_bytes - embed_bytes) / 4 + embed_bytes / 4 + 4 * 4096 * 8


@pytest.mark.parametrize("kernel", ["panel-int8", "fbgemm-dynamic", "reference"])
def test_an_int8_models_state_dict_loads_back_and_loaded_values_take_effect(kernel):
    """``model.load_state_dict(model.state_dict())`` of an int8 model raised on the ``weight_int8`` keys
    its packed paths save; with ``strict=False`` a loaded scale reached the buffer, not the packed copy
    the matmul reads. The layer's int8 form is now rebuilt from the loaded values."""
    from minivllm.engine.model_runner import build_model
    from minivllm.utils.model_source import resolve_model

    if kernel == "panel-int8":
        _panel_gemm()
    if kernel == "fbgemm-dynamic" and cpu_int8_unavailable_reason() is not None:
        pytest.skip(f"fbgemm int8: {cpu_int8_unavailable_reason()}")
    model = build_model(resolve_model(None), torch.device("cpu"), torch.float32, 0, None)
    quantize_model(model, QuantConfig("int8", kernel=kernel))
    layer, name = model.model.layers[1].mlp.down_proj, "model.layers.1.mlp.down_proj."
    assert layer.int8.kernel == kernel
    state = model.state_dict()
    assert state[name + "weight_int8"].dtype == torch.int8
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        before = layer(x)
    assert model.load_state_dict(state) is not None  # raised: unexpected key(s) ...weight_int8
    changed = dict(state)
    changed[name + "weight_int8"] = -state[name + "weight_int8"]
    changed[name + "weight_scale"] = 2 * state[name + "weight_scale"]
    model.load_state_dict(changed)
    assert layer.int8.kernel == kernel
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), -2 * before, rtol=1e-6, atol=1e-6 * float(before.abs().max()))
    assert torch.equal(model.state_dict()[name + "weight_int8"], changed[name + "weight_int8"])
    bad = dict(state)
    bad[name + "weight_int8"] = state[name + "weight_int8"][:, 1:]
    with pytest.raises(RuntimeError, match=r"size mismatch for model.layers.1.mlp.down_proj.weight_int8"):
        model.load_state_dict(bad)
    bad[name + "weight_int8"] = state[name + "weight_int8"].float()
    with pytest.raises(RuntimeError, match=r"down_proj.weight_int8 / .*expected int8 \[out, in\], got torch.float32"):
        model.load_state_dict(bad)
    del bad[name + "weight_scale"], bad[name + "weight_int8"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model.layers.1.mlp.down_proj.weight_int8"):
        model.load_state_dict(bad)
    lone = dict(state)
    del lone[name + "weight_scale"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model.layers.1.mlp.down_proj.weight_scale"):
        model.load_state_dict(lone)
    with torch.inference_mode():  # neither refused load changed the layer
        torch.testing.assert_close(layer(x), -2 * before, rtol=1e-6, atol=1e-6 * float(before.abs().max()))


def test_an_int8_engine_reloading_its_own_state_dict_keeps_its_tokens(fp32_and_int8, caplog):
    """Through the engine, CPU graphs included: the reload puts new tensors in the int8 buffers, so the
    graphs are recorded again over the rebuilt panels (not replayed over the freed ones) and the tokens
    stay the same."""
    _, quant = fp32_and_int8
    prompts = ["the quick brown", "one two three"]
    want = token_lists(quant.generate(prompts, greedy(6), use_tqdm=False))
    model = quant.llm_engine.runner.model
    model.load_state_dict(model.state_dict())
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert token_lists(quant.generate(prompts, greedy(6), use_tqdm=False)) == want
    assert "the model's parameters changed; recording the graphs again" in caplog.text


def test_int8_greedy_tokens_agree_with_fp32(fp32_and_int8):
    base, quant = fp32_and_int8
    n = 16
    want, got = _tokens(base, AGREEMENT_PROMPTS, n), _tokens(quant, AGREEMENT_PROMPTS, n)
    prefix = sum(_prefix(a, b) for a, b in zip(want, got)) / (n * len(want))
    # measured 78.5% over 32 tokens (docs/quantization.md); a broken int8 path agrees ~never
    assert prefix >= 0.6, prefix
    assert sum(a[0] == b[0] for a, b in zip(want, got)) >= len(want) - 2  # first tokens nearly all equal


def test_lm_head_can_stay_float(fp32_and_int8):
    from minivllm.quantization.layer import Int8LinearMixin

    base, _ = fp32_and_int8
    llm = LLM(None, quantization="int8", quantize_lm_head=False)
    try:
        model = llm.llm_engine.runner.model
        head, embed = model.lm_head, model.model.embed_tokens.weight
        # the head holds no int8 copy: it multiplies by the (tied) float32 embedding table
        assert head.int8 is None and not {"weight_scale", "weight_int8"} & set(head._buffers)
        assert head.weight is embed and embed.dtype == torch.float32
        # every other linear is int8, its float weight dropped
        others = [m for m in model.modules() if isinstance(m, Int8LinearMixin) and m is not head]
        assert len(others) == 4 * llm.llm_engine.source.hf_config.num_hidden_layers
        assert all(m.int8 is not None and m.weight is None for m in others)
        assert quantized_layers(model) == others
        # the logits are the float product (an int8 head is off by ~1e-2 here; float rounding ~1e-6)
        hidden = torch.randn(5, embed.shape[1], generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(head.compute_logits(hidden), F.linear(hidden, embed), rtol=0, atol=1e-4)
        # sane outputs: in the vocabulary, and greedy tokens mostly fp32's (as the all-int8 engine's are)
        n, vocab = 16, llm.llm_engine.source.hf_config.vocab_size
        want, got = _tokens(base, AGREEMENT_PROMPTS, n), _tokens(llm, AGREEMENT_PROMPTS, n)
        assert all(len(t) == n and all(0 <= x < vocab for x in t) for t in got)
        prefix = sum(_prefix(a, b) for a, b in zip(want, got)) / (n * len(want))
        assert prefix >= 0.6, prefix  # measured 0.89
        assert sum(a[0] == b[0] for a, b in zip(want, got)) >= len(want) - 2
    finally:
        llm.shutdown()


def test_startup_logs_the_int8_path(caplog):
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = LLM(None, quantization="int8")
    llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("int8 weights:")]
    assert len(lines) == 1 and "matmul:" in lines[0], lines


def test_reload_dequantises_then_requantises():
    from minivllm.utils.loader import load_weights
    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

    llm = LLM(None, quantization="int8")
    try:
        model = llm.llm_engine.runner.model
        before = _tokens(llm, ["The list type"], 8)
        scales = model.model.layers[0].mlp.down_proj.weight_scale.clone()
        load_weights(model, EMBEDDED_MODEL_DIR)  # float again while loading, int8 after
        assert len(quantized_layers(model)) == 17
        torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight_scale, scales)
        assert _tokens(llm, ["The list type"], 8) == before
    finally:
        llm.shutdown()


def test_quantize_model_without_config_is_a_no_op(fp32_and_int8):
    base, _ = fp32_and_int8
    assert quantize_model(base.llm_engine.runner.model) == 0
    assert quantized_layers(base.llm_engine.runner.model) == []


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", ["int4", "INT8", "fp8", 8, True])
def test_unknown_quantization_is_refused(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        EngineArgs(quantization=bad)
    with pytest.raises(ValueError, match="quantization"):
        LLM(None, quantization=bad)


def test_bad_lm_head_flag_and_quant_config():
    with pytest.raises(ValueError, match="quantize_lm_head='yes'"):
        EngineArgs(quantization="int8", quantize_lm_head="yes")
    with pytest.raises(ValueError, match="'int2'"):
        QuantConfig("int2")
    assert EngineArgs().quant_config is None
    assert EngineArgs(quantization="int8", quantize_lm_head=False).quant_config == QuantConfig("int8", False)


# ---------------------------------------------------------------------------- roofline
def _qwen3_06b():
    from minivllm.utils.model_source import resolve_model

    return resolve_model("random:qwen3-0.6b").hf_config


def test_roofline_counts_int8_bytes_and_scales():
    cfg = _qwen3_06b()
    fp = ModelCost.from_config(cfg, "float32")
    q = ModelCost.from_config(cfg, "float32", quantization="int8")
    D, F_, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    d = cfg.head_dim
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out_rows = (H + 2 * Hkv) * d + D + 2 * F_ + D  # qkv, o, gate+up, down
    assert q.body_weight_bytes == L * (fp.layer_matmul_params + out_rows * SCALE_BYTES) + fp.norm_params * 4
    assert q.lm_head_bytes == D * V + V * SCALE_BYTES
    assert fp.body_weight_bytes == (fp.matmul_params + fp.norm_params) * 4  # unchanged without quantisation
    nohead = ModelCost.from_config(cfg, "float32", quantization="int8", quantize_lm_head=False)
    assert nohead.lm_head_bytes == fp.lm_head_bytes
    ratio = (q.body_weight_bytes + q.lm_head_bytes) / (fp.body_weight_bytes + fp.lm_head_bytes)
    assert 0.25 < ratio < 0.26
    with pytest.raises(ValueError, match="'int4'"):
        ModelCost.from_config(cfg, "float32", quantization="int4")


def test_roofline_bytes_match_the_quantised_model(fp32_and_int8):
    """The formula against the tensors the engine really holds (embedded model, tp=1)."""
    _, quant = fp32_and_int8
    model = quant.llm_engine.runner.model
    cost = quant.llm_engine.model_cost
    layers = quantized_layers(model)
    body = sum(m.int8.nbytes for m in layers if m is not model.lm_head)
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    assert cost.body_weight_bytes == body + norms
    assert cost.lm_head_bytes == model.lm_head.int8.nbytes
    assert cost.quantization == "int8"


# ---------------------------------------------------------------------------- tensor parallel
def test_tp2_int8_is_the_tp1_int8_model(fp32_and_int8):
    """Each rank quantised its own shard: a row-parallel layer (o_proj, down_proj) holds part of every row,
    so its per-row scales came from that part only, and tp=2 ran another int8 model than tp=1 (scales up to
    ~45% apart; greedy tokens diverged on 1 of 30 prompts). The scales now come from the whole row."""
    _, quant = fp32_and_int8
    prompts = list(AGREEMENT_PROMPTS[:4])
    want = _tokens(quant, prompts, 8)
    llm = LLM(None, quantization="int8", tensor_parallel_size=2, num_kvcache_blocks=64)
    try:
        got = _tokens(llm, prompts, 8)
        one, two = (dict(x.llm_engine.runner.model.named_modules()) for x in (quant, llm))
        rows = [n for n, m in two.items() if getattr(m, "input_is_sharded", False) and m.int8 is not None]
        assert rows, "no row-parallel int8 layer on rank 0"
        for name in rows:  # rank 0's shard: the first half of every row, with the whole row's scale
            a, b = one[name].int8, two[name].int8
            assert torch.equal(a.scale, b.scale), name
            assert torch.equal(a.dequantized()[:, :b.in_features], b.dequantized()), name
    finally:
        llm.shutdown()
    assert got == want


# ---------------------------------------------------------------------------- bench
def test_bench_quantization_mode_reports_ratio_and_agreement():
    from minivllm.bench.cli import run_cli

    res = run_cli(["--quantization", "int8", "--threads", "1", "--decode-steps", "4", "--rounds", "1", "--quiet"],
                  peak_kwargs={"matmul_size": 64, "copy_bytes": 1 << 20, "read_bytes": 1 << 20, "repeats": 2})
    r = res["quantization"]
    assert r.quantization == "int8" and any(name in r.kernel for name in ("panel GEMM", "fbgemm", "reference"))
    assert r.speedup == pytest.approx(r.base["median_itl_ms"] / r.quant["median_itl_ms"])
    # int8 bytes in the int8 engine's roofline: 1 a weight (+ a scale per output channel), against 2
    # where the base engine holds the embedded model's float16 values in 16-bit panels, else 4
    assert r.quant["weight_bytes"] < r.base["weight_bytes"] / 1.8
    assert len(r.base["tpot_ms"]) == len(r.quant["tpot_ms"]) == 1
    assert set(r.agreement) >= {"prefix_agreement", "position_agreement", "identical"}
    with pytest.raises(SystemExit):  # argparse refuses an unknown method
        run_cli(["--quantization", "int4", "--quiet"])


def test_bench_quantization_gives_each_gpu_engine_its_own_kv_pool(monkeypatch):
    """Both engines live at once: on a GPU the second one's memory profile counted the first's pool (0.9 of
    the device) as its own use and found no room for a block (gpu_check's int8 section, bench
    --quantization). Each now gets an explicit 1 GiB pool there, unless the caller sizes one."""
    import minivllm.config
    from minivllm.bench import quant

    built = []

    def fake_build(model, **kw):
        built.append(kw)
        raise RuntimeError("stop after the first build")

    monkeypatch.setattr(quant, "build_llm", fake_build)
    monkeypatch.setattr(minivllm.config, "resolve_device", lambda device: torch.device("cuda"))
    with pytest.raises(RuntimeError, match="first build"):
        quant.run_quantization("random:qwen3-0.6b", peaks=False)
    assert built[-1].get("kv_cache_memory_bytes") == quant.TWO_ENGINE_KV_BYTES
    with pytest.raises(RuntimeError, match="first build"):
        quant.run_quantization("random:qwen3-0.6b", peaks=False, gpu_memory_utilization=0.4)
    assert "kv_cache_memory_bytes" not in built[-1] and built[-1]["gpu_memory_utilization"] == 0.4
    monkeypatch.setattr(minivllm.config, "resolve_device", lambda device: torch.device("cpu"))
    with pytest.raises(RuntimeError, match="first build"):
        quant.run_quantization("random:qwen3-0.6b", peaks=False)
    assert "kv_cache_memory_bytes" not in built[-1]  # the CPU default (512 MiB) stands


def test_accuracy_report_skips_the_loss_where_no_training_script_ships(monkeypatch, tmp_path, capsys):
    """On a wheel install (no scripts/) `python -m minivllm.quantization.accuracy` ended in a
    FileNotFoundError traceback before any figure; the held-out loss is now skipped, saying why."""
    from minivllm.quantization import accuracy

    monkeypatch.setattr(accuracy, "TRAIN_SCRIPT", tmp_path / "scripts" / "train_tiny_model.py")
    out = accuracy.main(["--skip", "agreement", "logits", "--threads", "1"])
    assert "heldout_loss" not in out
    assert "held-out loss: skipped" in capsys.readouterr().out
