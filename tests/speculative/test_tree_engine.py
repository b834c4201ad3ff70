"""Draft trees in a colocated scheduler loop on a tiny random checkpoint (fp32, in-process).

The tree mask equals attention over each path alone; greedy outputs with tree drafts equal plain
decoding's token for token, including stops, EOS and max_tokens inside an accepted run and paths
that are not the first chain (their K/V moved to their positions' slots, then decoding goes on);
NGRAM trees and seeded sampling run; a regex grammar is never broken by a tree's branches; the
pool is checked after every step and unleaked at the end (``generate``).
"""

from __future__ import annotations

import random
import re

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculative.ngram import NgramProposer, merge_tree
from pdserve.engine.speculative.proposer import Draft

from test_spec_tiny_model import generate, greedy, prompts, runner  # noqa: F401 - runner is a fixture

torch.set_num_threads(1)


class TreeOracle:
    """Knows each request's true continuation; drafts a tree of the truth and wrong branches in a
    random order, so the accepted path is often not the first chain. The draws depend on the tokens
    only (as NGRAM's drafts do), so requests with one seed and one prompt repeat."""

    name, wants_hidden = "TREE_ORACLE", False

    def __init__(self, truth: dict[str, list[int]], seed: int = 0, strict: bool = True):
        """``strict``: the request's tokens must follow the truth (greedy); else the drafts are the
        truth's tokens at the same positions, whatever came before (sampling)."""
        self.truth, self.seed, self.trees, self.strict = truth, seed, 0, strict

    def propose(self, inputs):
        out = []
        for i in inputs:
            full = self.truth[i.rid]
            n = len(i.token_ids)
            assert not self.strict or list(i.token_ids) == full[:n]
            rnd = random.Random(hash((self.seed, tuple(i.token_ids))))
            true = full[n : n + rnd.randint(0, i.max_tokens)]
            cands = [true]
            for _ in range(rnd.randint(1, 2)):  # wrong branches off the truth's prefix
                cut = rnd.randint(0, len(true))
                cands.append(true[:cut] + [(t + 7 + cut) % 500 for t in full[n + cut : n + cut + 3]])
            rnd.shuffle(cands)
            d = merge_tree(cands, i.max_tokens, rank_weight=1.0, depth_weight=0.9)
            self.trees += d.parents != list(range(-1, len(d.tokens) - 1))
            out.append(d)
        return out

    def release(self, rid):
        pass

    def close(self):
        pass


