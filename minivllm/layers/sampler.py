"""Turns one row of logits per sampling sequence into the next token ids.

Order of operations (vLLM V0's; V1 applies min-p right after temperature, before top-k/top-p): the per-request logits processors of the rows that
use them (allowed_token_ids, bad words, min_tokens, logit_bias:
``minivllm/layers/logits_processors.py``), repetition penalty, frequency/presence
penalties, then temperature, top-k, top-p, min-p, then a draw. Greedy rows
(temperature 0) take the argmax after the processors and penalties.

The draw uses the exponential race (the Gumbel-max trick in another guise): with
``E_i ~ Exp(1)`` independent, ``argmax_i p_i / E_i`` is distributed as ``p``.
It needs no cumulative sums, and a request with its own seed draws its own ``E``
from its own generator, so its tokens do not depend on what else is in the batch.

Top-k and top-p are defined on each row sorted most likely first (:func:`sorted_drop_mask`,
what a GPU runs). On a CPU the same tokens are found without the sort, and the sampler's draw
over them is :func:`minivllm.layers.cpu_sampling.sample_rows` (see that module).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.layers.logits_processors import (RowProcessing, apply_frequency_presence_penalties,
                                              apply_logits_processors)


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step (all tensors on the logits' device).

    Attributes:
        temperatures: fp32 ``[N]``; 0 marks a greedy row.
        top_k: int64 ``[N]``; 0 disables.
        top_p: fp32 ``[N]``; 1 disables.
        min_p: fp32 ``[N]``; 0 disables.
        repetition_penalties: fp32 ``[N]``; 1 disables.
        seen_token_ids: per row, the prompt + output token ids (only needed where the
            penalty is not 1; None elsewhere).
        generators: per row, a seeded ``torch.Generator`` or None (engine-wide stream).
        all_greedy / any_top_k / any_top_p / any_min_p / any_penalty: fast paths.
        processing: per row, its ``RowProcessing`` (None for rows without processors), or
            None when no row has any.
        num_logprobs: per row, ``SamplingParams.logprobs`` (None: not wanted), or None when
            no row wants logprobs.
        keep_processed: keep the processed logits at ``Sampler.processed_logits`` (the
            engine's ``logprobs_mode`` "processed_logprobs" / "processed_logits").
    """

    temperatures: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalties: torch.Tensor
    seen_token_ids: list[list[int] | None]
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    processing: list[RowProcessing | None] | None = None
    num_logprobs: list[int | None] | None = None
    keep_processed: bool = False

    @property
    def raw_argmax(self) -> bool:
        """Every row's token is the argmax of its raw logits: all greedy, no penalty, no processors."""
        return self.all_greedy and not self.any_penalty and self.processing is None

    def rows(self, index: slice) -> "SamplingBatch":
        """The settings of the rows in ``index`` (a slice) only: temperatures, filters, repetition
        penalties and generators. ``processing``, ``num_logprobs`` and ``keep_processed`` are not
        carried: its caller (draft verification) serves only requests without logits processors,
        penalties or logprobs (``minivllm.spec_decode.proposal.may_speculate``)."""
        if self.temperatures is None:
            return SamplingBatch.greedy(len(self.generators[index]))
        return SamplingBatch(self.temperatures[index], self.top_k[index], self.top_p[index], self.min_p[index],
                             self.repetition_penalties[index], self.seen_token_ids[index],
                             self.generators[index], all_greedy=self.all_greedy, any_top_k=self.any_top_k,
                             any_top_p=self.any_top_p, any_min_p=self.any_min_p, any_penalty=self.any_penalty)

    @classmethod
    def greedy(cls, num_rows: int) -> "SamplingBatch":
        """All rows greedy with no penalty: only ``all_greedy`` is read, no tensors needed."""
        return cls(None, None, None, None, None, [None] * num_rows, [None] * num_rows,
                   all_greedy=True, any_top_k=False, any_top_p=False, any_min_p=False, any_penalty=False)


