"""What the command line's ``generate`` and ``chat`` share: the engine options, the thread choice
and the line of measured figures printed after a completion."""
from __future__ import annotations

import argparse
import sys

__all__ = ["BACKEND_HELP", "DEVICE_HELP", "DTYPE_HELP", "THREADS_HELP", "CommandRun", "add_engine_options",
           "apply_threads", "banner", "measured_line"]

DEVICE_HELP = "'auto' (default: CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'"
DTYPE_HELP = "'auto' (default: bfloat16 on CUDA, float32 on CPU), 'float32', 'bfloat16' or 'float16'"
BACKEND_HELP = ("'auto' (default: flash_attn on CUDA where installed, else triton on CUDA, else torch), "
                "'torch', 'triton' or 'flash_attn'")
THREADS_HELP = ("torch CPU threads. 'auto' (default): of the cores this process may run on, those "
                "the 1-minute load average leaves idle, at most $OMP_NUM_THREADS where set, at least 1 "
                "(OpenMP threads wait on each other, so a thread on a core another process holds slows "
                "every step down); an int N from 1 to 1024: exactly N")


def with_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """A ``SamplingParams.<field>=...`` or engine argument's ``<field>=...`` error with the option that
    set the field in front of it (the options' names are the fields', as argparse derives them:
    ``--top-p`` sets ``top_p``, ``--max-model-len`` ``max_model_len``)."""
    message = message.removeprefix("prompt 0: ")  # the command's one prompt: "prompt 0" says nothing
    for action in parser._actions:
        if action.option_strings and (message.startswith(f"SamplingParams.{action.dest}=")
                                      or message.startswith(f"{action.dest}=")):
            return f"{action.option_strings[0]}: {message}"
    # the fixes a message gives as Python arguments, as this command's options
    for python, option in (("SamplingParams(truncate_prompt_tokens=N)", "--truncate-prompt-tokens N"),
                           ("a max_model_len of", "a --max-model-len of"),
                           ("LLM(tokenizer=<its directory>)", "--tokenizer <its directory>")):
        message = message.replace(python, option)
    return message


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer``, ``--device``, ``--dtype``, ``--attention-backend`` and ``--threads``."""
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="the tokenizer's directory, where the model's has none (as vLLM's --tokenizer; "
                             "default: the model's own)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    parser.add_argument("--attention-backend", default="auto", help=BACKEND_HELP)
    parser.add_argument("--threads", default="auto", help=THREADS_HELP)


def apply_threads(args) -> None:
    """Set torch's CPU threads as ``--threads`` asks (not for a CUDA run) and say so on stderr.

    Raises:
        ValueError: a ``--threads`` value that is neither 'auto' nor an int from 1 to 1024."""
    import torch

    from minivllm.utils.threads import choose_threads

    choice = choose_threads(args.threads)
    if choice.threads is not None and not (args.device.startswith("cuda")
                                           or (args.device == "auto" and torch.cuda.is_available())):
        torch.set_num_threads(choice.threads)
        print(f"# {choice.reason}", file=sys.stderr)


def banner(engine, load_s: float) -> str:
    """The ``# model=...`` line: what runs, and how long it took to load (seconds)."""
    # the torch backend's CPU decode and prompt attention run in our C kernels where they built: "+C"
    native = getattr(getattr(engine.runner, "backend", None), "native_kernels", False)
    return (f"# model={engine.source.name} device={engine.config.device} dtype={engine.config.dtype} "
            f"attention={engine.config.attention_backend}{'+C' if native else ''} (loaded in {load_s:.2f} s)")


def measured_line(metrics, completion, device) -> str:
    """``# N tokens (finish reason); TTFT; TPOT; tokens/s (measured on DEVICE)`` of one finished
    request: its ``RequestMetrics`` (ms figures; tokens/s from arrival, as TTFT) and its
    ``CompletionOutput``."""
    n = len(metrics.token_times)
    tps = f"{n / (metrics.e2e_ms / 1e3):.1f} tokens/s" if metrics.e2e_ms else "n/a tokens/s"
    ttft = f"{metrics.ttft_ms:.2f} ms" if metrics.ttft_ms is not None else "n/a (no token)"
    tokens = f"{n} token{'' if n == 1 else 's'}"
    tpot = f"{metrics.tpot_ms:.2f} ms" if metrics.tpot_ms is not None else f"n/a ({tokens})"
    why = completion.finish_reason + (f" at {completion.stop_reason!r}"
                                      if isinstance(completion.stop_reason, str) else "")
    return f"# {tokens} ({why}); TTFT {ttft}; TPOT {tpot}; {tps} (measured on {device})"


class CommandRun:
    """One run of a command that streams text from an engine: the engine (``self.llm``, shut down
    by :meth:`close` however the run ends) and whether a line is open on stdout (:meth:`end_line`
    closes it). Subclasses define :meth:`go`, returning the exit status; :meth:`main` runs it."""

    def __init__(self, args):
        self.args, self.llm, self.open_line = args, None, False

    def end_line(self) -> None:
        if self.open_line:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open_line = False

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    def go(self) -> int:
        raise NotImplementedError

    def main(self) -> int:
        """:meth:`go`, with Ctrl-C (status 130, "interrupted" on stderr) and a reader that went away
        (``| head``: quietly, status 141) handled as other commands do, and the engine shut down."""
        try:
            return self.go()
        except KeyboardInterrupt:
            self.end_line()
            print("interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            from minivllm.utils.cli_exit import stdout_gone

            return stdout_gone()
        finally:
            self.close()
