"""``minivllm chat``: a conversation in the terminal (turns read from stdin, replies streamed to
stdout, measured figures on stderr), its commands, and how it meets an interrupt, a conversation
grown past max_model_len and a model without a chat template."""
from __future__ import annotations

import io
import json
import re
import shutil
import sys

import pytest

from minivllm import LLM
from minivllm.__main__ import main
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

QUIET = ["--threads", "1", "--max-tokens", "6", "--temperature", "0"]


@pytest.fixture(autouse=True)
def _restore_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rendered(monkeypatch):
    """Every conversation ``chat`` renders (the messages it passes), and every LLM it builds."""
    seen, llms = [], []
    real_render, real_init = LLM._chat_prompts, LLM.__init__

    def spy_render(self, messages, **kw):
        seen.append([dict(m) for m in messages])
        return real_render(self, messages, **kw)

    def spy_init(self, *a, **kw):
        real_init(self, *a, **kw)
        llms.append(self)

    monkeypatch.setattr(LLM, "_chat_prompts", spy_render)
    monkeypatch.setattr(LLM, "__init__", spy_init)
    return seen, llms


def run(monkeypatch, capsys, text, *args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    status = main(["chat", *QUIET, *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_turns_keep_the_conversation_and_reset_forgets_it(monkeypatch, capsys, rendered):
    seen, llms = rendered
    status, out, err = run(monkeypatch, capsys, "hello\nand then?\n/reset\nagain\n", "--system", "Be brief.")
    assert status == 0
    turns = seen[1:]  # seen[0]: the template checked before the first turn
    assert [[m["role"] for m in t] for t in turns] == [
        ["system", "user"], ["system", "user", "assistant", "user"], ["system", "user"]]
    assert turns[1][2]["content"] and turns[1][2]["content"] in out  # the first reply, streamed, then remembered
    assert err.count("# 6 tokens (length); TTFT ") == 3 and "# the conversation is forgotten" in err
    cached = [int(m) for m in re.findall(r"tokens, (\d+) of them from the prefix cache", err)]
    assert len(cached) == 3 and cached[1] > 0  # the second turn's prompt starts with the first turn's blocks
    assert llms and llms[0].llm_engine.is_shut_down  # the engine is shut down when the command ends


def test_an_interrupted_reply_drops_its_turn_and_the_engine_serves_the_next(monkeypatch, capsys, rendered):
    seen, llms = rendered
    real_stream, calls = LLM.stream, []

    def interrupted_once(self, *a, **kw):
        calls.append(1)
        for i, out in enumerate(real_stream(self, *a, **kw)):
            if len(calls) == 1 and i == 2:
                raise KeyboardInterrupt  # Ctrl-C mid-reply
            yield out

    monkeypatch.setattr(LLM, "stream", interrupted_once)
    from minivllm import chat_command

    left, real_close = [], chat_command._ChatSession.close

    def close(self):  # what the engine holds when the command ends, before it is shut down
        if self.llm is not None:
            left.append((self.llm.llm_engine.has_unfinished_requests(), len(self.llm.llm_engine.requests)))
        real_close(self)

    monkeypatch.setattr(chat_command._ChatSession, "close", close)
    status, out, err = run(monkeypatch, capsys, "first\nsecond\n")
    assert status == 0 and "# interrupted: this turn is dropped" in err
    assert [m["content"] for m in seen[-1] if m["role"] == "user"] == ["second"]  # "first" was dropped
    assert err.count("# 6 tokens (length)") == 1
    assert left == [(False, 0)]  # nothing of the interrupted request is left


def test_a_conversation_past_max_model_len_is_refused_and_the_chat_goes_on(monkeypatch, capsys, rendered):
    status, out, err = run(monkeypatch, capsys, "word " * 60 + "\nhi\n", "--max-model-len", "48")
    assert status == 1  # piped: a turn was refused
    assert "error: " in err and "leaves no room for a reply" in err and "/reset starts the conversation again" in err
    assert err.count("# 6 tokens (length)") == 1  # the short turn after it was answered


def test_refusals_before_the_first_turn(monkeypatch, capsys, tmp_path):
    no_template = shutil.copytree(EMBEDDED_MODEL_DIR, tmp_path / "plain")
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    status, _, err = run(monkeypatch, capsys, "hi\n", "--model", str(no_template))
    assert status == 2 and "has no chat template" in err and "chat_template=" not in err  # no Python-only fix
    status, _, err = run(monkeypatch, capsys, "hi\n", "--top-p", "0")
    assert status == 2 and "top_p" in err
    with pytest.raises(SystemExit) as caught:  # argparse: not JSON
        main(["chat", "--chat-template-kwargs", "{nope"])
    assert caught.value.code == 2


def test_usage_names_the_chat_command(capsys):
    assert main(["--help"]) == 0
    assert "chat [--model PATH]" in capsys.readouterr().out
    assert main(["chta"]) == 2
    assert "choose generate, chat or bench" in capsys.readouterr().err


def test_quick_mode_and_vllm_option_names(monkeypatch, capsys, rendered):
    """vLLM's chat has -q MESSAGE (one message, then exit) and --system-prompt: both were unrecognised."""
    seen, _ = rendered
    status, out, err = run(monkeypatch, capsys, "", "-q", "hello", "--system-prompt", "Be brief.")
    assert status == 0 and out.strip() and err.count("# 6 tokens (length)") == 1
    assert [m["role"] for m in seen[-1]] == ["system", "user"] and seen[-1][1]["content"] == "hello"


def test_piped_input_keeps_no_carriage_return_and_a_refused_turn_sets_the_status(monkeypatch, capsys, rendered):
    seen, _ = rendered
    status, _, err = run(monkeypatch, capsys, "hi\r\n" + "word " * 60 + "\r\n", "--max-model-len", "48")
    assert seen[1][-1]["content"] == "hi"  # a Windows line ending is not part of the turn
    # the refusal speaks of the conversation and the option, not of SamplingParams or "prompt 0"
    assert "error: the conversation with this turn is " in err and "(--max-model-len)" in err
    assert "SamplingParams" not in err and "prompt 0" not in err
    assert status == 1  # a piped run says a turn was refused


def test_template_variables_the_template_chokes_on_are_named_before_the_first_turn(monkeypatch, capsys):
    for kwargs, words in (('{"tools": 5}', "chat_template_kwargs['tools']=5: must be a list of tool"),
                          ('{"messages": 3}', "messages: the conversation is LLM.chat's first argument"),
                          ('{"tokenize": true}', "tokenize: the text is always rendered")):
        status, _, err = run(monkeypatch, capsys, "hi\n", "--chat-template-kwargs", kwargs)
        assert status == 2 and words in err, (kwargs, err)
    # LLM.chat's arguments win over add_generation_prompt here (vLLM 0.34): the value was ignored, warned every turn
    for bad, words in (("{bad", "not valid JSON (Expecting property name"), ("[1]", "must be a JSON object"),
                       ('{"add_generation_prompt": false}', "['add_generation_prompt']: the chat loop sets these")):
        with pytest.raises(SystemExit) as caught:
            main(["chat", "--chat-template-kwargs", bad])
        assert caught.value.code == 2 and words in capsys.readouterr().err
    status, _, err = run(monkeypatch, capsys, "hi\n", "--max-tokens", "0")
    assert status == 2 and "--max-tokens: SamplingParams.max_tokens=0" in err  # the option, not just the field


def test_a_template_that_refuses_the_system_message_is_named_at_start(monkeypatch, capsys, tmp_path):
    """The start-up check rendered a user message alone, so a template refusing system messages failed at
    every turn, blamed on --chat-template-kwargs that were never given."""
    model = shutil.copytree(EMBEDDED_MODEL_DIR, tmp_path / "no-system")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}" + config["chat_template"])
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    status, _, err = run(monkeypatch, capsys, "", "--model", str(model), "-q", "hi", "--system", "x")
    assert status == 2
    assert "the model's chat template refused the conversation (TemplateError: System role not supported)" in err
    assert "--chat-template-kwargs" not in err
    status, out, _ = run(monkeypatch, capsys, "", "--model", str(model), "-q", "hi")  # without one it answers
    assert status == 0 and out.strip()


def test_a_reply_that_ends_in_an_error_drops_its_turn_and_sets_the_status(monkeypatch, capsys, rendered):
    from minivllm import SamplingParams

    seen, _ = rendered
    # no token can be drawn: a repetition penalty that overflows every logit (as generate's test does)
    monkeypatch.setattr(LLM, "get_default_sampling_params", lambda self: SamplingParams(repetition_penalty=1e-45))
    status, _, err = run(monkeypatch, capsys, "first\nsecond\n")
    assert status == 1 and err.count("no token could be sampled") == 2 and "(this turn is dropped)" in err
    assert [m["role"] for m in seen[-1]] == ["user"]  # the failed first turn left nothing in the conversation


def test_chat_template_option_serves_a_model_without_one(monkeypatch, capsys, tmp_path):
    """LLM(chat_template=...) could not be reached from the command: a model whose tokenizer has no template
    could not chat at all. --chat-template takes the template or its file (vLLM's option)."""
    model = shutil.copytree(EMBEDDED_MODEL_DIR, tmp_path / "no-template")
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    status, _, err = run(monkeypatch, capsys, "", "--model", str(model), "-q", "hi")
    assert status == 2 and "give one with --chat-template" in err
    (tmp_path / "t.jinja").write_text(template)
    for given in (template, str(tmp_path / "t.jinja")):
        status, out, _ = run(monkeypatch, capsys, "", "--model", str(model), "-q", "hi", "--chat-template", given)
        assert status == 0 and out.strip()
    status, _, err = run(monkeypatch, capsys, "", "--model", str(model), "-q", "hi", "--chat-template", "nope.jinja")
    assert status == 2 and "looks like a file path" in err


def test_an_empty_quick_message_is_refused_and_a_mistyped_command_is_not_sent(monkeypatch, capsys, rendered):
    """`chat -q ""` sent an empty user turn to the model (generate refuses an empty prompt), and a line
    such as /help went to the model as a message."""
    seen, _ = rendered
    status, out, err = run(monkeypatch, capsys, "", "-q", "  ")
    assert status == 2 and "-q/--quick: the message is empty" in err and not out
    assert not seen and not rendered[1]  # refused before a model was loaded
    status, out, err = run(monkeypatch, capsys, "/help\nhello\n")
    assert status == 0 and "# unknown command /help: commands: /reset" in err
    assert [[m["content"] for m in t] for t in seen[1:]] == [["hello"]]  # /help was no turn


def test_a_broken_chat_template_option_is_named_as_the_options(monkeypatch, capsys):
    """The error blamed "the model's chat template" for the one given with --chat-template."""
    status, _, err = run(monkeypatch, capsys, "", "-q", "hi", "--chat-template", "{{ bogus")
    assert status == 2 and "the --chat-template refused the conversation" in err
    assert "the model's chat template" not in err


def test_tokenizer_option_serves_a_checkpoint_without_one(monkeypatch, capsys, tmp_path):
    """The advice for a checkpoint without a tokenizer was LLM(tokenizer=...), with no option to follow it
    from the command line; --tokenizer (vLLM's option) now gives it, in chat and generate."""
    model = tmp_path / "weights-only"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(EMBEDDED_MODEL_DIR / name, model / name)
    status, _, err = run(monkeypatch, capsys, "", "--model", str(model), "-q", "hi")
    assert status == 2 and "give --tokenizer <its directory>" in err and "LLM(tokenizer=" not in err
    status, _, err = run(monkeypatch, capsys, "", "--model", str(model), "--tokenizer", "", "-q", "hi")
    assert status == 2 and "--tokenizer: tokenizer='': empty" in err  # not "no tokenizer.json in '.'"
    status, out, _ = run(monkeypatch, capsys, "", "--model", str(model), "--tokenizer", "minivllm-tiny", "-q", "hi")
    assert status == 0 and out.strip()
    assert main(["generate", "def", *QUIET, "--model", str(model), "--tokenizer", str(EMBEDDED_MODEL_DIR)]) == 0
    assert capsys.readouterr().out.strip()


def test_version(capsys):
    from minivllm import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == __version__
