"""The vLLM / nano-vllm compatibility surface of ``LLM``: mapping view of outputs, default
sampling params, engine-argument leniency, prompt types, max_model_len capping, chat options."""
from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch

from helpers_engine import greedy, make_llm, prompts_of
from minivllm import LLM, EngineArgs, LLMEngine, SamplingParams
from minivllm.chat import unused_template_variables


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    yield llm
    llm.shutdown()


def test_request_output_is_a_read_only_nano_vllm_mapping(llm):
    out = llm.generate(prompts_of([5])[0], greedy(3), use_tqdm=False)[0]
    assert out["text"] == out.outputs[0].text and out["token_ids"] == out.outputs[0].token_ids
    assert dict(out) == {"text": out.outputs[0].text, "token_ids": out.outputs[0].token_ids}
    assert "text" in out and "prompt" not in out and out.get("nope", 5) == 5
    with pytest.raises(KeyError, match="'prompt'"):
        out["prompt"]
    with pytest.raises(TypeError):
        out["text"] = "x"
    # items() / values() as nano-vllm's dict has them; json.dump takes dict(out). Not iterable and no len():
    # pandas and numpy then read a list of outputs as a table of the two keys
    assert out.items() == list(dict(out).items()) and out.values() == list(dict(out).values())
    with pytest.raises(TypeError):
        iter(out)
    assert np.array([out, out], dtype=object).shape == (2,)


def test_sampling_params_are_given_by_name():
    """SamplingParams(0.6, 256), nano-vllm's (temperature, max_tokens), was read as top_p=256 (refused with a
    message about top_p), and SamplingParams(0.6, 1) silently as top_p=1 with 16 tokens; vLLM's order starts
    with n. Positional arguments are refused, saying why."""
    for args in ((0.6, 256), (0.6, 1), (2,)):
        with pytest.raises(TypeError, match=re.escape(f"SamplingParams{args!r}: give its arguments by name")):
            SamplingParams(*args)
    assert SamplingParams(temperature=0.6, max_tokens=1).max_tokens == 1


def test_nano_vllm_engine_construction_and_block_count(tiny_ckpt):
    """nano-vllm's LLMEngine(path, **kwargs) raised AttributeError ('str' object has no attribute 'model');
    its num_kvcache_blocks=-1 (its default: sized from memory) was refused as not positive."""
    with pytest.raises(TypeError, match=r"LLMEngine\('x'\): takes EngineArgs.*LLM\(model, \*\*kwargs\)"):
        LLMEngine("x")
    assert EngineArgs(num_kvcache_blocks=-1).num_kvcache_blocks is None
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match=rf"num_kvcache_blocks={bad!r}: must be a positive int"):
            EngineArgs(num_kvcache_blocks=bad)


def test_logprob_imports_from_vllms_module_path():
    from minivllm import Logprob
    from minivllm import logprobs, sequence
    from minivllm.logprobs import Logprob as from_module  # was: from vllm.logprobs import Logprob
    from minivllm.sequence import Logprob as from_older  # vLLM's path before vllm.logprobs

    assert from_module is Logprob and from_older is Logprob
    assert (sequence.SampleLogprobs, sequence.PromptLogprobs) == (logprobs.SampleLogprobs, logprobs.PromptLogprobs)


def test_model_config_and_pooling_calls_as_vllm_scripts_reach_them(llm):
    """``llm.llm_engine.model_config.max_model_len`` (vLLM's benchmarks read it) and
    ``get_model_config()`` did not exist; ``llm.embed`` / ``get_metrics`` were bare AttributeErrors."""
    engine = llm.llm_engine
    config = engine.get_model_config()
    assert config is engine.model_config is llm.model_config
    assert config.max_model_len == engine.config.max_model_len and config.dtype == torch.float32
    assert config.get_vocab_size() == engine.vocab_size and config.model == engine.source.name
    for name in ("embed", "encode", "classify", "score", "reward"):
        with pytest.raises(AttributeError, match=f"LLM.{name}: a pooling model's call"):
            getattr(llm, name)
    with pytest.raises(AttributeError, match="LLM.get_metrics: .*RequestOutput.metrics"):
        llm.get_metrics()
    # vLLM's sleep mode and worker calls were bare "'LLM' object has no attribute" errors
    for name in ("sleep", "wake_up", "is_sleeping"):
        with pytest.raises(AttributeError, match=f"LLM.{name}: vLLM's sleep mode.*llm.shutdown"):
            getattr(llm, name)
    for name in ("collective_rpc", "apply_model"):
        with pytest.raises(AttributeError, match=f"LLM.{name}: .*llm.llm_engine.runner.model"):
            getattr(llm, name)
    assert llm.llm_engine.runner.model is not None  # where the message points


def test_outputs_are_plain_objects_with_vllms_fields_in_its_order(llm):
    """vLLM's scripts do ``vars(output.outputs[0])`` and attach attributes to outputs: both failed
    (slots), and the completion's positional fields were not vLLM's order."""
    import dataclasses

    from minivllm.outputs import CompletionOutput

    out = llm.generate(prompts_of([5], seed=3)[0], greedy(2), use_tqdm=False)[0]
    assert vars(out.outputs[0])["token_ids"] == out.outputs[0].token_ids and "request_id" in vars(out)
    out.reward = 1.0
    assert out.reward == 1.0
    assert out.lora_request is None and out.encoder_prompt is None and out.outputs[0].lora_request is None
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason"]
    assert [f.name for f in dataclasses.fields(type(out))][:11] == [  # vLLM's RequestOutput.__init__
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
        "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens"]


def test_vllm_import_lines_resolve_and_request_ids_are_strings(llm):
    """``from vllm.sampling_params import BeamSearchParams`` and ``from vllm.engine.arg_utils import
    EngineArgs`` failed at import (before beam search's own message); a request id of another type
    was accepted as its str() and then could not be aborted by it."""
    from minivllm.config import EngineArgs
    from minivllm.engine.arg_utils import EngineArgs as FromArgUtils
    from minivllm.sampling_params import BeamSearchParams

    assert FromArgUtils is EngineArgs
    with pytest.raises(NotImplementedError, match="BeamSearchParams: minivllm has no beam search"):
        BeamSearchParams(beam_width=4, max_tokens=8)
    # vLLM's structured-outputs and LoRA examples failed at their import lines, before any refusal
    from minivllm.lora.request import LoRARequest
    from minivllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    for cls in (StructuredOutputsParams, GuidedDecodingParams):
        with pytest.raises(NotImplementedError, match=f"{cls.__name__}: minivllm has no structured outputs"):
            cls(json={"type": "object"})
    with pytest.raises(NotImplementedError, match="LoRARequest: minivllm does not serve LoRA adapters"):
        LoRARequest("sql", 1, "/adapters/sql")
    engine = llm.llm_engine
    for bad in (None, ["a"], True):
        with pytest.raises(TypeError, match=re.escape(f"request_id={bad!r}")):
            engine.add_request(bad, [5, 6], greedy(1))
    with pytest.raises(ValueError, match="prompt_token_ids=5: must be a list"):
        engine.add_request("p", {"prompt_token_ids": 5}, greedy(1))
    assert not engine.has_unfinished_requests()


def test_nano_vllm_engine_calls_say_where_they_are(llm):
    """nano-vllm's LLM is its engine (llm.add_request(prompt, sp), llm.step(), llm.is_finished(), llm.exit()):
    each was a bare AttributeError, and the engine's add_request in nano-vllm's argument order said the
    SamplingParams was a bad prompt."""
    for name, hint in (("add_request", "llm.llm_engine.add_request(request_id"), ("step", "llm.llm_engine.step()"),
                       ("is_finished", "has_unfinished_requests"), ("exit", "llm.shutdown()")):
        with pytest.raises(AttributeError, match=re.escape(hint)):
            getattr(llm, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        llm.nothing_here
    with pytest.raises(TypeError, match="nano-vllm's order is \\(prompt, sampling_params\\)"):
        llm.llm_engine.add_request("hi", greedy(2))
    assert not llm.llm_engine.has_unfinished_requests()


def test_tokenizer_attribute(llm):
    assert llm.tokenizer is llm.get_tokenizer() is llm.llm_engine.tokenizer


def _with_generation_config(src, dst, **config):
    ckpt = shutil.copytree(src, dst)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, **config}))
    return ckpt


