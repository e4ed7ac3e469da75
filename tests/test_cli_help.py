"""Every command line a user can start explains every option, in plain text.

Each command's parser is caught at its ``parse_args`` call (nothing runs), then checked: every
option and positional argument has a help line (or is deliberately hidden), and the help text has
no raw reStructuredText markup (double backticks, ``:class:`` roles) and no internal references
("issue 3") that mean nothing to someone reading ``--help``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class _Caught(Exception):
    pass


def _catch_parser(monkeypatch, run) -> argparse.ArgumentParser:
    """The ArgumentParser that ``run()`` parses its arguments with (it is stopped right there)."""
    caught = []

    def fake_parse_args(self, args=None, namespace=None):
        caught.append(self)
        raise _Caught

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", fake_parse_args)
    with pytest.raises(_Caught):
        run()
    return caught[0]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_help_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _module_main(name: str):
    return lambda: importlib.import_module(name).main([])


COMMANDS = {
    "minivllm generate": lambda: importlib.import_module("minivllm.__main__").main(["generate", "x"]),
    "minivllm bench": lambda: importlib.import_module("minivllm.__main__").main(["bench"]),
    "scripts/gpu_check.py": lambda: _script("gpu_check").parse_args([]),
    "scripts/execute_notebook.py": lambda: _script("execute_notebook").main([]),
    "scripts/train_tiny_model.py": lambda: _script("train_tiny_model").main([]),
    "minivllm.executor.worker": _module_main("minivllm.executor.worker"),
    "minivllm.quantization.accuracy": _module_main("minivllm.quantization.accuracy"),
    "minivllm.quantization.gpu_check_int8": _module_main("minivllm.quantization.gpu_check_int8"),
    "minivllm.quantization.probe_cpu": _module_main("minivllm.quantization.probe_cpu"),
}


def _check_help_text(text: str, where: str) -> None:
    assert "`" not in text, f"{where}: raw backticks in --help:\n{text}"
    assert not re.search(r":(class|func|mod|meth|attr):", text), f"{where}: an RST role in --help"
    assert not re.search(r"\bissues? \d", text, re.IGNORECASE), f"{where}: an internal issue reference in --help"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_plain_help(command, monkeypatch):
    parser = _catch_parser(monkeypatch, COMMANDS[command])
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS
               and not (a.help or "").strip()]
    assert not missing, f"{command}: options without a help line: {missing}"
    assert parser.description, f"{command}: no description"
    _check_help_text(parser.format_help(), command)


def test_top_level_usage_names_both_commands_and_goes_to_stdout_when_asked(capsys):
    from minivllm.__main__ import main

    assert main(["--help"]) == 0
    out = capsys.readouterr()
    assert "generate" in out.out and "bench" in out.out and out.err == ""
    _check_help_text(out.out, "minivllm --help")
    assert main([]) == 2 and "usage:" in capsys.readouterr().err
    assert main(["foo"]) == 2 and "error: unknown command 'foo'" in capsys.readouterr().err


def test_dir_lists_the_lazy_exports():
    import minivllm

    assert {"LLM", "SamplingParams", "RequestOutput"} <= set(dir(minivllm))
    # not the package's own imports (a new user's report: they cluttered tab completion)
    assert not {"TYPE_CHECKING", "annotations", "importlib", "_EXPORTS"} & set(dir(minivllm))


def test_console_script_is_named_as_started(monkeypatch):
    """``minivllm generate --help`` (the console script) says ``minivllm``, not ``python -m minivllm``."""
    from minivllm.__main__ import build_generate_parser
    from minivllm.bench import build_parser

    monkeypatch.setattr("sys.argv", ["/venv/bin/minivllm", "generate"])
    assert build_generate_parser().prog == "minivllm generate" and build_parser().prog == "minivllm bench"
    monkeypatch.setattr("sys.argv", ["/repo/minivllm/__main__.py", "generate"])
    assert build_generate_parser().prog == "python -m minivllm generate"


def test_generate_writes_the_prompt_after_a_warning_about_the_request(monkeypatch):
    """Regression: the prompt was written before the request was added, so the max_model_len warning
    (stderr) landed in the middle of the prompt's line on a terminal ("The list typeWARNING ...")."""
    import io

    from minivllm.__main__ import main

    import logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own: minivllm's handler then stays quiet
    both = io.StringIO()  # one stream for both, as a terminal shows them
    monkeypatch.setattr("sys.stdout", both)
    monkeypatch.setattr("sys.stderr", both)
    assert main(["generate", "The list type", "--max-tokens", "5000", "--stop", "\\n"]) == 0
    text = both.getvalue()
    assert "exceeds max_model_len" in text and "The list type" in text
    assert text.index("exceeds max_model_len") < text.index("The list type")


def test_generate_reads_the_prompt_from_stdin_for_a_dash(monkeypatch, capsys):
    """``echo text | minivllm generate -`` continued the literal text "-" (a new user's report)."""
    import io

    from minivllm.__main__ import main

    monkeypatch.setattr("sys.stdin", io.StringIO("The list type\n"))
    assert main(["generate", "-", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("The list type")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", "-"]) == 2 and "the prompt is empty" in capsys.readouterr().err
