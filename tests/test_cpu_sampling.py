"""The CPU sampler's draw without a sort (minivllm/layers/cpu_sampling.py) keeps the tokens the
reference (the sort) keeps, but for a token exactly on top-p's cut within fp32 rounding, and
picks the token the reference picks from the same generator states:
top-k, top-p, min-p, their mixes, greedy rows, seeded rows, ties, banned tokens, and rows flat
enough that top-p's buckets are split again."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.layers.cpu_sampling import kept_token_ids, top_k_rows, top_token_ids
from minivllm.layers.sampler import (TOP_P_TOLERANCE, Sampler, SamplingBatch, drop_mask, exponential_race,
                                     filtered_probs, sorted_drop_mask)


def _batch(temps, top_k, top_p, min_p, generators) -> SamplingBatch:
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    n = len(temps)
    return SamplingBatch(
        temperatures=f(temps), top_k=torch.tensor(top_k, dtype=torch.int64), top_p=f(top_p), min_p=f(min_p),
        repetition_penalties=torch.ones(n), seen_token_ids=[None] * n, generators=generators,
        all_greedy=all(t == 0 for t in temps), any_top_k=any(k > 0 for k in top_k),
        any_top_p=any(p < 1 for p in top_p), any_min_p=any(p > 0 for p in min_p), any_penalty=False)


def _reference(logits, batch, default):
    """The reference draw (the sort; what CUDA runs), from the same generator states."""
    greedy = logits.argmax(dim=-1)
    sampled = exponential_race(filtered_probs(logits.clone(), batch, drop=sorted_drop_mask), batch.generators,
                               default)
    return torch.where(batch.temperatures > 0, sampled, greedy)


def _both(logits, temps, top_k, top_p, min_p, seeds):
    """Tokens from the CPU sampler and from the reference, each from fresh generators seeded alike."""
    def fresh():
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        return _batch(temps, top_k, top_p, min_p, gens), torch.Generator().manual_seed(1234)

    batch, default = fresh()
    sampler = Sampler(0, torch.device("cpu"))
    sampler.generator = default
    got = sampler(logits, batch)
    want = _reference(logits, *fresh())
    return got.tolist(), want.tolist()


def _off_the_exact_rule(drop: torch.Tensor, y: np.ndarray, top_k: int, top_p: float) -> float:
    """How far from top-p's threshold (in mass) a row's kept set departs from the rule worked in
    fp64: the largest ``|mass before - threshold|`` of a token kept or dropped against the rule
    (0 when it follows the rule)."""
    v = y.size
    order = np.lexsort((np.arange(v), -y.astype(np.float64)))
    k = top_k if 0 < top_k < v else v
    keep = np.zeros(v, dtype=bool)
    keep[order[:k]] = True
    if top_p < 1:
        e = np.exp(y[order[:k]].astype(np.float64) - float(y[order[0]]))
        p = e / e.sum()
        gap = np.cumsum(p) - p - (float(np.float32(top_p)) - TOP_P_TOLERANCE)
        keep[order[:k][1:]] = gap[1:] < 0
    wrong = np.flatnonzero(keep == drop.numpy())
    if wrong.size == 0:
        return 0.0
    assert top_p < 1 and np.isin(wrong, order[:k]).all(), "top-k's set is exact"
    return float(np.abs(gap[np.isin(order[:k], wrong)]).max())


@pytest.mark.parametrize("vocab,scale", [(50, 3.0), (4096, 3.0), (4096, 0.3), (60_000, 1.0), (60_000, 0.05)])
@pytest.mark.parametrize("case", range(4))
def test_the_cpu_draw_matches_the_reference(vocab, scale, case):
    """16 rows mixing every filter, a greedy row and seeded rows, over several draws; flat rows
    (scale 0.05 over 60,000 tokens) put thousands of tokens in top-p's cut bucket.

    The kept sets follow top-p's rule worked in fp64 but for tokens within 1e-7 of its cut; the
    sort departs from it by more (up to 7e-5 here: torch's fp32 softmax over 60,000 sorted values
    sums them less exactly than numpy's pairwise sum). Rows whose kept sets agree draw the same
    token from the same generator states."""
    rng = np.random.default_rng(case * 7919 + vocab)
    n = 16
    temps = [0.0] + [float(t) for t in rng.uniform(0.3, 1.5, n - 1)]
    top_k = [int(k) for k in rng.choice([0, 0, 1, 5, 50, vocab // 3, vocab, vocab + 5], n)]
    top_p = [float(p) for p in rng.choice([1.0, 1.0, 0.05, 0.5, 0.9, 0.95, 0.999], n)]
    min_p = [float(p) for p in rng.choice([0.0, 0.0, 0.0, 0.05, 0.3], n)]
    seeds = [None if rng.random() < 0.5 else int(rng.integers(1 << 30)) for _ in range(n)]
    logits = torch.from_numpy((rng.standard_normal((n, vocab)) * scale).astype(np.float32))
    logits[3] = logits[3].round()  # many ties
    logits[4, rng.choice(vocab, vocab // 10, replace=False)] = float("-inf")  # banned tokens
    agreed = 0
    for _ in range(3):
        batch = _batch(temps, top_k, top_p, min_p, [None] * n)
        y = logits / torch.where(batch.temperatures > 0, batch.temperatures, torch.ones(n)).unsqueeze(1)
        fast, ref = drop_mask(y, batch), sorted_drop_mask(y, batch)
        got, want = _both(logits, temps, top_k, top_p, min_p, seeds)
        for i in range(1, n):  # row 0 is greedy
            assert _off_the_exact_rule(fast[i], y[i].numpy(), top_k[i], top_p[i]) < 1e-7, i
            assert _off_the_exact_rule(ref[i], y[i].numpy(), top_k[i], top_p[i]) < 1e-4, i
            if torch.equal(fast[i], ref[i]):
                assert got[i] == want[i], i
                agreed += 1
        logits = logits.roll(1, dims=1)
    # Of 45 rows. How many the sort moves depends on the CPU's vector width (torch's softmax sums
    # in one running total per lane): fewer than 6 on the AVX2 EPYC this was written on, 6 on an
    # AVX-512 one.
    assert agreed >= 36


def test_top_token_ids_break_ties_by_id_as_a_stable_sort():
    y = np.array([1, 3, 3, 2, 3, 3, 0, 3], dtype=np.float32)
    for c in range(1, 9):
        want = np.argsort(-y, kind="stable")[:c]
        assert top_token_ids(y, c).tolist() == want.tolist()
    big = np.repeat(np.arange(10, dtype=np.float32), 100)  # 100 tokens at each value, k inside a tie
    assert top_token_ids(big, 150).tolist() == list(range(900, 1000)) + list(range(800, 850))


def test_top_k_rows_gives_each_row_the_set_of_top_token_ids():
    """The batched selection (one torch.topk) against the row-by-row one: per-row k (off, 1, in
    the middle, at V / 4 and above), ties inside the set, ties across the cut, banned tokens,
    a NaN row and a +inf row."""
    rng = np.random.default_rng(3)
    v = 400
    y = rng.standard_normal((10, v)).astype(np.float32)
    y[1] = np.round(y[1])  # a handful of values: ties across every cut
    y[2, :5] = y[2].max() + 1  # five equal largest values, inside the set for k >= 5
    y[3, rng.choice(v, v - 20, replace=False)] = -np.inf  # k beyond the finite values: ties at -inf
    y[4, 7] = np.nan
    y[5, 9] = np.inf
    ks = np.array([5, 30, 7, 50, 3, 3, 0, v, 1, 99], dtype=np.int64)
    got = top_k_rows(y, ks)
    for i, k in enumerate(ks):
        if i in (4, 5) or not 0 < k < v:
            assert got[i] is None, i
            continue
        want = top_token_ids(y[i], int(k))
        assert sorted(got[i].tolist()) == sorted(want.tolist()), i
        vals = y[i, got[i]]
        assert (vals[:-1] >= vals[1:]).all(), i  # largest first
    big_k = top_k_rows(y[:2], np.array([100, 120]))  # k * 4 >= V: the sorted path, per row
    assert [r.tolist() for r in big_k] == [top_token_ids(y[0], 100).tolist(), top_token_ids(y[1], 120).tolist()]
    assert top_k_rows(y, None) == [None] * 10



def test_a_long_kept_set_races_alone(monkeypatch):
    """Rows race together padded to the longest kept set; a flat row whose top-p keeps tens of
    thousands of tokens races alone, so a batch of them does not pad every row to its length
    (a review found ~1 GB of temporaries for 256 such rows). Tokens stay the reference's."""
    from minivllm.layers import cpu_sampling

    widths = []
    race = cpu_sampling._race_over
    monkeypatch.setattr(cpu_sampling, "_race_over",
                        lambda ids, *a: widths.append((len(ids), max(map(len, ids)))) or race(ids, *a))
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.standard_normal((6, 60_000)).astype(np.float32))
    logits[:2] *= 0.01  # flat: top-p 0.999 keeps nearly every token
    top_k, top_p = [0, 0, 5, 50, 0, 2], [0.999, 0.999, 1.0, 0.9, 0.5, 1.0]
    got, want = _both(logits, [1.0] * 6, top_k, top_p, [0.0] * 6, [None, 7, None, 3, None, None])
    assert got == want
    assert all(rows == 1 for rows, width in widths if width > cpu_sampling._RACE_TOGETHER_AT_MOST), widths
    assert sorted(rows for rows, _ in widths) == [1, 1, 1, 3], widths  # top_p=0.5 keeps ~9,700 here

