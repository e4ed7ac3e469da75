"""vLLM 0.34 arguments its own example scripts pass, which minivllm refused or misread (a review that ran
vLLM's examples and nano-vllm's scripts against minivllm, 2026-12-07): speculative_config's draft keys and
the spec_* shortcuts, LLM.chat's priority, generate's priority as one number and mm_processor_kwargs=None,
--config YAML files and -O, RequestOutput.metrics' V1 names, LLMEngine.get_supported_tasks and trace_headers,
prompts in a numpy array or a pandas Series."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from helpers_engine import make_llm, run_to_end
from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.utils.argparse_utils import FlexibleArgumentParser

USER = [{"role": "user", "content": "hi"}]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = make_llm("minivllm-tiny")
    yield llm
    llm.shutdown()


def test_speculative_config_takes_the_draft_keys_vllms_example_passes():
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": "minivllm-tiny-draft",
                                       "num_speculative_tokens": 2, "enforce_eager": False, "max_model_len": 64,
                                       "draft_tensor_parallel_size": 1})
    assert (cfg.enforce_eager, cfg.max_model_len) == (False, 64)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "minivllm-tiny-draft",
                                     "draft_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="enforce_eager='no'"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "minivllm-tiny-draft", "enforce_eager": "no"})
    with pytest.raises(ValueError, match="method 'ngram' has none"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 64})


def test_the_drafts_keys_act_on_the_draft():
    spec = {"method": "draft_model", "model": "minivllm-tiny-draft", "num_speculative_tokens": 2}
    capped = LLM(speculative_config={**spec, "max_model_len": 40, "enforce_eager": True}, num_kvcache_blocks=64)
    eager_target = LLM(speculative_config={**spec, "enforce_eager": False}, enforce_eager=True, num_kvcache_blocks=64)
    try:
        proposer = capped.llm_engine.scheduler.config.propose
        assert proposer.max_positions == 40
        assert proposer.runner.graph_runner is None  # enforce_eager=True: no graphs for the draft
        # the target runs eagerly, the draft asked for graphs: a float32 draft on a CPU replays them
        assert eager_target.llm_engine.runner.graph_runner is None
        assert eager_target.llm_engine.scheduler.config.propose.runner.graph_runner is not None
        out = capped.generate("x" * 60, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 6
    finally:
        capped.shutdown()
        eager_target.shutdown()


def test_spec_shortcuts_merge_into_speculative_config_as_vllm():
    spec = {"method": "ngram"}
    args = EngineArgs(speculative_config=spec, spec_tokens=3)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert spec == {"method": "ngram"}  # the caller's dict is not changed
    assert EngineArgs(spec_method="ngram", spec_tokens=2).speculative_config == {"method": "ngram",
                                                                                 "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="spec_method='ngram' and speculative_config\\['method'\\]"):
        EngineArgs(speculative_config={"method": "ngram"}, spec_method="ngram")


def test_vllm_034_engine_arguments_are_ignored_or_refused_by_name(caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        EngineArgs(optimization_level=3, offload_group_size=0, enable_extensible_kv_cache=None,
                   return_sampling_mask=False)
    assert "optimization_level=3" in caplog.text
    with pytest.raises(TypeError, match="return_sampling_mask=True"):
        EngineArgs(return_sampling_mask=True)


def test_chat_takes_vllms_priority_in_vllms_position(llm):
    by_name = llm.chat(USER, GREEDY, priority=None, use_tqdm=False)[0].outputs[0].token_ids
    positional = llm.chat(USER, GREEDY, False, None, 0)[0].outputs[0].token_ids  # (.., use_tqdm, lora, priority)
    assert by_name == positional
    with pytest.raises(ValueError, match="priority=1"):
        llm.chat(USER, GREEDY, priority=1, use_tqdm=False)


def test_generate_takes_one_priority_for_all_and_mm_processor_kwargs_none(llm):
    outs = llm.generate(["def", "class"], GREEDY, priority=0, mm_processor_kwargs=None, use_tqdm=False)
    assert len(outs) == 2
    with pytest.raises(ValueError, match="priority=2:"):
        llm.generate(["def", "class"], GREEDY, priority=2, use_tqdm=False)
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.generate("def", GREEDY, mm_processor_kwargs={"fps": 1}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompts_in_a_numpy_array_or_a_pandas_series(llm):
    pd = pytest.importorskip("pandas")
    expected = [o.outputs[0].token_ids for o in llm.generate(["def", "class"], GREEDY, use_tqdm=False)]
    for prompts in (np.array(["def", "class"]), pd.Series(["def", "class"])):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(type(o.prompt) is str for o in outs)
    ids = llm.generate(np.array([5, 6, 7]), GREEDY, use_tqdm=False)  # one prompt of token ids
    assert len(ids) == 1 and ids[0].prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="expected a str"):
        llm.generate(np.zeros((2, 2)), GREEDY, use_tqdm=False)


def test_metrics_carry_vllm_v1s_names_and_count_preemptions(tiny_ckpt):
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=8, max_model_len=32)
    try:
        engine = llm.llm_engine
        for i in range(3):
            engine.add_request(str(i), [3 + i] * 7, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        final, records = run_to_end(engine)
        victims = [rid for r in records for rid in r.preempted]
        assert victims, "the pool of 8 blocks should force a preemption"
        for rid, out in final.items():
            m = out.metrics
            assert m.num_preemptions == victims.count(rid)
            assert (m.queued_ts, m.scheduled_ts, m.first_token_ts) == (m.arrival_time, m.first_scheduled_time,
                                                                      m.first_token_time)
            assert m.last_token_ts == m.token_times[-1]
    finally:
        llm.shutdown()


def test_engine_has_vllms_supported_tasks_and_trace_headers(llm):
    engine = llm.llm_engine
    assert engine.get_supported_tasks() == ("generate",)
    # vLLM's positional order: arrival_time, lora_request, tokenization_kwargs, trace_headers, priority
    assert engine.add_request("t", [5, 6], GREEDY, None, None, None, None, 0) == "t"
    with pytest.raises(ValueError, match="trace_headers"):
        engine.add_request("u", [5, 6], GREEDY, trace_headers={"traceparent": "x"})
    run_to_end(engine)


def _parser():
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def test_config_yaml_file_as_vllms_parser_reads_it(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("max-model-len: 512\nenforce_eager: true\nenable-prefix-caching: false\n"
                    "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    args = _parser().parse_args(["--config", str(path), "--max-model-len", "256"])
    assert args.max_model_len == 256  # the command line wins over the file
    assert args.enforce_eager is True and args.enable_prefix_caching is False
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert _parser().parse_args([f"--config={path}"]).max_model_len == 512
    # not read as --config-format (argparse's prefix match made it config_format='...yaml', a TypeError here)
    assert EngineArgs.from_cli_args(_parser().parse_args(["--config", str(path)])).max_model_len == 512
    for bad, match in ((["--config", str(tmp_path / "x.json")], "yaml"), (["--config"], "no file")):
        with pytest.raises(ValueError, match=match):
            _parser().parse_args(bad)


def test_config_file_options_follow_a_subcommand(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("max_model_len: 128\n")
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="cmd").add_parser("run")
    sub.add_argument("--max-model-len", type=int)
    args = parser.parse_args(["run", "--config", str(path)])
    assert (args.cmd, args.max_model_len) == ("run", 128)


def test_short_optimization_level_flag_is_vllms():
    args = _parser().parse_args(["-O3"])
    assert args.optimization_level == 3


def test_request_validation_raises_vllms_validation_error_which_is_a_value_error(llm):
    """vLLM's tests and scripts catch vllm.exceptions.VLLMValidationError; there was no minivllm.exceptions."""
    import math

    from minivllm.exceptions import VLLMClientError, VLLMValidationError

    with pytest.raises(VLLMValidationError, match="temperature") as e:
        SamplingParams(temperature=math.nan)
    assert isinstance(e.value, ValueError) and isinstance(e.value, VLLMClientError)
    assert (e.value.parameter, str(e.value).startswith("SamplingParams.temperature=nan")) == ("temperature", True)
    with pytest.raises(VLLMValidationError):  # one SamplingParams per prompt, or one for all
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="prompt 1"):
        llm.generate(["a", [llm.llm_engine.vocab_size]], GREEDY, use_tqdm=False)
    with pytest.raises(VLLMValidationError):
        llm.llm_engine.add_request("bad", [], GREEDY)
    with pytest.raises(ValueError):  # as before: a ValueError too
        llm.generate(["a", "b"], GREEDY, priority=[0], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_params_values_that_ask_for_nothing_are_accepted():
    assert SamplingParams(thinking_token_budget=-1, prompt_logprob_start=0, extra_args={"k": 1}).max_tokens == 16
    # extra_args is kept for code that reads it back, as vLLM's field is (it was accepted and dropped)
    tagged = SamplingParams(extra_args={"tag": "exp-1", "nested": {"k": [1]}})
    copied = tagged.clone()
    assert copied.extra_args == tagged.extra_args and copied.extra_args["nested"] is not tagged.extra_args["nested"]
    assert SamplingParams().extra_args is None
    with pytest.raises(ValueError, match=r"extra_args=\['x'\]: must be a dict or None"):
        SamplingParams(extra_args=["x"])
    with pytest.raises(TypeError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=100)
    with pytest.raises(TypeError, match="prompt_logprob_start"):
        SamplingParams(prompt_logprob_start=3)


def test_request_output_ignores_arguments_of_a_newer_vllm(caplog):
    from minivllm.outputs import RequestOutput

    with caplog.at_level(logging.WARNING, logger="minivllm"):
        out = RequestOutput(request_id="x", prompt="p", prompt_token_ids=[1], prompt_logprobs=None, outputs=[],
                            finished=False, example_arg_added_in_new_version=1, kv_transfer_params={"k": 1})
    assert out.request_id == "x" and out.kv_transfer_params == {"k": 1}
    assert out == RequestOutput("x", "p", [1], None, [], False)


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5])
def test_engine_seed_outside_vllms_range_is_refused(seed):
    with pytest.raises(ValueError, match=f"seed={seed!r}"):
        EngineArgs(seed=seed)


