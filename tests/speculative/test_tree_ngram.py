"""NGRAM draft trees: the continuations of several earlier occurrences merged into a prefix tree."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.speculative import registry
from pdserve.engine.speculative.ngram import NgramProposer, merge_tree
from pdserve.engine.speculative.proposer import Draft, DraftInput


def propose(p: NgramProposer, tokens, k=4, rid="r") -> Draft:
    (d,) = p.propose([DraftInput(rid, tokens, k)])
    return d


def paths(d: Draft) -> set[tuple[int, ...]]:
    """Every root-to-node token path of the tree."""
    out, by_node = set(), []
    for tok, par in zip(d.tokens, d.parents):
        by_node.append((by_node[par] if par >= 0 else ()) + (tok,))
        out.add(by_node[-1])
    return out


def check_tree(d: Draft, k: int) -> None:
    assert len(d.tokens) <= k
    assert all(-1 <= p < j for j, p in enumerate(d.parents))  # parents before children
    siblings = {}
    for tok, par in zip(d.tokens, d.parents):
        assert tok not in siblings.setdefault(par, set())  # siblings are distinct tokens
        siblings[par].add(tok)


def test_two_occurrences_with_different_continuations_make_two_branches():
    # "7 8" is followed by "1 2 3" (earlier) and "4 5 6" (latest): the latest is the first chain
    toks = [7, 8, 1, 2, 3, 9, 7, 8, 4, 5, 6, 9, 7, 8]
    d = propose(NgramProposer(1, 4, 2), toks, k=5)
    check_tree(d, 5)
    assert d.parents[:3] == [-1, 0, 1] and d.tokens[:3] == [4, 5, 6]  # the best candidate, first
    assert (1,) in paths(d) and (4, 5, 6) in paths(d)
    # one branch: the chain of the latest occurrence, as before trees
    assert propose(NgramProposer(1, 4, 1), toks, k=5) == Draft.chain([4, 5, 6, 9, 7])


def test_shared_prefixes_are_one_node_and_a_lone_candidate_is_a_chain():
    d = merge_tree([[1, 2, 3], [1, 2, 4], [5]], 16)
    assert d == Draft([1, 2, 3, 4, 5], [-1, 0, 1, 1, -1])
    assert merge_tree([[1, 2, 3]], 16) == Draft.chain([1, 2, 3])
    assert merge_tree([[1, 2, 3], [1, 2, 3]], 16) == Draft.chain([1, 2, 3])  # the same continuation twice
    assert merge_tree([], 4) == Draft()
    # the budget keeps the nodes most likely reached, a tree (parents kept before children)
    cut = merge_tree([[1, 2, 3, 4, 5, 6], [7, 8, 9]], 3)
    check_tree(cut, 3)
    assert cut.tokens[:2] == [1, 2]


def test_shorter_suffixes_fill_the_branches_and_trees_stay_valid():
    rnd = random.Random(0)
    seq = [rnd.randrange(6) for _ in range(300)]  # a small alphabet: many repeated n-grams
    p, fresh_trees = NgramProposer(1, 6, 3), 0
    for n in range(1, len(seq) + 1):
        for k in (1, 3, 8):
            d = propose(p, seq[:n], k=k, rid="a")
            check_tree(d, k)
            # deterministic in the tokens: an incremental index proposes as a fresh one (TP ranks alike)
            assert d == propose(NgramProposer(1, 6, 3), seq[:n], k=k, rid="b")
            fresh_trees += d.parents != list(range(-1, len(d.tokens) - 1))
    assert fresh_trees > 100  # most drafts here are trees


def test_branches_come_from_the_config_and_are_checked():
    p = registry.create_proposer(EngineConfig(speculative_algorithm="NGRAM", speculative_ngram_branches=3), runner=None)
    assert p.branches == 3
    assert registry.create_proposer(EngineConfig(speculative_algorithm="NGRAM"), runner=None).branches == 1
    with pytest.raises(ValueError, match="speculative_ngram_branches"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_ngram_branches=0)
