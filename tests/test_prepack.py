"""Prepacked CPU linears, both forms (panels for our GEMM in float32, oneDNN's blocked layout
otherwise): packed once at load, same results, no dense copy left behind."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from helpers_models import make_hf_checkpoint
from helpers_native import native_or_skip
from minivllm.distributed import tp_scope
from minivllm.layers import cpu_gemm, prepack
from minivllm.layers.embedding import ParallelLMHead
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.utils.loader import init_random_weights, load_weights

def _model(path):
    return Qwen3ForCausalLM(AutoConfig.from_pretrained(path)).eval()


@pytest.fixture(params=["panels", "onednn"])
def form(request, monkeypatch):
    """Which packed form float32 weights take: panels (where the C GEMM loads) or oneDNN (with
    ``MINIVLLM_CPU_GEMM=0``)."""
    if request.param == "panels":
        native_or_skip(cpu_gemm, "panel GEMM")
    else:
        if prepack.onednn_unavailable_reason(torch.float32) is not None:
            pytest.skip("oneDNN prepacking unavailable on this CPU/torch")
        monkeypatch.setenv(cpu_gemm.ENV_SWITCH, "0")
    return request.param


def _is_form(t, form, rows):
    """``t`` is packed in ``form`` (panels need a multiple of 16 output rows: others go to oneDNN)."""
    return cpu_gemm.is_panels(t) if form == "panels" and rows % 16 == 0 else t.is_mkldnn


@pytest.mark.parametrize("tied", [True, False])
def test_loading_packs_every_linear_once_without_a_dense_copy(tmp_path, tied, form):
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=tied)
    model = _model(path)
    load_weights(model, path)
    rows = {m: m.output_size if hasattr(m, "output_size") else m.shard_size for m in model.modules()
            if hasattr(m, "pack_weights")}
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        is_matrix = name.endswith("proj.weight") or name == "lm_head.weight"
        assert prepack.is_packed(p) == is_matrix, name  # the parameter itself is the packed tensor
        if is_matrix:
            assert _is_form(p, form, rows[owner]), name
    assert not prepack.is_packed(model.model.embed_tokens.weight)  # the lookup needs the plain table
    head = model.lm_head
    assert (head.packed_copy is not None) == tied  # tied: a packed copy beside the shared table
    assert (head.weight is model.model.embed_tokens.weight) == tied


def test_a_vocabulary_that_is_a_multiple_of_16_gets_a_panel_head(tmp_path):
    native_or_skip(cpu_gemm, "panel GEMM")
    path = make_hf_checkpoint(tmp_path, vocab_size=160, tie_word_embeddings=False)
    model = _model(path)
    load_weights(model, path)
    assert cpu_gemm.is_panels(model.lm_head.weight)
    h = torch.randn(3, model.lm_head.embedding_dim)
    dense_head = model.state_dict()["lm_head.weight"]
    assert dense_head.shape == (160, model.lm_head.embedding_dim)
    torch.testing.assert_close(model.lm_head.compute_logits(h), F.linear(h, dense_head), atol=1e-5, rtol=1e-5)


def test_state_dict_is_dense_and_reload_after_packing_works(tmp_path, form):
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=False)
    a, b = _model(path), _model(path)
    load_weights(a, path)
    init_random_weights(b, 3)  # packed with other values ...
    load_weights(b, path)      # ... then loaded again: unpacked, written, repacked
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert not prepack.is_packed(sa[k]), k
        torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_load_state_dict_into_a_packed_model_loads_every_layer_and_packs_it_again(tmp_path, form, tied):
    """It raised on the panels' shape after loading the layers before it, and a tied LM head's
    packed copy kept the old table."""
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=tied)
    a, b = _model(path), _model(path)
    load_weights(a, path)
    init_random_weights(b, 3)  # packed, with other values
    b.load_state_dict(a.state_dict())
    for name, p in b.named_parameters():
        assert prepack.is_packed(p) == prepack.is_packed(dict(a.named_parameters())[name]), name
    assert (b.lm_head.packed_copy is not None) == tied
    mods_a = dict(a.named_modules())
    with torch.inference_mode():
        for name, m in b.named_modules():
            if hasattr(m, "pack_weights"):  # every linear and the LM head multiplies by a's values
                w = m.matmul_weight
                x = torch.randn(3, prepack.dense(w).shape[1])
                torch.testing.assert_close(prepack.linear(x, w), prepack.linear(x, mods_a[name].matmul_weight),
                                           atol=0, rtol=0, msg=name)
        h = torch.randn(3, b.lm_head.embedding_dim)
        torch.testing.assert_close(b.compute_logits(h), a.compute_logits(h), atol=0, rtol=0)


def test_packed_layers_match_f_linear_under_tensor_parallel_shards(form):
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 32, 64  # every local output a multiple of 16 at tp 2 (panels where the GEMM loads)
    w_gu = torch.randn(2 * inter, hidden, generator=gen)
    w_down = torch.randn(hidden, inter, generator=gen)
    w_qkv = torch.randn((4 + 2 + 2) * 8, hidden, generator=gen)
    x = torch.randn(5, hidden, generator=gen)
    for rank in range(2):
        with tp_scope(rank, 2):
            gu = MergedColumnParallelLinear(hidden, [inter, inter])
            qkv = QKVParallelLinear(hidden, 8, 4, 2)
            down = RowParallelLinear(inter, hidden)
        for layer, w in ((gu, w_gu), (qkv, w_qkv), (down, w_down)):
            layer.weight.weight_loader(layer.weight, w)
            ref_w = layer.weight.detach().clone()
            assert layer.pack_weights() and _is_form(layer.weight, form, layer.output_size)
            inp = x if layer is not down else torch.randn(5, inter // 2, generator=gen)
            torch.testing.assert_close(layer(inp), F.linear(inp, ref_w), atol=1e-5, rtol=1e-5)
            # a direct loader call on a packed layer (as notebook 10 does) unpacks it first
            layer.weight.weight_loader(layer.weight, prepack.pack_weight(w))
            assert not prepack.is_packed(layer.weight)
            torch.testing.assert_close(layer.weight.data, ref_w, atol=0, rtol=0)


@pytest.mark.parametrize("vocab", [50, 64])
def test_tied_head_keeps_dense_table_and_matches_f_linear(form, vocab):
    head = ParallelLMHead(vocab, 16)
    head.weight.data.copy_(torch.randn(vocab, 16, generator=torch.Generator().manual_seed(1)))
    table = head.weight.detach().clone()
    assert head.pack_weights(shared=True)
    assert not prepack.is_packed(head.weight) and _is_form(head.packed_copy, form, vocab)
    h = torch.randn(3, 16)
    torch.testing.assert_close(head.compute_logits(h), F.linear(h, table), atol=1e-5, rtol=1e-5)


def test_with_neither_packed_form_every_layer_keeps_f_linear_and_one_log_line_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(prepack, "onednn_unavailable_reason", lambda dtype: "no oneDNN here")
    monkeypatch.setenv(cpu_gemm.ENV_SWITCH, "0")
    path = make_hf_checkpoint(tmp_path)
    model = _model(path)
    with caplog.at_level(logging.INFO, logger="minivllm.layers.prepack"):
        load_weights(model, path)
    assert not any(prepack.is_packed(p) for p in model.parameters())
    lines = [r.getMessage() for r in caplog.records if r.name == "minivllm.layers.prepack"]
    assert lines == ["CPU linears: 9 through F.linear (MKL) (panel GEMM unavailable: MINIVLLM_CPU_GEMM=0; "
                     "oneDNN unavailable: no oneDNN here)"]


def test_the_log_line_counts_the_layers_of_each_form(tmp_path, caplog):
    native_or_skip(cpu_gemm, "panel GEMM")
    if prepack.onednn_unavailable_reason(torch.float32) is not None:
        pytest.skip("oneDNN prepacking unavailable on this CPU/torch")
    path = make_hf_checkpoint(tmp_path, vocab_size=100)  # 100 rows: the head goes to oneDNN
    with caplog.at_level(logging.INFO, logger="minivllm.layers.prepack"):
        load_weights(_model(path), path)
    lines = [r.getMessage() for r in caplog.records if r.name == "minivllm.layers.prepack"]
    assert len(lines) == 1 and lines[0].startswith("CPU linears: 8 through our panel GEMM (")
    assert lines[0].endswith(", 1 through oneDNN prepacked weights")


def test_the_onednn_probe_runs_on_the_cpu_under_a_meta_default_device():
    """The probe's answer is cached for the process: made under ``with torch.device("meta")`` its
    tensors landed on meta, it failed, and every later engine fell back to F.linear (user trial)."""
    from minivllm.layers.prepack import onednn_unavailable_reason

    onednn_unavailable_reason.cache_clear()
    try:
        on_cpu = onednn_unavailable_reason(torch.float32)  # None where this torch has oneDNN
        onednn_unavailable_reason.cache_clear()
        with torch.device("meta"):
            assert onednn_unavailable_reason(torch.float32) == on_cpu
    finally:
        onednn_unavailable_reason.cache_clear()
