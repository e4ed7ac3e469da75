"""Bad input raises a ValueError naming the field and value, and the engine keeps serving afterwards."""
from __future__ import annotations

import logging

import pytest
from safetensors import SafetensorError

from helpers_engine import greedy, make_llm, prompts_of, run_to_end
from helpers_models import make_hf_checkpoint
from minivllm import LLM, SamplingParams
from minivllm.utils.loader import load_weights


def assert_still_serving(llm) -> None:
    """Nothing was left queued by the failed call, and a new request runs to the end."""
    engine = llm.llm_engine
    assert engine.get_num_unfinished_requests() == 0
    out = llm.generate(prompts_of([5], seed=1)[0], greedy(3), use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 3


# -- SamplingParams --------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,shown", [
    ("stop", 5, "5"),
    ("stop", 2.5, "2.5"),
    ("stop", b"END", "b'END'"),
    ("stop", {"END"}, "{'END'}"),
    ("stop", ["END", 5], "5"),
    ("stop", ["END", None], "None"),
    ("stop", ["END", ""], "''"),
    ("stop_token_ids", 5, "5"),
    ("stop_token_ids", [1, 2.5], "2.5"),  # (a whole float, 2.0, is the id 2, as vLLM takes it)
    ("stop_token_ids", [1, True], "True"),
])
def test_malformed_stop_names_field_and_value(field, value, shown):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}=" in str(err.value) and shown in str(err.value)


def test_well_formed_stop_forms():
    assert SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]
    assert SamplingParams(stop=None).stop_strings == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


# -- stop_token_ids against the model --------------------------------------------------------
def test_stop_token_id_outside_vocabulary(tiny_ckpt):
    llm = make_llm(tiny_ckpt)  # vocabulary of 97
    prompt = prompts_of([5], seed=2)[0]
    with pytest.raises(ValueError, match=r"stop_token_ids=\[3, 97\].*97.*\[0, 97\)"):
        llm.generate(prompt, greedy(3, stop_token_ids=[3, 97]), use_tqdm=False)
    assert_still_serving(llm)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("bad", prompt, greedy(3, stop_token_ids=[10**6]))
    engine.add_request("good", prompt, greedy(3))
    final, _ = run_to_end(engine)
    assert set(final) == {"good"} and len(final["good"].outputs[0].token_ids) == 3


