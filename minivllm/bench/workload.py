"""Benchmark workloads: random-token prompts and per-request output lengths.

``nano`` is nano-vllm's benchmark (256 requests, prompt and output lengths uniform in
100..1024, random token ids), drawn as its ``bench.py`` draws them, so seed 0 gives its very
requests; ``cpu`` is a CPU-sized one (32 requests, prompts 16..256, outputs 16..128).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from minivllm.utils.checks import is_count

__all__ = ["WORKLOADS", "Workload", "make_workload"]

WORKLOADS = {
    "nano": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024), draws="nano-vllm"),
    "cpu": dict(num_requests=32, input_len=(16, 256), output_len=(16, 128), draws="interleaved"),
}


@dataclass
class Workload:
    """Prompts (token ids) and the number of tokens to generate for each."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    @property
    def num_requests(self) -> int:
        """Requests in the workload."""
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens asked for over all requests (the sum of their ``max_tokens``)."""
        return sum(self.output_lens)

    def warm_up(self, vocab_size: int, output_len: int = 2) -> "Workload":
        """The same prompt lengths with every token id moved by one (so nothing the timed run
        computes is in a prefix cache) and ``output_len`` tokens each: a warm-up that allocates
        and touches each engine's largest activations (the prefill of every prompt) off the clock."""
        prompts = [[(t + 1) % vocab_size for t in p] for p in self.prompts]
        return Workload(f"{self.name}-warm-up", prompts, [output_len] * len(prompts), self.seed)

    def describe(self) -> dict:
        """The workload's name, size and length statistics (min, max, mean tokens), JSON-ready."""
        pl = [len(p) for p in self.prompts]
        return {"name": self.name, "num_requests": self.num_requests, "seed": self.seed,
                "prompt_len_min": min(pl), "prompt_len_max": max(pl), "prompt_len_mean": statistics.fmean(pl),
                "output_len_min": min(self.output_lens), "output_len_max": max(self.output_lens),
                "output_len_mean": statistics.fmean(self.output_lens),
                "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens}


def check_range(name, r):
    """``r`` as a ``(min, max)`` tuple of ints, ``1 <= min <= max``; else a ValueError naming ``name``."""
    if (not isinstance(r, (tuple, list)) or len(r) != 2 or not all(isinstance(x, int) for x in r)
            or not 1 <= r[0] <= r[1]):
        raise ValueError(f"{name}={r!r}: expected (min, max) with 1 <= min <= max")
    return tuple(r)


def check_scale(scale, label: str = "scale=") -> None:
    """``scale`` (the workload's request-count multiplier) is a positive, finite number.

    Raises:
        ValueError: naming the value after ``label`` ("--scale " on the command line; inf once asked
            for more requests than memory holds)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"{label}{scale!r}: must be a positive, finite number")


def make_workload(name: str = "cpu", vocab_size: int = 10000, *, scale: float = 1.0,
                  num_requests: int | None = None, input_len: tuple[int, int] | None = None,
                  output_len: tuple[int, int] | None = None, max_model_len: int | None = None,
                  seed: int = 0) -> Workload:
    """A reproducible workload, lengths uniform in the ranges (inclusive).

    ``nano`` draws as nano-vllm's ``bench.py`` (GeeeekExplorer/nano-vllm at bb823b3, its main branch): from
    ``random.seed(seed)``, each prompt's length then its ids uniform in ``[0, min(vocab_size - 1,
    10000)]`` (``randint(0, 10000)``), then every output length; with seed 0 and a vocabulary above
    10,000 ids these are its 256 requests (142,827 prompt and 133,966 output tokens). ``cpu`` draws
    each request's two lengths, then its ids in ``[0, min(vocab_size, 10000))``.

    ``scale`` multiplies the preset's request count (ignored when ``num_requests`` is
    given). With ``max_model_len``, a prompt is shortened so prompt + output fits.

    Raises:
        ValueError: an unknown ``name``, a bad ``scale``, ``vocab_size``, ``num_requests`` or range, or (with
            ``max_model_len``) lengths that cannot fit it: the two minimums together, or an output drawn
            that leaves no room for a 1-token prompt.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r}: choose one of {sorted(WORKLOADS)}")
    check_scale(scale)
    if not is_count(vocab_size, 1):
        raise ValueError(f"vocab_size={vocab_size!r}: must be a positive int (the ids are drawn below it)")
    preset = WORKLOADS[name]
    n = num_requests if num_requests is not None else max(1, round(preset["num_requests"] * scale))
    if not is_count(n, 1):  # True was taken as one request
        raise ValueError(f"num_requests={n!r}: must be a positive int")
    n, vocab_size = int(n), int(vocab_size)  # numpy integers too, as plain ints in the workload
    lo_in, hi_in = check_range("input_len", input_len or preset["input_len"])
    lo_out, hi_out = check_range("output_len", output_len or preset["output_len"])
    if max_model_len is not None and lo_in + lo_out > max_model_len:
        raise ValueError(f"input_len min {lo_in} + output_len min {lo_out} exceed max_model_len={max_model_len}")
    rng = random.Random(seed)
    if preset["draws"] == "nano-vllm":
        high = min(vocab_size - 1, 10000)
        prompts = [[rng.randint(0, high) for _ in range(rng.randint(lo_in, hi_in))] for _ in range(n)]
        outs = [rng.randint(lo_out, hi_out) for _ in range(n)]
        _check_outputs_fit(name, outs, output_len, preset["output_len"], max_model_len)
        if max_model_len is not None:
            prompts = [p[:max(1, max_model_len - lo)] for p, lo in zip(prompts, outs)]
        return Workload(name, prompts, outs, seed)
    high = min(vocab_size, 10000) - 1
    prompts, outs = [], []
    for _ in range(n):
        li, lo = rng.randint(lo_in, hi_in), rng.randint(lo_out, hi_out)
        if max_model_len is not None and li + lo > max_model_len:
            li = max(1, max_model_len - lo)
        prompts.append([rng.randint(0, high) for _ in range(li)])
        outs.append(lo)
    _check_outputs_fit(name, outs, output_len, preset["output_len"], max_model_len)
    return Workload(name, prompts, outs, seed)


def _check_outputs_fit(name: str, outs: list[int], output_len, preset_output_len, max_model_len: int | None) -> None:
    """Prompts are shortened to fit ``max_model_len``, outputs are not: a request whose output alone
    leaves no room for a 1-token prompt would end at ``max_model_len`` short of its length, and the
    throughput run would stop at its end on a token count that does not add up.

    Raises:
        ValueError: naming the range, the longest output drawn and ``max_model_len``."""
    if max_model_len is not None and outs and max(outs) + 1 > max_model_len:
        given = (f"output_len={tuple(output_len)!r}" if output_len else
                 f"the {name!r} workload's output lengths {tuple(preset_output_len)!r}")
        raise ValueError(f"{given}: an output of {max(outs)} tokens was drawn, and with a prompt of at least 1 token "
                         f"it exceeds max_model_len={max_model_len} (give shorter output lengths, or a model with "
                         f"a longer max_model_len)")

