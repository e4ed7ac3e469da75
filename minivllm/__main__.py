"""Command line: ``minivllm generate "prompt"``, ``minivllm chat`` and ``minivllm bench`` (also
``python -m minivllm ...``)."""
from __future__ import annotations

import argparse
import os
import sys
import time


from minivllm.utils.cli_common import CommandRun, add_engine_options, apply_threads, banner, measured_line, with_flag


def prog_name() -> str:
    """How the command was started: ``minivllm`` (the console script) or ``python -m minivllm``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "minivllm" if name == "minivllm" else "python -m minivllm"


def build_generate_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The arguments of ``minivllm generate``."""
    parser = argparse.ArgumentParser(prog=f"{prog or prog_name()} generate",
                                     description="Stream a completion and print measured TTFT, TPOT and tokens/s.")
    parser.add_argument("prompt", help="prompt text, or - to read it from standard input (a pipe or a file)")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, 'minivllm-tiny' or 'random:<preset>' (random weights at a real "
                             "shape, e.g. random:qwen3-0.6b); default: $MINIVLLM_MODEL if set, else minivllm-tiny")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="most tokens to generate (default 64; fewer when the model's max_model_len "
                             "leaves less room, with a warning)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens whose probabilities add up to this "
                             "value (default 1.0: all)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample from the K most likely tokens (default 0: all)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 1 makes tokens already in the prompt or output less likely (default 1.0: off)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="end the completion where its text reaches TEXT (left out of the output); "
                             "repeat for several. Backslash escapes as in Python: --stop '\\n' stops at the end "
                             "of the line")
    parser.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                        help="keep only the prompt's last N tokens (SamplingParams.truncate_prompt_tokens)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens of prompt and completion together (default: the model's length)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token (to --max-tokens)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of this request's own generator at temperature > 0; without it the engine-wide "
                             "generator draws, seeded with 0 when the engine starts, so this "
                             "one-request command repeats its output either way")
    add_engine_options(parser)
    return parser


def _unescape(text: str) -> str:
    """A command-line stop string with Python's backslash escapes applied (``\\n`` -> newline), so a
    shell need not pass control characters.

    Raises:
        ValueError: a malformed escape, naming the string."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(f"--stop '{text}': not a valid backslash escape ({e.reason})") from None


def _generate(argv: list[str]) -> int:
    parser = build_generate_parser()
    args = parser.parse_args(argv)
    if args.prompt == "-":  # the shell's convention: `cat prompt.txt | minivllm generate -`
        args.prompt = sys.stdin.read().removesuffix("\n")  # the newline that ends a file, not the text's own
    if not args.prompt:  # before the model loads (the engine would refuse it a second and a half later)
        print("error: the prompt is empty: give the text to continue, e.g. generate \"The list type\"",
              file=sys.stderr)
        return 2
    try:  # a byte that is not UTF-8 in the shell's argument arrives as a lone surrogate the tokenizer refuses
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        print(f"error: the prompt {args.prompt!r} is not valid UTF-8 text", file=sys.stderr)
        return 2
    return _GenerateRun(args, parser).main()


class _GenerateRun(CommandRun):
    """One ``generate`` command (``CommandRun``: its engine and its open line)."""

    def __init__(self, args, parser):
        super().__init__(args)
        self.parser = parser

    def prompt_used(self, out) -> str:
        """The prompt as the model saw it: with --truncate-prompt-tokens, its last tokens (said on stderr)."""
        n = self.args.truncate_prompt_tokens
        kept = out.prompt_token_ids
        if n is None or kept is None or out.prompt is None:
            return self.args.prompt
        full = len(self.llm.get_tokenizer().encode(self.args.prompt))
        if full <= len(kept):
            return self.args.prompt
        print(f"# the prompt was cut to its last {len(kept)} of {full} tokens (--truncate-prompt-tokens {n})",
              file=sys.stderr)
        return self.llm.get_tokenizer().decode(kept)

    def go(self) -> int:
        args = self.args
        from minivllm import LLM, SamplingParams

        try:
            apply_threads(args)
            stop = [_unescape(text) for text in args.stop] if args.stop else None
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    repetition_penalty=args.repetition_penalty, seed=args.seed,
                                    max_tokens=args.max_tokens, stop=stop, ignore_eos=args.ignore_eos,
                                    truncate_prompt_tokens=args.truncate_prompt_tokens)
            t0 = time.perf_counter()
            self.llm = llm = LLM(args.model, device=args.device, dtype=args.dtype,
                                 attention_backend=args.attention_backend, max_model_len=args.max_model_len,
                                 tokenizer=args.tokenizer)
            load_s = time.perf_counter() - t0
            engine = llm.llm_engine
            print(banner(engine, load_s), file=sys.stderr)
            last = None
            for out in llm.stream(args.prompt, params):
                if last is None:  # written once the request is in: a warning about it comes before, not mid-line
                    sys.stdout.write(self.prompt_used(out))
                    self.open_line = True
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
                last = out
        except (ValueError, FileNotFoundError) as e:
            self.end_line()
            print(f"error: {with_flag(str(e), self.parser)}", file=sys.stderr)
            return 2
        self.end_line()
        if last is None:
            print("error: the engine returned no output for the request", file=sys.stderr)
            return 1
        out = last.outputs[0]
        print(measured_line(last.metrics, out, engine.config.device), file=sys.stderr)
        if out.finish_reason == "error":
            print(f"error: {last.error or 'the request ended in an error'}", file=sys.stderr)
            return 1
        return 0


def _chat(argv: list[str]) -> int:
    from minivllm.chat_command import run_chat

    return run_chat(argv, prog_name())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"generate": _generate, "chat": _chat}
    if argv and argv[0] in ("--version", "-V"):  # as vLLM's `vllm --version`
        from minivllm import __version__

        print(__version__)
        return 0
    if argv and argv[0] == "bench":
        from minivllm.bench import main as bench_main

        return bench_main(argv[1:]) or 0
    if not argv or argv[0] not in commands:
        prog = prog_name()
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(f"usage: {prog} {{generate,chat,bench}} ...\n"
              "  generate PROMPT [--model PATH] [--max-tokens N] ...   stream a completion\n"
              "  chat [--model PATH] [--system TEXT] ...               talk with the model, turn by turn\n"
              "  bench [--model M] [--sweep] [--overhead] ...          offline benchmark vs transformers\n"
              "  each takes --threads {auto,N}: torch CPU threads (auto: the cores the load average leaves idle)\n"
              f"  {prog} generate --help, {prog} chat --help, {prog} bench --help: every option; {prog} --version",
              file=sys.stdout if asked else sys.stderr)
        if argv and not asked:
            print(f"error: unknown command {argv[0]!r} (choose generate, chat or bench)", file=sys.stderr)
        return 0 if asked else 2
    return commands[argv[0]](argv[1:])

if __name__ == "__main__":
    sys.exit(main())
