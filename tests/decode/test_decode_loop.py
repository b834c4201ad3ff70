"""The decode loop's states with a real prefill loop in the same process (``local`` transfers):
preallocation under the scheduler's reserve rule, preemption while others wait for KV, aborts,
the waiting and quarantine timeouts on an injected clock. Both pools are checked after every
step (``PDPair.step``)."""

from __future__ import annotations

import pytest
from support.loop_stand import PDPair, reference

from pdserve.engine.sched.request import ReqStatus

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair(request):
    p = PDPair(**getattr(request, "param", {}))
    yield p
    p.close()


@pytest.mark.parametrize("pair", [{"d_pages": 21, "d_engine": {"num_reserved_decode_tokens": 8}}], indirect=True)
def test_preallocation_keeps_the_decode_reserve(pair):
    # 20 usable pages; each request: an 8-token prompt (2 pages) and, decoding from token 9,
    # a reserve of 8 tokens (3 more pages): at most 4 may hold pages at once (4 * 5 = 20)
    prompts = {f"r{i}": [i + 1] * 8 for i in range(8)}
    for rid, prompt in prompts.items():
        pair.submit(rid, prompt, max_new=8)
    most = 0

    def watch():
        nonlocal most
        most = max(most, sum(1 for r in pair.decode.scheduler.reqs.values() if r.pages))
        return all(pair.final("D", r) for r in prompts)

    pair.run(watch)
    assert most == 4
    assert pair.decode.scheduler.num_retractions == 0  # the reserve was enough: no preemption
    for rid, prompt in prompts.items():
        assert pair.tokens(rid) == reference(prompt, 8)
    pair.settle()


@pytest.mark.parametrize("pair", [{"d_pages": 13, "d_engine": {"num_reserved_decode_tokens": 0}}], indirect=True)
def test_preemption_while_requests_wait_for_kv(pair):
    # 12 usable pages, no reserve: decodes outgrow the pool and are retracted (recomputed from
    # their tokens on the decode side) while later requests wait in the preallocation queue
    prompts = {f"r{i}": [(7 * i + j) % 50 + 1 for j in range(4 + i % 5)] for i in range(8)}
    for rid, prompt in prompts.items():
        pair.submit(rid, prompt, max_new=16)
    both = False

    def watch():
        nonlocal both
        s = pair.decode.scheduler
        retracted = any(r.num_retractions for r in s.waiting)
        both = both or (retracted and len(pair.decode.prealloc) > 0)
        return all(pair.final("D", r) for r in prompts)

    pair.run(watch, timeout=10)
    assert pair.decode.scheduler.num_retractions > 0 and both
    for rid, prompt in prompts.items():
        assert pair.final("D", rid).finish_reason == "length"
        assert pair.tokens(rid) == reference(prompt, 16), rid
    pair.settle()


def test_abort_while_waiting_for_preallocation(pair):
    pair.submit("a", [9, 8, 7, 6, 5], max_new=3, to="D")
    pair.run(lambda: pair.decode.prealloc.entries["a"].receiver is not None, prefill=False)
    assert pair.decode.abort("a", "client left")
    pair.run(pair.done("a", sides="D"), prefill=False)
    assert pair.final("D", "a").finish_reason == "abort"
    assert pair.decode.pool.num_used == 0
    pair.settle()


def test_waiting_timeout_quarantines_until_the_prefill_closes_the_room(pair):
    # the prefill never gets the request: the decode's destination waits there unused
    pair.submit("w", list(range(10, 20)), max_new=3, to="D")
    pair.run(lambda: "w" in pair.decode.transfer, prefill=False)
    req = pair.decode.transfer.entries["w"][0]
    assert req.status == ReqStatus.WAITING_FOR_KV and len(req.pages) == 3
    for _ in range(10):
        pair.step()
    assert pair.final("D", "w") is None
    pair.clock.advance(pair.kv_config.waiting_timeout + 1)
    pair.run(pair.done("w", sides="D"))
    d = pair.final("D", "w")
    assert d.finish_reason == "error" and "waiting_timeout" in d.error
    pair.settle()  # held in quarantine, released by the prefill's RoomClosed


def test_quarantine_timeout_when_the_prefill_never_answers(pair):
    pair.submit("q", list(range(30, 42)), max_new=3, to="D")
    pair.run(lambda: "q" in pair.decode.transfer, prefill=False)
    pair.prefill.kv.close()  # the prefill rank is gone: no RoomClosed will come
    pair.clock.advance(pair.kv_config.waiting_timeout + 1)
    pair.run(pair.done("q", sides="D"), prefill=False)
    assert len(pair.decode.quarantine) == 1 and pair.decode.pool.num_used == 3
    assert pair.decode.scheduler.held_pages == set(pair.decode.pool.used_pages())
    for _ in range(5):
        pair.step(prefill=False)
    assert pair.decode.pool.num_used == 3  # still held: a write of the room could land
    pair.clock.advance(pair.kv_config.quarantine_timeout + 1)
    pair.run(lambda: not pair.decode.quarantine, prefill=False)
    assert pair.decode.pool.num_used == 0 and not pair.decode.scheduler.held_pages
    pair.settle()


def test_first_token_and_logprobs_come_through_the_aux_slot(pair):
    prompt = list(range(70, 79))
    pair.submit("lp", prompt, max_new=3, return_logprob=True, top_logprobs_num=2, stream=True)
    pair.run(pair.done("lp"))
    outs = pair.outputs["D:lp"]
    assert outs[0].new_token_ids == reference(prompt, 1) and len(outs[0].new_logprobs) == 1
    assert len(outs[0].new_top_logprobs[0]) == 2 and outs[0].new_top_logprobs[0][0][0] == outs[0].new_token_ids[0]
    assert pair.tokens("lp") == reference(prompt, 3)
    pair.settle()


def test_the_first_token_leaves_before_the_step_it_joins(pair):
    """A PD decode's first token came with the KV, from the prefill: the rank's loop ships it
    (``ship_early``) before the decode step the request joins, not with that step's outputs, which
    would add a decode step to the client's time to first token."""
    log = []
    pair.decode.ship_early = lambda outs: log.extend(("shipped", t) for o in outs for t in o.new_token_ids)
    forward = pair.decode.runner.forward

    def recorded(fb, *args, **kwargs):
        log.append(("forward", fb.num_tokens))
        return forward(fb, *args, **kwargs)

    pair.decode.runner.forward = recorded
    prompt = list(range(40, 49))
    pair.submit("early", prompt, max_new=3, stream=True)
    pair.run(pair.done("early"))
    assert log[0] == ("shipped", reference(prompt, 1)[0]) and log[1] == ("forward", 1)
    assert pair.tokens("early") == reference(prompt, 3)[1:]  # the others left with their steps
    pair.settle()
