"""The public API contract: LLM.generate / stream / chat, SamplingParams validation, outputs, metrics."""
from __future__ import annotations

import pytest

from helpers_engine import greedy, make_llm, prompts_of
from minivllm import LLM, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("temperature", float("nan")), ("stop", [""]),
    ("stop_token_ids", [-1]), ("seed", 1.5),
])
def test_sampling_params_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0, 0.0, 1.0, 16)
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(top_k=-1).uses_top_k is False


def test_prompt_forms_and_order(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    ids = prompts_of([5, 9, 3], seed=11)
    outs = llm.generate([ids[0], {"prompt_token_ids": ids[1]}, ids[2]], greedy(3), use_tqdm=False)
    singles = [llm.generate(p, greedy(3), use_tqdm=False)[0] for p in ids]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in singles]
    assert [o.prompt_token_ids for o in outs] == ids


def test_a_generator_of_prompts_is_refused_with_the_way_out():
    """A generator of prompts was refused with 'expected a str, list[int], dict, or a list of them',
    which does not say that the list is what is missing (a new user's report)."""
    from minivllm.llm import _as_prompt_list

    with pytest.raises(ValueError, match=r"generator or other iterable .* pass list\(\.\.\.\)"):
        _as_prompt_list(p for p in ["a", "b"])
    with pytest.raises(ValueError, match=r"a list of them$"):
        _as_prompt_list(3.5)
    assert _as_prompt_list(("a", "b")) == ["a", "b"]


def test_text_prompt(text_ckpt, tiny_ckpt):
    llm = make_llm(text_ckpt)
    out = llm.generate("The list", greedy(3), use_tqdm=False)[0]
    assert out.prompt == "The list" and out.prompt_token_ids == llm.get_tokenizer().encode("The list")
    assert len(out.outputs[0].token_ids) == 3 and isinstance(out.outputs[0].text, str)
    small = make_llm(tiny_ckpt)  # vocabulary of 97: most text encodes outside it
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        small.generate("The list type", greedy(3), use_tqdm=False)


def test_unknown_engine_argument_and_bad_model_path(tmp_path):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tmp_path), max_num_seq=3)
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        LLM(str(tmp_path))  # a directory, not a checkpoint
    with pytest.raises(FileNotFoundError, match="no such directory: '.*nowhere'"):
        LLM(str(tmp_path / "nowhere"))