def test_default_sampling_params_come_from_generation_config(tiny_ckpt, tmp_path, llm):
    assert llm.get_default_sampling_params() == SamplingParams()  # keys absent: our defaults
    ckpt = _with_generation_config(tiny_ckpt, tmp_path / "gen", temperature=0.0, top_k=20, top_p=0.95,
                                   max_new_tokens=5, do_sample=True)
    other = make_llm(ckpt)
    params = other.get_default_sampling_params()
    # temperature 0: greedy, whose filters are reset (vLLM's SamplingParams does the same)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 0, 1.0, 5)
    # presence / frequency penalties and skip_special_tokens were not read (vLLM 0.34 reads them:
    # ModelConfig.get_diff_sampling_param)
    sampled = make_llm(_with_generation_config(tiny_ckpt, tmp_path / "gen2", temperature=0.7, top_k=20, top_p=0.95,
                                               presence_penalty=1.5, frequency_penalty=0.5, skip_special_tokens=False))
    p = sampled.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p) == (0.7, 20, 0.95)
    assert (p.presence_penalty, p.frequency_penalty, p.skip_special_tokens) == (1.5, 0.5, False)
    sampled.shutdown()
    params.max_tokens = 1  # a copy: the engine's defaults are not changed through it
    assert other.get_default_sampling_params().max_tokens == 5
    # generate without sampling_params uses them: 5 greedy tokens (eos is token 0, rare at random)
    out = other.generate([3, 4, 5], use_tqdm=False)[0]
    ref = other.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    other.shutdown()


