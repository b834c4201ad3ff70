"""A draft tree's KV on the scheduler's side, with a real page pool and the token-echo model.

The echo model writes each fed token (the last token and the tree's nodes) into its KV slot and
derives each node's target from the node's own path (its ancestors), as a masked verify forward
does. After every step, every token that stands must be read back at its position's slot: the
accepted path's K/V were moved there from their nodes' slots (``PagePool.move_slots``). Outputs
equal plain decoding's and the pool is proven unleaked after every step.
"""

from __future__ import annotations

import random

import torch

from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.batch_builder import build_forward_batch
from pdserve.engine.sched.request import Req
from pdserve.engine.sched.scheduler import ForwardMode, SampleOutput
from pdserve.engine.sched.speculation import draft_nodes
from pdserve.engine.speculative.ngram import merge_tree
from pdserve.engine.speculative.proposer import Draft
from pdserve.engine.speculative.verify import accept_greedy_tree

from support.loop_stand import PS, next_token, reference
from test_scheduler_drafts import make


def stored_tokens(pool: PagePool, req: Req, n: int) -> list[int]:
    k = pool.k_slots(0)
    return [int(k[req.pages[p // PS] * PS + p % PS, 0, 0]) for p in range(n)]


def tree_verify_step(pool: PagePool, batch) -> SampleOutput:
    fb = build_forward_batch(batch, pool.page_size)
    pool.k_slots(0)[fb.out_cache_loc, 0, 0] = fb.input_ids.float()
    firsts, accepted, nodes = [], [], []
    for i, req in enumerate(batch.reqs):
        draft = batch.drafts[i]
        parents = batch.draft_parents[i] if batch.draft_parents is not None else list(range(-1, len(draft) - 1))
        kv_len = batch.prefix_lens[i]
        assert stored_tokens(pool, req, kv_len) == req.fill_ids[:kv_len], f"{req.rid}: a standing token's KV moved off"
        path_of = []
        for j, p in enumerate(parents):
            path_of.append((path_of[p] if p >= 0 else []) + [draft[j]])
        fed = req.fill_ids[: kv_len + 1]
        targets = [next_token(fed)] + [next_token(fed + path) for path in path_of]
        # positions: the fed token at kv_len, node j at kv_len + its depth
        assert fb.positions.tolist()[sum(batch.extend_lens[:i]):][: 1 + len(draft)] == \
            [kv_len] + [kv_len + len(path) for path in path_of]
        got, path = accept_greedy_tree(targets, draft, parents)
        firsts.append(got[0])
        accepted.append(got)
        nodes.append(path)
    return SampleOutput(firsts, accepted=accepted, accepted_nodes=nodes if batch.draft_parents is not None else None)


def tree_drafts(batch, want: dict[str, list[int]], rnd: random.Random, k: int):
    """The true continuation and wrong branches in a random order, merged into a tree."""
    drafts, parents = [], []
    for r in batch.reqs:
        n = len(r.output_ids)
        true = want[r.rid][n : n + rnd.randint(0, k)]
        cands = [true] + [true[: (c := rnd.randint(0, len(true)))] + [(t + 1 + c) % 1000 for t in want[r.rid][n + c : n + c + 2]]
                          for _ in range(rnd.randint(0, 2))]
        rnd.shuffle(cands)
        d = merge_tree(cands, k, rank_weight=1.0, depth_weight=0.9)
        drafts.append(d.tokens)
        parents.append(d.parents)
    return drafts, parents


def test_tree_outputs_equal_plain_and_moved_kv_stands_at_its_positions():
    prompts = [[random.Random(i).randrange(1000) for _ in range(5 + 3 * i)] for i in range(4)]
    pool, sched = make(64, k=8)
    rnd = random.Random(0)
    want = {f"r{i}": reference(p, 25) for i, p in enumerate(prompts)}
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=25, temperature=0.0)) for i, p in enumerate(prompts)]
    for r in reqs:
        assert sched.add(r) is None
    moved = []
    move_slots = pool.move_slots
    pool.move_slots = lambda src, dst: (moved.append(len(src)), move_slots(src, dst))
    trees = 0
    while sched.has_work():
        batch = sched.schedule()
        if batch.mode == ForwardMode.DECODE:
            drafts, parents = tree_drafts(batch, want, rnd, 8)
            sched.attach_drafts(batch, drafts, parents)
            trees += batch.draft_parents is not None
        if batch.drafts is None:  # plain steps: the echo of the fed tokens, one row each
            fb = build_forward_batch(batch, PS)
            pool.k_slots(0)[fb.out_cache_loc, 0, 0] = fb.input_ids.float()
            out = SampleOutput([next_token(r.fill_ids[: s + n]) for r, s, n in
                                zip(batch.reqs, batch.prefix_lens, batch.extend_lens)])
        else:
            out = tree_verify_step(pool, batch)
        sched.postprocess(batch, out)
        sched.check_integrity()
    assert trees > 3 and len(moved) > 3
    for r in reqs:
        assert r.output_ids == want[r.rid] and r.finish_reason.type == "length"
    assert pool.num_free + len(sched.cache.held_pages()) == pool.capacity  # unleaked


def test_move_slots_copies_every_layer_and_reads_before_it_writes():
    pool = PagePool(4, 2, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn_like(t))
    before = [pool.k_slots(layer).clone() for layer in range(2)] + [pool.v_slots(layer).clone() for layer in range(2)]
    pool.move_slots([3, 5, 4], [2, 3, 5])  # 3 -> 2 and 5 -> 3: 3 and 5 are read before they are written
    after = [pool.k_slots(layer) for layer in range(2)] + [pool.v_slots(layer) for layer in range(2)]
    for b, a in zip(before, after):
        assert torch.equal(a[2], b[3]) and torch.equal(a[3], b[5]) and torch.equal(a[5], b[4])
        assert torch.equal(a[[0, 1, 4, 6, 7]], b[[0, 1, 4, 6, 7]])


def test_attach_cuts_tree_nodes_and_a_backend_without_masks_gets_the_first_chain():
    pool, sched = make(64)
    r = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0))
    sched.add(r)
    b = sched.schedule()
    fb = build_forward_batch(b, PS)
    pool.k_slots(0)[fb.out_cache_loc, 0, 0] = fb.input_ids.float()
    sched.postprocess(b, SampleOutput([7]))  # 3 tokens left: at most 2 drafts
    batch = sched.schedule()
    assert sched.attach_drafts(batch, [[5, 6, 8, 9]], [[-1, -1, 0, 1]])
    assert batch.drafts == [[5, 6]] and batch.draft_parents == [[-1, -1]] and batch.extend_lens == [3]
    tree = Draft([5, 6, 8, 9], [-1, -1, 1, 0])
    assert draft_nodes(tree, 3, trees=True) == ([5, 6, 8], [-1, -1, 1])
    assert draft_nodes(tree, 4, trees=False) == ([5, 9], [-1, 0])  # flashinfer: the first chain only