def test_bad_params_of_a_later_prompt_queue_nothing(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    prompts = prompts_of([4, 6], seed=3)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(prompts, [greedy(3), greedy(3, stop_token_ids=[500])], use_tqdm=False)
    assert_still_serving(llm)


@pytest.mark.parametrize("change,field", [
    (lambda p: p.stop.append(5), "stop"),
    (lambda p: p.allowed_token_ids.append(-5), "allowed_token_ids"),
    (lambda p: p.allowed_token_ids.clear(), "allowed_token_ids"),
    (lambda p: p.logit_bias.update({5: "x"}), "logit_bias"),
])
def test_parameters_changed_in_place_after_construction_are_checked_when_added(tiny_ckpt, change, field):
    """A list or dict changed in place escapes SamplingParams' assignment checks: the request
    was queued and then every later step raised (or an id of -5 meant the vocabulary's last)."""
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    prompt = prompts_of([5], seed=2)[0]
    engine.add_request("running", prompt, greedy(4))
    engine.step()
    params = greedy(3, stop=["END"], allowed_token_ids=[3, 4], logit_bias={3: 1.0})
    change(params)
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        engine.add_request("bad", prompt, params)
    final, _ = run_to_end(engine)
    assert set(final) == {"running"} and len(final["running"].outputs[0].token_ids) == 4
    assert_still_serving(llm)


def test_generate_names_the_prompt_whose_parameters_were_changed_in_place(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    bad = greedy(3, allowed_token_ids=[3, 4])
    bad.allowed_token_ids.append(-5)
    with pytest.raises(ValueError, match=r"prompt 1: SamplingParams.allowed_token_ids="):
        llm.generate(prompts_of([4, 6], seed=3), [greedy(3), bad], use_tqdm=False)
    assert_still_serving(llm)


# -- token-id prompts with non-int elements ----------------------------------------------------
@pytest.mark.parametrize("prompt,index,shown", [
    ([5, 2.0, 7], 1, "2.0"),
    ([5, True], 1, "True"),
    ((False, 5), 0, "False"),
    ([5, "7"], 1, "'7'"),
    ([5, [7]], 1, "[7]"),
])
def test_mixed_token_id_prompt_is_one_malformed_prompt(tiny_ckpt, prompt, index, shown):
    llm = make_llm(tiny_ckpt)
    with pytest.raises(ValueError) as err:
        llm.generate(prompt, greedy(3), use_tqdm=False)
    assert f"element {index} is {shown}" in str(err.value)
    with pytest.raises(ValueError, match=f"element {index} is"):
        list(llm.stream(prompt, greedy(3)))
    assert_still_serving(llm)


def test_lists_of_prompts_still_accepted(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    a, b = prompts_of([4, 6], seed=4)
    outs = llm.generate([a, {"prompt_token_ids": b}], greedy(2), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [a, b]


# -- prompts longer than the tokenizer's model_max_length -----------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_long_text_prompt_gets_our_error_without_the_tokenizer_warning(text_ckpt):
    llm = make_llm(text_ckpt, max_model_len=256)
    tok = llm.get_tokenizer()
    text = "hello world " * (tok.model_max_length // 2 + 50)
    # transformers logs to its own "transformers" logger, which does not propagate to
    # the root (so pytest's caplog cannot see it): listen there.
    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        with pytest.raises(ValueError, match=r"prompt of \d+ tokens leaves no room to generate: max_model_len=256 "
                                             r"\(keep its last tokens with SamplingParams\(truncate_prompt_tokens=N\)"):
            llm.generate(text, greedy(3), use_tqdm=False)
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not [m for m in records.messages if "sequence length" in m], records.messages
    assert len(tok.encode(text, verbose=False)) > tok.model_max_length  # the case this test is about
    assert_still_serving(llm)


@pytest.mark.parametrize("engine_args,hint", [
    # the KV pool capped max_model_len: a larger max_model_len alone would be refused at start-up
    (dict(num_kvcache_blocks=4, block_size=16), r"or a larger KV pool \(num_kvcache_blocks>=5\)\)$"),
    (dict(max_model_len=32, num_kvcache_blocks=8, block_size=16), r"or a max_model_len of at least 71\)$"),
    (dict(max_model_len=64, num_kvcache_blocks=4, block_size=16),
     r"or a max_model_len of at least 71 and a larger KV pool \(num_kvcache_blocks>=5\)\)$"),
    (dict(kv_cache_memory_bytes=4 * 16 * 512, num_kvcache_blocks=None, block_size=16),  # 4 blocks of 16 x 512 B
     r"or a larger KV pool \(kv_cache_memory_bytes>=\d+ \([\d.]+ MiB\) or num_kvcache_blocks>=5\)\)$"),
])
def test_a_prompt_too_long_names_what_lengthens_max_model_len(tiny_ckpt, engine_args, hint):
    llm = make_llm(tiny_ckpt, **engine_args)
    with pytest.raises(ValueError, match=r"prompt of 70 tokens leaves no room to generate: .*" + hint):
        llm.generate(prompts_of([70], seed=0)[0], greedy(3), use_tqdm=False)
    assert_still_serving(llm)


# -- corrupt or truncated checkpoints ---------------------------------------------------------
def _corrupt(path, how: str) -> None:
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[:len(data) // 2], "header cut": data[:20],
                      "garbage": b"\x07" * 64, "empty": b""}[how])


@pytest.mark.parametrize("how", ["truncated", "header cut", "garbage", "empty"])
def test_corrupt_safetensors_names_the_file(tmp_path, how):
    from transformers import AutoConfig

    from minivllm.models.qwen3 import Qwen3ForCausalLM

    path = make_hf_checkpoint(tmp_path)
    _corrupt(path, how)
    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match=r"model\.safetensors.* is corrupt or truncated") as err:
        load_weights(model, path)
    assert str(path / "model.safetensors") in str(err.value)
    assert isinstance(err.value.__cause__, SafetensorError)


def test_llm_on_a_truncated_checkpoint_says_so(tmp_path):
    path = make_hf_checkpoint(tmp_path)
    _corrupt(path, "truncated")
    with pytest.raises(ValueError, match="is corrupt or truncated"):
        LLM(str(path), block_size=4, num_kvcache_blocks=64)


# -- prompt token ids ------------------------------------------------------------------------
def test_integer_scalars_are_token_ids_and_other_values_are_named(tiny_ckpt):
    """``list(np.array(...))`` or ``list(torch.tensor(...))`` as a prompt runs like the same Python
    ints (they were refused as "outside the vocabulary"); a float, str or bool is refused as not
    an integer, naming it and its type, and the engine keeps serving."""
    import numpy as np
    import torch

    llm = make_llm(tiny_ckpt)
    ids = prompts_of([6], seed=3)[0]
    want = llm.generate([ids], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    for form in (list(np.array(ids)), list(torch.tensor(ids)), tuple(np.array(ids, dtype=np.int32))):
        out = llm.generate([{"prompt_token_ids": form}], greedy(4), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want and out.prompt_token_ids == ids
        assert all(type(t) is int for t in out.prompt_token_ids)
    for bad, shown in ((3.0, "3.0 (float)"), ("7", "'7' (str)"), (True, "True (bool)"), (np.float32(2), "float32")):
        with pytest.raises(ValueError, match="is not an integer") as err:
            llm.generate([ids[:2] + [bad]], greedy(2), use_tqdm=False)
        assert shown in str(err.value)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, np.int64(97)]], greedy(2), use_tqdm=False)
    # one bare prompt of numpy ints (it was refused, "not an int token id", where the same list in a dict ran)
    out = llm.generate(list(np.array(ids)), greedy(4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want and all(type(t) is int for t in out.prompt_token_ids)
    with pytest.raises(ValueError, match=r"element 1 is np.float32\(2.0\) \(float32\), not an int token id"):
        llm.generate([ids[0], np.float32(2)], greedy(2), use_tqdm=False)
    # a list of prompts with a stray number blamed the valid prompt ("element 0 is 'hello' (str)")
    with pytest.raises(ValueError, match=r"prompts mix prompts \(element 0: str\) with a bare number \(element 1: 5\)"):
        llm.generate(["hello", 5], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"element 0: list\) with a bare number \(element 2: 7\)"):
        llm.generate([[5, 6], "x", 7], greedy(2), use_tqdm=False)
    assert_still_serving(llm)


def test_numpy_scalars_in_sampling_params_are_numbers():
    """np.float32(0.5) was refused as "must be a finite number" (it is one), np.int64 seeds and lengths as not ints."""
    import numpy as np

    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), seed=np.int64(3), max_tokens=np.int32(7),
                       top_k=np.int64(5), n=np.int64(2), logprobs=np.int8(1))
    assert (p.temperature, p.seed, p.max_tokens, p.top_k, p.n, p.logprobs) == (0.5, 3, 7, 5, 2, 1)
    assert type(p.temperature) is float and type(p.seed) is int and type(p.max_tokens) is int
    assert type(p.top_p) is float  # np.float64 too
    p.temperature = np.float32(0.25)  # assignment validates (and converts) too
    assert p.temperature == 0.25 and type(p.temperature) is float
    for field, value in (("temperature", np.float32("nan")), ("top_k", np.float32(2.0)), ("max_tokens", np.bool_(True))):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**{field: value})