def test_meaningless_vllm_arguments_warn_once_unknown_ones_raise(tiny_ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = make_llm(tiny_ckpt, trust_remote_code=True, swap_space=4, disable_log_stats=True)
    warnings = [r.getMessage() for r in caplog.records if "ignoring vLLM engine argument" in r.getMessage()]
    assert len(warnings) == 1
    assert all(name in warnings[0] for name in ("trust_remote_code", "swap_space", "disable_log_stats"))
    llm.shutdown()
    with pytest.raises(TypeError, match="swap_spaces"):
        make_llm(tiny_ckpt, swap_spaces=4)


def test_vllm_tokenizer_and_kv_cache_dtype_arguments(tiny_ckpt, tmp_path):
    """``LLM(model, tokenizer=model)`` and ``kv_cache_dtype="auto"``, common in vLLM scripts, were refused
    as unknown arguments."""
    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

    def text(**kw):
        llm = LLM("minivllm-tiny", num_kvcache_blocks=32, **kw)
        try:
            return llm.generate("The list type", SamplingParams(temperature=0, max_tokens=4),
                                use_tqdm=False)[0].outputs[0].text
        finally:
            llm.shutdown()

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL_DIR / name, tok_dir / name)
    want = text()
    assert text(tokenizer="minivllm-tiny", kv_cache_dtype="auto") == want
    assert text(tokenizer=str(tok_dir)) == want
    with pytest.raises(FileNotFoundError, match="tokenizer '/no/such/tokenizer'"):
        make_llm(tiny_ckpt, tokenizer="/no/such/tokenizer")
    # the end-of-sequence ids come from the given tokenizer where the checkpoint has no generation_config.json
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tok["added_tokens"].append({**tok["added_tokens"][0], "id": vocab["."], "content": "."})  # "." as a special token
    (eos_dir / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = "."
    (eos_dir / "tokenizer_config.json").write_text(json.dumps(config))
    llm = make_llm(tiny_ckpt, tokenizer=str(eos_dir))
    assert not (tiny_ckpt / "generation_config.json").exists()
    assert llm.llm_engine.eos_token_ids == {llm.get_tokenizer().eos_token_id} == {vocab["."]}
    llm.shutdown()
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        make_llm(tiny_ckpt, kv_cache_dtype="fp8")


def test_generation_config_extra_eos_ids_stop_with_their_id(tiny_ckpt, tmp_path):
    """vLLM makes a generation config's eos ids other than the tokenizer's into stop tokens: a request
    ending on one reports it as stop_reason (Qwen3's <|endoftext|> beside <|im_end|>), the tokenizer's
    eos stops as an eos even where the generation config leaves it out, and ignore_eos lets both
    through. Before: every generation-config eos read stop_reason None, and only those ids stopped."""
    def end(llm, token, **kw):
        params = SamplingParams(temperature=0, max_tokens=3, logit_bias={token: 50.0}, **kw)  # forced
        out = llm.generate([3, 4, 5], params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, out.finish_reason, out.stop_reason

    llm = make_llm(_with_generation_config(tiny_ckpt, tmp_path / "both", eos_token_id=[0, 7]))
    assert llm.get_tokenizer().eos_token_id == 0
    assert end(llm, 7) == ([7], "stop", 7) and end(llm, 0) == ([0], "stop", None)
    assert end(llm, 7, ignore_eos=True) == ([7, 7, 7], "length", None)
    llm.shutdown()
    llm = make_llm(_with_generation_config(tiny_ckpt, tmp_path / "extra", eos_token_id=[7]))
    assert end(llm, 0) == ([0], "stop", None) and end(llm, 7) == ([7], "stop", 7)
    llm.shutdown()


def test_nano_vllm_block_size_spelling(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), kvcache_block_size=8, num_kvcache_blocks=64)
    assert llm.llm_engine.config.block_size == 8
    llm.shutdown()
    with pytest.raises(TypeError, match="given twice"):
        LLM(str(tiny_ckpt), kvcache_block_size=8, block_size=8)


def test_lora_request_none_is_accepted_anything_else_refused(llm):
    out = llm.generate([1, 2, 3], greedy(2), use_tqdm=False, lora_request=None)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate([1, 2, 3], greedy(2), use_tqdm=False, lora_request=object())
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_features_minivllm_lacks_are_named_not_left_to_a_bare_type_error(llm):
    """A vLLM script's structured outputs, best_of or beam search: the error says it is a vLLM feature
    minivllm does not have (before: "unexpected keyword argument" / "'LLM' object has no attribute")."""
    for kw, what in (({"structured_outputs": {"json": {}}}, "structured outputs"),
                     ({"guided_decoding": object()}, "guided decoding"), ({"best_of": 4}, "best_of"),
                     ({"use_beam_search": True}, "beam search"), ({"logits_processors": [print]}, "logits_processors")):
        with pytest.raises(TypeError, match=rf"SamplingParams\({next(iter(kw))}=\.\.\.\): {what}.*vLLM feature"):
            SamplingParams(max_tokens=2, **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        SamplingParams(bogus=1)  # an unknown argument keeps Python's own message
    with pytest.raises(NotImplementedError, match="no beam search.*cumulative_logprob"):
        llm.beam_search(["The list"], None)
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_only_sampling_arguments_at_values_that_ask_for_nothing_are_accepted():
    """``structured_outputs=StructuredOutputsParams(...) if schema else None`` is a common vLLM
    pattern: None (vLLM's default) was refused as if it asked for the feature."""
    import inspect

    off = dict(structured_outputs=None, guided_decoding=None, extra_args=None, logits_processors=None,
               best_of=None, use_beam_search=False, length_penalty=1.0, early_stopping=False, watermarking=None)
    assert SamplingParams(temperature=0.5, **off) == SamplingParams(temperature=0.5)
    with pytest.raises(TypeError, match="watermarking"):  # vLLM 0.34's field: was a bare 'unexpected keyword'
        SamplingParams(watermarking=True)
    assert SamplingParams(watermarking=False) == SamplingParams()  # off, as None (vLLM's field is bool | None)
    assert SamplingParams(n=2, best_of=2, logits_processors=[], extra_args={}).n == 2
    with pytest.raises(TypeError, match=r"SamplingParams\(best_of=\.\.\.\)"):
        SamplingParams(n=2, best_of=3)
    assert "temperature" in inspect.signature(SamplingParams).parameters  # Shift+Tab shows the fields


def test_prompt_typed_dicts(llm):
    from minivllm import TextPrompt, TokensPrompt

    tokens = TokensPrompt(prompt_token_ids=[1, 2, 3])
    assert tokens == {"prompt_token_ids": [1, 2, 3]}
    a, b = llm.generate([tokens, [1, 2, 3]], greedy(3), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert TextPrompt(prompt="x") == {"prompt": "x"}
    assert TokensPrompt.__required_keys__ == {"prompt_token_ids"} and TextPrompt.__required_keys__ == {"prompt"}
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": 1}}, greedy(1), use_tqdm=False)


def test_cache_salt_keeps_prefix_hits_within_a_salt(tiny_ckpt):
    """It was accepted and ignored: prompts with different salts shared cached blocks."""
    llm = make_llm(tiny_ckpt, block_size=4)
    ids = prompts_of([13], seed=3)[0]

    def cached(**salt):
        return llm.generate({"prompt_token_ids": ids, **salt}, greedy(1), use_tqdm=False)[0].num_cached_tokens

    assert cached(cache_salt="alice") == 0 and cached(cache_salt="alice") == 12
    assert cached(cache_salt="bob") == 0 and cached() == 0 and cached() == 12
    with pytest.raises(ValueError, match=r"prompt 1: cache_salt=5: must be a non-empty str"):
        llm.generate([ids, {"prompt_token_ids": ids, "cache_salt": 5}], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"cache_salt='': must be a non-empty str"):
        llm.llm_engine.add_request("x", {"prompt": "Hi", "cache_salt": ""}, greedy(1))
    assert not llm.llm_engine.has_unfinished_requests()
    llm.shutdown()


def test_max_model_len_above_positions_is_capped_with_one_warning(tiny_ckpt, caplog):
    # the tiny checkpoint has max_position_embeddings=256 (nano-vllm's bench passes 4096)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = make_llm(tiny_ckpt, max_model_len=4096)
    capped = [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(capped) == 1 and "capped at 256" in capped[0].getMessage()
    assert llm.llm_engine.config.max_model_len == 256
    llm.shutdown()


def test_max_model_len_above_the_pool_names_the_argument_and_size(tiny_ckpt):
    with pytest.raises(ValueError, match=r"max_model_len=200 .* needs 50 blocks.*num_kvcache_blocks>=50"):
        make_llm(tiny_ckpt, block_size=4, num_kvcache_blocks=10, max_model_len=200)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes>=\d+"):
        make_llm(tiny_ckpt, block_size=4, num_kvcache_blocks=None, kv_cache_memory_bytes=4096, max_model_len=200)


TEMPLATE = ("{% if tools %}[tools:{{ tools | length }}]{% endif %}{% if flag %}[flag]{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% if not (loop.last and continue_final_message) %}</{{ m['role'] }}>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _rendered(out, tok) -> str:
    return tok.decode(out.prompt_token_ids)


@pytest.fixture(scope="module")
def text_llm(text_ckpt):
    llm = make_llm(text_ckpt)
    yield llm
    llm.shutdown()


def test_chat_options_reach_the_template(text_llm):
    tok = text_llm.tokenizer
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The list"}]
    kw = dict(chat_template=TEMPLATE, use_tqdm=False)
    out = text_llm.chat(conv, greedy(1), **kw)[0]
    assert _rendered(out, tok) == "<user>Hi</user><assistant>The list</assistant><assistant>"
    out = text_llm.chat(conv, greedy(1), add_generation_prompt=False, continue_final_message=True, **kw)[0]
    assert _rendered(out, tok) == "<user>Hi</user><assistant>The list"
    out = text_llm.chat(conv, greedy(1), add_generation_prompt=False, chat_template_kwargs={"flag": True},
                        tools=[{"type": "function", "function": {"name": "f"}}], **kw)[0]
    assert _rendered(out, tok) == "[tools:1][flag]<user>Hi</user><assistant>The list</assistant>"
    outs = text_llm.chat([conv[:1], conv], greedy(1), add_generation_prompt=False, **kw)
    assert [_rendered(o, tok) for o in outs] == ["<user>Hi</user>", "<user>Hi</user><assistant>The list</assistant>"]
    with pytest.raises(ValueError, match="continue_final_message"):
        text_llm.chat(conv, greedy(1), continue_final_message=True, **kw)


def test_unused_template_variables():
    qwen3_like = ("{%- if tools %}{{ tools | tojson }}{%- endif %}{% for m in messages %}{% if loop.index > 9 %}"
                  "{% break %}{% endif %}{{ m.content }}{% endfor %}{%- if enable_thinking is defined and "
                  "enable_thinking is false %}<think></think>{%- endif %}")
    assert unused_template_variables(qwen3_like, ["tools", "enable_thinking"]) == []
    assert unused_template_variables(TEMPLATE, ["tools", "flag", "enable_thinking", "documents"]) == [
        "documents", "enable_thinking"]
    # a tag jinja2 alone does not know (transformers' {% generation %}): not judged
    assert unused_template_variables("{% generation %}{{ x }}{% endgeneration %}", ["tools"]) == []


def test_chat_warns_once_of_variables_its_template_never_reads(text_llm, caplog):
    """The embedded model's plain ChatML template rendered the same prompt with tools=[...] or
    chat_template_kwargs={"enable_thinking": False} as without them, and nothing said so."""
    conv = [{"role": "user", "content": "Hi"}]
    bare = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "f"}}]
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        for _ in range(2):
            out = text_llm.chat(conv, greedy(1), chat_template=bare, tools=tools,
                                chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
        text_llm.chat(conv, greedy(1), chat_template=TEMPLATE, tools=tools, chat_template_kwargs={"flag": True},
                      use_tqdm=False)
    told = [r.getMessage() for r in caplog.records if "never reads" in r.getMessage()]
    assert told == ["LLM.chat: the chat_template given never reads enable_thinking, tools: the prompt is what it "
                    "would be without them"]
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        text_llm.chat(conv, greedy(1), chat_template=bare + " ", chat_template_kwargs={"enable_thinking": False},
                      use_tqdm=False)
    assert caplog.records[-1].getMessage().endswith("never reads enable_thinking: the prompt is what it would be "
                                                    "without it")
    assert _rendered(out, text_llm.tokenizer) == "<user>Hi"


def test_chat_refuses_unknown_keywords_and_takes_vllms_own(text_llm):
    """LLM.chat passed every unknown keyword to the template, so a misspelt argument
    (sampling_param=, use_tdqm=) was silently dropped; vLLM's fixed signature raises TypeError.
    vLLM's own chat_template_content_format ("auto"/"string") and mm_processor_kwargs (None) are
    taken."""
    conv = [{"role": "user", "content": "Hi"}]
    kw = dict(chat_template=TEMPLATE, use_tqdm=False)
    with pytest.raises(TypeError, match=r"\['sampling_param'\] \('sampling_param': did you mean 'sampling_params'\?\)"
                                        r".*chat_template_kwargs"):
        text_llm.chat(conv, sampling_param=greedy(1), **kw)
    with pytest.raises(TypeError, match=r"\['flag'\]: template variables"):  # nothing close: no guess
        text_llm.chat(conv, greedy(1), flag=True, **kw)
    out = text_llm.chat(conv, greedy(1), chat_template_content_format="string", mm_processor_kwargs=None, **kw)[0]
    assert _rendered(out, text_llm.tokenizer) == "<user>Hi</user><assistant>"
    with pytest.raises(ValueError, match="chat_template_content_format='openai'"):
        text_llm.chat(conv, greedy(1), chat_template_content_format="openai", **kw)
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        text_llm.chat(conv, greedy(1), mm_processor_kwargs={"num_crops": 4}, **kw)


def test_generate_makes_its_bar_with_a_use_tqdm_callable(text_llm):
    """vLLM's use_tqdm may be a callable that makes the progress bar; it was ignored (the default
    bar shown instead)."""
    from tqdm import tqdm

    made = []

    def factory(*args, **kwargs):
        made.append(kwargs)
        return tqdm(*args, **{**kwargs, "disable": True})

    outs = text_llm.generate(["Hi", "The"], greedy(1), use_tqdm=factory)
    assert len(outs) == 2 and len(made) == 1 and made[0]["total"] == 2


# Qwen3's own template keeps a message's content only when it is a string (else ''), as many do
STRING_ONLY = ("{% for m in messages %}{% if m.content is string %}{% set c = m.content %}{% else %}"
               "{% set c = '' %}{% endif %}<{{ m.role }}>{{ c }}</{{ m.role }}>{% endfor %}")


def test_chat_takes_openai_text_parts_and_none_content(text_llm):
    """vLLM joins a message's text parts with newlines and renders None as '' for such templates;
    passed through as a list, the user's words vanished from the prompt without an error."""
    tok = text_llm.tokenizer
    conv = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None, "tool_calls": []}]
    out = text_llm.chat(conv, greedy(1), chat_template=STRING_ONLY, add_generation_prompt=False, use_tqdm=False)[0]
    assert _rendered(out, tok) == "<user>Hi\nthere</user><assistant></assistant>"
    assert conv[0]["content"][0] == {"type": "text", "text": "Hi"}  # the caller's messages are not changed
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"conversation 1, message 0, content part 0: .*image_url.* text only"):
        text_llm.chat([conv, image], greedy(1), chat_template=STRING_ONLY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"conversation 0, message 1: must be a dict with a 'role'"):
        text_llm.chat([{"role": "user", "content": "Hi"}, {"content": "no role"}], greedy(1),
                      chat_template=STRING_ONLY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"message 0: content must be a str.*got int"):
        text_llm.chat([{"role": "user", "content": 5}], greedy(1), chat_template=STRING_ONLY, use_tqdm=False)
    assert not text_llm.llm_engine.has_unfinished_requests()


