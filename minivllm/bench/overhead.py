"""Engine overhead: ``LLMEngine.step()`` with the model and the sampling stubbed out (a fixed
token; the sampler's per-row settings are still built), in microseconds per sequence per
decode step, beside nano-vllm's figure measured by its peer script in rounds that alternate
with minivllm's."""
from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.bench.common import ResultMixin, build_llm, check_batch_sizes, device_label, loadavg, next_tag
from minivllm.bench.peers import NanoVllmOverhead, PeerOverhead, PeerUnavailable
from minivllm.bench.report import overhead_row, print_overhead_comparison
from minivllm.utils import cdiv
from minivllm.utils.checks import is_count

__all__ = ["OverheadResult", "run_overhead", "stub_run"]


@dataclass
class OverheadResult(ResultMixin):
    """What :func:`run_overhead` measured.

    Attributes:
        model / device: what ran; prompt_len / decode_steps / block_size: the set-up (the
            peer's rounds run at the same block size).
        rows: one per batch size: ``us_per_seq_step`` (mean), ``us_per_seq_step_median`` (over
            every timed step), ``round_medians`` (each round's median), ``step_ms_mean`` and the
            StepRecord breakdown (``schedule_ms``, ``prepare_ms``, ``postprocess_ms``,
            ``other_ms``: the rest of ``step()``).
        loadavg: 1/5/15-minute load averages after the run (both engines').
        peer: nano-vllm's figures, its rounds alternating with minivllm's (``None`` when not
            asked for).
    """

    mode: str
    model: str
    device: str
    prompt_len: int
    decode_steps: int
    rows: list = field(default_factory=list)
    loadavg: list | None = None
    peer: PeerOverhead | None = None
    block_size: int | None = None

    def ratios(self) -> dict[int, float]:
        """batch size -> minivllm / nano-vllm (below 1: minivllm is cheaper): the median over
        the rounds of each round's ratio of medians (the two ran back to back, under the same
        load), or without rounds the ratio of the medians; empty without an available peer."""
        if self.peer is None or not self.peer.available:
            return {}
        out = {}
        for r in self.rows:
            b = r["batch_size"]
            per_round = self.round_ratios(r)
            if per_round:
                out[b] = statistics.median(per_round)
            elif self.peer.us_per_seq_step.get(b):
                out[b] = r["us_per_seq_step_median"] / self.peer.us_per_seq_step[b]
        return out

    def round_ratios(self, row: dict) -> list[float]:
        """Each round's minivllm median / nano-vllm median for ``row``'s batch size, in the
        order they ran; empty unless both have every round."""
        ours = row.get("round_medians")
        theirs = self.peer.rounds.get(row["batch_size"]) if self.peer is not None else None
        if not ours or not theirs or len(ours) != len(theirs):
            return []
        return [x / y for x, y in zip(ours, theirs)]


def stub_run(runner, token_id: int):
    """Replacement for ``ModelRunner.run``: build the real inputs (ids, positions, attention
    metadata, on the engine's device) and the sampler's per-row settings
    (``ModelRunner.sampling_batch``, as nano-vllm's peer builds its temperatures in
    ``prepare_sample``), skip the model and the sampling itself, return ``token_id`` for every
    sequence that samples."""
    from minivllm.engine.model_runner import RunnerOutput

    def run(plan):
        t0 = time.perf_counter()
        inp = runner.prepare_input(plan)
        t1 = time.perf_counter()
        if inp.sampling_seqs:
            runner.sampling_batch(inp.sampling_seqs, plan.all_plain_greedy)
        t2 = time.perf_counter()
        return RunnerOutput(inp.sampling_seqs, [token_id] * len(inp.sampling_seqs), set(), (t1 - t0) * 1e3, 0.0,
                            (t2 - t1) * 1e3)

    return run