def test_a_hub_id_loads_from_the_hugging_face_cache_and_otherwise_says_how_to_get_it(tmp_path, monkeypatch):
    """A vLLM script names its model by Hub id; vLLM finds a cached snapshot offline, minivllm said
    "no such directory". Now the id resolves to the cache's snapshot, and a missing one is named with
    the download command."""
    import shutil

    from huggingface_hub import constants

    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR, resolve_model, with_tokenizer

    monkeypatch.chdir(tmp_path)  # "acme/tiny-qwen3" is no path here
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"If 'acme/tiny-qwen3' is a Hub id, it is not in the Hugging Face "
                                                r"Hub cache.*hf download acme/tiny-qwen3"):
        resolve_model("acme/tiny-qwen3")
    repo = tmp_path / "hub" / "models--acme--tiny-qwen3"
    snapshot = repo / "snapshots" / "0123abcd"  # the cache's layout
    snapshot.mkdir(parents=True)
    for f in EMBEDDED_MODEL_DIR.iterdir():  # first only what a tokenizer or config fetch leaves
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    with pytest.raises(FileNotFoundError, match=r"snapshot .* has no \*\.safetensors weights.*`hf download acme/"):
        resolve_model("acme/tiny-qwen3")
    # tokenizer= takes a cached Hub id too
    assert with_tokenizer(resolve_model("minivllm-tiny"), "acme/tiny-qwen3").tokenizer_dir == snapshot
    for f in EMBEDDED_MODEL_DIR.glob("*.safetensors"):
        shutil.copy(f, snapshot / f.name)
    source = resolve_model("acme/tiny-qwen3")
    assert source.checkpoint_dir == snapshot and source.tokenizer_dir == source.checkpoint_dir
    llm = LLM("acme/tiny-qwen3", enforce_eager=True)
    try:
        ref = LLM("minivllm-tiny", enforce_eager=True)
        try:
            assert (llm.generate("The list type", greedy(4), use_tqdm=False)[0].outputs[0].token_ids
                    == ref.generate("The list type", greedy(4), use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            ref.shutdown()
    finally:
        llm.shutdown()


def test_stream_deltas_join_to_final_text(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    prompts = prompts_of([4, 7], seed=12)
    finals = llm.generate(prompts, greedy(12), use_tqdm=False)
    joined = {o.request_id: ("", []) for o in []}
    texts, tokens, finished = {}, {}, set()
    for out in llm.stream(prompts, greedy(12)):
        assert out.request_id not in finished
        texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
        tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if out.finished:
            finished.add(out.request_id)
    del joined
    got = [texts[k] for k in sorted(texts, key=int)]
    got_tokens = [tokens[k] for k in sorted(tokens, key=int)]
    assert got == [f.outputs[0].text for f in finals]
    assert got_tokens == [f.outputs[0].token_ids for f in finals]
    assert len(finished) == 2


def test_stream_with_stop_string_never_leaks_the_stop(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    full = llm.generate([11, 12, 13], greedy(12), use_tqdm=False)[0].outputs[0].text
    stop = full[5:7]
    final = llm.generate([11, 12, 13], greedy(12, stop=stop), use_tqdm=False)[0].outputs[0]
    pieces = [o.outputs[0].text for o in llm.stream([11, 12, 13], greedy(12, stop=stop))]
    assert "".join(pieces) == final.text == full[:full.find(stop)]


def test_cumulative_text_holds_back_a_possible_stop_string_and_never_shrinks(tiny_ckpt):
    """Cumulative outputs showed the start of a stop string, then the final text without it
    (vLLM holds it back in both output kinds)."""
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine

    def cumulative(params):
        engine.add_request("c", [11, 12, 13], params, output_kind="cumulative")
        texts = []
        while engine.has_unfinished_requests():
            texts += [o.outputs[0].text for o in engine.step()]
        return texts

    plain = cumulative(greedy(12))
    full = plain[-1]
    # a stop string across two tokens' texts, whose first character ends a step's text
    cut = next(len(t) for t in plain
               if 0 < len(t) < len(full) and full.find(full[len(t) - 1:len(t) + 1]) == len(t) - 1)
    texts = cumulative(greedy(12, stop=[full[cut - 1:cut + 1]]))
    assert texts[-1] == full[:cut - 1]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    # a stop string kept in the output is never cut, so nothing is held back (vLLM's buffer of 0)
    kept = cumulative(greedy(12, stop=[full[cut - 1:cut + 1]], include_stop_str_in_output=True))
    assert kept[-1] == full[:cut + 1] and kept[:-1] == plain[:len(kept) - 1]


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_output_kinds(tiny_ckpt, kind):
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    engine.add_request("r", [1, 2, 3], greedy(4), output_kind=kind)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    final = llm.generate([1, 2, 3], greedy(4), use_tqdm=False)[0].outputs[0]
    if kind == "final_only":
        assert len(seen) == 1 and seen[0].outputs[0].token_ids == final.token_ids
    elif kind == "cumulative":
        assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3, 4]
        assert seen[-1].outputs[0].text == final.text
    else:
        assert [len(o.outputs[0].token_ids) for o in seen] == [1, 1, 1, 1]
        assert "".join(o.outputs[0].text for o in seen) == final.text
    assert [o.finished for o in seen][-1] is True
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("x", [1], greedy(1), output_kind="sometimes")


def test_abort_of_a_final_only_request_returns_its_text(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    engine.add_request("r", [1, 2, 3], greedy(10), output_kind="final_only")
    for _ in range(4):
        engine.step()
    out = engine.abort_request("r")
    full = llm.generate([1, 2, 3], greedy(4), use_tqdm=False)[0].outputs[0]  # 4 steps: prefill + 3 decodes
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == full.token_ids
    assert out.outputs[0].text == full.text


def test_a_request_id_in_use_says_how_to_free_it_and_is_free_once_its_request_ends(tiny_ckpt):
    """A notebook cell re-run after an interrupt adds its ids again while the first run's requests
    are unfinished: the refusal names the way out, and the id is free after the request ends."""
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    engine.add_request("0", [1, 2, 3], greedy(3))
    with pytest.raises(ValueError, match=r"'0' is already in use by an unfinished request \(abort_request\('0'\)"):
        engine.add_request("0", [4, 5], greedy(2))
    engine.abort_request("0")
    assert engine.add_request("0", [4, 5], greedy(2)) == "0"


def test_a_progress_bar_that_fails_to_start_leaves_nothing_queued(tiny_ckpt):
    """generate's bar was made after the requests were queued and outside the clean-up:
    a ``use_tqdm`` callable of another signature left them queued for good."""
    llm = make_llm(tiny_ckpt)
    with pytest.raises(TypeError):
        llm.generate(prompts_of([4, 5], seed=9), greedy(3), use_tqdm=lambda n: None)
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_closing_a_stream_early_aborts_its_requests(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    it = llm.stream([[1, 2, 3], [4, 5, 6]], greedy(20))
    next(it)
    it.close()
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.block_manager.num_used_blocks == 0


def test_metrics_are_measured_and_consistent(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    out = llm.generate([1, 2, 3, 4], greedy(5), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 5 and len(m.itl_ms) == 4
    assert m.ttft_ms > 0 and m.e2e_ms >= m.ttft_ms and m.queue_ms >= 0
    assert m.tpot_ms == pytest.approx(sum(m.itl_ms) / 4)


def test_step_records_describe_the_step(tiny_ckpt):
    llm = make_llm(tiny_ckpt)
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3, 4, 5, 6], greedy(2))
    rec = engine.step_with_record().record
    assert (rec.index, rec.num_prefill_tokens, rec.num_decode_tokens, rec.num_seqs) == (0, 6, 0, 1)
    assert rec.phase == "prefill" and rec.kv_blocks_used == 2 and rec.attention_backend == "torch"
    assert rec.wall_ms > 0 and rec.flops > 0 and rec.bytes_moved > 0 and rec.mfu is None
    rec2 = engine.step_with_record().record
    assert rec2.phase == "decode" and rec2.num_decode_tokens == 1 and rec2.finished == ["a"]
    assert rec2.kv_blocks_free == engine.block_manager.num_blocks


def test_mixed_step_has_decodes_and_a_prefill_chunk(tiny_ckpt):
    llm = make_llm(tiny_ckpt, max_num_batched_tokens=6)
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3], greedy(5))
    engine.step()
    engine.add_request("b", list(range(1, 15)), greedy(2))
    rec = engine.step_with_record().record
    assert rec.phase == "mixed"
    assert [(e.request_id, e.is_prefill, e.num_tokens) for e in rec.scheduled] == [("a", False, 1), ("b", True, 5)]
    engine.abort_request("a")
    engine.abort_request("b")


def test_context_manager_and_shutdown(tiny_ckpt):
    with make_llm(tiny_ckpt) as llm:
        llm.generate([1, 2], greedy(1), use_tqdm=False)
    assert llm.llm_engine.is_shut_down
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([1, 2], greedy(1), use_tqdm=False)


def test_the_engine_of_a_shut_down_llm_says_so(tiny_ckpt):
    """After ``llm.shutdown()``, ``llm.llm_engine`` is still the engine (as in vLLM), so a script's
    ``llm.llm_engine.step()`` gets the engine's RuntimeError (it was an AttributeError on None)."""
    llm = make_llm(tiny_ckpt)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="has been shut down"):
        llm.llm_engine.step()
    with pytest.raises(RuntimeError, match="has been shut down"):
        llm.llm_engine.add_request("a", [1, 2], greedy(1))
    assert not llm.llm_engine.has_unfinished_requests()


def test_an_engine_whose_llm_is_gone_says_so(tiny_ckpt):
    """``engine = LLM(...).llm_engine`` leaves the engine without its LLM, which shuts it down when
    collected: using the engine then raises a RuntimeError that says what happened (it was an
    AttributeError on None inside step)."""
    import gc

    engine = make_llm(tiny_ckpt).llm_engine
    gc.collect()
    with pytest.raises(RuntimeError, match="shut down .*keep a reference to the LLM"):
        engine.add_request("a", [1, 2, 3], greedy(2))
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    assert not engine.has_unfinished_requests()


def test_chat_applies_the_template(text_ckpt):
    llm = make_llm(text_ckpt)
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is a list?"}]
    out = llm.chat(messages, greedy(3), use_tqdm=False)
    expected = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert len(out) == 1 and out[0].prompt_token_ids == expected and len(out[0].outputs[0].token_ids) == 3
    assert len(llm.chat([messages, messages], greedy(1), use_tqdm=False)) == 2


def test_chat_without_template_is_a_clear_error(text_ckpt, tmp_path):
    import json
    import shutil

    ckpt = shutil.copytree(text_ckpt, tmp_path / "no-template")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    llm = make_llm(ckpt)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], greedy(2))


