"""KV control-plane authentication (``--disaggregation-auth-key-file``): a peer without the key, or
with a wrong one, registers nothing, starts no room and gets no write; its refusals are counted.

In one process: the real prefill and decode loops over the ``local`` backend (``loop_stand``), and
a hostile client speaking raw ZMQ and HTTP to them."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import msgspec
import pytest
import zmq
from support.loop_stand import PDPair, reference

import pdserve.kvtransfer.messages as m
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.messages import SchedulerStats
from pdserve.engine.kv_auth import AUTH_HEADER, AuthError, FrameAuth
from pdserve.kvtransfer.bootstrap_client import register_rank, route_url
from pdserve.kvtransfer.bootstrap_server import BootstrapServer
from pdserve.engine.kv_transfer_config import KVTransferConfig
from pdserve.kvtransfer.kv_poll import KVPoll

pytestmark = pytest.mark.timeout(30)

SECRET = b"correct horse battery staple 42, and more"
WRONG = b"an attacker's guess of the key, in 32+ bytes"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "kv.key"
    path.write_bytes(SECRET + b"\n")
    return str(path)


@pytest.fixture
def pair(key_file):
    p = PDPair(auth_key_file=key_file)
    yield p
    p.close()


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


class Intruder:
    """A control client that pushes frames to one KV manager's control endpoint."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"tcp://{endpoint}")
        self.pull = self.ctx.socket(zmq.PULL)
        self.endpoint = f"127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"

    def send(self, frame: bytes) -> None:
        self.push.send(frame)

    def received(self, timeout_ms: int = 300) -> list[bytes]:
        out = []
        while self.pull.poll(timeout_ms):
            out.append(self.pull.recv())
        return out

    def close(self) -> None:
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


def _register_pool(decode_kv, endpoint: str) -> m.RegisterPool:
    """A well-formed pool registration, as a decode rank would send (the intruder copies one)."""
    return m.RegisterPool(
        decode_id="intruder", endpoint=endpoint, backend="local", peer_info=decode_kv.engine.peer_info(),
        layout=decode_kv.layout, num_pages=decode_kv.pool.num_pages, page_bytes=decode_kv.page_bytes,
        k_addrs=decode_kv.k_addrs, v_addrs=decode_kv.v_addrs, aux_addr=decode_kv.aux_pool.base_addr,
        aux_slot_bytes=decode_kv.aux_pool.slot_bytes, aux_num_slots=decode_kv.aux_pool.num_slots,
    )


def test_frame_auth_refuses_tampering_a_wrong_key_old_frames_and_replays():
    now = [1000.0]
    a = FrameAuth(SECRET, "control", clock=lambda: now[0])
    b = FrameAuth(SECRET, "control", clock=lambda: now[0])
    frame = a.seal(b"payload")
    assert b.open(frame) == b"payload"
    with pytest.raises(AuthError, match="replayed"):
        b.open(frame)
    with pytest.raises(AuthError, match="bad authentication tag"):
        b.open(a.seal(b"payload")[:-1] + b"X")
    with pytest.raises(AuthError, match="bad authentication tag"):
        b.open(FrameAuth(WRONG, "control").seal(b"payload"))
    with pytest.raises(AuthError, match="bad authentication tag"):  # a bootstrap tag is no control tag
        b.open(FrameAuth(SECRET, "bootstrap", clock=lambda: now[0]).seal(b"payload"))
    with pytest.raises(AuthError, match="no authentication header"):
        b.open(m.encode(m.RoomClosed(1)))
    old = a.seal(b"late")
    now[0] += 31.0
    with pytest.raises(AuthError, match="replay window"):
        b.open(old)


def test_short_or_missing_key_file_is_a_config_error(tmp_path):
    short = tmp_path / "short.key"
    short.write_bytes(b"tiny")
    with pytest.raises(ValueError, match="at least 32 needed"):
        KVTransferConfig(auth_key_file=str(short))
    with pytest.raises(ValueError, match="cannot be read"):
        KVTransferConfig(auth_key_file=str(tmp_path / "missing"))


def test_greedy_output_is_the_same_with_auth(pair):
    prompt = list(range(100, 111))
    pair.submit("a", prompt, max_new=5)
    pair.run(pair.done("a"))
    assert pair.tokens("a") == reference(prompt, 5)
    assert pair.prefill.kv.auth is not None and pair.prefill.kv.auth_refused == 0
    assert pair.decode.kv.auth_refused == 0
    pair.settle()


