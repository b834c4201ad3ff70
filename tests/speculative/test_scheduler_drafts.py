"""The scheduler's side of speculation, with a real page pool and the token-echo model.

The echo model writes each fed token (the last token and the drafts) into its KV slot, reads each
sequence back through the page table and derives every row's next token from it, as a verify
forward does. Drafts come from the reference continuation with errors planted, so runs of every
length are accepted and rejected. After every step the pool is proven unleaked, and the outputs
equal plain decoding's, including stops inside an accepted run.
"""

from __future__ import annotations

import random

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import make_prefix_cache
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.batch_builder import build_forward_batch
from pdserve.engine.sched.request import FinishReason, Req
from pdserve.engine.sched.scheduler import ForwardMode, SampleOutput, Scheduler
from pdserve.engine.speculative.verify import accept_greedy

from support.loop_stand import PS, next_token, reference


def verify_step(pool: PagePool, batch) -> SampleOutput:
    fb = build_forward_batch(batch, pool.page_size)
    k = pool.k_slots(0)
    k[fb.out_cache_loc, 0, 0] = fb.input_ids.float()
    rows_per = [batch.logit_rows(i) for i in range(len(batch.reqs))]
    assert len(fb.logits_indices) == sum(rows_per)
    firsts, accepted = [], []
    last = -1  # a verify step's rows are expanded: each request's last row holds its whole length
    for i, req in enumerate(batch.reqs):
        last += rows_per[i]
        n = fb.seq_lens[last]
        t = torch.arange(n)
        seq = [int(x) for x in k[(fb.page_table[last].long()[t // PS] * PS + t % PS), 0, 0].tolist()]
        draft = batch.drafts[i] if batch.drafts is not None else []
        assert seq == req.fill_ids[: n - len(draft)] + draft, f"KV of {req.rid} is not its tokens"
        targets = [next_token(seq[: n - len(draft) + j]) for j in range(len(draft) + 1)]
        got = accept_greedy(targets, draft)
        firsts.append(got[0])
        accepted.append(got)
    return SampleOutput(firsts, accepted=accepted if batch.drafts is not None else None)


def oracle_drafts(batch, want: dict[str, list[int]], rnd: random.Random, k: int) -> list[list[int]]:
    """The true continuation, cut at a random length, with a wrong token planted half the time."""
    out = []
    for r in batch.reqs:
        true = want[r.rid][len(r.output_ids) : len(r.output_ids) + rnd.randint(0, k)]
        if true and rnd.random() < 0.5:
            j = rnd.randrange(len(true))
            true = true[:j] + [(true[j] + 1) % 1000] + true[j + 1 :]
        out.append(true)
    return out


def make(num_pages: int, stop_on: int | None = None, k: int = 4):
    pool = PagePool(num_pages, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    config = EngineConfig(page_size=PS, speculative_algorithm="NGRAM", speculative_num_draft_tokens=k,
                          num_reserved_decode_tokens=4)

    def stop(req: Req):
        if req.output_ids and req.output_ids[-1] == stop_on:
            return FinishReason("stop", matched=stop_on)
        if len(req.output_ids) >= req.sampling_params.max_new_tokens:
            return FinishReason("length")
        return None

    return pool, Scheduler(config, pool, make_prefix_cache(pool, False), stop)


def run(pool, sched, prompts, max_new, k=4, seed=0):
    rnd = random.Random(seed)
    want = {f"r{i}": reference(p, max_new) for i, p in enumerate(prompts)}
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=max_new, temperature=0.0)) for i, p in enumerate(prompts)]
    for r in reqs:
        assert sched.add(r) is None
    attached = dropped = 0
    while sched.has_work():
        batch = sched.schedule()
        if batch is None:
            break
        if batch.mode == ForwardMode.DECODE:
            drafts = oracle_drafts(batch, want, rnd, k)
            if sched.attach_drafts(batch, drafts):
                attached += 1
            elif any(d[: max(r.remaining_new_tokens - 1, 0)] for r, d in zip(batch.reqs, drafts)):
                dropped += 1
                assert batch.drafts is None and batch.extend_lens == [1] * len(batch.reqs)
        sched.postprocess(batch, verify_step(pool, batch))
        sched.check_integrity()
    return reqs, want, attached, dropped


def test_outputs_equal_plain_decoding_and_pages_are_accounted_every_step():
    prompts = [[random.Random(i).randrange(1000) for _ in range(5 + 3 * i)] for i in range(4)]
    pool, sched = make(64)
    reqs, want, attached, dropped = run(pool, sched, prompts, 21)
    assert attached > 5 and dropped == 0
    for r in reqs:
        assert r.output_ids == want[r.rid]
        assert r.finish_reason.type == "length"
    assert pool.num_free + sched.cache.held_pages().__len__() == pool.capacity  # unleaked


def test_a_stop_inside_an_accepted_run_truncates_it():
    prompt = [11, 12, 13]
    full = reference(prompt, 30)
    stop_tok = full[9]
    first = full.index(stop_tok)
    for seed in range(4):
        pool, sched = make(64, stop_on=stop_tok, k=8)
        (r,), _, _, _ = run(pool, sched, [prompt], 30, k=8, seed=seed)
        assert r.output_ids == full[: first + 1] and r.finish_reason.matched == stop_tok


def test_drafts_that_would_overrun_the_pool_are_dropped_not_failed():
    # 2 requests admitted together outgrow the pool (one is retracted): on the way their drafts'
    # pages are short
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    pool, sched = make(12, k=8)
    reqs, want, attached, dropped = run(pool, sched, prompts, 30, k=8)
    assert dropped > 0 and attached > 0
    for r in reqs:
        assert r.output_ids == want[r.rid] and r.finish_reason.type == "length"


def test_drafts_are_cut_to_the_tokens_left():
    pool, sched = make(64)
    r = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0))
    sched.add(r)
    sched.postprocess(b := sched.schedule(), verify_step(pool, b))  # prefill: 1 token out, 2 left
    batch = sched.schedule()
    assert sched.attach_drafts(batch, [[5, 6, 7, 8]])
    assert batch.drafts == [[5]] and batch.extend_lens == [2]