def test_steps_run_with_the_heap_frozen_and_the_freeze_is_undone(tiny_ckpt, monkeypatch):
    """generate and stream step the engine with the objects made before out of the collector's
    generations (a full collection mid-step walks only what the steps made); afterwards nothing
    stays frozen, and a freeze the caller made is neither extended nor undone. Whether the caller
    froze is asked once per call (gc.get_freeze_count walks the frozen objects), not per step."""
    import gc

    llm = make_llm(tiny_ckpt)
    counts = []
    real_step, real_count = llm.engine.step_with_record, gc.get_freeze_count
    asked = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or real_count())

    def step_with_record():
        counts.append(real_count())
        return real_step()

    llm.engine.step_with_record = step_with_record
    before = real_count()
    assert before == 0
    llm.generate(prompts_of([4, 6, 5]), greedy(5), use_tqdm=False)
    assert counts and min(counts) > 0 and real_count() == 0
    assert len(asked) == 1 and len(counts) > 3
    counts.clear()
    stream = llm.stream(prompts_of([3, 7]), greedy(4))
    next(stream)
    # the steps frozen, the consumer's turns not: a freeze across the yields froze the stream itself too
    assert counts and min(counts) > 0 and real_count() == 0
    list(stream)
    assert real_count() == 0 and len(asked) == 2  # asked once for the stream too, not once per turn
    stream = llm.stream(prompts_of([3, 7]), greedy(4))
    next(stream)
    del stream  # dropped half-way: closed, its requests aborted, the freeze undone
    assert real_count() == 0 and not llm.engine.has_unfinished_requests()
    gc.freeze()
    try:
        frozen = real_count()
        llm.generate(prompts_of([5, 2]), greedy(3), use_tqdm=False)
        assert 0 < real_count() <= frozen  # still the caller's (objects that died left it)
    finally:
        gc.unfreeze()


