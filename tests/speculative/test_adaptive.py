"""The adaptive rule: a request backs off when its accept length does not pay, and comes back."""

from __future__ import annotations

from pdserve.engine.speculative.adaptive import AdaptiveRule


def test_misses_back_off_with_growing_pauses_and_hits_keep_speculating():
    rule = AdaptiveRule(4, beta=0.1, min_backoff=2, max_backoff=8)
    assert rule.budget("r") == 4
    rule.verified("r", 4, 0)  # one miss: the prior keeps it going
    assert rule.budget("r") == 2  # ceil(ema 0.5) + 1
    rule.verified("r", 2, 0)  # ema 0.25 > 0.1 * 2
    assert rule.budget("r") == 2
    rule.verified("r", 2, 0)  # ema 0.125 <= 0.2: back off for 2 steps
    assert [rule.budget("r") for _ in range(3)] == [0, 0, 4]
    rule.verified("r", 4, 0)
    rule.verified("r", 2, 0)
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


def test_batch_cut_keeps_rows_under_the_cap_best_average_first():
    rule = AdaptiveRule(4, max_verify_tokens=8)
    rule.verified("good", 4, 4)
    rule.verified("bad", 4, 1)
    drafts = rule.cut_batch(["bad", "good", "new"], [[1, 2, 3, 4], [5, 6, 7, 8], [9]])
    assert len(drafts) + sum(map(len, drafts)) == 8
    assert drafts[1] == [5, 6, 7, 8]  # the best average keeps all of its draft
    assert drafts[2] == []  # a request with no verify yet ranks lowest
    assert rule.cut_batch(["a"], [[1, 2]]) == [[1, 2]]
