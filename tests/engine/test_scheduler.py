"""The pure scheduler with a real (tiny) PagePool and a token-echo model.

The stand-in model writes each input token id into its KV slot, then reads the
whole sequence back through the page table and derives the next token from
it. So a page handed out twice, a wrong radix hit or a lost prefix changes the
output, and every scenario is checked against a plain reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.sched.batch_builder import build_forward_batch
from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import make_prefix_cache
from pdserve.engine.sched.request import FinishReason, Req, ReqStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.scheduler import ForwardMode, SampleOutput, Scheduler

from support.loop_stand import PS, VOCAB, next_token, reference  # the same deterministic stand-in model


class EchoModel:
    def __init__(self, pool: PagePool):
        self.pool = pool

    def __call__(self, batch) -> SampleOutput:
        fb = build_forward_batch(batch, self.pool.page_size)
        assert fb.num_tokens == batch.num_tokens
        k = self.pool.k_slots(0)  # [slots, 1, 1]
        k[fb.out_cache_loc, 0, 0] = fb.input_ids.float()
        toks = []
        for i, req in enumerate(batch.reqs):
            n = fb.seq_lens[i]
            t = torch.arange(n)
            slots = fb.page_table[i].long()[t // PS] * PS + t % PS
            seq = [int(x) for x in k[slots, 0, 0].tolist()]
            assert seq == req.fill_ids[:n], f"KV of {req.rid} is not its tokens"
            if batch.sample[i]:
                toks.append(next_token(seq))
        assert len(toks) == len(fb.logits_indices)
        return SampleOutput(toks)


def make(num_pages=64, disable_cache=False, **cfg):
    pool = PagePool(num_pages, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    config = EngineConfig(page_size=PS, **cfg)
    sched = Scheduler(config, pool, make_prefix_cache(pool, disable_cache))
    return sched, EchoModel(pool)


def req(rid, prompt, n=8) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0))


def run(sched, model, max_steps=10_000, on_step=None):
    batches = []
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        if batch is None:
            assert not sched.has_work(), "scheduler has work but scheduled nothing (deadlock)"
            break
        batches.append(batch)
        sched.postprocess(batch, model(batch))
        sched.check_integrity()
        if on_step:
            on_step(steps)
        steps += 1
        assert steps < max_steps, "no progress"
    sched.check_integrity()
    return batches


def prompts(n, lo=3, hi=30, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_continuous_batching_outputs_and_decode_batches():
    sched, model = make()
    reqs = [req(f"r{i}", p, n=6) for i, p in enumerate(prompts(5))]
    for r in reqs:
        assert sched.add(r) is None
    batches = run(sched, model)
    for r, p in zip(reqs, prompts(5)):
        assert r.status == ReqStatus.FINISHED and r.finish_reason.type == "length"
        assert r.output_ids == reference(p, 6)
    assert batches[0].mode == ForwardMode.PREFILL and batches[0].batch_size == 5
    assert max(b.batch_size for b in batches if b.mode == ForwardMode.DECODE) == 5
    assert sched.pool.num_used == sched.cache.evictable_pages  # only the cache holds pages


def test_late_arrival_joins_running_batch():
    sched, model = make()
    a, b = req("a", range(1, 9), n=10), req("b", range(20, 25), n=3)
    sched.add(a)
    sched.postprocess(batch := sched.schedule(), model(batch))
    sched.postprocess(batch := sched.schedule(), model(batch))
    assert batch.mode == ForwardMode.DECODE
    sched.add(b)
    batch = sched.schedule()
    assert batch.mode == ForwardMode.PREFILL and batch.reqs == [b]  # prefill preferred
    sched.postprocess(batch, model(batch))
    batch = sched.schedule()
    assert batch.mode == ForwardMode.DECODE and batch.reqs == [a, b]
    sched.postprocess(batch, model(batch))
    run(sched, model)
    assert a.output_ids == reference(list(range(1, 9)), 10)
    assert b.output_ids == reference(list(range(20, 25)), 3)


def test_chunked_prefill_splits_long_prompt():
    sched, model = make(chunked_prefill_size=8)
    long = req("long", range(100, 130), n=4)  # 30 tokens -> chunks of 8
    short = req("short", range(5, 8), n=4)
    sched.add(long)
    sched.add(short)
    batches = run(sched, model)
    prefills = [b for b in batches if b.mode == ForwardMode.PREFILL]
    assert all(b.num_tokens <= 8 for b in prefills)
    assert [b.extend_lens[0] for b in prefills[:4]] == [8, 8, 8, 6]
    assert [b.sample[0] for b in prefills[:4]] == [False, False, False, True]
    # the short one rides along in the leftover budget of the last chunk
    assert prefills[3].reqs == [long, short]
    assert long.output_ids == reference(list(range(100, 130)), 4)
    assert short.output_ids == reference(list(range(5, 8)), 4)


def test_running_cap():
    sched, model = make(max_running_requests=3)
    reqs = [req(f"r{i}", p, n=5) for i, p in enumerate(prompts(7, seed=1))]
    for r in reqs:
        sched.add(r)
    seen_max = 0

    def watch(_):
        nonlocal seen_max
        seen_max = max(seen_max, len(sched.running) + (sched.chunked is not None))

    run(sched, model, on_step=watch)
    assert seen_max == 3
    for r, p in zip(reqs, prompts(7, seed=1)):
        assert r.output_ids == reference(p, 5)


def test_admission_keeps_decode_reserve():
    # 20 usable pages; each request: 8-token prompt (2 pages) + reserve of 8 tokens (2 pages)
    sched, model = make(num_pages=21, num_reserved_decode_tokens=8, disable_cache=True)
    reqs = [req(f"r{i}", [i + 1] * 8, n=8) for i in range(8)]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert first.batch_size == 5  # 5 * (2 + 2) = 20 pages
    assert sched.pool.num_free == 10  # the reserve stays free
    sched.postprocess(first, model(first))
    run(sched, model)
    assert sched.num_retractions == 0  # the reserve was enough: no preemption
    for i, r in enumerate(reqs):
        assert r.output_ids == reference([i + 1] * 8, 8)


@pytest.mark.parametrize("disable_cache", [False, True])
def test_preemption_tiny_pool_all_finish(disable_cache):
    # 12 usable pages = 48 tokens for 10 requests that each need up to 10 pages
    sched, model = make(num_pages=13, num_reserved_decode_tokens=0, disable_cache=disable_cache)
    ps = prompts(10, lo=4, hi=16, seed=3)
    reqs = [req(f"r{i}", p, n=20) for i, p in enumerate(ps)]
    for r in reqs:
        sched.add(r)
    run(sched, model)
    assert sched.num_retractions > 0
    for r, p in zip(reqs, ps):
        assert r.finish_reason.type == "length"
        assert r.output_ids == reference(p, 20), r


def test_request_outgrowing_the_whole_pool_finishes():
    sched, model = make(num_pages=4, num_reserved_decode_tokens=0)  # 3 pages = 12 tokens
    r = req("big", range(1, 9), n=50)
    sched.add(r)
    run(sched, model)
    assert r.finish_reason.type == "length" and 1 <= len(r.output_ids) < 50
    assert r.output_ids == reference(list(range(1, 9)), len(r.output_ids))
    too_long = req("huge", range(1, 40))
    assert sched.add(too_long).type == "error"


def test_radix_hit_reports_cached_tokens_and_same_output():
    sched, model = make()
    prompt = list(range(50, 73))  # 23 tokens: 5 full pages
    a = req("a", prompt, n=5)
    sched.add(a)
    run(sched, model)
    assert a.cached_tokens == 0
    b = req("b", prompt, n=5)
    c = req("c", prompt[:10] + [999] * 5, n=5)
    sched.add(b)
    sched.add(c)
    run(sched, model)
    assert b.cached_tokens == 20  # 5 full pages; the last token is always recomputed
    assert c.cached_tokens == 8  # 2 full pages shared
    assert b.output_ids == a.output_ids == reference(prompt, 5)
    assert c.output_ids == reference(prompt[:10] + [999] * 5, 5)


def test_radix_disabled_caches_nothing():
    sched, model = make(disable_cache=True)
    prompt = list(range(50, 73))
    for rid in ("a", "b"):
        r = req(rid, prompt, n=3)
        sched.add(r)
        run(sched, model)
        assert r.cached_tokens == 0
    assert sched.pool.num_used == 0


def test_abort_everywhere_frees_pages():
    sched, model = make(chunked_prefill_size=8)
    running, chunked, waiting = req("run", range(1, 6), n=50), req("chunk", range(1, 40), n=5), req("wait", [3] * 5)
    sched.add(running)
    sched.postprocess(b := sched.schedule(), model(b))
    sched.add(chunked)
    sched.add(waiting)
    sched.postprocess(b := sched.schedule(), model(b))
    assert sched.chunked is chunked and running in sched.running
    for r in (waiting, chunked, running):
        assert sched.abort(r.rid) is r
        assert r.finish_reason.type == "abort" and r.status == ReqStatus.FINISHED
        sched.check_integrity()
    assert not sched.has_work() and sched.abort("run") is None
    assert sched.pool.num_used == sched.cache.evictable_pages
    sched.cache.flush()
    assert sched.pool.num_used == 0


def test_abort_while_step_in_flight():
    sched, model = make()
    a, b = req("a", [1, 2, 3], n=5), req("b", [4, 5, 6], n=5)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    out = model(batch)
    sched.abort("a")
    ev = sched.postprocess(batch, out)
    assert ev.updated == [b] and a.output_ids == []
    run(sched, model)
    assert b.output_ids == reference([4, 5, 6], 5)


def test_random_workload_never_deadlocks():
    rng = random.Random(7)
    sched, model = make(num_pages=20, chunked_prefill_size=16, max_running_requests=6, num_reserved_decode_tokens=4)
    expected = {}
    step = 0
    pending = [(rng.randint(0, 60), p, rng.randint(1, 12)) for p in prompts(25, lo=1, hi=40, seed=11)]
    pending.sort(key=lambda x: x[0])
    reqs = {}
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            _, p, n = pending.pop(0)
            r = req(f"r{len(reqs)}", p, n=n)
            reqs[r.rid] = r
            expected[r.rid] = reference(p, n)
            assert sched.add(r) is None
        batch = sched.schedule()
        if batch is not None:
            sched.postprocess(batch, model(batch))
            sched.check_integrity()
        elif not pending:
            pytest.fail("deadlock")
        step += 1
        assert step < 5000
    for rid, r in reqs.items():
        assert r.output_ids == expected[rid]


def test_prefill_mode_holds_pages_until_sent():
    """A prefill server's scheduler (decode=False): after prefill the request keeps its pages for the KV sender."""
    pool = PagePool(64, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    sched = Scheduler(EngineConfig(page_size=PS), pool, make_prefix_cache(pool, False), decode=False)
    model = EchoModel(pool)
    r = req("p", range(1, 11), n=5)
    sched.add(r)
    events = sched.postprocess(b := sched.schedule(), model(b))
    assert events.prefilled == [r] and r.status == ReqStatus.SENDING_KV and not sched.running
    assert r.output_ids == reference(list(range(1, 11)), 1) and r.kv_len == 10
    assert sched.schedule() is None  # nothing to decode on the prefill side
    sched.check_integrity()  # its pages are owned, not leaked
    sched.finish(r, FinishReason("stop"))
    sched.check_integrity()
    assert pool.num_used == sched.cache.evictable_pages == 2  # its full pages went to the cache
    assert sched.drain_finished() == [r]  # it leaves by the one path


def test_prefill_mode_never_stops_on_its_one_token():
    """The prefill's token goes to the decode side even if it would stop there (EOS, stop id)."""
    pool = PagePool(16, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    always = lambda r: FinishReason("stop", matched=r.output_ids[-1])  # noqa: E731
    sched = Scheduler(EngineConfig(page_size=PS), pool, make_prefix_cache(pool, False), always, decode=False)
    r = req("eos", [1, 2, 3], n=5)
    sched.add(r)
    events = sched.postprocess(b := sched.schedule(), EchoModel(pool)(b))
    assert events.prefilled == [r] and not events.finished and r.status == ReqStatus.SENDING_KV


def test_decode_mode_request_arrives_with_kv_and_first_token():
    sched, model = make()
    prompt = list(range(30, 43))  # 13 tokens
    expected = reference(prompt, 6)
    r = req("d", prompt, n=6)
    r.status = ReqStatus.WAITING_FOR_KV
    r.pages = sched.try_alloc(sched.pool.pages_for(len(prompt)))
    # the "transfer": the prompt's KV lands in the preallocated pages, with the first token
    k = sched.pool.k_slots(0)
    for t, tok in enumerate(prompt):
        k[r.pages[t // PS] * PS + t % PS, 0, 0] = tok
    r.kv_len = len(prompt)
    r.output_ids = [expected[0]]
    sched.add_prefilled(r)
    assert r.status == ReqStatus.RUNNING
    sched.check_integrity()
    batches = run(sched, model)
    assert all(b.mode == ForwardMode.DECODE for b in batches)
    assert r.output_ids == expected
    assert sched.try_alloc(10_000) is None


def test_prompt_logprob_rows_cover_each_position_once_across_chunks():
    from pdserve.engine.sched.batch_builder import input_logprob_rows

    sched, model = make(chunked_prefill_size=8)
    prompt = list(range(200, 220))
    warm = req("warm", prompt, n=1)  # puts the prompt's pages in the cache
    sched.add(warm)
    run(sched, model)
    r = req("lp", prompt, n=2)
    r.return_logprob, r.logprob_start_len = True, 5
    sched.add(r)
    scored = []
    while sched.has_work():
        batch = sched.schedule()
        rows = input_logprob_rows(batch)
        assert all(0 <= row < batch.num_tokens for _, row, _ in rows)
        for i, row, p in rows:
            # the row holds the logits of position p - 1 of that request
            start = sum(batch.extend_lens[:i])
            assert batch.prefix_lens[i] + row - start == p - 1
            scored.append(p)
            batch.reqs[i].input_logprobs.append(0.0)
        out = SampleOutput([next_token(x.fill_ids[: s + e]) for x, s, e, smp in
                            zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample) if smp])
        sched.postprocess(batch, out)
        sched.check_integrity()
    assert scored == list(range(5, 20))
    assert r.cached_tokens == 4  # the cache match stops before the first scored position
    assert r.output_ids == reference(prompt, 2)


def test_mixed_chunk_decodes_ride_along_with_a_chunked_prefill():
    sched, model = make(chunked_prefill_size=8, enable_mixed_chunk=True)
    short = req("short", range(5, 8), n=6)
    long = req("long", range(100, 130), n=4)  # 30 tokens: chunked
    sched.add(short)
    sched.postprocess(batch := sched.schedule(), model(batch))  # short prefills alone, then runs
    sched.add(long)
    batches = run(sched, model)
    chunks = [b for b in batches if long in b.reqs and b.extend_lens[b.reqs.index(long)] > 1]
    assert len(chunks) == 5  # 7 + 7 + 7 + 7 + 2 tokens: one of each 8-token budget went to the decode
    for b in chunks[:3]:
        assert b.mode == ForwardMode.PREFILL and b.reqs == [long, short] and b.extend_lens == [7, 1]
        assert b.num_tokens <= 8 and b.sample == [False, True]
    assert short.output_ids == reference(list(range(5, 8)), 6)
    assert long.output_ids == reference(list(range(100, 130)), 4)


def test_mixed_chunk_off_by_default_and_never_over_budget():
    sched, model = make(chunked_prefill_size=8)
    sched.add(short := req("short", range(5, 8), n=6))
    sched.postprocess(batch := sched.schedule(), model(batch))
    sched.add(req("long", range(100, 130), n=4))
    batch = sched.schedule()
    assert batch.reqs != [] and short not in batch.reqs  # prefill-only step: the decode waits
    # as many running requests as the budget: mixing would leave no token for the prefill
    sched, model = make(chunked_prefill_size=4, enable_mixed_chunk=True, max_running_requests=16)
    runners = [req(f"r{i}", [i + 1, i + 2], n=20) for i in range(4)]
    for r in runners:
        sched.add(r)
    while any(r not in sched.running for r in runners):
        sched.postprocess(batch := sched.schedule(), model(batch))
    sched.add(req("late", range(50, 70), n=2))
    batch = sched.schedule()
    assert batch.mode == ForwardMode.PREFILL and not set(runners) & set(batch.reqs)


def test_mixed_chunk_random_workload_matches_reference():
    rng = random.Random(3)
    sched, model = make(num_pages=24, chunked_prefill_size=16, max_running_requests=6, num_reserved_decode_tokens=4,
                        enable_mixed_chunk=True)
    reqs = []
    for i, p in enumerate(prompts(20, lo=1, hi=45, seed=5)):
        r = req(f"r{i}", p, n=rng.randint(1, 12))
        reqs.append((r, reference(p, r.sampling_params.max_new_tokens)))
        sched.add(r)
    batches = run(sched, model)
    decoding = [r for b in batches if b.mode == ForwardMode.PREFILL
                for r, start in zip(b.reqs, b.prefix_lens) if start >= r.prompt_len]
    assert decoding, "no prefill step carried a decode"
    assert all(b.num_tokens <= 16 for b in batches)
    for r, expected in reqs:
        assert r.output_ids == expected


def test_fill_slice_is_the_slice_of_fill_ids():
    req = Req(rid="r", input_ids=[1, 2, 3, 4], sampling_params=SamplingParams())
    req.output_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert req.fill_slice(start, end) == req.fill_ids[start:end], (start, end)


def test_lora_slots_pinned_while_running_and_loaded_once():
    """Three adapters over two slots: a request waits while both slots are pinned by running
    requests, then takes the least recently used one; each placement is queued for loading once."""
    from pdserve.engine.model_executor.layers.lora_slots import LoraSlots

    pool = PagePool(64, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    sched = Scheduler(EngineConfig(page_size=PS), pool, make_prefix_cache(pool, False), lora_slots=LoraSlots(2))
    model = EchoModel(pool)
    reqs = [req(f"r{i}", p, n=4 + 2 * i) for i, p in enumerate(prompts(4, seed=3))]
    for r, (name, lora_id) in zip(reqs, [("a", 1), ("b", 2), ("c", 3), (None, 0)]):
        r.lora_name, r.lora_id = name, lora_id
        sched.add(r)
    first = sched.schedule()
    assert [r.rid for r in first.reqs] == ["r0", "r1"]  # c waits for a slot; the base request behind it
    assert sched.drain_lora_loads() == [(0, "a"), (1, "b")]
    assert [r.lora_slot for r in first.reqs] == [0, 1]
    sched.postprocess(first, model(first))
    loads = []
    run(sched, model, on_step=lambda _: loads.extend(sched.drain_lora_loads()))
    assert loads == [(0, "c")]  # a finished first: its slot, least recently used, goes to c
    assert all(r.finished and r.lora_slot == -1 for r in reqs)
    assert sched.lora_slots.unload("b") == 1  # held no pin: AdapterInUse otherwise