def test_every_request_input_error_is_a_validation_error_and_pickles(llm):
    import pickle
    import threading

    from minivllm.exceptions import VLLMValidationError

    for call in (lambda: llm.generate("a", GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 0}, use_tqdm=False),
                 lambda: llm.llm_engine.add_request("s", {"prompt_token_ids": [5], "cache_salt": 5}, GREEDY),
                 lambda: llm.chat(USER, GREEDY, chat_template_kwargs=5, use_tqdm=False),
                 lambda: llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)):
        with pytest.raises(VLLMValidationError):
            call()
    with pytest.raises(VLLMValidationError) as e:
        SamplingParams(seed=threading.Lock())
    copy = pickle.loads(pickle.dumps(e.value))  # the value itself does not pickle: its repr does
    assert type(copy) is VLLMValidationError and str(copy) == str(e.value) and copy.parameter == "seed"
    with pytest.raises(VLLMValidationError) as e:  # generate's "prompt i:" keeps parameter and value
        llm.generate(["a"], [SamplingParams(max_tokens=3, logprobs=10**6)], use_tqdm=False)
    assert str(e.value).startswith("prompt 0:")
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_engine_builds_its_outputs_without_the_forward_compatible_init(llm, monkeypatch):
    """The wrapper that takes a newer vLLM's arguments cost ~1.5 us a call, and the engine built one output per
    request per step through it (cumulative and delta outputs): 17-18% more engine time at batch 256."""
    import minivllm.outputs as outputs

    def refuse(*args, **kwargs):
        raise AssertionError("the engine went through RequestOutput's wrapped __init__")

    monkeypatch.setattr(outputs.RequestOutput, "__init__", refuse)
    streamed = list(llm.stream("def", GREEDY))
    assert len(streamed) == GREEDY.max_tokens and streamed[-1].finished
