"""Top-p (and top-k with it) keep exactly the tokens their definitions say, fp32 rounding notwithstanding;
the exponential race then samples the probabilities they leave."""
from __future__ import annotations

import warnings
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.layers.sampler import SamplingBatch, filtered_probs, sorted_drop_mask


def _batch(top_p: list[float], top_k: list[int] | None = None) -> SamplingBatch:
    n = len(top_p)
    k = torch.tensor(top_k or [0] * n, dtype=torch.int64)
    return SamplingBatch(
        temperatures=torch.ones(n), top_k=k, top_p=torch.tensor(top_p, dtype=torch.float32),
        min_p=torch.zeros(n), repetition_penalties=torch.ones(n), seen_token_ids=[None] * n,
        generators=[None] * n, all_greedy=False, any_top_k=bool((k > 0).any()),
        any_top_p=any(p < 1 for p in top_p), any_min_p=False, any_penalty=False)


def kept(probs: list[float], top_p: float, top_k: int = 0) -> set[int]:
    """Token ids that survive the filters, for one row given as probabilities; the CPU sampler's
    selection (minivllm/layers/cpu_sampling.py, no sort) must keep the same ones."""
    from minivllm.layers.cpu_sampling import kept_token_ids

    logits = torch.tensor([probs], dtype=torch.float32).log()
    out = filtered_probs(logits, _batch([top_p], [top_k]), drop=sorted_drop_mask)
    want = set(torch.nonzero(out[0] > 0).flatten().tolist())
    ids = kept_token_ids(logits[0].numpy(), top_k, top_p)
    assert (set(range(len(probs))) if ids is None else set(ids.tolist())) == want
    assert torch.equal(filtered_probs(logits, _batch([top_p], [top_k])), out)  # the CPU default: no sort
    return want


def test_issue_example_drops_the_token_past_the_boundary():
    # 0.5 + 0.3 reaches 0.8 exactly; fp32 puts it a hair below, which kept token 1 before.
    assert kept([0.3, 0.1, 0.1, 0.5], top_p=0.8) == {0, 3}


@pytest.mark.parametrize("probs,top_p,expected", [
    ([0.5, 0.25, 0.125, 0.125], 0.75, {0, 1}),      # boundary, exact in binary
    ([0.5, 0.25, 0.125, 0.125], 0.5, {0}),
    ([0.5, 0.25, 0.125, 0.125], 0.76, {0, 1, 2}),   # past a boundary: one more token
    ([0.7, 0.2, 0.1], 0.9, {0, 1}),                  # boundary, inexact in binary
    ([0.1, 0.6, 0.3], 0.6, {1}),
    ([0.6, 0.3, 0.1], 0.61, {0, 1}),
])
def test_boundaries(probs, top_p, expected):
    assert kept(probs, top_p) == expected


def test_ties_keep_the_smallest_set_lowest_ids_first():
    assert kept([0.4, 0.2, 0.2, 0.2], top_p=0.6) == {0, 1}
    assert kept([0.2, 0.2, 0.4, 0.2], top_p=0.6) == {0, 2}
    assert kept([0.4, 0.2, 0.2, 0.2], top_p=0.7) == {0, 1, 2}
    assert kept([0.25] * 4, top_p=0.5) == {0, 1}


def test_top_p_one_keeps_every_token_even_a_negligible_tail():
    logits = torch.tensor([[0.0, -40.0, -40.0, 5.0]])
    assert (filtered_probs(logits, _batch([1.0])) > 0).all()


def test_top_p_below_the_tolerance_still_keeps_the_most_likely_token():
    assert kept([0.3, 0.1, 0.1, 0.5], top_p=1e-7) == {3}


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.99, 1.0])
def test_top_k_one_with_top_p_keeps_only_the_argmax(top_p):
    assert kept([0.3, 0.1, 0.1, 0.5], top_p=top_p, top_k=1) == {3}


def test_top_p_applies_to_the_top_k_renormalised_mass():
    # After top_k=2 the mass is {0.5/0.8, 0.3/0.8} = {0.625, 0.375}: top_p=0.6 keeps one.
    assert kept([0.3, 0.1, 0.1, 0.5], top_p=0.6, top_k=2) == {3}
    assert kept([0.3, 0.1, 0.1, 0.5], top_p=0.7, top_k=2) == {0, 3}


def test_rows_are_filtered_independently():
    logits = torch.tensor([[0.3, 0.1, 0.1, 0.5]] * 3).log()
    out = filtered_probs(logits, _batch([1.0, 0.8, 0.5]))
    assert [set(torch.nonzero(r > 0).flatten().tolist()) for r in out] == [{0, 1, 2, 3}, {0, 3}, {3}]


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 12), min_size=2, max_size=12), data=st.data())
def test_matches_exact_rational_rule(weights, data):
    """Against the rule in exact arithmetic: the smallest set, most likely first (ties by
    id), whose mass reaches top_p, with top_p on or between cumulative boundaries."""
    total = sum(weights)
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    boundaries = [Fraction(sum(weights[j] for j in order[:n]), total) for n in range(1, len(order) + 1)]
    n = data.draw(st.integers(0, len(order) - 1), label="boundary")
    on_boundary = data.draw(st.booleans(), label="on_boundary")
    if on_boundary or n == 0:
        target = boundaries[n]
    else:  # halfway between boundaries n-1 and n: the set must reach boundary n
        target = (boundaries[n - 1] + boundaries[n]) / 2
    if target >= 1:
        return  # top_p = 1 disables the filter (tested above)
    expected = set(order[:n + 1])
    assert kept([w / total for w in weights], top_p=float(target)) == expected


