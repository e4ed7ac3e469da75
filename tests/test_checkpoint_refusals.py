"""Checkpoints a user brings that minivllm cannot serve as they are: refused at ``LLM(...)``, naming the
file or setting and what to do, instead of running with the wrong weights, tokenizer or sampling
settings (found by a reviewer trying their own checkpoints, 2026-12-05)."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers_engine import make_llm
from helpers_models import make_hf_checkpoint
from minivllm import SamplingParams
from minivllm.utils.loader import checkpoint_files, load_weights


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    return shutil.copytree(tiny_ckpt, tmp_path / "ckpt")


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("quant", [{"quant_method": "fp8", "weight_block_size": [128, 128]},
                                   {"quant_method": "gptq", "bits": 4}])
def test_a_pre_quantized_checkpoint_is_refused_naming_the_method(ckpt, quant):
    # its fp8 values were cast to float32 without their scales: the model loaded and generated noise
    _edit_json(ckpt / "config.json", quantization_config=quant)
    with pytest.raises(ValueError, match=f"pre-quantized checkpoint.*quant_method='{quant['quant_method']}'"):
        make_llm(ckpt)


def test_a_checkpoint_without_tokenizer_files_needs_the_tokenizer_argument(ckpt):
    # it ran with the embedded model's 4096-token tokenizer, silently, whatever the model's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink()
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json or tokenizer_config\.json in .*tokenizer="):
        make_llm(ckpt)
    llm = make_llm(ckpt, tokenizer="minivllm-tiny")  # said explicitly, it is used
    try:
        assert len(llm.generate([3, 4], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_a_bad_generation_config_value_is_named_at_construction(ckpt, caplog):
    # LLM(...) built, then the first generate() without sampling_params failed, naming no file
    (ckpt / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation_config\.json'.*top_p=0\.0"):
        make_llm(ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = make_llm(ckpt)
    llm.shutdown()
    said = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert len(said) == 1 and "temperature=0.6" in said[0] and "top_k=20" in said[0], said


def test_a_broken_shard_index_is_named(tmp_path):
    path = make_hf_checkpoint(tmp_path, shards=2)
    index = path / "model.safetensors.index.json"
    index.write_text('{"metadata": {}, ')
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        checkpoint_files(path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="model.safetensors.index.json.*weight_map"):
        checkpoint_files(path)


def test_pytorch_bin_weights_are_named_with_the_conversion(tmp_path):
    path = tmp_path / "bin-ckpt"
    path.mkdir()
    torch.save({"w": torch.zeros(1)}, path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin.*save_pretrained"):
        checkpoint_files(path)


def test_a_tensor_in_two_files_is_refused(tmp_path):
    # shards without an index beside a stale full copy: the later file silently overwrote the earlier
    path = make_hf_checkpoint(tmp_path, shards=2)
    (path / "model.safetensors.index.json").unlink()
    full = {}
    for f in sorted(path.glob("model-*.safetensors")):
        full.update(load_file(str(f)))
    save_file(full, str(path / "model-old-full.safetensors"), metadata={"format": "pt"})
    from transformers import AutoConfig

    from minivllm.models.qwen3 import Qwen3ForCausalLM

    with pytest.raises(ValueError, match=r"is in both '.*' and '.*'; remove the stale file"):
        load_weights(Qwen3ForCausalLM(AutoConfig.from_pretrained(path)), path)


@pytest.mark.parametrize("value, error", [("/no/such/checkpoint", FileNotFoundError), ("random:nope", ValueError)])
def test_a_bad_model_from_the_environment_names_the_variable(monkeypatch, value, error):
    # LLM() with $MINIVLLM_MODEL set to a bad value named only the value: a script that gives no
    # model did not say where it came from
    from minivllm.utils.model_source import resolve_model

    monkeypatch.setenv("MINIVLLM_MODEL", value)
    with pytest.raises(error, match=r"^\$MINIVLLM_MODEL .*" + value.split(":")[-1]):
        resolve_model(None)
    with pytest.raises(error) as given:  # a model given by name is reported as before
        resolve_model(value)
    assert "MINIVLLM_MODEL" not in str(given.value)
