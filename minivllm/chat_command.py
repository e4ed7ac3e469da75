"""``minivllm chat``: a conversation with the model in the terminal (vLLM's ``vllm chat`` talks to a
server; this one runs the engine in its own process).

Each line read is a user turn: the whole conversation so far is rendered with the model's chat
template (``LLM.chat``'s rendering) and the reply streams to stdout as it is generated, followed
on stderr by its measured figures (as ``generate`` prints them). ``/reset`` forgets the
conversation, ``/exit`` (or end of input, Ctrl-D) ends it. Ctrl-C during a reply stops it and drops
that turn (the request is aborted; the engine keeps serving); Ctrl-C at the prompt ends the command.
Standard input may be a pipe: then no prompt is shown.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from minivllm.utils.cli_common import CommandRun, add_engine_options, apply_threads, banner, measured_line

__all__ = ["build_chat_parser", "run_chat"]

HELP = "commands: /reset forgets the conversation, /exit ends it (or Ctrl-D); Ctrl-C stops a reply"


def build_chat_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments of ``minivllm chat``."""
    parser = argparse.ArgumentParser(prog=f"{prog} chat", description=(
        "Talk with the model: each line you type is a turn, the reply streams back with its measured TTFT and "
        "TPOT. " + HELP + "."))
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (its tokenizer must have a chat template), 'minivllm-tiny' or "
                             "'random:<preset>'; default: $MINIVLLM_MODEL if set, else minivllm-tiny")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message to start the conversation")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens of each reply (default 256)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default: the model's generation_config.json, else 1.0; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config.json, else 1.0")
    parser.add_argument("--top-k", type=int, default=None, help="default: the model's generation_config.json, else 0 (all)")
    parser.add_argument("--seed", type=int, default=None, help="seed of each reply's own generator (repeatable replies)")
    parser.add_argument("--chat-template-kwargs", type=json.loads, default=None, metavar="JSON",
                        help='extra chat-template variables, e.g. \'{"enable_thinking": false}\' for Qwen3')
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens of the whole conversation (default: the model's length)")
    add_engine_options(parser)
    return parser


def run_chat(argv: list[str], prog: str) -> int:
    """Run the command; returns its exit status (0, 2 for a refused argument, 130 for Ctrl-C at the prompt)."""
    return _ChatSession(build_chat_parser(prog).parse_args(argv)).main()


class _ChatSession(CommandRun):
    """One ``chat`` command (``CommandRun``: its engine and its open line) and its conversation."""

    def __init__(self, args):
        super().__init__(args)
        self.messages: list[dict] = []

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def go(self) -> int:
        args = self.args
        from minivllm import LLM

        try:
            apply_threads(args)
            t0 = time.perf_counter()
            self.llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                           max_model_len=args.max_model_len)
            load_s = time.perf_counter() - t0
            params = self.llm.get_default_sampling_params()  # the model's recommended settings, then the options
            for name in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
                if getattr(args, name) is not None:
                    setattr(params, name, getattr(args, name))
            self.llm.llm_engine.check_sampling_params(params)
            self.llm._chat_prompts([{"role": "user", "content": "?"}],  # a template now, not at the first turn
                                   chat_template_kwargs=args.chat_template_kwargs)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(banner(self.llm.llm_engine, load_s), file=sys.stderr)
        interactive = sys.stdin.isatty()
        if interactive:
            print(f"# {HELP}", file=sys.stderr)
        self.reset()
        while True:
            line = self.read_line(interactive)
            if line is None or line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                self.reset()
                print("# the conversation is forgotten", file=sys.stderr)
                continue
            self.turn(line, params)

    @staticmethod
    def read_line(interactive: bool) -> str | None:
        """The next user line, None at the end of input."""
        if interactive:
            try:
                return input("> ")
            except EOFError:
                return None
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None

    def turn(self, text: str, params) -> None:
        """One user turn: render, stream the reply, keep it in the conversation (or drop the turn
        when it fails or is interrupted)."""
        llm = self.llm
        self.messages.append({"role": "user", "content": text})
        reply, last = [], None
        try:
            prompts, tokenization = llm._chat_prompts(self.messages,
                                                      chat_template_kwargs=self.args.chat_template_kwargs)
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
            print(f"error: {e} (this turn is dropped; /reset starts the conversation again)", file=sys.stderr)
            return
        self.end_line()
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        if last is not None:
            print(measured_line(last.metrics, last.outputs[0], llm.llm_engine.config.device), file=sys.stderr)
            if last.outputs[0].finish_reason == "error":
                print(f"error: {last.error or 'the request ended in an error'}", file=sys.stderr)
