"""Two real processes, real page pools of the default model's KV shape, real engines."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import zmq

from peer_process import PeerProcess

from pdserve.kvtransfer.aux_pool import AuxPool

pytestmark = pytest.mark.timeout(120)

NUM_PAGES = 64
SRC_SEED = 1234
_rooms = itertools.count(1000)


class Pair:
    def __init__(self, backend: str, host: str = "127.0.0.1", p_netns=None, d_netns=None, env=None, spare=False):
        self.backend = backend
        self.host_p = host
        self.P = PeerProcess(p_netns, env)
        self.D = PeerProcess(d_netns, env)
        # a spare prefill process for the SIGKILL test, importing in parallel with the others
        self.victim = PeerProcess(p_netns, env) if spare else None
        self.cfg = {"backend": backend}

    def start(self, p_host="127.0.0.1", d_host="127.0.0.1"):
        self.host_p = p_host
        info = self.P.call("init", name="p", role="prefill", num_pages=NUM_PAGES, seed=SRC_SEED, cfg={**self.cfg, "host": p_host})
        self.bport, self.p_endpoint = info["bootstrap_port"], info["endpoint"]
        self.d_endpoint = self.D.call("init", name="d", role="decode", num_pages=NUM_PAGES, cfg={**self.cfg, "host": d_host})["endpoint"]
        return self

    def close(self):
        self.P.close()
        self.D.close()
        if self.victim is not None:
            self.victim.close()

    def open_room(self, dst, mgr="d"):
        room = next(_rooms)
        self.P.call("create_sender", mgr="p", room=room)
        self.D.call("create_receiver", mgr=mgr, room=room, host=self.host_p, port=self.bport)
        d = self.D.call("wait", room=room, states=["WaitingForInput", "Failed"])
        assert d["state"] == "WaitingForInput", d["reason"]
        self.D.call("recv_init", mgr=mgr, room=room, pages=dst)
        p = self.P.call("wait", room=room, states=["WaitingForInput", "Failed"])
        assert p["state"] == "WaitingForInput", p["reason"]
        return room

    def transfer(self, src, dst, chunks=1, aux=None):
        """One room: ``src`` pages here land in ``dst`` pages there, sent in ``chunks`` pieces."""
        self.D.call("clear", mgr="d")
        room = self.open_room(dst)
        bounds = [round(i * len(src) / chunks) for i in range(chunks + 1)]
        for i in range(chunks):
            last = i == chunks - 1
            self.P.call("send", room=room, pages=src[bounds[i] : bounds[i + 1]], is_last=last, aux=aux if last else None)
        p = self.P.call("wait", room=room, states=["Success", "Failed"])
        d = self.D.call("wait", room=room, states=["Success", "Failed"])
        assert (p["state"], d["state"]) == ("Success", "Success"), (p, d)
        untouched = sorted(set(range(NUM_PAGES)) - set(dst))
        check = self.D.call("verify", mgr="d", pairs=list(zip(dst, src)), untouched=untouched, src_seed=SRC_SEED, src_num_pages=NUM_PAGES)
        assert check == {"bad": [], "dirty": []}
        return room


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pair(request):
    pair = Pair(request.param, spare=True)
    try:
        yield pair.start()
    finally:
        pair.close()


def test_random_page_sets(pair):
    rng = random.Random(0)
    for n in (1, 7, 40):
        src = rng.sample(range(1, NUM_PAGES), n)
        dst = rng.sample(range(1, NUM_PAGES), n)
        pair.transfer(src, dst)
    # runs contiguous on both sides merge into one descriptor per layer per K/V
    pair.transfer(list(range(5, 25)), list(range(30, 50)))


def test_chunked_send_with_aux(pair):
    rng = random.Random(1)
    src = rng.sample(range(1, NUM_PAGES), 23)
    dst = rng.sample(range(1, NUM_PAGES), 23)
    aux = {"token_id": 4242, "logprob": -0.25, "top_ids": [4242, 7, 9], "top_logprobs": [-0.25, -1.5, -3.0],
           "cached_tokens": 48}
    room = pair.transfer(src, dst, chunks=4, aux=aux)
    assert pair.D.call("aux", room=room) == aux


def test_abort_from_decode(pair):
    room = pair.open_room([3, 4, 5])
    pair.D.call("abort", mgr="d", room=room, reason="client went away")
    p = pair.P.call("wait", room=room, states=["Failed"], timeout=10)
    assert p["state"] == "Failed" and "aborted by decode: client went away" in p["reason"]
    assert pair.D.call("poll", room=room)["state"] == "Failed"
    # the prefill closes the room (nothing in flight): the decode may reuse its pages
    assert pair.D.call("wait_closed", room=room) == {"closed": True}


def test_abort_from_prefill(pair):
    room = pair.open_room([3, 4, 5])
    pair.P.call("abort", mgr="p", room=room, reason="prefill OOM")
    d = pair.D.call("wait", room=room, states=["Failed"], timeout=10)
    assert d["state"] == "Failed" and "aborted by prefill: prefill OOM" in d["reason"]
    assert pair.D.call("wait_closed", room=room) == {"closed": True}


def test_abort_from_decode_while_chunks_in_flight(pair):
    """RoomClosed comes only once the chunks queued before the abort were written or dropped."""
    rng = random.Random(2)
    src = rng.sample(range(1, NUM_PAGES), 40)
    room = pair.open_room(rng.sample(range(1, NUM_PAGES), 40))
    for i in range(4):
        pair.P.call("send", room=room, pages=src[i * 10 : (i + 1) * 10], is_last=i == 3)
    pair.D.call("abort", mgr="d", room=room, reason="client went away")
    assert pair.D.call("wait_closed", room=room) == {"closed": True}
    assert pair.P.call("wait", room=room, states=["Success", "Failed"])["state"] in ("Success", "Failed")


def test_garbage_control_frames_are_rejected(pair):
    ctx = zmq.Context()
    try:
        for endpoint in (pair.p_endpoint, pair.d_endpoint):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"tcp://{endpoint}")
            for frame in (b"", b"\xff\x00garbage", b"\x82\xa4type\xabRoomRequest\xa4ro"):  # last: truncated
                sock.send(frame)
            sock.close()
    finally:
        ctx.term()
    time.sleep(0.2)
    pair.transfer([1, 2, 3], [9, 8, 7])  # both control threads survived


def test_page_size_mismatch_fails_with_message(pair):
    pair.D.call("init", name="d32", role="decode", num_pages=16, page_size=32, cfg=pair.cfg)
    room = next(_rooms)
    pair.P.call("create_sender", mgr="p", room=room)
    pair.D.call("create_receiver", mgr="d32", room=room, host=pair.host_p, port=pair.bport)
    d = pair.D.call("wait", room=room, states=["Failed"], timeout=10)
    assert d["state"] == "Failed" and "page_size: 16 vs 32" in d["reason"], d
    # the prefill side learns it too instead of waiting out bootstrap_timeout
    p = pair.P.call("wait", room=room, states=["Failed"], timeout=10)
    assert p["state"] == "Failed" and "page_size" in p["reason"], p


def test_killed_sender_fails_receiver_rooms_within_heartbeat_window(pair):
    interval, max_failures = 0.5, 2
    pair.D.call("init", name="hb", role="decode", num_pages=NUM_PAGES,
                cfg={**pair.cfg, "heartbeat_interval": interval, "heartbeat_max_failures": max_failures})
    victim = pair.victim
    try:
        bport = victim.call("init", name="p", role="prefill", num_pages=NUM_PAGES, cfg=pair.cfg)["bootstrap_port"]
        rooms = [next(_rooms), next(_rooms)]
        for room in rooms:
            victim.call("create_sender", mgr="p", room=room)
            pair.D.call("create_receiver", mgr="hb", room=room, host="127.0.0.1", port=bport)
            assert pair.D.call("wait", room=room, states=["WaitingForInput"])["state"] == "WaitingForInput"
            pair.D.call("recv_init", mgr="hb", room=room, pages=[1, 2])
            assert victim.call("wait", room=room, states=["WaitingForInput"])["state"] == "WaitingForInput"
        killed_at = time.monotonic()  # CLOCK_MONOTONIC is shared by the processes of this host
        victim.sigkill()
        for room in rooms:
            d = pair.D.call("wait", room=room, states=["Failed"], timeout=10)
            assert d["state"] == "Failed" and "no heartbeat reply" in d["reason"], d
            assert d["t"] - killed_at <= interval * max_failures + 1.0, d["t"] - killed_at
    finally:
        victim.close()


def test_timeouts(pair):
    # a second pair of managers in the same processes, with short timeouts
    # (only the timeout under test is short: a loaded host may take longer than 0.5 s to bootstrap)
    bport = pair.P.call("init", name="p_short", role="prefill", num_pages=8,
                        cfg={**pair.cfg, "bootstrap_timeout": 0.5})["bootstrap_port"]
    pair.D.call("init", name="d_short", role="decode", num_pages=8, cfg={**pair.cfg, "waiting_timeout": 0.5})
    room = next(_rooms)
    pair.P.call("create_sender", mgr="p_short", room=room)  # no decode side ever comes
    p = pair.P.call("wait", room=room, states=["Failed"], timeout=10)
    assert p["state"] == "Failed" and "bootstrap_timeout" in p["reason"], p
    room = next(_rooms)  # the decode side sends its destination, the prefill side never sends
    pair.D.call("create_receiver", mgr="d_short", room=room, host="127.0.0.1", port=bport)
    pair.D.call("recv_init", mgr="d_short", room=room, pages=[1, 2])
    d = pair.D.call("wait", room=room, states=["Failed"], timeout=10)
    assert d["state"] == "Failed" and "waiting_timeout" in d["reason"], d


def test_prefill_validates_registrations_and_destinations(pair):
    """Speak the control protocol directly: a bad pool is rejected with the reason; page
    indices outside the registered pool abort the room (never trusted as addresses)."""
    from pdserve.kvtransfer import messages as m

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://{pair.p_endpoint}")
    me = f"127.0.0.1:{port}"

    def reg(decode_id, page_size):
        layout = m.LayoutInfo(30, page_size, 3, 64, "bfloat16")
        return m.RegisterPool(decode_id, me, pair.backend, b"127.0.0.1:1" if pair.backend == "mooncake" else b"",
                              layout, 16, page_size * 3 * 64 * 2, [4096] * 30, [4096] * 30, 4096, AuxPool(1).slot_bytes, 4)

    def recv():
        assert pull.poll(10000), "no reply from prefill"
        return m.decode(pull.recv())

    try:
        push.send(m.encode(reg("fake-decode-32", 32)))
        ack = recv()
        assert isinstance(ack, m.RegisterAck) and not ack.ok and "page_size: 16 vs 32" in ack.reason, ack
        if pair.backend == "mooncake":  # a nixl pool needs real agent metadata; mooncake only a session id
            push.send(m.encode(reg("fake-decode-16", 16)))
            ack = recv()
            assert isinstance(ack, m.RegisterAck) and ack.ok, ack
            room = next(_rooms)
            push.send(m.encode(m.RoomRequest(room, "fake-decode-16", [1, 99], 0)))
            abort = recv()
            assert isinstance(abort, m.AbortRoom) and abort.room == room and "outside decode pool" in abort.reason
            push.send(m.encode(m.RoomRequest(room + 1, "fake-decode-16", [0], 0)))  # page 0 is scratch
            assert "outside decode pool" in recv().reason
            push.send(m.encode(m.RoomRequest(room + 2, "fake-decode-16", [1], 9)))
            assert "aux slot 9" in recv().reason
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_concurrent_rooms_interleaved_chunks(pair):
    pair.D.call("clear", mgr="d")
    rng = random.Random(3)
    src_all = rng.sample(range(1, NUM_PAGES), 48)
    dst_all = rng.sample(range(1, NUM_PAGES), 48)
    rooms = []
    for i in range(4):  # four rooms open at once, 12 pages each, disjoint destinations
        src, dst = src_all[i * 12 : (i + 1) * 12], dst_all[i * 12 : (i + 1) * 12]
        rooms.append((pair.open_room(dst), src, dst))
    for half in (0, 1):  # first halves of every room, then the last halves
        for room, src, _ in rooms:
            pair.P.call("send", room=room, pages=src[half * 6 : (half + 1) * 6], is_last=bool(half),
                        aux={"token_id": room % 1000, "logprob": 0.0, "top_ids": [], "top_logprobs": []} if half else None)
    for room, _, _ in rooms:
        assert pair.D.call("wait", room=room, states=["Success", "Failed"])["state"] == "Success"
        assert pair.D.call("aux", room=room)["token_id"] == room % 1000
    untouched = sorted(set(range(NUM_PAGES)) - set(dst_all))
    check = pair.D.call("verify", mgr="d", pairs=list(zip(dst_all, src_all)), untouched=untouched,
                        src_seed=SRC_SEED, src_num_pages=NUM_PAGES)
    assert check == {"bad": [], "dirty": []}
