"""The sampler's draw on a CPU: temperature, top-k, top-p and min-p without sorting the vocabulary.

The reference rule (:func:`~minivllm.layers.sampler.sorted_drop_mask`, then
:func:`~minivllm.layers.sampler.exponential_race`) sorts every row of logits whenever a row
asks for top-k or top-p. On a CPU that sort is most of a sampled step: a stable sort of 8
rows of Qwen3's 151,936 logits took 110-124 ms, ``torch.topk`` of their 50 largest 2.4-2.7 ms
(torch 2.13, one thread, 2-core Zen 4 EPYC, 2026-12-03). The filters only need the head of
the sorted order, so this path finds it without the sort:

- top-k: the ``k`` largest logits of every row by one partial selection (:func:`top_k_rows`:
  ``torch.topk``), ties at the ``k``-th value broken by id as a stable sort breaks them (a row
  with a tie across the cut takes :func:`top_token_ids`);
- top-p over the whole row: the tokens go into 1024 buckets by log-probability below the most
  likely one (up to 32 nats); a bucket is a run of the sorted order, so the buckets' cumulative
  mass finds the one bucket where the mass reaches ``top_p``, and only its tokens are sorted to
  place the cut (a bucket of more than 2048 tokens is split the same way first); where a C
  compiler is found, the splits and that sort are one C call for the rows of a batch, up to
  65,536 logits a call (:mod:`minivllm.layers.top_p_native`: the same operations in the same
  order, so the same ids);
- top-p after top-k: over the ``k`` tokens kept, sorted, renormalised among themselves;
- min-p and the race over the kept tokens only, rows together (:func:`_race_over`):
  ``argmax e_i / E_i`` with ``e_i = exp(y_i - max y)``, the probabilities up to their common
  normaliser, and ``E_i = -log U_i``
  from the same uniform draws (:func:`~minivllm.layers.sampler.race_uniforms`), so a seed
  picks the same token as the reference path does with the same generator, up to ties within
  fp32 rounding.

Probabilities are fp32 as the reference's, their cumulative mass fp64; the fp32 normaliser is
numpy's pairwise sum, which over a long row is closer to exact than torch's CPU softmax of the
sorted row (measured in chapter 09, section 6b). The kept set is therefore the reference's up to
a token whose mass sits on top-p's cut within that rounding.

:func:`drop_mask` gives :func:`~minivllm.layers.sampler.filtered_probs` the same selection on a
CPU (the draft model's draws, speculative decoding's verification, the sampling notebook and
widget), and :func:`sample_rows` is the sampler's draw.

Rows are independent: a row's result does not depend on the others (beyond the engine-wide
generator's draws, as on the reference path).
"""
from __future__ import annotations

import numpy as np
import torch

from minivllm.layers import top_p_native
from minivllm.layers.sampler import TOP_P_TOLERANCE, SamplingBatch, argmax_rows, race_uniforms

__all__ = ["drop_mask", "kept_rows", "kept_token_ids", "sample_rows", "top_k_rows", "top_token_ids"]

# top-p's buckets: 1024 over the row's range of log-probability, at most 32 nats (the last
# gathers every token further below the most likely one: a probability ratio below 1e-14);
# a bucket of at most 2048 tokens is sorted.
_BUCKETS = 1024
_SPAN_NATS = 32.0
_SORT_AT_MOST = 2048
# Rows split in one C call hold at most this many logits together (or one row), so the arrays made
# for them (exponentials, probabilities, keys, room for the kept ids) stay under 4 MiB: numpy asks
# the OS for 2 MiB pages for larger ones, and such fresh memory is zeroed 2 MiB at a touch (8 rows
# of 151,936 at once spent about as long again in that as in the work).
_SPLIT_TOGETHER_ELEMENTS = 1 << 16
# Rows whose kept sets are at most this long race together (padded to the longest); a longer
# one (a flat row under top-p) races alone, so a batch's padding stays small.
_RACE_TOGETHER_AT_MOST = 4096
_TINY = np.finfo(np.float32).tiny
_FP32_MAX = float(np.finfo(np.float32).max)