def test_intruder_without_the_key_registers_nothing_and_gets_nothing_written(pair):
    prefill_kv, decode_kv = pair.prefill.kv, pair.decode.kv
    room = pair.submit("victim", list(range(300, 309)), max_new=2, to="P")
    pair.step()
    sender = pair.prefill.bootstrap_queue.entries["victim"][1]
    intruder = Intruder(prefill_kv.endpoint)
    try:
        reg = _register_pool(decode_kv, intruder.endpoint)
        req = m.RoomRequest(room, "intruder", [1, 2, 3], 0)
        beat = m.Heartbeat("intruder", intruder.endpoint, 1)
        wrong = FrameAuth(WRONG, "control")
        for msg in (reg, req, beat):
            intruder.send(m.encode(msg))  # no key
            intruder.send(wrong.seal(m.encode(msg)))  # a wrong key
        _wait(lambda: prefill_kv.auth_refused == 6)
        for _ in range(20):
            pair.step()
        assert intruder.received() == []  # not even a HeartbeatAck or a RegisterAck
        assert "intruder" not in prefill_kv.decode_peers
        assert sender.poll() is KVPoll.Bootstrapping  # no destination reached the room
        assert pair.prefill.stats().kv_auth_refused == 6

        # a captured frame sent twice: the copy is refused
        sealed = FrameAuth(SECRET, "control").seal(m.encode(m.Heartbeat("intruder", intruder.endpoint, 2)),
                                                   intruder.endpoint, prefill_kv.endpoint)
        intruder.send(sealed)
        intruder.send(sealed)
        _wait(lambda: prefill_kv.auth_refused == 7)
        assert [type(m.decode(prefill_kv.auth.open(f, intruder.endpoint))) for f in intruder.received()] == [m.HeartbeatAck]
    finally:
        intruder.close()
    pair.prefill.abort("victim")
    pair.settle()


def test_forged_status_never_completes_a_decode_room(pair):
    room = pair.submit("d", list(range(400, 409)), max_new=2, to="D")
    pair.run(lambda: "d" in pair.decode.transfer and pair.decode.transfer.entries["d"][1].poll() is KVPoll.Transferring,
             prefill=False)
    receiver = pair.decode.transfer.entries["d"][1]
    intruder = Intruder(pair.decode.kv.endpoint)
    try:
        intruder.send(m.encode(m.RoomStatus(room, True)))
        intruder.send(FrameAuth(WRONG, "control").seal(m.encode(m.RoomStatus(room, True))))
        _wait(lambda: pair.decode.kv.auth_refused == 2)
        assert receiver.poll() is KVPoll.Transferring
    finally:
        intruder.close()
    pair.decode.abort("d")
    pair.run(lambda: pair.final("D", "d") is not None, prefill=False)


