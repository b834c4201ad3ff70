"""The prefill loop's states with a real decode loop in the same process (``local`` transfers):
chunked sends, admission under a full pool, aborts, failed rooms, the bootstrap timeout.
Both pools are checked after every step (``PDPair.step``)."""

from __future__ import annotations

import pytest
from support.loop_stand import PDPair, reference

from pdserve.engine.sched.request import ReqStatus
from pdserve.kvtransfer.kv_poll import KVPoll

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair(request):
    kw = getattr(request, "param", {})
    p = PDPair(**kw)
    yield p
    p.close()


def test_one_request_end_to_end(pair):
    prompt = list(range(100, 111))  # 11 tokens: 3 pages
    pair.submit("a", prompt, max_new=5)
    pair.run(pair.done("a"))
    p, d = pair.final("P", "a"), pair.final("D", "a")
    assert (p.finish_reason, p.new_token_ids) == ("length", reference(prompt, 1))
    assert d.finish_reason == "length" and pair.tokens("a") == reference(prompt, 5)
    pair.settle()


@pytest.mark.parametrize("pair", [{"p_engine": {"chunked_prefill_size": 8}}], indirect=True)
def test_chunks_leave_while_the_next_one_computes(pair):
    prompt = list(range(200, 230))  # 30 tokens: chunks of 8 -> 4 prefill steps, 8 pages
    pair.submit("long", prompt, max_new=3)
    pair.run(lambda: "long" in pair.prefill.senders and pair.prefill.senders["long"].poll() is KVPoll.WaitingForInput,
             decode=True)
    sender = pair.prefill.senders["long"]
    sent = []
    while "long" in pair.prefill.senders:
        pair.step()
        sent.append(sender.pages_sent)
    # the first chunk computed as the request joined; each later step first queues the pages the
    # previous chunk completed (2, 4, then 6), then computes; the last step also sends the rest (8)
    assert sent == [2, 4, 8] and sender.last_sent
    pair.run(pair.done("long"))
    assert pair.tokens("long") == reference(prompt, 3)  # every chunk landed in the right pages
    pair.settle()


@pytest.mark.parametrize("pair", [{"p_pages": 9, "p_engine": {"num_reserved_decode_tokens": 0}}], indirect=True)
def test_admission_under_a_full_prefill_pool(pair):
    # 8 usable pages; each prompt takes 3: at most 2 in the prefill pool at once, FIFO
    prompts = {f"r{i}": [i + 1] * 10 for i in range(5)}
    for rid, prompt in prompts.items():
        pair.submit(rid, prompt, max_new=2)
    most = 0

    def watch():
        nonlocal most
        held = [r for r in pair.prefill.scheduler.reqs.values() if r.pages]
        most = max(most, len(held))
        return all(pair.final(s, r) for r in prompts for s in "PD")

    pair.run(watch)
    assert most == 2
    for rid, prompt in prompts.items():
        assert pair.tokens(rid) == reference(prompt, 2)
    pair.settle()


@pytest.mark.parametrize("pair", [{"p_engine": {"chunked_prefill_size": 8}}], indirect=True)
def test_abort_on_the_prefill_side_in_each_state(pair):
    # waiting for the decode's destination (the decode has not seen the request yet)
    pair.submit("boot", [1, 2, 3], to="P")
    pair.step()
    assert "boot" in pair.prefill.bootstrap_queue
    assert pair.prefill.abort("boot", "client left")
    pair.run(pair.done("boot", sides="P"))
    assert pair.final("P", "boot").finish_reason == "abort"
    # prefilling: one chunk of a long prompt computed (its pages maybe sent), more to come
    pair.submit("chunked", list(range(1, 31)), max_new=4)
    pair.run(lambda: pair.prefill.scheduler.chunked is not None)
    assert pair.prefill.abort("chunked", "shutting down")
    pair.run(pair.done("chunked"))
    assert pair.final("P", "chunked").finish_reason == "abort"
    d = pair.final("D", "chunked")
    assert d.finish_reason == "error" and "aborted by prefill: shutting down" in d.error
    pair.settle()  # a chunk's pages written before the abort: quarantined, then released by RoomClosed


def test_decode_abort_fails_the_prefill_room(pair):
    prompt = list(range(40, 50))
    pair.submit("x", prompt, max_new=4)
    # the decode has preallocated and sent the destination; then the client goes away at the decode
    pair.run(lambda: "x" in pair.decode.transfer, prefill=False)
    assert pair.decode.abort("x", "client left")
    sender = pair.prefill.bootstrap_queue.entries["x"][1]
    pair.run(lambda: sender.poll() is KVPoll.Failed, prefill=False)  # the AbortRoom arrived
    pair.run(pair.done("x"))
    assert pair.final("D", "x").finish_reason == "abort"
    p = pair.final("P", "x")
    assert p.finish_reason == "error" and "aborted by decode" in p.error
    pair.settle()  # the decode's quarantine was released by the prefill's RoomClosed