def top_token_ids(y: np.ndarray, c: int) -> np.ndarray:
    """The ids of the ``c`` largest values of ``y`` (fp32 ``[V]``, no NaN; ``1 <= c <= V``),
    largest first, equal values in id order (as a stable descending sort orders them) ->
    int64 ``[c]``."""
    v = y.shape[0]
    if c * 4 >= v:  # most of the row: a partial selection saves little over the sort
        return np.argsort(-y, kind="stable")[:c]
    theta = y[np.argpartition(-y, c - 1)[c - 1]]  # the c-th largest value
    above = np.flatnonzero(y > theta)
    ties = np.flatnonzero(y == theta)[:c - above.size]
    ids = np.concatenate((above, ties))
    return ids[np.lexsort((ids, -y[ids]))]


def top_k_rows(y: np.ndarray, top_k: np.ndarray | None) -> list[np.ndarray | None]:
    """The set :func:`top_token_ids` gives each row for its own ``k`` (fp32 ``[N, V]``; ``top_k``
    int ``[N]`` or ``None``) -> per row the int64 ``[k]`` ids, largest first but equal values in
    no particular order; ``None`` where top-k is off (``k <= 0`` or ``>= V``) or the row's
    largest value is NaN or +inf.

    One ``torch.topk`` for the rows at once: on one thread of the dev EPYC (2026-12-03) it
    found the 50 largest of 8 rows of 4,096 in 60 us and of 151,936 in 2.4 ms, against 390 us
    and 18 ms for ``np.argpartition`` row by row. It also returns the ``k + 1``-th value, so a
    tie across the cut (the only case where ``topk``'s unspecified order among equal values
    picks the set) is seen and that row takes :func:`top_token_ids`, as do rows whose ``k``
    is a quarter of the row or more (a sort then costs about the same)."""
    n, v = y.shape
    out: list[np.ndarray | None] = [None] * n
    if top_k is None:
        return out
    ks = np.where((top_k > 0) & (top_k < v), top_k, 0).astype(np.int64)
    rows = np.flatnonzero(ks)
    if rows.size == 0:
        return out
    kmax = int(ks[rows].max())
    if kmax * 4 >= v:
        for i in rows:
            out[i] = top_token_ids(y[i], int(ks[i]))
        return out
    x = torch.from_numpy(y if rows.size == n else y[rows])
    vals, idx = x.topk(kmax + 1, dim=-1)  # largest first; kmax + 1 <= v
    vals, idx = vals.numpy(), idx.numpy()
    for j, i in enumerate(rows):
        if not np.isfinite(vals[j, 0]):  # NaN or +inf (topk ranks NaN first): callers skip the row
            continue
        k = int(ks[i])
        row_vals = vals[j, :k]
        if vals[j, k] == row_vals[-1]:  # a tie across the cut
            out[i] = top_token_ids(y[i], k)
            continue
        out[i] = idx[j, :k]
    return out


def _before_threshold(probs: np.ndarray, threshold: float, mass_above: float = 0.0) -> np.ndarray:
    """For probabilities sorted most likely first, after tokens of mass ``mass_above``: which to
    keep (the mass before them is below ``threshold``; the very first token always)."""
    mass = np.cumsum(probs, dtype=np.float64)
    keep = mass - probs + mass_above < threshold
    if mass_above == 0.0:
        keep[0] = True
    return keep