def test_chat_names_a_malformed_argument(text_llm):
    """A lone message dict was iterated into its keys ("conversation 0: ... got str"), chat(5) raised
    "'int' object is not iterable", a list for chat_template_kwargs dict()'s "update sequence" error,
    a non-str chat_template Jinja's "Can't compile non template nodes", and add_generation_prompt="no"
    opened the assistant turn (a truthy string)."""
    conv = [{"role": "user", "content": "Hi"}]
    for kw, match in ((dict(messages=conv[0]), r"messages=\{'role': 'user', 'content': 'Hi'\}: one message on its own"),
                      (dict(messages=5), "messages=5: must be a list of messages"),
                      (dict(messages="Hi"), "messages='Hi': must be a list of messages"),
                      (dict(messages=conv, chat_template_kwargs=["x"]), r"chat_template_kwargs=\['x'\]: must be a dict"),
                      (dict(messages=conv, chat_template=5), "chat_template=5: must be a Jinja template string"),
                      (dict(messages=conv, add_generation_prompt="no"), "add_generation_prompt='no': must be True or False"),
                      (dict(messages=conv, chat_template_kwargs={"continue_final_message": "yes"}),
                       r"chat_template_kwargs\['continue_final_message'\]='yes'")):
        with pytest.raises(ValueError, match=match):
            text_llm.chat(sampling_params=greedy(1), use_tqdm=False, **kw)
    assert not text_llm.llm_engine.has_unfinished_requests()
    assert len(text_llm.chat((conv,), greedy(1), chat_template=STRING_ONLY, use_tqdm=False)) == 1  # a tuple of them


TOOL_ARGS = ("{% for m in messages %}<{{ m.role }}>{% for c in m.tool_calls or [] %}"
             "{{ c.function.name }}({% if c.function.arguments is mapping %}{% for k, v in c.function.arguments | items %}"
             "{{ k }}={{ v }}{% endfor %}{% else %}?{% endif %})"
             "{% endfor %}{% if m.tool_calls is defined %}[calls]{% endif %}{% endfor %}")


def test_chat_parses_tool_call_arguments_as_vllm_does(text_llm):
    """OpenAI-format tool calls carry their arguments as a JSON string: a template iterating them
    (``| items``) raised "Can only get item pairs from a mapping"; vLLM parses them to a dict and
    drops an empty tool_calls list."""
    tok = text_llm.tokenizer
    call = {"id": "c0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Dallas"}'}}
    bare = {"id": "c1", "type": "function", "function": {"name": "now"}}  # no arguments: {} as in vLLM
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call, bare]},
            {"role": "assistant", "content": "ok", "tool_calls": []}]
    out = text_llm.chat(conv, greedy(1), chat_template=TOOL_ARGS, add_generation_prompt=False, use_tqdm=False)[0]
    assert _rendered(out, tok) == "<user><assistant>weather(city=Dallas)now()[calls]<assistant>"
    assert call["function"]["arguments"] == '{"city": "Dallas"}'  # the caller's message is not changed
    bad = {"function": {"name": "f", "arguments": "{not json"}}
    with pytest.raises(ValueError, match=r"message 0, tool call 0: arguments '\{not json' is not JSON"):
        text_llm.chat([{"role": "assistant", "content": "", "tool_calls": [bad]}], greedy(1),
                      chat_template=TOOL_ARGS, use_tqdm=False)


def test_tokenization_kwargs_and_add_requests_params_keyword(llm):
    """vLLM's generate/chat/add_request take tokenization_kwargs (how its newest SamplingParams-less
    scripts truncate prompts) and add_request names its parameters ``params``: both raised TypeError."""
    prompt = prompts_of([12], seed=8)[0]
    out = llm.generate(prompt, greedy(2), use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 5})[0]
    assert out.prompt_token_ids == prompt[-5:]
    with pytest.raises(ValueError, match=r"key\(s\) \['max_length'\]"):
        llm.generate(prompt, greedy(2), use_tqdm=False, tokenization_kwargs={"max_length": 5})
    kept = llm.generate(prompt, greedy(2, truncate_prompt_tokens=3), use_tqdm=False,
                        tokenization_kwargs={"truncate_prompt_tokens": None})[0]
    assert kept.prompt_token_ids == prompt[-3:]  # None in the kwargs leaves the SamplingParams' value
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens'\]=0"):
        llm.generate(prompt, greedy(2), use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 0})
    engine = llm.llm_engine
    engine.add_request(request_id="k", prompt=prompt, params=greedy(2),
                       tokenization_kwargs={"truncate_prompt_tokens": 4})
    engine.add_request("s", prompt, sampling_params=greedy(3))
    with pytest.raises(TypeError, match="both params and sampling_params"):
        engine.add_request("both", prompt, greedy(1), sampling_params=greedy(1))
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["k"].prompt_token_ids == prompt[-4:] and len(final["s"].outputs[0].token_ids) == 3


def test_vllm_request_arguments_priority_and_arrival_time(llm):
    import time

    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"priority=1: .*first come, first served"):
        engine.add_request("p", [1, 2, 3], greedy(1), priority=1)
    with pytest.raises(ValueError, match="lora_request"):
        engine.add_request("p", [1, 2, 3], greedy(1), None, object())
    with pytest.raises(ValueError, match=r"priority=\[0, 1\]"):
        llm.generate([[1, 2], [3, 4]], greedy(1), use_tqdm=False, priority=[0, 1])
    assert not engine.has_unfinished_requests()
    outs = llm.generate([[1, 2], [3, 4]], greedy(1), use_tqdm=False, priority=[0, 0])
    assert len(outs) == 2
    # a time.time() stamp 3 s ago, as vLLM takes it: the request has waited 3 s (perf_counter metrics)
    engine.add_request("late", [1, 2, 3], greedy(1), time.time() - 3.0, priority=0)
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    assert 3000 <= done[0].metrics.queue_ms < 60_000
    with pytest.raises(ValueError, match="arrival_time='now'"):
        engine.add_request("x", [1, 2, 3], greedy(1), "now")


def test_sampling_params_output_kind_asks_the_engine_for_deltas(llm):
    """vLLM's SamplingParams(output_kind=RequestOutputKind.DELTA) (it raised TypeError); LLM.generate
    still returns final outputs whatever the parameters say, as in vLLM."""
    from minivllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", [1, 2, 3], params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].token_ids for o in engine.step()]
    assert [len(d) for d in deltas] == [1, 1, 1, 1]
    assert llm.generate([1, 2, 3], params, use_tqdm=False)[0].outputs[0].token_ids == sum(deltas, [])
    engine.add_request("c", [1, 2, 3], greedy(3))  # the default: cumulative
    cumulative = []
    while engine.has_unfinished_requests():
        cumulative += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert cumulative == [1, 2, 3]
    assert SamplingParams(output_kind="final_only").output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match=r"SamplingParams.output_kind='stream': choose from"):
        SamplingParams(output_kind="stream")


def test_seed_outside_torch_generators_range_is_refused_at_once(llm):
    """Such a seed was accepted, then every step failed with torch's 'Overflow when unpacking long
    long' (not naming the field) until the request was aborted."""
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-2**63)
    for seed, n in ((2**64, 1), (-2**63 - 1, 1), (2**64 - 1, 2)):
        with pytest.raises(ValueError, match=r"SamplingParams.seed=-?\d+: must be in \[-2\*\*63, 2\*\*64 - 1\]"):
            SamplingParams(seed=seed, n=n, temperature=1.0)
    params = SamplingParams(seed=5)
    with pytest.raises(ValueError, match="seed"):
        params.seed = 2**64
    out = llm.generate([1, 2, 3], SamplingParams(seed=2**64 - 2, n=2, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2


def test_max_tokens_capped_by_max_model_len_warns_once_per_engine(tiny_ckpt, caplog):
    llm = make_llm(tiny_ckpt, max_model_len=16)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        outs = llm.generate([[1] * 10, [2] * 12], greedy(10), use_tqdm=False)
        llm.generate([1] * 10, greedy(10), use_tqdm=False)
        llm.generate([1] * 3, greedy(4), use_tqdm=False)
    warnings = [r.getMessage() for r in caplog.records if "exceeds max_model_len" in r.getMessage()]
    assert len(warnings) == 1 and "max_tokens=10" in warnings[0]
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 4]
    llm.shutdown()


def test_reset_prefix_cache_takes_vllms_flags_mid_run(llm):
    """vLLM's examples/offline_inference/llm_engine_reset_kv.py calls
    engine.reset_prefix_cache(reset_running_requests=True) between steps: a TypeError here."""
    engine, prompt = llm.llm_engine, list(range(3, 40))
    want = llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0].token_ids  # its blocks now cached
    engine.add_request("r", prompt, greedy(12))
    for _ in range(3):
        engine.step()
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False) is True
    engine.check_invariants()
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()
    assert out[-1].finished and out[-1].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="reset_running_requests='yes': must be True or False"):
        llm.reset_prefix_cache("yes")
    engine.check_invariants()


