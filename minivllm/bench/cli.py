"""``python -m minivllm bench``: argument parsing, thread choice, and running the modes."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from minivllm.bench.common import loadavg, wants_cuda
from minivllm.bench.overhead import run_overhead
from minivllm.bench.report import print_throughput
from minivllm.bench.sweep import run_sweep
from minivllm.bench.throughput import HF_PEERS, run_throughput
from minivllm.bench.workload import WORKLOADS, check_scale
from minivllm.config import KV_CACHE_DTYPES
from minivllm.utils.threads import ThreadChoice, choose_threads

__all__ = ["build_parser", "main", "run_cli"]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The arguments of ``minivllm bench`` (``prog``: the command's name, default as it was started)."""
    from minivllm.__main__ import prog_name
    from minivllm.utils.cli_common import BACKEND_HELP, DEVICE_HELP, DTYPE_HELP

    p = argparse.ArgumentParser(prog=f"{prog or prog_name()} bench",
                                description="Offline throughput against transformers (default), roofline sweeps "
                                            "(--sweep), engine overhead against nano-vllm (--overhead), speculative "
                                            "decoding (--speculative) and int8 weights (--quantization), each "
                                            "measured in this run.")
    p.add_argument("--model", default=None,
                   help="the embedded model, 'random:qwen3-0.6b', or a local checkpoint directory; default: "
                        "$MINIVLLM_MODEL if set, else the embedded minivllm-tiny")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="'nano' (256 requests, 100..1024 in/out; default on GPU) or 'cpu' (32 requests; default on CPU)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the workload's number of requests")
    p.add_argument("--num-requests", type=int, default=None, help="number of requests (overrides --workload's)")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="prompt lengths, uniform in MIN..MAX tokens (overrides --workload's)")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="output lengths, uniform in MIN..MAX tokens (overrides --workload's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's random prompts and lengths (default 0)")
    p.add_argument("--no-peers", action="store_true", help="run minivllm only")
    p.add_argument("--peers", default="hf_generate,hf_generate_batch",
                   help="comma-separated: hf_generate, hf_generate_batch")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="batch size of transformers generate (default: 64 on GPU; on CPU 32, or the number of requests if fewer)")
    p.add_argument("--sweep", action="store_true",
                   help="decode vs batch and prefill vs length, with a roofline; decode steps over their matmuls alone")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="write --sweep's roofline chart (plotly HTML) to PATH; without it no file is written")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="for --sweep / --overhead / --speculative")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="for --sweep: the prefill rows' prompt lengths")
    p.add_argument("--context-len", type=int, default=None,
                   help="for --sweep: the decode rows' prompt length in tokens (default 128)")
    p.add_argument("--overhead", action="store_true", help="engine overhead with the model stubbed out")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="timed decode steps for --sweep (default 12) / --overhead (default 64); new tokens per "
                        "request for --speculative (default 96) / --quantization")
    p.add_argument("--threads", default="auto",
                   help="torch CPU threads (torch.set_num_threads) for minivllm and the peers alike. 'auto' "
                        "(default): of the cores this process may run on, those the 1-minute load average leaves "
                        "idle, at most $OMP_NUM_THREADS where set, at least 1 (OpenMP threads "
                        "wait on each other, so threads on cores other processes hold slow a step down: 4.6 against 38.7 "
                        "tokens/s with 2 threads and 1 on the 2-core dev machine beside two busy processes, "
                        "README); "
                        "GPU runs keep torch's default")
    p.add_argument("--nanovllm-script", default=None,
                   help="nano-vllm's overhead script for --overhead (default: ../shared/peers/nanovllm_overhead.py "
                        "beside the repository)")
    p.add_argument("--no-nanovllm", action="store_true", help="--overhead without the nano-vllm peer rounds")
    p.add_argument("--speculative", default=None, nargs="+", choices=["ngram", "draft"],
                   help="greedy decode TPOT with and without speculative decoding (ngram: prompt lookup; draft: "
                        "the draft model --draft-model) on prompts whose continuation repeats their context, at "
                        "--batch-sizes (default 1 4 16 64: where speculation stops paying); --decode-steps new "
                        "tokens per request (default 96). Several methods are measured against the same unmodified engine")
    p.add_argument("--draft-model", default=None,
                   help="draft checkpoint for --speculative draft (default: the embedded minivllm-tiny-draft)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step for --speculative (default 4)")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="batch-1 decode of LLM(quantization=...) against the unquantised engine in the same run "
                        "(speed ratio, MBU on int8 bytes, greedy agreement); --decode-steps tokens per round")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per engine: --quantization and --speculative (default 3, the engines "
                        "alternating); --overhead (default 5), each minivllm round followed by one of "
                        "nano-vllm's, the ratio the median of the rounds'")
    p.add_argument("--no-quantize-lm-head", action="store_true", help="--quantization with the LM head kept in float")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--quiet", action="store_true", help="print nothing (with --json: the results only go there)")
    e = p.add_argument_group("engine arguments (as LLM(...) takes them; default: the engine's)")
    e.add_argument("--device", default=None, help=DEVICE_HELP)
    e.add_argument("--dtype", default=None, help=DTYPE_HELP)
    e.add_argument("--attention-backend", default=None, help=BACKEND_HELP)
    e.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one engine step")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in one engine step")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    e.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                   help="the KV cache's dtype: 'auto' (the model's) or 'bfloat16' (half the KV bytes of a float32 "
                        "model on a CPU)")
    e.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no decode graphs: CUDA graphs on a GPU, CPU graphs on a CPU")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m minivllm bench``: prints the results, returns exit status 0; a bad
    argument (a ``ValueError`` naming it, or a model or draft model path that does not exist) is
    printed as ``error: ...`` with exit status 2, as ``generate`` does; Ctrl-C prints ``interrupted``
    and returns 130 (each mode shuts its engines down on the way out)."""
    try:
        run_cli(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of the output went away (| head)
        from minivllm.utils.cli_exit import stdout_gone

        return stdout_gone()
    return 0


def run_cli(argv: list[str] | None = None, peak_kwargs: dict | None = None) -> dict:
    """Parse ``python -m minivllm bench`` arguments, run the chosen mode(s), return
    ``{"torch_threads": n, "loadavg": [...], mode: result dataclass, ...}``.
    ``peak_kwargs`` go to ``measure_peaks`` (sizes, repeats).

    Raises:
        ValueError: a bad ``--threads`` value, a bad workload/engine argument, or a flag value no run
            could use (checked before anything runs: ``_check_args``).
        FileNotFoundError: the model or draft model path does not exist.
    """
    args = build_parser().parse_args(argv)
    _check_args(args)
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    import torch

    choice = choose_threads(args.threads)
    if args.threads == "auto" and wants_cuda({"device": args.device}):
        choice = ThreadChoice(None, "GPU run: torch's default thread count")
    previous_threads = torch.get_num_threads()
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    log(choice.reason)
    try:
        return _run_modes(args, log, peak_kwargs)
    finally:
        torch.set_num_threads(previous_threads)


def _check_args(args) -> None:
    """Refuse, before minutes of measuring, the flag values a run would fail on at its end or
    quietly replace: counts below 1, an unknown peer, an output path that is a directory or under a
    file, ``--html`` without ``--sweep`` or without plotly installed, a ``--dtype`` no engine takes.

    Raises:
        ValueError: naming the flag and its value.
    """
    for flag in ("decode_steps", "hf_batch_size", "rounds", "num_requests", "num_speculative_tokens", "context_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={value}: must be at least 1")
    check_scale(args.scale, "--scale ")
    for flag in ("batch_sizes", "prompt_lens"):
        values = getattr(args, flag)
        if values is not None and min(values) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {' '.join(map(str, values))}: each must be at least 1")
    throughput = not (args.sweep or args.overhead or args.speculative or args.quantization)
    _check_flags_have_their_mode(args, throughput)
    if throughput and not args.no_peers:
        unknown = [x.strip() for x in args.peers.split(",") if x.strip() and x.strip() not in HF_PEERS]
        if unknown:
            raise ValueError(f"--peers {args.peers!r}: unknown peer(s) {unknown}; choose from {list(HF_PEERS)}")
    if args.dtype is not None and args.dtype != "auto":  # as generate words it, before any engine is built
        from minivllm.utils.dtypes import MODEL_DTYPES, canonical_dtype_name, dtype_spellings

        if canonical_dtype_name(args.dtype) not in MODEL_DTYPES:
            raise ValueError(f"--dtype {args.dtype!r}: choose 'auto' or one of {dtype_spellings(MODEL_DTYPES)}")
    if args.html is not None and not args.sweep:
        raise ValueError(f"--html {args.html!r}: the chart is --sweep's roofline; add --sweep")
    if args.html is not None and importlib.util.find_spec("plotly") is None:  # else it fails after the sweep
        raise ValueError(f"--html {args.html!r}: the chart needs plotly (pip install 'minivllm[lab]', or plotly)")
    for flag in ("json", "html"):
        value = getattr(args, flag)
        if value is None:
            continue
        path = Path(value)
        if path.is_dir():
            raise ValueError(f"--{flag} {value!r}: a directory; give a file path")
        above = next((q for q in path.absolute().parents if q.exists()), None)
        if above is not None and not above.is_dir():
            raise ValueError(f"--{flag} {value!r}: {str(above)!r} is a file, not a directory")


# flag -> (the modes that read it, as their own flags, or "throughput", the default mode)
_MODE_FLAGS = {
    "prompt_lens": ("sweep",), "context_len": ("sweep",),
    "nanovllm_script": ("overhead",), "no_nanovllm": ("overhead",),
    "draft_model": ("speculative",), "num_speculative_tokens": ("speculative",),
    "no_quantize_lm_head": ("quantization",),
    "batch_sizes": ("sweep", "overhead", "speculative"),
    "rounds": ("overhead", "speculative", "quantization"),
    "decode_steps": ("sweep", "overhead", "speculative", "quantization"),
    "workload": ("throughput",), "num_requests": ("throughput",), "input_len": ("throughput",),
    "output_len": ("throughput",), "hf_batch_size": ("throughput",),
}


def _check_flags_have_their_mode(args, throughput: bool) -> None:
    """A flag of a mode that is not running would be ignored: a mistyped command line (``--draft-model``
    without ``--speculative draft``) then measures something else and says nothing.

    Raises:
        ValueError: naming the flag and the mode(s) that read it."""
    running = {m for m in ("sweep", "overhead", "speculative", "quantization") if getattr(args, m)}
    if throughput:
        running.add("throughput")
    given = {flag: getattr(args, flag) for flag in _MODE_FLAGS if getattr(args, flag) not in (None, False)}
    if args.scale != 1.0:
        given["scale"] = args.scale
    for flag, value in given.items():
        modes = _MODE_FLAGS.get(flag, ("throughput",))
        if running.isdisjoint(modes):
            names = " / ".join("the throughput run (no mode flag)" if m == "throughput" else f"--{m}" for m in modes)
            shown = ("" if value is True else " " + " ".join(map(str, value)) if isinstance(value, list)
                     else f" {value!r}")  # as typed: --no-nanovllm, --batch-sizes 1 4, --draft-model 'x'
            raise ValueError(f"--{flag.replace('_', '-')}{shown}: only {names} reads it, and it is not running")
    if args.draft_model is not None and "draft" not in (args.speculative or ()):
        raise ValueError(f"--draft-model {args.draft_model!r}: only --speculative draft reads it")


def _run_modes(args, log, peak_kwargs) -> dict:
    import torch

    engine_args = {k: getattr(args, k) for k in ("device", "dtype", "attention_backend", "max_num_seqs",
                                                 "max_num_batched_tokens", "block_size", "enforce_eager",
                                                 "kv_cache_dtype")
                   if getattr(args, k) is not None}
    results: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "loadavg": loadavg()}
    if args.sweep:
        kw = {"decode_steps": args.decode_steps} if args.decode_steps is not None else {}
        if args.context_len is not None:
            kw["context_len"] = args.context_len
        results["sweep"] = run_sweep(args.model, batch_sizes=args.batch_sizes, prompt_lens=args.prompt_lens,
                                     html=args.html, seed=args.seed, log=log, peak_kwargs=peak_kwargs, **kw,
                                     **engine_args)
    if args.overhead:
        kw = {"decode_steps": args.decode_steps} if args.decode_steps is not None else {}
        if args.batch_sizes:
            kw["batch_sizes"] = tuple(args.batch_sizes)
        if args.rounds is not None:
            kw["rounds"] = args.rounds
        results["overhead"] = run_overhead(args.model, seed=args.seed, log=log, nanovllm=not args.no_nanovllm,
                                           nanovllm_script=args.nanovllm_script, **kw, **engine_args)
    if args.speculative:
        from minivllm.bench.speculative import print_speculative, run_speculative

        kw = {"decode_tokens": args.decode_steps} if args.decode_steps is not None else {}
        if args.batch_sizes:
            kw["batch_sizes"] = tuple(args.batch_sizes)
        if args.rounds is not None:
            kw["rounds"] = args.rounds
        if args.num_speculative_tokens is not None:
            kw["num_speculative_tokens"] = args.num_speculative_tokens
        results["speculative"] = run_speculative(args.model, method=args.speculative,
                                                 draft_model=args.draft_model, log=log, **kw, **engine_args)
        print_speculative(results["speculative"], log)
    if args.quantization:
        from minivllm.bench.quant import print_quantization, run_quantization

        kw = {"decode_tokens": args.decode_steps} if args.decode_steps is not None else {}
        results["quantization"] = run_quantization(
            args.model, quantization=args.quantization, quantize_lm_head=not args.no_quantize_lm_head,
            rounds=3 if args.rounds is None else args.rounds, seed=args.seed, log=log, peak_kwargs=peak_kwargs,
            **kw, **engine_args)
        print_quantization(results["quantization"], log)
    if not (args.sweep or args.overhead or args.speculative or args.quantization):
        peers = () if args.no_peers else tuple(x.strip() for x in args.peers.split(",") if x.strip())
        results["throughput"] = run_throughput(
            args.model, workload_name=args.workload, scale=args.scale, num_requests=args.num_requests,
            input_len=tuple(args.input_len) if args.input_len else None,
            output_len=tuple(args.output_len) if args.output_len else None, seed=args.seed, peers=peers,
            hf_batch_size=args.hf_batch_size, log=log, peak_kwargs=peak_kwargs, **engine_args)
        print_throughput(results["throughput"], log)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        from minivllm.telemetry.export import _plain

        plain = {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in results.items()}
        path.write_text(json.dumps(_plain(plain), indent=1))
        log(f"results written to {path}")
    return results
