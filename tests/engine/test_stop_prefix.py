"""The stop-string holdback: what a KMP automaton per stop string holds back equals the longest
suffix of the text that is a proper prefix of a stop string, however the text arrives; and its
work grows with the text, not with the text times the stop string's length."""

from __future__ import annotations

import random

from pdserve.engine.text.stop_prefix import StopPrefixTracker


def brute_holdback(text: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best


def test_holdback_matches_the_definition_on_random_texts():
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        tracker, text = StopPrefixTracker(stops), ""
        for _ in range(rng.randint(1, 12)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            tracker.feed(piece)
            text += piece
            assert tracker.holdback() == brute_holdback(text, stops), (stops, text)


class CountingList(list):
    lookups = 0

    def __getitem__(self, i):
        CountingList.lookups += 1
        return super().__getitem__(i)


def test_work_is_linear_in_the_text():
    """Failure-link steps over a whole output: at most one per character fed, even for a 20 000-
    character stop string that keeps almost matching (testing every prefix at every token would
    compare about 16 000 characters per token here)."""
    stop = "a" * 20_000 + "b"
    tracker = StopPrefixTracker([stop])
    tracker._fail[0] = CountingList(tracker._fail[0])
    fed = 0
    for _ in range(3):
        for _ in range(4_000):  # tokens of 4 characters
            tracker.feed("aaaa")
            fed += 4
        assert tracker.holdback() == 16_000  # the run of a's since the last break
        tracker.feed("c")  # the near-match breaks: one walk down the failure links
        fed += 1
        assert tracker.holdback() == 0
    assert CountingList.lookups <= fed
