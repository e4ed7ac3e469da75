"""Checks on the committed embedded model ``minivllm-tiny`` (minivllm/assets/minivllm-tiny/).

The checkpoint is produced by scripts/train_tiny_model.py; these tests only read it (fast, no training).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

ASSET_DIR = Path(__file__).resolve().parents[1] / "minivllm" / "assets" / "minivllm-tiny"
EOS = "<|endoftext|>"
FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_record.json",
)
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny_model.py"
# The spec: the committed checkpoint is at most 15 MB. 4,197,120 parameters stored in fp16 are 8.4 MB.
MAX_TOTAL_BYTES = 15_000_000
NON_ASCII = "Grüße, naïve café — 日本語のテキスト, emoji 🐍🙂, math ∑x², tab\tand newline\n"


def _json(name: str) -> dict:
    return json.loads((ASSET_DIR / name).read_text(encoding="utf-8"))


def test_committed_files_exist():
    missing = [f for f in FILES if not (ASSET_DIR / f).is_file()]
    assert missing == []


def test_config_fields():
    cfg = _json("config.json")
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    # The stored dtype, honestly (both spellings); engines choose their own compute dtype.
    assert cfg["torch_dtype"] == "float16"
    assert cfg["dtype"] == "float16"
    expected = {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "vocab_size": 4096,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
    }
    assert {k: cfg.get(k) for k in expected} == expected
    assert cfg["rope_theta"] == 10000.0
    if "rope_parameters" in cfg:  # transformers 5 spelling; must agree with the legacy key
        assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"]


def test_safetensors_holds_fp16_tied_weights_with_config_shapes():
    from safetensors import safe_open

    cfg = _json("config.json")
    with safe_open(str(ASSET_DIR / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert dtypes == {"F16"}
    # Tied embeddings: only the input embedding is stored; loaders must reuse it as the LM head.
    assert "lm_head.weight" not in keys
    assert shapes["model.embed_tokens.weight"] == (cfg["vocab_size"], cfg["hidden_size"])
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    layer0 = "model.layers.0."
    assert shapes[layer0 + "self_attn.q_proj.weight"] == (cfg["num_attention_heads"] * hd, h)
    assert shapes[layer0 + "self_attn.k_proj.weight"] == (cfg["num_key_value_heads"] * hd, h)
    assert shapes[layer0 + "self_attn.q_norm.weight"] == (hd,)
    assert shapes[layer0 + "mlp.down_proj.weight"] == (h, cfg["intermediate_size"])
    layers = {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    assert layers == set(range(cfg["num_hidden_layers"]))


def test_generation_config_eos_is_endoftext_and_greedy():
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json")).token_to_id(EOS)
    gen = _json("generation_config.json")
    assert eos_id is not None
    assert gen["eos_token_id"] == eos_id
    assert gen.get("do_sample", False) is False
    assert _json("config.json")["eos_token_id"] == eos_id


def test_tokenizer_config_special_tokens_and_template():
    tc = _json("tokenizer_config.json")
    assert tc["eos_token"] == EOS and tc["pad_token"] == EOS and tc["bos_token"] == EOS
    assert tc["model_max_length"] == 2048
    assert "{% for message in messages %}" in tc["chat_template"]


def test_raw_tokenizer_is_byte_level_bpe_and_round_trips_non_ascii():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    ids = tok.encode(NON_ASCII).ids
    assert max(ids) < 4096
    assert tok.decode(ids) == NON_ASCII


def test_transformers_tokenizer_round_trip_and_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSET_DIR)
    ids = tok.encode(NON_ASCII, add_special_tokens=True)
    assert tok.eos_token_id not in ids  # no BOS/EOS added when encoding
    assert tok.decode(ids) == NON_ASCII
    assert tok.pad_token_id == tok.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is a list?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"


def test_checkpoint_total_size_bound():
    total = sum(p.stat().st_size for p in ASSET_DIR.iterdir() if p.is_file())
    assert total <= MAX_TOTAL_BYTES, total


def test_training_record():
    rec = _json("training_record.json")
    loss = rec["heldout_loss"]
    assert isinstance(loss, float) and math.isfinite(loss)
    # A model that learned nothing sits at ln(4096) = 8.32 nats/token on held-out text.
    assert loss < math.log(4096) - 1.0
    assert re.fullmatch(r"[0-9a-f]{64}", rec["corpus"]["sha256"])
    # heldout_loss is measured on the stored fp16 weights; the curve is the fp32 training run.
    assert rec["stored_dtype"] == "float16"
    assert rec["loss_curve"][-1]["heldout_loss"] == rec["heldout_loss_fp32_before_rounding"]
    assert abs(loss - rec["heldout_loss_fp32_before_rounding"]) < 0.01
    assert abs(rec["rounding"]["heldout_loss_change"]) < 0.01
    assert rec["rounding"]["max_abs_weight"] < 65504  # fp16 max: nothing overflowed
    assert rec["rounding"]["max_rel_error_normal"] <= 2.0**-11
    assert rec["heldout_perplexity"] == pytest.approx(math.exp(loss), rel=1e-3)
    assert rec["files"]["model.safetensors"] == (ASSET_DIR / "model.safetensors").stat().st_size
    assert set(rec["versions"]) >= {"python", "torch", "transformers", "tokenizers"}
    assert isinstance(rec["seed"], int)
    assert len(rec["samples"]) == 6


def _hf_fp32_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ASSET_DIR, dtype=torch.float32).eval()


def test_transformers_fp32_load_is_exact_upcast_of_stored_fp16():
    import torch
    from safetensors.torch import load_file

    model = _hf_fp32_model()
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    stored = load_file(str(ASSET_DIR / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(stored) <= set(params)
    for name, t in stored.items():
        assert torch.equal(params[name].detach(), t.float()), name


def test_engine_ignores_config_dtype_and_runs_fp32_on_cpu():
    import torch

    from minivllm import LLM
    from minivllm.config import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with LLM("minivllm-tiny", device="cpu", num_kvcache_blocks=8) as llm:
        engine = llm.llm_engine
        assert engine.config.dtype == torch.float32
        model = engine.runner.model
        assert {p.dtype for p in model.state_dict().values()} == {torch.float32}
        # held: float32, but for the linears' panels, which keep the checkpoint's float16 values in
        # 16 bits (widened to float32 as the GEMM reads them: minivllm.layers.cpu_gemm)
        from minivllm.layers import cpu_gemm
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 or (cpu_gemm.is_panels(p) and p.dtype in (torch.float16, torch.bfloat16)), name


def _check_samples(samples, max_new_tokens=None):
    """Regenerate recorded samples with the script's greedy `generate` call (fp16 weights loaded in
    fp32); the first ``max_new_tokens`` tokens (all when None) must equal the record's."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSET_DIR)
    model = _hf_fp32_model()
    for rec in samples:
        n = max_new_tokens or rec["max_new_tokens"]
        ids = tok(rec["prompt"], return_tensors="pt").input_ids
        assert ids[0].tolist() == rec["prompt_token_ids"]
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                repetition_penalty=rec["repetition_penalty"], pad_token_id=tok.pad_token_id,
            )
        new = out[0, ids.shape[1]:].tolist()
        assert tok.decode(new, skip_special_tokens=True).strip() != ""
        assert new == rec["token_ids"][:n], (rec["prompt"], rec["repetition_penalty"])
        if max_new_tokens is None:
            assert tok.decode(new, skip_special_tokens=False) == rec["text"]


