"""vLLM's SamplingParams options beyond the classic five: validation, semantics against
direct implementations, stop semantics, streaming, and the untouched greedy fast path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers_engine import generate_spying_logits, greedy, make_llm, prompts_of
from minivllm import SamplingParams
from minivllm.engine.output_processor import find_stop
from minivllm.layers.logits_processors import banned_by_bad_words

PROMPT = prompts_of([7], seed=5)[0]


def G(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **{"ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    yield llm
    llm.shutdown()


def run(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", "1"),
    ("min_tokens", -1), ("min_tokens", 17), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("nan")}),
    ("logit_bias", [1, 2]), ("allowed_token_ids", []), ("allowed_token_ids", [1, -2]), ("bad_words", ["ok", ""]),
    ("bad_words", "word"), ("include_stop_str_in_output", 1), ("skip_special_tokens", None),
    ("spaces_between_special_tokens", "no"), ("detokenize", 0), ("max_tokens", 0), ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2), ("logprobs", -2), ("prompt_logprobs", 1.5), ("n", 0),
])
def test_each_new_field_is_validated_by_name(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_token_ids_outside_the_vocabulary_are_refused_by_name(llm):
    for field, value in (("logit_bias", {97: 1.0}), ("allowed_token_ids", [3, 97])):
        with pytest.raises(ValueError, match=f"{field}=.*token id 97"):
            llm.generate(PROMPT, SamplingParams(**{field: value}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_frequency_and_presence_penalties_follow_openai(llm):
    params = G(12, frequency_penalty=1.3, presence_penalty=0.7)
    completion, rows = generate_spying_logits(llm, PROMPT, params)
    tokens = completion.token_ids
    for step, logits in enumerate(rows):
        counts = torch.bincount(torch.tensor(tokens[:step], dtype=torch.long), minlength=logits.numel()).float()
        expected = logits - counts * 1.3 - (counts > 0).float() * 0.7  # OpenAI's formula, output tokens only
        assert tokens[step] == int(expected.argmax()), f"step {step}"
    assert tokens != run(llm, G(12)).token_ids  # the penalties changed something


def test_logit_bias_and_allowed_token_ids(llm):
    assert set(run(llm, G(6, logit_bias={7: 100.0})).token_ids) == {7}
    allowed = [3, 11, 40]
    out = run(llm, SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1


def test_logit_bias_is_added_as_given_and_minus_inf_bans(tiny_ckpt, llm):
    # it was clamped to [-100, 100] (OpenAI's server rule, not vLLM's LLM) and -inf was refused
    plain = run(llm, G(1)).token_ids[0]
    assert run(llm, G(1, logit_bias={plain: float("-inf")})).token_ids[0] != plain
    seen = make_llm(tiny_ckpt, logprobs_mode="processed_logits")
    c, rows = generate_spying_logits(seen, PROMPT, G(1, logprobs=0, logit_bias={7: 500.0}))
    assert c.token_ids == [7] and c.logprobs[0][7].logprob == pytest.approx(float(rows[0][7]) + 500.0, abs=1e-3)
    seen.shutdown()
    for bad in (float("inf"), float("nan"), 1e39, 10**400):  # 1e39 is +inf in float32 logits
        with pytest.raises(ValueError, match=r"logit_bias=.*not a number up to float32's largest"):
            SamplingParams(logit_bias={7: bad})
    assert SamplingParams(logit_bias={7: -10**400}).logit_bias == {7: float("-inf")}


def test_min_tokens_masks_stop_tokens_until_reached(llm):
    plain = run(llm, G(10)).token_ids
    stop_id = plain[1]
    assert run(llm, G(10, stop_token_ids=[stop_id])).token_ids == plain[:2]
    got = run(llm, G(10, stop_token_ids=[stop_id], min_tokens=6))
    assert len(got.token_ids) >= 6 and stop_id not in got.token_ids[:6]
    eos_llm_out = run(llm, SamplingParams(temperature=0, max_tokens=10, min_tokens=10, logit_bias={0: 50.0}))
    assert len(eos_llm_out.token_ids) == 10 and 0 not in eos_llm_out.token_ids  # eos id 0 masked, never ends early


@pytest.mark.parametrize("options", [
    dict(temperature=0, allowed_token_ids=[5], stop_token_ids=[5], min_tokens=3),
    dict(temperature=0.8, seed=3, allowed_token_ids=[5], stop_token_ids=[5], min_tokens=3),
    dict(temperature=0.8, seed=3, top_k=5, allowed_token_ids=[5], stop_token_ids=[5], min_tokens=3),
    dict(temperature=0.8, seed=3, repetition_penalty=1e-300),  # 0 in fp32: a division by zero
    dict(temperature=0, repetition_penalty=1e-300, logprobs=2),
    dict(temperature=0.01, seed=3, repetition_penalty=1e-37),  # finite until divided by the temperature
    dict(temperature=0.01, seed=3, top_k=3, repetition_penalty=1e-37),
], ids=["greedy-all-masked", "sampled-all-masked", "top-k-all-masked", "penalty-zero", "greedy-penalty-zero",
        "temperature-overflow", "top-k-temperature-overflow"])
def test_a_row_its_own_options_leave_nothing_to_draw_fails_by_name(llm, options):
    """Every token masked by the request's own options (or a penalty overflowing a logit) gave
    token 0 and finish_reason "stop" (the argmax of nothing); now the request ends with an
    error naming the cause, and its neighbour in the batch is served."""
    engine = llm.llm_engine
    engine.add_request("fine", PROMPT, G(4))
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, **options),
                       output_kind="final_only")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    bad = final["bad"].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "no token could be sampled" in final["bad"].error
    assert len(final["fine"].outputs[0].token_ids) == 4 and final["fine"].outputs[0].finish_reason == "length"


def test_vllm_spellings_normalised_as_vllm_does():
    """seed=-1 is no seed, logprobs=True one top token, stop and bad_words lists ([] for None):
    vLLM's SamplingParams.__post_init__ does the same, and scripts rely on it (iterating or
    appending to params.stop). Before: seed -1 was a fixed seed, True refused, stop kept as given."""
    params = SamplingParams(seed=-1, logprobs=True, prompt_logprobs=True, stop="\n")
    assert params.seed is None and params.logprobs == 1 and params.prompt_logprobs == 1
    # False passes vLLM's check (>= 0) and counts as 0: the sampled token's logprob alone; it was refused here
    off = SamplingParams(logprobs=False, prompt_logprobs=False)
    assert type(off.logprobs) is int and (off.logprobs, off.prompt_logprobs) == (0, 0)
    assert params.stop == ["\n"] and params.stop_strings == ["\n"]
    bare = SamplingParams()
    assert bare.stop == [] and bare.bad_words == [] and bare.stop_token_ids == []
    bare.stop.append("x")  # a vLLM script's habit; the stop strings follow
    assert bare.stop_strings == ["x"]
    bare.seed = -1
    assert bare.seed is None
    bare.stop = "END"
    assert bare.stop == ["END"] and bare.max_stop_len == 3


def test_a_temperature_too_small_to_divide_by_becomes_vllms_floor(llm, caplog):
    """temperature=1e-38 overflowed the scaled logits to inf and every request came back as token 0 (an
    eos) with finish_reason "stop"; vLLM raises a temperature in (0, 0.01) to 0.01 with a warning."""
    import logging

    with caplog.at_level(logging.WARNING, logger="minivllm"):
        params = SamplingParams(temperature=1e-38, max_tokens=6, seed=3, ignore_eos=True)
    assert params.temperature == 0.01 and "temperature=1e-38" in caplog.text
    floor = run(llm, SamplingParams(temperature=0.01, max_tokens=6, seed=3, ignore_eos=True))
    assert run(llm, params).token_ids == floor.token_ids and floor.token_ids != [0] * 6
    params.temperature = 1e-30  # assigned later, as generate.py does: the same rule
    assert params.temperature == 0.01
    assert SamplingParams(temperature=0.02).temperature == 0.02 and SamplingParams(temperature=0).temperature == 0


def test_eos_listed_in_stop_token_ids_reads_as_eos(llm):
    """vLLM checks eos before stop_token_ids: an eos that is also listed ends the request with
    stop_reason None, and only with ignore_eos does it count as a stop token (the eos, id 0, forced
    by a logit bias)."""
    out = run(llm, SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[0], logit_bias={0: 50.0}))
    assert out.token_ids == [0] and out.finish_reason == "stop" and out.stop_reason is None
    out = run(llm, G(4, stop_token_ids=[0], logit_bias={0: 50.0}))  # ignore_eos=True
    assert out.token_ids == [0] and out.finish_reason == "stop" and out.stop_reason == 0


def test_bad_words(llm):
    tok = llm.tokenizer
    plain = run(llm, G(10)).token_ids
    word_id = next(t for t in plain if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    got = run(llm, G(10, bad_words=[tok.decode([word_id])])).token_ids
    assert word_id not in got
    assert banned_by_bad_words([[5], [1, 2, 3], [9, 4]], [7, 1, 2]) == [5, 3]


def test_bad_words_variant_after_a_space_follows_vllms_rule(embedded):
    """vLLM bans " word" too only where it is as many tokens as "word" with another first token; it was
    banned whatever its tokenization ("getitem": [1616] alone, " getitem" three tokens, also banned)."""
    tok, engine = embedded.tokenizer, embedded.llm_engine
    for word in ("getitem", "module", "xyzzy", " list"):
        bare = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
        assert engine._bad_words_token_ids([word]) == want, word
    getitem = tok.encode(" getitem", add_special_tokens=False)
    assert len(getitem) != len(tok.encode("getitem", add_special_tokens=False))  # the case the rule leaves out


def test_stop_token_text_is_left_out_and_stop_strings_earliest_completing_wins(llm):
    tok = llm.tokenizer
    plain = run(llm, G(8))
    stop_id = plain.token_ids[3]
    first = plain.token_ids.index(stop_id)
    out = run(llm, G(8, stop_token_ids=[stop_id]))
    assert out.token_ids == plain.token_ids[:first + 1] and out.stop_reason == stop_id
    assert out.text == tok.decode(plain.token_ids[:first])  # vLLM: the stop token's text is not in text
    assert find_stop("abc", ["abc", "b"], 0) == (1, "b")    # 'b' completes first
    assert find_stop("xabc", ["bc", "abc"], 0) == (2, "bc")  # same end: list order
    assert find_stop("abc", ["zz"], 0) is None


def test_include_stop_str_in_output(llm):
    plain = run(llm, G(10)).text
    stop = plain[3:5]
    cut = plain.index(stop)
    assert run(llm, G(10, stop=[stop])).text == plain[:cut]
    out = run(llm, G(10, stop=[stop], include_stop_str_in_output=True))
    assert out.text == plain[:cut + len(stop)] and out.stop_reason == stop


def test_special_tokens_detokenize_and_max_tokens_none(tiny_ckpt, llm):
    forced = dict(logit_bias={0: 100.0})  # token 0 is <|endoftext|> (special)
    assert run(llm, G(3, **forced)).text == ""
    assert run(llm, G(3, skip_special_tokens=False, **forced)).text == "<|endoftext|>" * 3
    out = run(llm, G(5, detokenize=False))
    assert out.text == "" and len(out.token_ids) == 5
    small = make_llm(tiny_ckpt, max_model_len=16)
    out = small.generate(prompts_of([10])[0], G(None), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    small.shutdown()


def test_min_tokens_beyond_the_room_max_tokens_none_leaves_is_refused(tiny_ckpt):
    """max_tokens=None generates up to max_model_len: a min_tokens above that room was accepted and
    silently not met (finish_reason "length"); vLLM's input processor refuses it."""
    small = make_llm(tiny_ckpt, max_model_len=16)
    try:
        prompt = prompts_of([10])[0]
        with pytest.raises(ValueError, match=r"min_tokens=7 with max_tokens=None: a 10-token prompt leaves room for 6"
                                             r".* or a max_model_len of at least 17\)$"):
            small.generate([prompts_of([3])[0], prompt], G(None, min_tokens=7), use_tqdm=False)
        assert not small.llm_engine.has_unfinished_requests()  # the batch was refused before any was queued
        with pytest.raises(ValueError, match="min_tokens=7"):
            small.llm_engine.add_request("r", prompt, G(None, min_tokens=7))
        out = small.generate(prompt, G(None, min_tokens=6), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6
    finally:
        small.shutdown()


def test_truncate_prompt_tokens_above_max_model_len_is_refused_for_any_prompt(tiny_ckpt):
    """vLLM refuses truncate_prompt_tokens > max_model_len whatever the prompt's length; a short
    prompt let it through here."""
    small = make_llm(tiny_ckpt, max_model_len=16)
    try:
        for how in (dict(sampling=G(2, truncate_prompt_tokens=5000)),
                    dict(sampling=G(2), tokenization_kwargs={"truncate_prompt_tokens": 5000})):
            with pytest.raises(ValueError, match=r"truncate_prompt_tokens=5000 is more than max_model_len=16"):
                small.generate(prompts_of([3])[0], how["sampling"], use_tqdm=False,
                               **({"tokenization_kwargs": how["tokenization_kwargs"]}
                                  if "tokenization_kwargs" in how else {}))
    finally:
        small.shutdown()


def test_truncate_prompt_tokens(tiny_ckpt, llm):
    long = prompts_of([30])[0]
    out = llm.generate(long, G(2, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-5:]
    assert out.outputs[0].token_ids == run(llm, G(2), long[-5:]).token_ids
    small = make_llm(tiny_ckpt, max_model_len=16)
    assert small.generate(long, G(1, truncate_prompt_tokens=-1), use_tqdm=False)[0].prompt_token_ids == long[-15:]
    small.shutdown()


def test_no_replacement_character_between_a_token_id_prompt_and_the_output():
    from transformers import AutoTokenizer

    from minivllm.engine.detokenizer import IncrementalDetokenizer, byte_table
    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    table = byte_table(tok)
    lead, cont = (table.index(bytes([b])) for b in "é".encode())
    detok = IncrementalDetokenizer(tok, tok.encode("caf") + [lead])
    assert detok.step([cont]) + detok.step(tok.encode(" ok"), final=True) == "é ok"


STREAM_CASES = [
    G(10, stop=["e"], include_stop_str_in_output=True),
    G(10, min_tokens=4, frequency_penalty=0.5, presence_penalty=-0.5),
    SamplingParams(temperature=0.8, seed=3, max_tokens=9, logit_bias={5: 3.0}, bad_words=["a"]),
    G(6, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=1.0, seed=4, max_tokens=7, allowed_token_ids=[3, 4, 5, 6], ignore_eos=True),
    G(5, detokenize=False, truncate_prompt_tokens=3),
    G(4, skip_special_tokens=False, logit_bias={0: 100.0}),
    G(None, min_tokens=2, stop_token_ids=[9]),
]


def test_streaming_honours_every_option(llm):
    prompts = [prompts_of([6], seed=20 + i)[0] for i in range(len(STREAM_CASES))]
    final = llm.generate(prompts, STREAM_CASES, use_tqdm=False)
    joined = {}
    for d in llm.stream(prompts, STREAM_CASES):
        j = joined.setdefault(d.request_id, {"text": "", "ids": [], "lp": [], "plp": None, "reason": None})
        c = d.outputs[0]
        j["text"] += c.text
        j["ids"] += c.token_ids
        j["lp"] += c.logprobs or []
        if d.prompt_logprobs:
            assert j["plp"] is None, "prompt logprobs are sent once in delta mode"
            j["plp"] = d.prompt_logprobs
        elif d.prompt_logprobs is not None:  # the later deltas: [], as vLLM 0.34's
            assert d.prompt_logprobs == [] and j["plp"] is not None
        j["reason"] = (c.finish_reason, c.stop_reason)
    for out, j in zip(final, [joined[k] for k in sorted(joined, key=int)]):
        c = out.outputs[0]
        assert (j["text"], j["ids"], j["reason"]) == (c.text, c.token_ids, (c.finish_reason, c.stop_reason))
        assert j["lp"] == (c.logprobs or []) and j["plp"] == out.prompt_logprobs


def test_plain_requests_keep_the_greedy_fast_path(llm):
    runner = llm.llm_engine.runner
    from minivllm.engine.sequence import Sequence

    plain = [Sequence(str(i), None, [1, 2], G(3)) for i in range(3)]
    batch = runner.sampling_batch(plain)
    assert batch.all_greedy and batch.temperatures is None and batch.processing is None
    mixed = plain[:1] + [Sequence("b", None, [1, 2], G(3, logit_bias={4: 1.0}))]
    batch = runner.sampling_batch(mixed)
    assert batch.processing[0] is None and batch.processing[1] is not None and batch.num_logprobs is None


def test_fields_set_after_construction_are_validated_and_take_effect(llm):
    params = G(6)
    params.temperature, params.seed = 1.0, 11  # vLLM's generate.py sets fields on the defaults
    params.logit_bias = {9: 100.0}
    assert not params.plain_greedy and params.has_logits_processors
    assert set(run(llm, params).token_ids) == {9}
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p=3"):
        params.top_p = 3
    assert params.top_p == 1.0


def test_spaces_between_special_tokens_reaches_a_slow_tokenizers_decode():
    from minivllm.engine.detokenizer import IncrementalDetokenizer

    class SlowTokenizer:  # no backend_tokenizer: the general path, as for slow tokenizers
        def __init__(self):
            self.calls = []

        def __len__(self):
            return 10

        def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
            self.calls.append(spaces_between_special_tokens)
            return ("<s>" if spaces_between_special_tokens else "<S>") * len(ids)

    tok = SlowTokenizer()
    detok = IncrementalDetokenizer(tok, [1], spaces_between_special_tokens=False)
    assert detok.step([2, 3], final=True) == "<S><S>" and set(tok.calls) == {False}


def test_stop_strings_completing_in_one_token_earliest_end_wins(text_ckpt):
    """The issue's case: one token ' the' and stop=[' the', 'h']: 'h' completes first."""
    llm = make_llm(text_ckpt)
    the = llm.tokenizer.encode(" the")
    assert len(the) == 1
    params = G(3, logit_bias={the[0]: 100.0}, stop=[" the", "h"])
    out = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.stop_reason, out.finish_reason) == (" t", "h", "stop")
    for stop, expected in ((["e", "th"], (" ", "th")),    # 'th' ends before 'e'
                           (["he", "e"], (" t", "he")),   # the same end: list order
                           (["e", "he"], (" th", "e"))):
        out = llm.generate("x", G(3, logit_bias={the[0]: 100.0}, stop=stop), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.stop_reason) == expected, stop
    llm.shutdown()


def test_a_request_keeps_the_parameters_it_was_added_with():
    """The engine copies a request's SamplingParams when it is added (as vLLM does): the stop rule
    it fixes then (stop ids, end length) and what the sampler reads stay consistent when the
    caller changes the object later. Before the copy, a stop token removed from the object after
    admission still ended the request, reported as an eos (stop_reason None)."""
    from minivllm import LLM

    llm = LLM("minivllm-tiny", enforce_eager=True)  # its greedy tokens here do not repeat early
    engine = llm.llm_engine
    prompt = prompts_of([7], seed=3)[0]
    reference = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(reference) if i >= 4 and t not in reference[:i])  # first seen late
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    engine.add_request("kept", prompt, params, output_kind="final_only")
    engine.step()
    engine.step()
    params.stop_token_ids, params.max_tokens, params.temperature = [], 3, 0.9  # after admission
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    out = final["kept"]
    first = reference.index(stop)
    assert out.token_ids == reference[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    engine.add_request("after", prompt, params, output_kind="final_only")  # the change applies from now on
    while engine.has_unfinished_requests():
        final.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert len(final["after"].token_ids) == 3 and final["after"].finish_reason == "length"


def test_clone_copies_every_list_and_dict_and_keeps_the_derived_fields():
    """``SamplingParams.clone`` (the engine copies each request's parameters with it) is
    independent of the original for every container field, and keeps what __post_init__ derived;
    an attribute deepcopy could not copy (a lock) does not stop it."""
    import threading

    params = SamplingParams(temperature=0.7, stop=["a", "b"], stop_token_ids=[3], logit_bias={1: 2.0},
                            allowed_token_ids=[1, 2, 3], bad_words=["x"], seed=4)
    params.note = threading.Lock()
    twin = params.clone()
    assert twin == params and twin.draws_random and not twin.plain_greedy and twin.stop_strings == ["a", "b"]
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "stop_strings"):
        assert getattr(twin, name) is not getattr(params, name), name
    params.stop_token_ids.append(9)
    params.logit_bias[5] = 1.0
    assert twin.stop_token_ids == [3] and twin.logit_bias == {1: 2.0}
    twin.max_tokens = 3  # still validated on assignment
    assert params.max_tokens == 16
    with pytest.raises(ValueError, match="max_tokens"):
        twin.max_tokens = 0


