"""The adaptive rule: a request backs off when its accept length does not pay, and comes back; a batch
keeps the drafts that pay for the verify step's cost."""

from __future__ import annotations

import pytest

from pdserve.engine.speculative.adaptive import AdaptiveRule

# the logic's examples are worked with these costs (an extend-path verify's) and prior, not the defaults
COSTS = dict(fixed=(0.33, 1.0), beta=(0.07, 0.3), prior=1.5)


def test_misses_back_off_with_growing_pauses_and_hits_keep_speculating():
    rule = AdaptiveRule(4, min_backoff=2, max_backoff=8, **COSTS)
    assert rule.budget("r") == 4
    rule.verified("r", 4, 0)  # one miss: the prior keeps it going (ema 0.75 > c(1, 5) - 1 = 0.61)
    assert rule.budget("r") == 2  # ceil(ema) + 1
    rule.verified("r", 2, 0)  # ema 0.375 <= 0.47: back off for 2 steps
    assert [rule.budget("r") for _ in range(3)] == [0, 0, 4]
    rule.verified("r", 4, 0)
    rule.verified("r", 2, 0)  # the probe failed again: the pause doubles
    assert [rule.budget("r") for _ in range(5)] == [0, 0, 0, 0, 4]
    for _ in range(5):
        rule.verified("r", 4, 4)  # everything accepted: full drafts, no pause
        assert rule.budget("r") == 4
    rule.release("r")
    assert rule.budget("r") == 4


def test_empty_drafts_change_nothing():
    rule = AdaptiveRule(4)
    rule.verified("r", 0, 0)
    assert rule.budget("r") == 4


def test_cost_model_grows_with_rows_and_batch():
    rule = AdaptiveRule(4, **COSTS)
    assert rule.cost(1, 1) == 1.0 and rule.cost(8, 8) == 1.0
    assert rule.cost(1, 5) == pytest.approx(1 + 0.33 + 0.07 * 4)
    assert rule.cost(8, 40) == pytest.approx(1 + 1.0 + 0.3 * 4)
    assert rule.cost(8, 16) > rule.cost(1, 2)
    measured = AdaptiveRule(4)  # the defaults: the expanded-rows verify (docs/SPECULATIVE.md)
    assert measured.cost(1, 5) == pytest.approx(1 + measured.fixed[0] + measured.beta[0] * 4)
    assert measured.cost(8, 16) > measured.cost(1, 2) > 1.0


def test_batch_keeps_the_drafts_that_pay_best_average_first():
    rule = AdaptiveRule(4, **COSTS)
    for _ in range(4):
        rule.verified("good", 4, 4)
    assert rule.cut_batch(["new"], [[1, 2, 3, 4]]) == [[1, 2, 3, 4]]  # batch 1: a probe's prior pays
    assert rule.cut_batch(["new", "good"], [[1, 2], [5, 6, 7, 8]]) == [[1, 2], [5, 6, 7, 8]]
    # batch 8: the verify step costs 2-3 plain steps; probes (1.5 expected each) do not pay, nor does
    # one good draft among them; eight near-certain drafts do
    probes = [f"p{i}" for i in range(8)]
    assert rule.cut_batch(probes, [[1, 2, 3, 4]] * 8) == [[]] * 8
    assert rule.cut_batch(["good"] + probes[1:], [[1, 2, 3, 4]] + [[]] * 7) == [[]] * 8
    assert rule.cut_batch(["good"] * 8, [[1, 2, 3, 4]] * 8) == [[1, 2, 3, 4]] * 8


def test_a_batch_that_does_not_pay_by_the_prior_explores_now_and_then():
    rule = AdaptiveRule(4, explore_every=4, **COSTS)
    probes = [f"p{i}" for i in range(8)]
    kept = [rule.cut_batch(probes, [[1, 2, 3, 4]] * 8) for _ in range(8)]
    assert [any(k) for k in kept] == [False, False, False, True] * 2  # every 4th step measures them
    for rid in probes:
        rule.verified(rid, 4, 4)  # they turn out to copy: now the batch pays every step
    assert all(any(rule.cut_batch(probes, [[1, 2, 3, 4]] * 8)) for _ in range(4))


def test_drafts_that_could_not_pay_even_all_accepted_are_never_explored():
    """A draft model as dear as the target (each guess one more target step): at batch 8, even
    every draft accepted would not pay, so the batch never verifies, not even to explore; at
    batch 1 the cheap rule's explore still runs."""
    dear = AdaptiveRule(2, explore_every=2, fixed=COSTS["fixed"], beta=tuple(b + 1.0 for b in COSTS["beta"]))
    probes = [f"p{i}" for i in range(8)]
    assert not any(any(dear.cut_batch(probes, [[1, 2]] * 8)) for _ in range(8))
    cheap = AdaptiveRule(2, explore_every=2, **COSTS)
    assert any(any(cheap.cut_batch(probes, [[1, 2]] * 8)) for _ in range(8))


def test_a_draft_models_steps_are_priced_per_forward_not_per_sequence():
    """A self-draft whose step costs 0.6 of the target's, 4 rows a forward: at batch 1 a well
    accepted draft pays (2 draft steps and a verify for about 3 tokens); at batch 8 its forwards
    cost as much whatever the drafting requests, so no subset pays and nothing is explored."""
    rule = AdaptiveRule(2, explore_every=2, draft_step=0.6, draft_group=4)
    assert rule.cost(1, 3, 2, 1) == pytest.approx(1 + rule.fixed[0] + 2 * rule.beta[0] + 2 * 0.6)
    assert rule.cost(8, 10, 2, 1) < rule.cost(8, 16, 2, 4) < rule.cost(8, 17, 2, 5)  # a fifth adds forwards
    for _ in range(3):
        rule.verified("good", 2, 2)
    assert rule.cut_batch(["good"], [[1, 2]]) == [[1, 2]]
    probes = [f"p{i}" for i in range(8)]
    for rid in probes:
        for _ in range(3):
            rule.verified(rid, 2, 2)
    assert not any(any(rule.cut_batch(probes, [[1, 2]] * 8)) for _ in range(4))
    assert not any(any(rule.cut_batch([f"new{i}" for i in range(8)], [[1, 2]] * 8)) for _ in range(4))


def test_a_free_proposer_is_asked_only_where_a_draft_could_be_kept():
    """NGRAM is not asked at a step where no request's draft could pay at any length (its lookups
    then cost nothing); the step still counts towards exploring, which asks again."""
    rule = AdaptiveRule(4, explore_every=4)  # the measured costs: c(8, 9) - 1 = 0.08, beta(8) 0.39
    rids = [f"r{i}" for i in range(8)]
    assert rule.worth_asking(["new"], [4])  # batch 1: a probe's prior pays
    assert rule.worth_asking(rids, [4] * 8)  # never measured: 1-token drafts pay by the prior
    for rid in rids:
        rule.verified(rid, 2, 0)
        rule.verified(rid, 1, 0)  # ema 0.25: above c(1, 2) - 1, no back-off, but no pay at batch 8
    asked = [rule.worth_asking(rids, [2] * 8) for _ in range(8)]
    assert asked == [False] * 8  # all measured: exploring has nothing to learn
    rule.verified("r0", 2, 2)
    rule.verified("r0", 2, 2)  # a copy begins: ema 1.56, its draft pays even at batch 8
    assert rule.worth_asking(rids, [2] * 8)
    assert any(rule.cut_batch(rids, [[1, 2]] * 8))