def _put(port: int, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(route_url("127.0.0.1", port), data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_bootstrap_put_without_the_key_is_refused_and_counted():
    metrics = ServerMetrics(1, "m")
    server = BootstrapServer("127.0.0.1", 0, auth=FrameAuth(SECRET, "bootstrap"),
                             on_refused=metrics.bootstrap_auth_refused.inc).start_in_thread()
    try:
        reg = m.RankRegistration(dp_rank=0, tp_rank=0, endpoint="127.0.0.1:5000", page_size=4, kv_dtype="float32",
                                 num_layers=2, num_kv_heads=1, head_dim=2, backend="local")
        body = msgspec.json.encode(reg)
        assert _put(server.port, body, {}) == 401
        wrong = FrameAuth(WRONG, "bootstrap").http_header("PUT", "/route", body)
        assert _put(server.port, body, {AUTH_HEADER: wrong}) == 401
        other = FrameAuth(SECRET, "bootstrap").http_header("PUT", "/route", b"{}")  # signed for another body
        assert _put(server.port, body, {AUTH_HEADER: other}) == 401
        assert server.refused == 3
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(route_url("127.0.0.1", server.port), timeout=5)
        assert e.value.code == 503  # nothing registered
        assert "pdserve_bootstrap_auth_refused_total 3.0" in metrics.render([None], [0])
        register_rank("127.0.0.1", server.port, reg, FrameAuth(SECRET, "bootstrap"))
        with urllib.request.urlopen(route_url("127.0.0.1", server.port), timeout=5) as resp:
            assert resp.status == 200
    finally:
        server.stop_thread()


def test_rank_refusals_reach_metrics():
    metrics = ServerMetrics(2, "m")
    stats = [SchedulerStats(dp_rank=r, num_running=0, num_waiting=0, num_free_pages=1, num_total_pages=2,
                            page_size=4, kv_auth_refused=3 * r) for r in range(2)]
    text = metrics.render(stats, [0, 0])
    assert 'pdserve_kv_auth_refused_total{model_name="m",dp_rank="1"} 3.0' in text


def test_tag_binds_sender_and_receiver():
    """A frame sealed for one receiver is refused by another; the sender it names is authenticated."""
    a = FrameAuth(SECRET, "control")
    frame = a.seal(b"payload", "10.0.0.1:5000", "10.0.0.2:6000")
    with pytest.raises(AuthError, match="sealed for another receiver"):
        FrameAuth(SECRET, "control").open(frame, "10.0.0.3:6000")
    assert FrameAuth(SECRET, "control").open_from(frame, "10.0.0.2:6000") == ("10.0.0.1:5000", b"payload")
    forged = frame.replace(b"10.0.0.1:5000", b"10.0.0.9:5000")  # another sender's name on the same tag
    with pytest.raises(AuthError, match="bad authentication tag"):
        FrameAuth(SECRET, "control").open(forged, "10.0.0.2:6000")


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_timestamp_is_refused(ts):
    frame = FrameAuth(SECRET, "control", clock=lambda: ts).seal(b"payload")  # a valid tag over the bad time
    with pytest.raises(AuthError, match="not a finite number"):
        FrameAuth(SECRET, "control").open(frame)


def test_rotation_accepts_the_previous_key_and_seals_with_the_current():
    old, new = SECRET, WRONG
    rotating = FrameAuth(new, "control", previous=old)
    assert rotating.open(FrameAuth(old, "control").seal(b"from a server still on the old key")) 
    assert rotating.open(FrameAuth(new, "control").seal(b"from a server on the new key"))
    assert FrameAuth(new, "control").open(rotating.seal(b"sealed with the current key"))
    with pytest.raises(AuthError, match="bad authentication tag"):
        FrameAuth(old, "control").open(rotating.seal(b"never with the previous key"))
    with pytest.raises(AuthError, match="bad authentication tag"):
        rotating.open(FrameAuth(b"a third key, unknown to the receiver!", "control").seal(b"x"))


def test_placeholder_and_short_keys_and_lone_previous_key_are_refused(tmp_path, key_file):
    placeholder = tmp_path / "placeholder.key"
    placeholder.write_bytes(b"replace-me-with-a-random-secret\n")
    with pytest.raises(ValueError, match="placeholder"):
        KVTransferConfig(auth_key_file=str(placeholder))
    short = tmp_path / "31.key"
    short.write_bytes(b"x" * 31)
    with pytest.raises(ValueError, match="31 bytes; at least 32 needed"):
        KVTransferConfig(auth_key_file=str(short))
    with pytest.raises(ValueError, match="at least 32 needed"):
        KVTransferConfig(auth_key_file=key_file, auth_previous_key_file=str(short))
    with pytest.raises(ValueError, match="needs auth_key_file"):
        KVTransferConfig(auth_previous_key_file=key_file)


def test_rotation_through_real_managers(tmp_path, key_file):
    """Mid-rotation: a prefill on the new key (the old one previous) pairs with a decode still sealing
    with the old key (the new one already accepted)."""
    new = tmp_path / "new.key"
    new.write_bytes(WRONG)
    pair = PDPair(auth_key_file=key_file)
    try:
        rotated = KVTransferConfig(backend="local", auth_key_file=str(new), auth_previous_key_file=key_file)
        pair.prefill.kv.auth = rotated.frame_auth("control")  # the prefill restarted on the new key
        pair.decode.kv.auth = KVTransferConfig(backend="local", auth_key_file=key_file,
                                               auth_previous_key_file=str(new)).frame_auth("control")
        prompt = list(range(100, 109))
        pair.submit("a", prompt, max_new=3)
        pair.run(pair.done("a"))
        assert pair.tokens("a") == reference(prompt, 3)
        assert pair.prefill.kv.auth_refused == 0 and pair.decode.kv.auth_refused == 0
        pair.settle()
    finally:
        pair.close()


def test_a_key_holder_cannot_name_a_third_party_reply_endpoint(pair):
    """A Heartbeat sealed by one endpoint naming another as where the ack goes is refused."""
    prefill_kv = pair.prefill.kv
    intruder = Intruder(prefill_kv.endpoint)
    try:
        beat = m.Heartbeat("intruder", "192.0.2.1:9", 1)  # a victim's endpoint as the reply address
        intruder.send(FrameAuth(SECRET, "control").seal(m.encode(beat), intruder.endpoint, prefill_kv.endpoint))
        _wait(lambda: prefill_kv.auth_refused == 1)
        assert "192.0.2.1:9" not in prefill_kv.open_endpoints
    finally:
        intruder.close()
