"""The NGRAM proposer: longest suffix match over the request's own tokens, a chain of what followed."""

from __future__ import annotations

import pytest

from pdserve.engine.speculative.ngram import NgramProposer
from pdserve.engine.speculative.proposer import Draft, DraftInput


def propose(p: NgramProposer, tokens, k=4, rid="r"):
    (d,) = p.propose([DraftInput(rid, tokens, k)])
    assert d.parents == list(range(-1, len(d.tokens) - 1))  # a chain
    return d.tokens


def test_longest_suffix_wins_and_latest_occurrence():
    p = NgramProposer(1, 4)
    # suffix [7, 8]: "7 8" occurs at 0 (followed by 1 2) and at 5 (followed by 3 4); "5 7 8" only at 4
    toks = [7, 8, 1, 2, 5, 7, 8, 3, 4, 9, 5, 7, 8]
    assert propose(p, toks, k=3) == [3, 4, 9]
    # without the 3-gram the latest 2-gram occurrence wins
    assert propose(NgramProposer(1, 2), [7, 8, 1, 2, 6, 7, 8, 3, 4, 9, 7, 8], k=2) == [3, 4]


def test_no_match_is_an_empty_draft_and_suffix_never_matches_itself():
    p = NgramProposer(2, 3)
    assert propose(p, [1, 2, 3, 4, 5]) == []
    assert propose(p, [1, 2]) == []
    assert propose(NgramProposer(1, 1), [4]) == []


def test_draft_is_cut_at_max_tokens_and_sequence_end():
    p = NgramProposer(1, 3)
    toks = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert propose(p, toks, k=2) == [4, 5]
    assert propose(NgramProposer(1, 3), toks, k=16) == [4, 5, 6, 1, 2, 3]


def test_incremental_index_equals_a_fresh_one_and_rid_reuse_rebuilds():
    p = NgramProposer(1, 5)
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5]
    for n in range(1, len(seq) + 1):
        assert propose(p, seq[:n], rid="a") == propose(NgramProposer(1, 5), seq[:n], rid="b")
    # the same rid with other tokens (not an extension): the index is rebuilt, not reused
    assert propose(p, [1, 2, 1], rid="a") == [2, 1]
    p.release("a")
    assert propose(p, [9, 9], rid="a", k=3) == [9]


def test_zero_budget_and_bad_windows():
    p = NgramProposer()
    assert p.propose([DraftInput("r", [1, 1, 1], 0)]) == [Draft()]
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