def test_top_p_splits_a_flat_row_and_keeps_what_the_sort_keeps(monkeypatch):
    """A row of 60,000 nearly equal logits and one 30 nats below them: the first split's buckets
    span those 30 nats, so the cut bucket holds all but one token, far more than the sort limit,
    and is split again; the kept ids are the reference's. (Until 2026-12-04 this row had no
    outlier, and its cut bucket held a few hundred tokens: nothing was split again.) The numpy
    path (the C split makes the same steps: tests/test_top_p_native.py)."""
    monkeypatch.setenv("MINIVLLM_CPU_TOP_P", "0")
    splits = []
    real = np.bincount
    monkeypatch.setattr(np, "bincount", lambda x, *a, **k: splits.append(len(x)) or real(x, *a, **k))
    rng = np.random.default_rng(0)
    y = (rng.standard_normal(60_000) * 1e-3).astype(np.float32)
    y[0] = -30.0
    for top_p in (0.3, 0.9, 0.999):
        splits.clear()
        ids = kept_token_ids(y, 0, top_p)
        assert len(splits) >= 2 and splits[1] == 59_999, splits  # a second split of the cut bucket
        probs = filtered_probs(torch.from_numpy(y)[None], _batch([1.0], [0], [top_p], [0.0], [None]),
                               drop=sorted_drop_mask)
        assert set(ids.tolist()) == set(torch.nonzero(probs[0] > 0).flatten().tolist())
    same = np.zeros(10_000, dtype=np.float32)  # every key equal: no split, one sort
    assert sorted(kept_token_ids(same, 0, 0.5).tolist()) == list(range(5000))


