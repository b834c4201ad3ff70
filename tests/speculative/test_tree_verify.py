"""Acceptance over a draft tree: greedy follows the target's argmax through the tree; multi-candidate
rejection sampling keeps the target's distribution (chi-square, fixed seed, p = 0.001 threshold)."""

from __future__ import annotations

import random

import torch

from pdserve.engine.speculative.verify import (
    TreeUniforms, accept_greedy, accept_greedy_tree, accept_sampled, accept_sampled_tree, step_uniforms, target_probs,
)

from test_verify import chi2, chi2_critical

# the fed token's children 10 (with children 20, 21) and 11 (with child 22); node 3 (21) has child 30
TOKENS = [10, 20, 11, 21, 22, 30]
PARENTS = [-1, 0, -1, 0, 2, 3]


def test_greedy_follows_the_matching_child_and_ends_with_the_bonus():
    # rows: fed, node0 (10), node1 (20), node2 (11), node3 (21), node4 (22), node5 (30)
    assert accept_greedy_tree([11, 0, 0, 22, 0, 7, 0], TOKENS, PARENTS) == ([11, 22, 7], [2, 4])  # not the first chain
    assert accept_greedy_tree([10, 21, 0, 0, 30, 0, 8], TOKENS, PARENTS) == ([10, 21, 30, 8], [0, 3, 5])
    assert accept_greedy_tree([12, 0, 0, 0, 0, 0, 0], TOKENS, PARENTS) == ([12], [])
    # a chain is accepted as accept_greedy accepts it
    target, chain = [5, 6, 9, 8], [5, 6, 7]
    assert accept_greedy_tree(target, chain, [-1, 0, 1])[0] == accept_greedy(target, chain)


def test_sampled_chain_draws_exactly_as_the_chain_rule():
    gen = torch.Generator().manual_seed(3)
    probs = target_probs(torch.randn(4, 30, generator=gen) * 2, 0.9, -1, 1.0, 0.0)
    draft = [int(probs[0].argmax()), int(probs[1].argmax()), 4]
    for seed in range(50):
        a = accept_sampled(probs, draft, step_uniforms(seed, 0, 4, random.Random(0)))
        b, path = accept_sampled_tree(probs, draft, [-1, 0, 1], TreeUniforms(seed, 0, 4, random.Random(0)))
        assert a == b and path == list(range(len(b) - 1))


def test_tree_rejection_sampling_matches_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(1 + 4, vocab, generator=gen) * 2
    probs = target_probs(logits, 0.8, -1, 0.95, 0.0)
    order = probs[0].argsort(descending=True).tolist()
    a, b, c = order[0], order[1], order[5]  # the fed token's children: likely, less likely, unlikely
    x = int(probs[1].argmax())
    tokens, parents = [a, x, b, c], [-1, 0, -1, -1]  # node 0 (a) has child node 1 (x)
    rng = random.Random(0)
    n = 12000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    n_second = 0
    paths = set()
    for _ in range(n):
        out, path = accept_sampled_tree(probs, tokens, parents, TreeUniforms(None, 0, 3, rng))
        paths.add(tuple(path))
        first[out[0]] += 1
        if out[0] == a:  # a stood as node 0: the next token must follow node 0's row
            second[out[1]] += 1
            n_second += 1
    for counts, p, m in ((first, probs[0], n), (second, probs[1], n_second)):
        stat, df = chi2(counts, p, m)
        assert stat < chi2_critical(df), (stat, df)
        assert counts[p == 0].sum() == 0  # never a token top-p excludes
    assert {(), (0,), (0, 1), (2,)} <= paths  # rejections, a second sibling accepted, a deeper path
    # the test can fail: always taking the first child that has any mass is far off
    biased = torch.zeros(vocab)
    biased[a] = n
    assert chi2(biased, probs[0], n)[0] > chi2_critical(chi2(biased, probs[0], n)[1])


def test_seeded_tree_uniforms_repeat():
    u1, u2 = TreeUniforms(7, 3, 2, random.Random(1)), TreeUniforms(7, 3, 2, random.Random(2))
    assert [u1.accept(1, r) for r in range(3)] == [u2.accept(1, r) for r in range(3)]
    assert u1.draw(0) == u2.draw(0) and u1.accept(0, 1) != u1.accept(1, 1)
