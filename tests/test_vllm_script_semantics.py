"""Where a vLLM script got other results than vLLM gives (a vLLM user's review, 2026-12-05): greedy
requests' filters, chat tokenization and template arguments, special tokens in logprobs, numpy
token ids, a TokensPrompt's text, and vLLM arguments at values that ask for nothing."""
from __future__ import annotations

import copy
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers_engine import make_llm
from minivllm import EngineArgs, SamplingParams

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm():
    # the embedded model: its 4096-token vocabulary holds the chat template's tokens (tiny_ckpt's 97 do not)
    llm = make_llm("minivllm-tiny", logprobs_mode="processed_logprobs")
    yield llm
    llm.shutdown()


def test_greedy_requests_drop_their_filters_as_vllm(llm):
    """vLLM resets top_p, top_k and min_p of a temperature-0 request. Here a greedy row kept them, and
    with processed logprobs it reported the filtered distribution (-inf beyond top_k) only when a
    sampled request shared its batch: alone, the full one."""
    p = SamplingParams(temperature=0, top_k=2, top_p=0.5, min_p=0.2, max_tokens=2, logprobs=4)
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    prompt = [5, 6, 7, 8]
    alone = llm.generate([prompt], [p], use_tqdm=False)[0].outputs[0]
    batched = llm.generate([prompt, [9, 10]], [p, SamplingParams(seed=0, max_tokens=2)], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == batched.token_ids
    for a, b in zip(alone.logprobs, batched.logprobs, strict=True):
        assert list(a) == list(b)
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) and a[t].logprob > -1e9