def test_tree_mask_equals_each_path_alone(runner):  # noqa: F811
    pool = runner.page_pool
    prompt = prompts(1, 7)[0]
    n = len(prompt)
    tokens, parents = [5, 6, 9, 7, 8], [-1, 0, -1, 1, 0]  # two children of the fed token; node 0 has two
    pages = pool.alloc(pool.pages_for(n + len(tokens)))
    slot = lambda p: pages[p // 4] * 4 + p % 4  # noqa: E731
    table = torch.tensor([pages], dtype=torch.int32)
    try:
        # the prefix's KV, then the fed token and the tree as one extend over it
        runner.forward(ForwardBatch(torch.tensor(prompt[:-1]), torch.arange(n - 1), torch.tensor([slot(p) for p in range(n - 1)]),
                                    table, torch.tensor([n - 2]), [n - 1], [n - 1]))
        depth = [1, 2, 1, 3, 2]
        fb = ForwardBatch(torch.tensor(prompt[-1:] + tokens), torch.tensor([n - 1] + [n - 1 + d for d in depth]),
                          torch.tensor([slot(p) for p in range(n - 1, n + len(tokens))]), table,
                          torch.arange(1 + len(tokens)), [1 + len(tokens)], [n + len(tokens)], tree_parents=[parents])
        tree = runner.forward(fb)
    finally:
        pool.free(pages)
    for j in range(-1, len(tokens)):
        path, node = [], j
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        seq = prompt + path
        ref_pages = pool.alloc(pool.pages_for(len(seq)))
        try:
            ref = runner.forward(ForwardBatch(torch.tensor(seq), torch.arange(len(seq)),
                                              torch.tensor([ref_pages[p // 4] * 4 + p % 4 for p in range(len(seq))]),
                                              torch.tensor([ref_pages], dtype=torch.int32), torch.tensor([len(seq) - 1]),
                                              [len(seq)], [len(seq)]))
        finally:
            pool.free(ref_pages)
        torch.testing.assert_close(tree[1 + j], ref[0], atol=1e-4, rtol=1e-4)


def test_tree_drafts_greedy_equal_plain_decoding_with_stops_and_moves(runner):  # noqa: F811
    ps = prompts(3, 1)
    free = [(f"f{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(ps)]
    truth, _, _ = generate(runner, free)
    tok = runner.tokenizer
    reqs = []
    for i, p in enumerate(ps):
        out = truth[f"f{i}"]
        reqs += [
            (f"free{i}", p, greedy(30, ignore_eos=True)),
            (f"tok{i}", p, greedy(30, stop_token_ids=[out[11]], ignore_eos=True)),  # a stop token mid-run
            (f"str{i}", p, greedy(30, stop=[tok.decode(out[9:11])], ignore_eos=True)),  # a stop string
            (f"eos{i}", p, greedy(30)),  # EOS where the model emits it
            (f"len{i}", p, greedy(13, ignore_eos=True)),  # max_tokens not on a draft boundary
        ]
    plain, plain_finals, _ = generate(runner, reqs)
    oracle = TreeOracle({rid: p + truth[f"f{rid[-1]}"] for rid, p, _ in reqs}, seed=3)
    moves = []
    move_slots = runner.page_pool.move_slots
    runner.page_pool.move_slots = lambda src, dst: (moves.append(len(src)), move_slots(src, dst))
    try:
        spec, finals, loop = generate(runner, reqs, "NGRAM", proposer=oracle)
    finally:
        del runner.page_pool.move_slots
    assert spec == plain
    for rid in plain:
        assert (finals[rid].finish_reason, finals[rid].matched_stop) == (
            plain_finals[rid].finish_reason, plain_finals[rid].matched_stop)
    assert oracle.trees > 20 and len(moves) > 10  # paths off the first chain moved their K/V, decoding went on
    assert loop.spec.stats.accepted > 30


def test_ngram_trees_greedy_equal_plain_and_seeded_sampling_repeats(runner):  # noqa: F811
    rnd = random.Random(4)
    reqs = []
    for i in range(3):  # one motif, copied with different endings: several candidates per suffix
        motif = [rnd.randrange(3, 512) for _ in range(5)]
        prompt = sum(([*motif, rnd.randrange(3, 512), rnd.randrange(3, 512)] for _ in range(4)), [])
        reqs.append((f"g{i}", prompt + motif, greedy(20, ignore_eos=True)))
    plain, _, _ = generate(runner, reqs)
    spec, _, loop = generate(runner, reqs, "NGRAM", proposer=NgramProposer(1, 12, branches=2))
    assert spec == plain and loop.spec.stats.verify_steps > 0
    # sampled requests verify trees too; one seed gives one output (n = 2)
    p = reqs[0][1]
    sampled = [(f"s{i}", p, SamplingParams(max_new_tokens=16, temperature=0.3, seed=5, ignore_eos=True)) for i in range(2)]
    oracle = TreeOracle({rid: p + plain["g0"] for rid, _, _ in sampled}, seed=1, strict=False)
    spec, finals, loop = generate(runner, sampled, "NGRAM", proposer=oracle)
    assert spec["s0"] == spec["s1"] and len(spec["s0"]) == 16 and finals["s0"].spec_verify_ct > 0
    assert oracle.trees > 0 and loop.spec.stats.accepted > 0


class FixedTree:
    """The same tree for every request: branches of tokens the grammar forbids and allows."""

    name, wants_hidden = "FIXED_TREE", False

    def propose(self, inputs):
        d = Draft([6, 3, 4, 7, 3, 5, 6], [-1, -1, -1, 1, 1, 2, 2])
        return [Draft(d.tokens[: i.max_tokens], d.parents[: i.max_tokens]) for i in inputs]

    def release(self, rid):
        pass

    def close(self):
        pass


def test_regex_grammar_is_never_broken_by_tree_drafts(runner):  # noqa: F811
    pattern = "t(3|4|5)t(3|4|5)t(3|4|5)t(6|7)"
    p = prompts(1, 5)[0]
    reqs = [(f"g{i}", p, SamplingParams(max_new_tokens=12, temperature=t, regex=pattern, seed=i))
            for i, t in enumerate((0.0, 0.0, 1.0, 1.0, 0.7))]
    plain, _, _ = generate(runner, reqs)
    spec, finals, loop = generate(runner, reqs, "NGRAM", proposer=FixedTree())
    for rid in ("g0", "g1"):
        assert spec[rid] == plain[rid]
    for rid, toks in spec.items():
        text = "".join(runner.tokenizer.convert_ids_to_tokens(t) for t in toks if t != 2)
        assert re.fullmatch(pattern, text), (rid, text)
        assert finals[rid].finish_reason == "stop"
    assert loop.spec.stats.verify_steps > 0