def test_a_sampler_put_in_the_stock_ones_place_sees_greedy_batches_too(tiny_ckpt):
    """Plain greedy CPU batches skip the sampler call (numpy fast path), but only the stock
    Sampler's: a callable a caller puts in its place (a notebook's logits tap) is called every
    step, and its tokens are the ones emitted."""
    llm = make_llm(tiny_ckpt)
    runner = llm.llm_engine.runner
    stock, seen = runner.sampler, []

    def tap(logits, batch):
        seen.append(logits.shape[0])
        return stock(logits, batch)

    want = llm.generate(prompts_of([5, 7]), greedy(4), use_tqdm=False)
    runner.sampler = tap
    got = llm.generate(prompts_of([5, 7]), greedy(4), use_tqdm=False)
    assert len(seen) >= 4 and [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    runner.sampler = lambda logits, batch: torch.full((logits.shape[0],), 3, dtype=torch.long)
    assert all(o.outputs[0].token_ids == [3, 3] for o in llm.generate(prompts_of([4, 6]), greedy(2), use_tqdm=False))
    llm.shutdown()


def test_stop_strings_can_still_be_assigned_and_is_validated():
    params = SamplingParams()
    params.stop_strings = ["END"]
    assert params.stop == ["END"]
    with pytest.raises(ValueError, match="SamplingParams.stop="):
        params.stop_strings = [""]
    assert params.stop == ["END"]


@pytest.fixture(scope="module")
def embedded():
    from minivllm import LLM

    llm = LLM(num_kvcache_blocks=64)
    yield llm
    llm.shutdown()


def test_min_tokens_masks_eos_with_ignore_eos_too(embedded):
    """vLLM masks eos during the first min_tokens tokens whatever ignore_eos says (its
    all_stop_token_ids always hold eos); minivllm masked it only without ignore_eos."""
    eos = min(embedded.llm_engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=3, min_tokens=2, ignore_eos=True, logit_bias={eos: 100.0})
    ids = embedded.generate("The list type", params, use_tqdm=False)[0].outputs[0].token_ids
    assert eos not in ids[:2] and ids[2] == eos


def test_a_stop_string_may_start_in_the_min_tokens_text(embedded):
    """As vLLM: no stop string may end in the first min_tokens tokens' text, but one that starts there
    and ends after it stops the request (minivllm looked only past that text)."""
    plain = embedded.generate("The list type", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    first = plain.outputs[0].text[:len(embedded.get_tokenizer().decode(plain.outputs[0].token_ids[:1]))]
    rest = plain.outputs[0].text[len(first):]
    stop = first[-2:] + rest[:2]  # across the first token's end
    out = embedded.generate("The list type", SamplingParams(temperature=0, max_tokens=4, min_tokens=1, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, first[:-2])
    inside = SamplingParams(temperature=0, max_tokens=4, min_tokens=1, stop=[first[-2:]])  # ends in it: ignored
    assert embedded.generate("The list type", inside, use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("k", [0, -3, 2.5, True])
def test_encode_prompt_refuses_a_truncation_generate_would_refuse(llm, k):
    """``LLMEngine.encode_prompt`` is public: called directly, k=0 kept the whole prompt, k=-3
    returned an empty prompt (the empty check ran before the truncation), 2.5 failed in slicing."""
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens={k!r}: must be an int >= 1, -1"):
        llm.llm_engine.encode_prompt(prompts_of([30])[0], truncate_prompt_tokens=k)
    assert llm.llm_engine.encode_prompt(prompts_of([30])[0], truncate_prompt_tokens=np.int64(4))[1] == \
        prompts_of([30])[0][-4:]
