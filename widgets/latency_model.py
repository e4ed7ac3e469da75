"""``LatencyModel``: a step-time cost model fitted to steps measured on this machine."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LatencyModel:
    """Step wall time as a linear function of what the step computes, fitted by least squares.

    ``step_ms = prefill_base_ms * [step has a prefill chunk]
              + decode_base_ms  * [decode-only step]
              + ms_per_prefill_token * prefill tokens
              + ms_per_decode_seq    * decode tokens (one per decoding sequence)``

    The intercepts are the fixed cost of a step (reading every weight once, host
    overhead); the slopes the cost per token. None is below 0: a coefficient the least-squares fit
    puts below 0 (a slope, as two noisy batch sizes can; an intercept, as a prefill growing faster
    than linear can) is fixed at 0 and the rest refitted. Attention's growth with context length is
    not modelled (small for short contexts; visible as residuals on long ones).

    Predictions (:meth:`predict`) replay the engine's scheduling policy for ``batch``
    requests of ``prompt_len`` tokens submitted together: each step serves running decodes
    first (one token each), then fills the rest of the ``budget`` (max_num_batched_tokens)
    with prompt chunks in arrival order; a request's first token comes at the end of the
    step that finishes its prompt. TTFT, TPOT and total are means over the requests.

    Attributes:
        prefill_base_ms, decode_base_ms, ms_per_prefill_token, ms_per_decode_seq: the fit.
        r2: coefficient of determination of the fit on its own data.
        n_points: step shapes it was fitted to (each the median of its repeats).
        cold_decode: the decode cost was fitted to the first decode steps after a prefill (no
            row carried a ``batch``), which run slower than the steady state: TPOT is over-predicted.
    """

    prefill_base_ms: float
    decode_base_ms: float
    ms_per_prefill_token: float
    ms_per_decode_seq: float
    r2: float
    n_points: int
    cold_decode: bool = False

    @classmethod
    def fit(cls, rows: list[dict]) -> "LatencyModel":
        """Fit to measured steps: dicts with ``wall_ms`` and either ``phase``/``tokens``
        (from :func:`widgets.measure.measure_step_latency`, batch 1) or ``batch`` (from
        :func:`widgets.measure.measure_decode_batch`).

        Decode steps are fitted to the rows that carry ``batch`` (``measure_decode_batch`` leaves out
        the first decode steps after each prefill, which run slower: a CPU graph recorded, caches the
        prefill left cold). The decode rows of ``measure_step_latency`` are exactly those first steps,
        so they are used only when no row carries a batch (``cold_decode`` is then set).

        Raises:
            ValueError: prefill steps of fewer than two sizes, or no decode step.
        """
        warm_decodes = any(r.get("phase") == "decode" and "batch" in r for r in rows)
        groups: dict[tuple, list[float]] = {}
        for r in rows:
            phase = r.get("phase")
            if phase == "prefill":
                key = (1.0, 0.0, float(r["tokens"]), 0.0)
            elif phase == "decode":
                if warm_decodes and "batch" not in r:
                    continue  # a first decode after a prefill: not the steady step TPOT is made of
                key = (0.0, 1.0, 0.0, float(r.get("batch", r.get("tokens", 1))))
            else:
                continue  # mixed steps are predicted, not fitted
            groups.setdefault(key, []).append(float(r["wall_ms"]))
        # One point per step shape, its median over repeats: a shared machine's stalls
        # (another process taking the core for tens of ms) must not drag the fit.
        X = np.asarray(list(groups), dtype=float).reshape(-1, 4)
        y = np.asarray([float(np.median(v)) for v in groups.values()])
        n_pre = int(X[:, 0].sum()) if len(X) else 0
        n_dec = int(X[:, 1].sum()) if len(X) else 0
        if n_pre < 2 or n_dec < 1:
            raise ValueError(f"need prefill steps of at least 2 sizes and at least 1 decode step to fit, "
                             f"got {n_pre} prefill sizes and {n_dec} decode batch sizes")
        if np.ptp(X[X[:, 0] == 1, 2]) == 0:
            raise ValueError("prefill steps all have the same token count: measure several prompt lengths")
        if np.ptp(X[X[:, 1] == 1, 3]) == 0:
            # one batch size only: the decode slope is not identifiable; fit the intercept alone
            X = np.c_[X[:, :3], np.zeros(len(X))]
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        # No cost is negative: neither a cost per token or per sequence (noise on few points can say so)
        # nor a step's fixed cost (a prefill's growing faster than linear over the measured sizes puts the
        # line's intercept below 0, and a 1-token prompt would be predicted to take negative time). Each
        # coefficient that comes out negative is fixed at 0 and the rest refitted, until none is.
        fixed = np.zeros(len(coef), dtype=bool)
        while (coef[~fixed] < 0).any():  # the fixed set only grows: at most 4 refits
            fixed |= coef < 0
            X = X.copy()
            X[:, fixed] = 0.0
            coef, *_ = np.linalg.lstsq(X, y, rcond=None)
            coef[fixed] = 0.0  # lstsq's minimum-norm answer for a zeroed column is 0 only up to rounding (-7e-18)
        pred = X @ coef
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
        return cls(*(float(c) for c in coef), r2=1.0 - ss_res / ss_tot, n_points=len(y),
                   cold_decode=not warm_decodes)

    def step_ms(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Predicted wall time of one step."""
        if prefill_tokens:
            return self.prefill_base_ms + self.ms_per_prefill_token * prefill_tokens + \
                self.ms_per_decode_seq * decode_seqs
        if decode_seqs:
            return self.decode_base_ms + self.ms_per_decode_seq * decode_seqs
        return 0.0

    def predict(self, prompt_len: int, max_tokens: int, batch: int = 1, budget: int = 8192) -> dict:
        """Mean TTFT, TPOT and total (ms) for ``batch`` requests submitted together.

        Raises:
            ValueError: a length, count or budget that is not a positive int (a bool is not).
        """
        for name, v in (("prompt_len", prompt_len), ("max_tokens", max_tokens), ("batch", batch),
                        ("budget", budget)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive int")
        remaining = [prompt_len] * batch          # prompt tokens left per request
        generated = [0] * batch
        first_token = [None] * batch
        done_at = [None] * batch
        t = 0.0
        while any(d is None for d in done_at):
            # never more than the budget: a request starts decoding only after a prefill chunk took budget
            decoding = [i for i in range(batch) if first_token[i] is not None and done_at[i] is None]
            left = budget - len(decoding)
            chunks = {}
            for i in range(batch):
                if remaining[i] and left > 0:
                    n = min(remaining[i], left)
                    chunks[i] = n
                    left -= n
            t += self.step_ms(sum(chunks.values()), len(decoding))
            for i in decoding:
                generated[i] += 1
            for i, n in chunks.items():
                remaining[i] -= n
                if remaining[i] == 0:
                    first_token[i] = t
                    generated[i] = 1
            for i in range(batch):
                if first_token[i] is not None and done_at[i] is None and generated[i] >= max_tokens:
                    done_at[i] = t
        ttft = float(np.mean(first_token))
        total = float(np.mean(done_at))
        tpot = (float(np.mean([(d - f) / (max_tokens - 1) for d, f in zip(done_at, first_token)]))
                if max_tokens > 1 else None)
        return dict(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=total)

    def describe(self) -> str:
        """The fitted step-time model in one line (ms and µs per token)."""
        return (f"prefill step = {self.prefill_base_ms:.2f} ms + {self.ms_per_prefill_token * 1e3:.1f} µs/token; "
                f"decode step = {self.decode_base_ms:.2f} ms + {self.ms_per_decode_seq * 1e3:.1f} µs/sequence "
                f"(R² = {self.r2:.3f} over the medians of {self.n_points} measured step shapes)"
                + ("; decode fitted to the first (cold) decode steps after a prefill" if self.cold_decode else ""))