def test_reset_running_requests_preempts_them_to_recompute(llm):
    """vLLM's reset_kv example resets with reset_running_requests=True mid-run to show preemption: the flag
    changed nothing here (no request was preempted). Now every running request is preempted (its blocks
    freed, back to the front of the waiting queue in its order) and finishes with the same greedy tokens."""
    engine = llm.llm_engine
    prompts = prompts_of([37, 21, 9], seed=4)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(12))
    for _ in range(3):
        engine.step()
    running = [s.request_id for s in engine.scheduler.running]
    assert len(running) == 3
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert not engine.scheduler.running and [s.request_id for s in engine.scheduler.waiting] == running
    assert engine.block_manager.num_used_blocks == 0
    engine.check_invariants()
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(3)] == want
    assert [final[f"r{i}"].metrics.num_preemptions for i in range(3)] == [1, 1, 1]


def test_an_interrupt_while_reset_preempts_leaves_every_request_running(llm, monkeypatch):
    engine = llm.llm_engine
    prompts = prompts_of([17, 25], seed=5)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(10), use_tqdm=False)]
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, greedy(10))
    engine.step()
    before = [(s.request_id, list(s.block_table), s.num_computed_tokens) for s in engine.scheduler.running]
    requeue, calls = engine.scheduler.requeue, []

    def interrupted_second(seq):
        calls.append(seq.request_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        requeue(seq)

    monkeypatch.setattr(engine.scheduler, "requeue", interrupted_second)
    with pytest.raises(KeyboardInterrupt):
        engine.reset_prefix_cache(reset_running_requests=True)
    monkeypatch.undo()
    assert [(s.request_id, list(s.block_table), s.num_computed_tokens) for s in engine.scheduler.running] == before
    engine.check_invariants()
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[f"q{i}"].outputs[0].token_ids for i in range(2)] == want
    assert [final[f"q{i}"].metrics.num_preemptions for i in range(2)] == [0, 0]


def test_external_launcher_says_only_rank_0_returns(caplog):
    """vLLM's torchrun example passes distributed_executor_backend='external_launcher', where every rank gets the
    outputs; the warning said it "changes nothing", and a script's dist.barrier() after generate hung rank 0."""
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        EngineArgs(distributed_executor_backend="external_launcher")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "only rank 0's LLM(...) returns" in text and "README, 'Launching'" in text


