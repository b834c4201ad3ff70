"""Preemption by priority (``engine/sched/preemption.py``): a waiting request short of KV pages or of
a running slot retracts running requests of lower priority, lowest priority then latest arrival
first; they re-queue and finish with the output of an unpreempted run; no page leaks. The pure
choice, then the real scheduler over a real page pool with the deterministic stand-in model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import make_prefix_cache
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.preemption import outranks, pick_victims, preemption_order
from pdserve.engine.sched.request import Req, ReqStatus
from pdserve.engine.sched.scheduler import Scheduler

from support.loop_stand import PS, reference
from test_priority_scheduler import TokenModel


@dataclass
class R:
    name: str
    priority: int
    arrival: int
    pages: int = 2


def test_victims_are_the_lowest_priority_then_the_latest_arrival():
    running = [R("a", 0, 0), R("b", 0, 1), R("c", 3, 2), R("d", 1, 3)]
    assert [r.name for r in preemption_order(running, False)] == ["b", "a", "d", "c"]
    assert [r.name for r in preemption_order(running, True)] == ["c", "d", "b", "a"]
    gain = lambda r: r.pages  # noqa: E731
    pick = lambda prio, short, slot=False, low=False: [  # noqa: E731
        r.name for r in pick_victims(R("new", prio, 9), running, short, slot, gain, low)]
    assert pick(5, 3) == ["b", "a"]
    assert pick(2, 5) == ["b", "a", "d"]
    assert pick(2, 7) == []  # c outranks it: the others cannot cover the shortfall, none is taken
    assert pick(0, 1) == []  # equal priority never preempts
    assert pick(5, 0) == [] and pick(5, 0, slot=True) == ["b"]
    assert pick(-1, 2, low=True) == ["c"]
    assert outranks(2, 1, False) and outranks(1, 2, True) and not outranks(1, 1, False)


def make(pages: int, **cfg) -> tuple[Scheduler, TokenModel]:
    pool = PagePool(pages, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    sched = Scheduler(EngineConfig(page_size=PS, enable_priority_scheduling=True, **cfg), pool,
                      make_prefix_cache(pool, False))
    return sched, TokenModel(pool)


def req(i: int, priority: int, new: int) -> Req:
    return Req(f"r{i}", [10 + i, 20 + i, 30 + i, 40 + i, 50 + i],
               SamplingParams(max_new_tokens=new, temperature=0.0), priority=priority)


def run(sched: Scheduler, model: TokenModel, order: list[str], steps: int | None = None) -> None:
    """Step until idle (or ``steps`` steps), appending finished rids to ``order``."""
    n = 0
    while sched.has_work() and (steps is None or n < steps):
        batch = sched.schedule()
        order += [r.rid for r in sched.postprocess(batch, model(batch)).finished]
        sched.check_integrity()
        n += 1


def assert_unleaked(sched: Scheduler) -> None:
    assert not sched.reqs
    assert sched.free_pages() == sched.pool.capacity


def test_a_high_priority_request_short_of_pages_preempts_the_latest_lowest():
    # each low request takes 2 prompt pages plus 3 pages of decode reserve: three fill the pool
    sched, model = make(16, num_reserved_decode_tokens=12)
    lows = [req(0, 1, 12), req(1, 0, 12), req(2, 0, 12)]
    for r in lows:
        assert sched.add(r) is None
    order: list[str] = []
    run(sched, model, order, steps=4)
    assert len(sched.running) == 3 and not sched.waiting
    high = req(3, 5, 4)
    assert sched.add(high) is None
    run(sched, model, order)
    assert order[0] == "r3"
    assert sorted(order) == ["r0", "r1", "r2", "r3"]
    # the latest arrival of the lowest priority, and only it
    assert [r.num_retractions for r in lows] == [0, 0, 1]
    assert sched.num_preemptions == 1
    for r in lows + [high]:
        assert r.output_ids == reference(r.input_ids, r.sampling_params.max_new_tokens)
    assert_unleaked(sched)


def test_a_full_batch_gives_a_slot_and_equal_priorities_never_preempt():
    sched, model = make(64, max_running_requests=2, num_reserved_decode_tokens=0)
    for r in (req(0, 0, 8), req(1, 0, 8)):
        sched.add(r)
    order: list[str] = []
    run(sched, model, order, steps=3)
    same = req(2, 0, 2)
    sched.add(same)
    run(sched, model, order, steps=2)
    assert same.status == ReqStatus.WAITING and sched.num_preemptions == 0
    high = req(3, 2, 2)
    sched.add(high)
    run(sched, model, order)
    assert order[0] == "r3" and sched.num_preemptions == 1
    assert sched.reqs == {} and sorted(order) == ["r0", "r1", "r2", "r3"]
    assert_unleaked(sched)


def test_without_priority_scheduling_nothing_is_preempted():
    pool = PagePool(16, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    sched = Scheduler(EngineConfig(page_size=PS, num_reserved_decode_tokens=12), pool,
                      make_prefix_cache(pool, False))
    model = TokenModel(pool)
    for r in (req(0, 0, 12), req(1, 0, 12), req(2, 0, 12)):
        sched.add(r)
    order: list[str] = []
    run(sched, model, order, steps=4)
    sched.add(req(3, 0, 4))
    run(sched, model, order)
    assert order[-1] == "r3" and sched.num_preemptions == 0
    assert_unleaked(sched)
