"""oneDNN prepacked CPU linears: packed once at load, same results, no dense copy left behind."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from helpers_models import make_hf_checkpoint
from minivllm.distributed import tp_scope
from minivllm.layers import prepack
from minivllm.layers.embedding import ParallelLMHead
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.utils.loader import init_random_weights, load_weights

needs_onednn = pytest.mark.skipif(prepack.onednn_unavailable_reason(torch.float32) is not None,
                                  reason="oneDNN prepacking unavailable on this CPU/torch")


def _model(path):
    return Qwen3ForCausalLM(AutoConfig.from_pretrained(path)).eval()


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_loading_packs_every_linear_once_without_a_dense_copy(tmp_path, tied):
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=tied)
    model = _model(path)
    load_weights(model, path)
    for name, p in model.named_parameters():
        is_matrix = name.endswith("proj.weight") or name == "lm_head.weight"
        assert p.is_mkldnn == is_matrix, name  # the parameter itself is the packed tensor
    assert not model.model.embed_tokens.weight.is_mkldnn  # the lookup needs the plain table
    head = model.lm_head
    assert (head.packed_copy is not None) == tied  # tied: a packed copy beside the shared table
    assert (head.weight is model.model.embed_tokens.weight) == tied


@needs_onednn
def test_state_dict_is_dense_and_reload_after_packing_works(tmp_path):
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=False)
    a, b = _model(path), _model(path)
    load_weights(a, path)
    init_random_weights(b, 3)  # packed with other values ...
    load_weights(b, path)      # ... then loaded again: unpacked, written, repacked
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert not sa[k].is_mkldnn, k
        torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0)


@needs_onednn
def test_packed_layers_match_f_linear_under_tensor_parallel_shards():
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 32, 48
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
            assert layer.pack_weights() and layer.weight.is_mkldnn
            inp = x if layer is not down else torch.randn(5, inter // 2, generator=gen)
            torch.testing.assert_close(layer(inp), F.linear(inp, ref_w), atol=1e-5, rtol=1e-5)
            # a direct loader call on a packed layer (as notebook 10 does) unpacks it first
            layer.weight.weight_loader(layer.weight, prepack.pack_weight(w))
            assert not layer.weight.is_mkldnn
            torch.testing.assert_close(layer.weight.data, ref_w, atol=0, rtol=0)


@needs_onednn
def test_tied_head_keeps_dense_table_and_matches_f_linear():
    head = ParallelLMHead(50, 16)
    head.weight.data.copy_(torch.randn(50, 16, generator=torch.Generator().manual_seed(1)))
    table = head.weight.detach().clone()
    assert head.pack_weights(shared=True)
    assert not head.weight.is_mkldnn and head.packed_copy.is_mkldnn
    h = torch.randn(3, 16)
    torch.testing.assert_close(head.compute_logits(h), F.linear(h, table), atol=1e-5, rtol=1e-5)


def test_unavailable_onednn_falls_back_to_f_linear_with_one_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(prepack, "onednn_unavailable_reason", lambda dtype: "no oneDNN here")
    path = make_hf_checkpoint(tmp_path)
    model = _model(path)
    with caplog.at_level(logging.INFO, logger="minivllm.layers.prepack"):
        load_weights(model, path)
    assert not any(p.is_mkldnn for p in model.parameters())
    lines = [r.getMessage() for r in caplog.records if r.name == "minivllm.layers.prepack"]
    assert lines == ["CPU linears use F.linear (MKL): oneDNN prepacking unavailable: no oneDNN here"]


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