def test_enqueue_then_wait_for_completion_as_vllm_034(text_llm):
    """vLLM 0.34's LLM.enqueue / enqueue_chat queue requests without running them and wait_for_completion runs
    them to the end (an AttributeError here before): the same outputs as generate / chat, in queued order."""
    prompts = prompts_of([9, 4, 13], seed=6)
    want = [o.outputs[0].token_ids for o in text_llm.generate(prompts, greedy(6), use_tqdm=False)]
    conv = [{"role": "user", "content": "hello"}]
    chat_want = text_llm.chat(conv, greedy(5), use_tqdm=False)[0].outputs[0].token_ids
    from minivllm import RequestOutput

    engine = text_llm.llm_engine
    steps_before = engine.step_index
    ids = text_llm.enqueue(prompts[:2], greedy(6))
    ids += text_llm.enqueue_chat(conv, greedy(5), use_tqdm=False)
    ids += text_llm.enqueue(prompts[2], greedy(6))
    assert engine.get_num_unfinished_requests() == 4 and engine.step_index == steps_before  # queued, not run
    outs = text_llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids and all(o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [want[0], want[1], chat_want, want[2]]
    assert text_llm.wait_for_completion(RequestOutput, use_tqdm=False) == [] and not engine.has_unfinished_requests()
    class PoolingRequestOutput:  # (vLLM's; a script passing it wants embeddings)
        pass

    with pytest.raises(TypeError, match="RequestOutput only"):
        text_llm.wait_for_completion(PoolingRequestOutput)
    # a bad prompt queues nothing of its call; what was queued before stays
    ids = text_llm.enqueue(prompts[0], greedy(3))
    with pytest.raises(ValueError):
        text_llm.enqueue([prompts[1], []], greedy(3))
    assert engine.get_num_unfinished_requests() == 1
    assert [o.request_id for o in text_llm.wait_for_completion(use_tqdm=False)] == ids


def test_an_interrupted_wait_for_completion_aborts_what_was_enqueued(llm, monkeypatch):
    engine = llm.llm_engine
    llm.enqueue(prompts_of([7, 11], seed=7), greedy(8))
    step, calls = engine.step, []

    def interrupted_third():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_third)
    with pytest.raises(KeyboardInterrupt):
        llm.wait_for_completion(use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests() and llm.wait_for_completion(use_tqdm=False) == []
    engine.check_invariants()


def test_enqueue_while_a_wait_runs_is_kept_for_the_next_wait(llm, monkeypatch):
    """A request enqueued (by another thread) while a wait ran broke it: the wait's outputs were lost to a
    KeyError and the next wait raised "outputs never arrived". Each wait runs what was enqueued when it began."""
    engine = llm.llm_engine
    first, later = prompts_of([5, 8], seed=8), prompts_of([6], seed=9)
    want = [o.outputs[0].token_ids for o in llm.generate(first + later, greedy(6), use_tqdm=False)]
    ids = llm.enqueue(first, greedy(6))
    step, added = engine.step, []

    def step_then_enqueue():  # as a second thread would, between two steps of the wait
        out = step()
        if not added:
            added.extend(llm.enqueue(later, greedy(6)))
        return out

    monkeypatch.setattr(engine, "step", step_then_enqueue)
    outs = llm.wait_for_completion(use_tqdm=False)
    monkeypatch.undo()
    assert [o.request_id for o in outs] == ids and [o.outputs[0].token_ids for o in outs] == want[:2]
    outs = llm.wait_for_completion(use_tqdm=False)  # the later request: run (or kept) for this wait
    assert [o.request_id for o in outs] == added and outs[0].outputs[0].token_ids == want[2]
    assert not engine.has_unfinished_requests() and llm.wait_for_completion(use_tqdm=False) == []


def test_threads_enqueue_at_once_and_each_gets_its_own_ids(llm):
    import threading

    prompts = prompts_of([4, 5, 6], seed=10)
    got, barrier = {}, threading.Barrier(2)

    def enqueue(name):
        barrier.wait()
        got[name] = [rid for _ in range(4) for rid in llm.enqueue(prompts, greedy(3))]

    threads = [threading.Thread(target=enqueue, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got["a"]) == len(got["b"]) == 12 and not set(got["a"]) & set(got["b"])
    outs = llm.wait_for_completion(use_tqdm=False)
    assert sorted(o.request_id for o in outs) == sorted(got["a"] + got["b"]) and all(o.finished for o in outs)


def test_wait_for_completion_uses_a_callable_use_tqdm_and_survives_an_interrupt_after_its_run(llm, monkeypatch):
    """A callable use_tqdm was replaced by a plain bar; an interrupt after the outputs were collected left the
    requests listed as enqueued, and the next wait raised "outputs never arrived"."""
    made = []

    def bar(**kwargs):
        made.append(kwargs["total"])
        return tqdm_stub()

    class tqdm_stub:
        def update(self, n):
            made.append(n)

        def close(self):
            made.append("closed")

    llm.enqueue(prompts_of([4, 7], seed=11), [greedy(3), SamplingParams(n=2, temperature=0.8, max_tokens=3)])
    assert [len(o.outputs) for o in llm.wait_for_completion(use_tqdm=bar)] == [1, 2]
    assert made[0] == 3 and sorted(made[1:3]) == [1, 2] and made[-1] == "closed"
    llm.enqueue(prompts_of([4], seed=12), greedy(3))
    forget, calls = llm._forget_enqueued, []

    def interrupted_first(ids):
        calls.append(list(ids))
        if len(calls) == 1:
            raise KeyboardInterrupt
        forget(ids)

    monkeypatch.setattr(llm, "_forget_enqueued", interrupted_first)
    with pytest.raises(KeyboardInterrupt):
        llm.wait_for_completion(use_tqdm=False)
    monkeypatch.undo()
    assert llm.wait_for_completion(use_tqdm=False) == [] and not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_invariants()


def test_a_printed_request_output_counts_its_token_times(llm):
    """print(outputs), as vLLM's examples do, printed every token's timestamp (7,337 characters at 256 tokens)."""
    out = llm.generate([[3, 4, 5]], greedy(40), use_tqdm=False)[0]
    assert len(out.metrics.token_times) == 40
    assert "token_times=<40 times>" in repr(out) and len(repr(out.metrics)) < 400


def test_small_vllm_conveniences(llm):
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.tokenizer
    for rid in ("x", "y"):
        engine.add_request(rid, [1, 2, 3], greedy(5))
    out = engine.abort_request(["x", "y"])  # vLLM accepts an iterable of ids
    assert out.finished and out.outputs[0].finish_reason == "abort" and not engine.has_unfinished_requests()
    assert llm.reset_prefix_cache() is True
    params = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    copy = params.clone()
    copy.logit_bias[1] = 5.0
    assert copy == SamplingParams(stop=["a"], logit_bias={1: 5.0}) and params.logit_bias == {1: 2.0}


def test_vllm_engine_arguments_for_lacking_features_are_named_when_turned_on(tiny_ckpt):
    """LLM(logits_processors=[...]) said only 'unknown engine argument'; a vLLM script's
    pipeline_parallel_size=1 or enable_lora=False (features off) runs, with the ignored-arguments
    warning."""
    for kwargs, feature in (({"logits_processors": [print]}, "logits processors"), ({"enable_lora": True}, "LoRA"),
                            ({"pipeline_parallel_size": 2}, "pipeline parallelism")):
        with pytest.raises(TypeError, match=f"{feature}.* is a vLLM feature minivllm does not have"):
            make_llm(tiny_ckpt, **kwargs)
    llm = make_llm(tiny_ckpt, pipeline_parallel_size=1, enable_lora=False, max_lora_rank=16,
                   guided_decoding_backend="xgrammar")
    llm.shutdown()


def test_vllm_engine_arguments_at_their_defaults_run_and_name_their_feature_otherwise(tiny_ckpt, caplog):
    """Scripts pass task, runner, data_parallel_size, ... at values that ask for nothing minivllm lacks:
    they were 'unknown engine argument(s)'. (generation_config is an engine argument of its own now:
    test_generation_config_auto_vllm_or_a_directory.)"""
    defaults = dict(task="generate", runner="auto", data_parallel_size=1,
                    async_scheduling=False, skip_tokenizer_init=False, model_impl="auto",
                    enable_expert_parallel=False, hf_overrides={}, override_generation_config=None)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        make_llm(tiny_ckpt, **defaults).shutdown()
    warned = " ".join(r.getMessage() for r in caplog.records if "ignoring vLLM engine argument" in r.getMessage())
    assert all(f"{k}=" in warned for k in defaults)
    for kwargs, feature in (({"task": "embed"}, "task"),
                            ({"data_parallel_size": 2}, "data parallelism"),
                            ({"async_scheduling": True}, "asynchronous scheduling"),
                            ({"hf_overrides": {"rope_theta": 1.0}}, "overrides of the Hugging Face config"),
                            ({"override_generation_config": {"temperature": 0.5}}, "overrides of the generation")):
        with pytest.raises(TypeError, match=f"{feature}.* is a vLLM feature minivllm does not have"):
            make_llm(tiny_ckpt, **kwargs)


def test_engine_args_on_a_command_line_as_vllm_scripts_build_them():
    """EngineArgs.add_cli_args / from_cli_args (vLLM's generate.py, chat.py, llm_engine_example.py) did not
    exist; every field is an option with its default, bools as --x / --no-x, dicts as JSON, and the parser
    takes vLLM's underscore spellings."""
    import dataclasses

    from minivllm import EngineArgs
    from minivllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    args = parser.parse_args(["--max_num_seqs=3", "--no-enable-chunked-prefill", "--compile", "--seed", "5",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    got = EngineArgs.from_cli_args(args)
    assert (got.max_num_seqs, got.enable_chunked_prefill, got.compile, got.seed) == (3, False, True, 5)
    assert got.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert set(vars(args)) == {f.name for f in dataclasses.fields(EngineArgs)}
    text = parser.format_help()
    assert "--kv-cache-memory-bytes" in text and "tokens per KV block" in text
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        EngineArgs.from_cli_args(parser.parse_args(["--max-num-seqs", "0"]))
    # vLLM's own flags that LLM(...) takes for compatibility were "unrecognized arguments": now hidden options,
    # in the namespace only when given, warned about or refused as in Python
    args = parser.parse_args(["--trust-remote-code", "--swap-space", "4", "-tp", "1", "--disable-log-stats"])
    assert (args.trust_remote_code, args.swap_space, args.tensor_parallel_size) == (True, 4, 1)
    assert "trust-remote-code" not in text and not hasattr(parser.parse_args([]), "swap_space")
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    with pytest.raises(TypeError, match="pipeline parallelism"):
        EngineArgs.from_cli_args(parser.parse_args(["-pp", "2"]))
    with pytest.raises(SystemExit):  # argparse: "argument --speculative-config: '{bad' is not JSON (...)"
        parser.parse_args(["--speculative-config", "{bad"])
    # vLLM's yes/no flags take no value: a positional after one stays the script's (it was swallowed)
    script = FlexibleArgumentParser()
    script.add_argument("prompt")
    script.add_argument("--swap-space", type=float)  # a script's own option keeps its own definition
    EngineArgs.add_cli_args(script)
    args = script.parse_args(["--trust-remote-code", "hello", "--no-enable-lora", "--swap-space", "2"])
    assert (args.prompt, args.trust_remote_code, args.enable_lora, args.swap_space) == ("hello", True, False, 2.0)
    # vLLM's parser reads sizes with suffixes and --max-model-len auto (exit 2 here before)
    args = parser.parse_args(["--max-model-len", "1k", "--kv-cache-memory-bytes", "64M", "--max-num-batched-tokens",
                              "8.5k", "--enable-trace-replay"])
    assert (args.max_model_len, args.kv_cache_memory_bytes, args.max_num_batched_tokens) == (1000, 64 << 20, 8500)
    with pytest.raises(TypeError, match="trace replay"):
        EngineArgs.from_cli_args(args)
    assert EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "auto"])).max_model_len is None
    assert parser.parse_args(["--max-num-batched-tokens", "2K"]).max_num_batched_tokens == 2048
    for bad in ("1.5K", "lots", "auto"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-memory-bytes", bad])


def test_other_engines_spellings_of_our_arguments_are_command_line_options_too():
    """LLM(num_gpu_blocks_override=64) worked, but --num-gpu-blocks-override 64 (vLLM's flag) was an
    "unrecognized argument"; nano-vllm's --kvcache-block-size likewise."""
    from minivllm import EngineArgs
    from minivllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    got = EngineArgs.from_cli_args(parser.parse_args(["--num-gpu-blocks-override", "64", "--kvcache-block-size", "32"]))
    assert (got.num_kvcache_blocks, got.block_size) == (64, 32)
    assert "num-gpu-blocks-override" not in parser.format_help()
    with pytest.raises(TypeError, match="'num_kvcache_blocks' given twice"):  # as LLM(...) refuses both: not last-wins
        EngineArgs.from_cli_args(parser.parse_args(["--num-kvcache-blocks", "32", "--num-gpu-blocks-override", "64"]))
    # LLM(**vars(args)), the README's other way: the field's own option is in the namespace at its default (None),
    # which read as the argument given twice
    given = vars(parser.parse_args(["--num-gpu-blocks-override", "64", "--kvcache-block-size", "32"]))
    got = EngineArgs.from_kwargs(given.pop("model"), given)
    assert (got.num_kvcache_blocks, got.block_size) == (64, 32)
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-gpu-blocks-override", "many"])


def _trace_events(path):
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_start_and_stop_profile_write_a_trace_and_refuse_misuse(tiny_ckpt, tmp_path, monkeypatch):
    """vLLM's simple_profiling.py: LLM.start_profile / stop_profile did not exist (AttributeError).
    The directory comes from profiler_config (vLLM's current spelling) or VLLM_TORCH_PROFILER_DIR."""
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = make_llm(tiny_ckpt, profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "cfg"),
                                               "torch_profiler_record_shapes": True, "delay_iterations": 0})
    with pytest.raises(RuntimeError, match="not profiling"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already profiling"):
        llm.start_profile()
    llm.generate([3, 4, 5], greedy(3), use_tqdm=False)
    first = llm.stop_profile()
    llm.start_profile(profile_prefix="second")
    second = llm.stop_profile()  # a second trace in the same second gets its own name
    assert first.parent == tmp_path / "cfg" and first.name.endswith(".pt.trace.json.gz")  # vLLM's gzip default
    assert second.name.startswith("second-") and second.exists()
    assert any(e.get("name", "").startswith("aten::") for e in _trace_events(first))
    engine = llm.llm_engine
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.start_profile()  # a profile nothing would ever stop
    assert not torch.autograd._profiler_enabled()
    bare = make_llm(tiny_ckpt, profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "plain"),
                                                "torch_profiler_use_gzip": False})
    bare.start_profile()
    assert _trace_events(bare.stop_profile()) and list((tmp_path / "plain").glob("*.pt.trace.json"))
    bare.shutdown()
    bare = make_llm(tiny_ckpt)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        bare.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    bare.start_profile()
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")  # the directory was fixed at the start: the trace is kept
    assert bare.stop_profile().parent == tmp_path / "env"
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    with pytest.raises(ValueError, match="profile_prefix='run1/decode'"):  # a path: its trace was lost at the stop
        bare.start_profile(profile_prefix="run1/decode")
    bare.start_profile()
    profiler = bare.llm_engine.profiler
    bare.shutdown()  # a trace still running is stopped, not left recording the process
    assert profiler._profile is None and not torch.autograd._profiler_enabled()
    for config, match in (({"profiler": "cuda"}, "only 'torch'"), ({"torch_profiler_dir": "x"}, "needs 'profiler'"),
                          ({"profiler": "torch"}, "needs a 'torch_profiler_dir'"),
                          ({"profiler": "torch", "torch_profiler_dir": "x", "delay": 1}, "'delay'"),
                          ({"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_with_stack": "false"},
                           "must be True or False"),
                          ({"profiler": "torch", "torch_profiler_dir": "x", "max_iterations": 3}, "window of engine"),
                          ("./trace", "must be a dict")):
        with pytest.raises(ValueError, match=match):
            make_llm(tiny_ckpt, profiler_config=config)