def _top_p_ids(y: np.ndarray, threshold: float) -> np.ndarray:
    """The ids top-p keeps over the whole row ``y``, without sorting it. The tokens fall into
    ``_BUCKETS`` buckets by log-probability below the most likely one (a bucket holds a run of
    the sorted order): the buckets before the one where the mass reaches ``threshold`` are kept
    whole, the ones after it dropped, and that one is split again the same way until it holds
    few enough tokens (or only equal ones) to sort and place the cut in it."""
    m = y.max()
    e = torch.from_numpy(y - m).exp_().numpy()
    probs = e / np.float32(e.sum())  # the softmax, fp32 as the reference's
    key = m - y  # >= 0, smallest first in the sorted order
    lo, hi = 0.0, min(float(key.max()), _SPAN_NATS)
    ids, mass_above, kept = None, 0.0, []  # ids None: the whole row (no gathers over it)
    while (ids is None or ids.size > _SORT_AT_MOST) and hi > lo:
        scale = _BUCKETS / (hi - lo)
        if scale > _FP32_MAX:  # a range too narrow for fp32 to split: sort what is left
            break
        scale = np.float32(scale)
        k, p = (key, probs) if ids is None else (key[ids], probs[ids])
        b = np.clip((k - np.float32(lo)) * scale, 0, _BUCKETS - 1).astype(np.intp)
        mass = mass_above + np.cumsum(np.bincount(b, weights=p, minlength=_BUCKETS))
        reached = np.flatnonzero(mass >= threshold)
        if reached.size == 0:  # fp32 rounding left the mass below top_p: keep every token left
            return np.concatenate(kept + [np.arange(y.shape[0]) if ids is None else ids])
        c = int(reached[0])
        inside = np.flatnonzero(b == c)
        if inside.size == b.size:  # no split (equal keys): sort them
            break
        below = np.flatnonzero(b < c)
        kept.append(below if ids is None else ids[below])
        mass_above = float(mass[c - 1]) if c > 0 else mass_above
        ids = inside if ids is None else ids[inside]
        lo, hi = lo + c * (hi - lo) / _BUCKETS, lo + (c + 1) * (hi - lo) / _BUCKETS
    if ids is None:
        ids = np.arange(y.shape[0])
    ids = ids[np.lexsort((ids, -y[ids]))]  # by logit: two logits can round to one key
    keep = _before_threshold(probs[ids], threshold, mass_above)
    return np.concatenate(kept + [ids[keep]])


