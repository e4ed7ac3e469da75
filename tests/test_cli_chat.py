"""``minivllm chat``: a conversation in the terminal (turns read from stdin, replies streamed to
stdout, measured figures on stderr), its commands, and how it meets an interrupt, a conversation
grown past max_model_len and a model without a chat template."""
from __future__ import annotations

import io
import json
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
    assert status == 0
    assert "error: " in err and "leaves no room to generate" in err and "/reset starts the conversation again" in err
    assert err.count("# 6 tokens (length)") == 1  # the short turn after it was answered


def test_refusals_before_the_first_turn(monkeypatch, capsys, tmp_path):
    no_template = shutil.copytree(EMBEDDED_MODEL_DIR, tmp_path / "plain")
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    status, _, err = run(monkeypatch, capsys, "hi\n", "--model", str(no_template))
    assert status == 2 and "has no chat template" in err
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