def run_overhead(model: str | None = None, *, batch_sizes=(1, 16, 64, 256), prompt_len: int = 128,
                 decode_steps: int = 64, warmup_steps: int = 8, rounds: int = 5, seed: int = 0, log=print,
                 nanovllm: bool = True, nanovllm_script: str | Path | None = None, **engine_args) -> OverheadResult:
    """Engine overhead with the model stubbed out: per batch size, the mean and median of
    ``LLMEngine.step()`` wall time over ``rounds`` x ``decode_steps`` decode-only steps, per
    sequence (microseconds), with the StepRecord breakdown (schedule / prepare / postprocess).
    Each round admits its own batch of ``prompt_len``-token requests, prefills them, runs
    ``warmup_steps`` decode steps, times ``decode_steps`` and aborts them, so every round (and
    nano-vllm's, which starts a fresh scheduler) decodes over the same context lengths.

    With ``nanovllm`` (default), nano-vllm's overhead script
    (:class:`minivllm.bench.peers.NanoVllmOverhead`, ``nanovllm_script`` or the shared default
    path) runs a round of its own after each of minivllm's rounds, at the same batch size (its
    own warm-up, and ``max(decode_steps, 50)`` timed steps: :meth:`NanoVllmOverhead.measure`), in
    this process: the ratio is the median over the rounds of the two rounds' medians, so both
    figures of a ratio come from the same few hundred milliseconds (a shared machine's speed
    drifts over minutes: a round's batch-1 ratio ranged 0.47-0.99 in one run, docs/benchmarks.md run AN), and at the engine's block size (a block boundary costs each
    engine an allocation and a block hash). A missing or failing peer is reported in
    ``OverheadResult.peer``, not raised. The first decode step carrying the whole batch is
    always a warm-up step, so ``warmup_steps`` 0 and 1 run the same.

    Raises:
        ValueError: ``rounds`` or ``decode_steps`` below 1, ``warmup_steps`` below 0, ``prompt_len`` not a
            positive int, or a batch size below 1 or above a ``max_num_seqs`` / ``max_num_batched_tokens`` given (naming them).
        RuntimeError: a round's steps did not take the shape the run needs (never expected).
    """
    import torch

    from minivllm.sampling_params import SamplingParams

    if rounds < 1 or decode_steps < 1:
        raise ValueError(f"rounds and decode_steps must be >= 1, got rounds={rounds}, decode_steps={decode_steps}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps}: must be >= 0")
    if not is_count(prompt_len, 1):
        raise ValueError(f"prompt_len={prompt_len!r}: must be a positive int (each request's prompt, tokens)")
    prompt_len = int(prompt_len)  # a numpy integer too, as a plain int in the result
    check_batch_sizes(batch_sizes, engine_args)
    peer, peer_result = None, None
    if nanovllm:
        peer_result = PeerOverhead(True, script=str(nanovllm_script or ""))
        try:
            peer = NanoVllmOverhead(nanovllm_script)
            peer_result.script = str(peer.path)
        except PeerUnavailable as e:
            peer_result.available, peer_result.reason = False, str(e)
    bmax = max(batch_sizes)
    block = engine_args.get("block_size") or 16
    budget = engine_args.get("max_num_batched_tokens") or 8192
    # With chunked prefill the first-admitted sequences start decoding while later ones
    # still prefill, so they run ahead by up to this many steps: give every request room.
    lead = cdiv(bmax * prompt_len, budget) + 2
    max_tokens = warmup_steps + decode_steps + lead + 1
    per_seq = cdiv(prompt_len + max_tokens + 1, block)
    engine_args.setdefault("num_kvcache_blocks", bmax * per_seq + 8)
    engine_args.setdefault("max_num_seqs", max(256, bmax))
    engine_args.setdefault("enable_prefix_caching", True)
    llm = build_llm(model, **engine_args)
    rng = random.Random(seed)
    try:
        engine = llm.llm_engine
        cfg = engine.source.hf_config
        high = min(cfg.vocab_size, 10000) - 1
        token = min(cfg.vocab_size - 1, 100)
        engine.runner.run = stub_run(engine.runner, token)
        rows = []
        if engine.config.device.type == "cpu" and hasattr(os, "getloadavg") and \
                os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1):
            log(f"note: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: other processes compete "
                f"for the CPU, so the times below read high")
        block_size = engine.config.block_size  # resolved by the engine (the backend's default when unset)
        log(f"engine overhead, model stubbed (fixed token), {prompt_len}-token prompts, {block_size}-token KV blocks, "
            f"{rounds} rounds of "
            f"{warmup_steps} warm-up and {decode_steps} timed decode steps per batch size, each round its own "
            f"requests" + (f" and followed by a round of nano-vllm's (its script's 5 warm-up and "
                           f"{max(decode_steps, 50)} timed steps)" if peer is not None else ""))
        log("us/seq/step: mean over every timed step, (median): their median; step ms and sched / prep / post / "
            "other: mean ms per step (the StepRecord's phases; other: the rest of step())")
        log(f"{'batch':>6}{'us/seq/step':>13}{'(median)':>10}{'step ms':>9}{'sched':>8}{'prep':>8}{'post':>8}"
            f"{'other':>8}")
        for b in batch_sizes:
            times, recs, round_medians = [], [], []
            for _ in range(rounds):  # each round its own requests: every round (and the peer's) starts at its prompts
                tag = next_tag()
                rids = [f"ovh{tag}-{i}" for i in range(b)]
                for rid in rids:
                    engine.add_request(rid, [rng.randint(0, high) for _ in range(prompt_len)],
                                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                       output_kind="final_only")  # as LLM.generate (and nano-vllm) do
                # prefill (possibly several chunked steps), then warm-up decodes
                while True:
                    rec = engine.step_with_record().record
                    if rec.phase == "decode" and rec.num_seqs == b:
                        break
                    if not engine.has_unfinished_requests():  # never expected: the pool and limits fit b
                        raise RuntimeError(f"overhead run: the {b} requests finished before one decode step "
                                           f"carried all of them")
                for _ in range(warmup_steps - 1):
                    engine.step()
                block_times = []
                for _ in range(decode_steps):
                    t0 = time.perf_counter()
                    res = engine.step_with_record()
                    block_times.append(time.perf_counter() - t0)
                    if res.record.phase != "decode" or res.record.num_seqs != b:
                        raise RuntimeError(f"overhead run: expected a decode step of {b} sequences, "
                                           f"got {res.record.phase} with {res.record.num_seqs}")
                    recs.append(res.record)
                for rid in rids:
                    engine.abort_request(rid)
                engine.reset_prefix_cache()
                times += block_times
                round_medians.append(statistics.median(block_times) / b * 1e6)
                if peer is not None:
                    try:
                        peer_result.add_round(b, *peer.measure(b, decode_steps, torch.get_num_threads(),
                                                                 block_size))
                    except PeerUnavailable as e:
                        peer, peer_result.available, peer_result.reason = None, False, str(e)
            mean_us = statistics.fmean(times) / b * 1e6
            row = {"batch_size": b, "us_per_seq_step": mean_us,
                   "us_per_seq_step_median": statistics.median(times) / b * 1e6,
                   "round_medians": round_medians,
                   "step_ms_mean": statistics.fmean(times) * 1e3,
                   "schedule_ms": statistics.fmean(r.schedule_ms for r in recs),
                   "prepare_ms": statistics.fmean(r.prepare_ms for r in recs),
                   "postprocess_ms": statistics.fmean(r.postprocess_ms for r in recs)}
            # the rest of step(): building the StepRecord (with its roofline figures), bookkeeping
            row["other_ms"] = row["step_ms_mean"] - row["schedule_ms"] - row["prepare_ms"] - row["postprocess_ms"]
            rows.append(row)
            log(overhead_row(row))
        result = OverheadResult("overhead", engine.source.name, device_label(engine.config.device), prompt_len,
                                decode_steps, rows, loadavg(), peer_result, block_size)
    finally:
        llm.shutdown()
    print_overhead_comparison(result, log)
    return result