def test_the_race_noise_is_exponential_and_the_race_samples_the_probabilities():
    """Exp(1) noise as -log(U) (faster than torch's exponential_ on a CPU): a Kolmogorov-Smirnov
    test against Exp(1), never 0 or NaN; and the race over fixed probabilities matches them by a
    chi-square test, where a wrong noise (uniform instead of exponential) is rejected."""
    from scipy.stats import chisquare, kstest

    from minivllm.layers.sampler import exponential_noise_, exponential_race

    gen = torch.Generator().manual_seed(11)
    noise = exponential_noise_(torch.empty(200_000), gen)
    assert noise.min() > 0 and not noise.isnan().any()
    assert kstest(noise.numpy(), "expon").pvalue > 1e-3
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    rows = p.expand(60_000, -1).contiguous()
    counts = torch.bincount(exponential_race(rows, [None] * len(rows), gen), minlength=6)
    assert counts[5] == 0  # probability 0 never wins
    assert chisquare(counts[:5].numpy(), (p[:5] * len(rows)).numpy()).pvalue > 1e-3
    wrong = torch.bincount((rows / torch.rand(rows.shape, generator=gen)).argmax(-1), minlength=6)
    assert chisquare(wrong[:5].numpy(), (p[:5] * len(rows)).numpy()).pvalue < 1e-6


def test_a_uniform_draw_of_zero_does_not_sample_a_filtered_token(monkeypatch):
    """fp32 uniform_ returns exactly 0 once in 2^24 draws; as -log(0) = inf noise, a row whose
    filters left one token would see p / E = 0 everywhere and argmax would return token 0, a
    token of probability 0 (found in review). Every uniform draw is forced to 0 here."""
    from minivllm.layers.sampler import exponential_noise_, exponential_race

    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *args, **kwargs: self.zero_())
    assert torch.isfinite(exponential_noise_(torch.empty(8), None)).all()
    probs = torch.zeros(2, 10)
    probs[0, 7] = probs[1, 3] = 1.0
    assert exponential_race(probs, [None, torch.Generator().manual_seed(1)], None).tolist() == [7, 3]


def test_argmax_rows_matches_torch_argmax_ties_nan_inf_and_strided_rows():
    """The CPU fast path (numpy's argmax) picks what torch's argmax picks: the first maximum of a
    row with ties, the first NaN of a row holding one, +inf over finite values; strided rows too."""
    from minivllm.layers.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 50, generator=g)
    x[1, [3, 7, 20]] = 5.0  # a tie: the first wins
    x[2, [4, 9]] = float("nan")
    x[3, 11] = float("inf")
    x[4, :] = float("-inf")
    x[5, [2, 30]] = float("inf")
    x[6, [6]] = float("nan")
    x[6, [1]] = float("inf")
    x[7] = x[7].round()  # many ties
    for t in (x, x[:, ::2], x.t().contiguous().t(), x[::2]):
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
    assert torch.equal(argmax_rows(x.double()), x.double().argmax(dim=-1))  # other dtypes: torch's


def test_greedy_token_ids_match_the_general_path_and_mark_non_finite_rows():
    """The plain-greedy CPU path (numpy) gives what the sampler followed by the runner's check
    gives: each row's first maximum, -1 for a row holding NaN, +inf or -inf; it declines (None)
    every batch or tensor the general path must take."""
    from minivllm.layers.sampler import Sampler

    sampler = Sampler(0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 50, generator=g)
    x[1, [3, 7]] = 5.0  # a tie
    x[2, 4] = float("nan")
    x[3, 11] = float("inf")
    x[4, 9] = float("-inf")
    x[5] = x[5].round()
    greedy = SamplingBatch.greedy(8)
    general = sampler(x, greedy).masked_fill(~torch.isfinite(x.sum(dim=-1)), -1).tolist()
    assert general[2] == general[3] == general[4] == -1
    for t in (x, x[:, ::2].contiguous(), x[:, ::2]):
        want = sampler(t, greedy).masked_fill(~torch.isfinite(t.sum(dim=-1)), -1).tolist()
        assert sampler.greedy_token_ids(t, greedy) == want
    assert sampler.greedy_token_ids(x, greedy) == general
    finite = x[[0, 1, 5, 6, 7]]
    assert sampler.greedy_token_ids(finite, SamplingBatch.greedy(5)) == finite.argmax(dim=-1).tolist()
    assert sampler.greedy_token_ids(x.double(), greedy) is None
    mixed = torch.zeros(3, 8)
    mixed[0, 1], mixed[1, 2] = float("inf"), float("-inf")  # their sum is NaN: numpy would warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning turned into an error must not fail the step
        assert sampler.greedy_token_ids(mixed, SamplingBatch.greedy(3)) == [-1, -1, 0]
    for field, value in (("all_greedy", False), ("any_penalty", True), ("processing", [None] * 8),
                         ("keep_processed", True), ("num_logprobs", [1] * 8)):
        batch = SamplingBatch.greedy(8)
        setattr(batch, field, value)
        assert sampler.greedy_token_ids(x, batch) is None, field
