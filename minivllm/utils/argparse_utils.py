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
    (``--max_model_len 512`` as ``--max-model-len 512``) and ``--config FILE.yaml`` (the file's
    keys as options, before the command line's, which win), as vLLM's parser of that name does.

    Raises (from parsing): ValueError for a ``--config`` without a file, given twice, or naming a
    file that is not ``.yaml``/``.yml`` or does not hold a mapping; OSError for a file that
    cannot be read."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        if "--config" not in self._option_string_actions:  # a script's own --config stays its own
            args = _pull_config_file(self, args)
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


def _pull_config_file(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with ``--config FILE`` (or ``--config=FILE``) replaced by the options the YAML file
    holds, put first (after a leading subcommand) so that the command line's own options win
    (vLLM's precedence: command line, then file, then defaults). A true boolean becomes ``--key``,
    a false one ``--no-key`` where the parser has it, a list ``--key item ...``, a mapping
    ``--key '<JSON>'``."""
    at = [i for i, a in enumerate(args) if a == "--config" or a.startswith("--config=")]
    if not at:
        return args
    if len(at) > 1:
        raise ValueError(f"--config given {len(at)} times: give one YAML file")
    i = at[0]
    if args[i] == "--config":
        if i + 1 >= len(args):
            raise ValueError("--config: no file given (a YAML file of engine arguments)")
        path, rest = args[i + 1], args[:i] + args[i + 2:]
    else:
        path, rest = args[i].partition("=")[2], args[:i] + args[i + 1:]
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config {path!r}: expected a .yaml or .yml file, as vLLM reads it")
    import yaml  # PyYAML, a dependency of transformers

    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise ValueError(f"--config {path!r}: the file must hold a mapping of option names to values, "
                         f"not {type(config).__name__}")
    pulled = []
    for key, value in config.items():
        flag = "--" + str(key)
        if isinstance(value, bool):
            negated = "--no-" + str(key).replace("_", "-")
            if value:
                pulled.append(flag)
            elif negated in parser._option_string_actions:
                pulled.append(negated)
        elif isinstance(value, list):
            if value:
                pulled += [flag, *map(str, value)]
        elif isinstance(value, dict):
            pulled += [flag, json.dumps(value)]
        else:
            pulled += [flag, str(value)]
    if rest and not rest[0].startswith("-"):  # a subcommand first (vLLM's rule): the file's options after it
        return rest[:1] + pulled + rest[1:]
    return pulled + rest


def _help_by_name(cls) -> dict[str, str]:
    """The ``Args:`` section of ``cls``' docstring as {field name: its text} (an entry "a / b:
    text" names two fields)."""
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
    return helps


def json_object(text: str) -> dict:
    """An option's JSON object (``--speculative-config '{"method": "ngram"}'``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or not an object (argparse names the option)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object {{...}}")
    return value


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An option's count or size as vLLM's parser reads it: an int, or a number with a suffix,
    lower case decimal (``1k`` = 1,000, ``25.6k`` = 25,600), upper case binary (``1K`` = 1,024,
    ``64M`` = 64 MiB; whole numbers only).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the option)."""
    text = text.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give an int, or one with a suffix (1k = 1000, 1K = 1024, "
                                             "64M = 64 MiB)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; "
                                         f"{number}{suffix.lower()} is decimal")
    return int(number) * _BINARY[suffix]


def human_readable_int_or_auto(text: str) -> int:
    """:func:`human_readable_int`, or ``auto`` for -1 (``--max-model-len auto``: the longest that fits)."""
    return -1 if text.strip().lower() == "auto" else human_readable_int(text)


#: our options that take :func:`human_readable_int` (as vLLM's parser does for them)
HUMAN_READABLE = {"max_num_batched_tokens": human_readable_int, "kv_cache_memory_bytes": human_readable_int,
                  "max_model_len": human_readable_int_or_auto}


def loose_value(text: str):
    """A vLLM-only option's value as Python: true/false, an int, a float, JSON, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for convert in (int, float, json.loads):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _option_kind(hint) -> tuple[str, typing.Callable | None]:
    """("bool" | "value", the function an option's text goes through) for a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    if base is bool:
        return "bool", None
    if base is dict:
        return "value", json_object
    return "value", base if base in (int, float, str) else str


#: vLLM's short spellings of some options
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
               "optimization_level": "-O"}
#: the vLLM-only arguments that are yes/no flags there (``--trust-remote-code``, no value); the
#: others take one value
VLLM_FLAGS = frozenset({
    "trust_remote_code", "disable_log_stats", "disable_log_requests", "disable_custom_all_reduce",
    "disable_async_output_proc", "use_v2_block_manager", "enable_sleep_mode", "enable_lora",
    "enable_expert_parallel", "async_scheduling", "skip_tokenizer_init", "enable_prefix_caching_hash",
    "disable_sliding_window", "disable_cascade_attn", "enable_prompt_embeds",
    "enable_trace_replay", "enable_return_routed_experts", "disable_chunked_mm_input", "enable_log_requests",
})
#: the vLLM-only arguments that take a list of ints there (``--cuda-graph-sizes 1 2 4``)
VLLM_INT_LISTS = frozenset({"cuda_graph_sizes", "cudagraph_capture_sizes"})


def add_cli_args(cls, parser):
    """Add each field of the dataclass ``cls`` to ``parser`` (a parser or an argument group) as
    ``--kebab-case`` with the field's default (bools as ``--x / --no-x``, dicts as JSON), and
    return ``parser``; ``vars(parser.parse_args())`` is then a valid ``LLM(**kwargs)``.

    vLLM's own arguments that ``LLM`` accepts for compatibility (``minivllm.config``'s
    ``IGNORED_VLLM_ARGS`` and ``LACKING_VLLM_ARGS``) are options too, hidden from ``--help`` and
    present in the namespace only when given (``--trust-remote-code``, ``--swap-space 4``), so
    ``LLM`` warns about or refuses them as it does in Python; ``ARG_ALIASES``' spellings
    (``--num-gpu-blocks-override 64``, ``--kvcache-block-size 16``) set the field they name."""
    from minivllm.config import ARG_ALIASES, IGNORED_VLLM_ARGS, LACKING_VLLM_ARGS, SPEC_SHORTCUTS

    hints = typing.get_type_hints(cls)
    # the whole docstring entry (its defaults are often in its second sentence), without reST's ``quotes``
    helps = {n: h.replace("``", "").replace(":mod:", "").replace("%", "%%")
             for n, h in _help_by_name(cls).items()}
    fields = dataclasses.fields(cls)
    for f in fields:
        kind, convert = _option_kind(hints[f.name])
        flags = ["--" + f.name.replace("_", "-")] + ([SHORT_FLAGS[f.name]] if f.name in SHORT_FLAGS else [])
        text = helps.get(f.name, "")
        if kind == "bool":
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            suffix = "" if f.default is None else " (default: %(default)s)"  # None: the text says what applies
            if f.name in HUMAN_READABLE:
                convert = HUMAN_READABLE[f.name]
                suffix += (" (1k = 1000, 1K = 1024" + (", auto = -1" if f.name == "max_model_len" else "") + ")")
            parser.add_argument(*flags, type=convert, default=f.default, help=text + suffix)
    ours = {f.name for f in fields}
    taken = parser._option_string_actions  # (a group shares its parser's): a script's own option stays its own
    for alias, name in ARG_ALIASES.items():  # other engines' spellings (--num-gpu-blocks-override); from_cli_args
        flag, target = "--" + alias.replace("_", "-"), taken.get("--" + name.replace("_", "-"))  # renames them
        if name in ours and flag not in taken and target is not None:
            parser.add_argument(flag, dest=alias, type=target.type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for name in sorted((set(IGNORED_VLLM_ARGS) | set(LACKING_VLLM_ARGS) | set(SPEC_SHORTCUTS)) - ours):
        flags = ["--" + name.replace("_", "-")] + ([SHORT_FLAGS[name]] if name in SHORT_FLAGS else [])
        if any(flag in taken for flag in flags):
            continue
        if name in VLLM_FLAGS:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif name in VLLM_INT_LISTS:
            parser.add_argument(*flags, dest=name, type=int, nargs="*", default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(*flags, dest=name, type=loose_value, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
    return parser


def from_cli_args(cls, args: argparse.Namespace):
    """``cls`` built from parsed ``args``: its fields, and the vLLM-only arguments given (warned
    about or refused as ``LLM(...)`` does: ``EngineArgs.from_kwargs``); other attributes (a
    script's own options) are left alone.

    Raises:
        ValueError: a bad value, as ``cls`` raises it.
        TypeError: a vLLM argument for a feature minivllm lacks, or an argument given both under
            its name (not at its default) and an alias (``EngineArgs.from_kwargs``)."""
    from minivllm.config import ARG_ALIASES, IGNORED_VLLM_ARGS, LACKING_VLLM_ARGS, SPEC_SHORTCUTS

    names = ({f.name for f in dataclasses.fields(cls)} | set(IGNORED_VLLM_ARGS) | set(LACKING_VLLM_ARGS)
             | set(SPEC_SHORTCUTS) | set(ARG_ALIASES))
    given = {k: v for k, v in vars(args).items() if k in names}
    return cls.from_kwargs(given.pop("model", None), given)