def test_nan_and_all_banned_rows_do_not_raise_and_other_rows_are_drawn():
    logits = torch.randn(3, 100)
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    got, want = _both(logits, [1.0, 1.0, 1.0], [10, 10, 10], [0.9, 0.9, 0.9], [0.0] * 3, [None, None, 7])
    assert got[2] == want[2]


def test_a_uniform_draw_of_zero_keeps_the_cpu_draw_on_a_kept_token(monkeypatch):
    """As the reference's test: U = 0 gives finite noise, so a row whose filters left one token
    draws it, not token 0."""
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *args, **kwargs: self.zero_())
    logits = torch.zeros(2, 10)
    logits[0, 7] = logits[1, 3] = 5.0
    batch = _batch([1.0, 1.0], [1, 0], [1.0, 0.01], [0.0, 0.0], [None, torch.Generator().manual_seed(1)])
    assert Sampler(0, torch.device("cpu"))(logits, batch).tolist() == [7, 3]


def test_top_p_orders_its_cut_bucket_by_logit_not_by_its_rounded_key():
    """Two distinct logits can round to one key (max - logit) in fp32; ordered by key, the tie
    went to the lower id and top-p kept the less likely token (found in review)."""
    a = np.float32(0.3)
    y = torch.tensor([[a, np.nextafter(a, np.float32(1)), 8.0]])
    batch = _batch([1.0], [0], [0.99955], [0.0], [None])
    assert torch.equal(drop_mask(y, batch), sorted_drop_mask(y, batch))
    assert drop_mask(y, batch)[0].tolist() == [True, False, False]


def test_a_row_too_narrow_to_split_is_sorted_not_raised():
    """A row whose logits span less than fp32 can divide into buckets (tiny logits, or a huge
    temperature, which SamplingParams accepts) raised ValueError from np.bincount (found in review)."""
    tiny = torch.tensor([[1e-38, 0.0, 0.0, 0.0]])
    batch = _batch([1.0], [0], [0.9], [0.0], [None])
    assert torch.equal(drop_mask(tiny, batch), sorted_drop_mask(tiny, batch))
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(0))
    got, want = _both(logits, [1e37], [0], [0.9], [0.0], [None])
    assert got == want
