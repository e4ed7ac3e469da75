"""``minivllm chat``: a conversation with the model in the terminal (vLLM's ``vllm chat`` talks to a
server; this one runs the engine in its own process).

Each line read is a user turn: the whole conversation so far is rendered with the model's chat
template (``LLM.chat``'s rendering) and the reply streams to stdout as it is generated, followed
on stderr by its measured figures (as ``generate`` prints them) and how many of the prompt's tokens
came from the prefix cache (the conversation so far, whole blocks of it). ``/reset`` forgets the
conversation, ``/exit`` (or end of input, Ctrl-D) ends it. Ctrl-C during a reply stops it and drops
that turn (the request is aborted; the engine keeps serving); Ctrl-C at the prompt ends the command.
Standard input may be a pipe: then no prompt is shown, and the command exits 1 if a turn was refused.
``--quick MESSAGE`` (vLLM's ``-q``) sends one message, prints the reply and exits.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time

from minivllm.utils.cli_common import CommandRun, add_engine_options, apply_threads, banner, measured_line, with_flag

__all__ = ["build_chat_parser", "run_chat"]

HELP = "commands: /reset forgets the conversation, /exit ends it (or Ctrl-D); Ctrl-C stops a reply"


def _json_object(text: str) -> dict:
    """``--chat-template-kwargs``' value: a JSON object (argparse reports the error as the option's)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text}: must be a JSON object of template variables, e.g. "
                                         '\'{"enable_thinking": false}\'')
    fixed = sorted(value.keys() & {"add_generation_prompt", "continue_final_message"})
    if fixed:  # LLM.chat's own arguments win over these (vLLM 0.34's order): here they would change nothing
        raise argparse.ArgumentTypeError(f"{fixed}: the chat loop sets these itself (each turn opens the "
                                         "assistant's reply); leave them out")
    return value