def _top_p_rows(y: np.ndarray, thresholds: np.ndarray) -> list[np.ndarray]:
    """:func:`_top_p_ids` of each row of ``y`` (fp32 ``[R, V]``, finite maxima, no NaN) with its
    threshold (``thresholds``: ``[R]``). Where the C split is built (:mod:`minivllm.layers.top_p_native`:
    the same operations in the same order, so the same ids) the rows' softmax and keys are computed
    here as :func:`_top_p_ids` computes them, and their splits and sorts are one C call for every
    ``_SPLIT_TOGETHER_ELEMENTS`` logits (or one row); else each row takes :func:`_top_p_ids`."""
    native = top_p_native.load() if y.dtype == np.float32 else None
    if native is None:
        return [_top_p_ids(y[i], float(t)) for i, t in enumerate(thresholds)]
    group = max(1, _SPLIT_TOGETHER_ELEMENTS // y.shape[1])
    if y.shape[0] > group:
        return [ids for lo in range(0, y.shape[0], group)
                for ids in _top_p_rows(y[lo:lo + group], thresholds[lo:lo + group])]
    y = np.ascontiguousarray(y)
    m = y.max(axis=1, keepdims=True)
    e = y - m
    for row in e:  # row by row, as _top_p_ids: a row's values do not depend on the batch
        torch.from_numpy(row).exp_()
    probs = e / e.sum(axis=1, keepdims=True)  # each row's own numpy sum, as _top_p_ids
    key = m - y
    his = np.minimum(key.max(axis=1).astype(np.float64), _SPAN_NATS)
    return top_p_native.kept_rows(native, y, key, probs, his, np.asarray(thresholds, dtype=np.float64),
                                  _SORT_AT_MOST)


def _top_p_threshold(top_p: float) -> float | None:
    """The mass top-p's kept tokens must reach: ``top_p`` as the reference holds it (fp32) less
    ``TOP_P_TOLERANCE``; ``None`` when top-p is off (``top_p >= 1``)."""
    top_p = float(np.float32(top_p))
    return None if top_p >= 1 else top_p - TOP_P_TOLERANCE


def kept_token_ids(y: np.ndarray, top_k: int, top_p: float,
                   top_ids: np.ndarray | None = None) -> np.ndarray | None:
    """The token ids that top-k then top-p keep in one row of temperature-scaled logits ``y``
    (fp32 ``[V]``, finite maximum, no NaN), in no particular order; ``None`` when they keep every
    token. ``top_k <= 0`` or ``>= V`` and ``top_p >= 1`` disable their filter.

    The rule is :func:`~minivllm.layers.sampler.top_p_drop_mask`'s: after top-k, keep the
    smallest set of most likely tokens whose mass (renormalised over the top-k set) reaches
    ``top_p`` less ``TOP_P_TOLERANCE``, ties in id order; the sums are in fp64. ``top_ids``: the
    set :func:`top_token_ids` gives for ``top_k``, in any order, if already found (:func:`top_k_rows`)."""
    v = y.shape[0]
    threshold = _top_p_threshold(top_p)
    ids = None
    if 0 < top_k < v:
        ids = top_ids if top_ids is not None else top_token_ids(y, top_k)
    if threshold is None:
        return ids
    if ids is None:
        return _top_p_rows(y[None], np.array([threshold]))[0]
    ids = ids[np.lexsort((ids, -y[ids]))]  # most likely first, equal values in id order
    e = np.exp(y[ids] - y[ids[0]])
    return ids[_before_threshold(e / e.sum(), threshold)]


def kept_rows(y: np.ndarray, top_k: np.ndarray | None, top_p: np.ndarray | None) -> list[np.ndarray | None]:
    """:func:`kept_token_ids` of every row of ``y`` (fp32 ``[R, V]``, temperature-scaled logits),
    row ``r`` with ``top_k[r]`` and ``top_p[r]`` (``None``: that filter off in every row) -> per
    row its kept ids in no particular order, or ``None`` where it keeps every token or its
    maximum is not finite (NaN, +inf, or every token banned: callers skip such rows). The rows
    under top-p alone take :func:`_top_p_rows` together."""
    r, v = y.shape
    out: list[np.ndarray | None] = [None] * r
    finite = np.isfinite(y.max(axis=1))
    tops = top_k_rows(y, top_k)
    alone, thresholds = [], []  # rows under top-p without top-k
    for i in np.flatnonzero(finite):
        k = int(top_k[i]) if top_k is not None else 0
        p = float(top_p[i]) if top_p is not None else 1.0
        threshold = _top_p_threshold(p)
        if not 0 < k < v and threshold is not None:
            alone.append(i)
            thresholds.append(threshold)
        else:
            out[i] = kept_token_ids(y[i], k, p, tops[i])
    if alone:
        for i, ids in zip(alone, _top_p_rows(y[alone], np.array(thresholds))):
            out[i] = ids
    return out


def drop_mask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Which tokens top-k and top-p drop (what :func:`~minivllm.layers.sampler.sorted_drop_mask`
    gives) from fp32 CPU ``logits [N, V]`` after temperature -> bool ``[N, V]``, True where
    dropped. A row holding NaN or without a finite maximum drops nothing (its probabilities are
    not finite either way)."""
    y = logits.numpy()
    drop = np.zeros(y.shape, dtype=bool)
    kept = kept_rows(y, batch.top_k.numpy() if batch.any_top_k else None,
                     batch.top_p.numpy() if batch.any_top_p else None)
    for i, ids in enumerate(kept):
        if ids is not None:
            drop[i] = True
            drop[i, ids] = False
    return torch.from_numpy(drop)


def _race_over(ids: list[np.ndarray], y: np.ndarray, m: np.ndarray, u: np.ndarray,
               min_p: np.ndarray) -> np.ndarray:
    """The race over each row's kept ids, the rows at once: row ``r`` draws ``argmax e_t / E_t``
    over ``t`` in ``ids[r]`` (``e_t = exp(y_t - m_r)``, 0 below ``min_p[r]``; ``E_t = -log U_t``),
    equal scores going to the lowest id, as an argmax over the whole row in id order.
    ``y``, ``u``: fp32 ``[R, V]``; ``m``: fp32 ``[R, 1]``, each row's maximum (kept in ``ids``);
    ``min_p``: fp32 ``[R]`` -> int64 ``[R]`` token ids."""
    lens = np.fromiter(map(len, ids), dtype=np.intp, count=len(ids))
    valid = np.arange(int(lens.max())) < lens[:, None]
    pad = np.zeros(valid.shape, dtype=np.intp)
    pad[valid] = np.concatenate(ids)  # row-major: each row's ids, then padding
    rows = np.arange(len(ids))[:, None]
    e = np.exp(y[rows, pad] - m)
    e[(e < min_p[:, None]) | ~valid] = 0  # min-p: p < min_p * max p, where the largest e is exp(0) = 1
    score = e / -np.log(np.maximum(u[rows, pad], _TINY))
    ties = score == score.max(axis=1, keepdims=True)
    return np.where(ties, pad, np.iinfo(np.intp).max).min(axis=1).astype(np.int64)


def sample_rows(logits: torch.Tensor, batch: SamplingBatch, default: torch.Generator | None) -> torch.Tensor:
    """One draw per row of processed CPU logits (fp32 ``[N, V]``, after processors and
    penalties) -> int64 ``[N]``: what ``filtered_probs`` then ``exponential_race`` draw (with the
    sort, or with :func:`drop_mask`), from the
    same uniform draws (``default``: the engine-wide generator; a row's own in
    ``batch.generators``). Greedy rows (temperature 0) and rows whose maximum is not finite
    (NaN, or every token banned) get 0: the caller takes their argmax, or marks them failed."""
    n = logits.shape[0]
    u = race_uniforms(logits, batch.generators, default).numpy()
    temps = batch.temperatures.numpy()
    out = np.zeros(n, dtype=np.int64)
    rows = np.flatnonzero(temps > 0)
    if rows.size == 0:
        return torch.from_numpy(out)
    with np.errstate(over="ignore"):  # a logit overflowing at a low temperature: the row fails (Sampler)
        y = logits.numpy()[rows] / temps[rows, None]
    m = y.max(axis=1, keepdims=True)
    top_k = batch.top_k.numpy() if batch.any_top_k else None
    top_p = batch.top_p.numpy() if batch.any_top_p else None
    min_p = batch.min_p.numpy() if batch.any_min_p else np.zeros(n, dtype=np.float32)
    whole, kept = [], {}  # rows drawn over every token / each row's kept ids: drawn together
    filtered = [None] * rows.size if top_k is None and top_p is None else \
        kept_rows(y, None if top_k is None else top_k[rows], None if top_p is None else top_p[rows])
    for j, ids in enumerate(filtered):
        if not np.isfinite(m[j, 0]):
            continue
        if ids is None:
            whole.append(j)
        else:
            kept[j] = ids
    groups = [[r for r, ids in kept.items() if ids.size <= _RACE_TOGETHER_AT_MOST]]
    groups += [[r] for r, ids in kept.items() if ids.size > _RACE_TOGETHER_AT_MOST]
    for group in filter(None, groups):
        j = np.asarray(group)
        i = rows[j]
        out[i] = _race_over([kept[r] for r in group], y[j], m[j], u[i], min_p[i])
    if whole:  # as the reference draws them (no sort there), in torch: its exp and log are the faster here
        j = np.asarray(whole)
        i = rows[j]
        e = torch.from_numpy(y[j] - m[j]).exp_()
        if batch.any_min_p:
            e.masked_fill_(e < torch.from_numpy(min_p[i, None]), 0.0)
        noise = torch.from_numpy(u[i]).clamp_min_(_TINY).log_().neg_()
        out[i] = argmax_rows(e / noise).numpy()
    return torch.from_numpy(out)
