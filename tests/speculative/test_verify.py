"""The acceptance rule: greedy runs equal plain greedy decoding; rejection sampling keeps the
target's distribution (chi-square with a fixed seed)."""

from __future__ import annotations

import math
import random

import torch

from pdserve.engine.speculative.verify import accept_greedy, accept_sampled, step_uniforms, target_probs


def test_greedy_keeps_the_matching_prefix_and_one_more():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the correction ends the run
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([4], []) == [4]


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells of expected count >= 5 (the rest pooled into one)."""
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def test_rejection_sampling_matches_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(3, vocab, generator=gen) * 2
    probs = target_probs(logits, 0.8, -1, 0.95, 0.0)  # temperature and top-p, as a request asks
    likely = int(probs[0].argmax())
    draft = [likely, int(probs[1].argmax())]  # point-mass drafts that are often, not always, right
    rng = random.Random(0)
    n = 8000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    n_second = 0
    for _ in range(n):
        out = accept_sampled(probs, draft, step_uniforms(None, 0, 3, rng))
        first[out[0]] += 1
        if out[0] == likely:  # given the first token, the second must follow row 1
            second[out[1]] += 1
            n_second += 1
    for counts, p, m in ((first, probs[0], n), (second, probs[1], n_second)):
        stat, df = chi2(counts, p, m)
        assert stat < chi2_critical(df), (stat, df)
        assert counts[p == 0].sum() == 0  # never a token top-p excludes
    # the check can fail: a sampler that always accepted the draft would be far off
    biased = torch.zeros(vocab)
    biased[likely] = n
    assert chi2(biased, probs[0], n)[0] > chi2_critical(chi2(biased, probs[0], n)[1])


def test_seeded_uniforms_depend_on_seed_and_position_only():
    rng = random.Random(1)
    a = step_uniforms(7, 10, 3, rng)
    assert a[1:] == step_uniforms(7, 11, 2, random.Random(99))
    assert a != step_uniforms(8, 10, 3, rng)
