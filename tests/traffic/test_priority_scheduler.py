"""The engine scheduler's waiting queue with ``enable_priority_scheduling``: on a saturated
scheduler (one running request at a time) higher priorities are admitted, and so finish, before
lower ones queued earlier; equals keep arrival order; outputs are those of an unordered run and
the page pool's integrity check holds after every step. Pure scheduler logic with the
deterministic stand-in model of the scheduler tests (tokens in, tokens out, real page pool)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.frontend.value_checks import RequestLimits
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import make_prefix_cache
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.batch_builder import build_forward_batch
from pdserve.engine.sched.request import Req, ReqStatus
from pdserve.engine.sched.scheduler import SampleOutput, Scheduler
from pdserve.engine.frontend.request_error import RequestError

from support.loop_stand import PS, next_token, reference


class TokenModel:
    """Reads each sequence's tokens back from the KV pool and answers next_token of them."""

    def __init__(self, pool: PagePool):
        self.pool = pool

    def __call__(self, batch) -> SampleOutput:
        fb = build_forward_batch(batch, self.pool.page_size)
        k = self.pool.k_slots(0)
        k[fb.out_cache_loc, 0, 0] = fb.input_ids.float()
        toks = []
        for i, _ in enumerate(batch.reqs):
            t = torch.arange(fb.seq_lens[i])
            slots = fb.page_table[i].long()[t // PS] * PS + t % PS
            if batch.sample[i]:
                toks.append(next_token([int(x) for x in k[slots, 0, 0].tolist()]))
        return SampleOutput(toks)


def finish_order(priorities: list[int], **cfg) -> tuple[list[int], list[Req]]:
    pool = PagePool(64, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    sched = Scheduler(EngineConfig(page_size=PS, max_running_requests=1, **cfg), pool,
                      make_prefix_cache(pool, False))
    model = TokenModel(pool)
    reqs = [Req(f"r{i}", [10 + i, 20 + i, 30 + i], SamplingParams(max_new_tokens=3, temperature=0.0),
                priority=p) for i, p in enumerate(priorities)]
    # the first request runs alone; the rest queue behind it in arrival order
    assert sched.add(reqs[0]) is None
    sched.postprocess(batch := sched.schedule(), model(batch))
    for r in reqs[1:]:
        assert sched.add(r) is None
    order = []
    while sched.has_work():
        batch = sched.schedule()
        sched.postprocess(batch, model(batch))
        sched.check_integrity()
        order += [i for i, r in enumerate(reqs) if r.status == ReqStatus.FINISHED and i not in order]
    return order, reqs


def test_higher_priorities_queued_later_finish_first():
    # the running r0 is preempted for r3 and resumes first among its equals
    order, reqs = finish_order([0, 0, 0, 5, 1, 5], enable_priority_scheduling=True)
    assert order == [3, 5, 4, 0, 1, 2]
    for r in reqs:
        assert r.output_ids == reference(r.input_ids, 3)


def test_low_values_first_and_fifo_without_the_flag():
    order, _ = finish_order([0, 3, -2, 3], enable_priority_scheduling=True,
                            schedule_low_priority_values_first=True)
    assert order == [2, 0, 1, 3]
    order, _ = finish_order([0, 0, 9, 1])
    assert order == [0, 1, 2, 3]


def test_the_low_first_flag_needs_priority_scheduling():
    with pytest.raises(ValueError, match="enable_priority_scheduling"):
        EngineConfig(schedule_low_priority_values_first=True)


def test_a_priority_is_refused_unless_the_server_orders_by_it():
    limits = RequestLimits(model_names=frozenset({"m"}), max_n=1, dp_size=1, vocab_size=100)
    with pytest.raises(RequestError) as err:
        limits.check_priority(3)
    assert err.value.param == "priority" and "--enable-priority-scheduling" in str(err.value)
    assert limits.check_priority(None) == 0
    on = RequestLimits(model_names=frozenset({"m"}), max_n=1, dp_size=1, vocab_size=100,
                       enable_priority_scheduling=True)
    assert on.check_priority(-7) == -7
    with pytest.raises(RequestError):
        on.check_priority(2**40)