def test_a_decode_abort_before_the_prefill_saw_the_room_fails_it_at_once(pair):
    prompt = list(range(70, 80))
    room = pair.submit("early", prompt, max_new=4, to="D")
    # the destination went to the prefill, which has no sender for the room yet; the client leaves
    pair.run(lambda: "early" in pair.decode.transfer, prefill=False)
    assert pair.decode.abort("early", "client left")
    pair.run(lambda: not pair.decode.has_work(), prefill=False)  # the prefill's RoomClosed released it
    # the prefill request comes late: it fails at once, without prefilling, not after bootstrap_timeout
    pair.submit("early", prompt, max_new=4, to="P", room=room)
    pair.run(pair.done("early", sides="P"), decode=False)
    p = pair.final("P", "early")
    assert p.finish_reason == "error" and "aborted by decode: client left" in p.error, p.error
    pair.settle()


def test_a_failed_write_fails_the_room_on_both_sides(pair):
    # the decode's V buffer of the last layer is no longer registered: the write is refused
    d_kv = pair.decode.kv
    v_last = d_kv.pool.buffer_infos()[-1].base_addr
    d_kv.engine.deregister(v_last)
    pair.submit("f", list(range(60, 70)), max_new=4)
    pair.run(pair.done("f"))
    p, d = pair.final("P", "f"), pair.final("D", "f")
    assert p.finish_reason == "error" and "not registered" in p.error
    assert d.finish_reason == "error" and "KV transfer failed" in d.error
    pair.settle()
    d_kv.engine.register(v_last, d_kv.pool.buffer_infos()[-1].nbytes)  # so close() can deregister it


def test_bootstrap_timeout_on_the_injected_clock(pair):
    pair.submit("lonely", [5, 6, 7], to="P")  # no decode ever asks for this room
    for _ in range(20):
        pair.step()
    assert pair.final("P", "lonely") is None
    assert pair.prefill.bootstrap_queue.entries["lonely"][0].status == ReqStatus.WAITING_FOR_BOOTSTRAP
    pair.clock.advance(pair.kv_config.bootstrap_timeout + 1)
    pair.run(pair.done("lonely", sides="P"))
    p = pair.final("P", "lonely")
    assert p.finish_reason == "error" and "bootstrap_timeout" in p.error
    pair.settle()


def test_a_destination_after_the_room_timed_out_fails_the_decode_at_once(pair):
    room = pair.submit("late", [5, 6, 7], to="P")
    pair.step()
    pair.clock.advance(pair.kv_config.bootstrap_timeout + 1)
    pair.run(pair.done("late", sides="P"))
    assert "bootstrap_timeout" in pair.final("P", "late").error
    # the decode's destination comes after that: it fails now, not after its waiting_timeout, and its
    # pages leave quarantine on the prefill's RoomClosed (nothing was written to them)
    pair.submit("late", [5, 6, 7], to="D", room=room)
    pair.run(pair.done("late", sides="D"), prefill=False)
    d = pair.final("D", "late")
    assert d.finish_reason == "error" and "aborted by prefill: no destination from decode within bootstrap_timeout" in d.error
    pair.settle()


def test_max_new_tokens_zero_closes_the_room(pair):
    pair.submit("z", list(range(1, 6)), max_new=0, to="P")
    pair.submit("z", list(range(1, 6)), max_new=1, to="D", room=pair.prefill.bootstrap_queue.entries["z"][1].room)
    pair.run(pair.done("z"))
    assert pair.final("P", "z").finish_reason == "length"
    assert pair.final("D", "z").finish_reason == "error"
    pair.settle()


@pytest.mark.parametrize("pair", [{"p_engine": {"chunked_prefill_size": 8}}], indirect=True)
def test_decode_abort_stops_a_prefill_between_chunks(pair):
    pair.submit("mid", list(range(1, 31)), max_new=4)
    pair.run(lambda: pair.prefill.scheduler.chunked is not None)
    sender = pair.prefill.senders["mid"]
    assert pair.decode.abort("mid", "client left")
    pair.run(lambda: sender.poll() is KVPoll.Failed, prefill=False)
    pair.step()  # the prefill sees the failed room before computing the next chunk
    assert "mid" not in pair.prefill.scheduler.reqs and pair.prefill.scheduler.chunked is None
    pair.run(pair.done("mid"))
    p = pair.final("P", "mid")
    assert p.finish_reason == "error" and "aborted by decode: client left" in p.error
    pair.settle()