def test_two_profiles_at_once_are_refused_not_a_crash(tiny_ckpt, tmp_path, monkeypatch):
    """torch's profiler is process-wide: a second LLM's start_profile while the first profiles (ch05 keeps
    two LLMs) was accepted, and stopping them crashed the process (segmentation fault)."""
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    a, b = make_llm(tiny_ckpt), make_llm(tiny_ckpt)
    a.start_profile()
    with pytest.raises(RuntimeError, match="already running in this process"):
        b.start_profile()
    a.generate([3, 4], greedy(2), use_tqdm=False)
    assert a.stop_profile().exists()
    b.start_profile()  # free again
    b.stop_profile()
    a.shutdown()
    b.shutdown()


def test_a_tokenizer_output_given_as_a_prompt_is_refused_with_the_fix(llm):
    # transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding where 4.x returned the ids:
    # the vLLM idiom TokensPrompt(prompt_token_ids=tok.apply_chat_template(...)) then passed its keys as ids
    from transformers import BatchEncoding

    from minivllm import TokensPrompt

    encoding = BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]})  # (a tokenizer call's type)
    fix = r"BatchEncoding with keys \['input_ids', 'attention_mask'\].*pass its \['input_ids'\]"
    for prompt in (TokensPrompt(prompt_token_ids=encoding), encoding, [encoding]):
        with pytest.raises(ValueError, match=fix):
            llm.generate(prompt, greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"dict with keys \['input_ids'\].*pass its \['input_ids'\]"):
        llm.generate({"input_ids": [5, 6]}, greedy(2), use_tqdm=False)
    out = llm.generate(TokensPrompt(prompt_token_ids=encoding["input_ids"]), greedy(2), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(encoding["input_ids"]) and len(out.outputs[0].token_ids) == 2


def test_truncate_prompt_tokens_above_the_room_names_itself(tiny_ckpt):
    llm = make_llm(tiny_ckpt, max_model_len=16)
    try:
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens=16 keeps 16 tokens.*max_model_len - 1 = 15"):
            llm.generate(prompts_of([20])[0], greedy(2, truncate_prompt_tokens=16), use_tqdm=False)
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens=100 is more than max_model_len=16"):
            llm.generate(prompts_of([20])[0], greedy(2, truncate_prompt_tokens=100), use_tqdm=False)
        out = llm.generate(prompts_of([20])[0], greedy(2, truncate_prompt_tokens=15), use_tqdm=False)[0]
        assert len(out.prompt_token_ids) == 15
    finally:
        llm.shutdown()


def test_request_metrics_answer_to_vllm_names(llm):
    m = llm.generate(prompts_of([5])[0], greedy(3), use_tqdm=False)[0].metrics
    assert m.last_token_time == m.token_times[-1] and m.num_generation_tokens == 3
    assert m.time_in_queue == pytest.approx(m.queue_ms / 1e3) and m.time_in_queue >= 0
    assert m.first_token_latency == pytest.approx(m.ttft_ms / 1e3) and m.first_token_latency > 0
    from minivllm.outputs import RequestMetrics

    fresh = RequestMetrics(arrival_time=1.0)
    assert (fresh.last_token_time, fresh.time_in_queue, fresh.first_token_latency, fresh.num_generation_tokens) == (
        None, None, None, 0)


def test_vllm_engine_internals_say_where_they_are_here(llm):
    for name, where in (("model_executor", "llm.llm_engine.runner.model"), ("vllm_config", "llm.llm_engine.config"),
                        ("cache_config", "num_kv_blocks"), ("scheduler_config", "scheduler.config")):
        with pytest.raises(AttributeError, match=re.escape(where)):
            getattr(llm.llm_engine, name)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        llm.llm_engine.nope
    assert getattr(llm.llm_engine, "model_executor", None) is None  # hasattr-style probes still work
    assert llm.llm_engine.scheduler.config.max_model_len == llm.llm_engine.config.max_model_len


def test_generation_config_auto_vllm_or_a_directory(tiny_ckpt, tmp_path):
    ckpt = _with_generation_config(tiny_ckpt, tmp_path / "gen", temperature=0.7, top_k=20)
    auto = make_llm(ckpt)
    assert (auto.get_default_sampling_params().temperature, auto.llm_engine.args.generation_config) == (0.7, "auto")
    auto.shutdown()
    own = make_llm(ckpt, generation_config="vllm")  # vLLM's: SamplingParams' defaults, the file ignored
    assert own.get_default_sampling_params() == SamplingParams()
    own.shutdown()
    elsewhere = make_llm(tiny_ckpt, generation_config=ckpt)  # a directory (a Path too) holding the file
    assert elsewhere.get_default_sampling_params().top_k == 20
    elsewhere.shutdown()
    with pytest.raises(ValueError, match=r"generation_config='nope'.*'auto'.*'vllm'"):
        EngineArgs(model=str(tiny_ckpt), generation_config="nope")
    with pytest.raises(ValueError, match="a directory holding a generation_config.json"):
        EngineArgs(model=str(tiny_ckpt), generation_config=str(tiny_ckpt))  # a directory without the file


def test_vllm_import_lines_and_arguments_of_scripts(tiny_ckpt):
    from minivllm import PromptType  # vLLM exports it at top level
    from minivllm.distributed import destroy_model_parallel as from_package  # vLLM scripts import it from both
    from minivllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                     get_tp_size)

    assert from_package is destroy_model_parallel
    from minivllm.utils import random_uuid

    assert PromptType is __import__("minivllm.inputs").inputs.PromptType
    ids = {random_uuid() for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    destroy_model_parallel()
    destroy_distributed_environment()
    assert get_tp_size() == 1
    with pytest.raises(TypeError, match="convert='embed': converting the model for pooling"):
        EngineArgs(model=str(tiny_ckpt), convert="embed")
    with pytest.raises(TypeError, match="calculate_kv_scales=True: fp8 KV-cache scales"):
        EngineArgs(model=str(tiny_ckpt), convert="auto", calculate_kv_scales=True)
    EngineArgs(model=str(tiny_ckpt), convert="none", calculate_kv_scales=False, max_parallel_loading_workers=2)


def test_nano_vllm_engine_calls_say_what_to_use(tiny_ckpt, llm):
    """LLMEngine(path, enforce_eager=True) was a bare "unexpected keyword argument"; the engine's
    is_finished / exit / model_runner plain AttributeErrors; LLM.step's hint did not say where the
    step's token counts went, and Python appended "Did you mean: '_step'?" to it."""
    for args, kwargs in (((str(tiny_ckpt),), {"enforce_eager": True}), ((), {"model": str(tiny_ckpt)})):
        with pytest.raises(TypeError, match=r"nano-vllm's LLMEngine\(model, \*\*kwargs\) is LLM\(model, \*\*kwargs\)"):
            LLMEngine(*args, **kwargs)
    for name, where in (("is_finished", "has_unfinished_requests()"), ("exit", "llm.shutdown()"),
                        ("model_runner", "llm.llm_engine.runner")):
        with pytest.raises(AttributeError, match=re.escape(where)):
            getattr(llm.llm_engine, name)
    with pytest.raises(AttributeError, match="last_step_record.num_prefill_tokens") as caught:
        llm.step()
    import traceback

    assert "Did you mean" not in "".join(traceback.format_exception(caught.value))


def test_an_out_of_vocabulary_id_names_the_model_and_a_model_that_takes_it(llm):
    with pytest.raises(ValueError, match=r"token id 6311 is outside the vocabulary \[0, \d+\) of .*"
                                         r"model='random:qwen3-0.6b'"):
        llm.generate([[5, 6311]], greedy(1), use_tqdm=False)


def test_an_output_equals_the_dict_nano_vllm_returned(llm):
    """nano-vllm's generate returned dicts; ``outputs[0] == {"text": ..., "token_ids": ...}`` was silently False."""
    import copy

    out = llm.generate(prompts_of([5])[0], greedy(3), use_tqdm=False)[0]
    as_dict = {"text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids)}
    assert out == as_dict and as_dict == out and [out] == [as_dict]
    assert out != {"text": out.outputs[0].text, "token_ids": []} and out != {"text": out.outputs[0].text}
    twin = copy.deepcopy(out)
    assert twin == out and twin is not out  # two outputs still compare field by field
    twin.num_cached_tokens = (out.num_cached_tokens or 0) + 1
    assert twin != out and out != 5
    twin.outputs = []  # no completion (a script's own object): unequal to any dict, not an IndexError
    assert twin != {} and twin != as_dict


def test_vllm_example_scripts_import_lines_and_default_nones(tiny_ckpt):
    """Found running vLLM's own offline examples: their import lines for cleanup, pooling, the async
    engine and ProfilerConfig failed before any refusal; argparse defaults of None for max_num_seqs
    and gpu_memory_utilization (vLLM's own defaults) were refused; max_model_len=-1 (vLLM's "fit to
    memory") was refused; vLLM arguments such as disable_chunked_mm_input were "unknown"."""
    from minivllm import AsyncEngineArgs, AsyncLLMEngine, PoolingParams
    from minivllm.config import ProfilerConfig
    from minivllm.distributed import cleanup_dist_env_and_memory
    from minivllm.engine.arg_utils import AsyncEngineArgs as FromArgUtils

    assert FromArgUtils is AsyncEngineArgs
    cleanup_dist_env_and_memory()
    for cls, feature in ((PoolingParams, "pooling"), (AsyncEngineArgs, "no asynchronous engine"),
                         (AsyncLLMEngine, "no asynchronous engine")):
        with pytest.raises(NotImplementedError, match=f"{cls.__name__}: .*{feature}"):
            cls()
    with pytest.raises(NotImplementedError, match="AsyncLLMEngine.from_engine_args: minivllm has no asynchronous"):
        AsyncLLMEngine.from_engine_args(EngineArgs())
    # vLLM's async scripts build their options first: the class methods say it, not a bare AttributeError
    from minivllm.engine.async_llm_engine import AsyncLLM

    for call, name in ((lambda: AsyncEngineArgs.add_cli_args(None), "AsyncEngineArgs.add_cli_args"),
                       (lambda: AsyncEngineArgs.from_cli_args(None), "AsyncEngineArgs.from_cli_args"),
                       (AsyncLLM, "AsyncLLM:")):
        with pytest.raises(NotImplementedError, match=f"{name}.*no asynchronous engine"):
            call()
    assert ProfilerConfig(profiler="torch", torch_profiler_dir="t") == {"profiler": "torch", "torch_profiler_dir": "t"}
    # a dict subclass that dataclasses.asdict can rebuild: vLLM scripts call LLM(**asdict(engine_args))
    import dataclasses

    args = EngineArgs(profiler_config=ProfilerConfig(profiler="torch", torch_profiler_dir="t"))
    assert dataclasses.asdict(args)["profiler_config"] == {"profiler": "torch", "torch_profiler_dir": "t"}
    with pytest.raises(ValueError, match="only 'torch'"):
        ProfilerConfig(profiler="cuda")
    args = EngineArgs(max_num_seqs=None, gpu_memory_utilization=None, max_model_len=-1)
    assert (args.max_num_seqs, args.gpu_memory_utilization, args.max_model_len) == (256, 0.9, None)
    with pytest.raises(ValueError, match="max_model_len=-2: must be a positive int"):
        EngineArgs(max_model_len=-2)
    EngineArgs.from_kwargs(None, dict(disable_chunked_mm_input=True, cudagraph_capture_sizes=[1, 2],
                                      distributed_timeout_seconds=60, attention_config=None, config_format="auto",
                                      kv_transfer_config=None, quantization_config=None))
    for name, value, feature in (("kv_transfer_config", {"kv_connector": "x"}, "KV-cache transfer"),
                                 ("enable_trace_replay", True, "trace replay"),
                                 ("attention_config", {"backend": "FLASH_ATTN"}, "attention_backend="),
                                 ("worker_extension_cls", "m.C", "worker extensions")):
        with pytest.raises(TypeError, match=f"{name}=.*{re.escape(feature)}.*is a vLLM feature minivllm does not have"):
            EngineArgs.from_kwargs(None, {name: value})


def test_llm_from_engine_args_chat_template_and_vllm_calls(tiny_ckpt, text_ckpt, tmp_path):
    """vLLM's LLM.from_engine_args, get_world_size, get_model_inspection and LLM(chat_template=...)
    were an AttributeError or an "unknown engine argument"; its queue-then-wait and cache calls a bare
    AttributeError; a prompt_embeds prompt was refused with the tensor printed and no feature named."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    with pytest.raises(ValueError, match="chat_template='no_such_template.jinja' looks like a file path"):
        LLM(str(tiny_ckpt), chat_template="no_such_template.jinja")
    for given in (template, path, str(path)):
        llm = LLM.from_engine_args(EngineArgs(model=str(tiny_ckpt), num_kvcache_blocks=64)) if given is template \
            else None
        if llm is not None:
            assert llm.get_world_size() == 1 and "Qwen3" in llm.get_model_inspection()
            llm.shutdown()
        llm = make_llm(text_ckpt, chat_template=given)
        out = llm.chat([{"role": "user", "content": "hi"}], greedy(1), use_tqdm=False)[0]
        assert out.prompt == "<user>hi<assistant>"
        # the call's own template still wins
        out = llm.chat([{"role": "user", "content": "hi"}], greedy(1), use_tqdm=False,
                       chat_template="[{{ messages[0]['content'] }}]")[0]
        assert out.prompt == "[hi]"
        llm.shutdown()
    with pytest.raises(TypeError, match="engine_args must be an EngineArgs, got dict"):
        LLM.from_engine_args({"model": str(tiny_ckpt)})
    llm = make_llm(tiny_ckpt)
    for name, hint in (("release_kv_cache_memory", "sleep mode"), ("reset_mm_cache", "text only")):
        with pytest.raises(AttributeError, match=re.escape(hint)):
            getattr(llm, name)
    with pytest.raises(ValueError, match="prompt_embeds: prompt embeddings as inputs are a vLLM feature"):
        llm.generate({"prompt_embeds": torch.zeros(3, 8)}, greedy(1), use_tqdm=False)
    llm.shutdown()
