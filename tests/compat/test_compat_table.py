"""The README's compatibility table (feature | vLLM | nano-vllm | minivllm) is rendered from
``FEATURES`` below, and every minivllm cell is checked by running a probe on the engine:
a "yes" whose probe fails, or a "no" whose probe succeeds, fails this test, and so does a
README whose table differs from the rendering (regenerate it with ``render_table()``).

The vLLM (v1 offline API) and nano-vllm (bb823b3) columns record those projects' public APIs.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"


def _gen(llm, prompt="The list", **kw):
    return llm.generate(prompt, SamplingParams(**{"max_tokens": 4, "temperature": 0, **kw}), use_tqdm=False)[0]


def _raises(fn, exc=(TypeError, ValueError, AttributeError)) -> bool:
    try:
        fn()
    except exc:
        return True
    return False


# feature, vLLM, nano-vllm, minivllm probe (returns True when minivllm supports it)
FEATURES = [
    ("`LLM.generate` with text or token-id prompts", "yes", "yes",
     lambda llm: _gen(llm, [5, 6, 7]).outputs[0].token_ids != [] and _gen(llm).outputs[0].text is not None),
    ("`TokensPrompt` / `TextPrompt` prompts", "yes", "no",
     lambda llm: _gen(llm, {"prompt_token_ids": [5, 6]}).prompt_token_ids == [5, 6]),
    ("`output.outputs[0].text`, `finish_reason`, `metrics`", "yes", "no",
     lambda llm: _gen(llm).outputs[0].finish_reason == "length"),
    ("`output[\"text\"]`, `output[\"token_ids\"]`", "no", "yes",
     lambda llm: _gen(llm)["token_ids"] == _gen(llm).outputs[0].token_ids),
    ("`LLM.chat` (`chat_template`, `chat_template_kwargs`, `tools`, `continue_final_message`)", "yes", "no",
     lambda llm: len(llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False,
                              chat_template_kwargs={"enable_thinking": False})) == 1),
    ("`LLM.get_default_sampling_params()`", "yes", "no",
     lambda llm: isinstance(llm.get_default_sampling_params(), SamplingParams)),
    ("`llm.tokenizer`", "yes", "yes", lambda llm: llm.tokenizer is not None),
    # nano-vllm's LLMEngine sets self.tokenizer and has no get_tokenizer (nanovllm/engine/llm_engine.py, bb823b3)
    ("`llm.get_tokenizer()`", "yes", "no", lambda llm: llm.tokenizer is llm.get_tokenizer()),
    ("`LLMEngine.add_request` / `step()` returning `RequestOutput`s", "yes", "no",
     lambda llm: _engine_step(llm)),
    ("Streaming deltas (`LLM.stream`)", "no", "no", lambda llm: len(list(llm.stream("a", SamplingParams(max_tokens=2)))) == 2),
    ("Greedy (`temperature=0`)", "yes", "no",
     lambda llm: SamplingParams(temperature=0).greedy and _gen(llm).outputs[0].token_ids == _gen(llm).outputs[0].token_ids),
    ("`top_p`, `top_k`, `min_p`, per-request `seed`", "yes", "no",
     lambda llm: _gen(llm, temperature=1.0, top_p=0.9, top_k=5, min_p=0.05, seed=1).outputs[0].token_ids
     == _gen(llm, temperature=1.0, top_p=0.9, top_k=5, min_p=0.05, seed=1).outputs[0].token_ids),
    ("`repetition_penalty`, `presence_penalty`, `frequency_penalty`", "yes", "no",
     lambda llm: bool(_gen(llm, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5).outputs)),
    ("`min_tokens`, `logit_bias`, `allowed_token_ids`, `bad_words`", "yes", "no",
     lambda llm: set(_gen(llm, min_tokens=2, logit_bias={7: 100.0}, allowed_token_ids=[7, 8],
                          bad_words=["zz"]).outputs[0].token_ids) == {7}),
    ("`stop`, `stop_token_ids`, `include_stop_str_in_output`", "yes", "no",
     lambda llm: _gen(llm, stop=["e"], include_stop_str_in_output=True, stop_token_ids=[0]).outputs[0] is not None),
    ("`ignore_eos`, `max_tokens`", "yes", "yes", lambda llm: len(_gen(llm, ignore_eos=True).outputs[0].token_ids) == 4),
    ("`max_tokens=None` (up to `max_model_len`)", "yes", "no",
     lambda llm: SamplingParams(max_tokens=None).max_tokens is None),
    ("`detokenize`, `skip_special_tokens`, `truncate_prompt_tokens`", "yes", "no",
     lambda llm: _gen(llm, detokenize=False, skip_special_tokens=False, truncate_prompt_tokens=2)
     .outputs[0].text == ""),
    ("`tokenization_kwargs` (`truncate_prompt_tokens`, `add_special_tokens`)", "yes", "no",
     lambda llm: llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=2), use_tqdm=False,
                              tokenization_kwargs={"truncate_prompt_tokens": 2})[0].prompt_token_ids == [7, 8]),
    ("`logprobs`, `prompt_logprobs`", "yes", "no",
     lambda llm: _gen(llm, logprobs=2, prompt_logprobs=1).prompt_logprobs[0] is None),
    ("`n` > 1", "yes", "no", lambda llm: len(_gen(llm, n=2, temperature=1.0).outputs) == 2),
    ("Prefix caching", "yes", "yes", lambda llm: _gen(llm, "x" * 60) and _gen(llm, "x" * 60).num_cached_tokens > 0),
    ("Prefix-cache isolation (`cache_salt` in a prompt)", "yes", "no", lambda llm: _salted()),
    ("Chunked prefill mixed with decodes", "yes", "no", lambda llm: _mixed_chunked()),
    ("`max_model_len` above the model's positions", "refused", "capped",
     lambda llm: _capped()),
    ("vLLM-only engine arguments (`trust_remote_code`, `swap_space`, ...)", "yes", "no",
     lambda llm: _accepts_vllm_args()),
    ("Engine arguments on a command line (`EngineArgs.add_cli_args`, `from_cli_args`)", "yes", "no",
     lambda llm: _cli_args()),
    ("`LLM.start_profile()` / `stop_profile()` (a `torch.profiler` trace)", "yes", "no",
     lambda llm: _profiles(llm)),
    ("`tensor_parallel_size`, `enforce_eager` (CUDA graphs)", "yes", "yes",
     lambda llm: _constructs(tensor_parallel_size=1, enforce_eager=True)),
    ("KV cache in bfloat16 (`kv_cache_dtype=\"bfloat16\"`)", "yes", "no",
     lambda llm: _kv_bf16()),
    ("fp8 KV cache (`kv_cache_dtype=\"fp8\"`)", "yes", "no",
     lambda llm: not _raises(lambda: _constructs(kv_cache_dtype="fp8"))),
    ("LoRA adapters (`lora_request`)", "yes", "no",
     lambda llm: not _raises(lambda: _gen_lora(llm))),
    ("Beam search (`LLM.beam_search`)", "yes", "no",
     lambda llm: not _raises(lambda: llm.beam_search(["The list"], None), NotImplementedError)),
    ("Structured outputs (`guided_decoding` / `structured_outputs`)", "yes", "no",
     lambda llm: not _raises(lambda: SamplingParams(structured_outputs={"json": {}}))),
    ("Multimodal inputs (`multi_modal_data`)", "yes", "no",
     lambda llm: not _raises(lambda: _gen(llm, {"prompt_token_ids": [1], "multi_modal_data": {"image": 0}}))),
]


def _cli_args() -> bool:
    from minivllm import EngineArgs
    from minivllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--max-num-seqs", "3"])).max_num_seqs == 3


def _profiles(llm) -> bool:
    import gzip
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        os.environ["VLLM_TORCH_PROFILER_DIR"] = where
        try:
            llm.start_profile()
            _gen(llm)
            with gzip.open(llm.stop_profile(), "rt") as f:  # gzipped, as vLLM writes it by default
                return "traceEvents" in json.load(f)
        finally:
            del os.environ["VLLM_TORCH_PROFILER_DIR"]


def _engine_step(llm) -> bool:
    engine = llm.llm_engine
    engine.add_request("probe", [5, 6], SamplingParams(max_tokens=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].finished and outs[-1].request_id == "probe"


def _salted() -> bool:
    """A salted prompt hits its own salt's cached blocks, not another salt's."""
    def cached(salt):
        return _gen(llm, {"prompt": "y" * 60, "cache_salt": salt}).num_cached_tokens

    with LLM(str(EMBEDDED_MODEL_DIR), num_kvcache_blocks=64) as llm:
        return cached("a") == 0 and cached("a") > 0 and cached("b") == 0


def _mixed_chunked() -> bool:
    """A step holding a decode and a chunk of a longer prompt."""
    with LLM(str(EMBEDDED_MODEL_DIR), num_kvcache_blocks=64, max_num_batched_tokens=16) as llm:
        engine = llm.llm_engine
        engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()
        engine.add_request("long", list(range(5, 45)), SamplingParams(max_tokens=2))
        engine.step()
        record = engine.last_step_record
        mixed = record.num_decode_tokens > 0 and 0 < record.num_prefill_tokens < 40
        for rid in ("short", "long"):
            engine.abort_request(rid)
        return mixed


def _constructs(**engine_args) -> bool:
    with LLM(str(EMBEDDED_MODEL_DIR), num_kvcache_blocks=64, **engine_args):
        return True


def _kv_bf16() -> bool:
    with LLM(str(EMBEDDED_MODEL_DIR), kv_cache_dtype="bfloat16", num_kvcache_blocks=64) as llm:
        return llm.llm_engine.runner.kv_cache.dtype == torch.bfloat16 and len(_gen(llm).outputs[0].token_ids) == 4


def _capped() -> str:
    with LLM(str(EMBEDDED_MODEL_DIR), max_model_len=10**6, num_kvcache_blocks=256) as llm:
        return "capped" if llm.llm_engine.config.max_model_len < 10**6 else "accepted"


def _accepts_vllm_args() -> bool:
    with LLM(str(EMBEDDED_MODEL_DIR), trust_remote_code=True, swap_space=4, num_kvcache_blocks=64):
        return True


def _gen_lora(llm):
    llm.generate("a", SamplingParams(max_tokens=1), use_tqdm=False, lora_request=object())


def _cell(value) -> str:
    return value if isinstance(value, str) else ("yes" if value else "no")


def render_table(minivllm_cells: list[str] | None = None) -> str:
    """The Markdown table; minivllm's column from ``minivllm_cells`` (the probes' verdicts)."""
    rows = ["| feature | vLLM | nano-vllm | minivllm |", "|---|---|---|---|"]
    cells = minivllm_cells or [EXPECTED[f[0]] for f in FEATURES]
    for (feature, vllm, nano, _), ours in zip(FEATURES, cells):
        rows.append(f"| {feature} | {vllm} | {nano} | {ours} |")
    return "\n".join(rows)


def _readme_table() -> str:
    text = README.read_text()
    match = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert match, f"README.md has no {START} ... {END} block"
    return match.group(1)


def _readme_cells() -> dict[str, str]:
    out = {}
    for line in _readme_table().splitlines()[2:]:
        parts = [p.strip() for p in line.strip().strip("|").split(" | ")]
        out[parts[0]] = parts[3]
    return out


EXPECTED = _readme_cells() if README.exists() and START in README.read_text() else {}


@pytest.fixture(scope="module")
def llm():
    llm = LLM(str(EMBEDDED_MODEL_DIR), num_kvcache_blocks=256)
    yield llm
    llm.shutdown()


def test_readme_table_is_the_rendering_of_the_feature_list():
    assert set(EXPECTED) == {f[0] for f in FEATURES}, "README rows differ from FEATURES"
    assert _readme_table() == render_table()


@pytest.mark.parametrize("feature", [f[0] for f in FEATURES])
def test_minivllm_column_matches_a_probe(llm, feature):
    probe = next(f[3] for f in FEATURES if f[0] == feature)
    try:
        verdict = _cell(probe(llm))
    except Exception as e:  # a probe that raises means "not supported"
        verdict, why = "no", repr(e)
    else:
        why = ""
    assert verdict == EXPECTED[feature], f"{feature}: the probe says {verdict} {why}"
