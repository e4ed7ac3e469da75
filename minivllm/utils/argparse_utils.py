"""Engine arguments on a command line, as vLLM's example scripts build them.

vLLM's scripts do ``EngineArgs.add_cli_args(parser)`` then ``LLM(**vars(parser.parse_args()))``
or ``EngineArgs.from_cli_args(args)``; with these, such a script runs after only its import
lines change (``from minivllm.utils.argparse_utils import FlexibleArgumentParser``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing

__all__ = ["FlexibleArgumentParser", "add_cli_args", "from_cli_args"]


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that also takes option names written with underscores
    (``--max_model_len 512`` as ``--max-model-len 512``), as vLLM's parser of that name does."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        fixed = []
        for a in args:
            if a == "--":  # what follows is positional, left as written
                fixed.extend(args[len(fixed):])
                break
            if a.startswith("--"):
                name, eq, value = a.partition("=")
                a = name.replace("_", "-") + eq + value
            fixed.append(a)
        return super().parse_known_args(fixed, namespace)


def _help_by_name(cls) -> dict[str, str]:
    """The ``Args:`` section of ``cls``' docstring as {field name: first sentence of its text}
    (an entry "a / b: text" names two fields)."""
    doc = cls.__doc__ or ""
    section = doc.split("Args:", 1)[1].split("Raises:", 1)[0] if "Args:" in doc else ""
    helps, current = {}, []
    for line in section.splitlines():
        m = re.match(r"^ {8}([a-z_ /]+):\s*(.*)$", line)
        if m:
            current = [n.strip() for n in m.group(1).split("/")]
            for n in current:
                helps[n] = m.group(2)
        elif line.strip() and current:
            for n in current:
                helps[n] += " " + line.strip()
    return {n: re.split(r"(?<=\.)\s", h, maxsplit=1)[0].replace("%", "%%") for n, h in helps.items()}


def _option_kind(hint) -> tuple[str, type | None]:
    """("bool" | "value", the type an option's text converts to) for a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    if base is bool:
        return "bool", None
    if base is dict:
        return "value", json.loads  # --speculative-config '{"method": "ngram", ...}'
    return "value", base if base in (int, float, str) else str


def add_cli_args(cls, parser):
    """Add each field of the dataclass ``cls`` to ``parser`` (a parser or an argument group) as
    ``--kebab-case`` with the field's default (bools as ``--x / --no-x``, dicts as JSON), and
    return ``parser``; ``vars(parser.parse_args())`` is then a valid ``LLM(**kwargs)``."""
    hints = typing.get_type_hints(cls)
    helps = _help_by_name(cls)
    for f in dataclasses.fields(cls):
        kind, convert = _option_kind(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        text = helps.get(f.name, "")
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            parser.add_argument(flag, type=convert, default=f.default, help=text + " (default: %(default)s)")
    return parser


def from_cli_args(cls, args: argparse.Namespace):
    """``cls`` built from the fields of parsed ``args`` (other attributes are left alone).

    Raises:
        ValueError: a bad value, as ``cls`` raises it."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