def test_special_tokens_in_logprobs_read_as_themselves(llm):
    """Logprob.decoded_token of a special token was '' under the default skip_special_tokens=True (the
    text's rule); vLLM decodes each id alone, so eos reads '<|endoftext|>' in logprobs, while the text
    still leaves it out."""
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    for skip in (True, False):
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, logprobs=1, logit_bias={eos: 100},
                                                       skip_special_tokens=skip), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [eos] and out.logprobs[0][eos].decoded_token == tok.convert_ids_to_tokens(eos)
        assert out.text == ""
    prompt = llm.generate([[eos, 5, 6]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert prompt.prompt_logprobs[1][5].decoded_token == tok.decode([5])


def test_chat_arguments_win_over_chat_template_kwargs_as_in_vllm_0_34_and_template_keys_are_refused(llm, caplog):
    """chat_template_kwargs={"add_generation_prompt": False} raised 'got multiple values for keyword
    argument'; then the dict's values won, as in older vLLM. vLLM 0.34 merges the arguments over the dict
    (renderers/params.py merge_kwargs; entrypoints/common/offline.py), and add_generation_prompt's default
    True is no unset value, so the dict's False changes nothing there: the same here, with a warning.
    chat_template / tokenize in the dict are refused."""
    params = SamplingParams(temperature=0, max_tokens=1)
    plain = llm.chat(USER, params, use_tqdm=False, add_generation_prompt=False)[0].prompt
    opened = llm.chat(USER, params, use_tqdm=False)[0].prompt
    with caplog.at_level("WARNING", logger="minivllm"):
        via_dict = llm.chat(USER, params, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0].prompt
    assert via_dict == opened != plain
    assert "chat_template_kwargs' add_generation_prompt=False overridden by the argument" in caplog.text
    both = llm.chat(USER, params, use_tqdm=False, add_generation_prompt=False,
                    chat_template_kwargs={"add_generation_prompt": False})[0].prompt
    assert both == plain
    caplog.clear()
    with caplog.at_level("WARNING", logger="minivllm"):  # said once per names and values
        llm.chat(USER, params, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    assert "overridden" not in caplog.text
    # None / "auto" for a flag stayed a ValueError (a KeyError after the merge changed), "auto" tools refused
    for kw, match in ((dict(add_generation_prompt=None), "add_generation_prompt=None: must be True or False"),
                      (dict(add_generation_prompt="auto"), "add_generation_prompt='auto': must be True or False"),
                      (dict(continue_final_message=None), "continue_final_message=None: must be True or False"),
                      (dict(tools="auto"), "tools='auto': must be a list of tools")):
        with pytest.raises(ValueError, match=match):
            llm.chat(USER, params, use_tqdm=False, **kw)
    for key in ("tokenize", "chat_template"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs names \\['{key}'\\]"):
            llm.chat(USER, params, use_tqdm=False, chat_template_kwargs={key: True})


def test_chat_adds_no_second_bos(tmp_path):
    """The rendered chat was tokenized with add_special_tokens=True: a tokenizer that prepends a BOS, with a
    template that writes {{ bos_token }}, gave two. vLLM tokenizes the rendered text without special tokens."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from minivllm.utils.model_source import resolve_model

    embedded = resolve_model("minivllm-tiny").checkpoint_dir
    tok = AutoTokenizer.from_pretrained(embedded)
    bos = tok.convert_ids_to_tokens(0)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                              special_tokens=[(bos, 0)])
    tok.bos_token = bos
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path)
    assert tok.encode("hi")[0] == 0  # the tokenizer adds a BOS to plain text
    llm = make_llm(embedded, tokenizer=str(tmp_path))
    try:
        ids = llm.chat(USER, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
        assert ids[0] == 0 and ids[1] != 0
        kept = llm.chat(USER, SamplingParams(max_tokens=1), use_tqdm=False,
                        tokenization_kwargs={"add_special_tokens": True})[0].prompt_token_ids
        assert kept[:2] == [0, 0]  # asked for explicitly
    finally:
        llm.shutdown()


def test_tokens_prompt_keeps_its_text(llm):
    """{"prompt_token_ids": [...], "prompt": "..."} (vLLM's TokensPrompt with its text) came back with
    prompt=None: the text was dropped."""
    out = llm.generate({"prompt_token_ids": [5, 6, 7], "prompt": "five six seven"}, SamplingParams(max_tokens=1),
                       use_tqdm=False)[0]
    assert out.prompt == "five six seven" and out.prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="prompt=3 beside prompt_token_ids"):
        llm.generate({"prompt_token_ids": [5], "prompt": 3}, use_tqdm=False)


def test_numpy_and_whole_float_token_ids():
    """logit_bias={np.int64(5): 1}, {5.0: 1}, {5: np.float32(1.5)} and allowed_token_ids=list(np.array(...))
    were refused; vLLM takes int(token) and float biases. A fractional or boolean id is still refused."""
    p = SamplingParams(logit_bias={np.int64(5): 1, 6.0: np.float32(1.5), "7": 2}, allowed_token_ids=list(np.array([5, 6])),
                       stop_token_ids=[np.int32(3)])
    assert p.logit_bias == {5: 1.0, 6: 1.5, 7: 2.0} and all(type(k) is int for k in p.logit_bias)
    assert p.allowed_token_ids == [5, 6] and all(type(t) is int for t in p.allowed_token_ids)
    assert p.stop_token_ids == [3] and type(p.stop_token_ids[0]) is int
    for bad in ({5.5: 1}, {True: 1}):
        with pytest.raises(ValueError, match="is not a token id"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match=r"element 0 \(2.5\)"):
        SamplingParams(allowed_token_ids=[2.5])


def test_newer_vllm_sampling_fields_at_their_defaults():
    """flat_logprobs=False, skip_clone=True, stream_interval=None, ... were 'unexpected keyword argument';
    at values that ask for a feature minivllm lacks they name it."""
    SamplingParams(flat_logprobs=False, skip_clone=True, stream_interval=None, logprob_token_ids=None,
                   prompt_logprob_token_ids=None, prompt_logprob_start=None, thinking_token_budget=None,
                   repetition_detection=None, skip_reading_prefix_cache=None, trace_decode_token_ids=None,
                   routed_experts_prompt_start=0)
    for kw in ({"flat_logprobs": True}, {"stream_interval": 4}, {"logprob_token_ids": [1]},
               {"thinking_token_budget": 10}):
        with pytest.raises(TypeError, match=rf"SamplingParams\({next(iter(kw))}=\.\.\.\): .*vLLM feature"):
            SamplingParams(**kw)


def test_vllm_engine_arguments(caplog):
    """vLLM's num_gpu_blocks_override, scheduling_policy="fcfs", disable_sliding_window, ... were 'unknown
    engine argument(s)'; EngineArgs(trust_remote_code=True) built directly (vLLM's llm_engine_example) was a
    dataclass TypeError; load_format="dummy" and tokenizer_mode="slow" were warned about as changing nothing."""
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        args = EngineArgs(model="minivllm-tiny", num_gpu_blocks_override=64, scheduling_policy="fcfs",
                          trust_remote_code=True, disable_sliding_window=True, enable_prompt_embeds=False,
                          max_cpu_loras=None, cuda_graph_sizes=[1, 2], load_format="auto", tokenizer_mode="auto")
    assert args.num_kvcache_blocks == 64
    assert "scheduling_policy='fcfs'" in caplog.text and "trust_remote_code=True" in caplog.text
    assert copy.deepcopy(args) == args
    for kw, feature in (({"load_format": "dummy"}, "random:<preset>"), ({"tokenizer_mode": "slow"}, "tokenizer"),
                        ({"scheduling_policy": "priority"}, "first come"), ({"enable_prompt_embeds": True}, "embeddings"),
                        ({"stream_interval": 8}, "streaming")):
        with pytest.raises(TypeError, match=f"{next(iter(kw))}=.*{feature}.*is a vLLM feature minivllm does not have"):
            EngineArgs(**kw)
    with pytest.raises(TypeError, match="given twice"):
        EngineArgs(num_kvcache_blocks=8, num_gpu_blocks_override=8)
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['bogus'\]"):
        EngineArgs(bogus=1)


def test_engine_arguments_are_checked_when_given():
    """enable_prefix_caching='no' left prefix caching on (a truthy string), seed='x' failed in torch's
    manual_seed without naming the argument, and dtype / device / attention_backend names were only
    refused when the engine was built."""
    for kw, match in (({"enable_prefix_caching": "no"}, "enable_prefix_caching='no': must be True or False"),
                      ({"enforce_eager": "false"}, "enforce_eager='false'"),
                      ({"enable_chunked_prefill": 1}, "enable_chunked_prefill=1"),
                      ({"compile": "no"}, "compile='no'"), ({"seed": "x"}, r"seed='x': must be an int in \[0, 2\*\*32 - 1\]"),
                      ({"seed": True}, "seed=True"), ({"dtype": "bogus"}, "dtype='bogus': choose 'auto'"),
                      ({"device": "tpu"}, "device='tpu'"), ({"attention_backend": "nope"}, "attention_backend='nope'"),
                      # these three raised TypeErrors naming no argument (a comparison with a str, an unhashable
                      # list, Path(5) in the model's loader)
                      ({"gpu_memory_utilization": "0.5"}, r"gpu_memory_utilization='0.5': must be a number in \(0, 1\]"),
                      ({"gpu_memory_utilization": True}, "gpu_memory_utilization=True"),
                      ({"kv_cache_dtype": ["auto"]}, r"kv_cache_dtype=\['auto'\]: choose one of"),
                      ({"kv_cache_dtype": torch.bfloat16}, r"kv_cache_dtype=torch.bfloat16: .*as strings"),
                      ({"tokenizer": 5}, "tokenizer=5: must be a model name, a directory path or None"),
                      ({"model": 5}, "model=5: must be a model name")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(**kw)
    for kw in ({"dtype": "bf16"}, {"dtype": "float32"}, {"device": "cuda:1"}, {"device": "cpu"},
               {"attention_backend": "flash_attn"}, {"seed": None}, {"compile": None},
               {"gpu_memory_utilization": 1}, {"model": Path("some/dir")}, {"tokenizer": Path("some/dir")},
               {"gpu_memory_utilization": None}):  # None: vLLM's default, as its scripts' argparse defaults pass it
        EngineArgs(**kw)  # valid names; whether CUDA or flash-attn is there is the engine's question
    with pytest.raises(ValueError, match="ignore_eos='no': must be True or False"):
        SamplingParams(ignore_eos="no")  # it meant 'ignore eos'


def test_abort_request_names_a_bad_id(llm):
    """abort_request(None) and abort_request(1.5) raised 'object is not iterable'; abort_request(True) was
    taken as the id "True" (add_request refuses a bool id)."""
    engine = llm.llm_engine
    for bad in (None, 1.5, True):
        with pytest.raises(TypeError, match=rf"abort_request\({bad!r}\): give a request id"):
            engine.abort_request(bad)
    assert engine.abort_request(["nope", "none"]) is None


def test_stop_profile_says_why_the_trace_is_lost(tmp_path, monkeypatch):
    """A trace directory under a regular file: stop_profile raised NotADirectoryError, not the RuntimeError
    its docstring names."""
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    (tmp_path / "file").write_text("")
    llm = make_llm("minivllm-tiny", profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "file" / "x")})
    try:
        llm.start_profile()
        with pytest.raises(RuntimeError, match="trace directory .*file/x cannot be made .*the trace is lost"):
            llm.stop_profile()
        llm.start_profile()  # not left profiling
        with pytest.raises(RuntimeError):
            llm.stop_profile()
    finally:
        llm.shutdown()


def test_greedy_filter_reset_is_at_construction_and_on_the_engines_copy(llm):
    """The reset ran on every assignment (SamplingParams.__setattr__ validates again): p.top_k = 5 on a
    greedy object read back 0, and q.temperature = 0 then 0.7 lost q's top_k and top_p. As in vLLM, a later
    assignment is kept on the caller's object; the engine's own copy of a greedy request still drops them."""
    p = SamplingParams(temperature=0)
    p.top_k = 5
    assert p.top_k == 5
    q = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    q.temperature = 0
    q.temperature = 0.7
    assert (q.top_k, q.top_p) == (5, 0.9)
    p = SamplingParams(temperature=0, max_tokens=2, logprobs=4)
    p.top_k = 2
    alone = llm.generate([[5, 6, 7, 8]], [p], use_tqdm=False)[0].outputs[0]
    batched = llm.generate([[5, 6, 7, 8], [9, 10]], [p, SamplingParams(seed=0, max_tokens=2)],
                           use_tqdm=False)[0].outputs[0]
    assert [list(d) for d in alone.logprobs] == [list(d) for d in batched.logprobs]
    assert all(v.logprob > -1e9 for d in batched.logprobs for v in d.values())
    assert p.top_k == 2  # the caller's object is not changed by the engine


def test_vllm_spellings_of_engine_values():
    """enable_prefix_caching=None (vLLM's 'engine default'), device=torch.device("cpu"), numpy seeds and
    whole-float stop token ids were refused after this session's checks; vLLM's boolean flags
    (--disable-sliding-window, ...) and --cuda-graph-sizes 1 2 4 did not parse on a command line."""
    import torch

    from minivllm.utils.argparse_utils import FlexibleArgumentParser

    args = EngineArgs(enable_prefix_caching=None, enable_chunked_prefill=None, device=torch.device("cpu"),
                      seed=np.int64(3), max_logprobs=np.int32(5), max_num_seqs=np.int64(8))
    assert (args.enable_prefix_caching, args.enable_chunked_prefill, args.device) == (True, True, "cpu")
    assert (type(args.seed), type(args.max_logprobs), type(args.max_num_seqs)) == (int, int, int)
    assert SamplingParams(stop_token_ids=[2.0, np.float64(3.0)]).stop_token_ids == [2, 3]
    with pytest.raises(ValueError, match=r"element 0 \(2.5\)"):
        SamplingParams(stop_token_ids=[2.5])
    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--disable-sliding-window", "--disable-cascade-attn", "--no-enable-prompt-embeds", "--cuda-graph-sizes", "1", "2"])
    assert (ns.disable_sliding_window, ns.disable_cascade_attn, ns.enable_prompt_embeds, ns.cuda_graph_sizes) == (
        True, True, False, [1, 2])
    EngineArgs.from_cli_args(ns)


def test_int8_row_map_does_not_overflow():
    """A row holding +-2e38: (hi + lo) and (hi - lo) overflowed to inf in the C map, every output NaN."""
    from minivllm.quantization import Int8Weight
    from minivllm.quantization.int8 import cpu_int8_unavailable_reason

    if cpu_int8_unavailable_reason() is not None:
        pytest.skip(cpu_int8_unavailable_reason())
    import torch

    w = Int8Weight(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 1e-3, kernel="fbgemm-dynamic")
    x = torch.zeros(2, 8)
    x[0, 0], x[0, 1], x[1, 2] = 2e38, -2e38, 1.0
    y = w.matmul(x)
    ref = (x.double() @ w.dequantized().double().T)
    assert torch.isfinite(y).all() and float(((y.double() - ref).abs().max() / ref.abs().max())) < 0.05


def test_logprob_refusals_name_what_limits_them(llm, tiny_ckpt):
    """With max_logprobs=-1 a request above the vocabulary was told to give max_logprobs a larger value or -1;
    LLM.chat(tokenization_kwargs=[1]) raised "'list' object is not a mapping" (generate: a ValueError)."""
    unlimited = make_llm(tiny_ckpt, max_logprobs=-1)
    try:
        with pytest.raises(ValueError, match=r"logprobs=5000: requested sample logprobs of 5000, more than the "
                                             r"vocabulary's 97 tokens"):
            unlimited.generate([1, 2], SamplingParams(max_tokens=1, logprobs=5000), use_tqdm=False)
    finally:
        unlimited.shutdown()
    with pytest.raises(ValueError, match=r"tokenization_kwargs=\[1\]: must be a dict"):
        llm.chat(USER, SamplingParams(max_tokens=1), use_tqdm=False, tokenization_kwargs=[1])


def test_from_optional_and_vllms_integer_output_kinds():
    """SamplingParams.from_optional (vLLM's, for requests that leave fields unset) was missing, and
    RequestOutputKind(2), vLLM's integer value of FINAL_ONLY, was "not a valid OutputKind"."""
    from minivllm.sampling_params import RequestOutputKind

    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                     frequency_penalty=None, repetition_penalty=None, max_tokens=8, seed=3)
    assert p == SamplingParams(max_tokens=8, seed=3)
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None  # None keeps its meaning here
    # logit_bias clamped to [-100, 100] as vLLM 0.34's from_optional does (it was passed through: +1000 forced
    # the token); the constructor keeps any finite bias
    assert SamplingParams.from_optional(logit_bias={"5": 1000, 6: -500, 7: 2.5}).logit_bias == {5: 100.0, 6: -100.0,
                                                                                                 7: 2.5}
    assert SamplingParams(logit_bias={5: 1000}).logit_bias == {5: 1000.0}
    with pytest.raises(ValueError, match="top_k=None"):
        SamplingParams.from_optional(top_k=None)
    assert [RequestOutputKind(i) for i in (0, 1, 2)] == list(RequestOutputKind)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    for bad in (3, True):
        with pytest.raises(ValueError):
            RequestOutputKind(bad)


TEXT = "价格是 €5，中文 😀"  # characters of 2-4 UTF-8 bytes, split across the byte-level tokens


def test_logprobs_of_a_character_split_across_tokens_read_as_the_character(llm):
    """Every token holding part of a multi-byte character read U+FFFD in Logprob.decoded_token; vLLM's
    logprobs processor reads such a token as the character it completes with the tokens before it,
    or '' while the character is unfinished. (vLLM's prompt-logprobs context starts after the first
    prompt token; here it is the whole sequence, so a character begun by the first token is whole too.)"""
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # the case under test occurs
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    read = [out.prompt_logprobs[i][t].decoded_token for i, t in enumerate(ids) if i > 0]
    assert tok.decode(ids[:1]) == "\ufffd" and "".join(read) == TEXT  # (the first token: part of 价)
    # a generated token that completes a character the prompt began (the sampled logprobs' context)
    euro = tok.encode("€")
    assert len(euro) > 1
    c = llm.generate([[5] + euro[:-1]], SamplingParams(temperature=0, max_tokens=1, logprobs=0,
                                                       allowed_token_ids=[euro[-1]]), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [euro[-1]] and c.logprobs[0][euro[-1]].decoded_token == "€"


def test_a_space_before_a_split_character_stays_in_the_decoded_tokens(llm):
    """Token b' \xe2\x80' (a space, then the start of a curly quote) reads '' and b'\x9c' completes the
    quote: the completing token read only '“' (the context's space was taken as the context's own text),
    so the decoded tokens no longer joined to the text ' “'. vLLM gives the completing token the text of
    the tokens before it that read '' themselves (v1/engine/logprobs.py, _correct_decoded_token)."""
    tok = llm.get_tokenizer()
    lead, tail = next((a, b) for a in range(len(tok)) if tok.decode([a]) == " \ufffd"
                      for b in range(len(tok)) if tok.decode([a, b]) == " \u201c")
    assert tok.decode([tail]).endswith("\ufffd")
    c = llm.generate("He said", SamplingParams(max_tokens=2, temperature=0, logprobs=0, allowed_token_ids=[lead, tail]),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [lead, tail], c.token_ids  # the embedded model's greedy choice between the two
    read = [d[t].decoded_token for d, t in zip(c.logprobs, c.token_ids)]
    assert read == ["", " \u201c"] and "".join(read) == c.text
    prompt = llm.generate({"prompt_token_ids": [5, lead, tail]}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0].prompt_logprobs
    assert [prompt[i][t].decoded_token for i, t in ((1, lead), (2, tail))] == ["", " \u201c"]
    # the prompt ends with the space and the quote's first bytes: the completion's text is the quote alone,
    # and so is the token that completes it (the prompt's space is the prompt's)
    c = llm.generate({"prompt_token_ids": [5, lead]}, SamplingParams(max_tokens=1, temperature=0, logprobs=0,
                                                                        allowed_token_ids=[tail]),
                     use_tqdm=False)[0].outputs[0]
    assert c.text == "\u201c" and c.logprobs[0][tail].decoded_token == "\u201c"


@pytest.mark.parametrize("byte_level_table", [True, False])
def test_split_character_reads_the_same_on_both_detokenizer_paths(llm, byte_level_table):
    from minivllm.engine.detokenizer import IncrementalDetokenizer
    from minivllm.engine.output_processor import logprob_dicts

    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT)
    det = IncrementalDetokenizer(tok, [])
    if not byte_level_table:  # the general path: windows of tokenizer.decode
        det.table, det.num_known_ids = None, len(tok)
    entries = [None] + [([t], [0.0], [1]) for t in ids[1:]]
    read = [d[t].decoded_token for d, t in zip(logprob_dicts(entries, det, ids)[1:], ids[1:])]
    assert tok.decode(ids[:1]) == "\ufffd" and "".join(read) == TEXT  # (the first token: part of 价)
    assert read[-1] == "😀" and "" in read


def test_split_characters_read_the_same_in_delta_and_cumulative_outputs(llm):
    """A delta output's logprobs start at its first new token: their context must still be the whole
    sequence before each token, not the tokens from the prompt's end (n=2 children, a prompt that ends
    inside a character, tokens drawn from byte tokens only)."""
    from minivllm.sampling_params import RequestOutputKind

    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT)
    byte_tokens = sorted({t for t in ids if tok.decode([t]).endswith("\ufffd")})
    engine = llm.llm_engine
    seen = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=2, n=2,
                                allowed_token_ids=byte_tokens, output_kind=kind)
        engine.add_request(kind.name, {"prompt_token_ids": ids[:-2]}, params)
        got = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    if kind is RequestOutputKind.DELTA:
                        got.setdefault(c.index, []).extend(c.logprobs or [])
                    else:
                        got[c.index] = list(c.logprobs)
        seen[kind] = {i: [[(t, p.decoded_token) for t, p in d.items()] for d in v] for i, v in got.items()}
    assert seen[RequestOutputKind.DELTA] == seen[RequestOutputKind.CUMULATIVE]
    assert any(text not in ("", "\ufffd") and len(text) == 1 and ord(text) > 127
               for v in seen[RequestOutputKind.CUMULATIVE].values() for d in v for _, text in d)


def test_chat_names_bad_tools_and_an_empty_conversation(llm):
    """tools="x" and an empty conversation failed inside transformers' template code, naming neither the
    argument nor the conversation."""
    conv = [{"role": "user", "content": "hi"}]
    for bad in ("x", {"type": "function"}, [5]):
        with pytest.raises(ValueError, match=re.escape(f"tools={bad!r}: must be a list of tool")):
            llm.chat(conv, SamplingParams(max_tokens=1), tools=bad, use_tqdm=False)
    with pytest.raises(ValueError, match="conversation 1: empty"):
        llm.chat([conv, []], SamplingParams(max_tokens=1), use_tqdm=False)

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: its name.
        """

    # transformers builds a function's schema: a Python function is a tool too
    assert llm.chat(conv, SamplingParams(max_tokens=1), tools=[get_weather], use_tqdm=False)[0].outputs
    assert not llm.llm_engine.has_unfinished_requests()


def test_delta_outputs_after_the_first_carry_an_empty_prompt_logprobs_list(llm):
    # they carried None, as if the request had asked for no prompt logprobs; vLLM 0.34's later deltas carry []
    from minivllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    for n in (1, 2):
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True, prompt_logprobs=1, n=n,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(f"delta-{n}", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        seen = {}  # sample index -> its outputs' prompt_logprobs (each sample's first delta carries them, as in vLLM)
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen.setdefault(out.outputs[0].index, []).append(out.prompt_logprobs)
        assert sorted(seen) == list(range(n))
        for first, *later in seen.values():
            assert len(first) == 4 and first[0] is None and later and all(p == [] for p in later), (n, seen)
        # without prompt logprobs: None throughout
        engine.add_request(f"plain-{n}", [5, 6, 7, 8], SamplingParams(max_tokens=2, n=n, seed=1, temperature=0.8,
                                                                       output_kind=RequestOutputKind.DELTA))
        while engine.has_unfinished_requests():
            assert all(out.prompt_logprobs is None for out in engine.step())


def test_engine_add_request_returns_the_id_to_abort_by(llm):
    # it returned None; vLLM 0.34's returns the request's id (with a random suffix there), for abort_request
    engine = llm.llm_engine
    rid = engine.add_request(7, [5, 6, 7], SamplingParams(max_tokens=4))
    assert rid == "7" and rid in engine.requests
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.add_request("two", [5, 6], SamplingParams(max_tokens=2, n=2, temperature=1.0, seed=0)) == "two"
    engine.abort_request("two")