def test_a_stream_consumer_gets_its_garbage_collected(tiny_ckpt):
    """A freeze per step would reset the collector's count of new objects at every step, and a
    consumer making a few garbage cycles per token would never see a collection during the stream
    (a 251-token stream ran none); a stream collects its young generation at each yield."""
    import gc

    llm = make_llm(tiny_ckpt)
    gc.collect()
    before = gc.get_stats()[0]["collections"]
    made = 0
    for out in llm.stream(prompts_of([5]), greedy(120)):
        for _ in range(20):  # 20 cycles per token: far below the 700 new objects that start a collection
            a = []
            a.append(a)
            made += 1
    assert made >= 100 * 20 and gc.get_stats()[0]["collections"] > before


def test_heap_freeze_is_shared_by_overlapping_users_and_undone_by_the_last():
    """Two LLMs stepping at once in two threads share the process-wide freeze: the first one out
    must not unfreeze the heap under the other."""
    import gc
    import threading

    from minivllm.utils.gc_heap import heap_frozen

    inside, release = threading.Event(), threading.Event()

    def other():
        with heap_frozen():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with heap_frozen():
        t.start()
        assert inside.wait(10)
    assert gc.get_freeze_count() > 0  # the other thread is still stepping
    release.set()
    t.join(10)
    assert gc.get_freeze_count() == 0
    with heap_frozen(False):
        assert gc.get_freeze_count() == 0
