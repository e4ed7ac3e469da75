"""Checkpoint loading, config field helpers, presets and random weights."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from helpers_models import make_hf_checkpoint
from minivllm.layers.prepack import dense
from minivllm.models.hf_config import get_config_dtype, get_head_dim, get_rope_theta
from minivllm.models.presets import list_presets, load_preset_config
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.models.registry import get_model_class
from minivllm.utils.loader import init_random_weights, load_weights


def _model(path):
    return Qwen3ForCausalLM(AutoConfig.from_pretrained(path))


def _drop_tensor(path, name):
    state = load_file(str(path / "model.safetensors"))
    del state[name]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_hf_checkpoint(tmp_path)
    _drop_tensor(path, "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_weights(_model(path), path)


@pytest.mark.parametrize("name", ["lm_head.weight", "model.layers.0.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.q_norm.weight", "model.norm.weight"])
def test_each_kind_of_missing_tensor_is_named(tmp_path, name):
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=False)
    _drop_tensor(path, name)
    with pytest.raises(ValueError) as err:
        load_weights(_model(path), path)
    assert name in str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" not in str(err.value)


def test_missing_directory_names_the_path(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        load_weights(torch.nn.Linear(1, 1), missing)


def test_directory_without_safetensors_names_the_path(tmp_path):
    empty = tmp_path / "empty-ckpt"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="empty-ckpt"):
        load_weights(torch.nn.Linear(1, 1), empty)


def test_wrong_shape_names_the_tensor(tmp_path):
    path = make_hf_checkpoint(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        load_weights(_model(path), path)


def test_tied_checkpoint_without_lm_head_loads(tmp_path):
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = _model(path)
    load_weights(model, path)
    emb = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, emb)


def test_tied_checkpoint_with_a_different_lm_head_says_the_embedding_is_used(tmp_path, caplog):
    """tie_word_embeddings=true beside a separate lm_head.weight: vLLM uses the embedding (as here), transformers
    may keep the head, and the logits differ; the separate head was dropped without a word."""
    path = make_hf_checkpoint(tmp_path, tie_word_embeddings=True)
    state = load_file(str(path / "model.safetensors"))
    for head, warned in ((state["model.embed_tokens.weight"].clone(), False),
                         (state["model.embed_tokens.weight"] + 1.0, True)):
        save_file({**state, "lm_head.weight": head}, str(path / "model.safetensors"), metadata={"format": "pt"})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minivllm"):
            model = _model(path)
            load_weights(model, path)
        assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
        said = [r.getMessage() for r in caplog.records if "tie_word_embeddings=true" in r.getMessage()]
        assert len(said) == warned, said


def test_already_packed_names_load(tmp_path):
    path = make_hf_checkpoint(tmp_path)
    src = _model(path)
    load_weights(src, path)
    packed = tmp_path / "packed"
    packed.mkdir()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(packed / "model.safetensors"))
    assert any("qkv_proj" in k for k in load_file(str(packed / "model.safetensors")))
    dst = _model(path)
    init_random_weights(dst, 5)
    load_weights(dst, packed)
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), n


def test_load_converts_to_model_dtype(tmp_path):
    path = make_hf_checkpoint(tmp_path)
    model = _model(path).to(torch.bfloat16)
    load_weights(model, path)
    ref = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    # dense(): where oneDNN takes bf16 (AVX-512 BF16 / AMX CPUs) the loaded weight is packed for it
    qkv = dense(model.model.layers[0].self_attn.qkv_proj.weight)
    assert qkv.dtype == torch.bfloat16
    assert torch.equal(qkv[: ref.shape[0]], ref.to(torch.bfloat16))


def test_rope_theta_top_level_and_rope_parameters(tmp_path):
    assert get_rope_theta(SimpleNamespace(rope_theta=5e5)) == 5e5
    assert get_rope_theta(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 123.0})) == 123.0
    assert get_rope_theta(SimpleNamespace()) == 10000.0
    with pytest.raises(ValueError, match="yarn"):
        get_rope_theta(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}))
    # An old-style config.json (top-level rope_theta) read through transformers.
    path = make_hf_checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 777777.0
    (path / "config.json").write_text(json.dumps(cfg))
    config = AutoConfig.from_pretrained(path)
    assert get_rope_theta(config) == 777777.0
    assert Qwen3ForCausalLM(config).model.rotary.base == 777777.0


def test_dtype_and_torch_dtype(tmp_path):
    assert get_config_dtype(SimpleNamespace(dtype="bfloat16")) == torch.bfloat16
    assert get_config_dtype(SimpleNamespace(torch_dtype="float16")) == torch.float16
    assert get_config_dtype(SimpleNamespace(torch_dtype=torch.float32)) == torch.float32
    assert get_config_dtype(SimpleNamespace()) is None
    with pytest.raises(ValueError, match="float8"):
        get_config_dtype(SimpleNamespace(dtype="float8"))
    path = make_hf_checkpoint(tmp_path)
    for key in ("torch_dtype", "dtype"):
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("dtype", None)
        cfg.pop("torch_dtype", None)
        cfg[key] = "bfloat16"
        (path / "config.json").write_text(json.dumps(cfg))
        assert get_config_dtype(AutoConfig.from_pretrained(path)) == torch.bfloat16, key


def test_head_dim_from_config_or_derived():
    assert get_head_dim(SimpleNamespace(head_dim=128, hidden_size=1024, num_attention_heads=16)) == 128
    assert get_head_dim(SimpleNamespace(hidden_size=1024, num_attention_heads=16)) == 64


def test_presets():
    assert {"qwen3-0.6b", "qwen3-1.7b"} <= set(list_presets())
    cfg = load_preset_config("qwen3-0.6b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (1024, 28, 16, 8)
    assert (get_head_dim(cfg), cfg.intermediate_size, cfg.vocab_size) == (128, 3072, 151936)
    assert get_rope_theta(cfg) == 1e6 and cfg.tie_word_embeddings and cfg.max_position_embeddings == 40960
    assert get_config_dtype(cfg) == torch.bfloat16
    assert load_preset_config("random:qwen3-1.7b").hidden_size == 2048
    with pytest.raises(ValueError, match="qwen3-0.6b"):  # lists the valid names
        load_preset_config("qwen9-huge")


def test_registry():
    assert get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert get_model_class(SimpleNamespace(architectures=["Qwen3ForCausalLM"])) is Qwen3ForCausalLM
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class("LlamaForCausalLM")


def test_random_weights_deterministic(tmp_path):
    path = make_hf_checkpoint(tmp_path, vocab_size=3000)  # embedding > 2**16 elements: pooled path
    a, b, c = _model(path), _model(path), _model(path)
    init_random_weights(a, 1)
    init_random_weights(b, 1)
    init_random_weights(c, 2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for n in sa:
        assert torch.equal(sa[n], sb[n]), n
        assert not torch.equal(sa[n], sc[n]), n
    norm = sa["model.layers.0.input_layernorm.weight"]
    assert 0.8 < norm.mean() < 1.2 and 0.01 < norm.std() < 0.2
    for n in ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"):
        assert abs(sa[n].std().item() - 0.02) < 0.003, n
    # rows of the pooled embedding are not copies of each other
    emb = sa["model.embed_tokens.weight"]
    assert not torch.equal(emb[0], emb[1])
    with pytest.raises(ValueError, match="seed"):
        init_random_weights(a, "x")