def test_transformers_greedy_continuation_matches_record_prefix():
    samples = _json("training_record.json")["samples"]
    assert len(samples) == 6
    _check_samples([samples[0]], max_new_tokens=8)  # 'The list type', greedy


@pytest.mark.slow
def test_transformers_greedy_samples_match_record():
    """All six recorded samples in full (48 tokens; greedy with and without repetition_penalty)."""
    _check_samples(_json("training_record.json")["samples"])


def _script():
    spec = importlib.util.spec_from_file_location("train_tiny_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_round_to_store_dtype_rounds_to_nearest_fp16_and_refuses_overflow():
    import torch

    script = _script()
    layer = torch.nn.Linear(64, 64)
    with torch.no_grad():
        layer.weight[0, :4] = torch.tensor([1.0 + 2.0**-12, 1e-9, -3e-6, 70000.0 / 2])
    original = layer.weight.detach().clone()
    stats = script.round_to_store_dtype(layer, "float16")
    assert layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight, original.half().float())  # IEEE round-to-nearest-even
    assert layer.weight[0, 0].item() == 1.0  # a tie, rounded to the even neighbour
    assert stats["num_flushed_to_zero"] >= 1 and stats["num_subnormal"] >= 1
    assert stats["max_rel_error_normal"] <= 2.0**-11
    assert stats["max_abs_weight"] == 35000.0
    with torch.no_grad():
        layer.weight[0, 0] = 1e5
    with pytest.raises(ValueError, match="overflows float16"):
        script.round_to_store_dtype(layer, "float16")
    with pytest.raises(ValueError, match="bfloat16"):
        script.round_to_store_dtype(layer, "bfloat16")


# -- the embedded draft model (speculative decoding): minivllm/assets/minivllm-tiny-draft/ ------------------
DRAFT_DIR = ASSET_DIR.parent / "minivllm-tiny-draft"
MAX_DRAFT_BYTES = 4_000_000  # issue 13: at most 4 MB on disk


def test_draft_model_is_a_smaller_qwen3_with_the_same_tokenizer_within_4_mb():
    cfg = json.loads((DRAFT_DIR / "config.json").read_text())
    main = _json("config.json")
    assert cfg["model_type"] == "qwen3" and cfg["vocab_size"] == main["vocab_size"]
    assert cfg["num_hidden_layers"] < main["num_hidden_layers"]
    assert (DRAFT_DIR / "tokenizer.json").read_bytes() == (ASSET_DIR / "tokenizer.json").read_bytes()
    assert sum(p.stat().st_size for p in DRAFT_DIR.iterdir() if p.is_file()) <= MAX_DRAFT_BYTES


def test_draft_training_record_and_its_doc_section():
    rec = json.loads((DRAFT_DIR / "training_record.json").read_text())
    assert rec["model"] == "minivllm-tiny-draft" and rec["distillation"]["teacher"] == "minivllm-tiny"
    assert rec["corpus"]["sha256"] == _json("training_record.json")["corpus"]["sha256"]  # the same corpus
    assert rec["heldout_loss"] < math.log(4096) - 1.0
    assert 0 < rec["distillation"]["heldout_teacher_top1_agreement"] <= 1
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tiny_model.md").read_text()
    assert doc.startswith("# minivllm-tiny: the embedded default model")  # the main model's part first
    assert "# minivllm-tiny-draft: the embedded draft model" in doc and rec["command"] in doc


def test_splicing_the_doc_keeps_the_other_models_part():
    spec = importlib.util.spec_from_file_location("tiny_draft", SCRIPT.parent / "tiny_draft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    draft = mod.DRAFT_MARKER + "\n\n# draft part\n"
    assert mod.splice("# main v1\n\n" + draft, "# main v2\n", None) == "# main v2\n\n" + draft
    assert mod.splice("# main v1\n", "# main v2\n", None) == "# main v2\n"