def build_chat_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments of ``minivllm chat``."""
    parser = argparse.ArgumentParser(prog=f"{prog} chat", description=(
        "Talk with the model: each line you type is a turn, the reply streams back with its measured TTFT and "
        "TPOT. " + HELP + "."))
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (its tokenizer must have a chat template), 'minivllm-tiny' or "
                             "'random:<preset>'; default: $MINIVLLM_MODEL if set, else minivllm-tiny")
    parser.add_argument("--system", "--system-prompt", dest="system", default=None, metavar="TEXT",
                        help="a system message to start the conversation (--system-prompt: vLLM's name)")
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                        help="send this one message, print the reply and exit (as vLLM's chat -q)")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens of each reply (default 256)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default: the model's generation_config.json, else 1.0; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config.json, else 1.0")
    parser.add_argument("--top-k", type=int, default=None, help="default: the model's generation_config.json, else 0 (all)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of each reply's own generator at temperature > 0; without it the engine-wide "
                             "generator draws, seeded with 0 when the engine starts, so a run's replies repeat "
                             "either way")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template, or a file holding one, used instead of the tokenizer's "
                             "(as vLLM's --chat-template)")
    parser.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                        help='extra chat-template variables, e.g. \'{"enable_thinking": false}\' for Qwen3')
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens of the whole conversation (default: the model's length)")
    add_engine_options(parser)
    return parser


def run_chat(argv: list[str], prog: str) -> int:
    """Run the command; returns its exit status (0, 2 for a refused argument, 130 for Ctrl-C at the prompt)."""
    parser = build_chat_parser(prog)
    return _ChatSession(parser.parse_args(argv), parser).main()


class _ChatSession(CommandRun):
    """One ``chat`` command (``CommandRun``: its engine and its open line) and its conversation."""

    def __init__(self, args, parser):
        super().__init__(args)
        self.parser = parser
        self.messages: list[dict] = []
        self.refused = 0  # turns refused (the status of a piped run)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def go(self) -> int:
        args = self.args
        if args.quick is not None and not args.quick.strip():  # (before loading the model)
            print("error: -q/--quick: the message is empty", file=sys.stderr)
            return 2
        from minivllm import LLM

        try:
            apply_threads(args)
            t0 = time.perf_counter()
            self.llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                           max_model_len=args.max_model_len, chat_template=args.chat_template,
                           tokenizer=args.tokenizer)
            load_s = time.perf_counter() - t0
            params = self.llm.get_default_sampling_params()  # the model's recommended settings, then the options
            for name in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
                if getattr(args, name) is not None:
                    setattr(params, name, getattr(args, name))
            self.llm.llm_engine.check_sampling_params(params)
            self.reset()
            # the template with the system message and the variables now, not at every turn
            self.render(self.messages + [{"role": "user", "content": "?"}])
        except (ValueError, TypeError, FileNotFoundError) as e:
            message = with_flag(str(e), self.parser).replace(
                "(pass chat_template=...)", "(give one with --chat-template, or use a model whose tokenizer has one; "
                "generate needs none)")
            print(f"error: {message}", file=sys.stderr)
            return 2
        print(banner(self.llm.llm_engine, load_s), file=sys.stderr)
        if args.quick is not None:
            self.turn(args.quick, params)
            return 1 if self.refused else 0
        interactive = sys.stdin.isatty()
        if interactive:
            try:  # input() then edits the line (arrows, history); not on every platform
                importlib.import_module("readline")
            except ImportError:
                pass

            print(f"# {HELP}", file=sys.stderr)
        while True:
            line = self.read_line(interactive)
            if line is None or line.strip() in ("/exit", "/quit"):
                return 1 if self.refused and not interactive else 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                self.reset()
                print("# the conversation is forgotten", file=sys.stderr)
                continue
            if re.fullmatch(r"/[A-Za-z]\w*", line.strip()):  # a mistyped command is not a turn for the model
                print(f"# unknown command {line.strip()}: {HELP}", file=sys.stderr)
                continue
            self.turn(line, params)

    @staticmethod
    def read_line(interactive: bool) -> str | None:
        """The next user line, None at the end of input."""
        if interactive:
            try:
                return input("> ")
            except EOFError:  # Ctrl-D: end the prompt's line before the shell's
                print(file=sys.stderr)
                return None
            except KeyboardInterrupt:
                print(file=sys.stderr)
                raise
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None  # (a file written on Windows ends its lines with \r\n)

    def render(self, messages: list[dict]) -> tuple[list[str], dict]:
        """``LLM.chat``'s rendering of ``messages`` with ``--chat-template-kwargs``.

        Raises:
            ValueError: what ``LLM.chat`` refuses, and a variable of the wrong type for the template
                (jinja's TypeError or TemplateError, given as a ValueError naming the variables)."""
        from jinja2 import TemplateError

        kwargs = self.args.chat_template_kwargs
        try:
            return self.llm._chat_prompts(messages, chat_template_kwargs=kwargs)
        except (TypeError, TemplateError) as e:
            template = "the --chat-template" if self.args.chat_template else "the model's chat template"
            whose = (f"--chat-template-kwargs {json.dumps(kwargs)}: {template} failed with them" if kwargs
                     else f"{template} refused the conversation")
            raise ValueError(f"{whose} ({type(e).__name__}: {e})") from None

    def turn(self, text: str, params) -> None:
        """One user turn: render, stream the reply, keep it in the conversation (or drop the turn
        when it fails or is interrupted)."""
        llm = self.llm
        self.messages.append({"role": "user", "content": text})
        reply, last, prompts = [], None, None
        try:
            prompts, tokenization = self.render(self.messages)
            stream = llm.stream(prompts[0], params, tokenization_kwargs=tokenization)
            try:
                for out in stream:
                    piece = out.outputs[0].text
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                    self.open_line = True
                    last = out
            finally:
                stream.close()  # an interrupt mid-reply aborts the request here
        except KeyboardInterrupt:
            self.end_line()
            self.messages.pop()
            print("# interrupted: this turn is dropped", file=sys.stderr)
            return
        except ValueError as e:  # a conversation grown past max_model_len, a bad template variable
            self.end_line()
            self.messages.pop()
            self.refused += 1
            message = with_flag(str(e), self.parser)  # "prompt 0: " dropped, a field named by its option
            if "leaves no room to generate" in message and prompts:
                n = len(llm.get_tokenizer().encode(prompts[0], add_special_tokens=False))
                message = (f"the conversation with this turn is {n} tokens, which leaves no room for a reply within "
                           f"max_model_len={llm.llm_engine.config.max_model_len} (--max-model-len)")
            print(f"error: {message} (this turn is dropped; /reset starts the conversation again)", file=sys.stderr)
            return
        self.end_line()
        failed = last is not None and last.outputs[0].finish_reason == "error"
        if failed:  # no reply to keep: the turn is dropped, as a refused one
            self.messages.pop()
            self.refused += 1
        else:
            self.messages.append({"role": "assistant", "content": "".join(reply)})
        if last is not None:
            # the conversation so far is the next turn's prompt prefix: the prefix cache holds its KV blocks
            cached = (f"; prompt {len(last.prompt_token_ids)} tokens, {last.num_cached_tokens or 0} of them from the "
                      "prefix cache" if last.prompt_token_ids else "")
            print(measured_line(last.metrics, last.outputs[0], llm.llm_engine.config.device) + cached, file=sys.stderr)
            if failed:
                print(f"error: {last.error or 'the request ended in an error'} (this turn is dropped)", file=sys.stderr)