def apply_repetition_penalty(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM/CTRL repetition penalty: seen tokens' logits are divided by the penalty if
    positive, multiplied if negative. ``logits``: fp32 ``[N, V]``, modified in place."""
    for row, seen in enumerate(batch.seen_token_ids):
        penalty = float(batch.repetition_penalties[row])
        if seen is None or penalty == 1.0:
            continue
        idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
        vals = logits[row, idx]
        logits[row, idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


# Slack in top-p's "mass reaches top_p" test, for the rounding in fp32 probabilities (u =
# 2**-24): a few u each from exp and the division, u/2 in top_p itself, and the normalising
# sum's error. A pairwise sum over V tokens is off by about log2(V) u (~17 u for Qwen3's
# 151,936), which 1e-5 (~170 u) covers with room; torch's CPU softmax sums a row in a few
# sequential running totals, and over a sorted row of that length its probabilities summed to
# 1 + 0.9-1.4e-5 (torch 2.13, random logits; chapter 09 section 6b prints it), so on that path a
# token at the cut can still land on either side. 1e-5 is far below any difference between
# top_p values a user means.
TOP_P_TOLERANCE = 1e-5


def top_p_drop_mask(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top-p (nucleus sampling, Holtzman et al. 2020) drops.

    The rule (vLLM's and Hugging Face's): keep the smallest set of most likely tokens
    whose probability mass reaches ``top_p``. A token is therefore dropped when the mass
    of the tokens ranked before it already reaches ``top_p``. "Reaches" allows
    ``TOP_P_TOLERANCE`` of rounding slack, so probs ``[0.5, 0.3, 0.1, 0.1]`` with
    ``top_p=0.8`` keep exactly two tokens although fp32 puts ``0.5 + 0.3`` a hair below
    0.8. The mass is summed in fp64, so adding up many small probabilities adds no
    error of note to the probabilities' own. The most likely token is always kept, and
    a row with ``top_p >= 1`` keeps every token.

    Args:
        sorted_probs: fp32 ``[N, V]``, each row sorted in descending order.
        top_p: fp32 ``[N]``, in (0, 1].

    Returns:
        bool ``[N, V]``: True where the token is dropped.
    """
    probs = sorted_probs.double()
    mass_before = probs.cumsum(dim=-1) - probs
    threshold = top_p.double().unsqueeze(1) - TOP_P_TOLERANCE
    drop = mass_before >= threshold
    drop[:, 0] = False
    return drop & (top_p < 1).unsqueeze(1)


def sorted_drop_mask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Which tokens top-k and top-p drop, by sorting each row (the reference rule, and the path
    on a GPU): ``logits`` fp32 ``[N, V]`` after temperature -> bool ``[N, V]``, True where dropped."""
    # Stable, so tied tokens keep id order and the kept set does not vary between runs.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.any_top_k:
        k = batch.top_k.clamp(min=0)
        k = torch.where(k > 0, k, torch.full_like(k, logits.shape[-1]))
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        mask |= ranks >= k.unsqueeze(1)
    if batch.any_top_p:
        mask |= top_p_drop_mask(sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1), batch.top_p)
    return torch.zeros_like(mask).scatter(1, sorted_idx, mask)


def drop_mask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """:func:`sorted_drop_mask`'s result; for fp32 CPU logits without sorting the vocabulary
    (:func:`minivllm.layers.cpu_sampling.drop_mask`, the same tokens)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        from minivllm.layers import cpu_sampling

        return cpu_sampling.drop_mask(logits, batch)
    return sorted_drop_mask(logits, batch)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch, drop=drop_mask) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (fp32 ``[N, V]``).

    Greedy rows are given temperature 1 here; their result is not used. ``drop``: how the
    tokens top-k and top-p drop are found (:func:`drop_mask`; tests pass :func:`sorted_drop_mask`).
    """
    return filtered_logits_and_probs(logits, batch, drop, keep_logits=False)[1]


def filtered_logits_and_probs(logits: torch.Tensor, batch: SamplingBatch, drop=drop_mask,
                              keep_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`filtered_probs`, and with ``keep_logits`` the processed logits beside them (fp32
    ``[N, V]``: after temperature, ``-inf`` exactly where top-k, top-p or min-p removed a token;
    else None). A token whose probability only underflowed to 0 keeps its finite logit: the
    processed logprobs must not depend on whether a neighbour in the batch samples."""
    temps = torch.where(batch.temperatures > 0, batch.temperatures, torch.ones_like(batch.temperatures))
    logits = logits / temps.unsqueeze(1)
    if batch.any_top_k or batch.any_top_p:
        logits = logits.masked_fill(drop(logits, batch), float("-inf"))
    probs = logits.softmax(dim=-1)
    if batch.any_min_p:
        removed = probs < batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(removed, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        if keep_logits:
            logits = logits.masked_fill(removed, float("-inf"))
    return (logits if keep_logits else None), probs


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D ``x [N, V]`` -> int64 ``[N]``: the first maximum of each row
    (the first NaN in a row holding one, as torch does). A float32 CPU tensor goes through numpy's
    argmax: torch 2.13's CPU argmax over rows took 166 us for 32 x 4096 values, numpy's 7 us (one
    thread, 2-core Xeon, 2026-12-02), about 4% of a batch-32 decode step of the embedded model."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def exponential_noise_(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill ``out`` in place with Exp(1) draws, as ``-log(U)`` for ``U`` uniform on [0, 1).

    Not ``Tensor.exponential_``: on a CPU it took 3x as long (3.7 vs 1.2 ms for 32 x 4096 fp32,
    torch 2.13, one thread of the 2-core dev EPYC), a quarter of a batch-32 decode step of the
    embedded model. ``U`` is kept at or above the smallest normal float, so a draw is at most ~87
    (never ``inf``: a row whose filters left one token would otherwise, at ``U = 0``, see ``p / E =
    0`` everywhere and return token 0); ``U < 1``, so a draw is never 0 and ``p / E`` never NaN."""
    return out.uniform_(generator=generator).clamp_min_(torch.finfo(out.dtype).tiny).log_().neg_()


def race_uniforms(probs: torch.Tensor, generators: list[torch.Generator | None],
                  default: torch.Generator | None) -> torch.Tensor:
    """The race's uniform draws for ``probs`` (``[N, V]``): fp32 ``U`` on [0, 1) of its shape, the
    rows without a generator of their own from ``default`` in one call (row order), each other row
    from its own generator. Every sampling path draws through here, so a seed gives the same
    ``U`` whichever path turns it into a token."""
    u = torch.empty_like(probs)
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if shared_rows:
        if len(shared_rows) == len(generators):
            u.uniform_(generator=default)
        else:
            idx = torch.tensor(shared_rows, device=probs.device)
            u[idx] = torch.empty((len(shared_rows), probs.shape[1]), device=probs.device,
                                 dtype=probs.dtype).uniform_(generator=default)
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    return u


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None],
                     default: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` (fp32 ``[N, V]``) -> int64 ``[N]``: ``argmax p / E`` with
    ``E = -log(U)`` (see :func:`exponential_noise_` for the clamp), ``U`` from :func:`race_uniforms`."""
    noise = race_uniforms(probs, generators, default).clamp_min_(torch.finfo(probs.dtype).tiny).log_().neg_()
    return argmax_rows(probs / noise)


class Sampler:
    """Samples the next token for each row of logits.

    Args:
        seed: seeds the engine-wide generator used by requests without their own seed.
        device: where the generator lives (the logits' device).
    """

    def __init__(self, seed: int | None, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.processed_logits: torch.Tensor | None = None
        #: ``minivllm.layers.cpu_fused.CpuFusedOps`` when the runner turned the C ops on: a plain
        #: greedy CPU batch's argmax is then one C pass (:meth:`greedy_token_ids`)
        self.fused = None
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def greedy_token_ids(self, logits: torch.Tensor, batch: SamplingBatch,
                         ids: np.ndarray | None = None) -> list[int] | None:
        """The token ids of a plain greedy batch (no penalty, no processors, no logprobs) from
        fp32 CPU ``logits [N, V]``: each row's first maximum, -1 for a row holding a non-finite
        value (as ``__call__`` followed by the runner's check). ``None`` for any other batch or
        tensor: the caller then takes the general path. ``ids``: those ids already found by the LM
        head's GEMM as it wrote the logits (``ModelInput.greedy_ids``, int64 ``[N]``), used as they
        are for such a batch.

        In one C pass when the runner set :attr:`fused` (``CpuFusedOps.greedy_ids``), else in
        numpy, not torch: it runs right after a decode step has streamed the weights and the
        KV cache through the CPU's caches, and there each torch call dispatches from cold
        caches. For 32 x 4096 logits after reading 64 MiB elsewhere (dev EPYC, one thread,
        2026-12-03): numpy 122 us, against 269 us for the argmax, row sums, ``isfinite`` and
        ``masked_fill`` in torch; with warm caches 33 against 55 us. In the embedded model's
        batch-32 decode step numpy took ~95 us (2026-12-04). A row of finite logits so large that
        their fp32 sum overflows counts as non-finite in numpy (and in ``ModelRunner.run``'s check
        after ``__call__``), not in the C pass."""
        if (not batch.raw_argmax or batch.keep_processed or batch.num_logprobs is not None
                or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
                or logits.requires_grad):
            return None
        self.processed_logits = None
        if ids is not None:
            return ids.tolist()
        if self.fused is not None:
            ids = self.fused.greedy_ids(logits)
            if ids is not None:
                return ids.tolist()
        values = logits.numpy()
        ids = values.argmax(axis=-1)
        with np.errstate(over="ignore", invalid="ignore"):  # inf + -inf: NaN, as torch, without a warning
            if not np.isfinite(values.sum()):  # a row's fp32 sum is non-finite iff one of its values is
                ids[~np.isfinite(values.sum(axis=-1))] = -1
        return ids.tolist()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``logits``: fp32 ``[N, V]`` (not modified). Returns int64 ``[N]`` token ids, -1 for a
        row with nothing to draw (its own processors or penalties masked every token, or made a
        logit non-finite); the runner also marks -1 a row whose logits were not finite.

        With ``batch.keep_processed``, ``self.processed_logits`` is then the fp32 ``[N, V]``
        logits the draw used: after the processors and penalties, divided by the temperature
        (1 for greedy rows), and -inf where top-k / top-p / min-p removed the token.
        """
        processing = batch.processing
        self.processed_logits = None
        if batch.raw_argmax:
            if batch.keep_processed:
                self.processed_logits = logits
            return argmax_rows(logits)
        logits = logits.float().clone()
        if processing is not None:
            apply_logits_processors(logits, processing)
        if batch.any_penalty:
            apply_repetition_penalty(logits, batch)
        if processing is not None:
            apply_frequency_presence_penalties(logits, processing)
        ids = self._draw(logits, batch)
        if processing is not None or batch.any_penalty:
            # A row whose own options masked every token (allowed_token_ids against bad_words or
            # min_tokens) or overflowed a logit (a tiny repetition_penalty divides by it) has nothing
            # to draw: -1, failed, rather than the argmax's index 0. Its maximum is -inf, +inf or
            # NaN, or becomes inf once divided by the temperature (the draw's softmax is then NaN).
            temps = torch.where(batch.temperatures > 0, batch.temperatures, torch.ones_like(batch.temperatures))
            ids = ids.masked_fill(~torch.isfinite(logits.amax(dim=-1) / temps), -1)
        return ids

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids from the processed fp32 ``[N, V]`` logits (a greedy row's argmax)."""
        greedy = argmax_rows(logits)
        if batch.all_greedy:
            if batch.keep_processed:
                self.processed_logits = logits
            return greedy
        if (logits.device.type == "cpu" and (batch.any_top_k or batch.any_top_p) and not batch.keep_processed
                and not logits.requires_grad):
            # the same draw without sorting the vocabulary (minivllm/layers/cpu_sampling.py)
            from minivllm.layers.cpu_sampling import sample_rows

            return torch.where(batch.temperatures > 0, sample_rows(logits, batch, self.generator), greedy)
        processed, probs = filtered_logits_and_probs(logits, batch, keep_logits=batch.keep_processed)
        if batch.keep_processed:
            self.processed_logits = processed
        sampled = exponential_race(probs, batch.generators, self.generator)
        return torch.where(batch.temperatures > 0, sampled, greedy)
